"""The private Trainer's captured step (``PrivacyArguments.capture_step``).

A micro-batch's forward, backward and clipping run as :func:`dptorch.capture_step`'s graph: traced once per
batch shape under the batch tracker (the same rules as an eager step, the trainer's own ``compute_loss`` and
loss recipe), compiled when ``TrainingArguments.torch_compile`` is set, and replayed while its guards hold.
The DP optimizer's step (noise, accounting, update) is the eager one's. ``capture_step=None`` (the default)
captures when ``torch_compile=True`` and the set-up allows it; a step that does not trace then warns once and
the run goes on eagerly (the eager step is the proven one, so nothing changes but speed). ``True`` refuses a
set-up it cannot capture, before training, and a step that does not trace.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Dict, List, Optional, Union

import torch

from dptorch.optim.captured_step import CAPTURED_MODES, CUDA_GRAPH_MODES, CaptureRefused, CapturedStep


class TrainerCapture:
    """Whether and how a private trainer captures its micro-batch steps."""

    def __init__(self, trainer: Any, required: bool) -> None:
        self.required = required
        self.compile = trainer_compile_options(trainer.args)
        privacy = trainer.privacy_args
        self.pad_to_multiple_of = privacy.capture_pad_to_multiple_of
        #: Micro-batches run as replays of this many rows: by default the micro-batch size the run was given, so
        #: one shape whatever the Poisson draw, and no replay larger than that (its memory).
        self.rows_per_replay = privacy.capture_rows_per_replay or (
            None if self.pad_to_multiple_of else trainer.args.per_device_train_batch_size)
        self._step: Optional[CapturedStep] = None
        #: Why the run went on eagerly (a step that did not trace, under capture_step=None), or None.
        self.gave_up: Optional[str] = None

    @classmethod
    def for_trainer(cls, trainer: Any) -> Optional["TrainerCapture"]:
        """The trainer's capture, or None for eager steps; ``capture_step=True`` with a set-up that cannot be
        captured raises ValueError naming why."""
        privacy = trainer.privacy_args
        wanted = privacy.capture_step
        if wanted is False:
            return None
        reasons = uncapturable(trainer) if wanted or trainer.args.torch_compile else ["torch_compile=False"]
        if reasons and wanted:
            raise ValueError("capture_step=True, but the captured step does not support " + "; ".join(reasons)
                             + ": leave capture_step unset (None) or False for eager steps")
        if reasons and (privacy.capture_pad_to_multiple_of or privacy.capture_rows_per_replay):
            warnings.warn("capture_pad_to_multiple_of and capture_rows_per_replay shape the captured step's batches, "
                          f"but this run steps eagerly ({'; '.join(reasons)}): they are not used", stacklevel=3)
        return None if reasons else cls(trainer, required=bool(wanted))

    def run(self, trainer: Any, model: Any, inputs: Dict[str, Any]) -> Optional[torch.Tensor]:
        """One micro-batch's captured forward, backward and clipping; its loss, or None where the step is to run
        eagerly (a step that did not trace, under ``capture_step=None``)."""
        if self.gave_up is not None:
            return None
        model.train()
        inputs = trainer._prepare_inputs(inputs)
        try:
            if self._step is None:
                self._step = CapturedStep(trainer._dp_optimizer(), partial(_loss, trainer), compile=self.compile,
                                          pad_to_multiple_of=self.pad_to_multiple_of,
                                          rows_per_replay=self.rows_per_replay)
            with trainer.compute_loss_context_manager():
                return self._step(inputs).detach()
        except CaptureRefused as error:  # raised before anything was kept: the eager step runs this micro-batch
            if self.required:
                raise
            self.gave_up = str(error)
            warnings.warn(f"the private trainer runs its steps eagerly: {error}", stacklevel=2)
            return None

    @property
    def traces(self) -> int:
        """How many batch shapes (or changed models) were traced so far."""
        return 0 if self._step is None else self._step.traces


def uncapturable(trainer: Any) -> List[str]:
    """The trainer's settings a captured step does not reproduce (the optimizer's own are checked at its first
    step): each named."""
    args, privacy = trainer.args, trainer.privacy_args
    reasons = []
    if trainer.grad_sample_mode not in CAPTURED_MODES:
        reasons.append(f"grad_sample_mode {trainer.grad_sample_mode!r} (captured: {', '.join(CAPTURED_MODES)})")
    if privacy.clipping == "per_layer":
        reasons.append("clipping='per_layer'")
    if args.world_size > 1 or getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        reasons.append("several processes, DeepSpeed or FSDP")
    if args.fp16:
        reasons.append("fp16 loss scaling")
    if privacy.privacy_unit_column is not None or not trainer.privacy_units.trivial or trainer._dp_recipe.rows_per_example != 1:
        reasons.append("privacy units of several rows (privacy_unit_column, preference pairs)")
    if trainer.dp_hooks.unit_kind == "tokens" or getattr(args, "packing", False):
        reasons.append("examples packed in rows")
    if trainer._dp_physical is not None:
        reasons.append("auto_find_batch_size")
    if trainer._dp_neftune is not None:
        reasons.append("NEFTune")
    if args.torch_compile and args.torch_compile_mode in CUDA_GRAPH_MODES:
        reasons.append(f"torch_compile_mode={args.torch_compile_mode!r} (CUDA graphs)")
    return reasons


def trainer_compile_options(args: Any) -> Union[bool, Dict[str, Any]]:
    """``torch.compile``'s keyword arguments from ``TrainingArguments`` (backend, mode), or False (no
    ``torch_compile``: the captured graph replays uncompiled)."""
    if not args.torch_compile:
        return False
    options = {"backend": args.torch_compile_backend or "inductor"}
    return {**options, "mode": args.torch_compile_mode} if args.torch_compile_mode else options


def _loss(trainer: Any, batch: Dict[str, Any]) -> torch.Tensor:
    """A micro-batch's loss as the trainer computes it: each row's own (so that the step reports the real rows' sum
    when it pads), or the recipe's sum where it has no rows to show."""
    losses = trainer._dp_recipe.row_losses(trainer, trainer.model, dict(batch))
    return losses if losses is not None else trainer.compute_loss(trainer.model, batch)

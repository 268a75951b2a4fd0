"""DPCallback: DP-SGD for a plain ``transformers.Trainer`` through its callbacks.

For code that cannot swap its Trainer class for :class:`~dptorch.integrations.hf.DPTrainer` (or
``private(cls)``): ``Trainer(..., callbacks=[DPCallback(privacy_args)])``. At ``on_train_begin``
the callback attaches a :class:`~dptorch.grad_sample.GradSampleHooks` controller to the model,
puts a :class:`~dptorch.optim.DPOptimizer` under Accelerate's optimizer wrapper (clip after every
backward, Gaussian noise once per optimizer step, accounting in a
:class:`~dptorch.plan.PrivacyPlan`), and makes the model's training loss the sum of per-sample
losses (labels are taken from the model call and each row's loss is computed from the outputs, as
DPTrainer's default recipe does). At ``on_train_end`` all of it is removed again.

What a callback cannot do, and how each gap is handled (the same list is in
``docs/migrating-from-opacus.md``, section dp-transformers):

1. **Sampling.** The Trainer has built its loader (shuffled, fixed-size batches) before any
   callback runs, and its training step cannot take the empty batches Poisson sampling draws. Its
   shuffled batches (torch's ``BatchSampler`` over a random permutation per epoch, or in order) are
   accounted as ``make_private(poisson_sampling=False)`` accounts them (:mod:`dptorch.data.shuffled`):
   each epoch is one pass, one Gaussian of ``noise_multiplier / 2`` at sample rate 1, nothing
   amplified (a proven, much larger epsilon, reported as ``epsilon``); every training forward is
   handed to the plan with its epoch's pass, so a step holding micro-batches of two epochs would be
   refused. Any other sampler is refused, unless ``allow_shuffled_batches=True``: then it trains
   and reports ``epsilon_if_poisson``, the epsilon the same steps would have if each batch had
   been a Poisson sample of rate ``q = per_device_train_batch_size * gradient_accumulation_steps
   / len(train_dataset)``. That number is *not* a guarantee for the batches actually used
   (shuffling can leak more). A loader whose batch sampler is a dptorch Poisson sampler is
   accounted exactly and reported as ``epsilon``, provided it draws once per optimizer step: a
   ``PoissonBatchSampler`` needs ``gradient_accumulation_steps=1`` (each of its batches is a draw),
   a ``PoissonMicroBatchSampler`` ``micro_batches == gradient_accumulation_steps``; anything else
   is refused at ``on_train_begin``. The plan's draw ledger then checks every step as the engine
   does: the sampler reports each draw as it yields it, the callback hands it to the plan at the
   training forward that consumes it, and a step fed by several draws, or whose backward passes saw
   another number of rows than its draw (a collator that adds rows), is refused before it changes
   anything.
2. **Loss.** It sees the loss only through the model call. A ``compute_loss_func`` and label
   smoothing take the labels away from the model: refused (the first training forward without
   labels raises). An encoder-decoder model (T5, BART) gets its decoder inputs as in DPTrainer: the
   collator's ``decoder_input_ids``, else each row's own labels shifted by the model, row by row; labels
   padded with a token instead of -100 are refused at ``on_train_begin``. A Trainer subclass whose ``compute_loss`` recomputes the loss from the outputs
   (TRL's trainers) cannot be detected: use ``private(cls)`` for those. The logged ``loss`` is the
   sum over a micro-batch's rows.
3. **Privacy units.** One row is one unit; ``privacy_unit_column`` is refused.
4. **Resuming.** The Trainer restores callback state only into a new object and only with
   ``restore_callback_states_from_checkpoint``; resuming (``global_step > 0`` at the start) is
   refused, since epsilon would restart at 0.
5. **Logs.** ``epsilon`` goes into ``trainer.state.log_history`` and the logs of callbacks that
   run after this one; reporting integrations (``report_to``) run before it and do not see it.
   The Trainer's ``grad_norm`` is that of the raw gradient, which is never formed here (0).
6. The set-ups DPTrainer refuses (DeepSpeed, Liger, LOMO optimizers, length-grouped sampling) are
   refused here too (``torch_compile`` is not: the private forwards run eagerly), and so are several processes and
   FSDP, which DPTrainer supports (DDP, FSDP2) and the callback does not; NEFTune, which DPTrainer runs with
   each sample's own length (the callback cannot keep transformers' hook off); and fp16, which DPTrainer
   trains with a ``DPGradScaler`` (the callback does not replace Accelerate's GradScaler); so is
   ``noise_mechanism="bandmf"`` (it needs cyclic Poisson sampling the callback cannot impose).
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections import deque
from typing import Any, Deque, Dict, List, Optional

import torch
from transformers import TrainerCallback

from dptorch.data.poisson import PoissonBatchSampler
from dptorch.data.shuffled import permutation_problem
from dptorch.distributed.agreement import check_ranks_agree
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.modes.auto import resolve_grad_sample_mode
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.integrations.hf.arguments import PrivacyArguments
from dptorch.integrations.hf.budget import PrivacyBudget, PrivacyBudgetCallback
from dptorch.integrations.hf.loss_recipes import is_causal_lm
from dptorch.grad_sample.units.per_sample_losses import (PerSampleLoss, check_label_padding, check_per_sample_losses,
                                                         default_per_sample_loss, with_loss)
from dptorch.integrations.hf.sampling import PoissonMicroBatchSampler
from dptorch.integrations.hf.seq2seq import check_decoder_inputs_buildable, is_encoder_decoder, with_decoder_inputs
from dptorch.noise import NoiseGenerator
from dptorch.optim.optimizer import DPOptimizer
from dptorch.plan import PrivacyPlan
from dptorch.accounting.report import privacy_report

#: Log key of the epsilon reported for shuffled batches (a Poisson assumption, not a guarantee).
EPSILON_IF_POISSON = "epsilon_if_poisson"


class DPCallback(TrainerCallback):
    """DP-SGD for a plain ``transformers.Trainer``; see the module docstring for what it cannot guarantee.

    ``privacy_args``: a :class:`PrivacyArguments` (noise or target epsilon, clipping, accountant,
    delta). ``per_sample_loss_func``: ``fn(outputs, labels) -> one loss per row`` (default: each
    row's token-mean cross-entropy for language models, the row's loss for classifiers).
    ``allow_shuffled_batches``: train on the Trainer's shuffled batches and report
    ``epsilon_if_poisson`` (see item 1 of the module docstring) instead of refusing.
    """

    def __init__(
        self,
        privacy_args: PrivacyArguments,
        *,
        per_sample_loss_func: Optional[PerSampleLoss] = None,
        allow_shuffled_batches: bool = False,
    ) -> None:
        if not isinstance(privacy_args, PrivacyArguments):
            raise TypeError(f"DPCallback needs a PrivacyArguments, got {type(privacy_args).__name__}")
        if privacy_args.privacy_unit_column is not None:
            raise ValueError(
                "DPCallback cannot group rows into privacy units (it cannot change how the Trainer samples); use "
                "DPTrainer or private(cls) with privacy_unit_column, or leave it unset (one row per unit)"
            )
        if privacy_args.noise_mechanism != "independent":
            raise ValueError(
                f"DPCallback adds independent noise only, not noise_mechanism={privacy_args.noise_mechanism!r}: banded "
                "noise needs cyclic Poisson sampling over b partitions, which a callback cannot give the Trainer's "
                "sampler; use DPTrainer or private(cls) with noise_mechanism='bandmf', or leave it 'independent'"
            )
        self.privacy_args = privacy_args
        self.per_sample_loss_func = per_sample_loss_func
        self.allow_shuffled_batches = allow_shuffled_batches
        self.plan: Optional[PrivacyPlan] = None
        self.budget: Optional[PrivacyBudget] = None
        self.hooks: Optional[GradSampleHooks] = None
        self.optimizer: Optional[DPOptimizer] = None
        self.poisson: Optional[bool] = None
        self.grad_sample_mode: Optional[str] = None  # the mode that runs ("auto" resolved at train begin)
        self._budget_callback: Optional[PrivacyBudgetCallback] = None
        self._holder: Any = None
        self._model: Any = None
        self._loss_hooks: List[Any] = []
        self._labels: List[Any] = []
        self._sampler: Any = None  # the dptorch Poisson sampler of the Trainer's loader (Poisson batches only)
        self._yielded: Deque[Optional[int]] = deque()  # per micro-batch it yielded: the rows of the draw it opens
        self._pass: Optional[int] = None  # shuffled batches: the pass (epoch) the training forwards belong to
        self._pass_begun = False  # whether a forward of that pass reached the plan

    # ------------------------------------------------------------------ privacy state

    @property
    def epsilon_key(self) -> str:
        """``"epsilon"`` for Poisson and per-pass accounted batches, ``"epsilon_if_poisson"`` for the others."""
        return "epsilon" if self._proven else EPSILON_IF_POISSON

    @property
    def _proven(self) -> bool:
        return bool(self.poisson) or (self.plan is not None and self.plan.shuffled)

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """The accountant's epsilon so far (for shuffled batches: under the Poisson assumption)."""
        if self.plan is None:
            return 0.0
        return self.plan.epsilon(self.privacy_args.target_delta if delta is None else delta)

    def privacy_report(self) -> Dict[str, Any]:
        """The plan's report, saying how the batches were really sampled."""
        if self.plan is None:
            raise RuntimeError("nothing to report before training started")
        report = privacy_report(self.plan, self.privacy_args.target_delta,
                                grad_sample_mode=self.grad_sample_mode, privacy_unit="row")
        if not self._proven:
            report[EPSILON_IF_POISSON] = report.pop("epsilon")
            report["sampling"] = "shuffled fixed-size batches (the Trainer's)"
            report["note"] = (
                f"{EPSILON_IF_POISSON} is the epsilon of the same steps under Poisson sampling at this sample_rate; "
                "the batches were shuffled fixed-size batches, for which it is not a proven bound"
            )
        return report

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        _refuse_setups(args, state)
        if model is None or optimizer is None or train_dataloader is None:
            raise RuntimeError("DPCallback needs the Trainer's model, optimizer and train dataloader at on_train_begin")
        if self.plan is None:
            self._build_plan(args, state, train_dataloader)
        elif self._sampling_of(args, train_dataloader)[:2] != (self.plan.sample_rate, self.plan.num_units):
            raise ValueError("the train dataset or batch size changed since the last train(): the plan no longer holds")
        sampler = _poisson_sampler(train_dataloader) if self.poisson else None
        if sampler is not None:
            _check_one_draw_per_step(sampler, args.gradient_accumulation_steps)
        check_label_padding(_collator_of(train_dataloader))
        self._attach(args, model, optimizer)
        if sampler is not None:  # the draw ledger: the sampler tells of its draws, the training forwards consume them
            self._yielded.clear()
            sampler.listener = self._yielded.append
            self._sampler = sampler
        self._budget_callback.on_train_begin(args, state, control)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._pass, self._pass_begun = secrets.randbits(62), False  # a new iteration of the Trainer's loader

    def on_step_end(self, args, state, control, **kwargs):
        if self._budget_callback is not None:
            self._budget_callback.on_step_end(args, state, control)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.plan is None or logs is None or any(str(k).startswith(("eval_", "test_")) for k in logs):
            return
        epsilon = self.budget.epsilon()
        logs[self.epsilon_key] = epsilon
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1][self.epsilon_key] = epsilon

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()

    def detach(self) -> None:
        """Remove the controller, the loss hooks and the DP optimizer; the plan (and epsilon) stays."""
        for handle in self._loss_hooks:
            handle.remove()
        self._loss_hooks = []
        if self._sampler is not None:
            self._sampler.listener = None
        self._sampler = None
        self._yielded.clear()
        if self.optimizer is not None:
            self.optimizer.detach()
            if self._holder is not None and self._holder.optimizer is self.optimizer:
                self._holder.optimizer = self.optimizer.original_optimizer
        self.optimizer = self._holder = None
        if self.hooks is not None:
            self.hooks.cleanup()
        self.hooks = self._model = None

    # ------------------------------------------------------------------ set-up

    def _sampling_of(self, args: Any, loader: Any):
        """``(q, number of units, steps per epoch, Poisson?)`` of the Trainer's train loader."""
        sampler = _poisson_sampler(loader)
        if sampler is not None:
            logical = sampler.logical if isinstance(sampler, PoissonMicroBatchSampler) else sampler
            return logical.sample_rate, logical.num_samples, logical.steps, True
        dataset = getattr(loader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
            raise ValueError("DPCallback needs a map-style train_dataset with a length (the sample rate depends on it)")
        logical = args.per_device_train_batch_size * args.gradient_accumulation_steps
        steps = max(1, math.ceil(len(loader) / args.gradient_accumulation_steps))
        return min(1.0, logical / len(dataset)), len(dataset), steps, False

    def _build_plan(self, args: Any, state: Any, loader: Any) -> None:
        sample_rate, num_units, steps_per_epoch, poisson = self._sampling_of(args, loader)
        problem = None if poisson else permutation_problem(getattr(loader, "batch_sampler", None), num_units)
        shuffled = not poisson and problem is None and not self.allow_shuffled_batches
        if not poisson and problem is not None and not self.allow_shuffled_batches:
            raise ValueError(
                "DPCallback cannot replace the Trainer's sampler, and its batches are neither Poisson samples nor "
                f"passes over the data it can account ({problem}). Use DPTrainer or private(YourTrainer) (Poisson "
                "sampling, exact epsilon), or pass DPCallback(..., allow_shuffled_batches=True) to train anyway and "
                "report 'epsilon_if_poisson': the epsilon the same steps would have under Poisson sampling, which "
                "is not a guarantee for these batches"
            )
        p = self.privacy_args
        if p.target_delta >= 1 / num_units:
            raise ValueError(
                f"target_delta={p.target_delta:g} is not below 1/N for N={num_units} training rows; "
                "choose a smaller one"
            )
        options = p.clipping_options() if hasattr(p, "clipping_options") else {}
        fields = dict(sample_rate=sample_rate, steps_per_epoch=steps_per_epoch, num_units=num_units,
                      max_grad_norm=p.per_sample_max_grad_norm, clipping=p.clipping, accountant=p.accountant,
                      secure_mode=p.secure_mode, sampling="poisson" if poisson else ("shuffled" if shuffled else None),
                      track_draws=poisson or shuffled, **options)
        if shuffled:  # the loss is averaged over the logical batch the Trainer steps on
            fields["expected_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps
        if p.target_epsilon is not None:
            self.plan = PrivacyPlan.calibrated(target_epsilon=p.target_epsilon, target_delta=p.target_delta,
                                               steps=state.max_steps, **fields)
        else:
            if p.noise_multiplier == 0:
                warnings.warn("noise_multiplier=0: the training is not private (epsilon is infinite)", stacklevel=3)
            self.plan = PrivacyPlan(noise_multiplier=p.noise_multiplier, planned_steps=state.max_steps, **fields)
        check_ranks_agree(self.plan, loss_reduction="mean")  # several processes are refused above; a group set up by hand
        self.poisson = poisson
        self.budget = PrivacyBudget(plan=self.plan, delta=p.target_delta, cap=p.budget_cap)
        self._budget_callback = PrivacyBudgetCallback(self.budget)

    def _attach(self, args: Any, model: Any, optimizer: Any) -> None:
        holder = _optimizer_holder(optimizer)
        _check_optimizer_params(model, holder.optimizer)
        p = self.privacy_args
        encoder_decoder = is_encoder_decoder(model)
        if encoder_decoder:  # called without labels: the decoder inputs are built from each row's own labels
            check_decoder_inputs_buildable(model)
        causal = is_causal_lm(model)
        loss = self.per_sample_loss_func or default_per_sample_loss(
            causal, getattr(getattr(model, "config", None), "problem_type", None)
        )
        self.grad_sample_mode = resolve_grad_sample_mode(p.grad_sample_mode, model)
        hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=self.grad_sample_mode,
                                keep_param_grads=False)
        try:
            dp_optimizer = DPOptimizer(
                holder.optimizer, hooks=hooks, plan=self.plan, loss_reduction="mean",
                noise_generator=None if p.secure_mode else NoiseGenerator(seed=p.noise_seed, device=args.device),
                secure_mode=p.secure_mode,
            )
        except Exception:
            hooks.cleanup()
            raise
        holder.optimizer = dp_optimizer
        self.hooks, self.optimizer, self._holder, self._model = hooks, dp_optimizer, holder, model
        self._loss_hooks = [
            # an encoder-decoder model's decoder inputs are built before the controller's batch tracker starts (as
            # DPTrainer builds them before the call): the row-by-row shift is the loop's code, not the forward's
            model.register_forward_pre_hook(self._take_labels(causal, encoder_decoder), with_kwargs=True,
                                            prepend=encoder_decoder),
            model.register_forward_hook(self._summed_per_sample_loss(loss), with_kwargs=True),
        ]

    def _take_labels(self, causal: bool, encoder_decoder: bool = False):
        def hook(module, args, kwargs):
            if not (module.training and torch.is_grad_enabled()):
                self._labels.append(None)
                return None
            labels = kwargs.pop("labels", None)
            if labels is None:
                raise PerSampleGradientError(
                    "a training forward got no labels: the Trainer computes the loss outside the model "
                    "(compute_loss_func, label smoothing or a compute_loss override), where DPCallback cannot make it "
                    "a sum of per-sample losses. Use DPTrainer or private(YourTrainer)"
                )
            kwargs.pop("num_items_in_batch", None)  # the batch's token count couples the samples' losses
            if causal:
                kwargs["use_cache"] = False
            elif encoder_decoder:  # the collator's decoder_input_ids, else each row's labels shifted, row by row
                kwargs = with_decoder_inputs(module, kwargs, labels)
            if self._sampler is not None and self._yielded:  # the micro-batch this forward trains on, in order
                opened = self._yielded.popleft()
                if opened is not None:
                    self.plan.on_draw(opened)
            elif self.plan.shuffled:  # the micro-batch of this epoch's pass
                if self._pass is None:
                    raise RuntimeError("DPCallback: a training forward before on_epoch_begin; its pass is unknown")
                self.plan.on_draw(int(labels.shape[0]), pass_id=self._pass, new_pass=not self._pass_begun)
                self._pass_begun = True
            self._labels.append(labels)
            return args, kwargs

        return hook

    def _summed_per_sample_loss(self, per_sample_loss: PerSampleLoss):
        def hook(module, args, kwargs, output):
            labels = self._labels.pop() if self._labels else None
            if labels is None:
                return None
            return with_loss(output, check_per_sample_losses(per_sample_loss(output, labels), labels.shape[0]).sum())

        return hook


def _refuse_setups(args: Any, state: Any) -> None:
    optimizer_name = str(getattr(args.optim, "value", args.optim)).lower()
    refusals = [
        (state.global_step > 0,
         "resuming from a checkpoint: the callback's accountant history is not restored, so epsilon would restart "
         "at 0; use DPTrainer, whose checkpoints carry the privacy state"),
        (args.world_size > 1 or args.n_gpu > 1,
         "several processes or GPUs (the noise would be added per rank); DPTrainer supports DDP and FSDP2"),
        (args.fp16, "fp16: Accelerate's GradScaler scales the per-sample gradients before clipping and skips steps "
                    "on overflow; use DPTrainer (it trains fp16 with a DPGradScaler), or bf16 or fp32"),
        (bool(getattr(args, "deepspeed", None)) or bool(getattr(args, "fsdp", None)),
         "DeepSpeed and FSDP shard or replace the gradients clipping needs"),
        (args.neftune_noise_alpha is not None,
         "NEFTune: the Trainer attaches transformers' hook, which scales each sample's embedding noise by the padded "
         "length of its batch (the other samples'); DPTrainer runs a variant scaled by each sample's own length"),
        (args.use_liger_kernel, "Liger kernels replace the model's forward"),
        (optimizer_name in ("lomo", "adalomo"), "LOMO optimizers update the parameters inside backward"),
        (args.label_smoothing_factor != 0,
         "label_smoothing_factor: the Trainer's label smoother computes a batch-level loss outside the model"),
        (getattr(args, "train_sampling_strategy", "random") in ("group_by_length", "batch_rebalance"),
         "length-grouped sampling chooses batches from the data"),
    ]
    problems = [message for refused, message in refusals if refused]
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"DPCallback cannot train privately with this set-up:\n{listed}")


def _check_one_draw_per_step(sampler: Any, accumulation: int) -> None:
    """Refuse a Poisson sampler that does not draw exactly once per optimizer step of the Trainer."""
    if isinstance(sampler, PoissonMicroBatchSampler):
        if sampler.micro_batches == accumulation:
            return
        problem = (f"the PoissonMicroBatchSampler deals each draw into {sampler.micro_batches} micro-batches, but the "
                   f"Trainer steps after gradient_accumulation_steps={accumulation} of them")
        fix = f"build it with micro_batches={accumulation}"
    elif accumulation == 1:
        return
    else:
        problem = (f"each batch of the PoissonBatchSampler is a Poisson draw, and gradient_accumulation_steps="
                   f"{accumulation} sums {accumulation} of them into one noised step")
        fix = ("use gradient_accumulation_steps=1 (raise the sample rate for larger steps), or a "
               f"PoissonMicroBatchSampler(..., micro_batches={accumulation}), which deals one draw into "
               f"{accumulation} micro-batches")
    raise ValueError(
        f"DPCallback: {problem}. A step would not be the one Poisson draw of rate q the accountant records (with "
        "several draws in one step a row can count twice: 2 C under one noise draw). To keep the guarantee, "
        f"{fix}"
    )


def _collator_of(loader: Any) -> Any:
    """The user's collator behind the Trainer's loader (under transformers' column-removing wrapper)."""
    collate = getattr(loader, "collate_fn", None)
    return getattr(collate, "data_collator", collate)


def _poisson_sampler(loader: Any) -> Optional[Any]:
    """The dptorch Poisson sampler behind ``loader`` (through Accelerate's wrappers), if any."""
    current, seen = getattr(loader, "batch_sampler", None), 0
    while current is not None and seen < 8:
        if isinstance(current, (PoissonBatchSampler, PoissonMicroBatchSampler)):
            return current
        current, seen = getattr(current, "batch_sampler", None), seen + 1
    return None


def _optimizer_holder(optimizer: Any) -> Any:
    """The wrapper (Accelerate's ``AcceleratedOptimizer``) whose ``.optimizer`` the DP optimizer goes under."""
    holder, seen = optimizer, 0
    while seen < 8:
        inner = getattr(holder, "optimizer", None)
        if isinstance(inner, DPOptimizer):
            raise RuntimeError("the Trainer's optimizer is already private (a DPOptimizer): attach DPCallback once")
        if not isinstance(inner, torch.optim.Optimizer):
            break
        if getattr(inner, "optimizer", None) is None:
            return holder
        holder, seen = inner, seen + 1
    raise ValueError(
        f"DPCallback puts its DP optimizer under the Trainer's optimizer wrapper (Accelerate's AcceleratedOptimizer), "
        f"but the Trainer's optimizer is a {type(optimizer).__name__} without one; use DPTrainer"
    )


def _check_optimizer_params(model: Any, optimizer: torch.optim.Optimizer) -> None:
    in_model = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) not in in_model for p in params):
        raise ValueError("the Trainer's optimizer holds parameters that are not in its model; let the Trainer build it")
    if not any(p.requires_grad for p in params):
        raise ValueError("the optimizer has no trainable parameter")


__all__ = ["DPCallback", "EPSILON_IF_POISSON"]

"""The private Trainer: ``private(trainer_cls)`` and ``DPTrainer = private(transformers.Trainer)``.

One mixin, :class:`PrivateTrainerMixin`, goes in front of any ``Trainer`` subclass. It never
wraps the model: ``trainer.model`` stays the user's object (a ``PeftModel`` stays one) and a
:class:`~dptorch.grad_sample.GradSampleHooks` controller is attached to it after the parent's
``__init__`` (TRL creates PEFT adapters there). What it overrides, and why:

* ``get_train_dataloader``: Poisson-sampled logical batches of privacy units, split into exactly
  ``gradient_accumulation_steps`` micro-batches (:mod:`.sampling`).
* ``create_optimizer``: the parent's optimizer wrapped in a :class:`~dptorch.optim.DPOptimizer`
  (clips after every backward, adds noise once per optimizer step) that reads and accounts in the
  run's :class:`~dptorch.plan.PrivacyPlan` (``trainer.privacy_plan``).
* ``training_step``: tells the controller which rows form a unit; an empty micro-batch is skipped on
  one process and runs as a phantom (a stand-in that adds and counts nothing, :mod:`.phantom`) on
  several, so that every rank runs the same forwards, backwards and collectives.
* ``compute_loss``: the sum of per-unit losses, chosen by a recipe (:mod:`.loss_recipes`);
  ``num_items_in_batch`` is never used, ``loss_is_scaled_for_ga = True``.
* ``_clip_grad_norm`` / ``_get_grad_norm``: no Trainer clipping, and no norm of the raw
  (non-private) gradient in the logs; ``grad_norm`` is logged from the privatised gradient.
* ``train``: after the parent's, the privacy report goes into the last log entry (and
  ``trainer_state.json``) and one info line; ``_save`` / ``create_model_card``: the report goes into
  the saved model card (``README.md``, :mod:`dptorch.accounting.report`), PEFT's adapter card included.
* ``model_init`` / ``hyperparameter_search`` (:mod:`.tuning`): a new private run per model; the search's privacy.
* ``log``: adds ``epsilon``. ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``: the
  privacy plan's state (accountant history, steps) and the sampling seed travel with Trainer
  checkpoints (the DP optimizer's accumulator and noise generator travel inside ``optimizer.pt``;
  under FSDP the noise generator goes into ``dp_privacy_state.pt``).

Distributed (``torchrun`` / ``accelerate launch``, DDP or FSDP2): the logical batch is global (``q``
from ``per_device_train_batch_size * gradient_accumulation_steps * world_size``); each rank
Poisson-samples its own units (``r::world_size``, one shared secret seed) into the same number of
micro-batches, with Accelerate's batch dealing turned into a pass-through (no ``even_batches``
repetition). DDP: its all-reduce of the raw gradients is switched off during the private forwards
(:mod:`dptorch.distributed.ddp`); the DP optimizer all-reduces the clipped sums and rank 0 draws the
noise, once per step. FSDP2 (Accelerate's ``fsdp_version: 2``): Accelerate swaps the parameters for
sharded ones after the optimizer is built, so at the first micro-batch the controller is attached
anew to the sharded model and the DP optimizer listens to it (:mod:`dptorch.distributed.fsdp`:
clipped sums reduce-scattered, each rank noises its shard); Accelerate saves and loads the sharded
optimizer with ``torch.distributed.checkpoint``, which is handed the inner optimizer. In
``compute_loss`` the metric gathers accept micro-batches of different sizes (:mod:`.metrics`).
Every rank accounts the same steps, so epsilon is the same everywhere; the Trainer's loggers print
it from rank 0. The ranks' plans are compared when the trainer is built, and a difference (another
per-device batch size, dataset or privacy argument on one rank) is refused on every rank
(:mod:`dptorch.distributed.agreement`). DeepSpeed ZeRO-1, 2 and 3 (``TrainingArguments(deepspeed=...)``): the optimizer stays unwrapped
until Accelerate built the engine, which is then made private (``engine.step()``, called by Accelerate
after the last micro-batch, is the DP step; :mod:`.deepspeed`). FSDP1, fp16 under FSDP and
tensor-parallel models are refused (:mod:`.checks` says why);
``fp16=True`` on one process or under DDP trains with a :class:`~dptorch.optim.DPGradScaler` in place of
Accelerate's GradScaler. ``neftune_noise_alpha`` runs NEFTune scaled by each sample's own length
(:mod:`.neftune`); ``auto_find_batch_size`` cuts micro-batches into smaller passes after an out-of-memory
error, the draws untouched (:mod:`.physical_batches`).

One :class:`~dptorch.plan.PrivacyPlan` holds the sample rate and steps per epoch (from
:class:`.sampling.SamplingPlan`, the Trainer's arithmetic), the noise multiplier (given or
calibrated for exactly those), the clipping bound and the accountant; the Poisson sampler, the
optimizer, the budget callback, ``privacy_report`` and the checkpoints all read it. Before it is
built, ``bands="auto"`` (bandmf) becomes the b that :func:`~dptorch.noise.banded.choose_bands`
picks for DP-SGD's sample rate and the run's steps; ``trainer.privacy_args`` is a copy with that b.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings
from functools import partial
from typing import Any, Dict, Optional

import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker
from transformers.utils import logging

from dptorch.distributed import deepspeed as ds_zero
from dptorch.distributed.agreement import check_ranks_agree
from dptorch.distributed.ddp import ddp_wrappers, keep_out_of_gradient_sync
from dptorch.distributed.fsdp import is_sharded
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.modes.auto import describe_mode, resolve_grad_sample_mode
from dptorch.grad_sample.capture.rounds import _name_list
from dptorch.integrations.hf.arguments import PrivacyArguments
from dptorch.integrations.hf.captured import TrainerCapture
from dptorch.integrations.hf.audit import TrainerAudit
from dptorch.integrations.hf.budget import PrivacyBudget, PrivacyBudgetCallback
from dptorch.integrations.hf.checks import check_setup
from dptorch.integrations.hf.deepspeed import (
    clip_each_unit_only,
    deepspeed_config,
    one_deepspeed_step_per_logical_batch,
)
from dptorch.integrations.hf.model_card import write_private_model_card
from dptorch.integrations.hf.loss_func_recipe import with_compute_loss_func
from dptorch.integrations.hf.loss_recipes import choose_recipe
from dptorch.grad_sample.units.per_sample_losses import PerSampleLoss
from dptorch.integrations.hf.metrics import dropped_metrics, exact_gathers
from dptorch.integrations.hf.neftune import take_over_neftune
from dptorch.integrations.hf.packing import PackingCollator, check_packing, packing_after_sampling, pad_token_id
from dptorch.integrations.hf.physical_batches import check_physical_batches, no_restarts
from dptorch.integrations.hf.phantom import PhantomBatch
from dptorch.integrations.hf.sampling import (
    UNIT_IDS_KEY,
    IndexedDataset,
    PoissonMicroBatchSampler,
    PrivateCollate,
    SamplingPlan,
    is_empty_batch,
)
from dptorch.integrations.hf.tuning import PrivateSearchMixin
from dptorch.integrations.hf.units import PrivacyUnits
from dptorch.noise import NoiseGenerator, secure_seed
from dptorch.noise.banded.mechanism import _mechanism_fields, resolve_auto_bands
from dptorch.optim.loss_scaling import DPGradScaler
from dptorch.optim.optimizer import DPOptimizer
from dptorch.plan import PrivacyPlan, SamplingMismatchError, check_delta_for_units
from dptorch.accounting.report import privacy_report

logger = logging.get_logger(__name__)

#: Key of the log-history entry that holds the final privacy report.
PRIVACY_REPORT_KEY = "privacy_report"

#: File written into every Trainer checkpoint folder: the privacy plan's state and the sampling seed.
PRIVACY_STATE_NAME = "dp_privacy_state.pt"
_STATE_VERSION = 2


class PrivateTrainerMixin(PrivateSearchMixin):
    """DP-SGD for a ``transformers.Trainer`` subclass; see the module docstring.

    Extra constructor arguments: ``privacy_args`` (required, :class:`PrivacyArguments`) and
    ``per_sample_loss_func`` (optional ``fn(outputs, labels) -> one loss per row``; the default
    is each row's token-mean cross-entropy for language models, the row's loss for classifiers).
    """

    loss_is_scaled_for_ga = True  # the loss is a sum of per-unit losses: never divide it by GA
    dp_audit: Optional[TrainerAudit] = None  # PrivacyArguments(audit_canaries=m): the one-run audit (.audit)

    def __init__(
        self,
        *args: Any,
        privacy_args: Optional[PrivacyArguments] = None,
        per_sample_loss_func: Optional[PerSampleLoss] = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(privacy_args, PrivacyArguments):
            raise TypeError(
                f"{type(self).__name__} needs privacy_args=PrivacyArguments(...), got {type(privacy_args).__name__}"
            )
        self.privacy_args = privacy_args
        self.dp_hooks: Optional[GradSampleHooks] = None
        self.privacy_plan: Optional[PrivacyPlan] = None
        self.privacy_budget: Optional[PrivacyBudget] = None
        self._dp_sampler: Optional[PoissonMicroBatchSampler] = None
        self._dp_drawn = 0  # micro-batches the Poisson sampler yielded, and the training steps that took one
        self._dp_trained = 0
        self._dp_training = False  # inside train(): its micro-batches must be the sampler's
        self._dp_grad_norm: Optional[float] = None
        self._dp_clipping_logs: Dict[str, float] = {}  # adaptive bound, clipping statistics when enabled
        self._dp_engine_optimizer: Optional[DPOptimizer] = None  # DeepSpeed: the DP optimizer engine.step() runs
        with packing_after_sampling(kwargs.get("args", args[1] if len(args) > 1 else None)) as packing:
            super().__init__(*args, **kwargs)
        check_setup(self, privacy_args)
        if deepspeed_config(self) is not None:  # the Trainer's accumulation splits the logical batch, not DeepSpeed's
            one_deepspeed_step_per_logical_batch(deepspeed_config(self), self.args)
            clip_each_unit_only(deepspeed_config(self), self.args, privacy_args.per_sample_max_grad_norm)
        recipe = choose_recipe(self, per_sample_loss_func, skip=PrivateTrainerMixin)
        self._dp_recipe = with_compute_loss_func(recipe, self)
        self._dp_recipe.check(self)
        if packing is not None:
            check_packing(self, privacy_args, per_sample_loss_func)
            self.data_collator = PackingCollator(pad_token_id(self), packing.max_length)
        self.privacy_units = self._build_privacy_units(self.train_dataset)
        if privacy_args.banded == "auto":  # from here on privacy_args.bands is the chosen b
            self.privacy_args = privacy_args = self._resolve_auto_bands(privacy_args)
        self.sampling_plan = self._sampling_plan(privacy_args.banded)
        self.privacy_plan = self._build_plan()
        # one plan on every rank, or every rank refuses (before a check of this rank's number of units)
        check_ranks_agree(self.privacy_plan, micro_batches=self.sampling_plan.micro_batches)
        check_delta_for_units(privacy_args.target_delta, self.privacy_units.num_units, "target_delta")
        self._dp_physical = check_physical_batches(self, packing)  # auto_find_batch_size: passes, not the sampling
        self._dp_neftune = take_over_neftune(self)  # NEFTune scaled by each sample's own length
        self.privacy_budget = PrivacyBudget(plan=self.privacy_plan, delta=privacy_args.target_delta,
                                            cap=privacy_args.budget_cap)
        seed = privacy_args.sampling_seed
        self.dp_audit = TrainerAudit.from_args(privacy_args)  # audit_canaries: the one-run audit (docs/auditing.md)
        self._dp_sampling_seed = seed if seed is not None else secure_seed()  # secret unless given
        if self.args.world_size > 1 and not privacy_args.secure_mode:
            # One seed on every rank: the ranks' shards are disjoint parts of one Poisson draw, and
            # the checkpoint (written by rank 0) holds the seed every rank resumes with.
            self._dp_sampling_seed = _broadcast_from_rank_zero(self._dp_sampling_seed)
        self._dp_ddp_switches: list = []
        self._dp_wrapped: Any = None  # the wrapped model training_step last prepared for
        self._dp_on_shards = False  # whether the controller was attached anew to FSDP2's sharded parameters
        self._dp_phantom: Optional[PhantomBatch] = None
        self._dp_in_phantom = False
        #: The per-sample gradient mode that runs (``privacy_args.grad_sample_mode``, "auto" resolved).
        self.grad_sample_mode = resolve_grad_sample_mode(privacy_args.grad_sample_mode, self.model)
        logger.info(describe_mode(privacy_args.grad_sample_mode, self.grad_sample_mode))
        self.dp_hooks = self._new_controller()
        #: The captured micro-batch step (PrivacyArguments.capture_step), or None for eager steps.
        self.dp_capture = TrainerCapture.for_trainer(self)
        self.add_callback(PrivacyBudgetCallback(self.privacy_budget))

    def _new_controller(self) -> GradSampleHooks:
        # keep_param_grads=False: autograd skips the raw weight gradients; the DP optimizer writes p.grad itself.
        return GradSampleHooks(
            self.model, loss_reduction="sum", grad_sample_mode=self.grad_sample_mode, keep_param_grads=False
        )

    def _build_privacy_units(self, dataset: Any) -> PrivacyUnits:
        """Which training rows form one privacy unit: ``privacy_unit_column``, else one unit per row.

        Override to group rows another way (the dp-transformers ``author_mapping`` does).
        """
        return PrivacyUnits.from_dataset(dataset, self.privacy_args.privacy_unit_column)

    def _sampling_plan(self, bands: Optional[int]) -> SamplingPlan:
        """Sample rate and steps of this run's Trainer settings, with ``bands`` partitions (None: DP-SGD)."""
        return SamplingPlan.for_training(
            num_units=self.privacy_units.num_units,
            batch_size=self._train_batch_size,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            max_steps=self.args.max_steps,
            num_train_epochs=self.args.num_train_epochs,
            world_size=self.args.world_size,
            bands=bands,
        )

    def _resolve_auto_bands(self, privacy_args: PrivacyArguments) -> PrivacyArguments:
        """``bands="auto"``: a copy of ``privacy_args`` with the b ``choose_bands`` picks for DP-SGD's sample
        rate q (expected logical batch / units) and the total steps of this run (the user's copy keeps "auto")."""
        dp_sgd = self._sampling_plan(None)
        bands = resolve_auto_bands(target_epsilon=privacy_args.target_epsilon, target_delta=privacy_args.target_delta,
                                   steps=dp_sgd.total_steps, sample_rate=dp_sgd.sample_rate,
                                   accountant=privacy_args.accountant)
        return dataclasses.replace(privacy_args, bands=bands)

    def _build_plan(self) -> PrivacyPlan:
        """The run's privacy plan: the sampling the Trainer will draw, the noise, clipping and accountant."""
        p, sampling = self.privacy_args, self.sampling_plan
        fields = dict(
            sample_rate=sampling.sample_rate, steps_per_epoch=sampling.steps_per_epoch, num_units=sampling.num_units,
            max_grad_norm=p.per_sample_max_grad_norm, clipping=p.clipping, accountant=p.accountant,
            secure_mode=p.secure_mode, **p.clipping_options(),
        )
        if p.banded is not None:  # bandmf: the optimised band for the planned steps, q_p and the batch of a partition
            fields.update(_mechanism_fields(p.noise_mechanism, p.bands, sampling.total_steps),
                          expected_batch_size=sampling.expected_batch_size)
        if p.target_epsilon is not None:
            return PrivacyPlan.calibrated(target_epsilon=p.target_epsilon, target_delta=p.target_delta,
                                          steps=sampling.total_steps, **fields)
        if p.noise_multiplier == 0:
            warnings.warn("noise_multiplier=0: the training is not private (epsilon is infinite)", stacklevel=4)
        return PrivacyPlan(noise_multiplier=p.noise_multiplier, planned_steps=sampling.total_steps, **fields)

    # ------------------------------------------------------------------ privacy state

    @property
    def noise_multiplier(self) -> float:
        return self.privacy_plan.noise_multiplier

    def get_epsilon(self, delta: Optional[float] = None) -> float:
        """Epsilon spent so far, at ``delta`` (default: ``privacy_args.target_delta``)."""
        return self.privacy_plan.epsilon(self.privacy_budget.delta if delta is None else delta)

    def privacy_report(self) -> Dict[str, Any]:
        """The numbers a model card needs to state the guarantee, in ``PrivacyEngine.privacy_report``'s
        vocabulary (:mod:`dptorch.accounting.report`; the clipping bound ``per_sample_max_grad_norm`` is the
        report's ``max_grad_norm``): epsilon at ``target_delta``, accountant, noise, sampling, steps,
        privacy unit and number of units, the per-sample gradient mode that ran, dptorch's version."""
        unit = self.privacy_args.privacy_unit_column
        report = privacy_report(self.privacy_plan, self.privacy_budget.delta, grad_sample_mode=self.grad_sample_mode,
                                privacy_unit=f"rows sharing {unit!r}" if unit else "row")
        audit = self.dp_audit.report(self) if self.dp_audit is not None else None
        if audit is not None:  # audit_canaries: both audited lower bounds (docs/auditing.md)
            report["audit"] = audit
        tuning = getattr(self, "tuning_report", None)
        if tuning is not None:  # a hyperparameter search on this data: in it (a trial), or before this run
            report["tuning"] = {**tuning, "role": "trial" if getattr(self, "_dp_search", None) is not None else "after"}
        return report

    @property
    def audit_canaries(self) -> Any:
        """The run's gradient canaries (``PrivacyArguments(audit_canaries=m)``), for ``dptorch.auditing.audit_run``."""
        return self.dp_audit.canaries if self.dp_audit is not None else None

    def privacy_state_dict(self) -> Dict[str, Any]:
        """The privacy plan's state and the sampling seed (plain values, weights_only-loadable)."""
        plan = self.sampling_plan
        state = {
            "version": _STATE_VERSION,
            "plan": self.privacy_plan.state_dict(),
            "sampling": {
                "seed": int(self._dp_sampling_seed),
                "num_units": plan.num_units,
                "sample_rate": plan.sample_rate,
                "steps_per_epoch": plan.steps_per_epoch,
                "micro_batches": plan.micro_batches,
                "bands": plan.bands,
            },
        }
        optimizer = self._dp_optimizer()
        if (getattr(self, "is_fsdp_enabled", False) or self._dp_engine_optimizer is not None) and optimizer is not None:
            # FSDP: the optimizer is saved without its DP part (see _inner_optimizer_for_checkpoints); DeepSpeed:
            # engine.save_checkpoint saves ZeRO's state only (the DP optimizer holds nothing else between steps)
            state["noise_generator"] = optimizer.noise_generator.state_dict()
        return state

    def load_privacy_state_dict(self, state: Dict[str, Any]) -> None:
        plan = self.sampling_plan
        saved = state["sampling"]
        for key in ("num_units", "sample_rate", "steps_per_epoch", "micro_batches", "bands"):
            if saved.get(key, 1 if key == "bands" else None) != getattr(plan, key):
                raise ValueError(
                    f"the checkpoint was trained with {key}={saved.get(key, 1)}, this run has {getattr(plan, key)}: "
                    "the dataset, batch size, gradient accumulation, number of processes or bands changed, so the "
                    "resumed sampling would not continue the original one. Resume with the same data, batch settings, "
                    "number of processes and bands."
                )
        seed = int(saved["seed"])
        if self.privacy_args.sampling_seed is not None and self.privacy_args.sampling_seed != seed:
            warnings.warn("the checkpoint's sampling seed replaces privacy_args.sampling_seed", stacklevel=3)
        self._dp_sampling_seed = seed
        if self._dp_sampler is not None:
            self._dp_sampler.seed = seed
            self._dp_sampler.set_partition_seed(seed)  # bandmf: the partitions are a function of the seed
            # The Trainer reaches the checkpoint's position itself (set_epoch, then skipping the
            # micro-batches it trained on); draws after it belong to the discarded continuation.
            self._dp_sampler.rewind()
        if "plan" in state:
            self.privacy_plan.load_state_dict(state["plan"])
        else:  # version 1: accountant history and step count only
            self.privacy_budget.load_state_dict(state["budget"])
        optimizer = self._dp_optimizer()
        if "noise_generator" in state and optimizer is not None:
            optimizer.noise_generator.load_state_dict(state["noise_generator"])

    # ------------------------------------------------------------------ data

    def get_train_dataloader(self) -> DataLoader:
        """Poisson-sampled micro-batches; empty ones arrive as ``EmptyBatch``."""
        dataset, collator = self.train_dataset, self.data_collator
        if len(dataset) != self.privacy_units.num_rows:
            raise ValueError(
                f"train_dataset has {len(dataset)} rows but had {self.privacy_units.num_rows} when the trainer was "
                "built; the sampling rate and the noise were planned for that size. Build a new trainer."
            )
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if self._runs_phantoms:  # structure only: every value is replaced
            self._dp_phantom = PhantomBatch(collator, dataset)
            self._dp_phantom()  # built now: a collator it cannot use fails before training, not at an empty batch
        # Rows sharing a unit are clipped together: the batches must say which unit each row belongs to.
        tag_units = self.privacy_args.privacy_unit_column is not None or not self.privacy_units.trivial
        if tag_units:
            dataset = IndexedDataset(dataset)
        plan, previous = self.privacy_plan, self._dp_sampler
        secure = self.privacy_args.secure_mode
        self._dp_sampler = PoissonMicroBatchSampler(
            self.privacy_units, plan.sample_rate, steps=plan.steps_per_epoch,
            micro_batches=self.sampling_plan.micro_batches, seed=None if secure else self._dp_sampling_seed,
            secure=secure, rank=self.args.process_index, world_size=self.args.world_size,
            bands=self.privacy_args.banded, partition_seed=self._dp_sampling_seed,  # partitions kept in checkpoints
        )
        self._dp_sampler.listener = self._count_draw
        if previous is not None:  # a later train() of this trainer: new draws, never the earlier ones again
            position = previous.position
            if self._dp_sampler.bands is not None:
                # bandmf: draws the previous train() took ahead but never trained on are skipped; keep the next
                # step's partition (its noise step index mod b) so every unit stays b-min-separated in noise steps.
                position += (plan.steps - position) % self._dp_sampler.bands
            self._dp_sampler.start_at(position)
        args = self.args
        settings = dict(
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
        )
        if "in_order" in inspect.signature(DataLoader.__init__).parameters:  # torch >= 2.6
            settings["in_order"] = args.dataloader_in_order
        collate = PrivateCollate(collator, self.privacy_units.unit_of_row if tag_units else None,
                                 self._dp_recipe.rows_per_example)
        loader = DataLoader(dataset, batch_sampler=self._dp_sampler, collate_fn=collate, **settings)
        prepared = self.accelerator.prepare(loader)
        # The sampler is already rank-aware: Accelerate's BatchSamplerShard would deal its batches
        # round-robin over the ranks and, with even_batches, re-yield used ones. Make it a pass-through.
        dealt = getattr(prepared, "batch_sampler", None)
        if dealt is not None and dealt is not self._dp_sampler:
            if getattr(dealt, "batch_sampler", None) is not self._dp_sampler:
                raise RuntimeError(
                    f"Accelerate wrapped the Poisson sampler in {type(dealt).__name__}, which the private trainer "
                    "does not know how to keep from re-dealing batches; avoid split_batches and dispatch_batches"
                )
            dealt.num_processes, dealt.process_index = 1, 0
        return prepared

    # ------------------------------------------------------------------ optimizer

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The parent's optimizer, wrapped once in a DPOptimizer. Under DeepSpeed it stays unwrapped (DeepSpeed's
        ZeRO optimizer wraps it); the DP optimizer comes with the engine (:meth:`_make_engine_private`)."""
        super().create_optimizer(model)
        if getattr(self, "is_deepspeed_enabled", False):
            _check_optimizer_params(self.model, self.optimizer)
        elif _find_dp_optimizer(self.optimizer) is None:
            _check_optimizer_params(self.model, self.optimizer)
            self.optimizer = self._new_dp_optimizer(self.optimizer)
            self._use_dp_grad_scaler(self.optimizer)
        return self.optimizer

    def _new_dp_optimizer(self, inner: torch.optim.Optimizer) -> DPOptimizer:
        """The DP optimizer around ``inner``, reading and accounting in the run's privacy plan."""
        p = self.privacy_args
        optimizer = DPOptimizer(
            inner,
            hooks=self.dp_hooks,
            plan=self.privacy_plan,
            loss_reduction="mean",
            noise_generator=None if p.secure_mode else NoiseGenerator(seed=p.noise_seed, device=self.args.device),
            secure_mode=p.secure_mode,
        )
        optimizer.attach_step_hook(self._after_private_step)
        if self.dp_audit is not None and not self.dp_audit.waits_for_shards(self):
            self.dp_audit.attach(self, optimizer)
        return optimizer

    def _make_engine_private(self, engine: Any) -> None:
        """DeepSpeed (once per engine): the DP optimizer hands its noised gradient to ZeRO, and ``engine.step()``,
        which Accelerate calls after the last micro-batch of a logical step, is the DP optimizer's step
        (:mod:`dptorch.distributed.deepspeed`). The whole set-up is checked on the engine first."""
        if self._dp_engine_optimizer is not None and self._dp_engine_optimizer.original_optimizer.engine is engine:
            return
        if engine.module is not self.model:
            raise RuntimeError("DeepSpeed's engine does not hold trainer.model, to which the per-sample hooks attached")
        ds_zero.check_engine(engine)
        optimizer = self._new_dp_optimizer(ds_zero.DeepSpeedHandOver(engine))
        ds_zero.attach(engine, optimizer)
        self._dp_engine_optimizer = optimizer

    def _dp_optimizer(self) -> Optional[DPOptimizer]:
        """The run's DP optimizer: in Accelerate's optimizer chain, or the one DeepSpeed's engine steps."""
        engine_optimizer = self._dp_engine_optimizer
        return engine_optimizer if engine_optimizer is not None else _find_dp_optimizer(self.optimizer)

    @property
    def _runs_phantoms(self) -> bool:
        """Whether an empty micro-batch runs as a phantom: on several processes (paired collectives), and under
        DeepSpeed (the last micro-batch's backward is where Accelerate calls ``engine.step()``)."""
        return self.args.world_size > 1 or getattr(self, "is_deepspeed_enabled", False)

    def _use_dp_grad_scaler(self, optimizer: DPOptimizer) -> None:
        """fp16: the GradScaler Accelerate built (on a GPU, for ``fp16=True``) gives way to a fixed-scale
        :class:`~dptorch.optim.DPGradScaler` before ``prepare`` hands a scaler to the optimizer wrapper: no step
        skipped or scale lowered for an overflow, each unit unscaled before clipping
        (:mod:`dptorch.optim.loss_scaling`)."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and not isinstance(scaler, DPGradScaler):
            self.accelerator.scaler = DPGradScaler.replacing(
                scaler, optimizer, init_scale=self.privacy_args.fp16_loss_scale,
                growth_interval=self.privacy_args.fp16_scale_growth_interval)

    def _after_private_step(self, optimizer: DPOptimizer) -> None:
        """Keep the norm of the privatised gradient for the logs (the optimizer accounted the step in the plan)."""
        norms = [p.grad.detach().float().norm() for p in optimizer.params if p.grad is not None]
        self._dp_grad_norm = float(torch.stack(norms).norm()) if norms else None
        self._dp_clipping_logs = {
            ("per_sample_max_grad_norm" if key == "max_grad_norm" else key): value
            for key, value in optimizer.clipping_logs().items()
        }

    def _clip_grad_norm(self, model: Any) -> None:
        return None  # each unit is clipped by the DP optimizer; the Trainer's clipping would be on raw gradients

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> None:
        return None  # the raw gradient's norm is not private; `log` reports the privatised one

    # ------------------------------------------------------------------ steps and loss

    def training_step(self, model: Any, inputs: Dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward/backward of one micro-batch; returns its summed loss / expected batch size (for logs).

        An empty micro-batch is skipped on one process and runs as a phantom on several (:mod:`.phantom`);
        either way it returns 0."""
        self._attach_to_wrapped_model(model)
        self._check_drawn()
        if is_empty_batch(inputs):
            if self._runs_phantoms:
                self._phantom_step(model)
            return torch.zeros((), device=self.args.device)
        example_units = inputs.pop(UNIT_IDS_KEY, None)
        if self._dp_neftune is not None:
            self._dp_neftune.follow(self.model)
        if self._dp_physical is None:
            loss = self._train_pass(model, inputs, example_units, num_items_in_batch)
        else:  # auto_find_batch_size: the micro-batch in passes of whole units (.physical_batches)
            loss = self._dp_physical.run(inputs, example_units, partial(self._train_pass, model),
                                         self.dp_hooks.discard_failed_pass)
        return loss / self.privacy_plan.expected_batch_size

    def _train_pass(self, model: Any, inputs: Dict[str, Any], example_units: Any, num_items_in_batch: Any = None) -> Any:
        """The parent's forward and backward of ``inputs``, their rows' privacy units told to the controller."""
        self.dp_hooks.set_privacy_units(self._dp_recipe.row_unit_ids(example_units, inputs))
        if self.dp_capture is not None:
            loss = self.dp_capture.run(self, model, inputs)
            if loss is not None:
                return loss
        return super().training_step(model, inputs, num_items_in_batch)

    def _count_draw(self, rows: Optional[int]) -> None:
        self._dp_drawn += 1

    def _check_drawn(self) -> None:
        """Every training micro-batch must come from this trainer's Poisson sampler: a subclass whose
        ``get_train_dataloader`` builds another loader would train on batches the accounting never saw."""
        self._dp_trained += 1
        if self._dp_training and self._dp_trained > self._dp_drawn:
            raise SamplingMismatchError(
                f"{type(self).__name__} trains on a micro-batch its Poisson sampler did not draw: the train dataloader "
                "is not the private trainer's (a get_train_dataloader override that builds its own loader?), so the "
                "batches are not Poisson samples and the accounting does not hold. Call super().get_train_dataloader() "
                "and change only what the loader does with its batches, or subclass without overriding it"
            )

    def _attach_to_wrapped_model(self, model: Any) -> None:
        """Once per model Accelerate prepared (``model``, DDP- or FSDP2-wrapped).

        DDP: its raw-gradient all-reduce goes off during the private forwards (the DP optimizer
        all-reduces the clipped sums instead). FSDP2: Accelerate replaced the parameters by sharded
        ones after the controller and the optimizer were built; a new controller attaches to the
        sharded model and the DP optimizer listens to it."""
        if model is self._dp_wrapped:
            return
        self._dp_wrapped = model
        self._dp_ddp_switches += [keep_out_of_gradient_sync(ddp) for ddp in ddp_wrappers(model)]
        if ds_zero.is_deepspeed_engine(model):
            self._make_engine_private(model)
        optimizer = self._dp_optimizer()
        if not self._dp_on_shards and optimizer is not None and any(is_sharded(p) for p in optimizer.params):
            self.dp_hooks.cleanup()
            self.dp_hooks = self._new_controller()
            optimizer.use_hooks(self.dp_hooks)
            self._dp_on_shards = True
        if (self.dp_audit is not None and optimizer is not None and self.dp_audit.waits_for_shards(self)
                and getattr(optimizer, "canaries", None) is None):  # FSDP2: cut along the shards each rank holds
            self.dp_audit.attach(self, optimizer)

    def _phantom_step(self, model: Any) -> None:
        """Forward and backward of the phantom micro-batch: the collectives run, nothing is added or counted."""
        inputs = self._dp_phantom()
        inputs.pop(UNIT_IDS_KEY, None)
        self.dp_hooks.set_privacy_units(self._dp_recipe.row_unit_ids(None, inputs))  # rows as a real batch's
        self._dp_in_phantom = True
        try:
            with self._dp_optimizer().phantom():
                super().training_step(model, inputs, None)
        finally:
            self._dp_in_phantom = False

    def compute_loss(
        self, model: Any, inputs: Dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """In training: the sum over units of each unit's own loss (``num_items_in_batch`` unused); 0 times
        that for a phantom micro-batch."""
        parent = super().compute_loss
        if self.dp_hooks is None or not (model.training and torch.is_grad_enabled()):
            return parent(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        with contextlib.ExitStack() as stack:
            if self.args.world_size > 1:  # metric gathers of micro-batches of any size; a phantom sends no row
                gathers = stack.enter_context(exact_gathers(self.accelerator, phantom=self._dp_in_phantom))
                stack.enter_context(dropped_metrics(self, when=lambda: gathers.found_nothing))
            result = self._dp_recipe.summed_loss(self, model, inputs, return_outputs, parent)
        if self._dp_in_phantom:
            result = (result[0] * 0.0, result[1]) if return_outputs else result * 0.0
        return result

    def _get_num_items_in_batch(self, batch_samples: Any, device: Any) -> None:
        return None  # the batch's token count is exactly the cross-sample normaliser DP must not use

    def _track_num_input_tokens(self, inputs: Dict[str, Any]) -> None:
        if not is_empty_batch(inputs):
            super()._track_num_input_tokens(inputs)
        elif self.args.include_num_input_tokens_seen != "no" and self.args.world_size > 1:
            # the other ranks gather their counts now: take part with a count of 0
            zero = torch.zeros((), dtype=torch.int64, device=self.args.device)
            self.state.num_input_tokens_seen += self.accelerator.gather(zero).sum().item()

    # ------------------------------------------------------------------ logs and checkpoints

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        if self.privacy_budget is not None and not any(str(k).startswith(("eval_", "test_")) for k in logs):
            logs["epsilon"] = self.privacy_budget.epsilon()
            if "loss" in logs and self._dp_grad_norm is not None:
                logs["grad_norm"] = self._dp_grad_norm
            if "loss" in logs:
                logs.update(self._dp_clipping_logs)  # raw_* statistics are not covered by epsilon
            if "loss" in logs and self.dp_audit is not None:
                logs.update(self.dp_audit.logs(self))
        super().log(logs, start_time)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, then the privacy report into the logs: under ``"privacy_report"`` in the
        last entry of ``state.log_history`` (the final training metrics; hence in
        ``trainer_state.json`` when the state is saved) and one line in the log. ``epsilon`` is
        already in every log entry, the final metrics included."""
        if self._dp_engine_optimizer is not None:
            raise ValueError(
                "a second train() of a trainer under DeepSpeed is not supported: the Trainer hands Accelerate the "
                "engine of the first train(), which it does not prepare again (its backward would fail), and a new "
                "DP optimizer would restart the noise stream of noise_seed. Build a new trainer, or resume one from a "
                "checkpoint of this run (train(resume_from_checkpoint=...))"
            )
        self._dp_trained, self._dp_drawn, self._dp_training = 0, 0, True
        try:
            with no_restarts(self.args, self._dp_physical):
                output = super().train(*args, **kwargs)
        finally:
            self._dp_training = False
            if self._dp_neftune is not None:
                self._dp_neftune.remove()
        if self.privacy_plan is not None:
            report = self.privacy_report()
            history = self.state.log_history
            if history and "train_runtime" in history[-1]:  # the entry of the final training metrics
                history[-1][PRIVACY_REPORT_KEY] = report
            else:
                history.append({"step": self.state.global_step, PRIVACY_REPORT_KEY: report})
            logger.info(
                "privacy report: epsilon %s at delta %g (%s accountant), %s noise%s, noise multiplier %.4g, %d steps "
                "of sample rate %.4g, clipping bound %s, per-sample gradients %s", report["epsilon"], report["delta"],
                report["accountant"], report.get("noise_mechanism", "independent"),
                f" ({report['bands']} bands)" if "bands" in report else "", report["noise_multiplier"],
                report["steps"], report["sample_rate"], report["max_grad_norm"], report["grad_sample_mode"],
            )
        return output

    def _save(self, output_dir: Optional[str] = None, state_dict: Any = None) -> None:
        """Save the model as the Trainer does, then write the privacy report into the model card
        (``README.md`` of the folder: PEFT's adapter card, or a new one)."""
        shown = logging.is_progress_bar_enabled()
        if self.args.disable_tqdm:  # transformers' "Writing model shards" bar does not read disable_tqdm
            logging.disable_progress_bar()
        try:
            super()._save(output_dir, state_dict)
        finally:
            if shown:
                logging.enable_progress_bar()
        if self.privacy_plan is not None and self.args.should_save:
            write_private_model_card(output_dir if output_dir is not None else self.args.output_dir, self.privacy_report())

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's model card, with the privacy report added."""
        super().create_model_card(*args, **kwargs)
        if self.privacy_plan is not None and self.args.should_save:
            write_private_model_card(self.args.output_dir, self.privacy_report())

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.args.should_save and self.privacy_budget is not None:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), name)
            os.makedirs(folder, exist_ok=True)
            torch.save(self.privacy_state_dict(), os.path.join(folder, PRIVACY_STATE_NAME))
        with self._inner_optimizer_for_checkpoints():
            super()._save_checkpoint(model, trial)

    @contextlib.contextmanager
    def _inner_optimizer_for_checkpoints(self):
        """FSDP: Accelerate saves and loads the sharded optimizer through ``torch.distributed.checkpoint``,
        which first steps an optimizer without state (SGD's is always empty) to create it. Reaching the DP
        optimizer, that step would add noise and account a step; so for the block the chain holds the
        inner optimizer, and the DP optimizer's own state (its noise generator; its accumulator is empty
        between steps) travels in ``dp_privacy_state.pt``."""
        dp, holder = _find_dp_optimizer(self.optimizer), self.optimizer
        while dp is not None and holder is not None and getattr(holder, "optimizer", None) is not dp:
            holder = getattr(holder, "optimizer", None)  # the wrapper (Accelerate's) that holds the DP optimizer
        if not getattr(self, "is_fsdp_enabled", False) or dp is None or holder is None:
            yield
            return
        holder.optimizer = dp.original_optimizer
        try:
            yield
        finally:
            holder.optimizer = dp

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is not None and ds_zero.is_deepspeed_engine(self.model_wrapped):
            self._make_engine_private(self.model_wrapped)  # DeepSpeed loaded its state; the noise generator goes here
        with self._inner_optimizer_for_checkpoints():
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.privacy_budget is None:
            return
        path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no {PRIVACY_STATE_NAME}: it was not written by a private trainer, so its privacy "
                "spending is unknown and epsilon would restart at 0. Resume from a checkpoint of the private run, or "
                "load the weights into a new model and start a new private run (whose epsilon adds to the old one)."
            )
        self.load_privacy_state_dict(torch.load(path, weights_only=True))
        # The Trainer resumes at the first micro-batch of a logical step; clipped sums saved in the
        # middle of one (a JIT checkpoint before the optimizer step) would be added twice.
        self._dp_optimizer().zero_grad(set_to_none=True)


class DPTrainer(PrivateTrainerMixin, Trainer):
    """``transformers.Trainer`` with DP-SGD: ``DPTrainer(model=..., args=..., train_dataset=...,
    privacy_args=PrivacyArguments(...))``. Same as ``private(Trainer)``."""


_PRIVATE_CLASSES: Dict[type, type] = {Trainer: DPTrainer}


def private(trainer_cls: type) -> type:
    """The private version of a ``transformers.Trainer`` subclass, e.g. ``private(trl.SFTTrainer)``.

    The class it returns takes the same arguments plus ``privacy_args`` (and optionally
    ``per_sample_loss_func``). Calling ``private`` twice gives the same class.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"private() takes a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, PrivateTrainerMixin):
        return trainer_cls
    if trainer_cls not in _PRIVATE_CLASSES:
        name = f"DP{trainer_cls.__name__}"
        doc = f"{trainer_cls.__name__} with DP-SGD; also takes privacy_args=PrivacyArguments(...). Made by private()."
        _PRIVATE_CLASSES[trainer_cls] = type(
            name, (PrivateTrainerMixin, trainer_cls), {"__doc__": doc, "__module__": __name__, "__qualname__": name}
        )
    return _PRIVATE_CLASSES[trainer_cls]


def _broadcast_from_rank_zero(value: int) -> int:
    """Rank 0's ``value`` on every rank of the default process group (unchanged without one)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [int(value)]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def _find_dp_optimizer(optimizer: Any) -> Optional[DPOptimizer]:
    """The DPOptimizer inside Accelerate's (or anyone's) ``.optimizer`` chain, if any."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, DPOptimizer):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def _check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    in_model = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [tuple(p.shape) for p in params if id(p) not in in_model]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not in trainer.model (shapes "
            f"{_name_list([str(shape) for shape in foreign])}), "
            "e.g. because it was built before PEFT replaced or added layers; build it from trainer.model's "
            "parameters, or let the trainer create it"
        )
    if not any(p.requires_grad for p in params):
        raise ValueError("the optimizer has no trainable parameter (all have requires_grad=False)")


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)

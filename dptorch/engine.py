"""PrivacyEngine: wires the controller, the DP optimizer, Poisson sampling and the privacy plan.

``make_private`` returns ``(module, optimizer, data_loader)`` in every mode, and
``(module, optimizer, criterion, data_loader)`` when the caller passes ``criterion=`` (wrapped in
:class:`~dptorch.grad_sample.capture.dp_loss.DPLoss`, as Opacus does). With ``wrap_model=False`` the first item is the
:class:`~dptorch.grad_sample.GradSampleHooks` controller, as in Opacus 1.6 (also ``engine.hooks``): the model
stays the very object passed in, in the caller's variable, and ``hooks.cleanup()`` (or
``engine.detach()``) removes the controller without a trace.

Checkpoints use Opacus' layout (``module_state_dict``, ``privacy_accountant_state_dict``,
``optimizer_state_dict``, ... and the caller's entries at the top level) plus a ``"dptorch"`` entry
with what an exact resume needs (privacy plan, sampler position, torch's RNG); ``load_checkpoint``
also reads checkpoint files written by Opacus 1.6 and by earlier dptorch versions.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from dptorch.accounting import Selection, create_accountant
from dptorch.data.banded_sampling import auto_bands, cyclic_data_loader
from dptorch.data.shuffled import ShuffledDataLoader
from dptorch.distributed.agreement import check_ranks_agree
from dptorch.distributed.checkpoint import is_sharded_checkpoint, is_sharded_model, load_sharded, read_state, save_sharded
from dptorch.distributed.tensor_parallel import check_sharding, data_parallel_group, tensor_parallel_group
from dptorch.distributed import deepspeed as ds_zero
from dptorch.data.poisson import (
    DPDataLoader,
    check_map_style,
    check_sampler_replaceable,
    check_sharded_for_process_group,
    mirror_draws,
    poisson_sampler_of,
)
from dptorch.grad_sample import GradSampleHooks, GradSampleModule
from dptorch.grad_sample.modes.auto import describe_mode, resolve_grad_sample_mode
from dptorch.grad_sample.capture.hooks import is_attached
from dptorch.grad_sample.capture.rounds import _name_list
from dptorch.grad_sample.capture.dp_loss import DPLoss
from dptorch.noise import NoiseGenerator, SecureNoiseGenerator, as_noise_generator
from dptorch.optim.canaries import CanaryError, GradientCanaries
from dptorch.optim.adaclip import AdaClipDPOptimizer
from dptorch.optim.optimizer import DPOptimizer
from dptorch.clipping import CLIPPING_MODES, check_clipping
from dptorch.clipping.adaptive import clipping_plan_fields
from dptorch.plan import PrivacyPlan, check_delta_for_units, sampler_fields
from dptorch.accounting.report import privacy_report
from dptorch.plan import planned_steps as planned_steps_of
from dptorch.noise.banded.mechanism import _check_mechanism, _mechanism_fields
from dptorch.validate import ModuleValidator


logger = logging.getLogger(__name__)


class PrivacyEngine:
    """Make a model, optimizer and data loader private, and track the privacy spent.

    ``accountant`` is one of ``"pld"`` (default), ``"prv"``, ``"rdp"``, ``"gdp"`` (the GDP
    approximation reports only; it cannot calibrate the noise). ``secure_mode=True`` draws the
    noise and the Poisson sampling from the OS CSPRNG.

    ``make_private`` builds the run's :class:`~dptorch.plan.PrivacyPlan` (``engine.plan``): the
    sample rate and steps per epoch of the Poisson sampler the run iterates, the noise multiplier,
    the clipping bound and the accountant. The optimizer, the report and the checkpoints read it;
    ``sample_rate``, ``noise_multiplier`` and ``accountant`` here are views of it.
    """

    def __init__(self, accountant: str = "pld", secure_mode: bool = False) -> None:
        self.accountant = create_accountant(accountant)
        self.secure_mode = secure_mode
        self.hooks: Optional[GradSampleHooks] = None
        self.optimizer: Optional[DPOptimizer] = None
        self.plan: Optional[PrivacyPlan] = None
        #: The per-sample gradient mode that runs (``"auto"`` resolved), None before make_private.
        self.grad_sample_mode: Optional[str] = None
        #: make_private(audit_canaries=m): the run's gradient canaries (``dptorch.optim.canaries``), else None.
        self.audit_canaries: Optional[GradientCanaries] = None

    @property
    def sample_rate(self) -> Optional[float]:
        """The Poisson sample rate the sampler draws with and the accountant records (None before make_private)."""
        return self.plan.sample_rate if self.plan is not None else None

    @property
    def poisson_sampling(self) -> Optional[bool]:
        return (self.plan.sampling == "poisson") if self.plan is not None else None

    @property
    def noise_multiplier(self) -> Optional[float]:
        return self.plan.noise_multiplier if self.plan is not None else None

    # ------------------------------------------------------------------ set-up

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: Union[float, Sequence[float]],
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        grad_sample_mode: str = "auto",
        wrap_model: bool = True,
        noise_generator: Optional[Any] = None,
        strict: bool = True,
        criterion: Optional[Any] = None,
        gamma: Optional[float] = None,
        target_unclipped_quantile: Optional[float] = None,
        clipbound_learning_rate: Optional[float] = None,
        max_clipbound: Optional[float] = None,
        min_clipbound: Optional[float] = None,
        unclipped_num_std: Optional[float] = None,
        clipping_stats: Optional[str] = None,
        noise_mechanism: str = "independent",
        bands: Optional[int] = None,
        planned_steps: Optional[int] = None,
        model_loss: Optional[str] = None,
        audit_canaries: Optional[int] = None,
        audit_canary_kind: str = "dirac",
        audit_seed: Optional[int] = None,
    ):
        """Return ``(module, optimizer, data_loader)`` ready for DP-SGD.

        ``module`` is a :class:`GradSampleModule` holding the model, or with ``wrap_model=False`` the
        :class:`GradSampleHooks` controller attached to the untouched model (Opacus 1.6's
        ``hooks, optimizer, data_loader = engine.make_private(..., wrap_model=False)``; train the
        model itself, ``hooks.cleanup()`` at the end). A model compiled with ``torch.compile`` is taken with
        ``wrap_model=False`` only: the controller attaches to the model it compiled, the loop keeps calling the
        compiled one, and its private forwards run eagerly (docs/errors.md).

        ``noise_mechanism="bandmf"`` with ``bands=b`` adds banded matrix-factorisation noise
        (correlated across steps, docs/correlated-noise.md) instead of independent noise: the data
        loader is rebuilt as b-min-separated cyclic Poisson sampling with the same expected batch
        size, the strategy is optimised for ``planned_steps`` steps (default: one epoch), and the
        accountant records the amplified banded MF reduction (ceil(steps / b) sampled Gaussians).

        ``clipping`` is "flat", "per_layer", "automatic" (``gamma``, default 0.01; sensitivity 1,
        ``max_grad_norm`` unused) or "adaptive" (``max_grad_norm`` is the starting bound;
        ``target_unclipped_quantile``, ``clipbound_learning_rate``, ``max_clipbound``,
        ``min_clipbound``, ``unclipped_num_std`` as in Opacus). ``clipping_stats`` ("raw" or
        "private") records clipping statistics per step (docs/clipping.md).

        With ``criterion=`` (Opacus' argument) it returns ``(module, optimizer, criterion,
        data_loader)``, the criterion wrapped in :class:`~dptorch.grad_sample.capture.dp_loss.DPLoss` (one loss per sample,
        ``loss.backward()`` is one backward pass), in every ``grad_sample_mode``; the mode alone
        never changes the shape. ``grad_sample_mode="auto"`` (the default) runs an exact
        mode for the optimizer's parameters: ``"bk"`` when one of them is in a layer with a norm
        sampler, else ``"hooks"`` (:mod:`dptorch.grad_sample.modes.auto`); the mode that ran is logged
        (logger ``dptorch.engine``, info), is ``engine.grad_sample_mode`` and is in ``privacy_report``.
        ``poisson_sampling=False`` keeps the loader's own fixed-size batches (shuffled or in order) and
        accounts each pass over the data as one Gaussian of noise multiplier ``noise_multiplier / 2``
        at sample rate 1, with no amplification (:mod:`dptorch.data.shuffled`): a sound bound, much
        larger than the Poisson figure at the same noise; Poisson sampling is the default for that.
        A data loader whose sampler Poisson sampling would replace without a word (weights, a subset,
        a custom order) is refused, and so is an empty dataset. ``noise_generator`` is a ``torch.Generator`` (as in Opacus) or a
        :class:`~dptorch.noise.NoiseGenerator`. ``noise_multiplier=0`` is accepted with a warning:
        clipping only, no privacy, and ``get_epsilon`` returns infinity. Under a process group of several
        ranks every rank must build the same plan (same dataset length, batch size, noise, clipping, accountant,
        ...): a difference is refused on every rank with one message (:mod:`dptorch.distributed.agreement`).
        ``model_loss="mean"`` (or ``"sum"``), for a HuggingFace model whose forward computes its loss through
        ``self.loss_function``, makes ``outputs.loss`` per-sample: each unit's mean (sum) over its own target
        tokens, reduced over the rows as ``loss_reduction`` says (:mod:`dptorch.grad_sample.capture.model_loss`).
        ``audit_canaries=m`` adds ``m`` gradient canaries to every step (``audit_canary_kind`` "dirac" or "random",
        ``audit_seed``; :mod:`dptorch.optim.canaries`): extra privacy units for the one-run audit of this very run,
        ``engine.audit_canaries``; ``dptorch.auditing.audit_run(engine, delta=...)`` turns their scores into
        lower bounds on epsilon (docs/auditing.md). Without it nothing of the run changes.
        """
        options = clipping_plan_fields(
            clipping, gamma=gamma, target_unclipped_quantile=target_unclipped_quantile,
            clipbound_learning_rate=clipbound_learning_rate, max_clipbound=max_clipbound, min_clipbound=min_clipbound,
            unclipped_num_std=unclipped_num_std, clipping_stats=clipping_stats,
        ) if clipping in CLIPPING_MODES else {}
        deepspeed_engine, module, optimizer = _deepspeed_parts(module, optimizer)
        wrap_model = wrap_model and deepspeed_engine is None
        module = _uncompiled_root(module, wrap_model)
        dp_loader = self._check_and_prepare(module, optimizer, data_loader, poisson_sampling, clipping, max_grad_norm,
                                            bands=_check_mechanism(noise_mechanism, bands))
        options.update(_mechanism_fields(noise_mechanism, bands, planned_steps or dp_loader.batch_sampler.steps))
        plan = PrivacyPlan.for_sampler(dp_loader.batch_sampler, noise_multiplier=noise_multiplier,
                                       **self._plan_fields(max_grad_norm, clipping, options))
        check_ranks_agree(plan, loss_reduction=loss_reduction)  # one plan on every rank, or every rank refuses
        made = self._attach(module, optimizer, dp_loader, plan, batch_first=batch_first, loss_reduction=loss_reduction,
                            grad_sample_mode=grad_sample_mode, wrap_model=wrap_model, noise_generator=noise_generator,
                            strict=strict, criterion=criterion, model_loss=model_loss, audit_canaries=audit_canaries,
                            audit_canary_kind=audit_canary_kind, audit_seed=audit_seed)
        return self._onto_deepspeed(deepspeed_engine, made)

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        max_grad_norm: Union[float, Sequence[float]],
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        **kwargs: Any,
    ):
        """``make_private`` with the smallest noise multiplier that meets ``(target_epsilon, target_delta)``.

        The noise is calibrated at exactly the sample rate the Poisson sampler draws with and the
        steps the run takes: ``steps``, or ``epochs`` passes over the returned loader
        (``epochs * len(loader)`` draws), with this engine's accountant (not 'gdp'). Returns what
        ``make_private`` returns for the same arguments (with ``criterion=``: four items).
        ``noise_mechanism="bandmf", bands="auto"`` picks the bands of lowest expected prefix-sum error
        at the target, b = 1 (DP-SGD's noise) where no banded strategy is lower
        (:func:`~dptorch.noise.banded.choose_bands`).
        """
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs or steps")
        deepspeed_engine, module, optimizer = _deepspeed_parts(module, optimizer)
        if deepspeed_engine is not None:
            kwargs["wrap_model"] = False
        module = _uncompiled_root(module, kwargs.get("wrap_model", True))
        clipping = kwargs.pop("clipping", "flat")
        poisson_sampling = kwargs.pop("poisson_sampling", True)
        option_names = ("gamma", "target_unclipped_quantile", "clipbound_learning_rate", "max_clipbound",
                        "min_clipbound", "unclipped_num_std", "clipping_stats")
        given = {name: kwargs.pop(name) for name in option_names if name in kwargs}
        options = clipping_plan_fields(clipping, **given) if clipping in CLIPPING_MODES else {}
        noise_mechanism, bands = kwargs.pop("noise_mechanism", "independent"), kwargs.pop("bands", None)
        if noise_mechanism == "bandmf" and bands == "auto":
            bands = auto_bands(
                data_loader,
                lambda: self._check_and_prepare(module, optimizer, data_loader, poisson_sampling, clipping,
                                                max_grad_norm, bands=1),
                target_epsilon=target_epsilon, target_delta=target_delta, accountant=self.accountant.mechanism,
                horizon=lambda probe: planned_steps_of(probe.batch_sampler.steps, epochs, steps),
            )
        dp_loader = self._check_and_prepare(module, optimizer, data_loader, poisson_sampling, clipping, max_grad_norm,
                                            bands=_check_mechanism(noise_mechanism, bands))
        horizon = planned_steps_of(dp_loader.batch_sampler.steps, epochs, steps)
        options.update(_mechanism_fields(noise_mechanism, bands, horizon))
        plan = PrivacyPlan.calibrated(
            target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs, steps=steps,
            **sampler_fields(dp_loader.batch_sampler), **self._plan_fields(max_grad_norm, clipping, options),
        )
        check_ranks_agree(plan, loss_reduction=kwargs.get("loss_reduction", "mean"))  # before a check of this rank's N
        check_delta_for_units(target_delta, plan.num_units, "target_delta")
        return self._onto_deepspeed(deepspeed_engine, self._attach(module, optimizer, dp_loader, plan, **kwargs))

    def _onto_deepspeed(self, deepspeed_engine: Any, made: tuple) -> tuple:
        """``made`` as is, or under DeepSpeed the engine in the model's place, its ``step()`` now the DP optimizer's."""
        if deepspeed_engine is None:
            return made
        if self.audit_canaries is not None:
            self.detach()
            raise CanaryError("audit canaries refused under DeepSpeed: its partitions hold the clipped sums; audit the "
                              "same model on one process or under DDP")
        ds_zero.attach(deepspeed_engine, self.optimizer)
        self._deepspeed_engine = deepspeed_engine
        return (deepspeed_engine, *made[1:])

    # ------------------------------------------------------------------ compatibility (Opacus' names)

    def is_compatible(
        self, *, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
        data_loader: Optional[DataLoader] = None,
    ) -> bool:
        """True when ``make_private`` would accept these objects as they are (Opacus' name).

        Beyond Opacus, which checks the model only, this also checks what ``make_private`` would
        refuse: a model in eval mode, optimizer parameters that are not the model's, and a data
        loader whose sample rate cannot be derived. Changes nothing, draws no random number.
        """
        return not self.compatibility_problems(module=module, optimizer=optimizer, data_loader=data_loader)

    def validate(
        self, *, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
        data_loader: Optional[DataLoader] = None,
    ) -> None:
        """``is_compatible`` that raises: ``UnsupportedModuleError`` naming each incompatible module
        and its fix (as Opacus), else ``ValueError`` listing the optimizer and data loader problems."""
        ModuleValidator.validate(module, strict=True)
        problems = self.compatibility_problems(module=module, optimizer=optimizer, data_loader=data_loader)
        if problems:
            raise ValueError("make_private would refuse this set-up:\n" + "\n".join(f"  - {p}" for p in problems))

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """A compatible deep copy of ``module`` (``ModuleValidator.fix``, which also validates the result).

        Build the optimizer from the returned model's parameters, as with Opacus.
        """
        return ModuleValidator.fix(module)

    def compatibility_problems(
        self, *, module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
        data_loader: Optional[DataLoader] = None,
    ) -> List[str]:
        """Every reason ``make_private`` would refuse these objects (empty when it would accept them)."""
        problems = [str(problem) for problem in ModuleValidator.validate(module)]
        if not module.training:
            problems.append("the model is in eval mode; call model.train() before make_private")
        if optimizer is not None:
            try:
                _check_optimizer_params_in_model(module, optimizer)
            except ValueError as err:
                problems.append(str(err))
        if data_loader is not None:
            problem = _data_loader_problem(data_loader, self.secure_mode)
            if problem is not None:
                problems.append(problem)
        return problems

    def _check_and_prepare(self, module, optimizer, data_loader, poisson_sampling, clipping, max_grad_norm,
                           bands: Optional[int] = None) -> DPDataLoader:
        """Every check that needs no plan, then the Poisson loader; nothing is attached yet."""
        if self.hooks is not None and self.hooks.attached:
            raise RuntimeError("this PrivacyEngine already made a model private; call engine.detach() first")
        if isinstance(module, GradSampleModule) or any(is_attached(m) for m in module.modules()):
            raise RuntimeError(
                f"{type(module).__name__} is already private (it is, or holds, a model with per-sample gradient hooks "
                "from an earlier make_private): a second engine would clip and noise every step twice and both would "
                "count its privacy. Keep using the first engine's model and optimizer, or call detach() on it first"
            )
        _check_optimizer_params_in_model(module, optimizer)
        if not module.training:
            raise ValueError("the model is in eval mode; call model.train() before make_private (eval mode captures no per-sample gradients)")
        names = {p: n for n, p in module.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        check_clipping(clipping, max_grad_norm, params, [names.get(p, "?") for p in params])
        if poisson_sampling or bands is not None:
            _check_source_loader(data_loader)
        tensor_parallel = check_sharding(module)  # TP: every rank trains on one batch (dptorch.distributed.tensor_parallel)
        if tensor_parallel and (bands is not None or not poisson_sampling):
            raise ValueError("tensor parallelism is supported with Poisson sampling and independent noise only (not "
                             "poisson_sampling=False, not bandmf's correlated noise)")
        data_parallel = data_parallel_group(tensor_parallel)
        if bands is not None:  # bandmf: b-min-separated cyclic Poisson sampling
            dp_loader = cyclic_data_loader(data_loader, bands, poisson_sampling, self.secure_mode)
        else:
            dp_loader = _private_data_loader(data_loader, poisson_sampling, self.secure_mode, data_parallel=data_parallel)
        if tensor_parallel:
            mirror_draws(dp_loader.batch_sampler, tensor_parallel_group(tensor_parallel), data_parallel)
        if isinstance(dp_loader, ShuffledDataLoader):
            logger.info("poisson_sampling=False: the loader's shuffled batches of %d are accounted without "
                        "amplification, one Gaussian per pass", dp_loader.batch_sampler.batch_size)
        elif dp_loader is not data_loader:
            logger.info("the data loader's sampler was replaced by Poisson sampling at sample rate %.4g (expected "
                        "batch %.4g on this process)", dp_loader.batch_sampler.sample_rate,
                        dp_loader.batch_sampler.expected_batch_size)
        check_sharded_for_process_group(dp_loader.batch_sampler)  # every loader kind, given or rebuilt
        return dp_loader

    def _plan_fields(self, max_grad_norm, clipping, options=None) -> Dict[str, Any]:
        return dict(max_grad_norm=max_grad_norm, clipping=clipping, accountant=self.accountant,
                    secure_mode=self.secure_mode, track_draws=True, **(options or {}))

    def _attach(self, module, optimizer, dp_loader, plan, *, batch_first=True, loss_reduction="mean",
                grad_sample_mode="auto", wrap_model=True, noise_generator=None, strict=True, criterion=None,
                model_loss=None, audit_canaries=None, audit_canary_kind="dirac", audit_seed=None):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        ran = resolve_grad_sample_mode(grad_sample_mode, module, params)
        logger.info(describe_mode(grad_sample_mode, ran))
        grad_sample_mode = ran
        if noise_generator is not None and self.secure_mode and not isinstance(noise_generator, SecureNoiseGenerator):
            raise ValueError(
                "secure_mode=True draws the noise from the OS CSPRNG, and a noise_generator (a seedable, replayable "
                "stream) would replace it: remove noise_generator, or use PrivacyEngine(secure_mode=False)"
            )
        noise_generator = as_noise_generator(noise_generator)  # a torch.Generator becomes a NoiseGenerator
        if plan.noise_multiplier == 0:
            warnings.warn(
                "noise_multiplier=0: the gradients are clipped but no noise is added, so the training is not "
                "differentially private (get_epsilon returns inf); use it only as a clipping-only ablation",
                UserWarning,
                stacklevel=3,
            )
        if self.plan is not None:  # a second make_private on this engine: its steps add to the same budget
            plan.steps, plan.unprotected_steps = self.plan.steps, self.plan.unprotected_steps
        hooks_kwargs = dict(batch_first=batch_first, loss_reduction=loss_reduction, strict=strict,
                            grad_sample_mode=grad_sample_mode, keep_param_grads=False)
        if wrap_model:
            returned = GradSampleModule(module, **hooks_kwargs)
            hooks = returned.hooks
        else:
            hooks = GradSampleHooks(module, **hooks_kwargs)
            returned = hooks  # Opacus 1.6: the controller; the model stays in the caller's variable
        try:
            hooks.use_model_loss(model_loss)
            optimizer_class = AdaClipDPOptimizer if plan.clipping == "adaptive" else DPOptimizer  # Opacus' class
            dp_optimizer = optimizer_class(
                optimizer,
                hooks=hooks,
                plan=plan,
                loss_reduction=loss_reduction,
                noise_generator=noise_generator
                or _default_noise_generator(self.secure_mode, _parameter_device(optimizer)),
                secure_mode=self.secure_mode,
            )
            canaries = None if audit_canaries is None else GradientCanaries.attach(
                dp_optimizer, audit_canaries, kind=audit_canary_kind, seed=audit_seed)
        except Exception:
            hooks.cleanup()
            raise
        self.audit_canaries = canaries
        self.hooks, self.optimizer, self.plan = hooks, dp_optimizer, plan
        self.grad_sample_mode = grad_sample_mode
        dp_loader.privacy_plan = plan  # the loader reports every draw it hands out to the plan
        if criterion is not None:  # Opacus' shape: the caller asked for the wrapped criterion
            return returned, dp_optimizer, DPLoss(criterion, hooks), dp_loader
        return returned, dp_optimizer, dp_loader

    def detach(self) -> None:
        """Remove the controller and the optimizer's listener; the model is exactly as before."""
        if self.optimizer is not None:
            self.optimizer.detach()
        if self.hooks is not None:
            self.hooks.cleanup()
        if getattr(self, "_deepspeed_engine", None) is not None:
            ds_zero.detach(self.__dict__.pop("_deepspeed_engine"))

    # ------------------------------------------------------------------ accounting

    def get_epsilon(self, delta: float) -> float:
        """The epsilon spent so far at ``delta`` (infinite once a step ran with noise_multiplier=0).

        ``delta`` must be in (0, 1) and below 1/N for the N samples (privacy units) the data loader
        draws from, as for ``make_private_with_epsilon``'s ``target_delta`` and the private Trainer's:
        a delta of 1/N or more allows publishing a sample outright, so an epsilon at it is refused
        (``ValueError``) rather than reported (it would often be 0).
        """
        if self.plan is None:
            return self.accountant.get_epsilon(delta)
        return self.plan.epsilon(delta)

    def privacy_report(self, delta: float) -> Dict[str, Any]:
        """What a model card needs, in the private Trainer's vocabulary (``dptorch.accounting.report``): epsilon,
        delta, accountant, noise multiplier, clipping bound (``max_grad_norm``), sample rate, steps,
        privacy unit and number of units, the per-sample gradient mode that ran, dptorch's version."""
        if self.plan is None:
            return {"epsilon": self.get_epsilon(delta), "delta": delta, "steps": len(self.accountant),
                    "accountant": self.accountant.mechanism, "secure_mode": self.secure_mode}
        return privacy_report(self.plan, delta, grad_sample_mode=self.grad_sample_mode, privacy_unit="row")

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        path: Union[str, os.PathLike, Any] = None,
        *,
        module: nn.Module,
        optimizer: Optional[DPOptimizer] = None,
        data_loader: Optional[DataLoader] = None,
        extra: Optional[Dict[str, Any]] = None,
        optimizer_scheduler: Optional[Any] = None,
        noise_scheduler: Optional[Any] = None,
        grad_clip_scheduler: Optional[Any] = None,
        checkpoint_dict: Optional[Dict[str, Any]] = None,
        module_state_dict_kwargs: Optional[Dict[str, Any]] = None,
        torch_save_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        """Save everything a run needs to continue exactly: weights, optimizer with its
        accumulator and noise RNG, accountant history, sampler state and torch's RNG.

        Takes Opacus' keywords and writes Opacus' layout: ``module_state_dict`` (the unwrapped
        model's keys), ``privacy_accountant_state_dict``, ``optimizer_state_dict``,
        ``scheduler_state_dict`` (``optimizer_scheduler``), ``noise_scheduler_state_dict``,
        ``grad_clip_scheduler_state_dict``, and the entries of ``checkpoint_dict`` and ``extra``
        at the top level (a name the checkpoint uses itself is refused). What only dptorch needs
        (privacy plan, sampler position with ``data_loader=``, torch's RNG) is under ``"dptorch"``.
        ``path`` may be a file object; a file path is written atomically (a run killed mid-save
        keeps its previous checkpoint). ``checkpoint_dict`` is not modified. An FSDP2-sharded model
        (HSDP included) is saved to the directory ``path`` by every rank together: weights and inner
        optimizer state through ``torch.distributed.checkpoint``, the rest by rank 0
        (:mod:`dptorch.distributed.checkpoint`); ``load_checkpoint(path)`` on every rank reads it.
        """
        if path is None:
            raise TypeError("save_checkpoint needs path=")
        if ds_zero.is_deepspeed_engine(module) or any(hasattr(p, "ds_id") for p in _unwrap(module).parameters()):
            raise NotImplementedError(
                "save_checkpoint of a DeepSpeed engine (or of a model ZeRO-3 partitions, whose parameters hold no "
                "elements outside their layer's call) is refused: DeepSpeed owns the partitioned weights and optimizer "
                "state. Save with DeepSpeed's engine.save_checkpoint, or train through DPTrainer, whose checkpoints "
                "keep DeepSpeed's state and the privacy state together and resume exactly"
            )
        user = _user_entries(checkpoint_dict, extra)
        state: Dict[str, Any] = dict(user)
        target = _unwrap(module)
        sharded = is_sharded_model(target)  # FSDP2: weights and optimizer state go through DCP
        if not sharded:
            state["module_state_dict"] = target.state_dict(**(module_state_dict_kwargs or {}))
        state["privacy_accountant_state_dict"] = self.accountant.state_dict()
        if optimizer is not None:
            state["optimizer_state_dict"] = _dp_entry(optimizer) if sharded else optimizer.state_dict()
        for key, scheduler in _schedulers_given(optimizer_scheduler, noise_scheduler, grad_clip_scheduler):
            state[key] = scheduler.state_dict()
        ours: Dict[str, Any] = {
            "version": _CHECKPOINT_VERSION,
            "plan": self.plan.state_dict() if self.plan is not None else None,
            "torch_rng_state": torch.get_rng_state(),
            "user_keys": sorted(user),
        }
        if data_loader is not None and hasattr(data_loader, "state_dict"):
            ours["data_loader"] = data_loader.state_dict()
        state[_OURS] = ours
        if sharded:  # a directory: every rank writes its shards, rank 0 the rest
            save_sharded(path, target, optimizer.original_optimizer if optimizer is not None else None, state)
            return
        if not isinstance(path, (str, os.PathLike)):  # a file object, as Opacus allows
            torch.save(state, path, **(torch_save_kwargs or {}))
            return
        tmp = f"{os.fspath(path)}.tmp"
        torch.save(state, tmp, **(torch_save_kwargs or {}))
        os.replace(tmp, path)  # a run killed mid-save keeps its previous checkpoint

    def load_checkpoint(
        self,
        path: Union[str, os.PathLike, Any] = None,
        *,
        module: nn.Module,
        optimizer: Optional[DPOptimizer] = None,
        data_loader: Optional[DataLoader] = None,
        optimizer_scheduler: Optional[Any] = None,
        noise_scheduler: Optional[Any] = None,
        grad_clip_scheduler: Optional[Any] = None,
        module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
        torch_load_kwargs: Optional[Dict[str, Any]] = None,
    ) -> Dict[str, Any]:
        """Restore a checkpoint and return it, as Opacus does: the checkpoint dict, with the caller's
        entries (``checkpoint_dict``, ``extra``) at the top level and the optimizer and scheduler
        states taken out.

        Reads checkpoints of ``save_checkpoint``, of earlier dptorch versions, and Opacus 1.6
        checkpoint files: their weights (``_module.`` prefixes of Opacus' wrapper are dropped),
        optimizer state and accountant history (each step's noise multiplier and sample rate), so
        a run started with Opacus continues here with the same epsilon. A dptorch checkpoint of a
        run that sampled differently (sample rate, steps per epoch, dataset size) is refused
        before anything is loaded. Loads with ``weights_only=True`` unless ``torch_load_kwargs``
        says otherwise.
        """
        if path is None:
            raise TypeError("load_checkpoint needs path=")
        sharded = is_sharded_checkpoint(path)  # a directory of save_checkpoint under FSDP2
        load_kwargs = {"weights_only": True, **(torch_load_kwargs or {})}
        checkpoint = read_state(path, **load_kwargs) if sharded else _normalised_checkpoint(torch.load(path, **load_kwargs))
        ours = checkpoint.get(_OURS)
        if ours is None or not (self.plan is not None and ours.get("plan") is not None):
            self._check_selection_of(checkpoint["privacy_accountant_state_dict"])
        if ours is None:  # an Opacus checkpoint: the accountant history is all the privacy state it has
            self._load_opacus_accountant(checkpoint["privacy_accountant_state_dict"])
        elif self.plan is not None and ours.get("plan") is not None:
            self.plan.load_state_dict(ours["plan"])  # refuses a different sampling before anything is loaded
        else:  # no plan here yet, or a checkpoint written before checkpoints held the plan
            self.accountant.load_state_dict(checkpoint["privacy_accountant_state_dict"])
            if self.plan is not None:
                self.plan.steps = len(self.accountant)
        target = _unwrap(module)
        optimizer_state = checkpoint.pop("optimizer_state_dict", None)
        if sharded:
            load_sharded(path, target, optimizer.original_optimizer if optimizer is not None and optimizer_state else None)
        else:
            target.load_state_dict(_matching_keys(checkpoint["module_state_dict"], target),
                                   **(module_load_dict_kwargs or {}))
        if ours is not None and ours.get("torch_rng_state") is not None:
            torch.set_rng_state(ours["torch_rng_state"])
        if optimizer is not None and optimizer_state and sharded:  # the inner state came through DCP
            optimizer.load_state_dict({**optimizer.original_optimizer.state_dict(), **optimizer_state})
        elif optimizer is not None and optimizer_state:
            optimizer.load_state_dict(optimizer_state)
        elif optimizer is not None or optimizer_state:
            warnings.warn(
                "the checkpoint has no optimizer state, so the optimizer starts afresh" if optimizer is not None
                else "the checkpoint holds an optimizer state but no optimizer= was given, so it is not restored",
                UserWarning, stacklevel=2,
            )
        for key, scheduler in _schedulers_given(optimizer_scheduler, noise_scheduler, grad_clip_scheduler):
            saved = checkpoint.pop(key, None)
            if saved is None and key == "scheduler_state_dict":
                saved = checkpoint.pop("optimizer_scheduler_state_dict", None)
            if saved is None:
                warnings.warn(f"the checkpoint has no {key}; the scheduler starts afresh", UserWarning, stacklevel=2)
            else:
                scheduler.load_state_dict(saved)
        for key in _SCHEDULER_STATE_KEYS:
            checkpoint.pop(key, None)
        if data_loader is not None and ours is not None and "data_loader" in ours:
            data_loader.load_state_dict(ours["data_loader"])
        return checkpoint

    def _check_selection_of(self, state: Any) -> None:
        """Refuse an accountant state whose steps selected their batches otherwise than this run does."""
        saved = state.get("selection") if isinstance(state, dict) else None
        if self.plan is not None and Selection.from_dict(saved) != self.plan.selection:
            raise ValueError(
                f"the checkpoint's accountant composed {Selection.from_dict(saved).kind} batch selection, this run "
                f"selects by {self.plan.selection.kind}: the resumed run would not continue the accounted one. Resume "
                "with the data loader the checkpoint was written with"
            )

    def _load_opacus_accountant(self, state: Dict[str, Any]) -> None:
        """Take the step history of an Opacus accountant state (``{"history": [(sigma, q, steps), ...],
        "mechanism": ...}``): the history is the same whatever accountant composes it."""
        if not isinstance(state, dict) or "history" not in state:
            raise ValueError("the checkpoint's privacy_accountant_state_dict has no 'history' of steps")
        history, unprotected = [], 0
        for index, entry in enumerate(state["history"]):
            if len(entry) != 3:
                raise ValueError(
                    f"accountant history[{index}] must be (noise_multiplier, sample_rate, steps), got {entry!r}"
                )
            sigma, q, count = float(entry[0]), float(entry[1]), int(entry[2])
            if sigma == 0:
                unprotected += count
            else:
                history.append([sigma, q, count])
        if unprotected and self.plan is None:
            raise ValueError(
                f"the Opacus run took {unprotected} step(s) with noise_multiplier=0, so its epsilon is infinite; call "
                "load_checkpoint after make_private, whose privacy plan records such steps"
            )
        mechanism = str(state.get("mechanism", ""))
        if mechanism and mechanism != self.accountant.mechanism:
            warnings.warn(
                f"the Opacus checkpoint was accounted with {mechanism!r}, this engine accounts with "
                f"{self.accountant.mechanism!r}: the same steps are composed by another method, so epsilon may differ "
                f"slightly; use PrivacyEngine(accountant={mechanism!r}) for Opacus' figure",
                UserWarning, stacklevel=3,
            )
        self.accountant.load_state_dict({"mechanism": str(self.accountant.mechanism), "history": history})
        if self.plan is not None:
            self.plan.unprotected_steps = unprotected
            self.plan.steps = len(self.accountant) + unprotected
            if history and self.plan.sample_rate is not None and history[-1][1] != self.plan.sample_rate:
                warnings.warn(
                    f"the Opacus run's last steps sampled at q={history[-1][1]:g}, this run samples at "
                    f"q={self.plan.sample_rate:g} (another dataset size or batch size): epsilon accounts each step at "
                    "its own rate, but the resumed run is not the one that was started",
                    UserWarning, stacklevel=3,
                )


#: Where dptorch keeps what only it needs in a checkpoint (plan, sampler, torch's RNG).
_OURS = "dptorch"
_CHECKPOINT_VERSION = 2
_SCHEDULER_STATE_KEYS = ("scheduler_state_dict", "noise_scheduler_state_dict", "grad_clip_scheduler_state_dict")
_RESERVED_KEYS = frozenset({"module_state_dict", "privacy_accountant_state_dict", "optimizer_state_dict",
                            "optimizer_scheduler_state_dict", _OURS, *_SCHEDULER_STATE_KEYS})


def _dp_entry(optimizer: DPOptimizer) -> Dict[str, Any]:
    """The DP optimizer's own state (noise generator, flags) for a sharded checkpoint, whose inner state goes
    through DCP; refused mid-step, while clipped sums (this rank's shards) are held for the next step."""
    if optimizer.accumulated_iterations:
        raise ValueError(
            f"save_checkpoint of an FSDP2-sharded run while {optimizer.accumulated_iterations} backward pass(es) of "
            "clipped gradients are held for the next step (virtual steps): those sums are sharded across the ranks. "
            "Save after optimizer.step()"
        )
    dp = dict(optimizer.state_dict()["dp"])
    dp["summed"] = {}
    return {"dp": dp}


def _schedulers_given(optimizer_scheduler: Any, noise_scheduler: Any, grad_clip_scheduler: Any):
    """``(checkpoint key, scheduler)`` of each scheduler given."""
    given = zip(_SCHEDULER_STATE_KEYS, (optimizer_scheduler, noise_scheduler, grad_clip_scheduler))
    return [(key, scheduler) for key, scheduler in given if scheduler is not None]


def _user_entries(checkpoint_dict: Optional[Dict[str, Any]], extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The caller's entries (Opacus' ``checkpoint_dict``, dptorch's ``extra``), checked against the checkpoint's own."""
    entries: Dict[str, Any] = {}
    for source in (checkpoint_dict or {}, extra or {}):
        clash = sorted(set(source) & (_RESERVED_KEYS | set(entries)))
        if clash:
            raise ValueError(
                f"checkpoint entries {clash} clash with the checkpoint's own entries or with each other; rename them"
            )
        entries.update(source)
    return entries


def _normalised_checkpoint(state: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint in the current layout: files of dptorch before version 2 are translated."""
    if not isinstance(state, dict):
        raise ValueError(f"a checkpoint is a dict, got {type(state).__name__}")
    if "module_state_dict" in state:  # this version's layout, or Opacus'
        if "privacy_accountant_state_dict" not in state:
            raise ValueError("the checkpoint has module_state_dict but no privacy_accountant_state_dict")
        return dict(state)
    if "module" in state and "accountant" in state:  # dptorch before version 2
        checkpoint = dict(state.get("extra") or {})
        checkpoint["module_state_dict"] = state["module"]
        checkpoint["privacy_accountant_state_dict"] = state["accountant"]
        if "optimizer" in state:
            checkpoint["optimizer_state_dict"] = state["optimizer"]
        ours = {"version": 1, "plan": state.get("plan"), "torch_rng_state": state.get("torch_rng_state")}
        if "data_loader" in state:
            ours["data_loader"] = state["data_loader"]
        checkpoint[_OURS] = ours
        return checkpoint
    raise ValueError(
        f"not a checkpoint of dptorch or Opacus (keys: {_name_list(sorted(map(str, state)), 8)}); expected "
        "module_state_dict and "
        "privacy_accountant_state_dict"
    )


def _matching_keys(saved: Dict[str, Any], module: nn.Module) -> Dict[str, Any]:
    """``saved`` with the wrapper prefixes Opacus writes (``_module.``, DDP's ``module.``) dropped
    when the model's own keys do not have them."""
    wanted = set(module.state_dict())
    keys = set(saved)
    while keys and not keys <= wanted:
        for prefix in ("_module.", "module."):
            if all(key.startswith(prefix) for key in keys):
                saved = {key[len(prefix):]: value for key, value in saved.items()}
                keys = set(saved)
                break
        else:
            break
    return saved


def _default_noise_generator(secure_mode: bool, device: Any = "cpu") -> Optional[NoiseGenerator]:
    """Seeded from torch's global RNG, so ``torch.manual_seed`` makes a run reproducible; on the
    parameters' device, so the noise is drawn where it is added."""
    if secure_mode:
        return None  # the optimizer builds the secure generator
    return NoiseGenerator(seed=int(torch.randint(0, 2**62, (1,)).item()), device=device)


def _deepspeed_parts(module: nn.Module, optimizer: Any) -> tuple:
    """``(DeepSpeed engine or None, model, optimizer)``: under DeepSpeed ZeRO 1/2 the controller goes on the engine's
    model and the DP optimizer hands its gradient to DeepSpeed (:mod:`dptorch.distributed.deepspeed`)."""
    if not ds_zero.is_deepspeed_engine(module):
        return None, module, optimizer
    ds_zero.check_engine(module, optimizer)
    return module, module.module, ds_zero.DeepSpeedHandOver(module)


def _parameter_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """The device of the optimizer's first trainable parameter (CPU when it has none)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                return param.device
    return torch.device("cpu")


def _unwrap(module: nn.Module) -> nn.Module:
    """The user's model behind a GradSampleModule or a controller (what make_private returned)."""
    if isinstance(module, GradSampleHooks):
        return module.module
    return module._module if isinstance(module, GradSampleModule) else module


def _uncompiled_root(module: nn.Module, wrap_model: bool) -> nn.Module:
    """The module the controller attaches to: ``module``, or for a model compiled with ``torch.compile`` the model it
    compiled (``_orig_mod``; the caller keeps calling the compiled one, as after compiling a model made private).
    Refused with ``wrap_model=True`` (a wrapper around a compiled model would run its own root hook before Dynamo's
    call, so the private forward would meet the tracker under Dynamo)."""
    compiled = [f"submodule {name!r}" if name else "the model" for name, m in module.named_modules() if _is_compiled(m)]
    if not compiled:
        return module
    if wrap_model:
        raise ValueError(
            f"{_name_list(compiled)} {'is' if len(compiled) == 1 else 'are'} compiled with torch.compile, and "
            "make_private would wrap it (wrap_model=True). Pass wrap_model=False and keep calling your compiled model: "
            "the controller attaches to the model it compiled, its private forwards run eagerly under the batch "
            "tracker (Dynamo compiled around the tracker into wrong values in torch 2.13), and evaluation outside "
            "the loop runs compiled. Or pass the uncompiled model (compiled_model._orig_mod)"
        )
    return module._orig_mod if _is_compiled(module) else module


def _is_compiled(module: nn.Module) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing was compiled
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _check_optimizer_params_in_model(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_params = {id(p) for p in module.parameters()}
    foreign = [
        tuple(p.shape) for group in optimizer.param_groups for p in group["params"] if id(p) not in model_params
    ]
    if foreign:
        raise ValueError(
            f"Module parameters are different than optimizer Parameters: the optimizer holds {len(foreign)} "
            f"parameter(s) that are not in the model (shapes "
            f"{_name_list([str(shape) for shape in foreign])}); "
            "ModuleValidator.fix and get_peft_model return a new model, so build the optimizer from "
            "model.parameters() of the model you pass, after them"
        )


def _check_source_loader(data_loader: DataLoader) -> None:
    """Refuse, with the reason, a plain loader over an empty dataset or with a sampler Poisson
    sampling would silently replace (``check_sampler_replaceable``)."""
    if isinstance(data_loader, DPDataLoader):
        return
    try:
        size = len(data_loader.dataset)
    except TypeError:  # an iterable dataset: the map-style check says why it is refused
        return
    if size == 0:
        raise ValueError(
            "the data loader's dataset is empty (0 samples): there is nothing to train on, and no sample rate "
            "(batch size / N) or delta below 1/N exists for N = 0"
        )
    try:
        len(data_loader)
    except TypeError:  # no length: DPDataLoader.from_data_loader says why that is refused
        return
    check_sampler_replaceable(data_loader)


def _data_loader_problem(data_loader: DataLoader, secure_mode: bool) -> Optional[str]:
    """Why ``make_private`` would refuse ``data_loader`` (None when it would accept it); builds nothing."""
    if isinstance(data_loader, DPDataLoader):
        if secure_mode and not data_loader.batch_sampler.secure:
            return "secure_mode=True needs a DPDataLoader built with secure_mode=True (its sampling is seeded)"
        try:
            check_sharded_for_process_group(data_loader.batch_sampler)
        except ValueError as err:
            return str(err)
        return None
    try:
        _check_source_loader(data_loader)
    except ValueError as err:
        return str(err)
    try:
        check_map_style(data_loader.dataset)
        if data_loader.batch_size is None and poisson_sampler_of(data_loader) is not None:
            return None
        if len(data_loader) == 0:
            return "the data loader yields no batches"
    except (TypeError, ValueError) as err:
        return f"cannot derive the sample rate from the data loader: {err}"
    return None


def _private_data_loader(data_loader: DataLoader, poisson_sampling: bool, secure_mode: bool = False,
                         data_parallel: Any = True) -> DPDataLoader:
    """``data_parallel``: whether the Poisson draws are sharded over the process group (True), over a
    group of its ranks (a group: tensor parallelism with FSDP2), or not at all (None: tensor parallelism)."""
    if isinstance(data_loader, DPDataLoader):
        if secure_mode and not data_loader.batch_sampler.secure:
            raise ValueError(
                "secure_mode=True needs the Poisson sampling to come from the OS CSPRNG too, but this DPDataLoader "
                "draws from a seeded torch generator (whoever learns its seed can replay which samples each batch "
                "holds); build it with DPDataLoader(..., secure_mode=True), or pass a plain DataLoader"
            )
        return data_loader
    if not poisson_sampling:  # the loader's own batches, accounted per pass (dptorch.data.shuffled)
        return ShuffledDataLoader(data_loader)
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    distributed = data_parallel if initialised and data_parallel is not None else False
    try:
        return DPDataLoader.from_data_loader(data_loader, distributed=distributed, secure_mode=secure_mode)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot derive the sample rate from the data loader: {err}") from err

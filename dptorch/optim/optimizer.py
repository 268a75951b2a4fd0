"""DPOptimizer: clip, accumulate, noise and scale, then let any torch optimizer step.

At the end of every backward pass the controller reports per-sample norms; the optimizer
turns them into clip factors and adds the clipped sum to its accumulator. Any number of backward
passes may precede a step (virtual steps, gradient accumulation): ``step()`` adds Gaussian noise
of std ``noise_multiplier * C`` exactly once per logical step, divides by the expected logical
batch size when ``loss_reduction="mean"``, writes ``p.grad`` and calls the inner optimizer.

The noise multiplier, clipping bound and expected batch size are read from a
:class:`~dptorch.plan.PrivacyPlan` (built from the keyword arguments when none is given), and each
logical step is reported to it: the plan checks the step against the Poisson draws the DP data
loader handed out, then accounts it.

Clipping modes (``dptorch.clipping.factors``): "flat", "per_layer", "automatic" (every unit
normalised by ``1 / (||g_i|| + gamma)``, sensitivity 1, noise std ``noise_multiplier``) and
"adaptive" (``dptorch.clipping.adaptive``: the bound follows a target quantile of the norms through
a noised count of unclipped units, accumulated over the backward passes of a logical step and
released once, at ``step()``, after the gradient noise). ``clipping_stats`` ("raw" or "private")
fills ``last_clipping_stats`` at every logical step; off by default (raw norms are private data).
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dptorch.accounting.validation import is_number
from dptorch.clipping.adaptive import clipping_plan_fields, unclipped_fraction
from dptorch.clipping.checks import check_clipping
from dptorch.clipping.factors import (
    NonFiniteGradientWarning,
    _wide,
    automatic_factors,
    clip_factors,
    drop_nonfinite,
    flat_norms,
    nonfinite_units,
    per_layer_thresholds,
)
from dptorch.distributed.agreement import check_ranks_agree
from dptorch.distributed.fsdp import ShardedParameters, any_sharded
from dptorch.distributed.tensor_parallel import (
    TensorParallelSlices,
    complete_norms,
    data_parallel_shard_layout,
    tensor_parallel_group,
)
from dptorch.grad_sample.capture.claims import check_sole_claim, controller_of
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.capture.hooks import GradSampleHooks
from dptorch.grad_sample.capture.rounds import _name_list
from dptorch.grad_sample.tracking import watch as draw_watch
from dptorch.noise import NoiseGenerator, SecureNoiseGenerator, as_noise_generator
from dptorch.optim.gradient_writer import GradientWriter, WholeParameters
from dptorch.optim.loss_scaling import plain_scaler_error, unscale_factors, unscale_norms
from dptorch.noise.banded.mechanism import attach_banded_noise
from dptorch.plan import PrivacyPlan, SamplingMismatchError

StepHook = Callable[["DPOptimizer"], None]


class DPOptimizer(torch.optim.Optimizer):
    """Differentially private wrapper around ``optimizer`` (SGD, Adam, AdamW, HF optimizers...).

    ``state``, ``param_groups``, ``defaults``, ``state_dict`` and ``load_state_dict`` are the
    inner optimizer's (the state dict also carries the accumulator and noise RNG), so LR
    schedulers, Accelerate and the HF Trainer work unchanged.

    ``hooks`` is the per-sample gradient controller; without it (Opacus' keywords only) the
    optimizer takes the one controller attached to its parameters (``GradSampleHooks``,
    ``GradSampleModule``, ``wrap_model(..., wrap_model=False)``) and is refused when there is none,
    or more than one.
    """

    #: The ``DPGradScaler`` that scales this optimizer's losses (fp16), set by it; None: unscaled losses.
    loss_scaler: Optional[Any] = None
    #: torch's GradScaler.step then calls step() itself (with ``grad_scale`` set), where it is refused.
    _step_supports_amp_scaling = True
    #: Audit canaries (``dptorch.optim.canaries.GradientCanaries``) added to every step's clipped sum, or None.
    canaries: Optional[Any] = None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        hooks: Optional[GradSampleHooks] = None,
        noise_multiplier: Optional[float] = None,
        max_grad_norm: Optional[Union[float, Sequence[float]]] = None,
        expected_batch_size: Optional[float] = None,
        loss_reduction: str = "mean",
        clipping: Optional[str] = None,
        noise_generator: Optional[Any] = None,
        secure_mode: bool = False,
        plan: Optional[PrivacyPlan] = None,
        gamma: Optional[float] = None,
        target_unclipped_quantile: Optional[float] = None,
        clipbound_learning_rate: Optional[float] = None,
        max_clipbound: Optional[float] = None,
        min_clipbound: Optional[float] = None,
        unclipped_num_std: Optional[float] = None,
        clipping_stats: Optional[str] = None,
        generator: Optional[Any] = None,
    ) -> None:
        if generator is not None:  # Opacus' DPOptimizer(generator=): the noise generator
            if noise_generator is not None:
                raise TypeError("pass the noise generator once: noise_generator= or Opacus' generator=, not both")
            noise_generator = generator
        options = dict(gamma=gamma, target_unclipped_quantile=target_unclipped_quantile,
                       clipbound_learning_rate=clipbound_learning_rate, max_clipbound=max_clipbound,
                       min_clipbound=min_clipbound, unclipped_num_std=unclipped_num_std, clipping_stats=clipping_stats)
        if plan is None:
            if noise_multiplier is None or max_grad_norm is None:
                raise TypeError("DPOptimizer needs noise_multiplier and max_grad_norm (or plan=PrivacyPlan(...))")
            plan = PrivacyPlan(
                noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, clipping=clipping or "flat",
                expected_batch_size=expected_batch_size, accountant=None, sampling=None, secure_mode=secure_mode,
                **clipping_plan_fields(clipping or "flat", **options),
            )
            check_ranks_agree(plan, loss_reduction=loss_reduction)  # a plan given was checked where it was built
        else:
            given = [name for name, value in (("noise_multiplier", noise_multiplier), ("max_grad_norm", max_grad_norm),
                     ("expected_batch_size", expected_batch_size), ("clipping", clipping), *options.items())
                     if value is not None]
            if given:
                raise TypeError(f"give either plan= or {', '.join(given)}: the plan already holds them")
            if plan.max_grad_norm is None:
                raise ValueError("the plan has no max_grad_norm: the optimizer needs the clipping bound")
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if hooks is None:
            hooks = controller_of(params)
        else:
            check_sole_claim(hooks, params)
        check_clipping(plan.clipping, plan.max_grad_norm, params, [hooks.parameter_name(p) for p in params])
        if loss_reduction == "mean" and not plan.expected_batch_size:
            raise ValueError("loss_reduction='mean' needs the expected logical batch size (expected_batch_size > 0)")
        # Not Optimizer.__init__: parameter groups and state belong to the inner optimizer.
        self.original_optimizer = optimizer
        #: The privacy plan: noise multiplier, clipping bound, expected batch size, and the accountant
        #: this optimizer reports every logical step to.
        self.plan = plan
        self.loss_reduction = loss_reduction
        self.secure_mode = secure_mode or plan.secure_mode
        # A torch.Generator (Opacus' noise_generator=) is adopted by a NoiseGenerator, so its state checkpoints.
        noise_generator = as_noise_generator(noise_generator)
        self.noise_generator = noise_generator or (SecureNoiseGenerator() if self.secure_mode else NoiseGenerator())
        self._summed: Dict[nn.Parameter, torch.Tensor] = {}
        #: Opacus' queue of virtual-step signals: ``step()`` takes the first (skip when True; a real step when empty).
        self._step_skip_queue: List[bool] = []
        self._last_step_skipped = False
        self._rounds_since_call = 0  # backward rounds since the last step() call, real or skipped (Opacus' count)
        self._accounted_draws: Optional[int] = None  # draws the step being taken accounts (with a draw ledger)
        self._step_hooks: List[StepHook] = []
        self.last_clipped_fraction: Optional[float] = None
        #: Clipping statistics of the last logical step (``clipping_stats`` "raw" or "private"), else None.
        self.last_clipping_stats: Optional[Dict[str, Any]] = None
        #: With a count released (adaptive clipping, private stats): the noised unclipped fraction of the last step.
        self.last_unclipped_fraction: Optional[float] = None
        self._unclipped_count: Optional[torch.Tensor] = None  # sum of (b_i - 1/2) over this logical step
        self._nonfinite_count = 0  # units dropped this logical step (non-finite gradient); exact, private
        self._warned_nonfinite = False
        self._raw_norms: List[torch.Tensor] = []
        self._raw_within: List[torch.Tensor] = []
        self._accumulated = 0  # backward rounds whose clipped gradients wait for the next step
        self._phantom = False  # inside phantom(): backward rounds add nothing
        for name in (
            "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._rank, self._world_size = _distributed_rank_and_size()
        self._given_writer: Optional[GradientWriter] = None  # use_gradient_writer's, kept by use_hooks
        if getattr(plan, "strategy", None) is not None:  # bandmf: the noise is C^{-1} z, streamed (dptorch.noise.banded)
            attach_banded_noise(self, plan)
        self._listen(hooks)

    def _listen(self, hooks: GradSampleHooks) -> None:
        """Clip and accumulate after every backward round of ``hooks``.

        The update is ours to write: autograd skips the hooked layers' own parameter gradients, and
        any gradient that still reaches a parameter came by a path the controller does not see,
        which the controller then refuses."""
        self.hooks = hooks
        hooks.keep_param_grads = False
        # tensor parallelism (dptorch.distributed.tensor_parallel): every rank runs the whole batch
        tensor_parallel = self._tensor_parallel = dict(getattr(hooks, "tensor_parallel", None) or {})
        with_fsdp = any(layout.with_fsdp for layout in tensor_parallel.values())
        self._sharded = any_sharded(self.params) and (with_fsdp or not tensor_parallel)  # FSDP2: distributed.fsdp
        self._data_parallel_group = None  # the group whose ranks hold different samples (None: the world)
        if tensor_parallel:  # the ranks of a tensor-parallel group hold the same samples
            self.__dict__["_dp_shard_layouts"] = {p: data_parallel_shard_layout(p, layout)
                                                  for p, layout in tensor_parallel.items() if layout.with_fsdp}
            mesh = next(iter(tensor_parallel.values())).mesh
            self._data_parallel_group = mesh.get_group(0) if with_fsdp else None
            self._world_size = mesh.size(0) if with_fsdp else 1
        #: Keeps each backward pass's clipped sums and writes the step's noised gradient, in the parameters' layout
        #: over the ranks (``dptorch.optim.gradient_writer``).
        self.gradient_writer: GradientWriter = self._given_writer or (
            TensorParallelSlices(tensor_parallel, sharded=self._sharded) if tensor_parallel
            else ShardedParameters() if self._sharded else WholeParameters())
        self._remove_listener = hooks.add_backward_listener(self._clip_and_accumulate)

    # ------------------------------------------------------------------ delegation

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Dict[Any, Any]:
        return self.original_optimizer.state

    @state.setter
    def state(self, value: Dict[Any, Any]) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> Dict[str, Any]:
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    # ------------------------------------------------------------------ the plan's numbers

    @property
    def noise_multiplier(self) -> float:
        """The plan's noise multiplier; setting it changes the plan (the accountant records each step's)."""
        return self.plan.noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self.plan.noise_multiplier = value

    @property
    def max_grad_norm(self) -> Union[float, Sequence[float]]:
        return self.plan.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Union[float, Sequence[float]]) -> None:
        """A new clipping bound (a clipping schedule), from the next backward pass on."""
        if self.clipping in ("adaptive", "automatic"):
            raise ValueError(
                f"max_grad_norm cannot be set under clipping={self.clipping!r}: "
                + ("the adaptive rule moves the bound itself" if self.clipping == "adaptive" else "automatic clipping has no bound")
            )
        if self._accumulated:
            raise ValueError(
                f"max_grad_norm cannot change while {self._accumulated} backward pass(es) of clipped gradients are held "
                "for the next step: they were clipped at the old bound and the noise would be drawn at the new one. "
                "Change it after optimizer.step() (or zero_grad())"
            )
        check_clipping(self.clipping, value, self.params)
        self.plan.max_grad_norm = value if is_number(value) else list(value)

    @property
    def clipping(self) -> str:
        return self.plan.clipping

    @property
    def expected_batch_size(self) -> Optional[float]:
        return self.plan.expected_batch_size

    def __repr__(self) -> str:
        return f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm}, clipping={self.clipping!r}, optimizer={self.original_optimizer!r})"

    @property
    def _is_last_step_skipped(self) -> bool:
        """Opacus' name: whether the last ``step()`` was a skipped (virtual) one, its clipped sums kept for the
        logical step; read-only (the optimizer decides it from ``signal_skip_step``)."""
        return self._last_step_skipped

    @property
    def accumulated_iterations(self) -> int:
        """Backward passes whose clipped gradients are held for the next ``step()``, as in Opacus.

        Counts every backward round since the last privatised step (or since ``zero_grad`` dropped
        the held gradients): 1 after one backward pass, k after k physical batches of one logical
        batch (``BatchMemoryManager``) or k virtual steps (``signal_skip_step``). Unlike Opacus it
        never raises: dptorch clips after each backward and keeps only the running clipped sum.
        """
        return self._accumulated

    @property
    def params(self) -> List[nn.Parameter]:
        """The trainable parameters this optimizer updates."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    @property
    def grad_samples(self) -> List[torch.Tensor]:
        """Opacus' name: every trainable parameter's per-sample gradient (``p.grad_sample``) of the last
        backward pass, in the optimizer's order. dptorch clips after each backward pass and keeps no
        per-sample gradient of earlier ones; ``bk`` and ghost clipping form none at all."""
        missing = [self.hooks.parameter_name(p) for p in self.params if "grad_sample" not in p.__dict__]
        if missing:
            raise AttributeError(
                f"no per-sample gradient is held for {_name_list(missing)}: there is none before a backward pass or "
                "after zero_grad(), and grad_sample_mode='bk' or 'ghost' never forms one (it clips from per-sample "
                "norms). Use grad_sample_mode='hooks' to read them"
            )
        return [p.__dict__["grad_sample"] for p in self.params]

    # ------------------------------------------------------------------ privatisation

    @property
    def noise_std(self) -> float:
        """Standard deviation of the Gaussian noise added to the clipped sum at each step."""
        return self.plan.noise_std

    def _clip_and_accumulate(self, hooks: GradSampleHooks) -> None:
        if hooks.uncaptured:
            raise PerSampleGradientError(
                f"the backward pass gave gradients to {_name_list(hooks.uncaptured)} but captured no per-sample "
                "gradients: the model ran in eval mode (call model.train() before training) or under a forward "
                "the hooks did not see; a private step cannot be built from it"
            )
        if self._phantom:  # a stand-in pass: its rows are no units; it only takes part in the collectives
            self.gradient_writer.keep(self, hooks, {})  # e.g. zeros into FSDP2's reduce-scatter: the sums are unchanged
            return
        trainable = set(self.params)
        norms = {p: n for p, n in hooks.per_sample_norms().items() if p in trainable}
        if self._tensor_parallel:  # a split parameter's norm is the sum of the ranks' parts
            norms = complete_norms(norms, self._tensor_parallel, hooks.tensor_parallel_whole)
        if not norms:
            self.gradient_writer.keep(self, hooks, {})  # every rank takes part in the writer's collectives of every pass
            return
        # Units when hooks.set_privacy_units grouped rows (not comparable to the loader's sample count).
        grouped = getattr(hooks, "_unit_ids", None) is not None
        # a padded draw's padding rows (None: none); refused unless the round ran on the whole latest draw
        padding = self.plan.padding_mask(hooks.batch_size, grouped, getattr(hooks, "whole_draw", False))
        self.plan.on_backward(hooks.batch_size, grouped=grouped)
        scale = self.loss_scaler.round_scale() if self.loss_scaler is not None else 1.0  # fp16: DPGradScaler's
        norms = unscale_norms(norms, scale)
        total = flat_norms(norms)
        if padding is not None:  # padding rows are no units: norm 0 here, dropped below (exactly 0 in every mode)
            padding = padding.to(total.device)
            total = torch.where(padding, total.new_zeros(()), total)
        dropped = self._nonfinite(total)  # units whose gradient is not finite contribute 0 (None: none)
        if padding is not None:
            dropped = padding if dropped is None else dropped | padding
        within: Optional[torch.Tensor] = None  # per unit: no clipping applied (None: automatic, no bound)
        if self.clipping in ("flat", "adaptive"):
            bound = float(self.max_grad_norm)
            factor = drop_nonfinite(self.unit_factors(total), dropped)
            factors = {p: factor for p in norms}
            within = total <= bound  # False for a dropped unit (inf, NaN)
            clipped = (factor < 1) if dropped is None else (factor < 1) & ~dropped
            if padding is not None:
                clipped = clipped[~padding]
            self.last_clipped_fraction = float(clipped.float().mean()) if clipped.numel() else 0.0
        elif self.clipping == "automatic":
            factor = drop_nonfinite(self.unit_factors(total), dropped)
            factors = {p: factor for p in norms}
        else:
            thresholds = per_layer_thresholds(self.params, self.max_grad_norm)
            unknown = [hooks.parameter_name(p) for p in norms if p not in thresholds]
            if unknown:
                raise ValueError(f"per-layer clipping: no threshold for {', '.join(unknown)} (not in the optimizer)")
            factors = {p: drop_nonfinite(clip_factors(n, thresholds[p]), dropped) for p, n in norms.items()}
            within = torch.stack([n <= thresholds[p] for p, n in norms.items()]).all(0)
        factors = unscale_factors(factors, scale)  # applied to the scaled rows: the clipped sum in true units
        self._observe_clipping(total, within, dropped, padding)
        whole = self.gradient_writer.keep(self, hooks, factors, dropped)  # FSDP2: its shards reduce-scattered now
        self._keep_sums(hooks.clipped_sums(whole, dropped))

    def _keep_sums(self, sums: Dict[nn.Parameter, torch.Tensor]) -> None:
        """Add one backward round's clipped sums to those held for the next step."""
        for param, clipped in sums.items():
            held = self._summed.get(param)
            self._summed[param] = clipped if held is None else held + clipped
        self._accumulated += 1
        self._rounds_since_call += 1

    def keep_captured_round(self, rows: int, sums: Dict[nn.Parameter, torch.Tensor], total: torch.Tensor,
                            within: Optional[torch.Tensor], dropped: torch.Tensor, padding: Optional[torch.Tensor],
                            nonfinite: int, clipped: int) -> None:
        """Keep a round a captured step (``dptorch.optim.captured_step``) clipped in its graph, as
        ``_clip_and_accumulate`` keeps an eager one: the plan told of the ``rows`` of the draw it ran on (a padded
        draw's padding included, not the step's own), ``nonfinite`` units dropped (``dropped`` also holds the
        ``padding`` rows), ``clipped`` of the real units scaled down, the clipping statistics observed, the sums
        held for the step."""
        self.plan.on_backward(rows)
        self._count_nonfinite(nonfinite)
        if self.clipping in ("flat", "adaptive"):
            real = total.numel() - (0 if padding is None else int(padding.sum()))
            self.last_clipped_fraction = clipped / real if real else 0.0
        self._observe_clipping(total, within, dropped if nonfinite or padding is not None else None, padding)
        self._keep_sums(sums)

    def unit_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """The factor that scales a whole unit of gradient norm ``norms`` under flat, adaptive (the current bound)
        or automatic clipping: the rule every unit of a step goes through, audit canaries included."""
        if self.clipping in ("flat", "adaptive"):
            return clip_factors(norms, float(self.max_grad_norm))
        if self.clipping == "automatic":
            return automatic_factors(norms, self.plan.gamma)
        raise ValueError(f"clipping={self.clipping!r} clips each layer apart: a unit has no single factor")

    def _nonfinite(self, total: torch.Tensor) -> Optional[torch.Tensor]:
        """The mask of units whose norm is inf or NaN, or None when there are none (one host sync).

        Dropping such a unit depends on its own data only, so the bound on its contribution holds;
        the warning is shown once per optimizer and names no unit (it is itself a one-bit release).
        """
        dropped = nonfinite_units(total)
        count = int(dropped.sum()) if dropped.numel() else 0
        self._count_nonfinite(count)
        return dropped if count else None

    def _count_nonfinite(self, count: int) -> None:
        """``count`` units of this round were dropped for a non-finite gradient: counted, and warned of once."""
        if not count:
            return
        self._nonfinite_count += count
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(NonFiniteGradientWarning(
                "a privacy unit's gradient was not finite (inf or NaN: e.g. an inf feature, or log(0) in its loss "
                "term) and was dropped: it contributes exactly zero to the step, the other units are unaffected. "
                "Shown once; the number of such units per step is released only with clipping_stats='private' "
                "(noised, covered by epsilon) or clipping_stats='raw' (not covered by epsilon)"
                + (". Under fp16 loss scaling it is most likely an overflow of the scaled gradient: a lower "
                   "DPGradScaler init_scale keeps such units (docs/privacy.md, fp16 loss scaling)"
                   if self.loss_scaler is not None else "")
            ), stacklevel=3)

    def _observe_clipping(self, total: torch.Tensor, within: Optional[torch.Tensor], dropped: Optional[torch.Tensor] = None,
                          padding: Optional[torch.Tensor] = None) -> None:
        """Accumulate, over the backward passes of this logical step, what the step will release.

        The released count is the vector ``sum_i v_i``: ``(1/2, 0)`` for an unclipped unit, ``(-1/2, 0)``
        for a clipped one, ``(0, 1/2)`` for a dropped one (non-finite gradient). Every ``||v_i|| = 1/2``:
        the sensitivity, and so the cost, of the count of unclipped units alone (``dptorch.clipping.adaptive``).
        ``padding`` rows (in ``dropped`` too) are no units: they add nothing, to the count or to raw statistics.
        """
        if padding is not None:
            real = ~padding
            total, dropped = total[real], (None if dropped is None else dropped[real])
            within = None if within is None else within[real]
        if self.plan.counts_unclipped and within is not None:
            if dropped is not None:
                within = within & ~dropped
            counted = within.numel() - (0 if dropped is None else int(dropped.sum()))
            centred = _wide(within).sum() - 0.5 * counted  # each finite unit moves it by 1/2
            self._unclipped_count = centred if self._unclipped_count is None else self._unclipped_count + centred
        if self.plan.clipping_stats == "raw":
            self._raw_norms.append(total.detach())
            if within is not None:
                self._raw_within.append(within.detach())

    def _release_clipping_step(self) -> None:
        """After the gradient noise: the noised count (adaptive bound update, private stats) and raw stats."""
        plan = self.plan
        bound = float(plan.max_grad_norm) if plan.clipping in ("flat", "adaptive") else None
        stats: Optional[Dict[str, Any]] = None
        if plan.counts_unclipped:
            fraction, nonfinite = self._noised_counts()
            self.last_unclipped_fraction = fraction
            if plan.adaptive is not None:
                plan.max_grad_norm = plan.adaptive.next_bound(bound, fraction)
            if plan.clipping_stats == "private":
                stats = {"covered_by_epsilon": True, "clipped_fraction": min(1.0, max(0.0, 1.0 - fraction)),
                         "nonfinite_units": max(0.0, nonfinite)}
        if plan.clipping_stats == "raw":
            stats = {"covered_by_epsilon": False, **_raw_clipping_stats(self._raw_norms, self._raw_within)}
        if stats is not None and bound is not None:
            stats["max_grad_norm"] = bound  # the bound this step clipped with
        self.last_clipping_stats = stats
        self._reset_clipping_step()

    def _noised_counts(self) -> Tuple[float, Optional[float]]:
        """The noised unclipped fraction ``(sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2`` and, with private
        statistics, the noised number of dropped units ``2 (n_dropped / 2 + N(0, sigma_b^2))`` (else None).

        The two are one vector query of sensitivity 1/2 (``_observe_clipping``), its noise drawn once
        across all ranks; the dropped count's noise is drawn after the other's, only when it is released.
        """
        params = self.params
        device = params[0].device if params else torch.device("cpu")
        counts = _wide(torch.zeros(2, device=device))
        if self._unclipped_count is not None:
            counts[0] += self._unclipped_count.to(device=device, dtype=counts.dtype).reshape(())
        counts[1] += 0.5 * self._nonfinite_count
        released = self.plan.clipping_stats == "private"
        std = self.plan.count_noise_std
        if std and self._rank == 0:
            counts[:1] += self.noise_generator.noise_like(counts[:1], std).to(counts.dtype)
            if released:
                counts[1:] += self.noise_generator.noise_like(counts[1:], std).to(counts.dtype)
        if self._world_size > 1:
            torch.distributed.all_reduce(counts, group=self._data_parallel_group)
        if self._tensor_parallel:  # the same counts on every rank; rank 0's noise
            group = tensor_parallel_group(self._tensor_parallel)
            torch.distributed.broadcast(counts, src=torch.distributed.get_global_rank(group, 0), group=group)
        unclipped, dropped = counts.tolist()
        return unclipped_fraction(unclipped, self.expected_batch_size), (2.0 * dropped if released else None)

    def _reset_clipping_step(self) -> None:
        self._unclipped_count = None
        self._nonfinite_count = 0
        self._raw_norms, self._raw_within = [], []

    def clipping_logs(self) -> Dict[str, float]:
        """Numbers for training logs: the adaptive bound, and the last step's clipping statistics
        (raw ones prefixed ``raw_``: they are not covered by epsilon)."""
        logs: Dict[str, float] = {}
        if self.plan.adaptive is not None:
            logs["max_grad_norm"] = float(self.plan.max_grad_norm)
        stats = self.last_clipping_stats
        if stats:
            prefix = "" if stats["covered_by_epsilon"] else "raw_"
            for key, value in stats.items():
                if key in ("covered_by_epsilon", "max_grad_norm") or value is None:
                    continue
                if isinstance(value, dict):
                    logs.update({f"{prefix}norm_{k}": float(v) for k, v in value.items()})
                else:
                    logs[prefix + key] = float(value)
        return logs

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Queue whether the next ``step()`` only accumulates (a virtual step), as in Opacus: every
        ``step()`` takes the oldest signal, and is a real step when none is queued."""
        self._step_skip_queue.append(bool(do_skip))

    def _check_rounds_accountable(self) -> None:
        """Refuse, before anything changes, a step an accountant hook would record on a guess: several
        backward passes since the last ``step()`` call and no record of the draws behind them."""
        rounds = self._rounds_since_call
        accounting = any(getattr(hook, "records_privacy", False) for hook in self._step_hooks)
        if not accounting or self.plan.draws is not None or rounds <= 1:
            return
        raise SamplingMismatchError(
            f"DPOptimizer.step(): {rounds} backward passes since the last step() call, and no record of the "
            "Poisson draws behind them, so the accountant hook cannot tell one draw split into physical batches "
            "from several draws merged into one noised step (which no accountant covers; Opacus records it as one "
            f"step at {rounds} times the sample rate, which is not a proven bound). For one draw in physical "
            "batches, call signal_skip_step() before each step() but the last, or build the loader with "
            "wrap_data_loader / BatchMemoryManager; for several draws, take one step per draw"
        )

    def steps_to_account(self) -> Tuple[int, int]:
        """``(steps, rate factor)`` of the step being taken, for an accountant hook (Opacus' flow).

        With a draw ledger (the data loader tells the optimizer's plan of its draws: ``make_private``,
        ``wrap_data_loader``): one step at the sample rate per Poisson draw handed out since the last
        step (a step fed by several draws was refused before). Without one: one step at the rate,
        for the one backward pass since the last ``step()`` call (several were refused before the step
        changed anything: :meth:`_check_rounds_accountable`)."""
        if self._accounted_draws is not None:
            return self._accounted_draws, 1
        return 1, max(1, self._rounds_since_call)

    @contextlib.contextmanager
    def phantom(self):
        """Backward passes inside add nothing: no unit, no clipped gradient, no clipping statistic.

        For a stand-in forward and backward that only keeps the ranks' collectives paired (a
        micro-batch that Poisson sampling left empty on one rank: :mod:`dptorch.integrations.hf.phantom`).
        Under FSDP2 the rank still takes part in the reduce-scatter of the clipped sums, with zeros.
        """
        self._phantom = True
        try:
            yield
        finally:
            self._phantom = False

    def use_hooks(self, hooks: GradSampleHooks) -> None:
        """Listen to ``hooks`` from now on: a controller attached after the model's parameters were
        replaced (Accelerate's FSDP2 preparation swaps them for sharded ones after the optimizer was
        built). Held clipped sums, keyed by the old parameters, are dropped."""
        self._remove_listener()
        self._summed = {}
        self._accumulated = 0
        self.__dict__.pop("_dp_shard_layouts", None)
        self._listen(hooks)

    def use_gradient_writer(self, writer: GradientWriter) -> None:
        """Keep the clipped sums and write the noised gradient with ``writer`` from now on
        (``dptorch.optim.gradient_writer``): for an engine whose layout no parameter shows (DeepSpeed ZeRO-3's
        partitions). Refused while clipped sums are held: they are in the old writer's layout."""
        if self._summed:
            raise ValueError("use_gradient_writer: clipped sums of this step are held in the current writer's layout; "
                             "change the writer after optimizer.step() or zero_grad()")
        self._given_writer = self.gradient_writer = writer

    def attach_step_hook(self, hook: StepHook) -> None:
        """Call ``hook(self)`` after the noise is added and the plan accounted the step."""
        self._step_hooks.append(hook)

    def add_noise(self) -> None:
        """Write ``p.grad = (clipped sum + noise) / expected batch size`` for every trainable parameter.

        In distributed training the clipped sums of all ranks are added up and the noise is drawn
        once per element across the ranks, so every rank ends with its part of the same gradient;
        how is the gradient writer's (``gradient_writer``: whole parameters, FSDP2 shards, tensor-parallel
        slices, ZeRO-3 partitions).
        """
        params = self.params
        if params:
            self.gradient_writer.write(self, params)

    def pre_step(self) -> bool:
        """Privatise the accumulated gradient; False when this step is a skipped virtual step.

        Before anything changes, the plan checks that the held gradients come from at most one
        Poisson draw of the DP data loader and saw exactly its samples (``SamplingMismatchError``
        otherwise); then the noise is added and the plan accounts the step (one per draw handed out
        since the last step, at least one).
        """
        paused = getattr(self.hooks, "paused_gradients", [])
        if paused and not self._accumulated:
            raise PerSampleGradientError(
                f"optimizer.step(): the backward passes since the last step gave gradients to "
                f"{_name_list([self.hooks.parameter_name(p) for p in paused])} with capture paused (disable_hooks()), "
                "and none was captured, so there is no clipped gradient to privatise; a paused pass's gradients are "
                "never used by a DP step. Call enable_hooks() before the forward (dptorch clips in the first backward "
                "pass: Opacus' second backward with hooks disabled is not needed), or zero_grad() to drop them"
            )
        if self._step_skip_queue and self._step_skip_queue.pop(0):
            self._last_step_skipped = True
            self._rounds_since_call = 0
            self.hooks.clear()
            return False
        self._check_rounds_accountable()
        try:
            count = self.plan.close_step(batch_first=getattr(self.hooks, "batch_first", None))
        except Exception:
            self._last_step_skipped = False  # a refused step is no virtual step: zero_grad() drops what it held
            raise
        self.hooks.clear(keep_grad_samples=True)  # the round is consumed: its kept tensors make room for the noise
        if paused:  # a paused pass's raw gradients: never the step's, whatever writes it
            for p in self.params:
                p.grad = None
            self.hooks.forget_paused_gradients()
        if self.canaries is not None:  # audit canaries: extra units of known gradient, before the noise
            self.canaries.add_to_sums(self)
        self.add_noise()
        self._release_clipping_step()
        self.plan.record_steps(count)
        self._accounted_draws = count if self.plan.draws is not None else None
        try:
            for hook in self._step_hooks:
                hook(self)
        finally:
            self._accounted_draws = None
        self._summed = {}
        self._accumulated = 0
        self._rounds_since_call = 0
        self._last_step_skipped = False
        return True

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if self.__dict__.pop("grad_scale", None) is not None:  # set by torch's GradScaler.step (not DPGradScaler's)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError(plain_scaler_error())
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with draw_watch.aside():  # the step's own arithmetic is not the training loop's
            stepped = self.pre_step()
            if stepped:
                self.original_optimizer.step()
        if stepped:
            draw_watch.draw_closed()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and per-sample state; the accumulator survives a skipped step."""
        with draw_watch.aside():  # the library's own work, not the loop's
            self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.hooks.clear()
        if hasattr(self.hooks, "forget_paused_gradients"):
            self.hooks.forget_paused_gradients()
        if not self._last_step_skipped:
            self._summed = {}
            self._accumulated = 0
            self._rounds_since_call = 0
            self._reset_clipping_step()
            self.plan.on_discard()

    def drop_unfinished_step(self) -> None:
        """Forget the clipped gradients and skip signals of a logical batch left unfinished (a loop that
        stopped iterating in the middle of a Poisson draw): they were never released, so they cost
        nothing, and they must not join the next draw's step, which is accounted as one draw."""
        self._step_skip_queue.clear()
        self._last_step_skipped = False
        self.zero_grad()

    def detach(self) -> None:
        """Stop listening to the controller."""
        self._remove_listener()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's state dict plus a ``"dp"`` entry (accumulator, RNG, flags)."""
        state = self.original_optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state["dp"] = {
            # copies: the held sums become the gradients in place at the step (gradient_writer)
            "summed": {index[id(p)]: t.clone() for p, t in self._summed.items() if id(p) in index},
            "skip_queue": list(self._step_skip_queue),
            "last_step_skipped": self._last_step_skipped,
            "accumulated_iterations": self._accumulated,
            "noise_generator": self.noise_generator.state_dict(),
        }
        if self._unclipped_count is not None:  # mid-step (virtual steps): the count of the held clipped sums
            state["dp"]["unclipped_count"] = self._unclipped_count.detach().reshape(())
        if self._nonfinite_count:  # mid-step: units dropped from the held clipped sums
            state["dp"]["nonfinite_count"] = self._nonfinite_count
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        dp = state_dict.pop("dp", None)
        self.original_optimizer.load_state_dict(state_dict)
        if dp is None:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        self._summed = {params[int(i)]: t.to(params[int(i)].device, copy=True) for i, t in dp["summed"].items()}
        queue = dp.get("skip_queue")  # earlier checkpoints: one flag, "skip_next"
        self._step_skip_queue = [bool(f) for f in queue] if queue is not None else ([True] if dp.get("skip_next") else [])
        self._last_step_skipped = bool(dp["last_step_skipped"])
        self._accumulated = int(dp.get("accumulated_iterations", 1 if self._summed else 0))
        self.noise_generator.load_state_dict(dp["noise_generator"])
        held = dp.get("unclipped_count")
        self._unclipped_count = None if held is None else held.to(params[0].device if params else "cpu")
        self._nonfinite_count = int(dp.get("nonfinite_count", 0))


def _raw_clipping_stats(norms: List[torch.Tensor], within: List[torch.Tensor]) -> Dict[str, Any]:
    """Exact statistics of one step's per-unit norms: units, clipped fraction, norm quantiles (of the
    finite norms), and the units dropped for a non-finite gradient (neither clipped nor unclipped)."""
    values = torch.cat([n.reshape(-1) for n in norms]).detach().to("cpu", torch.float64) if norms else torch.zeros(0)
    finite = torch.isfinite(values)
    stats: Dict[str, Any] = {"units": int(values.numel()), "clipped_fraction": None, "norm_quantiles": None,
                             "nonfinite_units": int((~finite).sum())}
    if within:
        flags = torch.cat([w.reshape(-1) for w in within]).to("cpu")
        stats["clipped_fraction"] = float((~flags & finite).double().mean()) if flags.numel() else 0.0
    values = values[finite]
    if values.numel():
        levels = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
        q10, q50, q90 = torch.quantile(values, levels).tolist()
        stats["norm_quantiles"] = {"p10": q10, "p50": q50, "p90": q90, "max": float(values.max())}
    return stats


def _distributed_rank_and_size():
    """(rank, world size) of the default process group, or (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

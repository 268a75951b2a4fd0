"""Opacus 1.6 import paths and names mapped onto dptorch: the one place that says where each lives.

A script written for Opacus runs after replacing ``opacus`` by ``dptorch`` in its imports. The
modules that make that work mirror Opacus' layout in this package (``validators``,
``accountants``, ``utils.batch_memory_manager``, ``optimizers``, ...), are served under ``dptorch``
(``dptorch.validators``) by :mod:`dptorch.compat.paths`, and are one-line re-exports of the names
below; the table of every path is in ``docs/migrating-from-opacus.md``.

Most names are the dptorch object itself (``UniformWithReplacementSampler`` *is*
``PoissonBatchSampler``, ``GaussianAccountant`` *is* ``GDPAccountant``). A few are thin adapters
that translate Opacus' keywords and nothing else: ``DistributedUniformWithReplacementSampler``,
``wrap_data_loader``, ``DPPerLayerOptimizer``, ``get_optimizer_class``, ``wrap_model`` /
``prepare_module`` / ``get_gsm_class``, ``DPLossFastGradientClipping``, ``compute_rdp`` and
``get_privacy_spent``. An Opacus name with no dptorch counterpart raises
:class:`OpacusCompatibilityError` (an ``ImportError`` and a ``NotImplementedError``) that names the
replacement, at ``from ... import`` time.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type

import numpy as np
import torch
from torch import nn

from dptorch.accounting import (
    Accountant,
    GDPAccountant,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    create_accountant,
    get_noise_multiplier,
)
from dptorch.accounting.sampled_gaussian_rdp import rdp_to_epsilon, sampled_gaussian_rdp
from dptorch.accounting.validation import check_delta, check_noise_multiplier, check_sample_rate, check_steps
from dptorch.clipping import CLIPPING_MODES
from dptorch.compat.unmapped import OpacusCompatibilityError
from dptorch.compat.unmapped import unmapped_names as _unmapped_names
from dptorch.data import BatchMemoryManager, DPDataLoader, PhysicalBatchLoader
from dptorch.data.poisson import PoissonBatchSampler, distributed_rank_and_world_size
from dptorch.distributed.ddp import DifferentiallyPrivateDistributedDataParallel
from dptorch.engine import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks, GradSampleModule, register_grad_sampler
from dptorch.grad_sample.capture.dp_loss import DPLoss
from dptorch.grad_sample.modes.names import GRAD_SAMPLE_MODES
from dptorch.layers import DPGRU, DPLSTM, DPRNN, DPMultiheadAttention, DPRNNBase
from dptorch.optim import AdaClipDPOptimizer, DPOptimizer
from dptorch.validate import ModuleValidator, register_module_fixer


def unmapped_names(module_name: str, replacements: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of the served Opacus path of ``module_name`` (a module of this package):
    its Opacus-only names raise :class:`OpacusCompatibilityError` naming the replacement."""
    served = module_name.replace("dptorch.compat.opacus", "dptorch", 1)
    return _unmapped_names(served, replacements, foreign_path=served.replace("dptorch", "opacus", 1),
                           guide="docs/migrating-from-opacus.md")


# ---------------------------------------------------------------------------------- accountants

class _AnyAccountant(type(Accountant)):
    """``isinstance(x, IAccountant)`` holds for every dptorch accountant, as Opacus' interface does for its own."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return cls.__subclasscheck__(type(instance))

    def __subclasscheck__(cls, subclass: type) -> bool:
        # By the MRO alone: ABCMeta's check of Accountant asks its subclasses, this class among them.
        return Accountant in getattr(subclass, "__mro__", ()) if cls is IAccountant else super().__subclasscheck__(subclass)


class IAccountant(Accountant, metaclass=_AnyAccountant):
    """``opacus.accountants.IAccountant``: the base of an accountant written to Opacus' interface.

    Such an accountant overrides ``step``, ``get_epsilon``, ``__len__`` and ``mechanism``; dptorch's
    accountants compose their history in ``_compute_epsilon(runs, delta)`` instead, which a subclass
    that keeps dptorch's ``get_epsilon`` must implement. Every dptorch accountant is an ``IAccountant``.
    """

    def _compute_epsilon(self, runs: Tuple[Any, ...], delta: float) -> float:
        raise NotImplementedError(f"{type(self).__name__} must override get_epsilon(delta) (Opacus' interface) or "
                                  "_compute_epsilon(runs, delta) (dptorch's)")
#: ``opacus.accountants.GaussianAccountant``: the GDP central-limit approximation (warns; not a bound).
GaussianAccountant = GDPAccountant


def compute_rdp(*, q: float, noise_multiplier: float, steps: int, orders: Any) -> Any:
    """``opacus.accountants.analysis.rdp.compute_rdp``: RDP of ``steps`` sampled Gaussian steps.

    Returns an array over ``orders`` (a float for a single order), as Opacus does.
    """
    single = np.isscalar(orders)
    order_list = [orders] if single else list(orders)
    rdp = check_steps(steps, "steps") * sampled_gaussian_rdp(
        check_noise_multiplier(noise_multiplier), check_sample_rate(q, "q"), order_list
    )
    return float(rdp[0]) if single else rdp


def get_privacy_spent(*, orders: Any, rdp: Any, delta: float) -> Tuple[float, float]:
    """``opacus.accountants.analysis.rdp.get_privacy_spent``: ``(epsilon, best order)`` from RDP values."""
    order_array = np.atleast_1d(np.asarray(orders, dtype=float))
    rdp_array = np.atleast_1d(np.asarray(rdp, dtype=float))
    if order_array.shape != rdp_array.shape:
        raise ValueError(f"orders and rdp must have the same length, got {order_array.shape} and {rdp_array.shape}")
    epsilon, best = rdp_to_epsilon(rdp_array, order_array, check_delta(delta))
    return epsilon, float(order_array[best])


#: ``opacus.validators`` names with no counterpart.
VALIDATORS_UNMAPPED = {
    "register_module_validator": "dptorch.validate.register_module_check(*types) registers check(module) -> "
    "the reason as a str, or None when the module is fine (not a list of exceptions)",
}


# ---------------------------------------------------------------------------------- data

#: ``opacus.utils.uniform_sampler.UniformWithReplacementSampler``: Poisson batches of rate ``sample_rate``
#: (``num_samples=``, ``sample_rate=``, ``generator=``, ``steps=`` keep Opacus' meaning).
UniformWithReplacementSampler = PoissonBatchSampler


class DistributedUniformWithReplacementSampler(PoissonBatchSampler):
    """``opacus.utils.uniform_sampler.DistributedUniformWithReplacementSampler`` on dptorch's sampler.

    Takes Opacus' keywords; rank and world size come from the initialised process group. Each rank
    draws its shard (``rank::world_size``) of one Poisson batch of rate ``sample_rate`` over
    ``total_size`` samples, so the global batch has Opacus' law; ``shuffle`` and ``shuffle_seed``
    (Opacus' way of splitting the indices between ranks) change nothing the privacy analysis sees
    and are accepted for compatibility only.
    """

    def __init__(
        self,
        *,
        total_size: int,
        sample_rate: float,
        shuffle: bool = True,
        shuffle_seed: int = 0,
        generator: Optional[torch.Generator] = None,
        steps: Optional[int] = None,
    ) -> None:
        rank, world_size = distributed_rank_and_world_size()
        super().__init__(total_size, sample_rate, steps=steps, generator=generator, rank=rank, world_size=world_size)


def wrap_data_loader(*, data_loader: Any, max_batch_size: int, optimizer: Any) -> PhysicalBatchLoader:
    """``opacus.utils.batch_memory_manager.wrap_data_loader``: physical batches of at most ``max_batch_size``.

    The first epoch is planned at once, so that ``len()`` is exact for it (the HF Trainer reads it
    once, before training). Each physical batch queues one skip signal on the optimizer (Opacus'
    ``_step_skip_queue``), so a loop that fetches several batches ahead (the Trainer's gradient
    accumulation) still steps for real exactly at the last physical batch of every Poisson draw.
    """
    checked = BatchMemoryManager(data_loader=data_loader, max_physical_batch_size=max_batch_size, optimizer=optimizer)
    physical = _EpochPhysicalBatches(data_loader, checked.max_physical_batch_size, optimizer)
    physical.plan_epoch()
    return physical


class _EpochPhysicalBatches(PhysicalBatchLoader):
    """Physical batches whose every pass starts clean: the HF Trainer reads ``len()`` once and may stop
    a later epoch (planned anew, of another length) inside a Poisson draw; what that unfinished draw
    left in the optimizer is dropped, never merged into the next draw's step."""

    def __iter__(self) -> Any:
        drop = getattr(self.optimizer, "drop_unfinished_step", None)
        if drop is not None:
            drop()
        return super().__iter__()


# ---------------------------------------------------------------------------------- optimizers

#: Under torch.distributed the one DPOptimizer adds up the clipped sums of all ranks and draws the
#: noise once (on rank 0), so Opacus' distributed variants are the same class.
DistributedDPOptimizer = DPOptimizer
#: Ghost clipping is a strategy of the per-sample gradient controller, not of the optimizer.
DPOptimizerFastGradientClipping = DPOptimizer
DistributedDPOptimizerFastGradientClipping = DPOptimizer


class DPPerLayerOptimizer(DPOptimizer):
    """``opacus.optimizers.DPPerLayerOptimizer``: a :class:`DPOptimizer` with ``clipping="per_layer"``.

    ``max_grad_norm`` is one threshold per trainable parameter (or one number for all of them), as in
    Opacus; ``make_private(clipping="per_layer")`` builds the same optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        if kwargs.get("plan") is None:
            kwargs.setdefault("clipping", "per_layer")
        super().__init__(optimizer, **kwargs)


DistributedPerLayerOptimizer = DPPerLayerOptimizer
SimpleDistributedPerLayerOptimizer = DPPerLayerOptimizer

_FSDP_REPLACEMENT = (
    "dptorch has no FSDP ghost clipping; use grad_sample_mode='bk' or 'ghost' (one backward pass or two, "
    "no per-sample gradients kept), with DistributedDataParallel for several processes"
)
OPTIMIZERS_UNMAPPED = {
    "FSDPOptimizerFastGradientClipping": _FSDP_REPLACEMENT,
}


def get_optimizer_class(clipping: str, distributed: bool, grad_sample_mode: Optional[str] = None) -> Type[DPOptimizer]:
    """``opacus.optimizers.get_optimizer_class``: the DP optimizer class for a clipping mode.

    ``distributed`` and every dptorch ``grad_sample_mode`` give the same class (the optimizer
    handles both); FSDP ghost clipping raises :class:`OpacusCompatibilityError`.
    """
    if grad_sample_mode in ("ghost_fsdp", "ghost_tp"):
        raise OpacusCompatibilityError(f"grad_sample_mode={grad_sample_mode!r}: {_FSDP_REPLACEMENT}")
    if grad_sample_mode is not None and grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}")
    if clipping == "adaptive":
        return AdaClipDPOptimizer
    if clipping not in ("flat", "per_layer"):  # Opacus' modes; a class alone would not carry dptorch's others
        raise ValueError(
            f"clipping must be 'flat', 'per_layer' or 'adaptive' (Opacus' modes), got {clipping!r}"
            + (f"; dptorch's clipping={clipping!r} is make_private(clipping={clipping!r})" if clipping in CLIPPING_MODES else "")
        )
    return DPPerLayerOptimizer if clipping == "per_layer" else DPOptimizer


# ---------------------------------------------------------------------------------- distributed

# ``opacus.distributed.DifferentiallyPrivateDistributedDataParallel``: see dptorch.distributed.ddp.


# ---------------------------------------------------------------------------------- grad samples

_OPACUS_ONLY_MODES = {
    "ghost_fsdp": _FSDP_REPLACEMENT,
    "ghost_tp": _FSDP_REPLACEMENT,
    "no_op": "dptorch has no 'no_op' mode; leave the model unwrapped for non-private training",
}


def _controller_kwargs(grad_sample_mode: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    if grad_sample_mode in _OPACUS_ONLY_MODES:
        raise OpacusCompatibilityError(f"grad_sample_mode={grad_sample_mode!r}: {_OPACUS_ONLY_MODES[grad_sample_mode]}")
    kwargs = dict(kwargs)
    if kwargs.pop("force_functorch", False):
        grad_sample_mode = "functorch"
    kwargs.pop("max_grad_norm", None)  # Opacus' ghost module keeps the bound; dptorch's optimizer does
    kwargs.pop("use_ghost_clipping", None)
    return dict(kwargs, grad_sample_mode=grad_sample_mode)


def wrap_model(
    model: nn.Module,
    grad_sample_mode: str = "hooks",
    wrap_model: bool = True,
    *,
    attach_only: bool = False,
    **kwargs: Any,
) -> Any:
    """``opacus.grad_sample.utils.wrap_model``: capture per-sample gradients of ``model``.

    Returns a :class:`GradSampleModule` (wrapping), or with ``wrap_model=False`` (Opacus'
    later spelling: ``attach_only=True``) the :class:`GradSampleHooks` controller attached to the
    untouched model. ``kwargs`` are Opacus' module keywords (``batch_first``, ``loss_reduction``,
    ``strict``, ``force_functorch``).
    """
    options = _controller_kwargs(grad_sample_mode, kwargs)
    if wrap_model and not attach_only:
        return GradSampleModule(model, **options)
    return GradSampleHooks(model, **options)


def prepare_module(model: nn.Module, grad_sample_mode: str = "hooks", attach_only: bool = False, **kwargs: Any) -> Any:
    """``opacus.grad_sample.utils.prepare_module``: ``wrap_model`` with Opacus' ``attach_only`` flag."""
    return wrap_model(model, grad_sample_mode, attach_only=attach_only, **kwargs)


def get_gsm_class(grad_sample_mode: str) -> Type[GradSampleModule]:
    """``opacus.grad_sample.utils.get_gsm_class``: one wrapper class for every mode (the mode is a keyword)."""
    _controller_kwargs(grad_sample_mode, {})
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}")
    return GradSampleModule


def get_hooks_class(grad_sample_mode: str) -> Type[GradSampleHooks]:
    """``opacus.grad_sample.utils.get_hooks_class``: the one controller class for every mode."""
    get_gsm_class(grad_sample_mode)
    return GradSampleHooks


#: ``opacus.grad_sample.utils`` names with no counterpart.
GRAD_SAMPLE_UNMAPPED = {
    "register_norm_sampler": "dptorch.grad_sample.layers.registry.register_norm_sampler (a NormSampler object, "
    "not a function)",
}


_CELL_REPLACEMENT = "dptorch has no DP cell layers; run the whole sequence through DPRNN, DPGRU or DPLSTM"
LAYERS_UNMAPPED = {
    "DPRNNCell": _CELL_REPLACEMENT,
    "DPGRUCell": _CELL_REPLACEMENT,
    "DPLSTMCell": _CELL_REPLACEMENT,
    "RNNLinear": "dptorch's recurrent layers need no marked Linear: each layer-direction is a RecurrentSweep",
}


class DPLossFastGradientClipping(DPLoss):
    """``opacus.utils.fast_gradient_clipping_utils.DPLossFastGradientClipping`` with Opacus' arguments.

    ``DPLossFastGradientClipping(module, optimizer, criterion, loss_reduction)`` is
    ``dptorch.DPLoss(criterion, controller)``, the controller taken from ``module`` (a
    :class:`GradSampleModule`) or from ``optimizer`` (the DPOptimizer ``make_private`` returned).
    ``loss.backward()`` is then the usual single backward pass.
    """

    def __init__(self, module: Any, optimizer: Any, criterion: Callable[..., torch.Tensor],
                 loss_reduction: str = "mean") -> None:
        hooks = getattr(optimizer, "hooks", None)
        if isinstance(module, GradSampleModule):
            hooks = module.hooks
        elif isinstance(module, GradSampleHooks):
            hooks = module
        if not isinstance(hooks, GradSampleHooks):
            raise TypeError(
                "DPLossFastGradientClipping needs the per-sample gradient controller: pass the controller (what "
                "make_private(..., wrap_model=False) or wrap_model(..., wrap_model=False) returns), the "
                "GradSampleModule make_private returned, or the DPOptimizer"
            )
        super().__init__(criterion, hooks, loss_reduction=loss_reduction)

    def __call__(self, *args: Any, shape: Optional[Tuple[int, ...]] = None, **kwargs: Any) -> Any:
        if shape is not None:  # Opacus' generative case: per-token losses of logits flattened from (B, T, V)
            return DPLoss(lambda: self._per_sequence(args, kwargs, shape), self.hooks)()
        if hasattr(self.criterion, "reduction"):
            return super().__call__(*args, **kwargs)
        # A transformers loss (no `reduction`): it returns the batch's reduced loss, not one per sample.
        # That loss is used as it is: the controller's batch tracker follows it and refuses it unless
        # the samples meet only in its final sum or mean (tokens counted as divisor included).
        loss = self.criterion(*args, **kwargs)
        if isinstance(loss, torch.Tensor) and loss.dim() == 0:
            return loss
        return DPLoss(lambda: loss, self.hooks)()  # one loss per sample: checked and reduced as DPLoss does

    def _per_sequence(self, args: tuple, kwargs: dict, shape: Tuple[int, ...]) -> torch.Tensor:
        """One loss per sequence from per-token losses: their sum, or their mean over the sequence's own
        targets that are not ``ignore_index`` (a divisor from the sample alone)."""
        rows, steps = int(shape[0]), int(shape[1])
        per_token = self._per_sample_losses(*args, **kwargs)
        if per_token.numel() != rows * steps:
            raise ValueError(f"shape={tuple(shape)} promises {rows} x {steps} token losses, the criterion gave "
                             f"{per_token.numel()}; pass the shape of the logits before flattening")
        per_token = per_token.reshape(rows, steps)
        if self.loss_reduction == "sum":
            return per_token.sum(1)
        ignore = getattr(self.criterion, "ignore_index", None)
        target = kwargs.get("target", args[1] if len(args) > 1 else None)
        if ignore is None or target is None:
            return per_token.mean(1)
        return per_token.sum(1) / (target.reshape(rows, steps) != ignore).sum(1).clamp(min=1)


__all__ = [
    "BatchMemoryManager",
    "DPDataLoader",
    "DPGRU",
    "DPLSTM",
    "DPLossFastGradientClipping",
    "DPMultiheadAttention",
    "DPOptimizer",
    "DPOptimizerFastGradientClipping",
    "DPPerLayerOptimizer",
    "DPRNN",
    "DPRNNBase",
    "DifferentiallyPrivateDistributedDataParallel",
    "DistributedDPOptimizer",
    "DistributedDPOptimizerFastGradientClipping",
    "DistributedPerLayerOptimizer",
    "DistributedUniformWithReplacementSampler",
    "GaussianAccountant",
    "GradSampleHooks",
    "GradSampleModule",
    "IAccountant",
    "LAYERS_UNMAPPED",
    "ModuleValidator",
    "OpacusCompatibilityError",
    "PLDAccountant",
    "PRVAccountant",
    "PrivacyEngine",
    "RDPAccountant",
    "SimpleDistributedPerLayerOptimizer",
    "UniformWithReplacementSampler",
    "VALIDATORS_UNMAPPED",
    "compute_rdp",
    "create_accountant",
    "get_gsm_class",
    "get_hooks_class",
    "get_noise_multiplier",
    "get_optimizer_class",
    "get_privacy_spent",
    "prepare_module",
    "register_grad_sampler",
    "register_module_fixer",
    "unmapped_names",
    "wrap_data_loader",
    "wrap_model",
]

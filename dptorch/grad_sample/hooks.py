"""GradSampleHooks: the controller that captures per-sample gradients on an untouched model.

It registers forward hooks on every module that owns parameters, a forward pre-hook on the root
(to learn the batch size) and a post-accumulate-grad hook on every parameter (to notice a
gradient that arrived without its per-sample counterpart). Everything it keeps lives in its own
side tables; ``cleanup()`` removes every hook and every attribute it added.

One backward pass is one *round*: the per-sample gradients of all calls of a parameter within
it are summed (tied weights, modules called twice, the two halves of a DPO batch). When the
round ends, listeners (the DP optimizer) are told; a further backward pass while a round's
results are still held, and nobody consumed them, is an error rather than a silent mix.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptorch.grad_sample.errors import PerSampleGradientError, UnsupportedModuleError
from dptorch.grad_sample.functorch import functorch_per_sample_grads
from dptorch.grad_sample.registry import GradSampler, find_grad_sampler
from dptorch.grad_sample.tap import tap
from dptorch.grad_sample.validation import incompatibilities

GRAD_SAMPLE_MODES = ("hooks", "functorch")
LOSS_REDUCTIONS = ("mean", "sum")
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, GradSampleHooks]" = weakref.WeakKeyDictionary()
_BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "x", "input")


@dataclass
class _Layer:
    """A hooked module: its path, direct parameters and how to compute their per-sample grads."""

    name: str
    module: nn.Module
    params: Dict[str, nn.Parameter]
    sampler: Optional[GradSampler]  # None: torch.func fallback


class GradSampleHooks:
    """Attach per-sample gradient capture to ``module`` without wrapping or modifying it.

    After each backward pass, every trainable parameter ``p`` has ``p.grad_sample`` of shape
    ``(batch, *p.shape)``, also readable as ``hooks.grad_samples[p]``. Use as a context manager
    or call ``cleanup()`` to detach.

    ``loss_reduction="mean"`` means the loss averages the samples' losses (row ``i`` of the
    per-sample gradient is then rescaled to the gradient of sample ``i``'s own loss);
    ``"sum"`` means it sums them. ``grad_sample_mode="functorch"`` uses the torch.func
    fallback for every layer. With ``strict=True``, modules whose buffers mix samples
    (BatchNorm) are refused at attach time; otherwise they only warn.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        grad_sample_mode: str = "hooks",
    ) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"GradSampleHooks needs an nn.Module, got {type(module).__name__}")
        if module in _ATTACHED:
            raise RuntimeError(
                f"{type(module).__name__} already has GradSampleHooks attached; call cleanup() on them "
                "(or PrivacyEngine.detach()) before attaching again"
            )
        self.module = module
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self.grad_sample_mode = grad_sample_mode
        self._batch_dim = 0 if batch_first else 1
        self._handles: List[Any] = []
        self._restore_param_hooks: List[Tuple[nn.Parameter, Any]] = []
        self._layers: Dict[nn.Module, _Layer] = {}
        self._param_names: Dict[nn.Parameter, str] = {}
        self._grad_samples: Dict[nn.Parameter, torch.Tensor] = {}
        self._received: Dict[nn.Parameter, None] = {}
        self._unhooked_grad_versions: Dict[nn.Parameter, Tuple[int, int]] = {}
        self._unit_ids: Optional[torch.Tensor] = None
        self._listeners: List[Callable[["GradSampleHooks"], None]] = []
        self._batch_size: Optional[int] = None
        self._replaying = False
        self._in_backward = False
        self._round_done = False
        self._round_consumed = False
        self._attached = False
        self._check_compatible(strict)
        self._attach()

    # ------------------------------------------------------------------ attach / detach

    def _check_compatible(self, strict: bool) -> None:
        problems = incompatibilities(self.module)
        if not problems:
            return
        message = "the model cannot be trained with per-sample gradients:\n" + "\n".join(f"  - {p}" for p in problems)
        if strict:
            raise UnsupportedModuleError(message)
        import warnings

        warnings.warn(message, stacklevel=3)

    def _attach(self) -> None:
        self._handles.append(self.module.register_forward_pre_hook(self._on_root_forward, with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(self._on_root_forward_end, always_call=True))
        for name, param in self.module.named_parameters(remove_duplicate=True):
            self._param_names[param] = name
        for name, sub in self.module.named_modules():
            params = dict(sub.named_parameters(recurse=False))
            if not params:
                continue
            sampler = None if self.grad_sample_mode == "functorch" else find_grad_sampler(sub)
            self._layers[sub] = _Layer(name or type(sub).__name__, sub, params, sampler)
            self._handles.append(sub.register_forward_hook(self._on_layer_forward, with_kwargs=True))
        for param in self._param_names:
            if not param.requires_grad:
                continue
            self._restore_param_hooks.append((param, param._post_accumulate_grad_hooks))
            self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))
        _ATTACHED[self.module] = self
        self._attached = True

    def cleanup(self) -> None:
        """Remove every hook and attribute this controller added; the model is as before."""
        if not self._attached:
            return
        self.clear()
        for handle in self._handles:
            handle.remove()
        for param, previous in self._restore_param_hooks:
            param._post_accumulate_grad_hooks = previous
        self._handles.clear()
        self._restore_param_hooks.clear()
        self._layers.clear()
        self._listeners.clear()
        _ATTACHED.pop(self.module, None)
        self._attached = False

    def __deepcopy__(self, memo: dict) -> "GradSampleHooks":
        # A deep copy of the model (a reference model, ModuleValidator.fix) carries our hooks;
        # they must keep pointing here, where they ignore modules and parameters they don't own.
        return self

    def __enter__(self) -> "GradSampleHooks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    @property
    def attached(self) -> bool:
        return self._attached

    # ------------------------------------------------------------------ public results

    @property
    def grad_samples(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Per-sample gradients of the last backward round, by parameter (a copy of the table)."""
        return dict(self._grad_samples)

    def per_sample_norms(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Each parameter's per-sample gradient norm (float32, one entry per sample)."""
        return {p: g.flatten(1).float().norm(dim=1) for p, g in self._grad_samples.items()}

    def clipped_sums(self, clip_factors: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
        """``sum_i c_i * g_i`` (float32) for each parameter that ``clip_factors`` names."""
        return {p: torch.einsum("i,i...->...", c, self._grad_samples[p].float()) for p, c in clip_factors.items()}

    @property
    def batch_size(self) -> int:
        """Samples in the held round (0 when nothing is held)."""
        return next((g.shape[0] for g in self._grad_samples.values()), 0)

    def parameter_name(self, param: nn.Parameter) -> str:
        if param in self._param_names:
            return self._param_names[param]
        return next((n for n, p in self.module.named_parameters() if p is param), "<parameter not in model>")

    def add_backward_listener(self, listener: Callable[["GradSampleHooks"], None]) -> Callable[[], None]:
        """Call ``listener(self)`` at the end of every backward round; returns a remover.

        A listener consumes the round: the next backward pass then starts a fresh one.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def set_privacy_units(self, unit_ids: Optional[torch.Tensor]) -> None:
        """Group batch rows into privacy units for the following backward passes.

        ``unit_ids[r]`` names the unit of row ``r`` (any integers; rows with equal ids form one
        unit, e.g. a DPO example's chosen and rejected rows, or all records of one user). Their
        gradients are summed before clipping, and per-sample results have one row per unit, in
        ascending id order. ``None`` makes every row its own unit again.
        """
        self._unit_ids = None if unit_ids is None else torch.as_tensor(unit_ids).flatten()

    def clear(self) -> None:
        """Forget the held per-sample gradients (and remove ``p.grad_sample``)."""
        for param in self._grad_samples:
            param.__dict__.pop("grad_sample", None)
        self._grad_samples = {}
        self._round_done = False
        self._round_consumed = False

    # ------------------------------------------------------------------ forward side

    def _on_root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module is self.module and not self._replaying:
            self._batch_size = _infer_batch_size(args, kwargs, self._batch_dim)

    def _on_root_forward_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if module is self.module and not self._replaying:
            self._batch_size = None

    def _on_layer_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self._replaying or not torch.is_grad_enabled() or not module.training:
            return None
        layer = self._layers.get(module)
        if layer is None:
            return None
        params = {name: p for name, p in layer.params.items() if p.requires_grad}
        if not params:
            return None
        if layer.sampler is not None:
            return self._capture_for_sampler(layer, params, args, kwargs, output)
        return self._capture_for_replay(layer, params, args, kwargs, output)

    def _capture_for_sampler(self, layer: _Layer, params, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}) returned {type(output).__name__}, but its registered "
                "grad sampler needs a single tensor output; register a sampler for the layer that returns it"
            )
        if not output.requires_grad:
            return None
        activations = _tensor_arguments(layer.module, args, kwargs)
        n = self._batch_size_for(output)
        if self._is_broadcast(output, n):
            # Shared by the whole batch (e.g. GPT-2's position_ids of shape (1, T)): give each
            # sample its own row so that its gradient is kept apart.
            if not all(self._is_broadcast(a, n) for a in activations):
                raise self._not_per_sample(layer, output, n)
            output = _expand_batch(output, self._batch_dim, n)
            activations = tuple(_expand_batch(a, self._batch_dim, n) for a in activations)
        elif not self._has_batch(output, n):
            raise self._not_per_sample(layer, output, n)
        on_backward = partial(self._layer_backward, layer, params, n)
        return tap((output,), activations, on_backward)[0]

    def _capture_for_replay(self, layer: _Layer, params, args, kwargs, output):
        out_leaves, out_spec = tree_flatten(output)
        positions = [i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None
        call_leaves, call_spec = tree_flatten((args, kwargs))
        tensor_positions = [i for i, t in enumerate(call_leaves) if isinstance(t, torch.Tensor)]
        n = self._batch_size_for(out_leaves[positions[0]])
        for i in positions:
            if self._is_broadcast(out_leaves[i], n):
                out_leaves[i] = _expand_batch(out_leaves[i], self._batch_dim, n)
            elif not self._has_batch(out_leaves[i], n):
                raise self._not_per_sample(layer, out_leaves[i], n)
        on_backward = partial(self._replay_backward, layer, params, n, call_leaves, call_spec, tensor_positions, positions)
        tapped = tap([out_leaves[i] for i in positions], [call_leaves[i] for i in tensor_positions], on_backward)
        for i, t in zip(positions, tapped):
            out_leaves[i] = t
        return tree_unflatten(out_leaves, out_spec)

    def _batch_size_for(self, output: torch.Tensor) -> int:
        """The batch size of the current root call, else the rows of this output."""
        if self._batch_size is not None:
            return self._batch_size
        return output.shape[self._batch_dim] if output.dim() > self._batch_dim else 1

    def _has_batch(self, t: torch.Tensor, n: int) -> bool:
        return t.dim() > self._batch_dim and t.shape[self._batch_dim] == n

    def _is_broadcast(self, t: torch.Tensor, n: int) -> bool:
        return n != 1 and t.dim() > self._batch_dim and t.shape[self._batch_dim] == 1

    def _not_per_sample(self, layer: _Layer, t: torch.Tensor, n: int) -> PerSampleGradientError:
        return PerSampleGradientError(
            f"{layer.name} ({type(layer.module).__name__}) produced a tensor of shape {tuple(t.shape)}, which does "
            f"not have the batch's {n} rows along dim {self._batch_dim}: it is shared by, or flattened across, "
            "samples, so per-sample gradients of its parameters are not defined by this call. Freeze its "
            "parameters, give it inputs with one row per sample (check batch_first), or register a grad sampler."
        )

    # ------------------------------------------------------------------ backward side

    def _layer_backward(self, layer: _Layer, params, n: int, activations, grad_outputs) -> None:
        self._begin_round()
        backprops = self._per_sample_scale(grad_outputs[0], n)
        if self._batch_dim != 0:
            # 1-D inputs (EmbeddingBag's flat indices and offsets) carry no batch dimension.
            activations = tuple(a.movedim(self._batch_dim, 0) if a.dim() > 1 else a for a in activations)
            backprops = backprops.movedim(self._batch_dim, 0)
        grads = layer.sampler(layer.module, tuple(activations), backprops)
        self._accumulate(layer, params, grads)

    def _replay_backward(self, layer: _Layer, params, n, call_leaves, call_spec, tensor_positions, out_positions, saved, grad_outputs) -> None:
        self._begin_round()
        leaves = list(call_leaves)
        for i, t in zip(tensor_positions, saved):
            leaves[i] = t
        grad_outputs = [self._per_sample_scale(g, n) for g in grad_outputs]
        self._replaying = True
        try:
            with torch.enable_grad():
                grads = functorch_per_sample_grads(
                    layer.module, params, leaves, call_spec, out_positions, grad_outputs,
                    batch_size=n, batch_dim=self._batch_dim,
                )
        finally:
            self._replaying = False
        self._accumulate(layer, params, grads)

    def _per_sample_scale(self, grad: torch.Tensor, n: int) -> torch.Tensor:
        return grad * n if self.loss_reduction == "mean" else grad

    def _accumulate(self, layer: _Layer, params: Dict[str, nn.Parameter], grads: Dict[nn.Parameter, torch.Tensor]) -> None:
        for name, param in params.items():
            grad = grads.get(param)
            if grad is None:
                raise PerSampleGradientError(
                    f"the grad sampler of {layer.name} ({type(layer.module).__name__}) returned no per-sample "
                    f"gradient for its trainable parameter {name!r}"
                )
            held = self._grad_samples.get(param)
            if held is None:
                self._grad_samples[param] = grad
            elif held.shape != grad.shape:
                raise PerSampleGradientError(
                    f"parameter {self.parameter_name(param)} was used by calls with different batch sizes "
                    f"({held.shape[0]} and {grad.shape[0]}) in one backward pass; per-sample gradients need one "
                    "row per sample in every call"
                )
            else:
                self._grad_samples[param] = held + grad

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        if param.requires_grad and param in self._param_names:
            self._begin_round()
            self._received[param] = None

    def _begin_round(self) -> None:
        if self._in_backward:
            return
        if self._round_done:
            if not self._round_consumed:
                raise PerSampleGradientError(
                    "a second backward pass ran while the per-sample gradients of the previous one were still held. "
                    "Call optimizer.step() or optimizer.zero_grad() (or hooks.clear()) between backward passes; for "
                    "gradient accumulation use the DP optimizer, which clips after every backward pass."
                )
            self.clear()
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_round)

    def _end_round(self) -> None:
        self._in_backward = False
        self._round_done = True
        missing = [p for p in self._received if p not in self._grad_samples] + self._new_parameters_with_grads()
        self._received = {}
        if missing and (self._grad_samples or self.module.training):
            names = ", ".join(self.parameter_name(p) for p in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            self.clear()
            raise PerSampleGradientError(
                f"parameters {names}{more} received a gradient but no per-sample gradient. They were used outside a "
                "hooked forward: a forward run before the hooks attached, a module added after they attached (attach "
                "after PEFT/model surgery), a module in eval mode, or a weight read directly by another module's "
                "code (e.g. a fused LM head)."
            )
        if self._unit_ids is not None:
            self._grad_samples = {p: sum_rows_by_unit(g, self._unit_ids, self.parameter_name(p)) for p, g in self._grad_samples.items()}
        for param, grad in self._grad_samples.items():
            param.__dict__["grad_sample"] = grad
        if self._listeners:
            for listener in list(self._listeners):
                listener(self)
            self._round_consumed = True


    def _new_parameters_with_grads(self) -> List[nn.Parameter]:
        """Parameters added after attaching (no hooks) whose gradient changed since last seen."""
        changed = []
        for name, param in self.module.named_parameters():
            if param in self._param_names or not param.requires_grad or param.grad is None:
                continue
            version = (id(param.grad), param.grad._version)
            if self._unhooked_grad_versions.get(param) != version and param not in self._grad_samples:
                changed.append(param)
            self._unhooked_grad_versions[param] = version
        return changed


def sum_rows_by_unit(grad_sample: torch.Tensor, unit_ids: torch.Tensor, name: str = "") -> torch.Tensor:
    """Sum the rows of ``grad_sample`` that share a unit id; one row per unit, ids ascending."""
    if unit_ids.shape[0] != grad_sample.shape[0]:
        raise PerSampleGradientError(
            f"privacy units name {unit_ids.shape[0]} rows but the batch of {name or 'a parameter'} has "
            f"{grad_sample.shape[0]}; call set_privacy_units with one id per row of every batch"
        )
    _, units = torch.unique(unit_ids.to(grad_sample.device), return_inverse=True)
    num_units = int(units.max()) + 1 if units.numel() else 0
    summed = grad_sample.new_zeros((num_units, *grad_sample.shape[1:]))
    return summed.index_add_(0, units, grad_sample)


def _infer_batch_size(args: tuple, kwargs: dict, batch_dim: int) -> Optional[int]:
    """The batch size of a root call: its first positional tensor, else a well-known keyword."""
    candidates = list(args) + [kwargs[k] for k in _BATCH_KEYS if k in kwargs] + list(kwargs.values())
    for value in candidates:
        if isinstance(value, PackedSequence):
            return int(value.batch_sizes[0]) if len(value.batch_sizes) else 0
        if isinstance(value, torch.Tensor) and value.dim() > batch_dim:
            return value.shape[batch_dim]
    return None


def _tensor_arguments(module: nn.Module, args: tuple, kwargs: dict) -> Tuple[torch.Tensor, ...]:
    """The tensor arguments of a call, in the order of the module's ``forward`` signature."""
    if kwargs:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        values: Sequence[Any] = list(bound.arguments.values())
    else:
        values = args
    return tuple(v for v in values if isinstance(v, torch.Tensor))


def _expand_batch(t: torch.Tensor, batch_dim: int, n: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[batch_dim] = n
    return t.expand(*shape)

"""Per-sample gradients of normalisation layers, from the closed form of the normalised input.

For ``y = x_hat * weight + bias`` the per-sample grads are ``sum(g * x_hat)`` and ``sum(g)`` over the
dims that the parameter is broadcast along. ``x_hat`` is recomputed from the activation with the
functional op itself (``weight=None``), so it matches the module exactly.

Also holds the duck-typed rule for the HuggingFace RMSNorm family and :func:`verify_duck_sampler`,
which checks a built-in duck-typed sampler against ``torch.func`` before the registry trusts it for
a class (``register_verified_duck_sampler``, also used for HF ``Conv1D``).
"""

from __future__ import annotations

import copy
import inspect
import weakref
import math
from numbers import Real
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from dptorch.grad_sample.layers.linear import common_dtype, non_centred, param_shape
from dptorch.grad_sample.layers.registry import (
    GradSampler,
    ModulePredicate,
    matches_torch_func,
    register_duck_grad_sampler,
    register_grad_sampler,
)


def sum_to_parameter(tensor: torch.Tensor, param_dims: int, channels_first: bool) -> torch.Tensor:
    """Per-sample sum over the dims a parameter is broadcast along.

    ``channels_first``: the parameter indexes dim 1 of ``(B, C, *spatial)``; otherwise it covers
    the last ``param_dims`` dims of ``(B, *middle, *param_shape)``.
    """
    batch = tensor.shape[0]
    if channels_first:
        return tensor.reshape(batch, tensor.shape[1], math.prod(tensor.shape[2:])).sum(-1)
    param_shape = tensor.shape[tensor.dim() - param_dims :]
    middle = math.prod(tensor.shape[1 : tensor.dim() - param_dims])
    return tensor.reshape(batch, middle, *param_shape).sum(1)


def affine_grad_samples(
    weight: Optional[nn.Parameter],
    bias: Optional[nn.Parameter],
    normalized_input: Callable[[], torch.Tensor],
    backprops: torch.Tensor,
    channels_first: bool,
) -> Dict[nn.Parameter, torch.Tensor]:
    """Grads of the affine part of a norm layer; ``normalized_input`` is only called if the weight trains. Reads the
    parameters' shapes by :func:`param_shape` only (exact while ZeRO-3 has them released)."""
    grads: Dict[nn.Parameter, torch.Tensor] = {}
    if weight is not None and weight.requires_grad:
        x_hat, g = common_dtype(normalized_input(), backprops)
        grads[weight] = sum_to_parameter(g * x_hat, len(param_shape(weight)), channels_first).to(weight.dtype)
    if bias is not None and bias.requires_grad:
        grads[bias] = sum_to_parameter(backprops, len(param_shape(bias)), channels_first).to(bias.dtype)
    return grads


def trailing_shape_probe(module: nn.Module, generator: torch.Generator) -> Tuple[torch.Tensor, ...]:
    """Two samples of three tokens of the layer's ``normalized_shape``."""
    return (non_centred(generator, 2, 3, *module.normalized_shape),)


def channels_probe(spatial_dims: int) -> Callable[[nn.Module, torch.Generator], Tuple[torch.Tensor, ...]]:
    """Two samples of ``(channels, 3, ..., 3)`` for a channels-first norm layer."""

    def probe(module: nn.Module, generator: torch.Generator) -> Tuple[torch.Tensor, ...]:
        channels = getattr(module, "num_channels", None) or module.num_features
        return (non_centred(generator, 2, channels, *([3] * spatial_dims)),)

    return probe


@register_grad_sampler(nn.LayerNorm, probe=trailing_shape_probe)
def layer_norm_grad_sampler(
    module: nn.LayerNorm, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """``nn.LayerNorm`` over the trailing ``normalized_shape`` dims."""
    x = activations[0]
    return affine_grad_samples(
        module.weight,
        module.bias,
        lambda: F.layer_norm(x, module.normalized_shape, None, None, module.eps),
        backprops,
        channels_first=False,
    )


@register_grad_sampler(nn.GroupNorm, probe=channels_probe(1))
def group_norm_grad_sampler(
    module: nn.GroupNorm, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """``nn.GroupNorm`` on ``(B, C, *spatial)``; per-channel weight and bias."""
    x = activations[0]
    return affine_grad_samples(
        module.weight,
        module.bias,
        lambda: F.group_norm(x, module.num_groups, None, None, module.eps),
        backprops,
        channels_first=True,
    )


def instance_normalized(module: nn.modules.instancenorm._InstanceNorm, x: torch.Tensor) -> torch.Tensor:
    """``x_hat`` as the module's forward computes it, without touching its running statistics."""
    if x.numel() == 0:  # F.instance_norm rejects an empty batch; x_hat is empty too
        return torch.zeros_like(x)
    use_input_stats = module.training or not module.track_running_stats
    running_mean = None if use_input_stats else module.running_mean
    running_var = None if use_input_stats else module.running_var
    return F.instance_norm(
        x, running_mean, running_var, None, None, use_input_stats=use_input_stats, momentum=0.0, eps=module.eps
    )


@register_grad_sampler(nn.InstanceNorm3d, probe=channels_probe(3))
@register_grad_sampler(nn.InstanceNorm2d, probe=channels_probe(2))
@register_grad_sampler(nn.InstanceNorm1d, probe=channels_probe(1))
def instance_norm_grad_sampler(
    module: nn.modules.instancenorm._InstanceNorm, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """``nn.InstanceNorm{1,2,3}d`` with ``affine=True`` (input or running statistics)."""
    x = activations[0]
    return affine_grad_samples(
        module.weight, module.bias, lambda: instance_normalized(module, x), backprops, channels_first=True
    )


if hasattr(nn, "RMSNorm"):  # torch >= 2.4

    @register_grad_sampler(nn.RMSNorm, probe=trailing_shape_probe)
    def rms_norm_grad_sampler(
        module: nn.Module, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
    ) -> Dict[nn.Parameter, torch.Tensor]:
        """torch's ``nn.RMSNorm`` (``eps=None`` is resolved by ``F.rms_norm`` from the input dtype)."""
        x = activations[0]
        return affine_grad_samples(
            module.weight,
            None,
            lambda: F.rms_norm(x, module.normalized_shape, None, module.eps),
            backprops,
            channels_first=False,
        )


# ----------------------------------------------------------------------------- duck-rule verification

_DUCK_SAMPLERS: List[Tuple[ModulePredicate, GradSampler]] = []
_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, Dict[GradSampler, bool]]" = weakref.WeakKeyDictionary()


def _tokens_of_weight_width(module: nn.Module, generator: torch.Generator) -> Tuple[torch.Tensor, ...]:
    """A non-centred ``(2, 3, weight.shape[0])`` input (per-token shift and scale)."""
    width = param_shape(module.weight)[0]
    shape = lambda *dims: torch.randn(*dims, generator=generator)  # noqa: E731
    return (shape(2, 3, width) * shape(2, 3, 1).exp() + 2 * shape(2, 3, 1),)


def sampler_matches_torch_func(module: nn.Module, sampler: GradSampler) -> bool:
    """Compare ``sampler`` with ``torch.func`` per-sample grads on a random ``(2, 3, in_features)`` probe.

    ``in_features`` is ``weight.shape[0]``; see ``registry.matches_torch_func`` for the probe
    (random float32 parameters on a shallow copy, ``module`` untouched; any error means False).
    """
    weight = module._parameters.get("weight")
    if weight is None or len(param_shape(weight)) == 0:
        return False
    return matches_torch_func(with_whole_parameters(module), _tokens_of_weight_width, sampler=sampler)


def with_whole_parameters(module: nn.Module) -> nn.Module:
    """``module``, or where DeepSpeed ZeRO-3 has released its parameters (``data`` empty) a shallow copy holding
    zeros of their real shapes: the probe replaces the parameters by random ones of those shapes, so the check
    runs at the layer's real width, not on empty tensors."""
    params = module._parameters
    if not any(p is not None and hasattr(p, "ds_shape") for p in params.values()):
        return module
    copied = copy.copy(module)
    copied._parameters = {name: None if p is None else nn.Parameter(torch.zeros(param_shape(p), device=p.device))
                          for name, p in params.items()}
    return copied


def verify_duck_sampler(module: nn.Module) -> bool:
    """True if the built-in duck rule matching ``module`` reproduces ``torch.func`` on a probe.

    Cached per module instance (and rule): attributes can change what an instance computes, so one
    instance never vouches for another. The registry calls it through ``verify=`` before it hands
    out the rule's sampler; False there means the generic torch.func fallback is used.
    """
    for predicate, sampler in _DUCK_SAMPLERS:
        if predicate(module):
            verdicts = _VERIFIED.setdefault(module, {})
            if sampler not in verdicts:
                verdicts[sampler] = sampler_matches_torch_func(module, sampler)
            return verdicts[sampler]
    return False


def register_verified_duck_sampler(predicate: ModulePredicate):
    """``register_duck_grad_sampler(predicate, verify=verify_duck_sampler)`` for a built-in duck rule."""

    def decorator(fn: GradSampler) -> GradSampler:
        _DUCK_SAMPLERS.append((predicate, fn))
        return register_duck_grad_sampler(predicate, verify=verify_duck_sampler)(fn)

    return decorator


# ----------------------------------------------------------------------------- HF RMSNorm family


def hf_rms_norm_epsilon(module: nn.Module) -> Optional[float]:
    """The epsilon of an HF RMSNorm (``variance_epsilon`` or ``eps``), or None."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, Real) and not isinstance(value, bool):
            return float(value)
    return None


def _forward_takes_one_tensor(module: nn.Module) -> bool:
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(parameters) == 1 and parameters[0].kind in positional


def looks_like_hf_rms_norm(module: nn.Module) -> bool:
    """HF RMSNorm look-alikes: ``*RMSNorm`` / ``T5LayerNorm``, a lone 1-D ``weight``, an epsilon, ``forward(x)``."""
    name = type(module).__name__
    if not (name.endswith("RMSNorm") or name == "T5LayerNorm"):
        return False
    params = dict(module.named_parameters(recurse=False))
    if list(params) != ["weight"] or len(param_shape(params["weight"])) != 1:
        return False
    if hf_rms_norm_epsilon(module) is None or any(True for _ in module.children()):
        return False
    return _forward_takes_one_tensor(module)


def hf_rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps)`` in at least float32, as HF computes it."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@register_verified_duck_sampler(looks_like_hf_rms_norm)
def hf_rms_norm_grad_sampler(
    module: nn.Module, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """HF RMSNorm family (``weight * x_hat`` or ``(1 + weight) * x_hat``: same weight gradient)."""
    x = activations[0]
    eps = hf_rms_norm_epsilon(module)
    return affine_grad_samples(
        module.weight, None, lambda: hf_rms_normalized(x, eps), backprops, channels_first=False
    )

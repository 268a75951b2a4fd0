"""HuggingFace's GPT-2 style ``Conv1D`` (``x @ W + b`` with ``W`` of shape ``(in, out)``): its per-sample
gradients, norms, clipped sums and linear form, those of ``nn.Linear`` with the weight transposed.

The class is recognised by shape, so ``transformers`` is never imported here; the rule is checked
against torch.func once per class before use (see ``norms.verify_duck_sampler``).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from dptorch.grad_sample.layers.linear import affine_forms, linear_map_grad_samples, linear_norms, linear_sums, param_shape
from dptorch.grad_sample.layers.normalization import register_verified_duck_sampler
from dptorch.grad_sample.norms.linear_forms import LinearForm
from dptorch.grad_sample.layers.registry import register_norm_sampler

Tensors = Tuple[torch.Tensor, ...]


def looks_like_hf_conv1d(module: nn.Module) -> bool:
    """True for a module named ``Conv1D`` with an int ``nf`` and a weight laid out as ``(in, nf)``."""
    if type(module).__name__ != "Conv1D":
        return False
    out_features = getattr(module, "nf", None)
    weight = module._parameters.get("weight")
    bias = module._parameters.get("bias")
    shape = None if weight is None else param_shape(weight)
    if not isinstance(out_features, int) or shape is None or len(shape) != 2:
        return False
    if shape[1] != out_features:
        return False
    in_features = getattr(module, "nx", shape[0])
    if shape[0] != in_features:
        return False
    if bias is not None and tuple(param_shape(bias)) != (out_features,):
        return False
    return set(module._parameters) <= {"weight", "bias"} and not any(True for _ in module.children())


@register_verified_duck_sampler(looks_like_hf_conv1d)
def hf_conv1d_grad_sampler(
    module: nn.Module, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor, empty=None, scale=1.0
) -> Dict[nn.Parameter, torch.Tensor]:
    """HF ``Conv1D``: the linear-layer closed form with the weight grad laid out as ``(in, out)``."""
    return linear_map_grad_samples(
        module.weight, module.bias, activations[0], backprops, weight_is_in_by_out=True, empty=empty, scale=scale
    )


def _hf_conv1d_form(module: nn.Module, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, LinearForm]:
    return affine_forms(module, activations[0], backprops, in_by_out=True)


def hf_conv1d_clipped_sum(module: nn.Module, activations: Tensors, scaled_backprops: torch.Tensor):
    return linear_sums(module.weight, module.bias, activations[0], scaled_backprops, in_by_out=True)


@register_norm_sampler(predicate=looks_like_hf_conv1d, clipped_sum=hf_conv1d_clipped_sum, token_wise=True, linear_form=_hf_conv1d_form)
def hf_conv1d_norm_sampler(module: nn.Module, activations: Tensors, backprops: torch.Tensor):
    """transformers' ``Conv1D``: the same norms as a Linear layer (the layout does not matter)."""
    return linear_norms(module.weight, module.bias, activations[0], backprops)

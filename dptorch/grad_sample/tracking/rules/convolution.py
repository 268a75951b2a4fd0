"""Convolutions, pooling, resampling: per-sample along the batch dim of a batched input.

An unbatched input (``conv1d`` of ``(C, L)``) has its channels at dim 0: a convolution mixes
them, so a batch there is lost; pooling works per channel and keeps it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from dptorch.grad_sample.tracking.rules.structural import d_first, structural


def _batched(rank: int, at: int = 0) -> Callable:
    """The batch must be dim ``at`` of an input of ``rank`` dims (what the operation calls batched)."""

    def dimfn(d, shape, args, kwargs, out) -> Any:
        if len(shape) != rank:
            return "the input is not batched (its channels are dim 0, and they are mixed)"
        return d if d == at else f"expects the batch along dim {at}"

    return dimfn


def _leading(trailing: int) -> Callable:
    """Any dim before the last ``trailing`` (which the operation rearranges) may be the batch."""

    def dimfn(d, shape, args, kwargs, out) -> Any:
        return d if d < len(shape) - trailing else "rearranges the batch dimension"

    return dimfn


RULES: Dict[str, Callable] = {n: structural(d_first) for n in """avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d
max_pool3d max_pool1d_with_indices max_pool2d_with_indices max_pool3d_with_indices adaptive_avg_pool1d
adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d
adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices lp_pool1d lp_pool2d lp_pool3d interpolate upsample
upsample_nearest upsample_bilinear fractional_max_pool2d fractional_max_pool3d""".split()}
for _k in (1, 2, 3):
    RULES[f"conv{_k}d"] = RULES[f"conv_transpose{_k}d"] = structural(_batched(_k + 2))
    RULES[f"max_unpool{_k}d"] = structural(d_first, aligned=(1, "indices"))  # max_pool's indices of each sample
RULES["grid_sample"] = structural(d_first, aligned=(1, "grid"))  # a grid per sample
RULES.update({
    "conv_tbc": structural(_batched(3, at=1)),  # (time, batch, channels)
    "F.unfold": structural(_batched(4)), "F.fold": structural(_batched(3)),
    "pixel_shuffle": structural(_leading(3)), "pixel_unshuffle": structural(_leading(3)),
    "channel_shuffle": structural(d_first),  # channels are dim 1, whatever the rank
})

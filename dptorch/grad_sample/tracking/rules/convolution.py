"""Convolutions, pooling, resampling: per-sample along dim 0."""

from __future__ import annotations

from typing import Callable, Dict

from dptorch.grad_sample.tracking.rules.structural import d_first, structural


RULES: Dict[str, Callable] = {n: structural(d_first) for n in """conv1d conv2d conv3d conv_transpose1d conv_transpose2d
conv_transpose3d conv_tbc avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d max_pool1d_with_indices
max_pool2d_with_indices max_pool3d_with_indices adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d adaptive_max_pool1d_with_indices
adaptive_max_pool2d_with_indices lp_pool1d lp_pool2d lp_pool3d max_unpool1d max_unpool2d max_unpool3d pixel_shuffle
pixel_unshuffle channel_shuffle interpolate upsample upsample_nearest upsample_bilinear grid_sample
fractional_max_pool2d fractional_max_pool3d F.unfold F.fold""".split()}

"""``opacus.layers.dp_multihead_attention``: DPMultiheadAttention (implementation: dptorch.layers.attention)."""

from dptorch.compat.opacus import DPMultiheadAttention

__all__ = ["DPMultiheadAttention"]

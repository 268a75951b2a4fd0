"""``opacus.layers.dp_multihead_attention``: DPMultiheadAttention (implementation: dptorch.layers.attention)."""

from dptorch.opacus_compat import DPMultiheadAttention

__all__ = ["DPMultiheadAttention"]

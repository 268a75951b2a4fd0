"""DP-ready replacements for torch layers whose fused kernels hide per-sample gradients."""

from dptorch.layers.attention import AppendedVector, DPMultiheadAttention
from dptorch.layers.rnn import DPGRU, DPLSTM, DPRNN, DPRNNBase, RecurrentSweep

__all__ = ["AppendedVector", "DPGRU", "DPLSTM", "DPMultiheadAttention", "DPRNN", "DPRNNBase", "RecurrentSweep"]

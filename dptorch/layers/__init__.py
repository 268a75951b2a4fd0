"""DP-ready replacements for torch layers whose fused kernels hide per-sample gradients."""

from dptorch.layers.rnn import DPGRU, DPLSTM, DPRNN, DPRNNBase, RecurrentSweep

__all__ = ["DPGRU", "DPLSTM", "DPRNN", "DPRNNBase", "RecurrentSweep"]

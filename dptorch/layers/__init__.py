"""DP-ready replacements for torch layers whose fused kernels hide per-sample gradients.

``DPRNN``, ``DPGRU``, ``DPLSTM`` and ``DPMultiheadAttention`` take the same arguments, inputs and
state_dicts as their torch counterparts; ``ModuleValidator.fix`` swaps them in. ``SequenceBias``
(Opacus' layer) appends a learned step to every sequence.
"""

from dptorch.layers.attention import DPMultiheadAttention
from dptorch.layers.rnn import DPGRU, DPLSTM, DPRNN, DPRNNBase
from dptorch.layers.sequence_bias import SequenceBias

__all__ = ["DPGRU", "DPLSTM", "DPMultiheadAttention", "DPRNN", "DPRNNBase", "SequenceBias"]

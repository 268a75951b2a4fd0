"""``opacus.layers.dp_rnn``: DPRNN, DPGRU, DPLSTM (implementation: dptorch.layers.rnn)."""

from dptorch.compat.opacus import DPGRU, DPLSTM, DPRNN, LAYERS_UNMAPPED, DPRNNBase, unmapped_names

__all__ = ["DPGRU", "DPLSTM", "DPRNN", "DPRNNBase"]
__getattr__ = unmapped_names(__name__, LAYERS_UNMAPPED)

"""``opacus.utils.packed_sequences``: sequence lengths of a PackedSequence, and random packed test data."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence


def compute_seq_lengths(batch_sizes: torch.Tensor) -> List[int]:
    """The length of each sequence of a PackedSequence from its ``batch_sizes``, longest first (the packed
    order): sequence ``i`` runs for as many time steps as have more than ``i`` sequences."""
    sizes = torch.as_tensor(batch_sizes)
    return [int((sizes > i).sum()) for i in range(int(sizes[0]))] if sizes.numel() else []


def _gen_packed_data(
    minibatch_size: int,
    max_seq_length: int,
    input_dim: int,
    batch_first: bool,
    sorted_: Optional[bool] = False,
) -> PackedSequence:
    """A PackedSequence of ``minibatch_size`` standard normal sequences of random lengths in
    ``[1, max_seq_length]`` (lengths drawn from torch's global generator); ``sorted_`` packs them longest
    first (``enforce_sorted=True``), otherwise in drawn order."""
    lengths = torch.randint(1, max_seq_length + 1, (minibatch_size,))
    if sorted_:
        lengths = lengths.sort(descending=True).values
    padded = torch.zeros(minibatch_size, max_seq_length, input_dim)
    for i, length in enumerate(lengths.tolist()):
        padded[i, :length] = torch.randn(length, input_dim)
    if not batch_first:
        padded = padded.transpose(0, 1)
    return pack_padded_sequence(padded, lengths, batch_first=batch_first, enforce_sorted=bool(sorted_))


__all__ = ["compute_seq_lengths"]

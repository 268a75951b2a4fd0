"""``opacus.utils.tensor_utils``: ``unfold2d``, the patches of a 2-d convolution (``F.unfold``, and Opacus'
string paddings)."""

from __future__ import annotations

from typing import Tuple, Union

import torch
import torch.nn.functional as F

Pair = Tuple[int, int]


def unfold2d(
    input: torch.Tensor,
    *,
    kernel_size: Pair,
    padding: Union[str, Pair],
    stride: Pair,
    dilation: Pair,
) -> torch.Tensor:
    """``(B, C * kh * kw, L)`` patches of ``input`` ``(B, C, H, W)``; ``padding`` may be ``"valid"`` or
    ``"same"`` (stride 1: the extra row or column, if any, on the far side, as torch's convolution pads)."""
    if padding == "valid":
        padding = (0, 0)
    elif padding == "same":
        totals = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
        input = F.pad(input, (totals[1] // 2, totals[1] - totals[1] // 2, totals[0] // 2, totals[0] - totals[0] // 2))
        padding = (0, 0)
    return F.unfold(input, kernel_size=kernel_size, padding=padding, stride=stride, dilation=dilation)


__all__ = ["unfold2d"]

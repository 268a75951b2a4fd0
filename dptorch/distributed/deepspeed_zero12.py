"""DeepSpeed ZeRO stages 1 and 2 under DP-SGD: each rank's partition of the noised gradient, handed to ZeRO's step.

DeepSpeed 0.19.8's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``) lays every parameter group out as one flat
buffer: the group's trainable parameters side by side, flattened, in ``round_robin_bit16_groups[i]`` order (the
group's order unless ``round_robin_gradients`` reorders it), each at ``round_robin_bit16_offsets[i]`` (with
``parameter_alignment``'s padding between them), the whole padded to a multiple of ``2 * world``
(``bit16_groups_flat[i]``). Rank ``r`` owns elements ``[r * s, (r + 1) * s)`` of it, ``s = partition_size[i]``,
and steps the fp32 master weights of that partition only. At the step, ZeRO flattens the list
``averaged_gradients[i]`` (what its backward epilogue fills: this rank's partition of the ranks' averaged
gradient, zeros for the padding) into the gradient of its fp32 partition.

So a private step needs no full-size gradient on any rank: the group's flat buffer is a flat space
(:mod:`dptorch.distributed.partitions`), the clipped sums are reduce-scattered into it at the end of every
backward pass (each rank keeps only the parts of them its partition holds), and at the step each rank hands
``[its partition of (sum + noise) / divisor]`` to ZeRO as ``averaged_gradients[i]``, in fp32, the noise its
slice of the one-process stream. ZeRO's backward epilogue and reduction never run while the engine is private.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from dptorch.distributed.partitions import FlatSpace, keep_in_partitions, noised_partitions

#: What of ZeRO-1/2's optimizer (``DeepSpeedZeroOptimizer``) the partition hand-over uses.
ZERO12_PARTS = ("bit16_groups", "bit16_groups_flat", "round_robin_bit16_groups", "round_robin_bit16_offsets",
                "partition_size", "averaged_gradients", "_grad_acc_hooks", "create_gradient_handling_hooks")


def group_spaces(zero: Any) -> List[FlatSpace]:
    """ZeRO-1/2's layout: each parameter group's flat buffer, ``partition_size[i]`` elements per rank."""
    return [FlatSpace(size=int(zero.partition_size[index]), params=tuple(params),
                      offsets=tuple(int(offset) for offset in zero.round_robin_bit16_offsets[index]),
                      numels=tuple(p.numel() for p in params), device=zero.bit16_groups_flat[index].device)
            for index, params in enumerate(zero.round_robin_bit16_groups)]


def engine_problems(zero: Any, world: int) -> List[str]:
    """What in a ZeRO-1/2 optimizer's layout the partition hand-over does not know (empty: none)."""
    problems = []
    for index, space in enumerate(group_spaces(zero)):
        ends = [offset + numel for offset, numel in zip(space.offsets, space.numels)]
        ordered = all(end <= offset for end, offset in zip(ends, space.offsets[1:]))
        if zero.bit16_groups_flat[index].numel() != world * space.size or not ordered or max(ends, default=0) > \
                world * space.size:
            problems.append(f"ZeRO's parameter group {index} is not laid out as dptorch knows it (its parameters side "
                            f"by side in a flat buffer of {world} partitions of {space.size} elements; tested with "
                            "deepspeed 0.19.8): install that version")
    return problems


class Zero12Partitions:
    """The DP optimizer's gradient writer (``dptorch.optim.gradient_writer``) under ZeRO-1/2: the clipped sums
    reduce-scattered into this rank's partition of each group's flat buffer after every backward pass, the step's
    partition handed to ZeRO as ``averaged_gradients``."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        self.spaces = group_spaces(zero)

    def keep(self, optimizer: Any, hooks: Any, factors: Dict[nn.Parameter, torch.Tensor],
             dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        keep_in_partitions(optimizer, hooks, factors, dropped, self.spaces)
        return {}

    def write(self, optimizer: Any, params: List[nn.Parameter]) -> None:
        for index, part in enumerate(noised_partitions(optimizer, self.spaces)):
            self.zero.averaged_gradients[index] = [part]  # ZeRO's step flattens it into its fp32 partition's grad


__all__ = ["ZERO12_PARTS", "Zero12Partitions", "engine_problems", "group_spaces"]

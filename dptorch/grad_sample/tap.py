"""The capture point: an identity autograd Function placed on a hooked layer's output.

Its forward returns the layer's outputs unchanged (as detached aliases, so in-place operations
downstream neither crash nor hide the gradient) and saves the layer's inputs with
``save_for_backward``, so activation checkpointing manages them like any other saved tensor.
Its backward hands the output gradients, paired with *this call's* inputs, to a callback.
Pairing by call rather than by a per-module stack keeps results exact when a module is called
several times, and under reentrant or non-reentrant checkpointing. A tap passes one backward
only: a second backward through the same forward (``retain_graph``, a second loss) is refused,
since each pass would be clipped on its own.
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

from dptorch.grad_sample.errors import PerSampleGradientError

OnBackward = Callable[[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]], None]


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, on_backward: OnBackward, num_outputs: int, *tensors: torch.Tensor):
        outputs, inputs = tensors[:num_outputs], tensors[num_outputs:]
        ctx.on_backward = on_backward
        ctx.num_outputs = num_outputs
        ctx.num_inputs = len(inputs)
        ctx.save_for_backward(*inputs)
        aliases = tuple(out.detach() for out in outputs)
        return aliases if num_outputs > 1 else aliases[0]

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        if getattr(ctx, "fired", False):
            raise PerSampleGradientError(
                "a second backward pass went through the same forward pass. Each pass would be clipped to "
                "max_grad_norm on its own, so every sample would count up to twice in one step. Add the losses "
                "and call backward() once per forward (loss = main_loss + aux_loss; loss.backward())."
            )
        ctx.fired = True
        ctx.on_backward(ctx.saved_tensors, grad_outputs)
        return (None, None, *grad_outputs, *([None] * ctx.num_inputs))


def tap(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], on_backward: OnBackward) -> Tuple[torch.Tensor, ...]:
    """Return aliases of ``outputs``; ``on_backward(inputs, grad_outputs)`` runs in backward."""
    result = _Tap.apply(on_backward, len(outputs), *outputs, *inputs)
    return result if isinstance(result, tuple) else (result,)

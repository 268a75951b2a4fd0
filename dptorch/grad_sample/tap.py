"""The capture point: an identity autograd Function placed on a hooked layer's output.

Its forward returns the layer's outputs unchanged (as detached aliases, so in-place operations
downstream neither crash nor hide the gradient) and saves the layer's inputs with
``save_for_backward``, so activation checkpointing manages them like any other saved tensor.
Its backward hands the output gradients, paired with *this call's* inputs, to a callback.
Pairing by call rather than by a per-module stack keeps results exact when a module is called
several times, and under reentrant or non-reentrant checkpointing. An output gradient that
arrives in another layout than the contiguous output (a loss on ``logits.transpose(1, 2)``) is
made contiguous once, here, for both the callback and the layer's own backward, which would
each copy it otherwise (a ``(B, T, vocab)`` transpose is the costliest copy of a step). A tap passes one backward
only: a second backward through the same forward (``retain_graph``, a second loss) is refused,
since each pass would be clipped on its own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, Tuple

import torch

from dptorch.grad_sample.errors import PerSampleGradientError

OnBackward = Callable[[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]], None]


_OWN_PASSES = [0]  # how many of the controller's own backward passes are running (``own_pass``)


@contextmanager
def own_pass() -> Iterator[None]:
    """A backward pass of the controller's own (the per-sample vector-Jacobian product of a shared
    tensor where it meets the batch): taps it goes through neither fire nor count as passed."""
    _OWN_PASSES[0] += 1
    try:
        yield
    finally:
        _OWN_PASSES[0] -= 1


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, on_backward: OnBackward, num_outputs: int, *tensors: torch.Tensor):
        outputs, inputs = tensors[:num_outputs], tensors[num_outputs:]
        ctx.on_backward = on_backward
        ctx.num_outputs = num_outputs
        ctx.num_inputs = len(inputs)
        ctx.contiguous = tuple(out.is_contiguous() for out in outputs)
        ctx.save_for_backward(*inputs)
        aliases = tuple(out.detach() for out in outputs)
        return aliases if num_outputs > 1 else aliases[0]

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor):
        if _OWN_PASSES[0]:  # a vector-Jacobian product of the controller's own (origins.py): not the step's backward
            return (None, None, *grad_outputs, *([None] * ctx.num_inputs))
        if getattr(ctx, "fired", False):
            raise PerSampleGradientError(
                "a second backward pass went through the same forward pass. Each pass would be clipped to "
                "max_grad_norm on its own, so every sample would count up to twice in one step. Add the losses "
                "and call backward() once per forward (loss = main_loss + aux_loss; loss.backward()). Opacus' "
                "fast-gradient-clipping second backward (with disable_hooks()) is not needed: dptorch clips in the first."
            )
        ctx.fired = True
        grad_outputs = tuple(
            g.contiguous() if was and g is not None and not g.is_contiguous() else g
            for g, was in zip(grad_outputs, ctx.contiguous)
        )
        ctx.on_backward(ctx.saved_tensors, grad_outputs)
        return (None, None, *grad_outputs, *([None] * ctx.num_inputs))


def in_own_pass() -> bool:
    """Whether one of the controller's own backward passes (``own_pass``) is running."""
    return bool(_OWN_PASSES[0])


def is_tap_node(node: object) -> bool:
    """Whether an autograd graph node is a tap's backward."""
    return isinstance(node, _Tap._backward_cls)


def tap(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], on_backward: OnBackward) -> Tuple[torch.Tensor, ...]:
    """Return aliases of ``outputs``; ``on_backward(inputs, grad_outputs)`` runs in backward."""
    tensors = (*outputs, *inputs)
    if torch._C._are_functorch_transforms_active() or any(_is_wrapped(t) for t in tensors):
        result = _Tap.apply(on_backward, len(outputs), *tensors)
    else:  # what Function.apply does then, without its per-call signature binding and tree walk
        result = _apply(on_backward, len(outputs), *tensors)
    return result if isinstance(result, tuple) else (result,)


_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Tap)
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

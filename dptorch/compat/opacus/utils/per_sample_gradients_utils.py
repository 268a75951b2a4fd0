"""``opacus.utils.per_sample_gradients_utils``: check a model's per-sample gradients against micro-batching.

The reference is the gradient of each sample alone (a batch of one, a copy of the model); the
checked side is dptorch's controller in the chosen ``grad_sample_mode`` on another copy. Both use
Opacus' test loss: L1 distance of the output to zeros, summed or averaged (``loss_reduction``), so
each sample's own loss is the sum or the mean over its own outputs. Results are dicts from parameter
name to a batch-first ``(batch, *param.shape)`` tensor.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from dptorch.compat.opacus import wrap_model
from dptorch.compat.opacus.utils.module_utils import clone_module, trainable_parameters

Batch = Union[torch.Tensor, PackedSequence, Tuple[torch.Tensor, ...], List[torch.Tensor]]
LOSS_REDUCTIONS = ("sum", "mean")


def is_batch_empty(batch: Batch) -> bool:
    """Whether the batch (a tensor, or a tuple whose first item is the input) has no element."""
    first = batch if isinstance(batch, torch.Tensor) else batch[0]
    return first.numel() == 0


def unpack_packedsequences(packed: PackedSequence) -> List[torch.Tensor]:
    """The sequences a :class:`PackedSequence` was packed from, each ``(length, *features)``, in input order."""
    padded, lengths = pad_packed_sequence(packed, batch_first=True)  # both in input order
    return [padded[i, :length] for i, length in enumerate(lengths.tolist())]


def l1_test_loss(output: Any, loss_reduction: str) -> torch.Tensor:
    """Opacus' test loss: ``|output|`` summed, or averaged per sample and over samples (``"mean"``)."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
    if type(output) is tuple:  # recurrent layers: (output, hidden state); the loss reads the output
        output = output[0]
    if isinstance(output, PackedSequence):  # per sequence, on the padded batch (its padding is zeros)
        padded, lengths = pad_packed_sequence(output, batch_first=True)
        per_sequence = padded.abs().flatten(1).sum(1)
        if loss_reduction == "sum":
            return per_sequence.sum()
        return (per_sequence / (lengths.to(padded.dtype) * math.prod(padded.shape[2:]))).mean()
    return output.abs().sum() if loss_reduction == "sum" else output.abs().mean()


class ModelWithLoss(nn.Module):
    """``module`` followed by :func:`l1_test_loss` (a tuple input is unpacked into the call)."""

    supported_reductions = list(LOSS_REDUCTIONS)

    def __init__(self, module: nn.Module, loss_reduction: str = "mean") -> None:
        super().__init__()
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        self.wrapped_module = module
        self.loss_reduction = loss_reduction

    def forward(self, x: Batch) -> torch.Tensor:
        output = self.wrapped_module(*x) if type(x) is tuple else self.wrapped_module(x)  # not a PackedSequence
        return l1_test_loss(output, self.loss_reduction)


@contextlib.contextmanager
def _deterministic(seed: int = 0) -> Iterator[None]:
    """Deterministic algorithms and seeded generators (dropout draws the same masks on both sides)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(seed)
        np.random.seed(seed)
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def compute_microbatch_grad_sample(
    x: Batch,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    chunk_method: Callable = iter,
) -> Dict[str, torch.Tensor]:
    """The reference: each sample's gradient from a batch of one, stacked batch-first, by parameter name.

    ``x`` is a batch (batch along dim 0, or dim 1 when ``batch_first=False``) or a list of samples;
    ``chunk_method`` splits it into samples (``iter`` by default).
    """
    model = ModelWithLoss(clone_module(module), loss_reduction)
    named = list(trainable_parameters(model.wrapped_module))
    rows: Dict[str, List[torch.Tensor]] = {name: [] for name, _ in named}
    if not batch_first and isinstance(x, torch.Tensor):
        x = x.transpose(0, 1)
    with _deterministic():
        for sample in chunk_method(x):
            model.zero_grad(set_to_none=True)
            if type(sample) is not tuple:
                sample = sample.unsqueeze(0 if batch_first else 1)
            model(sample).backward()
            for name, param in named:
                rows[name].append(torch.zeros_like(param) if param.grad is None else param.grad.detach().clone())
    return {name: torch.stack(rows[name]) if rows[name] else param.new_zeros((0, *param.shape))
            for name, param in named}


def compute_opacus_grad_sample(
    x: Batch,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
) -> Dict[str, torch.Tensor]:
    """dptorch's per-sample gradients of a copy of ``module`` in ``grad_sample_mode``, by parameter name."""
    copy = clone_module(module)
    wrapped = wrap_model(copy, grad_sample_mode=grad_sample_mode, batch_first=batch_first, loss_reduction=loss_reduction)
    try:
        with _deterministic():
            ModelWithLoss(wrapped, loss_reduction)(x).backward()
        grad_samples = wrapped.hooks.grad_samples
        return {name: grad_samples[param] for name, param in trainable_parameters(copy) if param in grad_samples}
    finally:
        wrapped.to_standard_module()


def compute_grad_samples_microbatch_and_opacus(
    x: Batch,
    module: nn.Module,
    batch_first: bool = True,
    loss_reduction: str = "mean",
    grad_sample_mode: str = "hooks",
    chunk_method: Callable = iter,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """``(reference, dptorch)`` per-sample gradients of the same batch; raises if their parameter names differ."""
    if isinstance(x, PackedSequence):
        reference = compute_microbatch_grad_sample(unpack_packedsequences(x), module, batch_first=batch_first,
                                                   loss_reduction=loss_reduction, chunk_method=chunk_method)
    elif is_batch_empty(x):
        raise RuntimeError("x is expected to be non-empty: an empty batch has no per-sample gradient to compare")
    else:
        reference = compute_microbatch_grad_sample(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                                   chunk_method=chunk_method)
    computed = compute_opacus_grad_sample(x, module, batch_first=batch_first, loss_reduction=loss_reduction,
                                          grad_sample_mode=grad_sample_mode)
    if reference.keys() != computed.keys():
        raise ValueError(f"parameters differ: only in the reference {sorted(reference.keys() - computed.keys())}, "
                         f"only in dptorch's {sorted(computed.keys() - reference.keys())}")
    return reference, computed


def get_grad_sample_modes(use_ew: bool = False) -> List[str]:
    """The modes Opacus' checks iterate over: ``hooks`` and ``functorch`` (and ``ew`` with ``use_ew``)."""
    return ["hooks", "functorch", "ew"] if use_ew else ["hooks", "functorch"]


def check_per_sample_gradients_are_correct(
    x: Batch,
    module: nn.Module,
    *,
    batch_first: bool = True,
    atol: float = 10e-6,
    rtol: float = 10e-5,
    grad_sample_mode: str = "hooks",
) -> bool:
    """Whether dptorch's per-sample gradients of ``module`` on ``x`` match micro-batching (shapes, and
    values to ``atol``/``rtol``) under both loss reductions. Raises ``RuntimeError`` on an empty batch."""
    if grad_sample_mode == "ew" and not batch_first:
        raise RuntimeError("grad_sample_mode='ew' needs batch_first=True")
    for loss_reduction in LOSS_REDUCTIONS:
        reference, computed = compute_grad_samples_microbatch_and_opacus(
            x, module, batch_first=batch_first, loss_reduction=loss_reduction, grad_sample_mode=grad_sample_mode)
        for name, grad_sample in computed.items():
            expected = reference[name]
            if grad_sample.shape != expected.shape or not torch.allclose(expected, grad_sample, atol=atol, rtol=rtol):
                return False
    return True


__all__ = [
    "ModelWithLoss",
    "check_per_sample_gradients_are_correct",
    "clone_module",
    "compute_grad_samples_microbatch_and_opacus",
    "compute_microbatch_grad_sample",
    "compute_opacus_grad_sample",
    "get_grad_sample_modes",
    "is_batch_empty",
    "l1_test_loss",
    "unpack_packedsequences",
]

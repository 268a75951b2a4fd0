"""``ChunkedLMHead``: an LM head and its cross-entropy, computed a block of the vocabulary at a time.

Called with targets, ``head(hidden, targets)`` returns each row's cross-entropy over its own target tokens
(``(B,)``: their sum, or their mean with ``per_row="mean"``; targets of ``-100`` are ignored) without ever
holding the ``(B, T, V)`` logits: the forward keeps each token's log-sum-exp (``(B, T)``), and every later
pass (the backward to the hidden states, the weight's per-sample gradients, norms and clipped sums)
recomputes the logits of one block of ``vocab_block`` words at a time. Called without targets it is the plain
head, ``hidden @ weight.T`` (evaluation, generation).

The weight's gradient for sample ``i`` is ``sum_t s_it g_it h_it^T``: ``h_it`` the hidden state, ``g_it`` the
softmax of the logits minus the target's one-hot, and ``s_it`` the output gradient of row ``i``'s loss times
its token weight (1, or one over the row's target count). Every pass forms ``g`` by the one function
``_token_grads`` on the same blocks, so the norms and the clipped sum see the same values:

* grad sampler (hooks mode): the ``(B, V, d)`` per-sample gradients, block by block;
* norms (bk, ghost): per block, instantiated (``T >= d``) or as the Gram sum ``<g g^T, h h^T>`` (``T < d``),
  certified products (``norms/exact_products.py``), the clipped sum's rounding certified (``norms/certified.py``)
  with the magnitude ``sum_t ||h_it|| ||s_it g_it||``;
* clipped sum: the batch gradient with ``s_it`` scaled by the row's clip factor, block by block.

A tied head (its weight an input embedding's) has no linear form here (it would hold ``g`` whole): the
controller instantiates its per-sample gradient from the grad sampler and adds the embedding's, so the norm
is the norm of the sum of the two uses. The output mixes a row's tokens, so the layer is not token-wise:
examples packed in one row are refused by the token tracker.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dptorch.grad_sample.layers.linear import linear_map_grad_samples, linear_norms, linear_sums, param_shape
from dptorch.grad_sample.layers.registry import register_grad_sampler, register_norm_sampler
from dptorch.grad_sample.norms.certified import certified_norms_sq, gamma
from dptorch.grad_sample.norms.exact_products import (
    ProductSum,
    certified_gram,
    certified_product,
    frobenius_upper,
    operands,
    square_norm_upper,
)
from dptorch.grad_sample.norms.linear_forms import CLIP_ROUNDINGS, token_sums

Tensors = Tuple[torch.Tensor, ...]
IGNORE_INDEX = -100
PER_ROW = ("sum", "mean")
#: logits held at once by default: 2^22 float32 numbers (16 MiB) per block, whatever the batch's tokens
DEFAULT_BLOCK_ELEMENTS = 1 << 22


# ----------------------------------------------------------------------------- the math (pure functions)


def vocab_blocks(vocab: int, tokens: int, block_elements: int) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` of each block of words whose logits for ``tokens`` tokens hold about ``block_elements``."""
    width = max(1, block_elements // max(1, tokens))
    for start in range(0, vocab, width):
        yield start, min(vocab, start + width)


def _block_logits(h: torch.Tensor, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``(N, stop - start)`` float32 logits of the flat hidden states ``h`` for the words ``start:stop``."""
    return h @ weight[start:stop].to(h.dtype).t()


def _flat(hidden: torch.Tensor) -> torch.Tensor:
    """``(N, d)`` hidden states in float32 at least."""
    h = hidden.reshape(-1, hidden.shape[-1])
    return h if h.dtype in (torch.float32, torch.float64) else h.float()


def log_sum_exp_and_target(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           block_elements: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-sum-exp over the vocabulary and its target's logit (0 where ignored), block by block."""
    lse = torch.full((h.shape[0],), float("-inf"), dtype=h.dtype, device=h.device)
    target_logit = torch.zeros_like(lse)
    for start, stop in vocab_blocks(weight.shape[0], h.shape[0], block_elements):
        logits = _block_logits(h, weight, start, stop)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        inside = (targets >= start) & (targets < stop)
        if inside.any():
            picked = logits.gather(1, (targets - start).clamp(0, stop - start - 1).unsqueeze(1)).squeeze(1)
            target_logit = torch.where(inside, picked, target_logit)
    return lse, target_logit


def token_weights(targets: torch.Tensor, per_row: str) -> torch.Tensor:
    """``(B, T)`` weight of each token in its row's loss: 0 where ignored, else 1 (sum) or 1 / the row's count."""
    valid = (targets != IGNORE_INDEX).float()
    return valid if per_row == "sum" else valid / valid.sum(1, keepdim=True).clamp(min=1.0)


def _token_grads(h: torch.Tensor, weight: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                 start: int, stop: int) -> torch.Tensor:
    """``(N, stop - start)``: the softmax minus the target's one-hot, on the words ``start:stop`` (unscaled)."""
    g = (_block_logits(h, weight, start, stop) - lse.unsqueeze(1)).exp_()
    inside = (targets >= start) & (targets < stop)
    rows = inside.nonzero().squeeze(1)
    g[rows, targets[rows] - start] -= 1.0
    return g


def _token_scales(targets: torch.Tensor, per_row: str, row_grads: torch.Tensor) -> torch.Tensor:
    """``(N,)`` float32: each token's weight times its row's output gradient."""
    return (token_weights(targets, per_row) * row_grads.float().unsqueeze(1)).reshape(-1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Each row's cross-entropy of ``hidden @ weight.T`` against ``targets``; saves no logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, per_row, block_elements):
        h = _flat(hidden)
        flat_targets = targets.reshape(-1)
        lse, target_logit = log_sum_exp_and_target(h, weight, flat_targets, block_elements)
        per_token = (lse - target_logit).view(targets.shape)
        losses = (per_token * token_weights(targets, per_row)).sum(1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.per_row, ctx.block_elements = per_row, block_elements
        return losses

    @staticmethod
    def backward(ctx, row_grads):
        hidden, weight, targets, lse = ctx.saved_tensors
        h, flat_targets = _flat(hidden), targets.reshape(-1)
        scales = _token_scales(targets, ctx.per_row, row_grads).to(h.dtype).unsqueeze(1)
        wants_hidden, wants_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if wants_hidden else None
        grad_w = torch.zeros(weight.shape, dtype=h.dtype, device=h.device) if wants_weight else None
        for start, stop in vocab_blocks(weight.shape[0], h.shape[0], ctx.block_elements):
            g = _token_grads(h, weight, lse, flat_targets, start, stop).mul_(scales)
            if wants_hidden:
                grad_h.addmm_(g, weight[start:stop].to(h.dtype))
            if wants_weight:
                grad_w[start:stop] = g.t() @ h
        grad_hidden = None if grad_h is None else grad_h.view(hidden.shape).to(hidden.dtype)
        return grad_hidden, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


# ----------------------------------------------------------------------------- the module


class ChunkedLMHead(nn.Module):
    """A bias-free LM head whose call with targets is each row's cross-entropy, block by block of the vocabulary.

    ``weight`` (``(V, d)``) is the head's parameter itself (``from_linear`` keeps the Linear's, so a tied input
    embedding stays tied). ``per_row``: ``"mean"`` (each row's mean over its own target tokens, the private
    Trainer's loss) or ``"sum"``. ``block_elements``: how many logits one block holds.
    """

    def __init__(self, weight: nn.Parameter, per_row: str = "mean", block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> None:
        super().__init__()
        if per_row not in PER_ROW:
            raise ValueError(f"per_row must be one of {PER_ROW}, got {per_row!r}")
        if weight.dim() != 2:
            raise ValueError(f"an LM head's weight is (vocabulary, width); got shape {tuple(weight.shape)}")
        self.weight = weight
        self.per_row = per_row
        self.block_elements = int(block_elements)
        self.out_features, self.in_features = param_shape(weight)
        self.bias = None  # (HF's weight tying reads it)
        self._pending: Optional[torch.Tensor] = None
        self.register_forward_pre_hook(self._add_pending_targets)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "ChunkedLMHead":
        """The chunked head of ``linear`` (its very weight); a head with a bias is refused."""
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            what = type(linear).__name__ + (" with a bias" if isinstance(linear, nn.Linear) else "")
            raise ValueError(f"ChunkedLMHead replaces a bias-free nn.Linear LM head; this head is a {what}")
        return cls(linear.weight, **options)

    def forward(self, hidden: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if targets is None:
            return F.linear(hidden, self.weight)
        if targets.shape != hidden.shape[:-1] or hidden.dim() != 3:
            raise ValueError(f"targets of shape {tuple(targets.shape)} do not match hidden states of shape "
                             f"{tuple(hidden.shape)}: one target per (row, position)")
        return _ChunkedCrossEntropy.apply(hidden, self.weight, targets, self.per_row, self.block_elements)

    @contextlib.contextmanager
    def computing_loss(self, targets: torch.Tensor) -> Iterator[None]:
        """Inside, the head's next call with hidden states alone (a model's own ``self.lm_head(hidden)``) gets
        ``targets`` as its second argument, and so returns the per-row losses in place of the logits."""
        self._pending = targets
        try:
            yield
        finally:
            self._pending = None

    def _add_pending_targets(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        if self._pending is None or len(args) != 1:
            return None
        targets, self._pending = self._pending, None
        return args[0], targets

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, per_row={self.per_row!r}"


# ----------------------------------------------------------------------------- per-sample rules


def _blocks_of(module: ChunkedLMHead, activations: Tensors, row_grads: torch.Tensor):
    """``(h, targets, scales, lse, blocks)`` of one loss call: flat hidden states, targets, token scales."""
    hidden, targets = activations
    h, flat_targets = _flat(hidden), targets.reshape(-1)
    lse, _ = log_sum_exp_and_target(h, module.weight, flat_targets, module.block_elements)
    scales = _token_scales(targets, module.per_row, row_grads).to(h.dtype)
    return h, flat_targets, scales, lse, list(vocab_blocks(module.weight.shape[0], h.shape[0], module.block_elements))


def _trainable(module: ChunkedLMHead) -> bool:
    return module.weight.requires_grad


def chunked_head_grad_sampler(module: ChunkedLMHead, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients ``(B, V, d)`` of the weight, block by block (the logits' call: ``nn.Linear``'s)."""
    if len(activations) == 1:
        return linear_map_grad_samples(module.weight, None, activations[0], backprops)
    if not _trainable(module):
        return {}
    rows, tokens = activations[1].shape
    h, targets, scales, lse, blocks = _blocks_of(module, activations, backprops)
    out = h.new_empty((rows, *param_shape(module.weight)))
    hidden = h.view(rows, tokens, h.shape[-1])
    for start, stop in blocks:
        g = _token_grads(h, module.weight, lse, targets, start, stop).mul_(scales.unsqueeze(1))
        torch.bmm(g.view(rows, tokens, stop - start).transpose(1, 2), hidden, out=out[:, start:stop])
    return {module.weight: out.to(module.weight.dtype)}


def chunked_head_norms_sq(module: ChunkedLMHead, activations: Tensors, backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """Certified squared norms of each row's weight gradient, block by block, as certified products
    (``exact_products``): ghost (the Gram of the scaled token gradients summed over the blocks) for
    ``T < d``, else each block's instantiated gradient (the blocks are disjoint rows of the weight)."""
    if len(activations) == 1:
        return linear_norms(module.weight, None, activations[0], backprops)
    if not _trainable(module):
        return {}
    rows, tokens = activations[1].shape
    h, targets, scales, lse, blocks = _blocks_of(module, activations, backprops)
    (hidden,) = operands(h.view(rows, tokens, h.shape[-1]))
    width, vocab = hidden.shape[2], module.weight.shape[0]
    ghost = tokens < width  # the Gram sum costs T^2 per word, instantiation T d
    grad_gram = ProductSum()
    upper = torch.zeros(rows, dtype=torch.float64, device=h.device)
    grad_sq = torch.zeros(rows, tokens, dtype=torch.float64, device=h.device)
    for start, stop in blocks:
        # scaled in the clipped sum's dtype: one more rounding of each term, counted in sum_terms below
        g = _token_grads(h, module.weight, lse, targets, start, stop).mul_(scales.to(h.dtype).unsqueeze(1))
        (g,) = operands(g.view(rows, tokens, stop - start))
        grad_sq += torch.linalg.vector_norm(g, dim=2, dtype=torch.float64).square()
        if ghost:
            grad_gram.add(certified_gram(g))
        else:
            upper += square_norm_upper(certified_product(g.transpose(1, 2), hidden))
    if ghost:
        upper = frobenius_upper(certified_gram(hidden), grad_gram.result())
    else:
        upper = upper * (1 + gamma(len(blocks) + 1, torch.float64))
    terms = width + tokens + vocab + 4
    magnitude = (grad_sq.sqrt() * torch.linalg.vector_norm(hidden, dim=2, dtype=torch.float64)).sum(1)
    magnitude = magnitude * (1 + gamma(terms, torch.float64))
    return {module.weight: certified_norms_sq(upper, magnitude, sum_terms=tokens + CLIP_ROUNDINGS + 1, sum_dtype=h.dtype)}


def chunked_head_clipped_sum(module: ChunkedLMHead, activations: Tensors, scaled_backprops: torch.Tensor) -> Dict[nn.Parameter, torch.Tensor]:
    """The batch gradient of the weight with each row's output gradient scaled by its clip factor."""
    if len(activations) == 1:
        return linear_sums(module.weight, None, activations[0], scaled_backprops)
    if not _trainable(module):
        return {}
    rows, tokens = activations[1].shape
    h, targets, scales, lse, blocks = _blocks_of(module, activations, scaled_backprops)
    summed = h.new_empty(param_shape(module.weight))
    hidden = h.view(rows, tokens, h.shape[-1])
    for start, stop in blocks:  # each row's tokens summed on their own first (``token_sums``)
        g = _token_grads(h, module.weight, lse, targets, start, stop).mul_(scales.unsqueeze(1))
        summed[start:stop] = token_sums(g.view(rows, tokens, stop - start), hidden)
    return {module.weight: summed.float()}


def _probe(module: ChunkedLMHead, generator: torch.Generator) -> Tensors:
    """Two rows of three tokens, one target ignored."""
    targets = torch.randint(0, module.out_features, (2, 3), generator=generator)
    targets[0, 1] = IGNORE_INDEX
    return torch.randn(2, 3, module.in_features, generator=generator), targets


register_grad_sampler(ChunkedLMHead, probe=_probe)(chunked_head_grad_sampler)
register_norm_sampler(ChunkedLMHead, clipped_sum=chunked_head_clipped_sum)(chunked_head_norms_sq)

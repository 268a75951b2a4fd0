"""Losses: per-sample with reduction="none" along dim 0, otherwise a loss over the batch."""

from __future__ import annotations

from typing import Callable, Dict

from torch import Tensor

from dptorch.grad_sample.tracking.args import Tracker, op_name, tensors_of
from dptorch.grad_sample.tracking.loss import loss_total
from dptorch.grad_sample.tracking.tags import DIM, KEEP, WEAK


# targets (and ctc's lengths) with fewer dims than the input, their dim 0 the batch's: not broadcast from the right
_LEADING = {"cross_entropy", "nll_loss", "multi_margin_loss", "cosine_embedding_loss", "gaussian_nll_loss", "ctc_loss"}


def loss_rule(tr: Tracker, func, args, kwargs):
    x = args[0] if args else kwargs.get("input")
    tag = tr.get(x)
    name = op_name(func)
    others = [(t, tr.get(t)) for _, t in tensors_of(args, kwargs) if t is not x]
    out = tr.run(func, args, kwargs)
    if tag is None and all(g is None for _, g in others):
        return out
    at = 1 if name == "ctc_loss" and x.ndim == 3 else 0  # ctc's log_probs are (time, batch, classes)
    if isinstance(out, Tensor) and out.ndim and type(tag) is int and tag & DIM == at and all(
            _aligned(name, x, tag, at, t, g) for t, g in others):
        tr.put(out, tag & KEEP)
    elif isinstance(out, Tensor) and not out.ndim:
        tr.put(out, loss_total(tr, func, args, kwargs, tag))
    else:
        tr.put(out, tr.lost_from(f"{name} (a loss over the batch)", [tag, *(g for _, g in others)]))
    return out


def _aligned(name: str, x: Tensor, tag: int, at: int, t: Tensor, g) -> bool:
    """Whether a target ``t`` (tag ``g``) of a per-sample loss of ``x`` (batched along ``at``) is shared, or
    batched along its dim 0 as ``x`` is, that dim meeting ``x``'s batch dim."""
    if g is None:
        return True
    if type(g) is not int or g & DIM or (g & ~(DIM | WEAK)) != (tag & ~(DIM | WEAK)) or not t.ndim:
        return False
    return t.shape[0] == x.shape[at] and (t.ndim == x.ndim or name in _LEADING)


RULES: Dict[str, Callable] = {n: loss_rule for n in """cross_entropy nll_loss binary_cross_entropy
binary_cross_entropy_with_logits mse_loss l1_loss smooth_l1_loss huber_loss kl_div poisson_nll_loss gaussian_nll_loss
cosine_embedding_loss margin_ranking_loss hinge_embedding_loss multilabel_margin_loss multilabel_soft_margin_loss
multi_margin_loss soft_margin_loss triplet_margin_loss triplet_margin_with_distance_loss ctc_loss""".split()}

"""Losses: per-sample with reduction="none" along dim 0, otherwise a loss over the batch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict

from torch import Tensor

from dptorch.grad_sample.tracking.args import op_name, tensors_of
from dptorch.grad_sample.tracking.loss import loss_total
from dptorch.grad_sample.tracking.tags import DIM

if TYPE_CHECKING:
    from dptorch.grad_sample.tracking.mode import BatchTracker


def loss_rule(tr: BatchTracker, func, args, kwargs):
    x = args[0] if args else kwargs.get("input")
    tag = tr.get(x)
    out = tr.run(func, args, kwargs)
    if tag is None and not any(tr.get(t) is not None for _, t in tensors_of(args, kwargs)):
        return out
    if isinstance(out, Tensor) and out.ndim and type(tag) is int and tag & DIM == 0:
        tr.put(out, tag)
    elif isinstance(out, Tensor) and not out.ndim:
        tr.put(out, loss_total(tr, func, args, kwargs, tag))
    else:
        tr.put(out, tr.lost_from(f"{op_name(func)} (a loss over the batch)", [tr.get(t) for _, t in tensors_of(args, kwargs)]))
    return out


RULES: Dict[str, Callable] = {n: loss_rule for n in """cross_entropy nll_loss binary_cross_entropy
binary_cross_entropy_with_logits mse_loss l1_loss smooth_l1_loss huber_loss kl_div poisson_nll_loss gaussian_nll_loss
cosine_embedding_loss margin_ranking_loss hinge_embedding_loss multilabel_margin_loss multilabel_soft_margin_loss
multi_margin_loss soft_margin_loss triplet_margin_loss triplet_margin_with_distance_loss ctc_loss""".split()}

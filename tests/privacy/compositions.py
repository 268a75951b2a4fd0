"""The fuzzer's vocabulary: torch operations, trainable layers and losses, composed into a model.

A :class:`Composition` names trainable layers (Linear, Embedding, LayerNorm, Conv1d; all of width
``D``), the operations applied before, between and after them, the loss, and where the loss is
computed (outside the model, as ``loss_fn(model(x), y)``; inside the forward, HF-style
``out.loss``; or inside but unused, the step back-propagating the logits' per-sample sum).
:func:`build` turns it into an ``nn.Module``.

Each operation is a pure function of a ``(n, T, D)`` tensor that returns the same shape. ``ROW_OPS``
act on each sample alone; ``MIXING_OPS`` let one sample's values or gradient reach another's (or
leave the tracked world: ``.data``, numpy, ``.item()``, ``.tolist()``, Python loops). The
classification only steers the drawing and the report: the oracle in ``test_sensitivity.py`` asks
the same of every composition (refused, or exact against the batch-of-one reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

D = 4  # width of every layer and the number of classes
VOCAB = 7
IGNORE = -100
PERM = [2, 0, 3, 1]


def _shared_weight() -> torch.Tensor:
    """A fixed matrix every sample is multiplied by (not trainable, not batch-derived)."""
    return torch.linspace(-1.0, 1.0, D * D).reshape(D, D)


# ------------------------------------------------------------------------ row-wise operations


def _inplace(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Apply an in-place method to a copy (never to the caller's input or a saved tensor)."""
    return lambda h, w: fn(h.clone())


def _setitem_within_row(h, w):
    y = h.clone()
    y[..., 0] += h[..., 1]
    return y


def _scale_time0(h, w):
    y = h.clone()
    y[:, 0] = y[:, 0] * 2.0
    return y


ROW_OPS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "tanh": lambda h, w: torch.tanh(h),
    "relu": lambda h, w: F.relu(h),
    "gelu": lambda h, w: F.gelu(h),
    "sigmoid": lambda h, w: torch.sigmoid(h),
    "sin": lambda h, w: torch.sin(h),
    "affine": lambda h, w: h * 1.5 + 0.25,
    "square": lambda h, w: h * h,
    "where": lambda h, w: torch.where(h > 0, h, 0.1 * h),
    "masked_fill_own": lambda h, w: h.masked_fill(h > 0.8, 0.0),
    "tanh_": _inplace(lambda y: y.tanh_()),
    "mul_": _inplace(lambda y: y.mul_(2.0)),
    "add_": _inplace(lambda y: y.add_(1.0)),
    "relu_inplace": _inplace(lambda y: F.relu(y, inplace=True)),
    "clamp_": _inplace(lambda y: y.clamp_(-0.5, 0.5)),
    "softmax_row": lambda h, w: h.softmax(-1),
    "normalize_row": lambda h, w: F.normalize(h, dim=-1),
    "layer_norm_fn": lambda h, w: F.layer_norm(h, (D,)),
    "center_time": lambda h, w: h - h.mean(1, keepdim=True),
    "scale_by_own_norm": lambda h, w: h / (h.pow(2).sum((1, 2), keepdim=True) + 1.0).sqrt(),
    "max_within_row": lambda h, w: h - h.amax(-1, keepdim=True),
    "sort_within_row": lambda h, w: h.sort(-1).values,
    "flatten_unflatten": lambda h, w: h.reshape(h.shape[0], -1).reshape(h.shape),
    "merge_batch_time": lambda h, w: h.reshape(-1, D).reshape(h.shape),
    "transpose_roundtrip": lambda h, w: h.transpose(1, 2).contiguous().transpose(1, 2),
    "unsqueeze_squeeze": lambda h, w: h.unsqueeze(0).squeeze(0),
    "feature_perm": lambda h, w: h[..., PERM],
    "feature_roll": lambda h, w: h.roll(1, -1),
    "time_flip": lambda h, w: h.flip(1),
    "cat_shift": lambda h, w: torch.cat([h[..., 1:], h[..., :1]], -1),
    "gather_row": lambda h, w: torch.gather(h, 2, torch.tensor(PERM, device=h.device).expand(h.shape)),
    "gather_first_token": lambda h, w: h + torch.gather(h, 1, h.new_zeros(h.shape[0], 1, D, dtype=torch.long)),
    "gate_by_own_time0": lambda h, w: h * torch.tanh(h[:, :1]),
    "setitem_within_row": _setitem_within_row,
    "scale_time0": _scale_time0,
    "matmul_shared": lambda h, w: h @ w,
    "einsum_shared": lambda h, w: torch.einsum("ntd,de->nte", h, w),
    "loop_rowwise": lambda h, w: torch.stack([h[i] * 2.0 for i in range(h.shape[0])]),
    "numpy_rowwise": lambda h, w: h + torch.from_numpy(np.tanh(h.detach().cpu().numpy())).to(h),
}


# ------------------------------------------------------------------------ mixing operations


def _through_alias(h, write):
    """``write`` into an alias of a copy of ``h``; the copy is returned."""
    z = h * 1.0
    write(z)
    return z


def _put_batch_sum(h, w):
    y = h.clone()
    y.put_(torch.tensor([0], device=h.device), h.sum().reshape(1), accumulate=True)
    return y


def _index_put_other_rows(h, w):
    y = h.clone()
    y.index_put_((torch.tensor([0], device=h.device),), h[1:].sum(0, keepdim=True), accumulate=True)
    return y


def _masked_scatter(h, w):
    mask = (torch.arange(h.numel(), device=h.device) % 2 == 0).reshape(h.shape)
    return h.masked_scatter(mask, h * 2.0)


def _data_assign(h, w):
    y = h * 1.0
    y.data = h.data.cumsum(0)
    return y


def _perm_index(h: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
    """A shared index of ``rows`` rows and ``tokens`` tokens into the features, permuting them (``PERM``)."""
    return torch.tensor(PERM, device=h.device).expand(rows, tokens, D)


def _setitem_batch_sum(h, w):
    h2 = h.clone()
    h2[..., 0] += h[..., 1].sum()
    return h2


MIXING_OPS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cumsum0": lambda h, w: h.cumsum(0),
    "cumsum0_": _inplace(lambda y: y.cumsum_(0)),
    "fft0": lambda h, w: torch.fft.fft(h, dim=0).real,
    "flip0": lambda h, w: h.flip(0),
    "roll0": lambda h, w: h.roll(1, 0),
    "interleave": lambda h, w: h.transpose(0, 1).reshape(h.shape),
    "batch_norm": lambda h, w: F.batch_norm(h.transpose(1, 2), None, None, training=True).transpose(1, 2),
    "mean0": lambda h, w: h - h.mean(0, keepdim=True),
    "sum0": lambda h, w: h + 0.1 * h.sum(0, keepdim=True),
    "max0": lambda h, w: h - h.max(0, keepdim=True).values,
    "sort0": lambda h, w: h.sort(0).values,
    "put_": _put_batch_sum,
    "index_put_": _index_put_other_rows,
    "masked_scatter": _masked_scatter,
    "data_assign": _data_assign,
    "numpy_cumsum": lambda h, w: torch.from_numpy(np.cumsum(h.detach().cpu().numpy(), 0)).to(h),
    "numpy_cumsum_add": lambda h, w: h + torch.from_numpy(np.cumsum(h.detach().cpu().numpy(), 0)).to(h),
    "tolist_flip": lambda h, w: h + torch.tensor(h.detach().flip(0).tolist(), dtype=h.dtype, device=h.device),
    "item_scale": lambda h, w: h * (1.0 + 0.5 * torch.tanh(h.sum()).item()),
    "loop_cumsum": lambda h, w: torch.stack([h[: i + 1].sum(0) for i in range(h.shape[0])]),
    "first_row_gate": lambda h, w: h * torch.tanh(50 * h[:1].detach()),
    "setitem_batch_sum": _setitem_batch_sum,
    # a batch total written in place through an alias, and aliases made where __torch_function__ is not called
    "detach_sub_mean0": lambda h, w: _through_alias(h, lambda z: z.detach().sub_(z.detach().mean(0))),
    "data_add_sum0": lambda h, w: _through_alias(h, lambda z: z.data.add_(z.data.sum(0))),
    "view_add_mean0": lambda h, w: _through_alias(h, lambda z: z.view(z.shape).add_(z.mean(0))),
    "legacy_ctor_mean0": lambda h, w: h - torch.Tensor(h.mean(0).detach()),
    "dlpack_sum0": lambda h, w: h + 0.1 * torch.from_dlpack(h.sum(0).detach()),
    # an index of one row along the batch: sample 0's row only, broadcast into every sample's (or written alone)
    "gather_short": lambda h, w: h + torch.gather(h, 2, _perm_index(h, 1, h.shape[1])),
    "gather_short_method": lambda h, w: h * h.gather(2, _perm_index(h, 1, h.shape[1])).tanh(),
    "scatter_short": lambda h, w: h.scatter(2, _perm_index(h, 1, h.shape[1]), 0.5),
    "scatter_add_short": lambda h, w: h + h.new_zeros(1, *h.shape[1:]).scatter_add(2, _perm_index(h, 1, h.shape[1]),
                                                                                     h.detach()),
    "scatter_short_": _inplace(lambda y: y.scatter_(2, _perm_index(y, 1, y.shape[1]), 0.5)),
}

#: Operations that cut the gradient (their output does not require grad): placed only where a
#: trainable layer follows, else the loss would have no gradient at all.
DETACHING = {"numpy_cumsum"}
OPS = {**ROW_OPS, **MIXING_OPS}


# ------------------------------------------------------------------------ losses


def _token_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every token, ``(n, T)``; ignored labels give 0."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="none").view(y.shape)


def _projection(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    weights = torch.randn(out.shape[1:], generator=g, dtype=torch.float64).to(out)
    return (out * weights).sum()


def _row_mean_ce(out, y):
    """Each row's mean over its own labelled tokens, summed over rows: the per-sample form."""
    counts = (y != IGNORE).sum(1).clamp(min=1)
    return (_token_ce(out, y).sum(1) / counts).sum()


def _contrastive(out, y):
    z = out.flatten(1)
    return F.cross_entropy(z @ z.T, torch.arange(z.shape[0], device=z.device), reduction="sum")


def _batch_baseline(out, y):
    r = _token_ce(out, y).sum(1)
    advantage = (r - r.mean()).detach()
    return (advantage * r).sum()


LOSSES: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    # per-sample terms meeting only in a sum (or a mean by a constant)
    "ce_sum": lambda out, y: _token_ce(out, y).sum(),
    "ce_sum_by_constant": lambda out, y: _token_ce(out, y).sum() / 3.0,
    "projection": _projection,
    "row_mean_ce": _row_mean_ce,
    # terms that couple samples
    "ce_mean": lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=IGNORE),
    "ce_by_label_count": lambda out, y: _token_ce(out, y).sum() / (y != IGNORE).sum().clamp(min=1),
    "ce_by_batch_statistic": lambda out, y: _token_ce(out, y).sum() / (out.detach().pow(2).mean().sqrt() + 1.0),
    "contrastive": _contrastive,
    "batch_baseline": _batch_baseline,
    "ce_by_batch_size": lambda out, y: _token_ce(out, y).sum() / len(y),
    "ce_by_label_copy_count": lambda out, y: (lambda c: _token_ce(out, c).sum() / (c != IGNORE).sum().clamp(min=1))(
        y.clone()),
}
MIXING_LOSSES = {"ce_mean", "ce_by_label_count", "ce_by_batch_statistic", "contrastive", "batch_baseline",
                 "ce_by_batch_size", "ce_by_label_copy_count"}

#: Where the loss is computed and what the backward runs on.
PLACEMENTS = ("outside", "inside", "inside_unused")
LAYERS = ("linear", "embedding", "layernorm", "conv1d")


# ------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Composition:
    """One drawn model and step: ``slots[k]`` are the operations before layer ``k`` (``slots[-1]``:
    after the last layer), ``n`` samples of ``t`` tokens, ``seed`` for weights and data, clipped at ``clip``."""

    layers: Tuple[str, ...]
    slots: Tuple[Tuple[str, ...], ...]
    loss: str = "ce_sum"
    placement: str = "outside"
    n: int = 4
    t: int = 2
    seed: int = 0
    clip: float = 1.0  # max_grad_norm C; a factor common to all rows only shows where some are not clipped

    def __post_init__(self):
        assert len(self.slots) == len(self.layers) + 1, "one slot before each layer and one after the last"
        assert all(op in OPS for slot in self.slots for op in slot), "unknown operation"
        assert self.loss in LOSSES and self.placement in PLACEMENTS and set(self.layers) <= set(LAYERS)

    @property
    def mixing(self) -> bool:
        """Whether an operation or the back-propagated loss couples samples (for the report only)."""
        ops = any(op in MIXING_OPS for slot in self.slots for op in slot)
        return ops or (self.loss in MIXING_LOSSES and self.placement != "inside_unused")

    def __str__(self) -> str:
        parts = [" -> ".join(self.slots[0]) or "x"]
        for layer, slot in zip(self.layers, self.slots[1:]):
            parts.append(f"[{layer}]")
            parts.extend(slot)
        return (f"{' -> '.join(parts)} | loss {self.loss} ({self.placement}) | n={self.n} T={self.t} "
                f"seed={self.seed} C={self.clip:g}")


class Composed(nn.Module):
    """``forward(x, ids, labels=None)``: the composition's operations and layers applied in turn;
    with ``labels``, returns HF's ``CausalLMOutput(loss=..., logits=...)``, the loss computed inside."""

    def __init__(self, c: Composition):
        super().__init__()
        self.composition = c
        self.layers = nn.ModuleList(_layer(kind) for kind in c.layers)
        self.register_buffer("shared", _shared_weight())

    def forward(self, x: torch.Tensor, ids: torch.Tensor, labels: Optional[torch.Tensor] = None):
        h = x
        for k, layer in enumerate(self.layers):
            h = self._run_ops(self.composition.slots[k], h)
            h = _call_layer(self.composition.layers[k], layer, h, ids)
        logits = self._run_ops(self.composition.slots[-1], h)
        if labels is None:
            return logits
        return CausalLMOutput(loss=LOSSES[self.composition.loss](logits, labels), logits=logits)

    def _run_ops(self, ops: Tuple[str, ...], h: torch.Tensor) -> torch.Tensor:
        for op in ops:
            h = OPS[op](h, self.shared)
        return h


def _layer(kind: str) -> nn.Module:
    if kind == "linear":
        return nn.Linear(D, D)
    if kind == "embedding":
        return nn.Embedding(VOCAB, D)
    if kind == "layernorm":
        return nn.LayerNorm(D)
    return nn.Conv1d(D, D, kernel_size=3, padding=1)


def _call_layer(kind: str, layer: nn.Module, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if kind == "embedding":
        return h + layer(ids)
    if kind == "conv1d":
        return layer(h.transpose(1, 2)).transpose(1, 2)
    return layer(h)


def build(c: Composition) -> nn.Module:
    torch.manual_seed(c.seed)
    model = Composed(c)
    with torch.no_grad():  # LayerNorm starts at (1, 0): perturb it so its gradients carry the data
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def data(c: Composition, seed_offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, ids, labels)`` for ``c.n`` samples; about a quarter of the labels are ignored."""
    g = torch.Generator().manual_seed(c.seed * 7919 + seed_offset)
    x = torch.randn(c.n, c.t, D, generator=g)
    ids = torch.randint(0, VOCAB, (c.n, c.t), generator=g)
    labels = torch.randint(0, D, (c.n, c.t), generator=g)
    labels[torch.rand(c.n, c.t, generator=g) < 0.25] = IGNORE
    return x, ids, labels


def loss_of(model: nn.Module, c: Composition, x, ids, labels) -> torch.Tensor:
    """The scalar the step back-propagates, as a user's training loop computes it."""
    if c.placement == "outside":
        return LOSSES[c.loss](model(x, ids), labels)
    out = model(x, ids, labels=labels)
    if c.placement == "inside":
        return out.loss
    return LOSSES["projection"](out.logits, labels)

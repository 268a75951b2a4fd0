"""Every rule of the batch tracker keeps its promise: an output it tags batched holds each sample's rows apart.

For each rule of the registry (``tracking/registry.py``'s ``RULES``: a rule added without a case fails
``test_every_rule_has_a_case``), a few calls built from one batched root ``x`` (float64; long, bool or
complex where the operation needs them) run under a ``BatchTracker`` over adversarial layouts: a batch of
one, the batch along an inner dim, size-1 dims, ``T == n``, second arguments transposed, shortened or
batched along another dim. For every output the tracker tags

- batched along ``b`` (``k`` rows per sample where merged with an inner dim): it has ``n * k`` rows there
  (n > 1), replacing sample ``j`` changes no other sample's rows, and reordering the samples moves each
  sample's rows with it, unchanged (so row ``i`` is one function of sample ``i`` alone, whatever its place:
  ``tril`` across the batch fails this; not checked for random calls, nor for calls given a shared argument
  with a row of its own per sample, which the tracker cannot tell from one shared by all);
- untagged (shared by the samples): replacing any sample changes nothing (n > 1).

A ``Lost`` output is a refusal, which always passes. Rules that hold no data of the batch are ``EXEMPT``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dptorch.grad_sample.tracking import INNER, BatchTracker, Lost
from dptorch.grad_sample.tracking.registry import FAMILIES, RULES, UNFOLLOWED
from dptorch.grad_sample.tracking.rules.elementwise import INPLACE_ALIASES, broadcast
from dptorch.grad_sample.tracking.tags import DIM

#: rules that hold no data of the batch, or cannot run here: why each is left out
EXEMPT = {
    **{name: "returns no tensor (a shape, a flag, a string, an iterator of unbind's rows)"
       for name in ("size dim ndimension numel nelement data_ptr stride storage_offset is_contiguous element_size "
                    "__len__ __bool__ __hash__ __setstate__ __iter__ __contains__ retain_grad "
                    "is_floating_point is_complex is_signed get_device is_pinned is_shared is_set_to type_as_ __dir__ "
                    "__sizeof__ _is_view is_nonzero has_names is_inference is_same_size dim_order "
                    "__array_wrap__ get:shape").split()},
    **{name: "a read out of torch: refused inside the forward (escapes.py)"
       for name in ("item tolist numpy __array__ __float__ __int__ __index__ __complex__ __reduce_ex__ __getstate__ "
                    "untyped_storage storage register_hook __repr__ __format__").split()},
    **{name: "sets an attribute that holds no data" for name in
       ("set:requires_grad", "set:grad", "set:retains_grad", "set:names", "set:name")},
    "backward": "the loss check (loss.py): no tensor result", "grad": "the loss check (loss.py): no tensor result",
    "cuda": "a device move: no accelerator here", "pin_memory": "needs an accelerator",
    **{name: "never dispatched in this torch: x.__add__(y) arrives as add, F.logsigmoid as log_sigmoid, F.upsample* as "
             "interpolate" for name in ("__abs__ __add__ __div__ __ge__ __gt__ __le__ __lt__ __matmul__ __mod__ __mul__ "
                                        "__ne__ __neg__ __pos__ __pow__ __radd__ __rand__ __rmul__ __ror__ __rtruediv__ "
                                        "__rxor__ __sub__ __truediv__ logsigmoid upsample upsample_bilinear "
                                        "upsample_nearest").split()},
    "embedding": "unreachable: registry._find sends a function named embedding to F.embedding or torch.embedding",
    "alias": "no public torch function of that name (torch.ops.aten.alias takes the fail-closed default)",
}

LAYOUTS = (((3, 4), 0), ((1, 4), 0), ((3, 3), 1), ((2, 3, 4), 1), ((4, 1, 4), 0), ((3, 3), 0))
FEW = (((3, 4), 0), ((3, 3), 1), ((2, 3, 4), 1), ((4, 1, 4), 0))  # for the ~200 elementwise operations' generic calls
RANDOM = set("""bernoulli normal uniform exponential random geometric cauchy log_normal dropout dropout1d dropout2d
dropout3d alpha_dropout feature_alpha_dropout rrelu rand_like randn_like randint_like gumbel_softmax
fractional_max_pool2d fractional_max_pool3d""".split())


@dataclass(eq=False)
class Case:
    """``fn(x, d)``: the call on root ``x`` batched along ``d``, over ``layouts`` of ``(shape, d)``."""

    name: str
    fn: Callable
    layouts: tuple = LAYOUTS
    dtype: str = "float"
    positional: bool = False  # a random call, or a shared argument with a row per sample: no reordering check
    values: bool = True  # untagged outputs have defined values (not empty_like's)
    line: int = 0  # where the call is written, and its place in CASES (for the report)
    index: int = 0
    generic: bool = False  # one of the patterns tried on every elementwise operation


CASES: List[Case] = []


def case(name: str, *fns: Callable, layouts: tuple = LAYOUTS, dtype: str = "float", positional: bool = False,
         values: bool = True, generic: bool = False) -> None:
    for fn in fns:
        line = getattr(fn, "func", fn).__code__.co_firstlineno
        CASES.append(Case(name, fn, layouts, dtype, positional or name in RANDOM, values, line, len(CASES), generic))


def _values(shape, dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == "long":
        return torch.randint(0, 4, shape, generator=g)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == "complex":
        return torch.randn(shape, generator=g, dtype=torch.complex128)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def shared(x: torch.Tensor, d: int = -1, shape=None) -> torch.Tensor:
    """A tensor shared by the samples, of ``shape`` (default: ``x``'s with size 1 at ``d``), deterministic."""
    if shape is None:
        shape = tuple(1 if i == d % max(x.ndim, 1) else s for i, s in enumerate(x.shape))
    numel = torch.Size(shape).numel()
    values = torch.linspace(-1.5, 1.3, max(numel, 1), dtype=torch.float64)[:numel].reshape(shape)
    return values > 0 if x.dtype == torch.bool else values.to(x.dtype)


def other_dim(x: torch.Tensor, d: int) -> int:
    """The last dim of ``x`` that is not the batch's (``d`` itself for a 1-D ``x``)."""
    return max((i for i in range(x.ndim) if i != d), default=d)


def other(x: torch.Tensor, d: int) -> torch.Tensor:
    """A second argument batched as ``x`` is (its last non-batch dim flipped)."""
    e = other_dim(x, d)
    return x.flip(e) if e != d else x.clone()


def per_sample(x: torch.Tensor, d: int) -> torch.Tensor:
    """A vector of one entry per sample (each sample's first element), batched along its only dim."""
    return x.movedim(d, 0).flatten(1)[:, 0] if x.ndim > 1 else x


def trailing(x: torch.Tensor, d: int) -> torch.Tensor:
    """A shared tensor of ``x``'s last dim, broadcast over the others (size 1 where that dim is the batch's)."""
    return shared(x, shape=(1 if d == x.ndim - 1 else x.shape[-1],))


# ------------------------------------------------------------------------------------ elementwise

INT_ONLY = {"bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "bitwise_not",
            "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__",
            "__rshift__", "__rrshift__", "__invert__", "gcd", "lcm"}
PATTERNS: Dict[str, Callable] = {
    "x": lambda x, d: (x,),
    "x, y": lambda x, d: (x, other(x, d)),
    "x, shared": lambda x, d: (x, shared(x, d)),
    "shared, x": lambda x, d: (shared(x, d), x),
    "x, trailing": lambda x, d: (x, trailing(x, d)),
    "x, y transposed": lambda x, d: (x, x.mT),
    "x, y reduced": lambda x, d: (x, x.sum(other_dim(x, d)) if x.dtype != torch.bool else x.any(other_dim(x, d))),
    "x, 0.5": lambda x, d: (x, 0.5),
    "x, 2": lambda x, d: (x, 2),
}
MANUAL_ELEMENTWISE = {
    "where": [lambda x, d: torch.where(x > 0, x, shared(x, d)), lambda x, d: torch.where(shared(x, d) > 0, x, other(x, d)),
              lambda x, d: torch.where(x.mT > 0, x, 0.0), lambda x, d: x.where(x < 0, trailing(x, d))],
    "masked_fill": [lambda x, d: x.masked_fill(shared(x, d) > 0, 0.5), lambda x, d: x.masked_fill(x > 0, 0.5),
                    lambda x, d: shared(x, d).expand_as(x).masked_fill(x > 0, 2.0),
                    lambda x, d: x.masked_fill(x.mT > 0, 0.5), lambda x, d: x.clone().masked_fill_(x > 0, 1.0)],
    "lerp": [lambda x, d: torch.lerp(x, other(x, d), 0.3), lambda x, d: torch.lerp(shared(x, d), x, shared(x, d)),
             lambda x, d: x.clone().lerp_(trailing(x, d), x.sigmoid())],
    "addcmul": [lambda x, d: torch.addcmul(x, other(x, d), shared(x, d), value=0.5),
                lambda x, d: torch.addcmul(shared(x, d), x, x.mT)],
    "addcdiv": [lambda x, d: torch.addcdiv(shared(x, d), x, other(x, d).exp()),
                lambda x, d: x.clone().addcdiv_(trailing(x, d), x.exp())],
    "clamp": [lambda x, d: torch.clamp(x, -0.5, 0.5), lambda x, d: torch.clamp(x, min=shared(x, d), max=other(x, d))],
    "clip": [lambda x, d: torch.clip(x, max=trailing(x, d))],
    "clamp_min": [lambda x, d: x.clamp_min(shared(x, d))], "clamp_max": [lambda x, d: x.clamp_max(0.1)],
    "threshold": [lambda x, d: torch.threshold(x, 0.1, -1.0)],  # (F.threshold arrives as _threshold: no rule)
    "log_sigmoid": [lambda x, d: F.logsigmoid(x)], "hardtanh": [lambda x, d: F.hardtanh(x, -0.5, 0.5)],
    "polygamma": [lambda x, d: torch.polygamma(1, x.abs() + 1)],
    "prelu": [lambda x, d: F.prelu(x, shared(x, shape=(1,)))],
    "type": [lambda x, d: x.type(torch.float32)], "to": [lambda x, d: x.to(torch.float32), lambda x, d: x.to(x.mT)],
    "type_as": [lambda x, d: x.type_as(shared(x, d).float())],
    "copy_": [lambda x, d: torch.zeros_like(shared(x, d)).expand_as(x).clone().copy_(x),
              lambda x, d: x.clone().copy_(shared(x, d)), lambda x, d: x.clone().copy_(x.mT)],
    "fill": [lambda x, d: torch.fill(x, 0.5), lambda x, d: x.clone().fill_(x.sum()),
             lambda x, d: x.clone().fill_(shared(x, shape=()))],
    "zero": [lambda x, d: x.clone().zero_()],
    "bernoulli": [lambda x, d: torch.bernoulli(x.sigmoid()), lambda x, d: x.clone().bernoulli_(0.5)],
    "normal": [lambda x, d: torch.normal(x, 0.5), lambda x, d: x.clone().normal_()],
    "get:imag": [lambda x, d: x.imag], "get:real": [lambda x, d: x.real, lambda x, d: x.to(torch.complex128).real],
    "get:data": [lambda x, d: x.data],
    "requires_grad_": [lambda x, d: x.requires_grad_()],
    "cpu": [lambda x, d: x.cpu()],
    "rrelu": [lambda x, d: F.rrelu(x)],  # (in training its random draws depend on the values)
    "dropout": [lambda x, d: F.dropout(x, 0.5, training=True)],
    "dropout1d": [lambda x, d: F.dropout1d(x, 0.5, training=True)],
    "dropout2d": [lambda x, d: F.dropout2d(x, 0.5, training=True)],
    "dropout3d": [lambda x, d: F.dropout3d(x, 0.5, training=True)],
    "alpha_dropout": [lambda x, d: F.alpha_dropout(x, 0.5, training=True)],
    "feature_alpha_dropout": [lambda x, d: F.feature_alpha_dropout(x, 0.5, training=True)],
    "tril": [lambda x, d: torch.tril(x), lambda x, d: x.triu(1).tril(1), lambda x, d: x.clone().tril_()],
    "triu": [lambda x, d: torch.triu(x, -1)],
}


def _callables(name: str) -> list:
    """The tensor method ``name`` and the first function of that name in ``torch`` or ``F``, where they exist."""
    method = getattr(torch.Tensor, name, None)
    function = next((f for f in (getattr(torch, name, None), getattr(F, name, None)) if callable(f)), None)
    return [f for f in (method, function) if callable(f)]


def _elementwise_cases() -> None:
    for name in FAMILIES["elementwise"]:
        if name in EXEMPT:
            continue
        dtypes = ("long", "bool") if name in INT_ONLY else ("complex",) if name == "get:imag" else ("float",)
        if name in MANUAL_ELEMENTWISE:
            for dtype in dtypes:
                case(name, *MANUAL_ELEMENTWISE[name], dtype=dtype)
            continue
        for dtype in dtypes:
            for f in _callables(name):
                case(name, *(lambda x, d, f=f, p=p: f(*p(x, d)) for p in PATTERNS.values()), dtype=dtype, layouts=FEW,
                     generic=True)
            inplace = getattr(torch.Tensor, name + "_", None) if not name.startswith("__") else None
            if callable(inplace):
                case(name, *(lambda x, d, f=inplace, p=p: f(p(x, d)[0].clone(), *p(x, d)[1:])
                             for k, p in PATTERNS.items() if not k.startswith("shared")), dtype=dtype, layouts=FEW,
                     generic=True)


_elementwise_cases()

# ------------------------------------------------------------------------------------ metadata (factories)

for _name in ("zeros_like", "ones_like", "rand_like", "randn_like"):
    case(_name, lambda x, d, f=getattr(torch, _name): f(x))
case("empty_like", lambda x, d: torch.empty_like(x), values=False)
case("full_like", lambda x, d: torch.full_like(x, 0.5), lambda x, d: torch.full_like(x, x.sum()))
case("randint_like", lambda x, d: torch.randint_like(x, 5))
case("new_zeros", lambda x, d: x.new_zeros(x.shape))
case("new_ones", lambda x, d: x.new_ones((2, 3)))
case("new_full", lambda x, d: x.new_full(x.shape, 0.5))
case("new_empty", lambda x, d: x.new_empty(x.shape), values=False)
case("new_empty_strided", lambda x, d: x.new_empty_strided(x.shape, x.stride()), values=False)

# ------------------------------------------------------------------------------------ reductions, scans, sorts

E = other_dim
for _name in ("sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "logsumexp", "std", "var", "norm",
              "count_nonzero", "argmax", "argmin", "median", "nanmedian", "mode", "max", "min", "std_mean", "var_mean",
              "aminmax", "all", "any"):
    _f = getattr(torch, _name)
    case(_name, lambda x, d, f=_f: f(x, E(x, d)), lambda x, d, f=_f: f(x, dim=d), lambda x, d, f=_f: f(x),
         lambda x, d, f=_f: f(x, 0, keepdim=True), lambda x, d, f=_f: f(x, -1, True), generic=True)
    if _name in ("all", "any", "count_nonzero", "amax"):
        case(_name, lambda x, d, f=_f: f(x, E(x, d)), lambda x, d, f=_f: f(x, -1), dtype="bool")
case("sum", lambda x, d: x.sum((0, -1)), lambda x, d: x.sum([E(x, d)], keepdim=True),
     lambda x, d: x.sum(dtype=torch.float32))
case("mean", lambda x, d: x.mean((E(x, d),)), lambda x, d: x.mean(E(x, d), True))
case("norm", lambda x, d: torch.norm(x, 2, E(x, d)), lambda x, d: x.norm(dim=E(x, d), keepdim=True),
     lambda x, d: torch.norm(x, "fro", (E(x, d),)))
case("std", lambda x, d: torch.std(x, E(x, d), True, True), lambda x, d: x.std(E(x, d), correction=0))
case("max", lambda x, d: torch.max(x, other(x, d)), lambda x, d: x.max(shared(x, d)), lambda x, d: x.max(x.mT))
case("min", lambda x, d: torch.min(x, trailing(x, d)))
case("kthvalue", lambda x, d: torch.kthvalue(x, 1, E(x, d)), lambda x, d: x.kthvalue(1, d, True),
     lambda x, d: x.kthvalue(1))
for _name in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"):
    case(_name, lambda x, d, f=getattr(torch, _name): f(x, E(x, d)), lambda x, d, f=getattr(torch, _name): f(x, d),
         lambda x, d, f=getattr(torch, _name): f(x, dim=-1))
case("cumsum_", lambda x, d: x.clone().cumsum_(E(x, d)), lambda x, d: x.clone().cumsum_(d))
case("cumprod_", lambda x, d: x.clone().cumprod_(E(x, d)), lambda x, d: x.clone().cumprod_(0))
case("sort", lambda x, d: torch.sort(x), lambda x, d: x.sort(d), lambda x, d: x.sort(dim=E(x, d), descending=True))
case("argsort", lambda x, d: torch.argsort(x), lambda x, d: x.argsort(d), lambda x, d: x.argsort(dim=E(x, d)))
case("msort", lambda x, d: torch.msort(x))
case("topk", lambda x, d: torch.topk(x, 1), lambda x, d: x.topk(1, d),
     lambda x, d: x.topk(1, dim=E(x, d), largest=False))
case("diff", lambda x, d: torch.diff(x), lambda x, d: x.diff(dim=d), lambda x, d: x.diff(1, E(x, d)),
     lambda x, d: torch.diff(x, dim=E(x, d), prepend=shared(x, d).narrow(E(x, d), 0, 1).expand(
         [1 if i == E(x, d) else s for i, s in enumerate(x.shape)])),
     lambda x, d: torch.diff(x, dim=E(x, d), append=x.narrow(E(x, d), 0, 1)),
     lambda x, d: torch.diff(x, dim=E(x, d), prepend=x.mT))

# ------------------------------------------------------------------------------------ structural

S3 = (((2, 3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), 2), ((3, 3, 3), 1), ((1, 3, 4), 0), ((3, 1, 4), 0))
case("transpose", lambda x, d: x.transpose(0, -1), lambda x, d: torch.transpose(x, 1, 2), layouts=S3)
case("swapaxes", lambda x, d: x.swapaxes(0, 1), layouts=S3)
case("swapdims", lambda x, d: torch.swapdims(x, 2, 0), layouts=S3)
case("t", lambda x, d: x.t(), lambda x, d: torch.t(x))
case("t_", lambda x, d: x.clone().t_())
case("transpose_", lambda x, d: x.clone().transpose_(0, 1), layouts=S3)
case("swapaxes_", lambda x, d: x.clone().swapaxes_(0, 2), layouts=S3)
case("swapdims_", lambda x, d: x.clone().swapdims_(1, 2), layouts=S3)
case("get:T", lambda x, d: x.T)
case("get:mT", lambda x, d: x.mT, layouts=S3)
case("get:mH", lambda x, d: x.mH, layouts=S3)
case("get:H", lambda x, d: x.H)
case("adjoint", lambda x, d: x.adjoint(), layouts=S3)
case("permute", lambda x, d: x.permute(2, 0, 1), lambda x, d: torch.permute(x, (1, 2, 0)), layouts=S3)
case("movedim", lambda x, d: x.movedim(0, -1), lambda x, d: torch.movedim(x, (0, 1), (2, 0)), layouts=S3)
case("moveaxis", lambda x, d: torch.moveaxis(x, 2, 0), layouts=S3)
case("unsqueeze", lambda x, d: x.unsqueeze(0), lambda x, d: x.unsqueeze(-1), lambda x, d: torch.unsqueeze(x, 1))
case("unsqueeze_", lambda x, d: x.clone().unsqueeze_(1))
case("squeeze", lambda x, d: x.squeeze(), lambda x, d: x.squeeze(d), lambda x, d: x.squeeze(1),
     lambda x, d: x.squeeze((0, 1)), layouts=S3)
case("squeeze_", lambda x, d: x.clone().squeeze_(1), lambda x, d: x.clone().squeeze_(), layouts=S3)
RESHAPES = (((2, 3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), 2), ((3, 3, 4), 0), ((3, 3, 3), 1), ((1, 3, 4), 0), ((3, 1, 1), 0))


def _merged(x, d):
    """``x`` with its batch dim merged with the next dim (or the one before), and split back."""
    return x.flatten(d, d + 1) if d + 1 < x.ndim else x.flatten(d - 1, d)


case("view", lambda x, d: x.view(-1), lambda x, d: x.view(x.shape[0], -1), lambda x, d: x.view(-1, x.shape[-1]),
     lambda x, d: x.view(torch.int64), lambda x, d: x.view(torch.float32), layouts=RESHAPES)
case("reshape", lambda x, d: x.reshape(x.shape[0] * x.shape[1], -1), lambda x, d: x.reshape(-1, x.shape[1]),
     lambda x, d: torch.reshape(x, (x.shape[0], x.shape[1] * x.shape[2])),
     lambda x, d: x.reshape(x.shape[1], x.shape[0], -1), lambda x, d: _merged(x, d).reshape(x.shape),
     lambda x, d: _merged(x, d).transpose(0, -1).reshape(x.shape), layouts=RESHAPES)
case("view_as", lambda x, d: x.flatten().view_as(x), lambda x, d: x.view_as(shared(x, shape=(x.numel(),))),
     layouts=RESHAPES)
case("reshape_as", lambda x, d: x.mT.reshape_as(x), lambda x, d: _merged(x, d).reshape_as(x), layouts=RESHAPES)
case("flatten", lambda x, d: x.flatten(), lambda x, d: x.flatten(1), lambda x, d: torch.flatten(x, 0, 1),
     layouts=RESHAPES)
case("unflatten", lambda x, d: x.unflatten(-1, (1, -1)),
     lambda x, d: _merged(x, d).unflatten(d if d + 1 < x.ndim else d - 1,
     x.shape[d : d + 2] if d + 1 < x.ndim else x.shape[d - 1 : d + 1]), layouts=RESHAPES)
case("ravel", lambda x, d: x.ravel(), layouts=RESHAPES)
EXPANDS = (((3, 1, 4), 0), ((1, 3, 4), 0), ((1, 1, 4), 0), ((2, 3, 1), 1))
case("expand", lambda x, d: x.expand(-1, 5, -1), lambda x, d: x.expand(2, *x.shape), lambda x, d: x.expand(5, 3, 4),
     layouts=EXPANDS)
case("expand_as", lambda x, d: x.expand_as(shared(x, shape=(2, 3, 3, 4))), lambda x, d: shared(x, d).expand_as(x),
     layouts=EXPANDS)
case("broadcast_to", lambda x, d: x.broadcast_to(2, 3, 3, 4), lambda x, d: torch.broadcast_to(x, (5, 3, 4)),
     layouts=EXPANDS)
case("repeat", lambda x, d: x.repeat(1, 2, 1), lambda x, d: x.repeat(2, 1, 1), lambda x, d: x.repeat(2, 1, 1, 1),
     layouts=S3)
case("tile", lambda x, d: x.tile((2,)), lambda x, d: x.tile((2, 1, 1)), lambda x, d: torch.tile(x, (1, 1, 2, 1)),
     layouts=S3)
case("repeat_interleave", lambda x, d: x.repeat_interleave(2, dim=E(x, d)), lambda x, d: x.repeat_interleave(2, d),
     lambda x, d: x.repeat_interleave(2),
     lambda x, d: x.repeat_interleave(torch.arange(x.shape[E(x, d)]) % 2 + 1, dim=E(x, d)),
     lambda x, d: x.repeat_interleave((per_sample(x, d) > 0).long() + 1, dim=E(x, d)), layouts=S3 + (((3, 3, 3), 0),))
case("narrow", lambda x, d: x.narrow(E(x, d), 0, 1), lambda x, d: x.narrow(d, 0, x.shape[d]),
     lambda x, d: x.narrow(d, 0, 1),
     lambda x, d: torch.narrow(x, d, 1, x.shape[d] - 1), layouts=S3)
case("select", lambda x, d: x.select(E(x, d), 0), lambda x, d: x.select(d, 0), lambda x, d: torch.select(x, 0, -1),
     layouts=S3)
case("unfold", lambda x, d: x.unfold(E(x, d), 2, 1), lambda x, d: x.unfold(d, 1, 1), layouts=S3)
case("flip", lambda x, d: x.flip(E(x, d)), lambda x, d: x.flip(d), lambda x, d: torch.flip(x, (0, 1)), layouts=S3)
case("fliplr", lambda x, d: x.fliplr(), layouts=S3)
case("flipud", lambda x, d: torch.flipud(x), layouts=S3)
case("roll", lambda x, d: x.roll(1, E(x, d)), lambda x, d: x.roll(1, d), lambda x, d: x.roll(1), layouts=S3)
case("rot90", lambda x, d: x.rot90(1, (1, 2)), lambda x, d: torch.rot90(x), layouts=S3)
case("view_as_real", lambda x, d: torch.view_as_real(x), layouts=S3, dtype="complex")
case("view_as_complex", lambda x, d: torch.view_as_complex(x), layouts=(((3, 4, 2), 0), ((3, 2, 2), 1), ((4, 2), 1)))
case("pad", lambda x, d: F.pad(x, (1, 2)), lambda x, d: F.pad(x, (0, 0, 1, 0)),
     lambda x, d: F.pad(x, (1, 1), "reflect"),
     lambda x, d: F.pad(x, (1, 1), "circular"), lambda x, d: F.pad(x, (0, 0, 0, 0, 0, 1)), lambda x, d: F.pad(x, (-1, 0)),
     layouts=S3)

# ------------------------------------------------------------------------------------ normalisations

case("softmax", lambda x, d: x.softmax(-1), lambda x, d: F.softmax(x, d), lambda x, d: torch.softmax(x, 0), layouts=S3)
case("log_softmax", lambda x, d: F.log_softmax(x, E(x, d)), lambda x, d: x.log_softmax(d), layouts=S3)
case("softmin", lambda x, d: F.softmin(x, -1), layouts=S3)
case("glu", lambda x, d: F.glu(x, E(x, d)), lambda x, d: F.glu(x, d),
     layouts=(((2, 3, 4), 0), ((4, 2, 2), 1), ((2, 2), 1)))
case("normalize", lambda x, d: F.normalize(x), lambda x, d: F.normalize(x, dim=E(x, d)), layouts=S3)
case("gumbel_softmax", lambda x, d: F.gumbel_softmax(x, dim=E(x, d)),
     lambda x, d: F.gumbel_softmax(x, hard=True, dim=d), layouts=S3)
case("layer_norm", lambda x, d: F.layer_norm(x, x.shape[-1:]), lambda x, d: F.layer_norm(x, x.shape[-2:]),
     lambda x, d: F.layer_norm(x, x.shape[-1:], shared(x, shape=x.shape[-1:]), shared(x, shape=x.shape[-1:])),
     lambda x, d: F.layer_norm(x, x.shape[-1:], per_sample(x, d)),  # a weight of one entry per sample
     layouts=S3 + (((3, 2, 3), 0),))
case("rms_norm", lambda x, d: F.rms_norm(x, x.shape[-1:]), lambda x, d: F.rms_norm(x, x.shape[-1:], per_sample(x, d)),
     layouts=S3 + (((3, 2, 3), 0),))
NCL = (((2, 4, 3), 0), ((3, 4, 5), 0), ((1, 4, 3), 0), ((4, 3, 4), 1), ((2, 4, 3), 2))
case("group_norm", lambda x, d: F.group_norm(x, 2),
     lambda x, d: F.group_norm(x, 2, shared(x, shape=(4,)), shared(x, shape=(4,))),
     layouts=NCL)
case("batch_norm", lambda x, d: F.batch_norm(x, shared(x, shape=(4,)), shared(x, shape=(4,)).abs() + 1),
     lambda x, d: F.batch_norm(x, None, None, training=True),
     lambda x, d: F.batch_norm(x, shared(x, shape=(4,)), shared(x, shape=(4,)) ** 2, x.sum((0, 2))), layouts=NCL)
case("instance_norm", lambda x, d: F.instance_norm(x), layouts=NCL)
case("instance_norm", lambda x, d: F.instance_norm(x, weight=shared(x, shape=(4,))), layouts=NCL, positional=True)
case("local_response_norm", lambda x, d: F.local_response_norm(x, 2), layouts=NCL)

# ------------------------------------------------------------------------------------ linear algebra

M3 = (((2, 3, 4), 0), ((3, 3, 3), 0), ((3, 3, 3), 1), ((3, 3, 3), 2), ((1, 4, 4), 0), ((4, 4), 0), ((4, 4), 1))
case("linear", lambda x, d: F.linear(x, shared(x, shape=(2, x.shape[-1]))),
     lambda x, d: F.linear(x, shared(x, shape=(2, x.shape[-1])), shared(x, shape=(2,))),
     lambda x, d: F.linear(shared(x, d), x.flatten(0, -2)[: x.shape[-1]].mT.contiguous()), layouts=M3)
case("bilinear", lambda x, d: F.bilinear(x, x, shared(x, shape=(2, x.shape[-1], x.shape[-1]))), layouts=M3)
case("matmul", lambda x, d: torch.matmul(x, shared(x, shape=(x.shape[-1], 2))),
     lambda x, d: torch.matmul(shared(x, shape=(2, x.shape[-2])), x),
     lambda x, d: torch.matmul(x, x.mT), lambda x, d: torch.matmul(x, shared(x, shape=(x.shape[-1],))),
     lambda x, d: torch.matmul(shared(x, d), x.mT), layouts=M3)
case("__matmul__", lambda x, d: x @ shared(x, shape=(x.shape[-1], 3)), lambda x, d: x @ x, layouts=M3)
case("__rmatmul__", lambda x, d: shared(x, shape=(3, x.shape[-2])) @ x, lambda x, d: x.__rmatmul__(x), layouts=M3)
case("mm", lambda x, d: torch.mm(x, shared(x, shape=(x.shape[-1], 2))), lambda x, d: x.mm(x),
     lambda x, d: shared(x, d).mm(x),
     layouts=M3)
case("bmm", lambda x, d: torch.bmm(x, shared(x, shape=(1, x.shape[-1], 2)).expand(x.shape[0], -1, -1)),
     lambda x, d: x.bmm(x.mT), lambda x, d: shared(x, d).expand(x.shape[0], -1, -1).bmm(x) if d != 0 else x, layouts=M3)
case("mv", lambda x, d: torch.mv(x, shared(x, shape=(x.shape[-1],))), lambda x, d: x.mv(x.select(0, 0)),
     lambda x, d: shared(x, shape=(2, x.shape[0])).mv(x.select(-1, 0)), layouts=M3)
case("dot", lambda x, d: torch.dot(x.flatten(), shared(x, shape=(x.numel(),))), layouts=M3)
case("vdot", lambda x, d: torch.vdot(x.select(-1, 0), x.select(-1, 1)), layouts=M3)
case("inner", lambda x, d: torch.inner(x, shared(x, shape=(x.shape[-1],))), layouts=M3)
case("addmm", lambda x, d: torch.addmm(shared(x, shape=(2,)), x, shared(x, shape=(x.shape[-1], 2))),
     lambda x, d: torch.addmm(x, x, x), lambda x, d: torch.addmm(x.mT, x, shared(x, shape=(x.shape[-1],) * 2)),
     layouts=M3)
case("baddbmm",
     lambda x, d: torch.baddbmm(x, x, shared(x, shape=(1, x.shape[-1], x.shape[-1])).expand(x.shape[0], -1, -1)),
     lambda x, d: torch.baddbmm(shared(x, d), x, x.mT), lambda x, d: x.baddbmm(batch1=x, batch2=x), layouts=M3)
case("addmv", lambda x, d: torch.addmv(shared(x, shape=(1,)), x, shared(x, shape=(x.shape[-1],))),
     lambda x, d: torch.addmv(x.select(-1, 0), x, x.select(-1, 1)), layouts=M3)
case("addbmm", lambda x, d: torch.addbmm(shared(x, shape=(x.shape[1], x.shape[1])), x, x.mT), layouts=M3)
case("einsum", lambda x, d: torch.einsum("...ij,jk->...ik", x, shared(x, shape=(x.shape[-1], 2))),
     lambda x, d: torch.einsum("ii->i", x), lambda x, d: torch.einsum("ij->ji", x),
     lambda x, d: torch.einsum("ij,kj->ik", x, x), lambda x, d: torch.einsum("ij,ij->i", x, x.flip(1)),
     lambda x, d: torch.einsum("bij,bkj->bik", x, x), lambda x, d: torch.einsum("i...,i...", x, x),
     lambda x, d: torch.einsum("bi,bj->bij", x, x), layouts=M3)
ATTN = (((2, 3, 4), 0), ((3, 3, 4), 1), ((3, 3, 3), 0), ((1, 3, 4), 0))


def _sdpa(x, d, kind):
    q = x[:, None] if x.ndim == 3 else x
    s = shared(q, shape=(1, 1) + q.shape[-2:])
    if kind == "all":
        return F.scaled_dot_product_attention(q, q, q)
    if kind == "query":
        return F.scaled_dot_product_attention(q, s, s)
    if kind == "key":
        return F.scaled_dot_product_attention(s, q, s)
    if kind == "mask":
        return F.scaled_dot_product_attention(s, s, s, attn_mask=q[..., : q.shape[-2]].exp())
    return F.scaled_dot_product_attention(q, q, q, attn_mask=shared(q, shape=(q.shape[-2], q.shape[-2])), is_causal=False)


case("scaled_dot_product_attention",
     *(functools.partial(_sdpa, kind=k) for k in ("all", "query", "key", "mask", "shared mask")),
     layouts=ATTN)
case("cosine_similarity", lambda x, d: F.cosine_similarity(x, shared(x, d)),
     lambda x, d: F.cosine_similarity(x, other(x, d), dim=-1),
     lambda x, d: F.cosine_similarity(x, x.mT, dim=0), layouts=S3)
case("pairwise_distance", lambda x, d: F.pairwise_distance(x, shared(x, d)),
     lambda x, d: F.pairwise_distance(x, other(x, d), keepdim=True),
     layouts=S3)

# ------------------------------------------------------------------------------------ embeddings

IDS = (((3, 4), 0), ((3, 3), 1), ((1, 4), 0), ((2, 3, 4), 1))
case("F.embedding", lambda x, d: F.embedding(x, shared(x, shape=(5, 2)).double()),
     lambda x, d: F.embedding(x, shared(x, shape=(5, 2)).double(), padding_idx=0), layouts=IDS, dtype="long")
case("F.embedding", lambda x, d: F.embedding(shared(x, shape=(2, 3)).long().abs() % x.shape[0], x),
     lambda x, d: F.embedding((x.abs() * 10).long() % x.shape[0], x), layouts=IDS)
case("torch.embedding", lambda x, d: torch.embedding(shared(x, shape=(5, 2)).double(), x), layouts=IDS, dtype="long")
case("torch.embedding", lambda x, d: torch.embedding(x, (x.abs() * 10).long() % x.shape[0]), layouts=IDS)
case("one_hot", lambda x, d: F.one_hot(x, 5), layouts=IDS, dtype="long")
case("embedding_bag", lambda x, d: F.embedding_bag(x, shared(x, shape=(5, 2)).double()),
     lambda x, d: F.embedding_bag(x.flatten(), shared(x, shape=(5, 2)).double(), torch.arange(0, x.numel(), x.shape[-1])),
     lambda x, d: F.embedding_bag(x.select(-1, 0), shared(x, shape=(5, 2)).double(), x.select(-1, 1).cumsum(0) - x.select(-1, 1)),
     layouts=IDS, dtype="long")

# ------------------------------------------------------------------------------------ convolutions and pooling

C1 = (((2, 4, 6), 0), ((1, 4, 6), 0), ((4, 6), 0), ((4, 4, 6), 1), ((2, 4, 6), 2))
C2 = (((2, 4, 6, 6), 0), ((1, 4, 6, 6), 0), ((4, 6, 6), 0), ((2, 4, 6, 6), 1))
C3 = (((2, 4, 4, 4, 4), 0), ((4, 4, 4, 4), 0), ((2, 4, 4, 4, 4), 1))
for _k, _lay in ((1, C1), (2, C2), (3, C3)):
    case(f"conv{_k}d",
         lambda x, d, k=_k: getattr(F, f"conv{k}d")(x, shared(x, shape=(3, 4) + (2,) * k), shared(x, shape=(3,))),
         lambda x, d, k=_k: getattr(F, f"conv{k}d")(x, x[(Ellipsis,) + (slice(0, 2),) * k]),  # a weight of the batch
         layouts=_lay)
    case(f"conv_transpose{_k}d",
         lambda x, d, k=_k: getattr(F, f"conv_transpose{k}d")(x, shared(x, shape=(4, 3) + (2,) * k)), layouts=_lay)
    case(f"avg_pool{_k}d", lambda x, d, k=_k: getattr(F, f"avg_pool{k}d")(x, 2), layouts=_lay)
    case(f"max_pool{_k}d", lambda x, d, k=_k: getattr(F, f"max_pool{k}d")(x, 2), layouts=_lay)
    case(f"max_pool{_k}d_with_indices", lambda x, d, k=_k: getattr(F, f"max_pool{k}d")(x, 2, return_indices=True),
         layouts=_lay)
    case(f"adaptive_avg_pool{_k}d", lambda x, d, k=_k: getattr(F, f"adaptive_avg_pool{k}d")(x, 2), layouts=_lay)
    case(f"adaptive_max_pool{_k}d", lambda x, d, k=_k: getattr(F, f"adaptive_max_pool{k}d")(x, 2), layouts=_lay)
    case(f"lp_pool{_k}d", lambda x, d, k=_k: getattr(F, f"lp_pool{k}d")(x, 2.0, 2), layouts=_lay)
    case(f"max_unpool{_k}d",
         lambda x, d, k=_k: getattr(F, f"max_unpool{k}d")(*getattr(F, f"max_pool{k}d")(x, 2, return_indices=True), 2),
         lambda x, d, k=_k: getattr(F, f"max_unpool{k}d")(x, getattr(F, f"max_pool{k}d")(x.flip(0), 1, return_indices=True)[1], 1),
         layouts=_lay)
for _k in (1, 2):
    case(f"adaptive_max_pool{_k}d_with_indices",
         lambda x, d, k=_k: getattr(F, f"adaptive_max_pool{k}d")(x, 2, return_indices=True), layouts=(C1, C2)[_k - 1])
case("fractional_max_pool2d", lambda x, d: F.fractional_max_pool2d(x, 2, output_size=2), layouts=C2)
case("fractional_max_pool3d", lambda x, d: F.fractional_max_pool3d(x, 2, output_size=2), layouts=C3)
case("interpolate", lambda x, d: F.interpolate(x, scale_factor=2),
     lambda x, d: F.interpolate(x, size=3, mode="linear"), layouts=C1)
case("upsample", lambda x, d: F.upsample(x, scale_factor=2), layouts=C1)
case("upsample_nearest", lambda x, d: F.upsample_nearest(x, scale_factor=2), layouts=C2)
case("upsample_bilinear", lambda x, d: F.upsample_bilinear(x, scale_factor=2), layouts=C2)
case("grid_sample",
     lambda x, d: F.grid_sample(x, shared(x, shape=(1, 3, 3, 2)).tanh().expand(x.shape[0], -1, -1, -1), align_corners=False),
     lambda x, d: F.grid_sample(x, x[:, :2].permute(0, 2, 3, 1).tanh(), align_corners=False),
     lambda x, d: F.grid_sample(x, x.flip(0)[:, :2].permute(0, 2, 3, 1).tanh(), align_corners=False), layouts=C2)
case("conv_tbc", lambda x, d: torch.conv_tbc(x, shared(x, shape=(2, 4, 3)), shared(x, shape=(3,))),
     layouts=(((6, 2, 4), 1), ((6, 1, 4), 1), ((6, 4, 4), 0)))
case("F.unfold", lambda x, d: F.unfold(x, 2), layouts=C2)
case("F.fold", lambda x, d: F.fold(x, (3, 3), 2), layouts=(((2, 8, 4), 0), ((2, 8, 4), 1), ((1, 8, 4), 0)))
case("pixel_shuffle", lambda x, d: F.pixel_shuffle(x, 2),
     layouts=(((2, 4, 3, 3), 0), ((2, 3, 4, 2, 2), 1), ((1, 4, 2, 2), 0)))
case("pixel_unshuffle", lambda x, d: F.pixel_unshuffle(x, 2), layouts=(((2, 1, 4, 4), 0), ((2, 3, 1, 4, 4), 1)))
case("channel_shuffle", lambda x, d: F.channel_shuffle(x, 2), layouts=C1)

# ------------------------------------------------------------------------------------ joins and splits

case("cat", lambda x, d: torch.cat([x, other(x, d)], E(x, d)), lambda x, d: torch.cat([x, x], d),
     lambda x, d: torch.cat([x, shared(x, d).expand_as(x)], E(x, d)), lambda x, d: torch.cat([x, x.mT], E(x, d)),
     lambda x, d: torch.cat([shared(x, d), x], d), layouts=S3)
case("concat", lambda x, d: torch.concat([x, x], dim=-1), layouts=S3)
case("concatenate", lambda x, d: torch.concatenate([shared(x, d).expand_as(x), x], 0), layouts=S3)
case("stack", lambda x, d: torch.stack([x, other(x, d)]), lambda x, d: torch.stack([x, x.mT], -1),
     lambda x, d: torch.stack([x, shared(x, d).expand_as(x)], 1), layouts=S3)
case("split", lambda x, d: x.split(1, E(x, d)), lambda x, d: torch.split(x, 1, d), lambda x, d: x.split(x.shape[d], d),
     layouts=S3)
case("chunk", lambda x, d: x.chunk(2, E(x, d)), lambda x, d: x.chunk(2, d), layouts=S3)
case("tensor_split", lambda x, d: x.tensor_split(2, E(x, d)), lambda x, d: torch.tensor_split(x, [1], dim=d),
     layouts=S3)
case("split_with_sizes", lambda x, d: x.split_with_sizes([1, x.shape[E(x, d)] - 1], E(x, d)),
     lambda x, d: x.split_with_sizes([x.shape[d]], d), layouts=S3)
case("unbind", lambda x, d: x.unbind(E(x, d)), lambda x, d: torch.unbind(x, d), layouts=S3)

# ------------------------------------------------------------------------------------ indexing

G2 = (((3, 4), 0), ((3, 3), 0), ((3, 3), 1), ((4, 3), 1), ((1, 4), 0), ((2, 3, 4), 1), ((3, 2, 3), 0))


def _index(x, e, rows: int, cols: int = 2):
    """A shared index into dim ``e`` of ``x``: ``rows`` rows (at ``e``'s other dims' first place), ``cols`` columns."""
    shape = [1] * x.ndim
    shape[e] = cols
    for i in range(x.ndim):
        if i != e:
            shape[i] = min(rows, x.shape[i])
    return (torch.arange(torch.Size(shape).numel()).reshape(shape) * 7 + 1) % x.shape[e]


def _full_index(x, e, d, cols: int = 2):
    """A shared index into dim ``e``: ``x``'s rows along ``d`` (the same for every sample), ``cols`` along ``e``."""
    shape = list(x.shape)
    shape[e] = cols
    one = [1 if i == d else s for i, s in enumerate(shape)]
    return ((torch.arange(torch.Size(one).numel()).reshape(one) * 7 + 1) % x.shape[e]).expand(shape).contiguous()


GATHERS = [
    lambda x, d: torch.gather(x, E(x, d), _full_index(x, E(x, d), d)),
    lambda x, d: torch.gather(x, E(x, d), _index(x, E(x, d), 1)),  # shortened: one row
    lambda x, d: x.gather(E(x, d), _index(x, E(x, d), 2, 1)),
    lambda x, d: torch.gather(x, d, _full_index(x, d, E(x, d), x.shape[d])),
    lambda x, d: torch.gather(x, d, _index(x, d, 1, x.shape[d])),
    lambda x, d: torch.gather(shared(x, shape=(5,) * x.ndim), d, (x.abs() * 9).long() % 5),  # a lookup
    lambda x, d: torch.gather(x, E(x, d), (x.abs() * 9).long() % x.shape[E(x, d)]),
    lambda x, d: torch.gather(x, E(x, d), (x.mT.abs() * 9).long() % x.shape[E(x, d)]),
]
case("gather", *GATHERS, layouts=G2)
case("gather", lambda x, d: torch.gather(shared(x, shape=(5,) * x.ndim), E(x, d), (x.abs() * 9).long() % 5),
     lambda x, d: torch.gather(x, E(x, d), (torch.arange(x.shape[d]).reshape([-1 if i == d else 1 for i in range(x.ndim)])
                                                     % x.shape[E(x, d)]).expand(x.shape)), layouts=G2, positional=True)
case("take_along_dim", lambda x, d: torch.take_along_dim(x, _index(x, E(x, d), 1), E(x, d)),
     lambda x, d: torch.take_along_dim(x, _index(x, d, 1, 2), d), lambda x, d: torch.take_along_dim(x, _index(x, d, 1, 2)),
     lambda x, d: torch.take_along_dim(shared(x, shape=[5 if i == d else 1 for i in range(x.ndim)]), (x.abs() * 9).long() % 5, d),
     lambda x, d: torch.take_along_dim(x, (x.argsort(E(x, d)))[..., :1] if E(x, d) == x.ndim - 1 else x.argsort(E(x, d)), E(x, d)),
     layouts=G2)


def _scatters(method: str):
    inplace = method.endswith("_")

    def on(target):
        return target.clone() if inplace else target

    return [
        lambda x, d: getattr(on(x), method)(E(x, d), _full_index(x, E(x, d), d), shared(x, d).expand_as(x)),
        lambda x, d: getattr(on(x), method)(E(x, d), _index(x, E(x, d), 1), shared(x, d).expand_as(x)),  # shortened index
        lambda x, d: getattr(on(shared(x, d)), method)(E(x, d), _index(x, E(x, d), 1), x),  # shared self of one row
        lambda x, d: getattr(on(shared(x, d).expand_as(x).contiguous()), method)(E(x, d), _full_index(x, E(x, d), d), x),
        lambda x, d: getattr(on(shared(x, d).expand_as(x).contiguous()), method)(E(x, d), _index(x, E(x, d), 1), x),
        lambda x, d: getattr(on(x), method)(d, _full_index(x, d, E(x, d), x.shape[d]), other(x, d)),
        lambda x, d: getattr(on(shared(x, d).expand_as(x).contiguous()), method)(d, _index(x, d, 1, 1), x),
        lambda x, d: getattr(on(shared(x, shape=(5,) * x.ndim)), method)(d, (x.abs() * 9).long() % 5, x),
    ]


for _method in ("scatter", "scatter_", "scatter_add", "scatter_add_"):
    case(_method, *_scatters(_method), layouts=G2)
    case(_method.rstrip("_"),
         lambda x, d, m=_method: getattr(torch, m.rstrip("_"))(x, E(x, d), _index(x, E(x, d), 1), shared(x, d).expand_as(x)),
         layouts=G2)
for _method in ("scatter_reduce", "scatter_reduce_"):
    _on = (lambda t: t.clone()) if _method.endswith("_") else (lambda t: t)
    case(_method,
         lambda x, d, m=_method, on=_on: getattr(on(x), m)(E(x, d), _full_index(x, E(x, d), d), other(x, d), "amax"),
         lambda x, d, m=_method, on=_on: getattr(on(shared(x, d)), m)(E(x, d), _index(x, E(x, d), 1), x, "sum",
                                                                     include_self=False), layouts=G2)
case("scatter", lambda x, d: torch.scatter(x, E(x, d), _index(x, E(x, d), 1), 0.5),
     lambda x, d: x.scatter(E(x, d), (x.abs() * 9).long() % x.shape[E(x, d)], 0.5), layouts=G2)


def _index_ops(method: str, src: bool):
    inplace = method.endswith("_")

    def on(target):
        return target.clone() if inplace else target

    def source(x, e, at=0):  # the row ``at`` along ``e``
        return x.narrow(e, at % x.shape[e], 1) * 2 if src else 0.5

    def shared_self(x, d):
        return shared(x, d).expand_as(x).contiguous()

    def some(x, d):  # an index derived from the batch
        return (x.abs().sum() * 3).long().reshape(1) % x.shape[E(x, d)]

    fns = [
        lambda x, d: getattr(on(x), method)(E(x, d), torch.tensor([1]), source(x, E(x, d))),
        lambda x, d: getattr(on(x), method)(d, torch.tensor([0]), source(x, d, 1)),  # sample 1's row into 0's
        lambda x, d: getattr(on(shared_self(x, d)), method)(E(x, d), torch.tensor([0]), source(x, E(x, d))),
        lambda x, d: getattr(on(x), method)(E(x, d), some(x, d), source(x, E(x, d))),
    ]
    if src:  # a shared self of 5 along the indexed dim, 2 of its rows written by each sample
        fns.append(lambda x, d: getattr(on(shared(x, d).narrow(E(x, d), 0, 1).expand(
            [5 if i == E(x, d) else s for i, s in enumerate(x.shape)]).contiguous()), method)(
                E(x, d), torch.tensor([1, 3]), x.narrow(E(x, d), 0, 2)))
    return fns


for _method, _src in (("index_add", True), ("index_copy", True), ("index_fill", False)):
    case(_method, *_index_ops(_method, _src), layouts=G2)
    case(_method + "_", *_index_ops(_method + "_", _src), layouts=G2)
case("index_fill", lambda x, d: x.index_fill(E(x, d), torch.tensor([0]), x.sum()), layouts=G2)
case("index_select", lambda x, d: x.index_select(E(x, d), torch.tensor([1, 0])),
     lambda x, d: x.index_select(d, torch.arange(x.shape[d])),
     lambda x, d: x.index_select(d, torch.tensor([0])), lambda x, d: torch.index_select(x, d, torch.arange(x.shape[d]).flip(0)),
     lambda x, d: shared(x, shape=(5, 2)).index_select(0, (x.select(E(x, d), 0).abs() * 9).long() % 5),
     lambda x, d: x.index_select(E(x, d), (x.select(E(x, d), 0).abs() * 9).long() % x.shape[E(x, d)]), layouts=G2)
case("take", lambda x, d: torch.take(x, torch.tensor([0, 2])),
     lambda x, d: shared(x, shape=(5,)).take((x.abs() * 9).long() % 5),
     layouts=G2)


def _getitems():
    A = torch.arange
    return [
        lambda x, d: x[..., 0], lambda x, d: x[0], lambda x, d: x[:, 1:], lambda x, d: x[:1], lambda x, d: x[None, ..., None],
        lambda x, d: x[:, [1, 0]], lambda x, d: x[[1, 0]] if x.shape[0] > 1 else x[[0, 0]], lambda x, d: x[A(x.shape[0])],
        lambda x, d: x[A(x.shape[0])[:, None], A(x.shape[1])[None, :1]], lambda x, d: x[:, A(x.shape[1])[None, :1].expand(2, 1)],
        lambda x, d: x[shared(x, d) > 0] if shared(x, d).shape == x.shape else x[x > 0], lambda x, d: x[x > 0],
        lambda x, d: x[:, (x.select(1, 0).abs() * 9).long() % x.shape[1]] if x.ndim == 2 else x[..., 0],
        lambda x, d: shared(x, shape=(5, 2))[(x.abs() * 9).long() % 5], lambda x, d: x[A(x.shape[0]).flip(0)],
        lambda x, d: x[A(1)], lambda x, d: x[A(x.shape[0])[:1]], lambda x, d: x[..., A(x.shape[-1])[:, None], A(1)[None, :]],
        lambda x, d: x[[0] * x.shape[0]], lambda x, d: x[:, None, 1:2], lambda x, d: x[torch.tensor(0)],
        lambda x, d: x[..., torch.tensor(0)], lambda x, d: x[::2], lambda x, d: x[:, ::2],
        lambda x, d: x.mT[A(x.shape[-1])],
    ]


case("__getitem__", *_getitems(), layouts=G2)
case("__getitem__", lambda x, d: x[torch.arange(x.shape[0]), torch.arange(x.shape[0]) % x.shape[1]], layouts=G2,
     positional=True)  # the diagonal: sample i's element i


def _setitem(target_fn, index_fn, value_fn):
    def fn(x, d):
        target = target_fn(x, d)
        target[index_fn(x, d)] = value_fn(x, d)
        return target

    return fn


_X = lambda x, d: x.clone()  # noqa: E731
_S = lambda x, d: shared(x, d).expand_as(x).clone()  # noqa: E731
_S1 = lambda x, d: shared(x, d).clone()  # noqa: E731
case("__setitem__",
     _setitem(_X, lambda x, d: (Ellipsis, 0), lambda x, d: 0.5),
     _setitem(_X, lambda x, d: (Ellipsis, 0), lambda x, d: shared(x, shape=())),
     _setitem(_X, lambda x, d: (slice(None), 0), lambda x, d: x[:, 1]),
     _setitem(_S, lambda x, d: (Ellipsis,), lambda x, d: x),
     _setitem(_S, lambda x, d: (slice(None), slice(0, 1)), lambda x, d: x[:, 1:2]),
     _setitem(_X, lambda x, d: (0,), lambda x, d: x[-1]),
     _setitem(_X, lambda x, d: (slice(0, 1),), lambda x, d: shared(x, d)),
     _setitem(_X, lambda x, d: (torch.arange(x.shape[0]).flip(0),), lambda x, d: x),
     _setitem(_X, lambda x, d: (x > 0,), lambda x, d: 0.0),
     _setitem(_X, lambda x, d: (shared(x, d).expand_as(x) > 0,), lambda x, d: 1.0),
     _setitem(_S, lambda x, d: (x > 0,), lambda x, d: 1.0),
     _setitem(_X, lambda x, d: (slice(None), [1, 0]), lambda x, d: x[:, :2]),
     _setitem(_X, lambda x, d: (slice(None), [1, 0]), lambda x, d: x.mT[:, :2]),
     _setitem(lambda x, d: x.new_zeros((x.shape[0] + 1,) + x.shape[1:]), lambda x, d: (slice(0, x.shape[0]),),
              lambda x, d: x),
     _setitem(lambda x, d: x.new_zeros((2 * x.shape[0],) + x.shape[1:]), lambda x, d: (slice(None, None, 2),),
              lambda x, d: x),
     layouts=G2)
# a total of the batch written into a shared tensor (loss.py's total_rule takes operations on totals)
case("__setitem__", _setitem(_S1, lambda x, d: (Ellipsis,), lambda x, d: x.sum(d, keepdim=True)), layouts=G2)

# ------------------------------------------------------------------------------------ opaque, sequences, losses, copies

case("masked_select", lambda x, d: x.masked_select(x > 0))
case("nonzero", lambda x, d: torch.nonzero(x > 0))
case("argwhere", lambda x, d: torch.argwhere(x))
case("unique", lambda x, d: torch.unique(x, dim=E(x, d)), dtype="long")
case("unique_consecutive", lambda x, d: torch.unique_consecutive(x), dtype="long")
case("bincount", lambda x, d: torch.bincount(x.flatten()), dtype="long")
case("histc", lambda x, d: torch.histc(x, 4))
case("as_strided", lambda x, d: x.as_strided((2,), (1,)))
case("masked_scatter", lambda x, d: x.masked_scatter(x > 0, x.flip(d)))


def _packed(x, d, lengths):
    lengths = lengths(x)
    return pad_packed_sequence(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False), batch_first=True)[0]


SEQ = (((3, 4, 2), 0), ((1, 4, 2), 0), ((3, 3, 3), 0))
for _name in ("_pack_padded_sequence", "_pad_packed_sequence"):
    case(_name, lambda x, d: _packed(x, d, lambda x: torch.full((x.shape[0],), x.shape[1])), layouts=SEQ)
    case(_name, lambda x, d: _packed(x, d, lambda x: torch.arange(x.shape[0], 0, -1) % x.shape[1] + 1), layouts=SEQ,
         positional=True)
case("_pack_padded_sequence",
     lambda x, d: pack_padded_sequence(x, torch.full((x.shape[0],), 2), batch_first=True).data, layouts=SEQ)

LOSS = (((3, 4), 0), ((4, 4), 0), ((4, 4), 1), ((1, 4), 0), ((3, 4, 2), 0))
_T = lambda x: shared(x, shape=x.shape[1:]).sigmoid().expand_as(x)  # noqa: E731  (a target shared by the samples)
_CLS = lambda x: torch.ones(x.shape[:1] + x.shape[2:], dtype=torch.long)  # noqa: E731
case("cross_entropy", lambda x, d: F.cross_entropy(x, _CLS(x), reduction="none"),
     lambda x, d: F.cross_entropy(x, x.mT.softmax(1) if x.shape[0] == x.shape[1] else _T(x), reduction="none"),
     lambda x, d: F.cross_entropy(x, _CLS(x)), layouts=LOSS)
case("nll_loss", lambda x, d: F.nll_loss(x, _CLS(x), reduction="none"),
     lambda x, d: F.nll_loss(x, (x.mT.abs() * 9).long()[:, 0] % x.shape[1], reduction="none"), layouts=LOSS)
for _name in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
              "binary_cross_entropy_with_logits", "poisson_nll_loss"):
    case(_name, lambda x, d, f=getattr(F, _name): f(x, _T(x), reduction="none"),
         lambda x, d, f=getattr(F, _name): f(x, x.mT.sigmoid(), reduction="none"),
         lambda x, d, f=getattr(F, _name): f(x, x.sum(-1, keepdim=True).sigmoid().expand_as(x).clone(), reduction="none"),
         lambda x, d, f=getattr(F, _name): f(x, x.sum(0).sigmoid().expand_as(x), reduction="none"),
         lambda x, d, f=getattr(F, _name): f(x, _T(x)), layouts=LOSS)
case("mse_loss", lambda x, d: F.mse_loss(x, x.select(-1, 0).sigmoid(), reduction="none"), layouts=LOSS)
case("binary_cross_entropy", lambda x, d: F.binary_cross_entropy(x.sigmoid(), _T(x), reduction="none"),
     lambda x, d: F.binary_cross_entropy(x.sigmoid(), x.mT.sigmoid(), reduction="none"), layouts=LOSS)
case("kl_div", lambda x, d: F.kl_div(x.log_softmax(-1), _T(x), reduction="none"),
     lambda x, d: F.kl_div(x.log_softmax(-1), x.mT.softmax(-1), reduction="none"), layouts=LOSS)
case("gaussian_nll_loss", lambda x, d: F.gaussian_nll_loss(x, _T(x), _T(x) + 1, reduction="none"),
     lambda x, d: F.gaussian_nll_loss(x, _T(x), x.mT.exp(), reduction="none"), layouts=LOSS)
case("cosine_embedding_loss", lambda x, d: F.cosine_embedding_loss(x, _T(x), torch.ones(x.shape[0]), reduction="none"),
     lambda x, d: F.cosine_embedding_loss(x, x.mT, torch.ones(x.shape[0]), reduction="none"), layouts=LOSS[:4])
case("margin_ranking_loss", lambda x, d: F.margin_ranking_loss(x, _T(x), torch.ones_like(x), reduction="none"),
     lambda x, d: F.margin_ranking_loss(x, x.mT, torch.ones_like(x), reduction="none"), layouts=LOSS)
case("hinge_embedding_loss", lambda x, d: F.hinge_embedding_loss(x, torch.ones_like(x), reduction="none"),
     lambda x, d: F.hinge_embedding_loss(x, (x.mT > 0).double() * 2 - 1, reduction="none"), layouts=LOSS)
case("multilabel_margin_loss",
     lambda x, d: F.multilabel_margin_loss(x, torch.zeros_like(x, dtype=torch.long), reduction="none"),
     lambda x, d: F.multilabel_margin_loss(x, (x.mT.abs() * 9).long() % x.shape[1], reduction="none"), layouts=LOSS[:4])
case("multi_margin_loss",
     lambda x, d: F.multi_margin_loss(x, torch.ones(x.shape[0], dtype=torch.long), reduction="none"),
     lambda x, d: F.multi_margin_loss(x, (x.mT.abs() * 9).long()[:, 0] % x.shape[1], reduction="none"), layouts=LOSS[:4])
case("triplet_margin_loss", lambda x, d: F.triplet_margin_loss(x, _T(x), other(x, d), reduction="none"),
     lambda x, d: F.triplet_margin_loss(x, _T(x), x.mT, reduction="none"), layouts=LOSS[:4])
case("triplet_margin_with_distance_loss",
     lambda x, d: F.triplet_margin_with_distance_loss(x, _T(x), other(x, d), reduction="none"),
     lambda x, d: F.triplet_margin_with_distance_loss(x, x.mT, _T(x), reduction="none"), layouts=LOSS[:4])
case("ctc_loss", lambda x, d: F.ctc_loss(x.log_softmax(-1), torch.ones(x.shape[1], 2, dtype=torch.long),
                                         torch.full((x.shape[1],), x.shape[0]), torch.full((x.shape[1],), 2), reduction="none"),
     layouts=(((5, 3, 4), 1), ((4, 4, 4), 0), ((4, 4, 4), 1), ((5, 1, 4), 1)))

case("__deepcopy__", lambda x, d: copy.deepcopy(x))
case("tensor", lambda x, d: torch.tensor(x))
case("as_tensor", lambda x, d: torch.as_tensor(x, dtype=torch.float32))
case("asarray", lambda x, d: torch.asarray(x))
case("new_tensor", lambda x, d: shared(x, d).new_tensor(x), lambda x, d: x.new_tensor([1.0, 2.0]))


def _set_data(x, d):
    target = shared(x, d).clone()
    target.data = x
    return target


case("set:data", _set_data)

# ------------------------------------------------------------------------------------ quantized matmuls (bitsandbytes)


def _gemm_4bit(x, nested=False, bias=None):
    """A shared NF4 weight (3 rows) applied to ``x`` as bitsandbytes' Linear4bit calls it (nested: double
    quantization, the absmax quantized again)."""
    import bitsandbytes.functional as BF

    packed, st = BF.quantize_4bit(shared(x, shape=(3, x.shape[-1])).float(), quant_type="nf4", compress_statistics=nested)
    extra = dict(absmax_8bit=st.absmax, absmax_code=st.state2.code, absmax_offset=st.offset) if nested else {}
    return torch.ops.bitsandbytes.gemm_4bit.default(x.float(), packed.view(-1, 1), list(st.shape),
                                                    st.state2.absmax if nested else st.absmax, st.blocksize,
                                                    st.quant_type, bias=bias, **extra)


def _int8_rows(x, threshold=0.0):
    return torch.ops.bitsandbytes.int8_vectorwise_quant.default(x.half(), threshold)


def _int8_mm(x, row_stats=None, bias=None):
    """``x`` quantized row by row, times a shared int8 weight (LLM.int8() without outlier columns)."""
    rows, scales, _ = _int8_rows(x)
    weight, weight_scales, _ = _int8_rows(shared(x, shape=(3, x.shape[-1])))
    return torch.ops.bitsandbytes.int8_scaled_mm.default(rows, weight, scales if row_stats is None else row_stats,
                                                         weight_scales, bias=bias, dtype=torch.float32)


def _int8_mixed_mm(x):
    """LLM.int8() with its outlier columns: the columns where any row of ``x`` passes the threshold."""
    rows, scales, outliers = _int8_rows(x, 1.0)
    weight, weight_scales, _ = _int8_rows(shared(x, shape=(3, x.shape[-1])))
    return torch.ops.bitsandbytes.int8_mixed_scaled_mm.default(x.half(), rows, weight, scales, weight_scales, outliers)


if importlib.util.find_spec("bitsandbytes") is None:
    EXEMPT.update({name: "bitsandbytes is not installed" for name in FAMILIES["quantized"]})
else:
    case("bitsandbytes::gemm_4bit", lambda x, d: _gemm_4bit(x), lambda x, d: _gemm_4bit(x, nested=True),
         lambda x, d: _gemm_4bit(x, bias=shared(x, shape=(3,)).float()),
         lambda x, d: _gemm_4bit(x, bias=x.float().flatten()[:3]), layouts=M3)
    case("bitsandbytes::int8_vectorwise_quant", lambda x, d: _int8_rows(x), lambda x, d: _int8_rows(x, 1.0),
         layouts=M3)
    case("bitsandbytes::int8_scaled_mm", lambda x, d: _int8_mm(x, row_stats=shared(x, shape=(x.shape[0],)).abs().float() + 1),
         layouts=M3, positional=True)  # a shared scale per row
    case("bitsandbytes::int8_scaled_mm", lambda x, d: _int8_mm(x), lambda x, d: _int8_mm(x, bias=shared(x, shape=(3,)).float()),
         lambda x, d: _int8_mm(shared(x, d).expand_as(x), row_stats=x.float().abs().flatten()[: x.shape[0]]),
         layouts=M3)
    case("bitsandbytes::int8_mixed_scaled_mm", lambda x, d: _int8_mixed_mm(x), layouts=M3)

# ------------------------------------------------------------------------------------ the check


def _key(func) -> str:
    """The registry entry ``func`` dispatches to (as ``registry._find`` looks it up)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:  # an operator (OpOverload): custom operators' rules are keyed by ns::name
        return schema.name
    name = getattr(func, "__name__", None) or ""
    if name in ("__get__", "__set__"):
        return name[2:5] + ":" + str(getattr(getattr(func, "__self__", None), "__name__", ""))
    module = getattr(func, "__module__", None) or ""
    if module == "torch.nn.functional" and "F." + name in RULES:
        return "F." + name
    if name == "embedding" and module != "torch.nn.functional":
        return "torch.embedding"
    if name in RULES:
        return name
    if name in INPLACE_ALIASES:
        return INPLACE_ALIASES[name]
    if name.endswith("_") and RULES.get(name[:-1]) is broadcast:
        return name[:-1]
    return name


class Recording(BatchTracker):
    """A batch tracker that records the registry entries of the operations it follows."""

    def __init__(self, n: int):
        super().__init__(n, skip=lambda: False, quiet=None)
        self.seen: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.add(_key(func))
        return super().__torch_function__(func, types, args, kwargs)


def _tensors(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


@contextlib.contextmanager
def _seeded(c: Case):
    """A random call draws the same numbers every time (the global generator restored after)."""
    if c.name not in RANDOM:
        yield
        return
    state = torch.get_rng_state()
    torch.default_generator.manual_seed(0)
    try:
        yield
    finally:
        torch.set_rng_state(state)


def _plain(c: Case, x: torch.Tensor, d: int) -> List[torch.Tensor]:
    with _seeded(c):
        return [t.detach().clone() for t in _tensors(c.fn(x.clone(), d))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True)
    return torch.equal(a, b)


def _run(c: Case, shape: Tuple[int, ...], d: int):
    """``(entries the call reached, problems)``, or None where the call does not apply to this layout."""
    x = _values(shape, c.dtype, 0)
    n = shape[d]
    try:
        plain = _plain(c, x, d)
    except (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError):
        return None
    tracker = Recording(n)
    failed = {k for k in UNFOLLOWED if "rule failed" in k}
    with _seeded(c):
        with tracker:
            root = x.clone()
            tracker.put(root, d)
            outs = _tensors(c.fn(root, d))
            tags = [tracker.get(o) for o in outs]
    outs = [o.detach() for o in outs]
    where = f"{c.name} {tuple(shape)} batched along {d}, call #{c.index} (line {c.line})"
    problems = [f"{where}: {k}" for k in UNFOLLOWED if "rule failed" in k and k not in failed]
    if [o.shape for o in outs] != [o.shape for o in plain]:
        return tracker.seen, problems + [f"{where}: the tracked call changed the result's shapes"]
    replaced = []
    for j in range(n):
        y = x.clone()
        y.narrow(d, j, 1).copy_(_values(y.narrow(d, j, 1).shape, c.dtype, j + 1))
        replaced.append(_plain(c, y, d))
    rolled = _plain(c, x.roll(1, d), d) if n > 1 and not c.positional else None  # sample i moved to place i + 1
    for k, (o, g) in enumerate(zip(outs, tags)):
        if type(g) is int:
            b, rows = g & DIM, max(g // INNER, 1)
            if b >= o.ndim or (n > 1 and o.shape[b] != n * rows):
                problems.append(f"{where}: output {k} tagged {g} has shape {tuple(o.shape)}, not {n} x {rows} rows")
                continue

            def rows_of(t, i):
                return t.narrow(b, i * rows, rows)

            for j, other_out in enumerate(replaced):
                changed = [i for i in range(n) if i != j and (other_out[k].shape != o.shape or not _same(
                    rows_of(o, i), rows_of(other_out[k], i)))]
                if changed:
                    problems.append(f"{where}: output {k} tagged {g}: replacing sample {j} changed sample(s) {changed}")
                    break
            moved = [i for i in range(n) if rolled is not None and (rolled[k].shape != o.shape or not _same(
                rows_of(o, i), rows_of(rolled[k], (i + 1) % n)))]
            if moved:
                problems.append(f"{where}: output {k} tagged {g}: sample(s) {moved} computed otherwise at another place "
                                "in the batch")
        elif g is None and c.values and n > 1:  # (a batch of one's lost tag is None: the call is that sample's)
            if any(not _same(o, other_out[k]) for other_out in replaced):
                problems.append(f"{where}: output {k} is untagged (shared), yet replacing a sample changes it")
        elif g is not None and type(g) is not Lost:
            problems.append(f"{where}: output {k} has an unexpected tag {g!r}")
    return tracker.seen, problems


@functools.lru_cache(maxsize=None)
def results() -> Tuple[Dict[str, List[str]], frozenset, tuple]:
    """Problems by rule name, the rule names some call reached (in a layout it applies to), and the calls that
    apply to none of their layouts."""
    problems: Dict[str, List[str]] = {}
    covered = set()
    idle = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated forms (dropout2d of 3-D inputs, upsample), on purpose
        for c in CASES:
            ran = False
            for shape, d in c.layouts:
                found = _run(c, shape, d)
                if found is None:
                    continue
                ran, (seen, bad) = True, found
                if c.name in seen:
                    covered.add(c.name)
                problems.setdefault(c.name, []).extend(bad)
            if not ran:
                idle.append(c)
    return problems, frozenset(covered), tuple(idle)


def test_every_rule_has_a_case():
    assert not set(EXEMPT) - set(RULES), f"exempt but not a rule: {sorted(set(EXEMPT) - set(RULES))}"
    _, covered, _ = results()
    missing = sorted(set(RULES) - set(EXEMPT) - covered)
    assert not missing, f"rules without a case that reaches them: {missing}"


def test_every_special_call_applies_to_a_layout():
    """A call written for one rule that fits none of its layouts checks nothing (the generic elementwise
    patterns are tried on every operation, and skipped where they do not apply)."""
    idle = [f"{c.name} (line {c.line})" for c in results()[2] if not c.generic]
    assert not idle, f"calls that apply to none of their layouts: {idle}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_outputs_hold_each_samples_rows_apart(family):
    problems, _, _ = results()
    found = [p for name in FAMILIES[family] for p in problems.get(name, [])]
    assert not found, f"{len(found)} problem(s):\n" + "\n".join(found[:40])


@pytest.mark.parametrize("op", [lambda x, t: x + t, lambda x, t: t * 2.0, lambda x, t: torch.where(x > 0, t, x),
                                lambda x, t: x.clone().add_(t)])
def test_a_batch_dim_of_another_size_is_never_broadcast(op):
    """A tensor tagged batched whose batch dim has one row (a rule's mistake: sample 0's row) is never broadcast
    into the samples' rows as if it were each sample's."""
    x, t = torch.randn(3, 4), torch.randn(1, 4)
    with BatchTracker(3, skip=lambda: False, quiet=None) as tracker:
        tracker.put(x, 0)
        tracker.put(t, 0)
        assert isinstance(tracker.get(op(x, t) + torch.zeros(3, 4)), Lost)

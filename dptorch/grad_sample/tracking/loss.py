"""The loss: samples may meet only in the final sum (or mean) of their own loss terms.

A sum or mean over the batch dimension of a batched tensor is a *total*: a ``Lost`` of kind
"sum" or "mean" (a layer fed it is refused like any other ``Lost``). A total stays a total under
operations that are linear with coefficients shared by all samples (scaling by a constant, adding
totals of the same kind, reshapes, dtype casts, further sums); anything else made from it is
mixing (``log(total)``, ``total * total``, ``per_sample / total``, ...) and is plainly ``Lost``.

``backward`` (and ``torch.autograd.grad``) is where this is checked: what it is called on must
be a total of the controller's ``loss_reduction`` (the gradients are rescaled by that reduction
before clipping), a batched tensor with a per-sample gradient, or free of the batch. Anything
else is refused before any gradient is formed. The tracker keeps following the operations of
the user's loss after the root forward for this (``hooks.py`` moves it to the bottom of torch's
mode stack, so that the user's own modes open and close above it).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional

from torch import Tensor

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tracking.args import Tracker, any_tensor, arg, caller, is_library, op_name, tensors_of
from dptorch.grad_sample.tracking.tags import DIM, WEAK, Lost
from dptorch.grad_sample.tracking.unseen import follow as follow_unseen
from dptorch.grad_sample.tracking.unseen import off as unseen_off
from dptorch.grad_sample.tracking.writes import derived, written

TOTALS = ("sum", "mean")


_ADDITIVE = set("add sub subtract rsub __add__ __radd__ __sub__ __rsub__ __iadd__ __isub__ add_ sub_".split())
_SCALING = set("mul multiply __mul__ __rmul__ __imul__ mul_".split())
_DIVIDING = set("div divide true_divide __truediv__ __itruediv__ div_ __div__ __idiv__".split())
_LINEAR = set("""clone contiguous detach detach_ float double half bfloat16 to type type_as view reshape view_as
reshape_as squeeze unsqueeze flatten ravel expand expand_as broadcast_to neg negative __neg__ __pos__ positive alias
requires_grad_ sum mean __getitem__ get:data cpu cuda""".split())
_LINEAR_PROPERTIES = {"data", "T", "mT", "H", "mH", "real"}
_JOINS = set("cat concat concatenate stack".split())
_ESCAPES = set("item tolist numpy __float__ __int__ __index__ __array__".split())
_BACKWARD = {"backward", "grad"}
_FROM_NUMBER = set("tensor as_tensor asarray scalar_tensor full new_tensor new_full full_like".split())


def is_total(tag: Any) -> bool:
    return type(tag) is Lost and tag.kind in TOTALS


def has_total(tr: Tracker, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor argument (or one in a list argument) is a total."""
    return any_tensor(args, kwargs, lambda t: is_total(tr.get(t)))


def total(tr: Tracker, kind: str, reason: str) -> Optional[Lost]:
    """A total of ``kind`` (None for a batch of at most one sample, which nothing can mix)."""
    if tr.n <= 1:
        return None
    tr.totals += 1
    return Lost(reason, kind)


def units_total(tr: Tracker, kind: str) -> Lost:
    """The tag of ``dptorch.packed_loss``'s result: a total of packed token units' own losses."""
    tr.totals += 1
    return Lost(f"the {kind} of packed examples' own losses (dptorch.packed_loss)", kind, units=True)


def batch_total(tr: Tracker, name: str, tag: int, averaged: Optional[int] = None) -> Optional[Lost]:
    """The tag of reduction ``name`` over the batch dim of a tensor batched as ``tag`` (``averaged``: the
    number of entries each result entry is made of, a mean's divisor)."""
    if name in TOTALS and not tag & WEAK:
        found = total(tr, name, f"the {name} over the batch dimension")
        if found is not None and name == "mean":
            found.count = averaged
        return found
    return tr.lost(f"{name} over the batch dimension", tag)


def loss_total(tr: Tracker, func, args: tuple, kwargs: dict, tag: Any) -> Optional[Lost]:
    """The tag of a torch loss reduced over the batch: a total where its divisor is a constant.

    The divisor of ``reduction="mean"`` must not be counted from the data: cross entropy and NLL
    divide by the summed class weights of the targets, and by the number of targets that are not
    ``ignore_index``; both are refused.
    """
    name = op_name(func)
    tags = [tr.get(t) for _, t in tensors_of(args, kwargs)]
    upstream = next((g for g in tags if type(g) is Lost), None)
    if upstream is not None:  # the input already mixed samples: say where
        return tr.lost_from(upstream.reason, tags)
    if type(tag) is not int or tag & WEAK or tag & ~WEAK & DIM:
        return tr.lost_from(f"{name} over a tensor that does not carry the batch along its first dim", tags)
    others = [tr.get(t) for where, t in tensors_of(args, kwargs) if where != ("a", 0) and where != ("k", "input")]
    if any(g is not None and g != tag and not (type(g) is int and g & ~WEAK == tag & ~WEAK) for g in others):
        return tr.lost_from(f"{name} of a target that does not carry the batch as its input does", others)
    bound = _bind(func, args, kwargs)
    reduction = bound.get("reduction", "mean")
    if reduction == "sum":
        return total(tr, "sum", f"{name}(reduction='sum') over the batch")
    if name in ("cross_entropy", "nll_loss"):
        target = bound.get("target")
        if bound.get("weight") is not None:
            return tr.lost(f"{name}(weight=..., reduction='mean'), which divides by the summed weights of the "
                           "batch's targets (a divisor counted from the data)", tag)
        ignore = bound.get("ignore_index", -100)
        if isinstance(target, Tensor) and not target.is_floating_point() and bool((target == ignore).any()):
            return tr.lost(f"{name}(reduction='mean') with targets equal to ignore_index={ignore}, which divides "
                           "by the number of targets not ignored (a divisor counted from the data)", tag)
    return total(tr, "mean", f"{name}(reduction={reduction!r}) over the batch")


def _bind(func, args: tuple, kwargs: dict) -> dict:
    try:
        return dict(inspect.signature(func).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)


def total_rule(tr: Tracker, func, args: tuple, kwargs: dict):
    """An operation with a total among its inputs: a total again only if it is linear in it."""
    name = op_name(func)
    if name in _BACKWARD:
        return backward_rule(tr, func, args, kwargs)
    tensors = list(tensors_of(args, kwargs)) + [(("l", i), b) for i, a in enumerate(args) if isinstance(a, (list, tuple))
                                                for b in a if isinstance(b, Tensor)]
    tagged = [(where, g) for where, g in ((where, tr.get(t)) for where, t in tensors) if g is not None]
    first = next(g for _, g in tagged if is_total(g))
    if name in _ESCAPES:
        tr.escaped = f"{name}() of {first.reason}"
        return tr.run(func, args, kwargs)
    same = all(is_total(g) and g.kind == first.kind and g.units == first.units for _, g in tagged)
    alone = len(tagged) == 1 and tagged[0][0] in (("a", 0), ("k", "input"), ("k", "self"))
    scaling = name in _SCALING or (name in _DIVIDING and alone)  # a total divided by a constant, not a constant by it
    kind = first.kind
    if name in _ADDITIVE or name in _JOINS:
        keep = same
    elif _undoes_mean(name, first, tagged, args, kwargs):  # mean * its own divisor: the sum, exactly
        keep, kind = True, "sum"
    elif scaling:
        keep = len(tagged) == 1 and (read_from_batch(tr) is None or not _has_number(args, kwargs))
    else:
        keep = name in _LINEAR and alone
    if name == "__get__":  # a property: .data, .T and .real read the total itself; others (.grad, .shape) no data
        keep = getattr(getattr(func, "__self__", None), "__name__", "") in _LINEAR_PROPERTIES
        if not keep:
            return tr.run(func, args, kwargs)
    if name == "__set__":  # t.data = total: t now holds the total's values; other attributes hold no data
        out = tr.run(func, args, kwargs)
        if getattr(getattr(func, "__self__", None), "__name__", "") == "data":
            tr.put(args[0], tr.get(args[1]))
        return out
    targets = written(func, args, kwargs)
    old = [tr.get(t) for t in targets]
    out = tr.run(func, args, kwargs)
    if keep:
        # inside the forward shapes are read all the time: a factor there may be the batch size (refused at backward)
        inside = any(g.scaled_inside for _, g in tagged if is_total(g)) or (scaling and not tr.forward_done)
        tag = Lost(first.reason, kind, units=first.units, scaled_inside=inside)
        counts = {g.count for _, g in tagged if is_total(g)}  # means of different divisors added: no one divisor
        tag.count = first.count if kind == "mean" and len(counts) == 1 else None
    else:
        tag = Lost(_mixing_reason(name, first, read_from_batch(tr) if scaling else None))
    for target, was in zip(targets, old):  # in place, or out=
        if is_total(was):  # a total changed in place (loss += other)
            tr.put(target, tag)
        else:  # a total written into other memory (a buffer, a view, x[:] = total): its aliases follow
            tr.wrote(target, was, tag)
    tr.put_all(out, tag)
    return out


def _undoes_mean(name: str, first: Lost, tagged: list, args: tuple, kwargs: dict) -> bool:
    """``mean * k`` where ``k`` is the number of entries the mean averaged: the sum of those entries (DPO's mean
    over the pairs of a micro-batch times their number), whatever read gave ``k``."""
    if name not in _SCALING or first.kind != "mean" or first.count is None or len(tagged) != 1:
        return False
    numbers = [a for a in (*args, *kwargs.values()) if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return len(numbers) == 1 and numbers[0] == first.count


#: Libraries whose own scaling of the loss is by a configured constant (gradient accumulation steps, a loss
#: scale), not a number of the batch: DeepSpeed's engine.backward, Accelerate's backward, the Trainer's step,
#: and TRL's DPO losses (beta, loss weights, label smoothing; the loss types that couple pairs are refused by
#: the DPO recipe, integrations/hf/loss_recipes.py). Only that module of TRL: its other trainers are not vetted.
_CONSTANT_SCALERS = ("deepspeed.", "accelerate.", "transformers.trainer", "trl.trainer.dpo_trainer")


def read_from_batch(tr: Tracker) -> Optional[str]:
    """What was read from the batch into Python since its draw, outside the forward (a value, or its size):
    a number scaling the loss after it may come from it, so the scaling is not known to be a constant
    (unless the scaling is done by one of ``_CONSTANT_SCALERS``)."""
    read = tr.escaped or tr.counted
    if read is None:
        return None
    scaler = caller()  # (this library's own arithmetic, the optimizer's divisor say, is not the loop's)
    return None if scaler.startswith(_CONSTANT_SCALERS) or is_library(scaler) else read


def _has_number(args: tuple, kwargs: dict) -> bool:
    """Whether an operation has a Python number among its arguments."""
    return any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in (*args, *kwargs.values()))


def scales_after_read(tr: Tracker, func, args: tuple, kwargs: dict) -> bool:
    """Whether, after a read from the batch into Python outside the forward, an operation scales or shifts a
    tensor by a Python number (``per_sample_loss / len(y)`` before its sum, ``out - out.mean().item()``) or
    makes a tensor of one (``torch.tensor(1 / len(y))``): the number may be the batch size, or a value of the
    batch."""
    if not tr.forward_done or (tr.escaped is None and tr.counted is None) or tr.n <= 1:
        return False
    name = op_name(func)
    if name in _SCALING or name in _DIVIDING or name in _ADDITIVE:  # (a shift by a read value: x - x.mean().item())
        scales = _has_number(args, kwargs) and any(isinstance(a, Tensor) and derived(tr.get(a))
                                                   for a in (*args, *kwargs.values()))
    else:
        scales = name in _FROM_NUMBER and _has_number(args, kwargs)
    return scales and read_from_batch(tr) is not None  # (not DeepSpeed's, Accelerate's or this library's own)


def read_scaling_rule(tr: Tracker, func, args: tuple, kwargs: dict):
    """A tensor scaled by, or made of, a number after a read from the batch: ``Lost`` (the number may be the
    batch size, so each sample's gradient would depend on how many others were drawn)."""
    out = tr.run(func, args, kwargs)
    lost = Lost(f"{op_name(func)} with a Python number that may come from {read_from_batch(tr)}, read from the "
                "batch into Python, which would make each sample's gradient depend on the others (read values and sizes "
                "after backward(), or make the number a constant of your code)")
    for target in written(func, args, kwargs):
        tr.wrote(target, tr.get(target), lost)
    tr.put_all(out, lost)
    return out


def _mixing_reason(name: str, tag: Lost, escaped: Optional[str]) -> str:
    reason = f"{name} of {tag.reason}, which couples every sample's gradient to the others'"
    if escaped:
        reason += f" (its factor may come from {escaped}: a number read from the batch)"
    return reason


def backward_rule(tr: Tracker, func, args: tuple, kwargs: dict):
    """``backward`` / ``torch.autograd.grad``: refuse a root that mixes samples (unless ``tr`` only tags: the draw's
    watch, for which a backward is another model's); then run it, the guard of unseen operations off meanwhile."""
    if func is Tensor.backward:
        roots, grads = [arg(args, kwargs, 0, "self")], _as_list(arg(args, kwargs, 1, "gradient"))
    elif op_name(func) == "grad":  # torch.autograd.grad(outputs, inputs, grad_outputs)
        roots, grads = _as_list(arg(args, kwargs, 0, "outputs")), _as_list(arg(args, kwargs, 2, "grad_outputs"))
    else:  # torch.autograd.backward(tensors, grad_tensors)
        roots, grads = _as_list(arg(args, kwargs, 0, "tensors")), _as_list(arg(args, kwargs, 1, "grad_tensors"))
    try:
        kind = tr.unit_kind()
        for i, root in enumerate(roots if tr.checks_backward else ()):
            grad = grads[i] if i < len(grads) else None
            problem = _root_problem(tr, root, grad) if kind != "tokens" else _token_root_problem(tr, root, grad)
            if problem is not None:
                raise PerSampleGradientError(problem)
    finally:
        tr.on_backward()
    unseen_off()  # backward is not the loop's code: no guard of unseen operations there (unseen.py)
    try:
        return func(*args, **kwargs)
    finally:
        follow_unseen()  # back in the loop (the draw's watch goes on after backward)


def _as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _root_problem(tr: Tracker, root: Any, grad: Any) -> Optional[str]:
    if not isinstance(root, Tensor):
        return None
    tag = tr.get(root)
    gtag = tr.get(grad) if isinstance(grad, Tensor) else None
    if tag is None and gtag is None:
        return None
    fix = ("Samples may meet only in the final reduction of per-sample loss terms: compute one loss per sample "
           "(reduction='none', or dptorch.DPLoss(criterion, hooks)) and sum them, or average them by the batch "
           "size with loss_reduction='mean'. Nothing was updated.")
    if is_total(tag) and gtag is None:
        reduction = tr.loss_reduction
        if reduction is not None and tag.kind != reduction:  # the controller undoes a reduction the loss did not make
            if tag.kind == "mean":
                effect, fix = "divided", "sum the per-sample losses (reduction='sum', loss.sum())"
            else:
                effect, fix = "multiplied", "average the per-sample losses (reduction='mean', loss.mean())"
            return (f"{_call(root)} is {tag.reason}, but loss_reduction={reduction!r}: each unit's gradient is "
                    f"{effect} by the drawn batch size before clipping, so its clipping depends on how many others "
                    f"were drawn. Pass loss_reduction={tag.kind!r} to make_private (or GradSampleHooks), or {fix}. "
                    "Nothing was updated.")
        return _scaled_inside(root, tag)
    if type(tag) is int and (gtag is None or (type(gtag) is int and gtag & ~WEAK == tag & ~WEAK)):
        return None
    what = gtag if tag is None or (type(tag) is int and gtag is not None) else tag
    reason = what.reason if type(what) is Lost else "a gradient that does not carry the batch as its tensor does"
    hint = ""
    if "ignore_index" in reason or "weight=" in reason:
        hint = (" A HuggingFace model's built-in loss (out.loss) does this: pass model_loss='mean' to make_private "
                "(out.loss becomes each sample's mean over its own tokens), compute the per-sample loss from out.logits "
                "(dptorch.grad_sample.units.per_sample_losses), or train with dptorch.integrations.hf.DPTrainer, which "
                "does it for you.")
    return f"{_call(root)} derives from {reason}. {fix}{hint}"


def _scaled_inside(root: Tensor, tag: Lost) -> Optional[str]:
    """A total scaled by a number inside the model's forward, where shapes are read all the time: the
    number may be the batch size (a loss divided by ``len(labels)`` in the forward)."""
    if not tag.scaled_inside:
        return None
    return (f"{_call(root)} is {tag.reason}, scaled inside the model's forward by a number the batch tracker "
            "cannot follow: it may be the batch size, which would make each sample's gradient depend on how many "
            "others were drawn. Return the per-sample losses (or their sum) from the forward and scale outside it, "
            "or pass loss_reduction='mean' for a mean. Nothing was updated.")


def _token_root_problem(tr: Tracker, root: Any, grad: Any) -> Optional[str]:
    """Packed token units: the root must be (a constant multiple of) ``dptorch.packed_loss``'s total."""
    if not isinstance(root, Tensor):
        return None
    tag = tr.get(root)
    if is_total(tag) and tag.units and grad is None:
        return _scaled_inside(root, tag)
    return (f"{_call(root)} is not dptorch.packed_loss(...) of a packed forward (or a constant multiple of it). With "
            "several examples packed in one row, only that loss is known to give every example its own loss (it never "
            "predicts one example's token from another's, nor divides by a count of the batch's tokens). Nothing was "
            "updated.")


def _call(root: Tensor) -> str:
    return "backward() is called on a tensor that" if root.ndim == 0 else f"backward() on a tensor of shape {tuple(root.shape)} that"


RULES = {"backward": backward_rule, "grad": backward_rule}

"""The tags of the batch tracker, and how a layer call's argument tags classify it.

Tags (kept in a side table keyed by tensor identity, holding weak references only):

- an ``int``: batched along that dim; ``+ WEAK`` when the evidence is only a root argument whose
  size matched the batch, and no DP loader's draw says whether it derives from the samples (a mask
  ``(T, T)`` with ``T == n``, or a copy of the input): it is taken as batched; where it meets a strong
  dim along another dim, or is mixed over its rows, the result is ``Lost``;
  ``+ k * INNER`` when the batch was merged with an inner dim of size ``k`` (BLOOM's ``(B * H, T, d)``,
  OPT's ``(B * T, d)``): the dim holds each sample's ``k`` rows one after the other; ``+ ROWS_TOKENS``
  (the token tracker only) when the packed batch's rows and tokens were flattened into that dim;
- a ``Lost``: derived from the batch, but the batch dim is gone (a mean over the batch, the batch
  interleaved with another dim, an operation the tracker does not follow). A layer fed such a
  tensor is refused: its per-sample gradients are not defined;
- a tuple of ``OriginCall`` (``origins.py``): derived only from the output of a captured layer
  call whose inputs carry no batch.

Untagged tensors (parameters, buffers, ``arange``, factories) are shared by all samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

from torch import Tensor

if TYPE_CHECKING:
    from dptorch.grad_sample.tracking.origins import OriginCall

WEAK = 64  # added to a dim when the batch was only inferred from a root argument's size
DIM = WEAK - 1
KEEP = ~DIM  # all but the dim: strength and the merged factor
INNER = 128  # the batch dim holds n groups of ``tag // INNER`` rows (the batch merged with a dim inside it)
# the token tracker's dim holds the packed batch's rows and tokens flattened together, row-major (an MoE
# block's ``(B * T, H)``); a flag of its own, never a group size (no rule's size check can match it)
ROWS_TOKENS = INNER << 40


class Lost:
    """A batch-derived tensor whose batch dimension is gone; ``reason`` says where.

    A total (kind "sum" or "mean", ``loss.py``) with ``units`` is the sum of packed token units'
    own losses. Three kinds are followed further: "packed" (a PackedSequence's data; ``order`` its
    ``sorted_indices`` or None), "permuted" (the batch along ``dim``, but row ``i`` is sample
    ``order[i]``; gathering the rows back into the batch's order makes them batched again) and "rows"
    (some of the batch's rows along ``dim``, row ``i`` being sample ``order[i]``: a micro-batch sliced
    from a draw, which a root forward may take as its batch). Met by other rows, the last two are
    plainly lost. Only a rule that says where their rows go keeps them so (it makes a new tag, on the tensor it
    is made for); one carried to another tensor as it is, by a rule that does not follow rows, is plainly lost. A
    ``weak`` one was derived from weak evidence only (it is refused all the same where it meets the batch).
    """

    __slots__ = ("reason", "kind", "dim", "order", "weak", "units", "scaled_inside", "holder", "count")

    def __init__(self, reason: str, kind: Optional[str] = None, dim: int = 0, order: Optional[Tensor] = None,
                 weak: bool = False, units: bool = False, scaled_inside: bool = False) -> None:
        self.reason = reason
        self.kind = kind
        self.dim = dim
        self.order = order
        self.weak = weak  # derived only from weak evidence
        self.units = units  # a total of packed token units' own losses (dptorch.packed_loss)
        self.scaled_inside = scaled_inside  # a total scaled by a number inside the forward (loss.py refuses it)
        self.holder: Optional[int] = None  # an ordered one's tensor (id): a rule that says where its rows go makes a new one
        self.count: Optional[int] = None  # a "mean" total's divisor: the number of entries it averaged

    def __repr__(self) -> str:
        return f"Lost({self.reason!r})"


ROWS_ORDERED = ("permuted", "rows")  # Losts whose ``order`` says which sample each row along ``dim`` is
# and "units" (grouped privacy units, ``set_privacy_units``): ``order`` says which unit each entry along ``dim``
# belongs to, each made of that unit's rows only (a DPO pair's chosen and rejected log-probabilities combined)
ORDERED = ROWS_ORDERED + ("units",)


def ordered_at(tag: Lost, dim: int) -> Lost:
    """The same rows (or units), in the same order, now along ``dim`` (a new tag: see ``BatchTracker.put``)."""
    return Lost(tag.reason, tag.kind, dim, tag.order, weak=tag.weak)


def unit_entries(order: Any, dim: int) -> Lost:
    """Entries along ``dim`` each made of one grouped privacy unit's rows only: unit ``order[i]``'s."""
    return Lost("entries made of several rows of one privacy unit each", "units", dim, order)

_PACKED_REASON = "the data of a PackedSequence (the rows of all samples interleaved by time step)"
PACKED = Lost(_PACKED_REASON, "packed")


def packed(order: Optional[Tensor]) -> Lost:
    """The tag of a PackedSequence's data whose sequences are in ``order`` (its sorted_indices)."""
    return PACKED if order is None else Lost(_PACKED_REASON, "packed", 0, order)


@dataclass
class CallBatch:
    """How one layer call carries the batch.

    ``kind``: "batched" (tensor argument ``i`` along ``input_dims[i]``, output ``j`` along
    ``output_dims[j]``; None: not batched), "origin" (no argument carries the batch; ``origins``,
    one per output, collect its per-sample output gradients) or "single" (a batch of at most one
    sample: the whole call is that sample's).
    """

    kind: str
    n: int
    input_dims: Tuple[Optional[int], ...] = ()
    output_dims: Tuple[Optional[int], ...] = ()
    origins: Tuple[OriginCall, ...] = ()


_UNKNOWN_ROWS = ("a root argument with as many rows as the batch, so it may hold the samples' data. If it is shared "
                 "by all samples, create it inside the forward, or hand the batch out with a DP data loader, which "
                 "tells the tensors derived from its draw from the others")
MISALIGNED = f"{_UNKNOWN_ROWS}, aligned with another dim of the batch"


def as_strong(lost: Lost) -> Lost:
    """A weak ``Lost`` meeting the batch: lost for certain (its rows may have been the samples')."""
    return Lost(f"{lost.reason}, in {_UNKNOWN_ROWS}") if lost.weak else lost


def classify(tags: Sequence[Any], n: int) -> Tuple[str, Tuple[Optional[int], ...], Any]:
    """``(kind, input dims, primary tag)`` of a layer call whose tensor arguments have ``tags``
    (a dim is ``d + k * INNER`` when the batch is merged with an inner dim of size ``k``).

    kind is "batched", "origin", "single" or "lost" (the primary tag is then the ``Lost``): a
    batch-derived argument without its batch dim, or mixed with batched ones, has no per-sample
    gradient. A weak dim is taken as batched: where it disagrees with a strong one, or where a weak
    ``Lost`` (its rows mixed) meets the batch, the call is lost, for the argument may hold the samples'
    data (a copy of the input passed a second time).
    """
    strong = [g for g in tags if type(g) is int and not g & WEAK]
    weak = [g for g in tags if type(g) is int and g & WEAK]
    losts = [g for g in tags if type(g) is Lost]
    lost = next((g for g in losts if not g.weak), losts[0] if losts else None)
    if strong or weak:
        primary = (strong or weak)[0]
        if lost is not None and n > 1:
            return "lost", (), as_strong(lost)
        if strong and n > 1 and any(g & ~WEAK != primary for g in weak):
            return "lost", (), Lost(MISALIGNED)
        return "batched", tuple(g & ~WEAK if type(g) is int else None for g in tags), primary
    if n <= 1:
        return "single", (None,) * len(tags), None
    if lost is not None:
        return "lost", (), lost
    return "origin", (None,) * len(tags), None


def fed_no_batch(output_tags: Sequence[Any], n: int) -> bool:
    """Whether a layer call whose arguments carry the batch is still a call fed no batch: none of its
    outputs (their ``output_tags``) derives from the batch, so its arguments gave it no more than
    their shapes (BART's learned positions of ``input_ids``). Its outputs are then shared by the
    samples, like those of a call on positions alone (an "origin" call)."""
    return n > 1 and bool(output_tags) and all(g is None or type(g) is tuple for g in output_tags)

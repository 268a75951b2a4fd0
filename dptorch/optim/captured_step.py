"""The captured private step: one batch shape's forward, backward and clipping traced once, then replayed.

``step = capture_step(optimizer, loss_fn)`` returns a callable; ``loss = step(*batch)`` does what a
forward, ``loss.backward()`` and the DP optimizer's clipping do in an eager step (the round's clipped
sums are held for ``optimizer.step()``, which adds the noise, accounts the step and updates, as
always). The first call for a batch shape traces that work with ``make_fx`` on fake tensors *while
the controller's batch tracker follows it*: every torch call of the trace meets the same rules as in
an eager step, so a step whose samples meet is refused before any graph exists. The graph (ATen
operations; the parameters read by reference) is compiled with ``torch.compile`` (``compile=True``, or a
dict of its keyword arguments such as ``{"backend": "inductor"}``) and replayed for every later batch of that
shape. CUDA graphs (``mode="reduce-overhead"``) are refused: a virtual step holds one replay's sums while the
next replay would overwrite the graph's static outputs.

What the trace proved holds for a replay only while the step runs what was traced. Each call
compares, before the replay, what the trace saw and could have depended on (the guards): the
batch's structure, shapes, dtypes and devices, the controller's and the optimizer's settings,
autocast, and the model's state (``step_guards.py``: every module's plain attributes such as
``training``, its hooks, parameters, buffers and children, its class's ``forward``). Anything
changed is a new trace, proven afresh. Checks that read values (an origin call's gradients against
their total: ``grad_sample/value_checks.py``) are outputs of the graph, read after every replay
before the round is kept.

The batch must be a DP loader's latest batch as handed out: its tensors, or tensors holding exactly
their values (copies moved to a device; the step moves the batch to the parameters' device itself).
Only then are its rows known to be the draw's, in order (a padded draw's mask), with nothing mixed
into them before the forward. Fixed-shape batches (``TruncatedPoissonDataLoader``, fixed-size
selection) trace once; Poisson batches trace once per size seen, with ``pad_to_multiple_of=m`` once per
multiple of ``m``, and with ``rows_per_replay=m`` once: the batch runs as replays of exactly ``m`` rows,
whose clipped sums add up to one round (every row clipped once, in one replay; a piece of a padded
draw's padding alone is not replayed, its outputs known). Either way the step appends copies of a
first row, which the graph masks as a padded loader's rows are (factor 0, rows zeroed: exactly 0 to
the clipped sum, not counted), and the plan is told the draw's real rows.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptorch.clipping.factors import automatic_factors, clip_factors, flat_norms, nonfinite_units
from dptorch.data import drawn
from dptorch.grad_sample import value_checks
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tracking import watch as draw_watch
from dptorch.optim.gradient_writer import WholeParameters
from dptorch.optim.optimizer import DPOptimizer
from dptorch.optim.step_guards import ModelGuard

CAPTURED_MODES = ("bk", "ghost", "hooks")
#: How a trace on fake tensors fails where Python reads a tensor's value.
_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
#: torch.compile modes that replay CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
#: Traced shapes beyond which the step warns (Poisson batch sizes: each one a trace and a compile).
MANY_SHAPES = 8


class CaptureRefused(PerSampleGradientError):
    """A step the captured route cannot run (it does not trace, compile or keep its state in a graph, or its settings
    are not reproduced): raised before the round is kept, so the eager step may still run it. A step whose samples
    meet raises the tracker's own error instead, as eagerly."""


def capture_step(optimizer: DPOptimizer, loss_fn: Callable[..., torch.Tensor], *,
                 compile: Union[bool, Dict[str, Any]] = True,
                 pad_to_multiple_of: Optional[int] = None,
                 rows_per_replay: Optional[int] = None) -> "CapturedStep":
    """A captured private step of ``loss_fn(*batch)`` for the DP ``optimizer`` (from ``make_private``): the loss
    of a batch by the controller's ``loss_reduction``, or one loss per row (the step reduces them, and returns the
    reduction over the real rows of a padded batch alone); see the module's docstring."""
    return CapturedStep(optimizer, loss_fn, compile=compile, pad_to_multiple_of=pad_to_multiple_of,
                        rows_per_replay=rows_per_replay)


class CapturedStep:
    """Forward, backward and clipping of a batch as one traced (and compiled) graph per batch shape."""

    def __init__(self, optimizer: DPOptimizer, loss_fn: Callable[..., torch.Tensor], *,
                 compile: Union[bool, Dict[str, Any]] = True,
                 pad_to_multiple_of: Optional[int] = None,
                 rows_per_replay: Optional[int] = None) -> None:
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"capture_step needs the DP optimizer make_private returned, got {type(optimizer).__name__}")
        check_row_options(pad_to_multiple_of, rows_per_replay)
        _check_supported(optimizer)
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        #: torch.compile's keyword arguments for each traced graph, or None: the graph replays uncompiled.
        self.compile_options = compile_options(compile)
        #: Poisson batches padded up to a multiple of this many rows (masked rows: exactly 0), fewer shapes to trace.
        self.pad_to_multiple_of = pad_to_multiple_of
        #: Every batch run as replays of exactly this many rows (the last padded with masked rows): one graph.
        self.rows_per_replay = rows_per_replay
        self._graphs: Dict[Any, Tuple[Callable, List[nn.Parameter], List[Callable[[], Exception]], ModelGuard]] = {}
        #: How many times a step was traced (each one a proof, and with ``compile`` a compilation).
        self.traces = 0
        #: How many times a traced graph was replayed (a batch in pieces: one per piece holding a real row).
        self.replays = 0

    def __call__(self, *batch: Any) -> torch.Tensor:
        with draw_watch.aside():  # the library's own work: the draw's watch, if one runs, leaves the mode stack
            return self._step(batch)

    def _step(self, batch: tuple) -> torch.Tensor:
        optimizer = self.optimizer
        hooks = optimizer.hooks
        _check_supported(optimizer)
        leaves, spec = tree_flatten(batch)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        rows = _check_batch(tensors, optimizer.plan.draws is not None)
        if not hooks.hooks_enabled or hooks.privacy_units_set or optimizer._phantom:
            raise CaptureRefused(
                "captured step: capture is paused (disable_hooks()), privacy units are set (set_privacy_units) or the "
                "optimizer is in phantom(); a captured step clips every row as its own unit with capture on: use the "
                "eager step for these"
            )
        padding = optimizer.plan.padding_mask(rows, False, True)  # the latest draw's, whole and in order (checked)
        if rows == 0:  # an empty Poisson draw: no forward; the step adds the noise alone
            optimizer.plan.on_backward(0)
            return torch.zeros(())
        device = optimizer.params[0].device
        tensors = [t.to(device, non_blocking=True) for t in tensors]
        bound = torch.tensor(float(optimizer.max_grad_norm) if optimizer.clipping != "automatic" else 0.0,
                             dtype=torch.float64, device=device)
        # padding rows are zeroed, as eagerly (so the sums are the eager ones, bit for bit); a step that pads its
        # batches takes the masked graph for every batch, one that needs no padding too: one graph per shape
        masked = padding is not None or bool(self.pad_to_multiple_of or self.rows_per_replay)
        round_, masks = None, []
        for piece, mask in self._pieces(tensors, padding, rows):
            masks.append(mask)
            if round_ is not None and bool(mask.all()):  # padding alone: nothing to add or count, its outputs known
                round_.add_padding(len(mask))
                continue
            real = int((~mask).sum())
            piece_round = self._replay(leaves, spec, piece, mask.to(device), bound, real, masked=masked)
            if piece_round.nonfinite and not masked:  # a non-finite unit's gradient: only the masked graph zeroes it
                piece_round = self._replay(leaves, spec, piece, mask.to(device), bound, real, masked=True)
            round_ = piece_round if round_ is None else round_.add(piece_round, hooks.loss_reduction)
        mask = torch.cat(masks)
        padding = mask.to(device) if bool(mask.any()) else None  # on the device of the norms the optimizer masks with
        optimizer.keep_captured_round(rows, round_.sums, round_.total,
                                      round_.within if optimizer.clipping != "automatic" else None, round_.dropped,
                                      padding, round_.nonfinite, round_.clipped)
        return round_.loss

    def _pieces(self, tensors: List[torch.Tensor], padding: Optional[torch.Tensor],
                rows: int) -> List[Tuple[List[torch.Tensor], torch.Tensor]]:
        """The replays a batch of ``rows`` rows runs as, each its tensors and its mask of padding rows (the draw's,
        and the copies of the piece's first row the step appends): the whole batch, padded up to a multiple of
        ``pad_to_multiple_of``; or pieces of ``rows_per_replay`` rows, the last one padded."""
        mask = padding if padding is not None else torch.zeros(rows, dtype=torch.bool)
        width = self.rows_per_replay or rows
        multiple = self.rows_per_replay or self.pad_to_multiple_of or 1
        pieces = []
        for start in range(0, rows, width):
            piece, piece_mask = [t[start:start + width] for t in tensors], mask[start:start + width]
            short = -(-len(piece_mask) // multiple) * multiple - len(piece_mask)
            if short:
                piece = [torch.cat([t, t[:1].expand(short, *t.shape[1:])]) for t in piece]
                piece_mask = torch.cat([piece_mask, piece_mask.new_ones(short)])
            pieces.append((piece, piece_mask))
        return pieces

    def _replay(self, leaves: list, spec: Any, tensors: List[torch.Tensor], mask: torch.Tensor, bound: torch.Tensor,
                real: int, masked: bool) -> "CapturedRound":
        key = (_settings(self.optimizer, leaves, spec, tensors), masked)
        entry = self._graphs.get(key)
        if entry is None or not entry[3].holds():  # a new shape or setting, or the model changed: proven afresh
            guard = ModelGuard(self.optimizer.hooks.module)
            entry = self._graphs[key] = (*self._trace(leaves, spec, tensors, mask, bound, masked), guard)
            if len(self._graphs) == MANY_SHAPES + 1:
                warnings.warn(f"the captured step traced {len(self._graphs)} batch shapes or settings, each a proof and a "
                              "compilation: give it fixed-shape batches (TruncatedPoissonDataLoader), or "
                              "rows_per_replay=m (one graph) or pad_to_multiple_of=m", stacklevel=3)
        graph, params, errors, _ = entry
        self.replays += 1
        with torch.no_grad():
            try:
                outputs = graph(*tensors, mask, bound)
            except BackendCompilerFailed as error:  # torch.compile compiles at the first replay
                del self._graphs[key]
                raise CaptureRefused(
                    f"captured step: torch.compile failed on the traced step ({str(error).strip().splitlines()[0]}); "
                    "pass compile=False to replay the traced graph uncompiled (the same operations), or choose "
                    "another backend (compile={'backend': ...})") from error
            return CapturedRound(outputs, params, errors, real)

    def _trace(self, leaves: list, spec: Any, tensors: List[torch.Tensor], mask: torch.Tensor, bound: torch.Tensor,
               masked: bool) -> Tuple[Callable, List[nn.Parameter], List[Callable[[], Exception]]]:
        optimizer, loss_fn = self.optimizer, self.loss_fn
        hooks = optimizer.hooks
        trainable = optimizer.params
        found: List[nn.Parameter] = []
        errors: List[Callable[[], Exception]] = []

        def step(*inputs: torch.Tensor) -> List[torch.Tensor]:
            *batch, padding, limit = inputs
            stand_ins = iter(batch)
            args = tree_unflatten([next(stand_ins) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
            with value_checks.deferred() as checks:
                with drawn.standing_in(batch):
                    loss, reported = _reduced(loss_fn(*args), padding, hooks.loss_reduction)
                    loss.backward()
                if hooks.uncaptured:
                    raise PerSampleGradientError(
                        f"captured step: the backward pass gave gradients to {', '.join(hooks.uncaptured)} but captured "
                        "no per-sample gradients: the model ran in eval mode (call model.train() before training) or "
                        "under a forward the hooks did not see")
                held = set(trainable)
                norms = {p: n for p, n in hooks.per_sample_norms().items() if p in held}
                total = torch.where(padding, 0.0, flat_norms(norms))
                nonfinite = nonfinite_units(total)
                dropped = nonfinite | padding
                if optimizer.clipping == "automatic":
                    factor = automatic_factors(total, optimizer.plan.gamma)
                else:
                    factor = clip_factors(total, limit)
                factor = torch.where(dropped, factor.new_zeros(()), factor)
                within = total <= limit
                sums = hooks.clipped_sums({p: factor for p in norms}, dropped if masked else None)
                hooks.clear()
            found.extend(norms)
            errors.extend(error for _, error in checks)
            counts = torch.stack([ok.double() for ok, _ in checks]
                                 + [nonfinite.sum().double(), ((factor < 1) & ~dropped).sum().double()])
            return [reported.detach(), total, within, dropped, counts] + [sums[p] for p in norms]

        saved = _model_state(hooks.module, trainable)
        self.traces += 1
        try:
            with hooks.listeners_aside():
                graph = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors, mask, bound)
        except Exception as error:
            hooks.clear()
            _restore(saved)
            raise _explained(error) from error
        finally:
            draw_watch.stop()  # it followed the stand-ins
        changed = _restore(saved)
        if changed:
            raise CaptureRefused(
                f"captured step: the traced step changed {', '.join(changed)} (put back): a graph replays a step's "
                "operations, not the Python that stores tensors on the model, so a forward that keeps state on its "
                "modules (a cache, a running statistic) cannot be captured; use the eager step")
        _drop_unused_comparisons(graph)
        options = self.compile_options
        return (graph if options is None else torch.compile(graph, **options)), found, errors


class CapturedRound:
    """One replay's outputs, of ``real`` real (not padding) rows, with its value checks read (one host read; a failed
    check raises here)."""

    def __init__(self, outputs: List[torch.Tensor], params: List[nn.Parameter],
                 errors: List[Callable[[], Exception]], real: int) -> None:
        self.loss, self.total, self.within, self.dropped, counts = outputs[:5]
        self.sums = dict(zip(params, outputs[5:]))
        read = counts.tolist()
        value_checks.raise_failed([bool(ok) for ok in read[:-2]], errors)
        #: Real units dropped for a non-finite gradient; real units clipped.
        self.nonfinite, self.clipped = int(read[-2]), int(read[-1])
        #: The real (not padding) rows behind the round's loss.
        self.real = real

    def add(self, piece: "CapturedRound", reduction: str) -> "CapturedRound":
        """This round with the next piece's of the same batch taken in: sums added in the pieces' order (as a virtual
        step adds its physical batches), each row's outputs joined, the loss reported over every real row by the
        controller's ``reduction``."""
        self.sums = {p: s + piece.sums[p] for p, s in self.sums.items()}
        self.total, self.within, self.dropped = (torch.cat(pair) for pair in (
            (self.total, piece.total), (self.within, piece.within), (self.dropped, piece.dropped)))
        self.nonfinite, self.clipped = self.nonfinite + piece.nonfinite, self.clipped + piece.clipped
        if reduction == "sum":
            self.loss = self.loss + piece.loss
        elif piece.real:  # a mean over the real rows: a piece of padding alone adds none (its own mean is 0 / 0)
            self.loss = piece.loss if not self.real else (
                (self.loss * self.real + piece.loss * piece.real) / (self.real + piece.real))
        self.real += piece.real
        return self

    def add_padding(self, rows: int) -> None:
        """Join ``rows`` padding rows without a replay: what the graph gives them (norm 0, within the bound, dropped)."""
        self.total = torch.cat([self.total, self.total.new_zeros(rows)])
        self.within = torch.cat([self.within, self.within.new_ones(rows)])
        self.dropped = torch.cat([self.dropped, self.dropped.new_ones(rows)])


def _reduced(loss: Any, padding: torch.Tensor, reduction: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The loss to differentiate and the loss to report: a scalar loss is both; one loss per row is reduced by the
    controller's ``reduction`` over all rows (padding rows too: their gradients are masked), and reported reduced over
    the real rows alone."""
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss, loss
    if not isinstance(loss, torch.Tensor) or loss.shape != padding.shape:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"capture_step: loss_fn(*batch) must return the batch's loss, a scalar tensor, or one loss per "
                        f"row, shape ({len(padding)},); got {shape}")
    real = torch.where(padding, loss.new_zeros(()), loss).sum()
    if reduction == "sum":
        return loss.sum(), real
    return loss.mean(), real / (~padding).sum()


def check_row_options(pad_to_multiple_of: Any, rows_per_replay: Any, prefix: str = "") -> None:
    """Refuse row options (named with ``prefix``, as the Trainer's arguments are) that are not positive whole numbers
    or None, or both given."""
    for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("rows_per_replay", rows_per_replay)):
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{prefix}{name} must be a positive whole number or None, got {value!r}")
    if pad_to_multiple_of is not None and rows_per_replay is not None:
        raise ValueError(f"give {prefix}rows_per_replay (one shape, the batch in replays of that many rows) or "
                         f"{prefix}pad_to_multiple_of (one shape per multiple), not both")


def compile_options(compile: Union[bool, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """``torch.compile``'s keyword arguments for ``compile`` (True: its defaults), None for no compilation; CUDA
    graphs refused (their outputs live in buffers the next replay overwrites, and a virtual step holds them)."""
    if isinstance(compile, bool):
        return {} if compile else None
    if not isinstance(compile, dict):
        raise TypeError(f"compile must be a bool or a dict of torch.compile's keyword arguments, got {compile!r}")
    options = compile.get("options") or {}
    if compile.get("mode") in CUDA_GRAPH_MODES or options.get("triton.cudagraphs"):
        raise ValueError(
            f"capture_step: torch.compile mode {compile.get('mode')!r} replays CUDA graphs, whose outputs the next "
            "replay overwrites while a virtual step still holds them; use mode None, 'default' or "
            "'max-autotune-no-cudagraphs'")
    return dict(compile)


def _check_supported(optimizer: DPOptimizer) -> None:
    """Refuse the settings a captured round does not reproduce exactly, naming them."""
    hooks = optimizer.hooks
    reasons = []
    if hooks.grad_sample_mode not in CAPTURED_MODES:
        reasons.append(f"grad_sample_mode={hooks.grad_sample_mode!r} (captured: {', '.join(CAPTURED_MODES)})")
    if not hooks.batch_first:
        reasons.append("batch_first=False")
    if optimizer.clipping == "per_layer":
        reasons.append("clipping='per_layer'")
    if optimizer._world_size > 1 or optimizer._tensor_parallel or not isinstance(optimizer.gradient_writer, WholeParameters):
        reasons.append("several processes or sharded parameters")
    if optimizer.loss_scaler is not None:
        reasons.append("fp16 loss scaling")
    if reasons:
        raise CaptureRefused(f"capture_step does not support {'; '.join(reasons)}: use the eager step")


def _check_batch(tensors: List[torch.Tensor], tracked: bool) -> int:
    """The batch's rows; refused unless every tensor has them along dim 0 and, where a DP loader hands out
    batches (or the plan tracks draws), is one of the latest batch's tensors as handed out."""
    if not tensors or any(t.dim() == 0 for t in tensors) or len({t.shape[0] for t in tensors}) > 1:
        raise PerSampleGradientError(
            f"captured step: the batch's tensors must have its rows along dim 0 (got shapes "
            f"{[tuple(t.shape) for t in tensors]})")
    latest = drawn.latest()
    if (latest or tracked) and not all(_is_drawn(t, latest) for t in tensors):
        raise PerSampleGradientError(
            "captured step: give it the DP data loader's latest batch as handed out (its tensors, or copies of them "
            "moved to a device): a tensor derived from the batch before the step (sliced, scaled, normalised over the "
            "batch) cannot be told apart from the batch by a graph, and a batch the loader did not hand out last is "
            "not the draw the accountant records")
    return int(tensors[0].shape[0])


def _is_drawn(tensor: torch.Tensor, latest: List[torch.Tensor]) -> bool:
    """Whether ``tensor`` is one of the ``latest`` batch's tensors, or holds exactly its values in its order (a copy
    moved to the device): then it is that data, however it was made."""
    if any(tensor is t for t in latest):
        return True
    return any(t.shape == tensor.shape and t.dtype == tensor.dtype and torch.equal(tensor.to(t.device), t) for t in latest)


def _settings(optimizer: DPOptimizer, leaves: list, spec: Any, tensors: List[torch.Tensor]) -> tuple:
    """What a trace depends on besides the model (``step_guards.ModelGuard``): the batch's structure, its
    non-tensor entries, its tensors' shapes, dtypes and devices; the controller's and optimizer's settings."""
    hooks = optimizer.hooks
    return (spec, tuple(leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)),
            tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors),
            hooks.grad_sample_mode, hooks.loss_reduction, optimizer.clipping, optimizer.plan.gamma,
            tuple(id(p) for p in optimizer.params), torch.is_autocast_enabled(), torch.get_default_dtype())


def _model_state(model: nn.Module, params: List[nn.Parameter]) -> List[Tuple[Any, str, Any]]:
    """Every tensor a trace could leave behind on the model: the modules' tensor attributes and buffers, the
    parameters' gradients."""
    state: List[Tuple[Any, str, Any]] = []
    for module in model.modules():
        state.extend((module, name, value) for name, value in module.__dict__.items() if isinstance(value, torch.Tensor))
        state.extend((module._buffers, name, value) for name, value in module._buffers.items())
    state.extend((p, "grad", p.grad) for p in params)
    return state


def _restore(state: List[Tuple[Any, str, Any]]) -> List[str]:
    """Put back what a trace changed; the names of what it had changed (a parameter's ``grad`` silently:
    the trace's own, a fake tensor)."""
    changed = []
    for owner, name, value in state:
        if isinstance(owner, dict):
            if owner.get(name) is not value:
                changed.append(f"buffer {name}")
                owner[name] = value
        elif name == "grad":
            owner.grad = value
        elif owner.__dict__.get(name) is not value:
            changed.append(f"{type(owner).__name__}.{name}")
            owner.__dict__[name] = value
    return changed


def _drop_unused_comparisons(graph: torch.fx.GraphModule) -> None:
    """Take out the trace's ``torch.equal`` calls whose answer only the tracker read (row orders it keeps, constants
    of the trace): a replay needs no answer from them, and Dynamo would break the graph at each."""
    unused = [node for node in graph.graph.nodes if node.target is torch.ops.aten.equal.default and not node.users]
    for node in unused:
        graph.graph.erase_node(node)
    if unused:
        graph.recompile()


def _explained(error: Exception) -> Exception:
    """A trace's failure, as the user's error: data-dependent Python named with where it happened; an operation
    that cannot run on fake tensors (torch's ``_grouped_mm`` on float32 CPU tensors, say) named too. The library's
    own refusals, and errors of the loss function's arguments, pass as they are."""
    if isinstance(error, (PerSampleGradientError, TypeError)):
        return error
    if isinstance(error, _DATA_DEPENDENT):
        where = re.search(r"Caused by: \(([^)]*)\)", str(error))
        return CaptureRefused(
            "captured step: the step reads a tensor's value into Python"
            + (f" ({where.group(1)})" if where else "")
            + ", which a graph traced on fake tensors cannot hold (its shape or branch would depend on the data); "
            "train this model with the eager step (forward, backward, optimizer.step())")
    return CaptureRefused(
        f"captured step: tracing the step on fake tensors failed ({type(error).__name__}: {error}); a captured step "
        "needs every operation of the step to trace. Train this model with the eager step (forward, backward, "
        "optimizer.step())")

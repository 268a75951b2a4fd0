"""The root forward's session: from the root call's pre-hook to its end it learns the batch size and
follows the batch (and, for token privacy units, the tokens) through the forward; then the tracker
follows the loss, from the bottom of torch's mode stack, until backward or the next root forward.
The tracker steps aside for the layer calls whose operations need no following, and for the
controller's own."""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptorch.data import drawn
from dptorch.distributed.tensor_parallel import check_same_batch, context_parallel_active, tensor_parallel_group
from dptorch.grad_sample.capture.attachment import HookTarget
from dptorch.grad_sample.capture.buffer_check import BufferGuard
from dptorch.grad_sample.capture.rounds import Rounds
from dptorch.grad_sample.capture.settings import Settings, Switches
from dptorch.grad_sample.capture.sharding import Sharding
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.modes import expanded_weights
from dptorch.grad_sample.tap import tap
from dptorch.grad_sample.tracking import WEAK, BatchTracker, Lost, packed
from dptorch.grad_sample.tracking import watch as draw_watch
from dptorch.grad_sample.tracking.compiled import COMPILED_CODE, under_torch_compile
from dptorch.grad_sample.tracking.stack import remove as remove_mode
from dptorch.grad_sample.tracking.stack import remove_finished as remove_finished_trackers
from dptorch.grad_sample.tracking.stack import sink as sink_mode
from dptorch.grad_sample.tracking.tags import ROWS_ORDERED
from dptorch.grad_sample.units.token_tracker import TOKEN_DIM, TokenTracker
from dptorch.grad_sample.units.token_units import TokenUnits

_BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "x", "input")
# HF keywords whose tensors have the batch first whenever they have n rows there
_PER_SAMPLE_KEYS = frozenset(_BATCH_KEYS + (
    "attention_mask", "token_type_ids", "position_ids", "labels", "decoder_input_ids", "decoder_attention_mask",
    "decoder_inputs_embeds", "pixel_mask", "bool_masked_pos", "encoder_hidden_states", "encoder_attention_mask",
))


class RootForward(HookTarget):
    """The tracking session of the current root forward of ``module``: its batch size, its trackers
    (batch, tokens, then loss), the token units set for the next forward and which outputs kept them apart."""

    def __init__(self, module: nn.Module, settings: Settings, switches: Switches, sharding: Sharding,
                 rounds: Rounds) -> None:
        self.module = module
        self._settings, self._switches, self._sharding, self._rounds = settings, switches, sharding, rounds
        self.depth = 0
        self._batch_size: Optional[int] = None
        self.last_batch_size: Optional[int] = None
        #: Whether every training root forward since the last backward ran on the whole latest draw of a DP loader,
        #: its rows in the order handed out (what a padded draw's mask relies on: data/truncated_poisson.py).
        self.whole_draw = False
        self.tracker: Optional[BatchTracker] = None  # follows the batch through the current root forward
        self.loss_tracker: Optional[BatchTracker] = None  # then through the loss, until backward (tracking/loss.py)
        self.token_units: Optional[TokenUnits] = None  # for the next root forward (set_privacy_units of (B, T) ids)
        self.token_tracker: Optional[TokenTracker] = None  # follows the tokens through the current root forward
        self._packed_forward: Optional[TokenUnits] = None  # the token units of the last root forward, if packed
        self._separable: Dict[int, Any] = {}  # id -> weakref: root outputs whose tokens kept their units apart
        self.tracking_off: Any = False  # "popped"/"paused": the tracker stepped aside for a layer call
        self._buffer_guard = BufferGuard(module)  # buffers a training forward fills from the batch (buffer_check.py)
        self.expanded: Optional[Any] = None  # grad_sample_mode "ew": torch's expanded weights for this forward
        self._nested: Optional[BatchTracker] = None  # the loss tracker a non-training forward runs under

    @property
    def unit_kind(self) -> str:
        """What a privacy unit is in the current forward: "rows", "grouped" rows or "tokens"."""
        if self.token_tracker is not None or self._packed_forward is not None:
            return "tokens"
        return "rows" if self._rounds.unit_ids is None else "grouped"

    def on_root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module is self.module and not self._switches.replaying:
            if module.training and torch.is_grad_enabled() and under_torch_compile():
                raise PerSampleGradientError(COMPILED_CODE)
            self.depth += 1
            if self.depth > 1:  # the root calling itself: the outer call's batch and tracking stand
                return
            self.drop_loss_tracker(finished_only=True)
            watched = draw_watch.pause()  # first: the controller's own reads below are not the loop's
            if module.training and torch.is_grad_enabled():
                self._rounds.free_kept_grad_samples()
            if torch._C._current_graph_task_id() == -1:  # outside backward, where the stack is the caller's
                remove_finished_trackers()  # other controllers' too: they only pass calls through
            bags = bag_offsets(module, args, kwargs)
            self._batch_size = infer_batch_size(args, kwargs, self._settings.batch_dim) if bags is None else bags.shape[0]
            self.last_batch_size = self._batch_size
            units, self.token_units = self.token_units, None  # token units hold for one forward
            self._packed_forward = None
            if module.training and torch.is_grad_enabled() and context_parallel_active():
                raise PerSampleGradientError(
                    "context parallelism (torch.distributed.tensor.experimental.context_parallel) is on: it splits "
                    "every sample's tokens over the ranks, so no rank holds a sample's whole gradient and attention "
                    "meets the other ranks' tokens through collectives the batch tracker does not follow. Private "
                    "training refuses it; give each rank whole sequences (DDP, FSDP2, or tensor parallelism)"
                )
            tensor_parallel = self._sharding.tensor_parallel
            if module.training and torch.is_grad_enabled() and tensor_parallel:  # one batch on every rank
                check_same_batch(_tensor_leaves((args, kwargs)), tensor_parallel_group(tensor_parallel))
            if module.training and torch.is_grad_enabled() and self._batch_size is not None and not self._switches.paused:
                self._buffer_guard.start()
                self.tracker = self._start_tracking(args, kwargs, self._batch_size, *watched)
                if units is not None:
                    self.token_tracker = self._start_token_tracking(units, args, kwargs)
            else:  # not a training forward: the loop's own (its outputs derive from the batch)
                draw_watch.rest()
                draw_watch.resume()
                if self.loss_tracker is not None:  # followed in the loss phase as a model's forward (its own
                    self.loss_tracker.nested_forwards += 1  # scalings are its constants, like the training forward's)
                    self._nested = self.loss_tracker
            if (self._settings.grad_sample_mode == "ew" and module.training and torch.is_grad_enabled() and self._batch_size
                    and not self._switches.paused):
                self.expanded = expanded_weights.expanded(module, self._batch_size, self._settings.loss_reduction)
                self.expanded.__enter__()

    def _start_tracking(self, args: tuple, kwargs: dict, n: int, watched: Optional[BatchTracker] = None,
                        whole: bool = False) -> BatchTracker:
        """Tag the root call's batched inputs and follow the batch through the forward.

        The primary input (what the batch size came from), HF's per-sample keywords and what the
        draw's watch (``watched``) saw derived from a DP loader's batch carry the batch for certain.
        Any other argument with ``n`` rows along ``batch_dim`` is shared when the watch saw the
        whole way from the draw, and otherwise weakly batched: taken as batched, and refused where
        it is mixed or meets the batch along another dim (``tracking/tags.py``).
        """
        owner = weakref.ref(self)  # the mode stack must not keep a dropped controller (and its model) alive
        tracker = BatchTracker(n, skip=lambda: owner()._switches.suspended,
                               quiet=lambda: owner()._switches.capture_suspended())
        tracker.loss_reduction = self._settings.loss_reduction
        tracker.owner = owner
        tracker.on_backward = lambda: getattr(owner(), "loss_phase_over", lambda t: None)(tracker)
        tracker.unit_kind = lambda: getattr(owner(), "unit_kind", "rows")  # grouped rows: docs/privacy.md
        tracker.unit_ids = lambda: getattr(getattr(owner(), "_rounds", None), "unit_ids", None)
        previous, self.loss_tracker = self.loss_tracker, None
        if previous is not None:  # a second forward before backward: the loss may combine both
            remove_mode(previous)
            if not previous.done:
                tracker.adopt(previous)
            previous.close()
        dim = self._settings.batch_dim
        if watched is not None:  # what the loop derived from the DP loader's draw before this forward
            tracker.adopt(watched)
        if dim == 0:  # the DP loader's latest batch, collated along dim 0: labels the loss may use
            for t in drawn.latest():
                if t.dim() and t.shape[0] == n and tracker.get(t) is None:
                    tracker.put(t, 0)
        # With the draw watched (and no value of it read into Python), a root argument not derived from it is
        # shared by the samples; otherwise one with n rows may hold their data (weak: taken as batched)
        known = watched is not None and whole and watched.escaped is None
        primary = bag_offsets(self.module, args, kwargs)
        primary = _primary_input(args, kwargs, dim) if primary is None else primary
        named = [(None, a) for a in args] + list(kwargs.items())
        leaves = []
        for name, value in named:
            strong = value is primary or (dim == 0 and name in _PER_SAMPLE_KEYS)
            for leaf in tree_flatten(value)[0] if not isinstance(value, PackedSequence) else [value]:
                if isinstance(leaf, PackedSequence):
                    tracker.put(leaf.data, packed(leaf.sorted_indices))
                elif isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == n:
                    leaves.append((leaf, strong or leaf is primary))
        drawn_rows, rows = _drawn_rows([tracker.get(leaf) for leaf, _ in leaves], dim, n)
        primary_tag = tracker.get(primary) if isinstance(primary, torch.Tensor) else None
        on_draw = watched is not None and drawn_rows and rows is None and type(primary_tag) is int and primary_tag == dim
        self.whole_draw = on_draw and (previous is None or self.whole_draw)
        if rows is not None:  # a micro-batch cut from the draw: its rows (the labels' too) are this forward's batch
            tracker.take_rows(rows, watched.n)
        for leaf, strong in leaves:
            seen = tracker.get(leaf)
            if seen is not None and not (type(seen) is int and seen & ~WEAK == dim) and not (
                    drawn_rows and type(seen) is Lost and seen.kind in ROWS_ORDERED):
                continue  # the watch saw it derived otherwise (mixed, rows of other samples, another dim)
            if strong or seen is not None or not known:
                tracker.tag_root(leaf, dim, strong or seen is not None)
        tracker.__enter__()
        return tracker

    def _start_token_tracking(self, units: TokenUnits, args: tuple, kwargs: dict) -> TokenTracker:
        """Tag the root call's ``(B, T)`` inputs along their tokens, and follow them (above the batch tracker)."""
        primary = _primary_input(args, kwargs, 0)
        rows_tokens = tuple(primary.shape[:2]) if isinstance(primary, torch.Tensor) else ()
        if tuple(units.shape) != rows_tokens or units.shape[1] < 2:
            raise PerSampleGradientError(
                f"token privacy units of shape {tuple(units.shape)} do not fit this batch of (rows, tokens) {rows_tokens} "
                "(rows of at least 2 tokens): call set_privacy_units with the (batch, tokens) ids of each packed batch"
            )
        tracker = TokenTracker(units, self.tracker)
        named = [(None, a) for a in args] + list(kwargs.items())
        for name, value in named:
            for leaf in tree_flatten(value)[0]:
                if not isinstance(leaf, torch.Tensor) or self.tracker.get(leaf) is None:
                    continue
                if (leaf is primary or name in _PER_SAMPLE_KEYS) and tuple(leaf.shape[:2]) == tuple(units.shape):
                    tracker.put(leaf, TOKEN_DIM)
                else:  # the row's data (or not known to be per token): its examples would share it
                    tracker.put(leaf, Lost(f"a root argument of shape {tuple(leaf.shape)} that carries the batch but is "
                                           "not known to hold one entry per token (the model's input, or a keyword "
                                           "such as attention_mask, position_ids, labels)"))
        tracker.__enter__()
        return tracker

    def _end_token_tracking(self, output: Any) -> None:
        """The root forward ended: remember which outputs kept every token's unit apart (``packed_loss`` reads them)."""
        tracker, self.token_tracker = self.token_tracker, None
        if tracker is None:
            return
        remove_mode(tracker)
        self._separable = {}
        self._packed_forward = tracker.units
        if sys.exc_info()[1] is None:
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and tracker.keeps_tokens(t):
                    self._separable[id(t)] = (weakref.ref(t), tracker.units)
        tracker.close()

    def separable_units(self, t: torch.Tensor) -> Optional[TokenUnits]:
        """The token units of the last packed forward if ``t`` is one of its outputs that kept them apart."""
        held = self._separable.get(id(t))
        return held[1] if held is not None and held[0]() is t else None

    def _enter_loss_phase(self) -> None:
        """End of the root forward: the tracker goes on following the loss, from the bottom of
        torch's mode stack, until backward (where the loss is checked) or the next root forward."""
        draw_watch.rest()
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return
        self.tracking_off = False
        tracker.paused = False
        if sys.exc_info()[1] is not None:  # the forward raised (a refusal, say): no loss will follow it
            remove_mode(tracker)
            tracker.close()
            draw_watch.resume()
            return
        tracker.end_forward()
        sink_mode(tracker)
        self.loss_tracker = tracker

    def loss_phase_over(self, tracker: BatchTracker) -> None:
        """backward() was called (and checked): a tracker in its loss phase ignores everything from
        now on; it leaves the mode stack at the next chance outside torch's dispatch."""
        if tracker is self.loss_tracker:
            tracker.done = True

    def drop_loss_tracker(self, finished_only: bool = False) -> None:
        tracker = self.loss_tracker
        if tracker is None or (finished_only and not tracker.done):
            return
        if torch._C._current_graph_task_id() != -1:  # in backward's callbacks torch's mode stack is not the
            return  # caller's: the tracker would stay on it for good; it leaves at the next chance instead
        self.loss_tracker = None
        remove_mode(tracker)
        tracker.close()

    def suspend_tracking(self) -> None:
        """Take the tracker (and the token tracker above it) off torch's mode stack, if they are on top,
        until ``resume_tracking``."""
        tracker = self.tracker
        if tracker is None or self.tracking_off:
            return
        ours = [tracker] if self.token_tracker is None else [tracker, self.token_tracker]
        depth = torch._C._len_torch_function_stack()
        if depth >= len(ours) and all(torch._C._get_function_stack_at(depth - len(ours) + k) is mode
                                      for k, mode in enumerate(ours)):
            for _ in ours:
                torch._C._pop_torch_function_stack()
            self.tracking_off = "popped"
        else:  # another mode above them: they stay, ignoring what they see
            for mode in ours:
                mode.paused = True
            self.tracking_off = "paused"

    def resume_tracking(self) -> None:
        if self.tracker is not None:
            ours = [self.tracker] if self.token_tracker is None else [self.tracker, self.token_tracker]
            for mode in ours:
                if self.tracking_off == "popped":
                    torch._C._push_on_torch_function_stack(mode)
                mode.paused = False
        self.tracking_off = False

    def on_root_forward_end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if module is not self.module or self._switches.replaying:
            return None
        self.depth = max(self.depth - 1, 0)
        if self.depth:
            return None
        nested, self._nested = self._nested, None
        if nested is not None:
            nested.nested_forwards -= 1
        self._end_token_tracking(output)
        leak = self._buffer_guard.finish(self.tracker)  # a buffer filled from the batch: put back, refused
        self._enter_loss_phase()
        self._batch_size = None
        if self.expanded is not None:
            self.expanded.__exit__(None, None, None)
            self.expanded = None
        if leak is not None and sys.exc_info()[1] is None:
            self.drop_loss_tracker()
            raise PerSampleGradientError(leak)
        return None

    def tap_root_outputs(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Tap the model's outputs, so that a second backward through this forward is refused
        even where it reaches no hooked layer twice (two heads on a frozen trunk). Under expanded
        weights, where torch writes p.grad_sample itself, the tap also tells us when backward starts."""
        if (module is not self.module or self._switches.replaying or self._switches.paused
                or not (torch.is_grad_enabled() and module.training)):
            return None
        leaves, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None
        ew = self._settings.grad_sample_mode == "ew"
        rounds = self._rounds
        def on_backward(saved: Any, grads: Any) -> None:
            rounds.on_outputs_backward()  # the outer backward pass (reentrant checkpointing nests others in it)
            if ew:
                rounds.begin_round()

        tracker = self.loss_tracker
        for i, t in zip(positions, tap([leaves[i] for i in positions], [], on_backward)):
            if tracker is not None:
                tracker.put(t, tracker.get(leaves[i]))  # the loss is followed from the tapped outputs
            units = self.separable_units(leaves[i])
            if units is not None:
                self._separable[id(t)] = (weakref.ref(t), units)
            leaves[i] = t
        return tree_unflatten(leaves, spec)


def _drawn_rows(tags: List[Any], dim: int, n: int) -> Tuple[bool, Optional[torch.Tensor]]:
    """Whether the root arguments the draw's watch saw derived from the batch are each ``n`` of its rows
    along ``dim`` (the whole draw, or a micro-batch cut from it), the same rows in the same order: then
    they form this forward's batch; and those rows of the draw (None: the whole draw, in its order)."""
    orders = []
    for tag in tags:
        if type(tag) is int and tag & ~WEAK == dim:
            orders.append(None)
        elif type(tag) is Lost and tag.kind in ROWS_ORDERED and tag.dim == dim and tag.order is not None:
            orders.append(tag.order)
        elif tag is not None:
            return False, None
    picked = [o for o in orders if o is not None]
    if not picked:
        return True, None
    same = all(o.shape == picked[0].shape and torch.equal(o, picked[0]) for o in picked)
    whole = torch.equal(picked[0], torch.arange(n))
    if same and picked[0].numel() == n and (len(picked) == len(orders) or whole):
        return True, picked[0]
    return False, None


def _primary_input(args: tuple, kwargs: dict, batch_dim: int) -> Any:
    """The input a root call's batch size comes from: its first positional tensor, else a well-known keyword."""
    candidates = list(args) + [kwargs[k] for k in _BATCH_KEYS if k in kwargs] + list(kwargs.values())
    for value in candidates:
        if isinstance(value, PackedSequence) or (isinstance(value, torch.Tensor) and value.dim() > batch_dim):
            return value
    return None


def bag_offsets(module: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The offsets of an ``nn.EmbeddingBag`` called as the root with 1-D input and offsets: its batch, one bag per
    sample; None for any other call (``include_last_offset`` too: its batch is then not told here)."""
    if not isinstance(module, nn.EmbeddingBag) or module.include_last_offset:
        return None
    given = args[0] if args else kwargs.get("input")
    offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    if not (isinstance(given, torch.Tensor) and given.dim() == 1 and isinstance(offsets, torch.Tensor) and offsets.dim() == 1):
        return None
    return offsets


def infer_batch_size(args: tuple, kwargs: dict, batch_dim: int) -> Optional[int]:
    """The batch size of a root call (see ``_primary_input``)."""
    value = _primary_input(args, kwargs, batch_dim)
    if isinstance(value, PackedSequence):
        return int(value.batch_sizes[0]) if len(value.batch_sizes) else 0
    return None if value is None else value.shape[batch_dim]


def _tensor_leaves(tree: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]

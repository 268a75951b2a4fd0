"""The capture of each layer call in the forward: the layer's parameters kept out of autograd for the
call, how the call carries the batch (from what its inputs derive from, or the decision remembered
for the same call in the forward), and its outputs tapped, their backward handed to the sampler's
path (``backward.py``) or a replay (``replays.py``)."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptorch.grad_sample.capture.attachment import Attachment, HookedLayer, HookTarget
from dptorch.grad_sample.capture.backward import CallBackward, not_per_sample
from dptorch.grad_sample.capture.replays import Replays
from dptorch.grad_sample.capture.session import RootForward, bag_offsets, infer_batch_size
from dptorch.grad_sample.capture.settings import Settings, Switches
from dptorch.grad_sample.capture.sharding import Sharding
from dptorch.grad_sample.capture.wrapper_tags import WrapperTags
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tap import tap
from dptorch.grad_sample.tracking import INNER, WEAK, CallBatch, Lost, OriginCall, classify, fed_no_batch
from dptorch.grad_sample.tracking.reads import ParameterReads
from dptorch.grad_sample.units.token_tracker import token_call

_AMBIGUOUS: Any = object()  # a layer call signature seen with different decisions


class LayerCalls(HookTarget):
    """The hooks on every hooked layer: the layers whose parameters a call holds out of autograd, and the
    decisions made for each layer call signature in the forward (for recomputation)."""

    def __init__(self, settings: Settings, switches: Switches, attachment: Attachment, sharding: Sharding,
                 session: RootForward, backward: CallBackward, replays: Replays, tags: WrapperTags,
                 reads: ParameterReads) -> None:
        self._settings, self._switches, self._session = settings, switches, session
        self._attachment, self._layers, self._sharding = attachment, attachment.layers, sharding
        self._backward, self._replays, self._tags, self._reads = backward, replays, tags, reads  # where a call goes
        self._suppressed: Dict[nn.Module, Dict[str, nn.Parameter]] = {}
        self._decisions: Dict[nn.Module, Dict[tuple, Any]] = {}  # per layer call signature, for recomputation

    def capturing(self, module: nn.Module) -> bool:
        return (not (self._switches.replaying or self._switches.paused) and torch.is_grad_enabled() and module.training
                and module in self._layers)

    def enter_leaf_layer(self, module: nn.Module, args: tuple) -> None:
        session = self._session
        if session.tracker is None or session.tracking_off or not self.capturing(module):
            return
        # Off first: with the tracker on torch's mode stack, reading p.requires_grad goes through it.
        session.suspend_tracking()
        if not any(p.requires_grad for p in self._layers[module].params.values()):
            session.resume_tracking()

    def check_expanded_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        session = self._session
        if session.expanded is None or not any(p.requires_grad for p in self._layers[module].params.values()):
            return
        rows = infer_batch_size(args, kwargs, self._settings.batch_dim)
        tensors = _tensor_arguments(module, args, kwargs)
        if session.tracker is not None and tensors:  # the batch must derive from the root's, along dim 0
            kind, dims, _ = classify([session.tracker.get(t) for t in tensors], session.tracker.n)
            rows = tensors[0].shape[0] if tensors[0].dim() else 1
            if kind == "batched" and dims[0] == 0:
                rows = session.last_batch_size
            elif kind != "single" and rows == session.last_batch_size:
                rows = (f"inputs of shape {tuple(tensors[0].shape)} whose {rows} rows are not the batch's (they do not "
                        "derive from it along dim 0), so it is called with no")
        if rows is not None and rows != session.last_batch_size:
            layer = self._layers[module]
            raise PerSampleGradientError(
                f"{layer.name} ({type(module).__name__}) is called with {rows} rows but the batch has "
                f"{session.last_batch_size}: expanded weights need one row per sample in every call (a broadcast "
                "input such as GPT-2's default position_ids of shape (1, T), or T5's relative position buckets of "
                "shape (T, T), is not). Pass per-row inputs, or use grad_sample_mode='hooks', which handles "
                "broadcast inputs."
            )

    def before_layer_forward(self, module: nn.Module, args: tuple) -> None:
        """Watch parameters unfrozen since attach; keep this layer's parameters out of autograd.

        Autograd need not compute this layer's parameter gradients, which the clipped sum
        replaces; its parameters stop requiring grad for the duration of the call.
        """
        layer = self._layers.get(module)
        if layer is None:  # a deep copy of the model carries our hooks; it is not ours
            return
        live = self._sharding.live_params(module, layer)
        for p in live.values():
            self._attachment.watch(p)
        if not self._settings.suppressing or not self.capturing(module):
            return
        params = {name: p for name, p in live.items() if p.requires_grad or self._suppressed_around(p)}
        for p in params.values():
            p.requires_grad_(False)
        self._suppressed[module] = params

    def _suppressed_around(self, param: nn.Parameter) -> bool:
        """Whether an enclosing call holds ``param`` out of autograd (a parameter shared by a module and
        its child, as BERT's MLM bias and its decoder's): the inner call still captures it."""
        return bool(self._suppressed) and any(p is param for held in self._suppressed.values() for p in held.values())

    def on_tensor_parallel_layer_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """A tensor-parallel layer's capture, before torch's output hook redistributes its output (a row-wise
        layer's sums scattered over the tokens): the output gradient there is every token's."""
        tapped = self.on_layer_forward(module, args, kwargs, output)
        self._tags.note_output(module, args, output if tapped is None else tapped)
        return tapped

    def on_layer_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self._session.suspend_tracking()  # our own operations are not the model's
        try:
            return self._layer_forward(module, args, kwargs, output)
        finally:
            self._session.resume_tracking()

    def _layer_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        suppressed = self._suppressed.pop(module, None)
        if suppressed:
            for p in suppressed.values():
                if not self._suppressed_around(p):
                    p.requires_grad_(True)
            outputs = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            leaves = [t for t in outputs if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad]
            if leaves:  # no input needed grad: the output becomes the graph's leaf (an input passed through stays)
                inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
                for t in leaves:
                    if id(t) not in inputs:
                        t.requires_grad_()
        if not self.capturing(module):
            self._note_uncaptured_call(module, args, kwargs, output)
            return None
        layer = self._layers[module]
        if suppressed:
            params = {name: layer.params[name] for name in suppressed}
        else:
            params = {name: p for name, p in layer.params.items() if p.requires_grad}
        if not params:
            return None
        if layer.sampler is not None:
            return self._capture_for_sampler(layer, params, args, kwargs, output)
        if any(module._parameters.get(name) is not p for name, p in params.items()):
            raise PerSampleGradientError(
                f"{layer.name} ({type(module).__name__}) has no grad sampler, and its parameters are swapped for "
                "others during the call (sharded by FSDP2's fully_shard): the torch.func fallback would replay the "
                "call in backward, when the gathered parameters may be freed. Register a grad sampler for "
                f"{type(module).__name__} (dptorch.grad_sample.register_grad_sampler), or freeze its parameters"
            )
        return self._capture_for_replay(layer, params, args, kwargs, output)

    def _capture_for_sampler(self, layer: HookedLayer, params, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}) returned {type(output).__name__}, but its registered "
                "grad sampler needs a single tensor output; register a sampler for the layer that returns it"
            )
        if not output.requires_grad:
            return None
        activations = _tensor_arguments(layer.module, args, kwargs)
        call, tag, chained = self._classify_call(layer, activations, (output,))
        tokens = self._session.token_tracker
        token_tag, flat = (None, False) if tokens is None else token_call(tokens, layer.name, layer.module, layer.token_wise, activations)
        if call.kind == "batched":
            dim = call.output_dims[0]
            rows = None if dim is None else call.n * max(dim // INNER, 1)  # the batch merged with an inner dim
            if dim is None or output.dim() <= dim % INNER or output.shape[dim % INNER] != rows:
                raise not_per_sample(layer, output, call.n, None if dim is None else dim % INNER)
        on_backward = partial(self._backward.layer_backward, layer, params, call, None if tokens is None else tokens.units, flat)
        tapped = tap((output,), activations, on_backward)
        self._tag_outputs(call, tapped, [tag], chained)
        if tokens is not None:
            tokens.put(tapped[0], token_tag)
        return tapped[0]

    def _capture_for_replay(self, layer: HookedLayer, params, args, kwargs, output):
        out_leaves, out_spec = tree_flatten(output)
        positions = [i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None
        call_leaves, call_spec = tree_flatten((args, kwargs))
        tensor_positions = [i for i, t in enumerate(call_leaves) if isinstance(t, torch.Tensor)]
        outputs = [out_leaves[i] for i in positions]
        call, _, chained = self._classify_call(layer, [call_leaves[i] for i in tensor_positions], outputs)
        session = self._session
        tags = [session.tracker.get(t) for t in outputs] if session.tracker is not None else [None] * len(outputs)
        if session.token_tracker is not None:
            replay = self._replays.token_replay(session.token_tracker, layer, [call_leaves[i] for i in tensor_positions],
                                                outputs)
            on_backward = partial(replay, params, call, call_leaves, call_spec, tensor_positions, positions)
        else:
            on_backward = partial(self._replays.replay_backward, layer, params, call, call_leaves, call_spec,
                                  tensor_positions, positions)
        tapped = tap(outputs, [call_leaves[i] for i in tensor_positions], on_backward)
        self._tag_outputs(call, tapped, tags, chained)
        for i, t in zip(positions, tapped):
            if session.token_tracker is not None:
                session.token_tracker.put(t, session.token_tracker.get(out_leaves[i]))
            out_leaves[i] = t
        return tree_unflatten(out_leaves, out_spec)

    def _classify_call(self, layer: HookedLayer, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]):
        """How this call carries the batch (a ``CallBatch``), from what its inputs derive from.

        Also returns the tag of its primary batched input and the origins (layer calls without a
        batched input) its inputs derive from. Outside a tracked forward (recomputation under
        activation checkpointing, a layer called directly) the decision made for the same layer
        and input shapes in the forward is reused.
        """
        tracker = self._session.tracker
        if tracker is None:
            return self._recall_call(layer, tensors, outputs), None, ()
        n = tracker.n
        tags = [tracker.get(t) for t in tensors]
        if n <= 1:  # one sample cannot be mixed with others; only a dim of one row can be its batch dim
            tags = [g if type(g) is not int or _has_rows(t, g & ~WEAK, n) else None for t, g in zip(tensors, tags)]
        kind, dims, primary = classify(tags, n)
        if kind == "lost":
            culprit = (t for t, g in zip(tensors, tags) if g is primary or type(g) is Lost or (type(g) is int and g & WEAK))
            raise _lost_batch(layer, next(culprit, tensors[0]), primary)
        if kind == "batched" and layer.sampler is None and fed_no_batch([tracker.get(t) for t in outputs], n):
            kind, dims = "origin", (None,) * len(tensors)  # its batched inputs gave it only their shapes
        if kind == "batched":
            for t, d in zip(tensors, dims):
                if d is None:
                    continue
                if not _has_rows(t, d, n):
                    raise not_per_sample(layer, t, n, d % INNER)
            if layer.sampler is not None:
                out_dims: Tuple[Optional[int], ...] = (primary & ~WEAK,)
            else:
                out_tags = [tracker.get(t) for t in outputs]
                out_dims = tuple(g & ~WEAK if type(g) is int else None for g in out_tags)
            if n <= 1:
                out_dims = tuple(d if d is not None and _has_rows(o, d, n) else None for o, d in zip(outputs, out_dims))
            call = CallBatch("batched", n, dims, out_dims)
            if n <= 1 and any(d is None for d in out_dims):  # the whole call is the one sample's
                call = CallBatch("single", n, (None,) * len(tensors), (None,) * len(outputs))
        else:
            call = CallBatch(kind, n, dims, (None,) * len(outputs))
        self._remember_call(layer.module, tensors, call)
        if kind == "origin":
            call = CallBatch("origin", n, dims, call.output_dims, tuple(OriginCall(layer.name, n) for _ in outputs))
        chained = tuple(dict.fromkeys(o for g in tags if type(g) is tuple for o in g))
        if kind == "origin":  # parameters read outside their module's call, fed to it (DeBERTa-v2's rel_embeddings)
            chained += self._reads.origins(tensors, n, layer.params.values(), tracker.param_origins)
        return call, primary, chained

    def _tag_outputs(self, call: CallBatch, tapped: Sequence[torch.Tensor], tags: Sequence[Any], chained: tuple) -> None:
        """Tag the tapped outputs for the tracker: a batched call's outputs keep the batch;
        an origin call's outputs are where its per-sample gradients will be gathered."""
        tracker = self._session.tracker
        for j, alias in enumerate(tapped):
            if call.kind == "origin":
                origin = call.origins[j]
                origin.bind(alias, tracked=tracker is not None)
                if tracker is not None:
                    tracker.add_origin(origin)
                    tracker.put(alias, (origin,) + chained)
            elif tracker is not None and tags[j] is not None:
                tracker.put(alias, tags[j])

    def _note_uncaptured_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A hooked call in a tracked forward that captures nothing (grad disabled, e.g. the first
        pass of reentrant checkpointing): remember its decision for the recomputation."""
        tracker = self._session.tracker
        layer = self._layers.get(module)
        if tracker is None or layer is None or torch.is_grad_enabled() or not module.training or self._switches.replaying:
            return
        if layer.sampler is not None:
            tensors = list(_tensor_arguments(module, args, kwargs))
            outputs = [output] if isinstance(output, torch.Tensor) else []
        else:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        try:
            self._classify_call(layer, tensors, outputs)
        except PerSampleGradientError:
            pass  # reported if the call is ever captured

    def _remember_call(self, module: nn.Module, tensors: Sequence[torch.Tensor], call: CallBatch) -> None:
        memo = self._decisions.setdefault(module, {})
        key = tuple([(t.shape, t.dtype) for t in tensors])
        held = memo.get(key)
        if held is None:
            if len(memo) >= 64:
                memo.pop(next(iter(memo)))
            memo[key] = call
        elif held is not _AMBIGUOUS and (held.kind, held.input_dims, held.output_dims) != (call.kind, call.input_dims, call.output_dims):
            memo[key] = _AMBIGUOUS

    def _recall_call(self, layer: HookedLayer, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> CallBatch:
        """The decision for a call outside a tracked forward (see ``_classify_call``)."""
        key = tuple([(t.shape, t.dtype) for t in tensors])
        held = self._decisions.get(layer.module, {}).get(key)
        if held is _AMBIGUOUS:
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}) is recomputed outside the model's forward (activation "
                "checkpointing), and the forward called it on inputs of these shapes both with and without the batch, "
                "so which one this is cannot be told. Call it outside the checkpointed region, or use "
                "use_reentrant=False."
            )
        if held is not None:
            if held.kind == "origin":
                return CallBatch("origin", held.n, held.input_dims, held.output_dims,
                                 tuple(OriginCall(layer.name, held.n) for _ in outputs))
            return held
        # Called directly, outside any forward of the model: its own arguments are the batch, along batch_dim.
        bags = bag_offsets(layer.module, tuple(tensors[:2]), {})
        if bags is not None:  # an EmbeddingBag's 1-D input and offsets: one bag (offset) per sample
            return CallBatch("batched", bags.shape[0], (None, 0) + (None,) * (len(tensors) - 2), (0,) * len(outputs))
        dim = self._settings.batch_dim
        first = next((t for t in tensors if t.dim() > dim), None)
        if first is None:
            return CallBatch("single", 1, (None,) * len(tensors), (None,) * len(outputs))
        n = first.shape[dim]
        dims = tuple(dim if t.dim() > dim and t.shape[dim] == n else None for t in tensors)
        return CallBatch("batched", n, dims, tuple(dim if t.dim() > dim and t.shape[dim] == n else None for t in outputs))


def _lost_batch(layer: HookedLayer, t: torch.Tensor, lost: Any) -> PerSampleGradientError:
    return PerSampleGradientError(
        f"{layer.name} ({type(layer.module).__name__}) is called on a tensor of shape {tuple(t.shape)} derived from "
        f"the batch in a way that mixes or merges its samples ({lost.reason}), so per-sample gradients of the "
        "layer's parameters are not defined. Keep each sample's rows apart up to the layer (compute the statistic "
        "per sample), or freeze its parameters."
    )


def _tensor_arguments(module: nn.Module, args: tuple, kwargs: dict) -> Tuple[torch.Tensor, ...]:
    """The tensor arguments of a call, in the order of the module's ``forward`` signature."""
    if kwargs:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        values: Sequence[Any] = list(bound.arguments.values())
    else:
        values = args
    return tuple(v for v in values if isinstance(v, torch.Tensor))


def _has_rows(t: torch.Tensor, dim: int, n: int) -> bool:
    """Whether ``t`` has the batch's rows along ``dim`` (``n * inner`` when merged)."""
    d, inner = dim % INNER, dim // INNER
    return t.dim() > d and t.shape[d] == n * max(inner, 1)

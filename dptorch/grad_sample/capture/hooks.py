"""GradSampleHooks: the controller that captures per-sample gradients on an untouched model.

It registers forward hooks on every module that owns parameters, a forward pre-hook on the root
(to learn the batch size) and a post-accumulate-grad hook on every parameter (to notice a
gradient that arrived without its per-sample counterpart). Everything it keeps lives in its own
side tables; ``cleanup()`` removes every hook and every attribute it added.

One backward pass is one *round*: the per-sample gradients of all calls of a parameter within
it are summed (tied weights, modules called twice, the two halves of a DPO batch). When the
round ends, listeners (the DP optimizer) are told; a further backward pass while a round's
results are still held, and nobody consumed them, is an error rather than a silent mix.

What is kept of each layer call, and how norms and clipped sums are formed from it, is the
mode's strategy (``modes/instantiate.py``, ``modes/book_keeping.py``); the capture itself is the same for every mode.
"""

from __future__ import annotations

import contextlib
import sys
import dataclasses
import inspect
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptorch.data import drawn
from dptorch.distributed.ddp import keep_out_of_gradient_sync
from dptorch.distributed.fsdp import is_fully_sharded_module
from dptorch.distributed.tensor_parallel import (
    check_same_batch,
    check_sharding,
    context_parallel_active,
    local_part,
    local_shape,
    partial_gradient_params,
    sum_partial_gradients,
    tensor_parallel_group,
    token_split_part,
    torch_style_hooks,
    whole_on_every_rank,
)
from dptorch.grad_sample.modes import expanded_weights
from dptorch.grad_sample.capture.buffer_check import BufferGuard
from dptorch.grad_sample.layers import reads_no_parameter_data
from dptorch.grad_sample.tracking import (
    INNER,
    Lost,
    WEAK,
    BatchTracker,
    CallBatch,
    OriginCall,
    classify,
    fed_no_batch,
    origin_grads,
    packed,
    rows_to_dense,
)
from dptorch.grad_sample.tracking.reads import ParameterReads
from dptorch.grad_sample.tracking.tags import DIM, ORDERED
from dptorch.grad_sample.modes.linear_head import HEAD_NORM_SAMPLER, HEAD_SAMPLER, linear_head
from dptorch.grad_sample.units.token_tracker import TOKEN_DIM, TokenTracker, token_call
from dptorch.grad_sample.units.token_tracker import refuse as refused_for_tokens
from dptorch.grad_sample.units.token_units import TokenUnits
from dptorch.grad_sample.capture import claims
from dptorch.grad_sample.modes.buffers import BufferPool
from dptorch.grad_sample.errors import PerSampleGradientError, UnsupportedModuleError
from dptorch.grad_sample.modes.functorch import functorch_per_sample_grads
from dptorch.grad_sample.layers.registry import GradSampler, NormSampler, find_grad_sampler, find_norm_sampler
from dptorch.grad_sample.modes.book_keeping import BookKeeping
from dptorch.grad_sample.modes.instantiate import Instantiate
from dptorch.grad_sample.modes.layer_call import LayerCall, affine_layout
from dptorch.grad_sample.tap import tap
from dptorch.grad_sample.tracking.stack import remove as remove_mode
from dptorch.grad_sample.tracking.stack import remove_finished as remove_finished_trackers
from dptorch.grad_sample.tracking.stack import sink as sink_mode
from dptorch.grad_sample.tracking import watch as draw_watch
from dptorch.grad_sample.layers.checks import incompatibilities
from dptorch.grad_sample.modes.names import GRAD_SAMPLE_MODES, LOSS_REDUCTIONS

_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, GradSampleHooks]" = weakref.WeakKeyDictionary()
drawn.watch(lambda tensors: draw_watch.start(tensors, active=lambda: bool(_ATTACHED)))
_BATCH_KEYS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "x", "input")
# HF keywords whose tensors have the batch first whenever they have n rows there
_PER_SAMPLE_KEYS = frozenset(_BATCH_KEYS + (
    "attention_mask", "token_type_ids", "position_ids", "labels", "decoder_input_ids", "decoder_attention_mask",
    "decoder_inputs_embeds", "pixel_mask", "bool_masked_pos", "encoder_hidden_states", "encoder_attention_mask",
))


@dataclass
class _Layer:
    """A hooked module: its path, direct parameters and how to compute their per-sample grads."""

    name: str
    module: nn.Module
    params: Dict[str, nn.Parameter]
    sampler: Optional[GradSampler]  # None: torch.func fallback
    norm_sampler: Optional[NormSampler] = None  # ghost / book-keeping modes only
    token_wise: bool = False  # acts on each position on its own (``_token_wise``), whatever the mode


class GradSampleHooks:
    """Attach per-sample gradient capture to ``module`` without wrapping or modifying it.

    After each backward pass, every trainable parameter ``p`` has ``p.grad_sample`` of shape
    ``(batch, *p.shape)``, also readable as ``hooks.grad_samples[p]``. Use as a context manager
    or call ``cleanup()`` to detach.

    ``batch_first`` says where the batch is in the root call's inputs (dim 0, else dim 1). Inside
    the model the batch is followed through the forward (``tracking/``): each layer call
    is per-sample along the dim its input derives from the batch, so a time-major model with
    batch-first layers inside is exact, and a layer whose input carries no batch (T5's relative
    attention bias) gets its per-sample gradients where its output meets the batch.

    ``loss_reduction="mean"`` means the loss averages the samples' losses (row ``i`` of the
    per-sample gradient is then rescaled to the gradient of sample ``i``'s own loss);
    ``"sum"`` means it sums them. ``grad_sample_mode="functorch"`` uses the torch.func
    fallback for every layer; ``"ew"`` uses torch's expanded weights; ``"bk"`` (book-keeping) keeps each layer's inputs and output
    gradients and forms norms and clipped sums from them in one backward pass; ``"ghost"`` is
    the same method under Opacus' name (``dptorch.DPLoss`` is optional there). In these two modes
    only instantiated parameters (tied weights, layers without a norm sampler) have
    ``grad_sample``. With ``strict=True``, modules whose buffers mix samples
    (BatchNorm) are refused at attach time; otherwise they only warn.
    ``keep_param_grads=False`` spares autograd the ordinary parameter gradients of layers whose
    per-sample results are computed here (``p.grad`` then stays empty for them; the DP
    optimizer writes it); it is the default for ``"bk"`` and ``"ghost"``, and the engine's. Then
    a gradient that reaches a parameter by a path outside its module's call (a weight read
    directly, a penalty on it in the loss) is refused at the end of backward.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        strict: bool = True,
        grad_sample_mode: str = "hooks",
        keep_param_grads: Optional[bool] = None,
    ) -> None:
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {grad_sample_mode!r}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"GradSampleHooks needs an nn.Module, got {type(module).__name__}")
        if module in _ATTACHED:
            raise RuntimeError(
                f"{type(module).__name__} already has GradSampleHooks attached; call cleanup() on them "
                "(or PrivacyEngine.detach()) before attaching again"
            )
        self.module = module
        self.batch_first = batch_first
        self.loss_reduction = loss_reduction
        self.grad_sample_mode = grad_sample_mode
        # Whether autograd still fills p.grad for layers whose per-sample results we compute
        # ourselves. The DP optimizer overwrites p.grad, so it turns this off (and then any
        # autograd gradient reaching a parameter reveals a path we do not see); book-keeping and
        # ghost default to off.
        self.keep_param_grads = grad_sample_mode not in ("bk", "ghost") if keep_param_grads is None else keep_param_grads
        self._batch_dim = 0 if batch_first else 1
        self._handles: List[Any] = []
        self._restore_param_hooks: List[Tuple[nn.Parameter, Any]] = []
        self._watched: Dict[int, nn.Parameter] = {}  # parameters with our post-accumulate-grad hook, by id
        self._layers: Dict[nn.Module, _Layer] = {}
        self._param_names: Dict[nn.Parameter, str] = {}
        self._buffers = BufferPool()  # per-sample gradient memory, lent again each round (CPU)
        self._strategy = self._new_strategy()
        self._suspending = False  # inside _capture_suspended: our own operations
        self._paused = False  # disable_hooks(): no capture at all until enable_hooks()
        self._paused_gradients: Dict[nn.Parameter, None] = {}  # parameters a paused backward gave a gradient
        self._suppressed: Dict[nn.Module, Dict[str, nn.Parameter]] = {}
        self._expanded: Optional[Any] = None
        self._received: Dict[nn.Parameter, None] = {}
        self._unhooked_grad_versions: Dict[nn.Parameter, Tuple[int, int]] = {}
        self._unit_ids: Optional[torch.Tensor] = None
        self._token_units: Optional[TokenUnits] = None  # for the next root forward (set_privacy_units of (B, T) ids)
        self._token_tracker: Optional[TokenTracker] = None  # follows the tokens through the current root forward
        self._round_units: Optional[TokenUnits] = None  # the token units of the held round
        self._kept_grad_samples: List[nn.Parameter] = []  # p.grad_sample left after a step, until the next forward
        self._separable: Dict[int, Any] = {}  # id -> weakref: root outputs whose tokens kept their units apart
        self._packed_forward: Optional[TokenUnits] = None  # the token units of the last root forward, if packed
        # Parameter a sharding wrapper (FSDP2's fully_shard) swaps in for the call -> registered one
        self._canonical: Dict[torch.Tensor, nn.Parameter] = {}
        self._wrapper_inputs: Dict[nn.Module, List[Any]] = {}  # FSDP2 modules: inputs (and tags) before its pre-hook
        self._wrapper_outputs: Dict[nn.Module, Any] = {}  # tensor-parallel layers: the output tapped, before their hook
        self.uncaptured: List[str] = []  # parameters the last backward gave gradients but no capture
        self._listeners: List[Callable[["GradSampleHooks"], None]] = []
        self._batch_size: Optional[int] = None
        self.last_batch_size: Optional[int] = None
        self._replaying = False
        self._tracker: Optional[BatchTracker] = None  # follows the batch through the current root forward
        self._loss_tracker: Optional[BatchTracker] = None  # then through the loss, until backward (tracking/loss.py)
        self._buffer_guard = BufferGuard(module)  # buffers a training forward fills from the batch (buffer_check.py)
        self._root_depth = 0
        self._tracking_off: Any = False  # "popped"/"paused": the tracker stepped aside for a layer call
        self._decisions: Dict[nn.Module, Dict[tuple, Any]] = {}  # per layer call signature, for recomputation
        self._reads = ParameterReads(self._owners, self.parameter_name, self._read_backward)  # tracking/reads.py
        self._in_backward = False
        self._round_done = False
        self._round_consumed = False
        self._attached = False
        self._check_compatible(strict)
        self._attach()
        self._attach_batch_tracking()

    # ------------------------------------------------------------------ attach / detach

    def _check_compatible(self, strict: bool) -> None:
        # tensor parallelism splits one sample's gradient across ranks: only the splits it can add up
        self.tensor_parallel = check_sharding(self.module)
        self._tensor_parallel_whole = {}
        self._partial_gradients = partial_gradient_params(self.module) if self.tensor_parallel else []
        self._tensor_parallel_modules = [m for m in self.module.modules()
                                         if any(p in self.tensor_parallel for p in m.parameters(recurse=False))]
        self._replicated_tensor_parallel = {id(m) for m in self._tensor_parallel_modules  # SequenceParallel's norms
                                            if not any(self.tensor_parallel[p].sharded for p in m.parameters(recurse=False))}
        self._token_split: Dict[nn.Parameter, bool] = {}
        self._check_replicated_tensor_parallel()
        if self.grad_sample_mode == "ew":
            unsupported = expanded_weights.unsupported_modules(self.module)
            if unsupported:
                raise UnsupportedModuleError(
                    "grad_sample_mode='ew' cannot compute per-sample gradients of:\n"
                    + "\n".join(f"  - {p}" for p in unsupported)
                )
        problems = incompatibilities(self.module)
        if not problems:
            return
        message = "the model cannot be trained with per-sample gradients:\n" + "\n".join(f"  - {p}" for p in problems)
        if strict:
            raise UnsupportedModuleError(message)
        import warnings

        warnings.warn(message, stacklevel=3)

    @property
    def _under_ddp(self) -> bool:
        """Attached to a DistributedDataParallel module (its gradient sync is switched off while the
        parameters are kept out of autograd: ``dptorch.distributed.ddp``)."""
        return isinstance(self.module, nn.parallel.DistributedDataParallel)

    def _attach(self) -> None:
        self._handles.append(self.module.register_forward_pre_hook(self._on_root_forward, with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(self._on_root_forward_end, always_call=True))
        self._handles.append(self.module.register_forward_hook(self._tap_root_outputs))
        for name, param in self.module.named_parameters(remove_duplicate=True):
            self._param_names[param] = name
        tensor_parallel = {id(m) for m in self._tensor_parallel_modules}
        for name, sub in self.module.named_modules():
            params = dict(sub.named_parameters(recurse=False))
            if not params:
                continue
            sampler = None if self.grad_sample_mode == "functorch" else find_grad_sampler(sub)
            norm_sampler = find_norm_sampler(sub) if sampler and self.grad_sample_mode in ("bk", "ghost") else None
            self._layers[sub] = _Layer(name or type(sub).__name__, sub, params, sampler, norm_sampler,
                                       _token_wise(sub, norm_sampler or (find_norm_sampler(sub) if sampler else None)))
            self._handles.append(sub.register_forward_pre_hook(self._before_layer_forward))
            if self.grad_sample_mode == "ew":
                self._handles.append(sub.register_forward_pre_hook(self._check_expanded_batch, with_kwargs=True))
                continue
            if id(sub) in tensor_parallel:  # the output before tensor parallelism's output hook redistributes it
                self._handles.append(sub.register_forward_hook(self._on_tensor_parallel_layer_forward, with_kwargs=True,
                                                               always_call=True, prepend=True))
                continue
            self._handles.append(sub.register_forward_hook(self._on_layer_forward, with_kwargs=True, always_call=True))
        for param in self._param_names:
            self._watch(param)
        self._attach_wrapper_tags()
        if self._under_ddp:  # the DP optimizer reduces the clipped sums; DDP must not expect raw gradients
            self._handles.append(keep_out_of_gradient_sync(self.module, when=lambda: self._suppressing))
        _ATTACHED[self.module] = self
        claims.claim(self, list(self._param_names))  # a DPOptimizer built without hooks= finds us by parameter
        self._attached = True

    def cleanup(self) -> None:
        """Remove every hook and attribute this controller added; the model is as before."""
        if not self._attached:
            return
        self._drop_loss_tracker()
        self.clear()
        for handle in self._handles:
            handle.remove()
        self._reads.remove()
        for param, previous in self._restore_param_hooks:
            param._post_accumulate_grad_hooks = previous
        self._handles.clear()
        self._restore_param_hooks.clear()
        self._watched.clear()
        self._layers.clear()
        self._listeners.clear()
        self._canonical.clear()
        claims.release(self, list(self._param_names))
        _ATTACHED.pop(self.module, None)
        draw_watch.stop()  # the draw it watched was for this controller, or another one's: that one falls back
        self._attached = False

    #: Opacus' name for :meth:`cleanup`.
    remove_hooks = cleanup

    def __deepcopy__(self, memo: dict) -> "GradSampleHooks":
        # A deep copy of the model (a reference model, ModuleValidator.fix) carries our hooks;
        # they must keep pointing here, where they ignore modules and parameters they don't own.
        return self

    def __enter__(self) -> "GradSampleHooks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    @property
    def attached(self) -> bool:
        return self._attached

    # ------------------------------------------------------------------ not the model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_NOT_THE_MODEL.format(what="called like a model", model=type(self.__dict__.get("module")).__name__))

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(_NOT_THE_MODEL.format(what=f"indexed like a model ([{key!r}])",
                                              model=type(self.__dict__.get("module")).__name__))

    def __getattr__(self, name: str) -> Any:
        # Only for names the controller lacks: model attributes used on it (the old dptorch idiom
        # `model, optimizer, loader = make_private(..., wrap_model=False)`) get the fix in the message.
        module = self.__dict__.get("module")
        if name.startswith("__") or module is None or not (hasattr(nn.Module, name) or hasattr(module, name)):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(_NOT_THE_MODEL.format(what=f"asked for the model attribute {name!r}",
                                                   model=type(module).__name__))

    # ------------------------------------------------------------------ public results

    def _new_strategy(self):
        if self.grad_sample_mode in ("bk", "ghost"):
            return BookKeeping(self.parameter_name, self._buffers)
        return Instantiate(self.parameter_name, self._buffers)

    @property
    def grad_samples(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Instantiated per-sample gradients of the last backward round, by parameter (a copy)."""
        return dict(self._strategy.grads)

    def per_sample_norms(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Each parameter's per-sample (per-unit) gradient norm, float32, for the held round."""
        self._drop_loss_tracker(finished_only=True)
        return self._strategy.per_sample_norms()

    def clipped_sums(self, clip_factors: Dict[nn.Parameter, torch.Tensor], dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        """``sum_i c_i * g_i`` (float32) for each parameter that ``clip_factors`` names; the units in the bool
        mask ``dropped`` (non-finite gradients) contribute exactly 0, whatever their rows hold."""
        sums = self._strategy.clipped_sums(clip_factors, dropped)
        for p, whole in self._tensor_parallel_whole.items():  # formed whole on every rank: keep this rank's slice
            if whole and p in sums:
                sums[p] = self.tensor_parallel[p].local_of(sums[p].reshape(self.tensor_parallel[p].shape))
        return sums

    #: Whether a layer's samplers read no parameter data (only shapes): exact while ZeRO-3 has them released.
    reads_no_parameter_data = staticmethod(reads_no_parameter_data)

    @property
    def tensor_parallel_whole(self) -> set:
        """The split parameters whose per-sample gradients this round formed whole on every rank."""
        return {p for p, whole in self._tensor_parallel_whole.items() if whole}

    @property
    def batch_size(self) -> int:
        """Samples (units) in the held round (0 when nothing is held)."""
        return self._strategy.batch_size()

    @contextlib.contextmanager
    def _replay(self):
        """Our own re-run of a recorded layer call in backward: the hooked layers inside it capture nothing."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    @contextlib.contextmanager
    def _capture_suspended(self):
        self._suspending = True
        try:
            yield
        finally:
            self._suspending = False

    @property
    def _suspended(self) -> bool:
        """Whether backward-side capture is off: our own operations, or capture paused."""
        return self._suspending or self._paused

    # ------------------------------------------------------------------ pausing (Opacus' names)

    @property
    def hooks_enabled(self) -> bool:
        """Whether forwards and backwards are captured (Opacus' name); ``disable_hooks()`` pauses."""
        return self._attached and not self._paused

    def disable_hooks(self) -> None:
        """Pause capture: forwards and backwards from now on capture nothing, as in an unhooked model.

        The gradients a paused backward gives reach ``p.grad`` unclipped, and no DP step ever uses them:
        the DP optimizer writes every parameter's gradient from the clipped sums of captured backward
        passes plus noise, and refuses a step that has only paused passes behind it. ``enable_hooks()``
        resumes exact per-sample capture from the next forward.
        """
        self._set_paused(True)

    def enable_hooks(self) -> None:
        """Resume capture after :meth:`disable_hooks` (capture is on from attach)."""
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        if self._root_depth or self._in_backward or torch._C._current_graph_task_id() != -1:
            raise RuntimeError("disable_hooks() / enable_hooks() inside a forward or backward pass: pause or resume "
                               "between passes, so that every pass is captured whole or not at all")
        self._paused = paused

    @property
    def paused_gradients(self) -> List[nn.Parameter]:
        """Parameters paused backward passes gave gradients since :meth:`forget_paused_gradients`."""
        return list(self._paused_gradients)

    def forget_paused_gradients(self) -> None:
        """The paused passes' gradients are gone (the DP optimizer's ``zero_grad()`` or step)."""
        self._paused_gradients = {}

    def parameter_name(self, param: nn.Parameter) -> str:
        if param in self._param_names:
            return self._param_names[param]
        return next((n for n, p in self.module.named_parameters() if p is param), "<parameter not in model>")

    def add_backward_listener(self, listener: Callable[["GradSampleHooks"], None]) -> Callable[[], None]:
        """Call ``listener(self)`` at the end of every backward round; returns a remover.

        A listener consumes the round: the next backward pass then starts a fresh one.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def set_privacy_units(self, unit_ids: Optional[torch.Tensor]) -> None:
        """Group batch rows, or tokens, into privacy units.

        ``unit_ids[r]`` (1-D) names the unit of row ``r`` for the following backward passes (any
        integers; rows with equal ids form one unit, e.g. a DPO example's chosen and rejected rows,
        or all records of one user). Their gradients are summed before clipping, and per-sample
        results have one row per unit, in ascending id order. ``None`` makes every row its own unit
        again.

        ``unit_ids[b, t]`` (2-D, ``(B, T)``) names the unit of each token of the next root forward:
        several examples packed in one row (``dptorch.grad_sample.units.token_units`` derives the ids from
        packed ``position_ids`` or sequence lengths; -1 marks a pad token of no unit). That forward is
        then followed along its tokens too (``tracking/tokens.py``), and its loss must be
        ``dptorch.packed_loss``. Call it before every packed forward.
        """
        if unit_ids is not None and torch.as_tensor(unit_ids).dim() == 2:
            if not self.batch_first:
                raise ValueError("token privacy units need batch_first=True: ids of shape (batch, tokens)")
            self._token_units, self._unit_ids = TokenUnits(unit_ids), None
            return
        self._token_units = None
        self._unit_ids = None if unit_ids is None else torch.as_tensor(unit_ids).flatten()

    @property
    def unit_kind(self) -> str:
        """What a privacy unit is in the current forward: "rows", "grouped" rows or "tokens"."""
        if self._token_tracker is not None or self._packed_forward is not None:
            return "tokens"
        return "rows" if self._unit_ids is None else "grouped"

    def clear(self, keep_grad_samples: bool = False) -> None:
        """Forget the held per-sample gradients (and remove ``p.grad_sample``). With
        ``keep_grad_samples`` (the DP optimizer's step), ``p.grad_sample`` stays readable, as in Opacus,
        until the next training forward or ``clear()``, so it never adds to a forward's memory."""
        self._drop_loss_tracker(finished_only=True)
        self._drop_kept_grad_samples()
        if keep_grad_samples:
            self._kept_grad_samples = [p for p in self._strategy.grads if "grad_sample" in p.__dict__]
        else:
            for param in self._strategy.grads:
                param.__dict__.pop("grad_sample", None)
        self._strategy = self._new_strategy()
        if not keep_grad_samples:  # (kept ones are taken back when they are dropped)
            self._buffers.reclaim()  # the dropped round's memory, where nothing else holds it
        self._round_done = False
        self._round_consumed = False
        self._round_units = None
        self._tensor_parallel_whole: Dict[nn.Parameter, bool] = {}  # split layers computed whole this round
        self._token_split = {}  # replicated layers whose inputs were split along the tokens this round

    def _drop_kept_grad_samples(self) -> None:
        for param in self._kept_grad_samples:
            param.__dict__.pop("grad_sample", None)
        self._kept_grad_samples = []

    # ------------------------------------------------------------------ forward side

    def _on_root_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module is self.module and not self._replaying:
            self._root_depth += 1
            if self._root_depth > 1:  # the root calling itself: the outer call's batch and tracking stand
                return
            self._drop_loss_tracker(finished_only=True)
            watched = draw_watch.pause()  # first: the controller's own reads below are not the loop's
            if module.training and torch.is_grad_enabled() and self._kept_grad_samples:
                self._drop_kept_grad_samples()
                self._buffers.reclaim()
            if torch._C._current_graph_task_id() == -1:  # outside backward, where the stack is the caller's
                remove_finished_trackers()  # other controllers' too: they only pass calls through
            bags = _bag_offsets(module, args, kwargs)
            self._batch_size = _infer_batch_size(args, kwargs, self._batch_dim) if bags is None else bags.shape[0]
            self.last_batch_size = self._batch_size
            units, self._token_units = self._token_units, None  # token units hold for one forward
            self._packed_forward = None
            if module.training and torch.is_grad_enabled() and context_parallel_active():
                raise PerSampleGradientError(
                    "context parallelism (torch.distributed.tensor.experimental.context_parallel) is on: it splits "
                    "every sample's tokens over the ranks, so no rank holds a sample's whole gradient and attention "
                    "meets the other ranks' tokens through collectives the batch tracker does not follow. Private "
                    "training refuses it; give each rank whole sequences (DDP, FSDP2, or tensor parallelism)"
                )
            if module.training and torch.is_grad_enabled() and self.tensor_parallel:  # one batch on every rank
                check_same_batch(_tensor_leaves((args, kwargs)), tensor_parallel_group(self.tensor_parallel))
            if module.training and torch.is_grad_enabled() and self._batch_size is not None and not self._paused:
                self._buffer_guard.start()
                self._tracker = self._start_tracking(args, kwargs, self._batch_size, *watched)
                if units is not None:
                    self._token_tracker = self._start_token_tracking(units, args, kwargs)
            else:  # not a training forward: the loop's own (its outputs derive from the batch)
                draw_watch.rest()
                draw_watch.resume()
            if self.grad_sample_mode == "ew" and module.training and torch.is_grad_enabled() and self._batch_size and not self._paused:
                self._expanded = expanded_weights.expanded(module, self._batch_size, self.loss_reduction)
                self._expanded.__enter__()

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
        tracker = BatchTracker(n, skip=lambda: owner()._suspended, quiet=lambda: owner()._capture_suspended())
        tracker.loss_reduction = self.loss_reduction
        tracker.owner = owner
        tracker.on_backward = lambda: getattr(owner(), "_loss_phase_over", lambda t: None)(tracker)
        tracker.unit_kind = lambda: getattr(owner(), "unit_kind", "rows")  # grouped rows: docs/privacy.md
        previous, self._loss_tracker = self._loss_tracker, None
        if previous is not None:  # a second forward before backward: the loss may combine both
            remove_mode(previous)
            if not previous.done:
                tracker.adopt(previous)
            previous.close()
        dim = self._batch_dim
        if watched is not None:  # what the loop derived from the DP loader's draw before this forward
            tracker.adopt(watched)
        if dim == 0:  # the DP loader's latest batch, collated along dim 0: labels the loss may use
            for t in drawn.latest():
                if t.dim() and t.shape[0] == n and tracker.get(t) is None:
                    tracker.put(t, 0)
        # With the draw watched (and no value of it read into Python), a root argument not derived from it is
        # shared by the samples; otherwise one with n rows may hold their data (weak: taken as batched)
        known = watched is not None and whole and watched.escaped is None
        primary = _bag_offsets(self.module, args, kwargs)
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
        if rows is not None:  # a micro-batch cut from the draw: its rows (the labels' too) are this forward's batch
            tracker.take_rows(rows, watched.n)
        for leaf, strong in leaves:
            seen = tracker.get(leaf)
            if seen is not None and not (type(seen) is int and seen & ~WEAK == dim) and not (
                    drawn_rows and type(seen) is Lost and seen.kind in ORDERED):
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
        tracker = TokenTracker(units, self._tracker)
        named = [(None, a) for a in args] + list(kwargs.items())
        for name, value in named:
            for leaf in tree_flatten(value)[0]:
                if not isinstance(leaf, torch.Tensor) or self._tracker.get(leaf) is None:
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
        tracker, self._token_tracker = self._token_tracker, None
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
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        self._tracking_off = False
        tracker.paused = False
        if sys.exc_info()[1] is not None:  # the forward raised (a refusal, say): no loss will follow it
            remove_mode(tracker)
            tracker.close()
            draw_watch.resume()
            return
        tracker.end_forward()
        sink_mode(tracker)
        self._loss_tracker = tracker

    def _loss_phase_over(self, tracker: BatchTracker) -> None:
        """backward() was called (and checked): a tracker in its loss phase ignores everything from
        now on; it leaves the mode stack at the next chance outside torch's dispatch."""
        if tracker is self._loss_tracker:
            tracker.done = True

    def _drop_loss_tracker(self, finished_only: bool = False) -> None:
        tracker = self._loss_tracker
        if tracker is None or (finished_only and not tracker.done):
            return
        if torch._C._current_graph_task_id() != -1:  # in backward's callbacks torch's mode stack is not the
            return  # caller's: the tracker would stay on it for good; it leaves at the next chance instead
        self._loss_tracker = None
        remove_mode(tracker)
        tracker.close()

    def _attach_batch_tracking(self) -> None:
        """Inside a capturing call of a layer with a grad sampler and no hooked module below it, the
        layer's own operations need not be followed: its output is batched where its input is (a
        sampler's layer works row by row; an expert bank's parameterless activation is part of it).
        The tracker steps aside for the call (a pre-hook that runs before the others)."""
        if self.grad_sample_mode == "ew":
            return
        for module, layer in self._layers.items():
            if layer.sampler is not None and not any(m in self._layers for m in module.modules() if m is not module):
                self._handles.append(module.register_forward_pre_hook(self._enter_leaf_layer, prepend=True))

    def _enter_leaf_layer(self, module: nn.Module, args: tuple) -> None:
        if self._tracker is None or self._tracking_off or not self._capturing(module):
            return
        # Off first: with the tracker on torch's mode stack, reading p.requires_grad goes through it.
        self._suspend_tracking()
        if not any(p.requires_grad for p in self._layers[module].params.values()):
            self._resume_tracking()

    def _suspend_tracking(self) -> None:
        """Take the tracker (and the token tracker above it) off torch's mode stack, if they are on top,
        until ``_resume_tracking``."""
        tracker = self._tracker
        if tracker is None or self._tracking_off:
            return
        ours = [tracker] if self._token_tracker is None else [tracker, self._token_tracker]
        depth = torch._C._len_torch_function_stack()
        if depth >= len(ours) and all(torch._C._get_function_stack_at(depth - len(ours) + k) is mode
                                      for k, mode in enumerate(ours)):
            for _ in ours:
                torch._C._pop_torch_function_stack()
            self._tracking_off = "popped"
        else:  # another mode above them: they stay, ignoring what they see
            for mode in ours:
                mode.paused = True
            self._tracking_off = "paused"

    def _resume_tracking(self) -> None:
        if self._tracker is not None:
            ours = [self._tracker] if self._token_tracker is None else [self._tracker, self._token_tracker]
            for mode in ours:
                if self._tracking_off == "popped":
                    torch._C._push_on_torch_function_stack(mode)
                mode.paused = False
        self._tracking_off = False

    def _on_root_forward_end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if module is not self.module or self._replaying:
            return None
        self._root_depth = max(self._root_depth - 1, 0)
        if self._root_depth:
            return None
        self._end_token_tracking(output)
        leak = self._buffer_guard.finish(self._tracker)  # a buffer filled from the batch: put back, refused
        self._enter_loss_phase()
        self._batch_size = None
        if self._expanded is not None:
            self._expanded.__exit__(None, None, None)
            self._expanded = None
        if leak is not None and sys.exc_info()[1] is None:
            self._drop_loss_tracker()
            raise PerSampleGradientError(leak)
        return None

    def _tap_root_outputs(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Tap the model's outputs, so that a second backward through this forward is refused
        even where it reaches no hooked layer twice (two heads on a frozen trunk). Under expanded
        weights, where torch writes p.grad_sample itself, the tap also tells us when backward starts."""
        if module is not self.module or self._replaying or self._paused or not (torch.is_grad_enabled() and module.training):
            return None
        leaves, spec = tree_flatten(output)
        positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None
        ew = self.grad_sample_mode == "ew"
        on_backward = lambda saved, grads: self._begin_round() if ew else None  # noqa: E731
        tracker = self._loss_tracker
        for i, t in zip(positions, tap([leaves[i] for i in positions], [], on_backward)):
            if tracker is not None:
                tracker.put(t, tracker.get(leaves[i]))  # the loss is followed from the tapped outputs
            units = self.separable_units(leaves[i])
            if units is not None:
                self._separable[id(t)] = (weakref.ref(t), units)
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _check_expanded_batch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._expanded is None or not any(p.requires_grad for p in self._layers[module].params.values()):
            return
        rows = _infer_batch_size(args, kwargs, self._batch_dim)
        tensors = _tensor_arguments(module, args, kwargs)
        if self._tracker is not None and tensors:  # the batch must derive from the root's, along dim 0
            kind, dims, _ = classify([self._tracker.get(t) for t in tensors], self._tracker.n)
            rows = tensors[0].shape[0] if tensors[0].dim() else 1
            if kind == "batched" and dims[0] == 0:
                rows = self.last_batch_size
            elif kind != "single" and rows == self.last_batch_size:
                rows = (f"inputs of shape {tuple(tensors[0].shape)} whose {rows} rows are not the batch's (they do not "
                        "derive from it along dim 0), so it is called with no")
        if rows is not None and rows != self.last_batch_size:
            layer = self._layers[module]
            raise PerSampleGradientError(
                f"{layer.name} ({type(module).__name__}) is called with {rows} rows but the batch has "
                f"{self.last_batch_size}: expanded weights need one row per sample in every call (a broadcast "
                "input such as GPT-2's default position_ids of shape (1, T), or T5's relative position buckets of "
                "shape (T, T), is not). Pass per-row inputs, or use grad_sample_mode='hooks', which handles "
                "broadcast inputs."
            )

    def _capturing(self, module: nn.Module) -> bool:
        return not (self._replaying or self._paused) and torch.is_grad_enabled() and module.training and module in self._layers

    @property
    def _suppressing(self) -> bool:
        """Whether hooked layers keep their own parameters out of autograd during their calls.

        Then any autograd gradient that reaches a parameter came by a path the controller does not
        see (a weight read outside its module, a penalty on it in the loss) and is refused. Under
        DDP too: DDP's gradient sync is then off for the forward (the DP optimizer all-reduces the
        clipped sums). Expanded weights need the parameters in the graph.
        """
        return not self.keep_param_grads and self.grad_sample_mode != "ew"

    def _watch(self, param: nn.Parameter) -> None:
        """Register the post-accumulate-grad hook that notices gradients arriving at ``param``."""
        if id(param) in self._watched or not param.requires_grad:
            return
        self._watched[id(param)] = param
        self._restore_param_hooks.append((param, param._post_accumulate_grad_hooks))
        self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))

    def _before_layer_forward(self, module: nn.Module, args: tuple) -> None:
        """Watch parameters unfrozen since attach; keep this layer's parameters out of autograd.

        Autograd need not compute this layer's parameter gradients, which the clipped sum
        replaces; its parameters stop requiring grad for the duration of the call.
        """
        layer = self._layers.get(module)
        if layer is None:  # a deep copy of the model carries our hooks; it is not ours
            return
        live = self._live_params(module, layer)
        for p in live.values():
            self._watch(p)
        if not self._suppressing or not self._capturing(module):
            return
        params = {name: p for name, p in live.items() if p.requires_grad or self._suppressed_around(p)}
        for p in params.values():
            p.requires_grad_(False)
        self._suppressed[module] = params

    def _check_replicated_tensor_parallel(self) -> None:
        """Refuse a layer with replicated tensor-parallel weights (SequenceParallel) that no grad sampler
        covers: the ranks' parts of its per-sample gradients are summed only on the grad samplers' path."""
        for name, sub in self.module.named_modules():
            if id(sub) not in self._replicated_tensor_parallel or not any(p.requires_grad for p in sub.parameters(False)):
                continue
            if self.grad_sample_mode in ("functorch", "ew") or find_grad_sampler(sub) is None:
                raise ValueError(
                    f"{name} ({type(sub).__name__}) has weights replicated over the tensor-parallel group "
                    f"(SequenceParallel) and no grad sampler in grad_sample_mode={self.grad_sample_mode!r}: each rank "
                    "holds part of every sample's tokens, and only a grad sampler's per-sample gradients (of a layer "
                    "that acts on each token on its own: LayerNorm, RMSNorm) are summed over the ranks. Register a "
                    "grad sampler for it, use grad_sample_mode 'hooks', 'bk' or 'ghost', or leave it out of the plan"
                )

    def _suppressed_around(self, param: nn.Parameter) -> bool:
        """Whether an enclosing call holds ``param`` out of autograd (a parameter shared by a module and
        its child, as BERT's MLM bias and its decoder's): the inner call still captures it."""
        return bool(self._suppressed) and any(p is param for held in self._suppressed.values() for p in held.values())

    def _attach_wrapper_tags(self) -> None:
        """FSDP2's forward pre-hook replaces a sharded module's inputs that require grad by aliases
        (its post-backward Function), and torch's tensor-parallel styles replace a module's inputs and
        outputs by DTensors wrapping them, redistributed or unwrapped, which the batch tracker never saw
        being made: hooks around them hand each input's (and the output's) batch tag to its replacement."""
        tensor_parallel = {id(m) for m in self._tensor_parallel_modules}
        for sub in self.module.modules():
            layer = id(sub) in tensor_parallel
            if is_fully_sharded_module(sub) or layer or torch_style_hooks(sub, outputs=False):
                self._handles.append(sub.register_forward_pre_hook(self._note_wrapper_inputs, prepend=True, with_kwargs=True))
                self._handles.append(sub.register_forward_pre_hook(self._tag_wrapper_inputs, with_kwargs=True))
            if layer or torch_style_hooks(sub, outputs=True):
                if not (layer and sub in self._layers):  # (a tensor-parallel layer's capture notes its output)
                    self._handles.append(sub.register_forward_hook(self._note_wrapper_output, prepend=True))
                self._handles.append(sub.register_forward_hook(self._tag_wrapper_output))

    def _note_wrapper_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self._wrapper_inputs.setdefault(module, []).append([(t, tracker.get(t)) for t in leaves])

    def _tag_wrapper_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        pending = self._wrapper_inputs.get(module)
        noted = pending.pop() if pending else None
        tracker = self._tracker
        if noted is None or tracker is None:
            return
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if len(leaves) != len(noted):
            return
        for t, (before, tag) in zip(leaves, noted):
            if t is not before and tag is not None and tracker.get(t) is None and _keeps_batch_dim(before, t, tag):
                tracker.put(t, tag)

    def _on_tensor_parallel_layer_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """A tensor-parallel layer's capture, before torch's output hook redistributes its output (a row-wise
        layer's sums scattered over the tokens): the output gradient there is every token's."""
        tapped = self._on_layer_forward(module, args, kwargs, output)
        self._note_wrapper_output(module, args, output if tapped is None else tapped)
        return tapped

    def _note_wrapper_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._tracker is not None:
            self._wrapper_outputs[module] = output

    def _tag_wrapper_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        """A tensor-parallel layer's output hook redistributes (and unwraps) the output the controller tapped
        (a row-wise layer's partial sums scattered over the tokens): the batch tag passes to the result."""
        before = self._wrapper_outputs.pop(module, None)
        if before is None or before is output or not isinstance(output, torch.Tensor):
            return
        for tracker in (self._tracker, self._token_tracker):
            tag = None if tracker is None else tracker.get(before)
            if tag is not None and tracker.get(output) is None and _keeps_batch_dim(before, output, tag):
                tracker.put(output, tag)

    def _live_params(self, module: nn.Module, layer: _Layer) -> Dict[str, torch.Tensor]:
        """The parameter tensors this call of ``layer`` uses, by name: the registered ones, or the
        ones a sharding wrapper swapped in for the call (FSDP2's all-gathered parameters), which
        are then remembered as aliases of the registered ones (``_canonical``)."""
        if self.grad_sample_mode == "ew":  # expanded weights stand in for the parameters: not aliases
            return dict(layer.params)
        live = {}
        for name, param in layer.params.items():
            current = module._parameters.get(name)
            if isinstance(current, nn.Parameter) and current is not param:
                self._canonical[current] = param
                live[name] = current
            else:
                live[name] = param
        return live

    def _keyed_by_registered(self, fn: Optional[Callable]) -> Optional[Callable]:
        """``fn``, a function returning a dict by parameter, with its keys mapped to the registered
        parameters (a sampler run while FSDP2 has its gathered parameters in place)."""
        canonical = self._canonical
        if fn is None or not canonical:
            return fn

        def keyed(*args: Any, **kwargs: Any) -> Dict[nn.Parameter, Any]:
            return {canonical.get(p, p): value for p, value in fn(*args, **kwargs).items()}

        return keyed

    def _on_layer_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        self._suspend_tracking()  # our own operations are not the model's
        try:
            return self._layer_forward(module, args, kwargs, output)
        finally:
            self._resume_tracking()

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
        if not self._capturing(module):
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

    def _capture_for_sampler(self, layer: _Layer, params, args, kwargs, output):
        if not isinstance(output, torch.Tensor):
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}) returned {type(output).__name__}, but its registered "
                "grad sampler needs a single tensor output; register a sampler for the layer that returns it"
            )
        if not output.requires_grad:
            return None
        activations = _tensor_arguments(layer.module, args, kwargs)
        call, tag, chained = self._classify_call(layer, activations, (output,))
        tokens = self._token_tracker
        token_tag, flat = (None, False) if tokens is None else token_call(tokens, layer.name, layer.module, layer.token_wise, activations)
        if call.kind == "batched":
            dim = call.output_dims[0]
            rows = None if dim is None else call.n * max(dim // INNER, 1)  # the batch merged with an inner dim
            if dim is None or output.dim() <= dim % INNER or output.shape[dim % INNER] != rows:
                raise self._not_per_sample(layer, output, call.n, None if dim is None else dim % INNER)
        on_backward = partial(self._layer_backward, layer, params, call, None if tokens is None else tokens.units, flat)
        tapped = tap((output,), activations, on_backward)
        self._tag_outputs(call, tapped, [tag], chained)
        if tokens is not None:
            tokens.put(tapped[0], token_tag)
        return tapped[0]

    def _capture_for_replay(self, layer: _Layer, params, args, kwargs, output):
        out_leaves, out_spec = tree_flatten(output)
        positions = [i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None
        call_leaves, call_spec = tree_flatten((args, kwargs))
        tensor_positions = [i for i, t in enumerate(call_leaves) if isinstance(t, torch.Tensor)]
        outputs = [out_leaves[i] for i in positions]
        call, _, chained = self._classify_call(layer, [call_leaves[i] for i in tensor_positions], outputs)
        tags = [self._tracker.get(t) for t in outputs] if self._tracker is not None else [None] * len(outputs)
        if self._token_tracker is not None:
            replay = self._token_replay(layer, [call_leaves[i] for i in tensor_positions], outputs)
            on_backward = partial(replay, params, call, call_leaves, call_spec, tensor_positions, positions)
        else:
            on_backward = partial(self._replay_backward, layer, params, call, call_leaves, call_spec, tensor_positions, positions)
        tapped = tap(outputs, [call_leaves[i] for i in tensor_positions], on_backward)
        self._tag_outputs(call, tapped, tags, chained)
        for i, t in zip(positions, tapped):
            if self._token_tracker is not None:
                self._token_tracker.put(t, self._token_tracker.get(out_leaves[i]))
            out_leaves[i] = t
        return tree_unflatten(out_leaves, out_spec)

    def _classify_call(self, layer: _Layer, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]):
        """How this call carries the batch (a ``CallBatch``), from what its inputs derive from.

        Also returns the tag of its primary batched input and the origins (layer calls without a
        batched input) its inputs derive from. Outside a tracked forward (recomputation under
        activation checkpointing, a layer called directly) the decision made for the same layer
        and input shapes in the forward is reused.
        """
        tracker = self._tracker
        if tracker is None:
            return self._recall_call(layer, tensors, outputs), None, ()
        n = tracker.n
        tags = [tracker.get(t) for t in tensors]
        if n <= 1:  # one sample cannot be mixed with others; only a dim of one row can be its batch dim
            tags = [g if type(g) is not int or _has_rows(t, g & ~WEAK, n) else None for t, g in zip(tensors, tags)]
        kind, dims, primary = classify(tags, n)
        if kind == "lost":
            culprit = (t for t, g in zip(tensors, tags) if g is primary or type(g) is Lost or (type(g) is int and g & WEAK))
            raise self._lost_batch(layer, next(culprit, tensors[0]), primary)
        if kind == "batched" and layer.sampler is None and fed_no_batch([tracker.get(t) for t in outputs], n):
            kind, dims = "origin", (None,) * len(tensors)  # its batched inputs gave it only their shapes
        if kind == "batched":
            for t, d in zip(tensors, dims):
                if d is None:
                    continue
                if not _has_rows(t, d, n):
                    raise self._not_per_sample(layer, t, n, d % INNER)
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

    def _owners(self) -> Dict[int, List[nn.Module]]:
        """id(parameter) -> the hooked modules holding it directly."""
        owners: Dict[int, List[nn.Module]] = {}
        for module, layer in self._layers.items():
            for param in layer.params.values():
                owners.setdefault(id(param), []).append(module)
        return owners

    def _read_backward(self, param: nn.Parameter, grads: torch.Tensor) -> None:
        """Per-sample gradients of a parameter read outside its module's call (``tracking/reads.py``)."""
        if self._suspended:
            return
        if self.unit_kind == "tokens":
            raise refused_for_tokens(f"{self.parameter_name(param)} is read outside its module's call")
        self._begin_round()
        grads = self._per_sample_scale(grads, grads.shape[0])
        call = LayerCall(self.parameter_name(param), self.module, {"read": param}, None, None, (), grads)
        self._strategy.add(call, {param: grads})

    def _tag_outputs(self, call: CallBatch, tapped: Sequence[torch.Tensor], tags: Sequence[Any], chained: tuple) -> None:
        """Tag the tapped outputs for the tracker: a batched call's outputs keep the batch;
        an origin call's outputs are where its per-sample gradients will be gathered."""
        tracker = self._tracker
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
        tracker = self._tracker
        layer = self._layers.get(module)
        if tracker is None or layer is None or torch.is_grad_enabled() or not module.training or self._replaying:
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

    def _recall_call(self, layer: _Layer, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> CallBatch:
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
        bags = _bag_offsets(layer.module, tuple(tensors[:2]), {})
        if bags is not None:  # an EmbeddingBag's 1-D input and offsets: one bag (offset) per sample
            return CallBatch("batched", bags.shape[0], (None, 0) + (None,) * (len(tensors) - 2), (0,) * len(outputs))
        dim = self._batch_dim
        first = next((t for t in tensors if t.dim() > dim), None)
        if first is None:
            return CallBatch("single", 1, (None,) * len(tensors), (None,) * len(outputs))
        n = first.shape[dim]
        dims = tuple(dim if t.dim() > dim and t.shape[dim] == n else None for t in tensors)
        return CallBatch("batched", n, dims, tuple(dim if t.dim() > dim and t.shape[dim] == n else None for t in outputs))

    def _not_per_sample(self, layer: _Layer, t: torch.Tensor, n: int, dim: Optional[int]) -> PerSampleGradientError:
        where = f"along dim {dim}" if dim is not None else "along its batch dimension"
        return PerSampleGradientError(
            f"{layer.name} ({type(layer.module).__name__}) produced a tensor of shape {tuple(t.shape)}, which does "
            f"not have the batch's {n} rows {where}: it is shared by, or flattened across, "
            "samples, so per-sample gradients of its parameters are not defined by this call. Freeze its "
            "parameters, give it inputs with one row per sample (check batch_first), or register a grad sampler."
        )

    def _lost_batch(self, layer: _Layer, t: torch.Tensor, lost: Any) -> PerSampleGradientError:
        return PerSampleGradientError(
            f"{layer.name} ({type(layer.module).__name__}) is called on a tensor of shape {tuple(t.shape)} derived from "
            f"the batch in a way that mixes or merges its samples ({lost.reason}), so per-sample gradients of the "
            "layer's parameters are not defined. Keep each sample's rows apart up to the layer (compute the statistic "
            "per sample), or freeze its parameters."
        )

    # ------------------------------------------------------------------ backward side

    def _layer_backward(self, layer: _Layer, params, call: CallBatch, units: Optional[TokenUnits], flat: bool,
                        activations, grad_outputs) -> None:
        if self._suspended:
            return
        if flat:  # the packed tokens flattened with their rows (an MoE block's (B * T, H)): (B, T, H) again
            activations = tuple(a.unflatten(0, units.shape) for a in activations)
            grad_outputs = (grad_outputs[0].unflatten(0, units.shape), *grad_outputs[1:])
        self._begin_round()
        self._enter_round_units(units)
        packed = None
        if id(layer.module) in self._replicated_tensor_parallel:  # whole weights: all tokens, or this rank's
            activations, grad_outputs = self._replicated_tensor_parallel_call(layer, params, call, units, activations,
                                                                              grad_outputs)
        elif self._tensor_parallel_modules:  # each rank's slice: local inputs, local output gradients
            dims = call.input_dims if call.kind == "batched" else (None,) * len(activations)
            linear = isinstance(layer.module, nn.Linear)  # an embedding's ids must be whole
            activations = tuple(local_part(a, None if d is None else d % INNER, linear) for a, d in zip(activations, dims))
            out_dim = call.output_dims[0] if call.kind == "batched" else None
            grad_outputs = tuple(local_part(g, None if out_dim is None else out_dim % INNER) for g in grad_outputs)
            self._note_tensor_parallel_call(layer, params, activations, grad_outputs[0])
        if units is not None and self._packed_affine(layer, activations, grad_outputs[0], units):
            backprops, group, packed = grad_outputs[0], None, units  # kept packed (packed_affine: no (U, L) layout)
            scale = float(units.num_units) if self.loss_reduction == "mean" else 1.0
        elif units is not None:  # one row per token unit, its tokens side by side (the layer is token-wise)
            activations, backprops, group = tuple(units.group(a) for a in activations), units.group(grad_outputs[0]), None
            scale = float(units.num_units) if self.loss_reduction == "mean" else 1.0
        else:
            activations, backprops, group = _batch_first(call, activations, grad_outputs[0], layer.token_wise)
            scale = float(call.n) if self.loss_reduction == "mean" else 1.0
        sampler, norm_sampler = layer.sampler, layer.norm_sampler
        if group:  # the batch merged with an inner dim, into a layer that is not token-wise
            sampler, norm_sampler = _summed_in_groups(sampler, group), None
        if self._canonical:  # FSDP2: the samplers see the gathered parameters; results go to the registered ones
            sampler = self._keyed_by_registered(sampler)
            if norm_sampler is not None:
                norm_sampler = dataclasses.replace(
                    norm_sampler, norms_sq=self._keyed_by_registered(norm_sampler.norms_sq),
                    clipped_sum=self._keyed_by_registered(norm_sampler.clipped_sum),
                    linear_form=self._keyed_by_registered(norm_sampler.linear_form),
                )
        call = LayerCall(layer.name, layer.module, params, sampler, norm_sampler, tuple(activations), backprops, scale, units=packed)
        self._strategy.on_call(call)

    def _replicated_tensor_parallel_call(self, layer: _Layer, params, call: CallBatch, units: Optional[TokenUnits],
                                         activations, grad_outputs):
        """The local inputs and output gradients of a layer whose weights are whole on every rank; under
        ``SequenceParallel`` they hold this rank's tokens, so its per-sample gradients are this rank's part,
        summed over the group at the end of the pass (one answer per parameter and pass)."""
        batched = call.kind == "batched"
        in_dims = call.input_dims if batched else (self._batch_dim,) * len(activations)
        out_dim = call.output_dims[0] if batched else self._batch_dim
        width = max(len(p.shape) for p in params.values())
        try:
            split_in = [token_split_part(a, None if d is None else d % INNER, width) for a, d in zip(activations, in_dims)]
            split_out = [token_split_part(g, None if out_dim is None else out_dim % INNER, width) for g in grad_outputs]
        except ValueError as error:
            raise PerSampleGradientError(f"{layer.name} ({type(layer.module).__name__}): {error}") from None
        splits = {dim for (_, dim), d in zip(split_in, in_dims) if d is not None} | {split_out[0][1]}
        if len(splits) > 1 or (None not in splits and not layer.token_wise):
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}): its weights are replicated over the tensor-parallel "
                f"group, but its input and output gradient are split along dims {sorted(splits, key=str)} (None: whole) "
                "and the layer is not one that acts on each token on its own: its per-sample gradients cannot be "
                "formed from each rank's tokens. Use SequenceParallel on norm layers only"
            )
        split = None not in splits
        if split and units is not None:
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}): privacy units of tokens (packed sequences) and "
                "SequenceParallel, which gives each rank a slice of the tokens, are not supported together"
            )
        for p in params.values():
            if self._token_split.setdefault(p, split) != split:
                raise PerSampleGradientError(
                    f"{layer.name}: one backward pass reached calls of this layer with inputs split along the tokens "
                    "and with whole inputs; its per-sample gradients need one layout per pass"
                )
        return tuple(t for t, _ in split_in), tuple(t for t, _ in split_out)

    def _note_tensor_parallel_call(self, layer: _Layer, params, activations, backprops) -> None:
        """Whether this call of a split layer gives each sample's whole gradient on every rank, or this
        rank's slice (``tensor_parallel.whole_on_every_rank``); one answer per parameter and round."""
        for p in params.values():
            layout = self.tensor_parallel.get(p)
            if layout is None or not layout.sharded:
                continue
            whole = whole_on_every_rank(layer.module, layout, activations, backprops)
            if self._tensor_parallel_whole.setdefault(p, whole) != whole:
                raise PerSampleGradientError(
                    f"{layer.name}: one backward pass reached calls of this split layer with whole and with sliced "
                    "inputs; per-sample gradients of a split weight need one layout per pass"
                )

    def _packed_affine(self, layer: _Layer, activations, backprops: Optional[torch.Tensor], units: TokenUnits) -> bool:
        """A built-in Linear / Conv1D call of a packed forward in bk / ghost mode, on ``(B, T, ...)`` tensors:
        its norms and clipped sums are formed from the packed tokens (``packed_affine``); any other layer,
        mode or layout is regrouped one unit per row."""
        return (
            self.grad_sample_mode in ("bk", "ghost") and not self._canonical
            and affine_layout(layer.norm_sampler) is not None and len(activations) == 1
            and activations[0].is_floating_point() and activations[0].dim() >= 3 and backprops is not None and backprops.dim() >= 3
            and tuple(activations[0].shape[:2]) == tuple(units.shape) == tuple(backprops.shape[:2])
        )

    def _replay_backward(self, layer: _Layer, params, call: CallBatch, call_leaves, call_spec, tensor_positions, out_positions, saved, grad_outputs) -> None:
        if self._suspended:
            return
        if call.kind == "batched" and self._linear_head_backward(layer, None, params, call, call_leaves, call_spec,
                                                                 tensor_positions, out_positions, saved, grad_outputs):
            return
        self._begin_round()
        leaves = _recorded_leaves(call_leaves, tensor_positions, saved)
        n = call.n
        positions, per_sample, out_dims = [], [], []
        for j, (pos, grad) in enumerate(zip(out_positions, grad_outputs)):
            if call.kind == "batched":
                dim = call.output_dims[j]
                if dim is None:  # an output without the batch: refused only if a gradient reached it
                    if grad is not None and bool((grad != 0).any()):
                        raise self._not_per_sample(layer, grad, n, None)
                    continue
                grad = _to_batch_first(grad, dim, n)  # a batch merged with an inner dim: (n, rows, ...)
            elif call.kind == "origin":
                grad = origin_grads(call.origins[j], grad, rows_ok=False)[0]
            else:
                grad, dim = grad.expand(n, *grad.shape), None
            positions.append(pos)
            per_sample.append(self._per_sample_scale(grad, n))
            out_dims.append(dim if call.kind == "batched" else None)
        if not positions:
            grads = {p: p.new_zeros((n, *p.shape)) for p in params.values()}
            self._strategy.add(LayerCall(layer.name, layer.module, params, None, None, (), grad_outputs[0]), grads)
            return
        tensor_dims = call.input_dims if call.kind == "batched" else (None,) * len(tensor_positions)
        with self._replay(), torch.enable_grad():
            grads = functorch_per_sample_grads(
                layer.module, params, leaves, call_spec, positions, per_sample,
                batch_size=n, tensor_dims=tensor_dims, output_dims=out_dims,
            )
        self._strategy.add(LayerCall(layer.name, layer.module, params, None, None, (), per_sample[0]), grads)

    def _token_replay(self, layer: _Layer, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> Callable:
        """The backward of a packed forward's call of a layer with no grad sampler (an MoE router): replayed one
        token at a time by the torch.func fallback, each unit's gradient the sum of its tokens'. Only when the
        token tracker followed the call's own operations and found every input and output (flattened or not)
        keeping each token apart: then each output token depends on its input token and the parameters alone.
        A layer whose one parameter is a weight read once by ``F.linear`` on its input (``linear_head``) is
        sampled as a bias-free linear layer instead, from the gradient at the linear's output."""
        tokens = self._token_tracker
        layouts = [tokens.layout(t) for t in (*inputs, *outputs)]
        if None in layouts:
            raise refused_for_tokens(
                f"{layer.name} ({type(layer.module).__name__}) has no grad sampler, and its inputs or outputs do not "
                "keep each packed token apart (the torch.func fallback replays such a layer one token at a time only "
                "when they all do)")
        return partial(self._token_replay_backward, layer, tokens.units, layouts[: len(inputs)], layouts[len(inputs):])

    def _token_replay_backward(self, layer: _Layer, units: TokenUnits, in_layouts, out_layouts, params, call: CallBatch,
                               call_leaves, call_spec, tensor_positions, out_positions, saved, grad_outputs) -> None:
        if self._suspended:
            return
        if self._linear_head_backward(layer, units, params, call, call_leaves, call_spec, tensor_positions,
                                      out_positions, saved, grad_outputs):
            return
        self._begin_round()
        self._enter_round_units(units)
        one_row_per_token = lambda t, layout: t if layout == "flat" else t.flatten(0, 1).unsqueeze(1)  # noqa: E731
        leaves = _recorded_leaves(call_leaves, tensor_positions,
                                  [one_row_per_token(t, layout) for t, layout in zip(saved, in_layouts)])
        scale = float(units.num_units) if self.loss_reduction == "mean" else 1.0
        kept = [(pos, one_row_per_token(g, layout) * scale)
                for pos, g, layout in zip(out_positions, grad_outputs, out_layouts) if g is not None]
        tokens = units.index.to(saved[0].device if saved else units.index.device)
        with self._replay(), torch.enable_grad():
            per_token = functorch_per_sample_grads(
                layer.module, params, leaves, call_spec, [pos for pos, _ in kept], [g for _, g in kept],
                batch_size=tokens.numel(), tensor_dims=(0,) * len(saved), output_dims=(0,) * len(kept),
            ) if kept else {p: p.new_zeros((tokens.numel(), *p.shape)) for p in params.values()}
        real = tokens >= 0
        grads = {p: g.new_zeros((units.num_units, *g.shape[1:])).index_add_(0, tokens[real], g[real])
                 for p, g in per_token.items()}
        self._strategy.add(LayerCall(layer.name, layer.module, params, None, None, (), next(iter(grads.values()))), grads)

    def _linear_head_backward(self, layer: _Layer, units: Optional[TokenUnits], params, call: CallBatch,
                              call_leaves, call_spec, tensor_positions, out_positions, saved, grad_outputs) -> bool:
        """The call of a layer with no grad sampler as a bias-free linear layer's (``linear_head``), on packed
        tokens (``units``) or on the batch's rows: False where it is not one (functorch mode: never), or where
        its rows are not laid out as the rules below read them."""
        if self.grad_sample_mode == "functorch" or len(params) != 1:
            return False
        if units is None and any(call.output_dims[j] is None for j, g in enumerate(grad_outputs) if g is not None):
            return False  # an output without the batch that got a gradient: the replay refuses it
        grads = [(pos, g) for pos, g in zip(out_positions, grad_outputs) if g is not None]
        with self._replay():
            head = linear_head(layer.module, next(iter(params.values())),
                               _recorded_leaves(call_leaves, tensor_positions, saved), call_spec, grads)
        if head is None:
            return False
        index, x, backprops = head
        if units is not None:
            rows, tokens = units.shape
            flat = x.dim() == 2 and x.shape[0] == rows * tokens
            if not flat and tuple(x.shape[:2]) != (rows, tokens):
                return False
        else:  # a row-major view of an input batched along dim 0: the batch merged with x's rows (k per sample)
            dim, n, flat = call.input_dims[index], call.n, False
            if dim is None or dim % INNER or n < 1 or x.dim() < 2 or x.shape[0] % n:
                return False
            k = x.shape[0] // n
            call = CallBatch("batched", n, (k * INNER if k > 1 else 0,), (k * INNER if k > 1 else 0,))
        norm_sampler = HEAD_NORM_SAMPLER if self.grad_sample_mode in ("bk", "ghost") else None
        head_layer = _Layer(layer.name, layer.module, params, HEAD_SAMPLER, norm_sampler, True)
        self._layer_backward(head_layer, params, call, units, flat, (x,), (backprops,))
        return True

    def _enter_round_units(self, units: Optional[TokenUnits]) -> None:
        """This backward pass's calls all come from forwards with the same privacy units."""
        if self._round_units is not units and (self._round_units is not None or self._strategy.covers()):
            raise PerSampleGradientError(
                "one backward pass reached layer calls of forwards with different privacy units (a packed forward and "
                "another): run the backward of each packed forward before the next forward"
            )
        self._round_units = units

    def _per_sample_scale(self, grad: torch.Tensor, n: int) -> torch.Tensor:
        return grad * n if self.loss_reduction == "mean" else grad

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        param = self._canonical.get(param, param)  # FSDP2: a gathered parameter stands for its shard
        if self._paused and param.requires_grad and param in self._param_names:
            self._paused_gradients[param] = None  # never used by a DP step (DPOptimizer.pre_step)
            return
        if param.requires_grad and param in self._param_names and not self._suspended:
            self._begin_round()
            self._received[param] = None

    def _begin_round(self) -> None:
        if self._in_backward:
            return
        if self._round_done:
            if not self._round_consumed:
                raise PerSampleGradientError(
                    "a second backward pass ran while the per-sample gradients of the previous one were still held. "
                    "Call optimizer.step() or optimizer.zero_grad() (or hooks.clear()) between backward passes; for "
                    "gradient accumulation use the DP optimizer, which clips after every backward pass."
                )
            self.clear()
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_round)

    def _end_round(self) -> None:
        self._in_backward = False
        self._round_done = True
        if self.grad_sample_mode == "ew":
            self._collect_expanded_grad_samples()
        covered = self._strategy.covers()
        received, self._received = list(self._received), {}
        if self._suppressing or self.grad_sample_mode == "ew":  # (expanded weights never write p.grad)
            self._refuse_unseen_paths([p for p in received if p in covered and p not in self._reads.delivered])
        self._reads.delivered.clear()
        missing = [p for p in received if p not in covered] + self._unwatched_parameters_with_grads(covered)
        self.uncaptured = [self.parameter_name(p) for p in missing]
        if missing and (covered or self.module.training):
            self.clear()
            raise PerSampleGradientError(
                f"parameters {_name_list([self.parameter_name(p) for p in missing])} received a gradient but no "
                "per-sample gradient. They were used outside a hooked forward: a forward run before the hooks "
                "attached, a module added after they attached (attach after PEFT/model surgery), a module in eval "
                "mode, or a weight read directly by another module's code (e.g. a fused LM head)."
            )
        summed = []
        partial = self._partial_gradients + [p for p, split in self._token_split.items() if split]
        if partial:  # each rank holds part of these per-sample gradients: the sum is the gradient
            summed = sum_partial_gradients(self._strategy.grads, partial, tensor_parallel_group(self.tensor_parallel))
        self._strategy.finish_round(self._unit_ids if self._round_units is None else None)
        unsummed = self._unsummed_partial_gradients(partial, summed) if partial else []
        if unsummed:  # held in a form the sum cannot reach (a weight shared by several calls): not the gradient
            self.clear()
            raise PerSampleGradientError(
                f"parameters {_name_list([self.parameter_name(p) for p in unsummed])} hold part of each sample's "
                "gradient on every tensor-parallel rank (replicated_with_grad_allreduce, SequenceParallel), but this "
                "backward pass formed them where the parts cannot be summed before their norms; use "
                "grad_sample_mode='hooks'"
            )
        for param, grad in self._strategy.grads.items():
            param.__dict__["grad_sample"] = grad
        if self._listeners:
            for listener in list(self._listeners):
                listener(self)
            self._round_consumed = True
        draw_watch.resume()  # the loop's code until the next forward is the draw's watch's to follow


    def _unsummed_partial_gradients(self, partial: List[nn.Parameter], summed: List[nn.Parameter]) -> List[nn.Parameter]:
        covered, summed_ids = self._strategy.covers(), {id(p) for p in summed}
        return [p for p in partial if p in covered and id(p) not in summed_ids]

    def _collect_expanded_grad_samples(self) -> None:
        """Move the ``grad_sample`` torch wrote on each parameter into the strategy's table."""
        for param in self._param_names:
            grad = param.__dict__.pop("grad_sample", None)
            if grad is None and self.last_batch_size == 0 and self._received.pop(param, False) is None:
                grad = param.new_zeros((0, *param.shape))  # an empty Poisson batch: no sample, no row
            if grad is not None:
                self._strategy.grads[param] = grad

    def _refuse_unseen_paths(self, params: List[nn.Parameter]) -> None:
        """Covered parameters that also got an autograd gradient: a path the controller does not see."""
        if not params:
            return
        self.clear()
        raise PerSampleGradientError(
            f"parameters {_name_list([self.parameter_name(p) for p in params])} got gradient by a path outside "
            "their own module's call: the weight is read directly elsewhere (a tied head computed as "
            "h @ emb.weight.T, a penalty on the weight added to the loss, another module's code using it). That "
            "gradient has no per-sample counterpart, so it cannot be clipped. Call the module instead (e.g. "
            "nn.Linear with the tied weight as lm_head), or apply weight decay in the optimizer, not in the loss."
        )

    def _unwatched_parameters_with_grads(self, covered: set) -> List[nn.Parameter]:
        """Parameters without our hook (added, or unfrozen and never called through a module since)
        whose gradient changed since last seen."""
        changed = []
        watched = self._watched
        for param in _all_parameters(self.module):
            if id(param) in watched or not param.requires_grad or param.grad is None:
                continue
            version = (id(param.grad), param.grad._version)
            if self._unhooked_grad_versions.get(param) != version and param not in covered:
                changed.append(param)
            self._unhooked_grad_versions[param] = version
        return changed


def _all_parameters(module: nn.Module) -> List[nn.Parameter]:
    """Every parameter of ``module`` and its submodules, each once: ``module.parameters()`` without its
    names, generators and hashing of tensors (run after every backward pass)."""
    params: List[nn.Parameter] = []
    seen_params, seen_modules, stack = set(), set(), [module]
    while stack:
        sub = stack.pop()
        if sub is None or sub in seen_modules:
            continue
        seen_modules.add(sub)
        for param in sub._parameters.values():
            if param is not None and id(param) not in seen_params:
                seen_params.add(id(param))
                params.append(param)
        stack.extend(reversed(sub._modules.values()))  # named_parameters' order
    return params


def _name_list(names: List[str], shown: int = 5) -> str:
    """``a, b, c and 4 more``: a list cut with its count, never silently."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _drawn_rows(tags: List[Any], dim: int, n: int) -> Tuple[bool, Optional[torch.Tensor]]:
    """Whether the root arguments the draw's watch saw derived from the batch are each ``n`` of its rows
    along ``dim`` (the whole draw, or a micro-batch cut from it), the same rows in the same order: then
    they form this forward's batch; and those rows of the draw (None: the whole draw, in its order)."""
    orders = []
    for tag in tags:
        if type(tag) is int and tag & ~WEAK == dim:
            orders.append(None)
        elif type(tag) is Lost and tag.kind in ORDERED and tag.dim == dim and tag.order is not None:
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


_NOT_THE_MODEL = (
    "the GradSampleHooks controller was {what}, but it is not the model: make_private(..., wrap_model=False) "
    "returns the controller as its first item, as Opacus 1.6 does, and your {model} stays in your own variable, "
    "untouched. Write `hooks, optimizer, data_loader = engine.make_private(module=model, ..., wrap_model=False)`, "
    "train `model` itself, and call `hooks.cleanup()` at the end (the model is also `hooks.module`)"
)


def is_attached(module: nn.Module) -> bool:
    """Whether a controller is attached to ``module`` (as its root)."""
    return module in _ATTACHED


def _bag_offsets(module: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The offsets of an ``nn.EmbeddingBag`` called as the root with 1-D input and offsets: its batch, one bag per
    sample; None for any other call (``include_last_offset`` too: its batch is then not told here)."""
    if not isinstance(module, nn.EmbeddingBag) or module.include_last_offset:
        return None
    given = args[0] if args else kwargs.get("input")
    offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    if not (isinstance(given, torch.Tensor) and given.dim() == 1 and isinstance(offsets, torch.Tensor) and offsets.dim() == 1):
        return None
    return offsets


def _recorded_leaves(call_leaves: Sequence[Any], tensor_positions: Sequence[int], tensors: Sequence[torch.Tensor]) -> list:
    """A recorded call's flattened arguments with its tensors (at ``tensor_positions``) replaced by ``tensors``."""
    leaves = list(call_leaves)
    for i, t in zip(tensor_positions, tensors):
        leaves[i] = t
    return leaves


def _infer_batch_size(args: tuple, kwargs: dict, batch_dim: int) -> Optional[int]:
    """The batch size of a root call (see ``_primary_input``)."""
    value = _primary_input(args, kwargs, batch_dim)
    if isinstance(value, PackedSequence):
        return int(value.batch_sizes[0]) if len(value.batch_sizes) else 0
    return None if value is None else value.shape[batch_dim]


def _tensor_leaves(tree: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _tensor_arguments(module: nn.Module, args: tuple, kwargs: dict) -> Tuple[torch.Tensor, ...]:
    """The tensor arguments of a call, in the order of the module's ``forward`` signature."""
    if kwargs:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        values: Sequence[Any] = list(bound.arguments.values())
    else:
        values = args
    return tuple(v for v in values if isinstance(v, torch.Tensor))


_AMBIGUOUS: Any = object()  # a layer call signature seen with different decisions


def _has_rows(t: torch.Tensor, dim: int, n: int) -> bool:
    """Whether ``t`` has the batch's rows along ``dim`` (``n * inner`` when merged)."""
    d, inner = dim % INNER, dim // INNER
    return t.dim() > d and t.shape[d] == n * max(inner, 1)


_TOKEN_WISE = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def _keeps_batch_dim(before: torch.Tensor, after: torch.Tensor, tag: Any) -> bool:
    """Whether ``after``, what a tensor-parallel hook made of ``before`` (wrapped in a DTensor, gathered or
    scattered along the tokens or features, unwrapped), keeps ``before``'s batch tag: a batch dim (an int
    tag) whole in both, of one size; a lost batch always; an origin's output only at the very same shape."""
    if type(tag) is Lost:
        return True
    if type(tag) is not int:
        return local_shape(after) == local_shape(before)
    dim = tag & DIM
    if before.dim() != after.dim() or dim >= before.dim():
        return False
    return len({before.shape[dim], local_shape(before)[dim], after.shape[dim], local_shape(after)[dim]}) == 1


def _token_wise(module: nn.Module, norm_sampler: Optional[NormSampler]) -> bool:
    """Whether the layer acts on each position of ``(B, *middle, F)`` on its own (so a sample's rows
    can stand side by side in the middle dims): its norm sampler says so (looked up in every mode),
    or it is a built-in token-wise layer."""
    if norm_sampler is not None:
        return norm_sampler.token_wise
    name = type(module).__name__
    return isinstance(module, _TOKEN_WISE) or name == "Conv1D" or name.endswith("RMSNorm") or name == "T5LayerNorm"


def _summed_in_groups(sampler: Any, group: int) -> Any:
    """A grad sampler run on rows that are ``group`` consecutive rows per sample: sums each sample's."""

    def summed(module: nn.Module, activations: Tuple[torch.Tensor, ...], backprops: torch.Tensor):
        grads = sampler(module, activations, backprops)
        if not isinstance(grads, dict):  # the strategy says what a grad sampler must return
            return grads
        return {p: g.unflatten(0, (g.shape[0] // group, group)).sum(1) for p, g in grads.items()}

    return summed


def _to_batch_first(t: torch.Tensor, dim: Optional[int], n: int, split: bool = True) -> torch.Tensor:
    """``t`` with its batch (along ``dim``, merged with an inner dim when ``dim >= INNER``) along dim 0;
    a merged batch is split into ``(n, inner)`` unless ``split`` is False."""
    if not dim:
        return t
    d, inner = dim % INNER, dim // INNER
    if inner and split:
        t = t.unflatten(d, (n, inner))
    return t.movedim(d, 0) if d else t


def _batch_first(call: CallBatch, activations: Sequence[torch.Tensor], grad: torch.Tensor, token_wise: bool = True):
    """A captured call's inputs and output gradient with one row per sample along dim 0, and the
    number of consecutive rows per sample when they stay merged (None: one row per sample).

    A batch merged with an inner dim of ``k`` rows is split into ``(n, k)`` for token-wise layers;
    other layers see the ``n * k`` rows as they computed them, and their rows' gradients are summed
    per sample.
    """
    n = call.n
    if call.kind == "batched":
        inners = {d // INNER for d in (*call.input_dims, call.output_dims[0]) if d is not None}
        split = token_wise or inners <= {0}
        if not split and len(inners) > 1:
            raise PerSampleGradientError(
                "a layer's inputs and output carry the batch merged with other dims in different ways; per-sample "
                "gradients need each sample's rows grouped alike"
            )
        activations = tuple(_to_batch_first(a, d, n, split) for a, d in zip(activations, call.input_dims))
        return activations, _to_batch_first(grad, call.output_dims[0], n, split), None if split else inners.pop()
    if call.kind == "origin":
        # Each sample's gradient of the shared output, gathered where it met the batch. When every
        # use paired the output's rows with the samples (e.g. token_type_ids expanded from a buffer),
        # the inputs' rows pair with them too (a sampler's layer works row by row).
        grad, dim = origin_grads(call.origins[0], grad, rows_ok=True)
        if dim is not None and all(a.dim() > dim and a.shape[dim] == n for a in activations):
            return tuple(a.movedim(dim, 0) for a in activations), grad.movedim(dim, 0), None
        if dim is not None:
            grad = rows_to_dense(grad, dim, n)
    else:  # at most one sample: the whole call is its
        grad = grad.expand(n, *grad.shape)
    return tuple(a.expand(n, *a.shape) for a in activations), grad, None

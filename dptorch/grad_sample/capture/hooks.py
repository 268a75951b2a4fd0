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

The controller coordinates; each part of the work is a collaborator's, with its own side tables:
``attachment.py`` (the hooks, the hooked layers, the claim on the parameters, the compatibility
check), ``session.py`` (the root forward's tracking of the batch, the tokens and the loss),
``calls.py`` (the capture of each layer call), ``backward.py`` and ``replays.py`` (what a captured
call's backward hands the strategy), ``rounds.py`` (the backward round and its results),
``sharding.py`` and ``wrapper_tags.py`` (FSDP2 and tensor parallelism), ``settings.py`` (the
options, and whether capture is on).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from dptorch.grad_sample.capture.attachment import Attachment, is_attached
from dptorch.grad_sample.capture.backward import CallBackward
from dptorch.grad_sample.capture.calls import LayerCalls
from dptorch.grad_sample.capture.model_loss import ModelLoss
from dptorch.grad_sample.capture.replays import Replays
from dptorch.grad_sample.capture.rounds import Rounds
from dptorch.grad_sample.capture.session import RootForward
from dptorch.grad_sample.capture.settings import Settings, Switches
from dptorch.grad_sample.capture.sharding import Sharding
from dptorch.grad_sample.capture.wrapper_tags import WrapperTags
from dptorch.grad_sample.layers import reads_no_parameter_data
from dptorch.grad_sample.modes.names import GRAD_SAMPLE_MODES, LOSS_REDUCTIONS
from dptorch.grad_sample.units.token_units import TokenUnits


class _Delegated:
    """An attribute of the controller that one of its collaborators keeps: ``_Delegated("_session")`` reads
    and writes ``hooks._session.<the attribute's name>``, ``_Delegated("_session", "tracker")`` names it."""

    def __init__(self, holder: str, name: Optional[str] = None) -> None:
        self.holder, self.name = holder, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, hooks: Any, owner: Optional[type] = None) -> Any:
        return self if hooks is None else getattr(getattr(hooks, self.holder), self.name)

    def __set__(self, hooks: Any, value: Any) -> None:
        setattr(getattr(hooks, self.holder), self.name, value)


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
        if is_attached(module):
            raise RuntimeError(
                f"{type(module).__name__} already has GradSampleHooks attached; call cleanup() on them "
                "(or PrivacyEngine.detach()) before attaching again"
            )
        self.module = module
        self.batch_first = batch_first
        # Whether autograd still fills p.grad for layers whose per-sample results we compute
        # ourselves. The DP optimizer overwrites p.grad, so it turns this off (and then any
        # autograd gradient reaching a parameter reveals a path we do not see); book-keeping and
        # ghost default to off.
        keep_param_grads = grad_sample_mode not in ("bk", "ghost") if keep_param_grads is None else keep_param_grads
        self._settings = settings = Settings(batch_first, loss_reduction, grad_sample_mode, keep_param_grads)
        self._switches = switches = Switches()
        self._sharding = sharding = Sharding(module, settings)  # refuses replicated layers no grad sampler covers
        self.tensor_parallel = sharding.tensor_parallel
        self._attachment = attachment = Attachment(module, settings)
        attachment.check_compatible(strict)
        self._rounds = rounds = Rounds(self, settings, switches, attachment, sharding)
        self._session = session = RootForward(module, settings, switches, sharding, rounds)
        backward = CallBackward(settings, switches, sharding, rounds)
        replays = Replays(settings, switches, rounds, backward)
        tags = WrapperTags(session)
        calls = LayerCalls(settings, switches, attachment, sharding, session, backward, replays, tags, rounds.reads)
        attachment.attach(self, session, calls, tags, sharding.tensor_parallel_modules, rounds.on_grad_accumulated)
        self._model_loss: Optional[ModelLoss] = None

    # the options, kept where the collaborators read them (the DP optimizer turns keep_param_grads off)
    loss_reduction = _Delegated("_settings")
    grad_sample_mode = _Delegated("_settings")
    keep_param_grads = _Delegated("_settings")
    last_batch_size = _Delegated("_session")  # of the last root forward
    whole_draw = _Delegated("_session")  # the training forwards since the last backward ran on the whole latest draw
    uncaptured = _Delegated("_rounds")  # parameters the last backward gave gradients but no capture

    # ------------------------------------------------------------------ attach / detach

    def cleanup(self) -> None:
        """Remove every hook and attribute this controller added; the model is as before."""
        if not self._attachment.attached:
            return
        self._session.drop_loss_tracker()
        self.clear()
        self._rounds.reads.remove()
        self.use_model_loss(None)
        self._attachment.detach(self)
        self._rounds.listeners.clear()
        self._sharding.canonical.clear()

    #: Opacus' name for :meth:`cleanup`.
    remove_hooks = cleanup

    def use_model_loss(self, per_unit: Optional[str]) -> None:
        """Make the model's own ``outputs.loss`` per-sample, each unit's token ``"mean"`` or ``"sum"``
        (``make_private(model_loss=)``, ``capture/model_loss.py``); ``None`` leaves it as the model computes it."""
        if self._model_loss is not None:
            self._model_loss.remove()
        self._model_loss = None if per_unit is None else ModelLoss(self.module, self._settings, per_unit)

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
        return self._attachment.attached

    @property
    def _module(self) -> nn.Module:
        """Opacus' name for :attr:`module`, the model the controller is attached to (read-only)."""
        return self.module

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

    @property
    def grad_samples(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Instantiated per-sample gradients of the last backward round, by parameter (a copy)."""
        return dict(self._rounds.strategy.grads)

    def per_sample_norms(self) -> Dict[nn.Parameter, torch.Tensor]:
        """Each parameter's per-sample (per-unit) gradient norm, float32, for the held round."""
        self._session.drop_loss_tracker(finished_only=True)
        return self._rounds.strategy.per_sample_norms()

    def clipped_sums(self, clip_factors: Dict[nn.Parameter, torch.Tensor], dropped: Optional[torch.Tensor] = None) -> Dict[nn.Parameter, torch.Tensor]:
        """``sum_i c_i * g_i`` (float32) for each parameter that ``clip_factors`` names; the units in the bool
        mask ``dropped`` (non-finite gradients) contribute exactly 0, whatever their rows hold."""
        return self._sharding.local_sums(self._rounds.strategy.clipped_sums(clip_factors, dropped))

    #: Whether a layer's samplers read no parameter data (only shapes): exact while ZeRO-3 has them released.
    reads_no_parameter_data = staticmethod(reads_no_parameter_data)

    @property
    def tensor_parallel_whole(self) -> set:
        """The split parameters whose per-sample gradients this round formed whole on every rank."""
        return self._sharding.whole_params

    @property
    def batch_size(self) -> int:
        """Samples (units) in the held round (0 when nothing is held)."""
        return self._rounds.strategy.batch_size()

    # ------------------------------------------------------------------ pausing (Opacus' names)

    @property
    def hooks_enabled(self) -> bool:
        """Whether forwards and backwards are captured (Opacus' name); ``disable_hooks()`` pauses."""
        return self._attachment.attached and not self._switches.paused

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
        if self._session.depth or self._rounds.in_backward or torch._C._current_graph_task_id() != -1:
            raise RuntimeError("disable_hooks() / enable_hooks() inside a forward or backward pass: pause or resume "
                               "between passes, so that every pass is captured whole or not at all")
        self._switches.paused = paused

    @property
    def paused_gradients(self) -> List[nn.Parameter]:
        """Parameters paused backward passes gave gradients since :meth:`forget_paused_gradients`."""
        return list(self._switches.paused_gradients)

    def forget_paused_gradients(self) -> None:
        """The paused passes' gradients are gone (the DP optimizer's ``zero_grad()`` or step)."""
        self._switches.paused_gradients = {}

    def parameter_name(self, param: nn.Parameter) -> str:
        names = self._attachment.param_names
        if param in names:
            return names[param]
        return next((n for n, p in self.module.named_parameters() if p is param), "<parameter not in model>")

    def add_backward_listener(self, listener: Callable[["GradSampleHooks"], None]) -> Callable[[], None]:
        """Call ``listener(self)`` at the end of every backward round; returns a remover.

        A listener consumes the round: the next backward pass then starts a fresh one.
        """
        listeners = self._rounds.listeners
        listeners.append(listener)
        return lambda: listeners.remove(listener) if listener in listeners else None

    @contextlib.contextmanager
    def listeners_aside(self) -> Iterator[None]:
        """Backward rounds inside reach no listener: their results stay held for the caller to read (a captured
        step's trace, ``dptorch.optim.captured_step``, forms the clipped sums itself)."""
        listeners = self._rounds.listeners
        held, listeners[:] = list(listeners), []
        try:
            yield
        finally:
            listeners[:] = held

    @property
    def privacy_units_set(self) -> bool:
        """Whether ``set_privacy_units`` grouped rows, or named token units for the next forward."""
        return self._rounds.unit_ids is not None or self._session.token_units is not None

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
            self._session.token_units, self._rounds.unit_ids = TokenUnits(unit_ids), None
            return
        self._session.token_units = None
        self._rounds.unit_ids = None if unit_ids is None else torch.as_tensor(unit_ids).flatten()

    @property
    def unit_kind(self) -> str:
        """What a privacy unit is in the current forward: "rows", "grouped" rows or "tokens"."""
        return self._session.unit_kind

    def separable_units(self, t: torch.Tensor) -> Optional[TokenUnits]:
        """The token units of the last packed forward if ``t`` is one of its outputs that kept them apart."""
        return self._session.separable_units(t)

    def clear(self, keep_grad_samples: bool = False) -> None:
        """Forget the held per-sample gradients (and remove ``p.grad_sample``). With
        ``keep_grad_samples`` (the DP optimizer's step), ``p.grad_sample`` stays readable, as in Opacus,
        until the next training forward or ``clear()``, so it never adds to a forward's memory."""
        self._session.drop_loss_tracker(finished_only=True)
        self._rounds.reset(keep_grad_samples)
        self._sharding.new_round()

    def discard_failed_pass(self) -> bool:
        """After a training forward or backward raised (an out-of-memory error, say): forget what the pass captured,
        so that the next pass starts a clean round, and return True. False, with nothing reset, when the error came
        from the end-of-round listeners (a DP optimizer's clipping): part of the pass may have been accumulated, so
        it must not run again."""
        if not self._rounds.abandon():
            return False
        self.clear()
        return True

    # ------------------------------------------------------------------ read by other modules

    _layers = _Delegated("_attachment", "layers")  # distributed/deepspeed_zero3.py checks their samplers
    _tracker = _Delegated("_session", "tracker")  # ZeRO-3's markers carry its tags (and the token tracker's)
    _token_tracker = _Delegated("_session", "token_tracker")
    _loss_tracker = _Delegated("_session", "loss_tracker")  # packed_loss tags its total
    _unit_ids = _Delegated("_rounds", "unit_ids")  # the DP optimizer counts units, not rows, with them


_NOT_THE_MODEL = (
    "the GradSampleHooks controller was {what}, but it is not the model: make_private(..., wrap_model=False) "
    "returns the controller as its first item, as Opacus 1.6 does, and your {model} stays in your own variable, "
    "untouched. Write `hooks, optimizer, data_loader = engine.make_private(module=model, ..., wrap_model=False)`, "
    "train `model` itself, and call `hooks.cleanup()` at the end (the model is also `hooks.module`)"
)

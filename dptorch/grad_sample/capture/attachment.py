"""Attach and detach: the controller's hooks on the user's model and its parameters, the table of hooked
layers, its claim on the parameters, and the check that the model can be trained with per-sample gradients.

Everything lives in these side tables; ``detach`` removes every hook and restores what it replaced.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

from dptorch.data import drawn
from dptorch.distributed.ddp import keep_out_of_gradient_sync
from dptorch.distributed.fsdp import is_fully_sharded_module
from dptorch.distributed.tensor_parallel import torch_style_hooks
from dptorch.grad_sample.capture import claims
from dptorch.grad_sample.capture.settings import Settings
from dptorch.grad_sample.errors import UnsupportedModuleError
from dptorch.grad_sample.layers.checks import incompatibilities
from dptorch.grad_sample.layers.registry import GradSampler, NormSampler, find_grad_sampler, find_norm_sampler
from dptorch.grad_sample.modes import expanded_weights
from dptorch.grad_sample.tracking import watch as draw_watch
from dptorch.grad_sample.tracking.compiled import eager_when_followed, outside_dynamo
from dptorch.grad_sample.tracking.unseen import follow as follow_unseen

_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()  # root -> its controller
drawn.watch(lambda tensors: draw_watch.start(tensors, active=lambda: bool(_ATTACHED)))
drawn.on_let_go(draw_watch.let_go)


def is_attached(module: nn.Module) -> bool:
    """Whether a controller is attached to ``module`` (as its root)."""
    return module in _ATTACHED


class HookTarget:
    """A collaborator whose methods the model's hooks call: a deep copy of the model (a reference model,
    ModuleValidator.fix) carries the hooks, which must keep pointing here, where they ignore modules and
    parameters they don't own."""

    def __deepcopy__(self, memo: dict) -> "HookTarget":
        return self


@dataclass
class HookedLayer:
    """A hooked module: its path, direct parameters and how to compute their per-sample grads."""

    name: str
    module: nn.Module
    params: Dict[str, nn.Parameter]
    sampler: Optional[GradSampler]  # None: torch.func fallback
    norm_sampler: Optional[NormSampler] = None  # ghost / book-keeping modes only
    token_wise: bool = False  # acts on each position on its own (``_token_wise``), whatever the mode


class Attachment:
    """The controller's hooks on ``module``: their handles, the hooked layers and parameter names, the
    post-accumulate-grad hooks that notice gradients arriving at parameters, and the claim on them."""

    def __init__(self, module: nn.Module, settings: Settings) -> None:
        self.module = module
        self._settings = settings
        self._handles: List[Any] = []
        self._restore_param_hooks: List[Tuple[nn.Parameter, Any]] = []
        self._watched: Dict[int, nn.Parameter] = {}  # parameters with our post-accumulate-grad hook, by id
        self.layers: Dict[nn.Module, HookedLayer] = {}
        self.param_names: Dict[nn.Parameter, str] = {}
        self._unhooked_grad_versions: Dict[nn.Parameter, Tuple[int, int]] = {}
        self._on_grad_accumulated: Optional[Callable[[nn.Parameter], None]] = None
        self.attached = False

    def check_compatible(self, strict: bool) -> None:
        """Refuse (``strict``) or warn about a model that cannot be trained with per-sample gradients
        (called by the controller's ``__init__``: the warning points at its caller)."""
        if self._settings.grad_sample_mode == "ew":
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

    def attach(self, owner: Any, session: Any, calls: Any, tags: Any, tensor_parallel_modules: List[nn.Module],
               on_grad_accumulated: Callable[[nn.Parameter], None]) -> None:
        """Hook the root call (``session``, the root forward's), every module that owns parameters (``calls``,
        the layer calls' capture), every parameter (``on_grad_accumulated``) and the sharding wrappers
        (``tags``, their batch tags); register ``owner``, the controller, as the model's and its parameters'."""
        mode = self._settings.grad_sample_mode
        followed = (lambda: session.depth == 1  # a training forward, or one run while a DP loader's draw is watched
                    and (session.tracker is not None or draw_watch.following()))
        self._handles.append(self.module.register_forward_pre_hook(eager_when_followed(session.on_root_forward, followed),
                                                                   with_kwargs=True))  # first: Dynamo off from here
        self._hook(self.module, session.on_root_forward_end, always_call=True)
        self._hook(self.module, session.tap_root_outputs)
        for name, param in self.module.named_parameters(remove_duplicate=True):
            self.param_names[param] = name
        tensor_parallel = {id(m) for m in tensor_parallel_modules}
        for name, sub in self.module.named_modules():
            params = dict(sub.named_parameters(recurse=False))
            if not params:
                continue
            sampler = None if mode == "functorch" else find_grad_sampler(sub)
            norm_sampler = find_norm_sampler(sub) if sampler and mode in ("bk", "ghost") else None
            self.layers[sub] = HookedLayer(name or type(sub).__name__, sub, params, sampler, norm_sampler,
                                           _token_wise(sub, norm_sampler or (find_norm_sampler(sub) if sampler else None)))
            self._hook(sub, calls.before_layer_forward, pre=True)
            if mode == "ew":
                self._hook(sub, calls.check_expanded_batch, pre=True, with_kwargs=True)
                continue
            if id(sub) in tensor_parallel:  # the output before tensor parallelism's output hook redistributes it
                self._hook(sub, calls.on_tensor_parallel_layer_forward, with_kwargs=True, always_call=True, prepend=True)
                continue
            self._hook(sub, calls.on_layer_forward, with_kwargs=True, always_call=True)
        self._on_grad_accumulated = on_grad_accumulated
        for param in self.param_names:
            self.watch(param)
        self._attach_wrapper_tags(tags, tensor_parallel)
        if self._under_ddp:  # the DP optimizer reduces the clipped sums; DDP must not expect raw gradients
            self._handles.append(keep_out_of_gradient_sync(self.module, when=lambda: self._settings.suppressing))
        _ATTACHED[self.module] = owner
        claims.claim(owner, list(self.param_names))  # a DPOptimizer built without hooks= finds us by parameter
        self.attached = True
        self._attach_leaf_layers(calls)

    def _hook(self, module: nn.Module, hook: Callable, pre: bool = False, **options: Any) -> None:
        """Register a forward (``pre``: pre-) hook of the controller on ``module``, run outside Dynamo: under
        torch.compile it breaks the graph and runs as in an eager forward (``tracking/compiled.py``)."""
        register = module.register_forward_pre_hook if pre else module.register_forward_hook
        self._handles.append(register(outside_dynamo(hook), **options))

    def _attach_wrapper_tags(self, tags: Any, tensor_parallel: set) -> None:
        """FSDP2's forward pre-hook replaces a sharded module's inputs that require grad by aliases
        (its post-backward Function), and torch's tensor-parallel styles replace a module's inputs and
        outputs by DTensors wrapping them, redistributed or unwrapped, which the batch tracker never saw
        being made: hooks around them hand each input's (and the output's) batch tag to its replacement."""
        for sub in self.module.modules():
            layer = id(sub) in tensor_parallel
            if is_fully_sharded_module(sub) or layer or torch_style_hooks(sub, outputs=False):
                self._hook(sub, tags.note_inputs, pre=True, prepend=True, with_kwargs=True)
                self._hook(sub, tags.tag_inputs, pre=True, with_kwargs=True)
            if layer or torch_style_hooks(sub, outputs=True):
                if not (layer and sub in self.layers):  # (a tensor-parallel layer's capture notes its output)
                    self._hook(sub, tags.note_output, prepend=True)
                self._hook(sub, tags.tag_output)

    def _attach_leaf_layers(self, calls: Any) -> None:
        """Inside a capturing call of a layer with a grad sampler and no hooked module below it, the
        layer's own operations need not be followed: its output is batched where its input is (a
        sampler's layer works row by row; an expert bank's parameterless activation is part of it).
        The tracker steps aside for the call (a pre-hook that runs before the others)."""
        if self._settings.grad_sample_mode == "ew":
            return
        for module, layer in self.layers.items():
            if layer.sampler is not None and not any(m in self.layers for m in module.modules() if m is not module):
                self._hook(module, calls.enter_leaf_layer, pre=True, prepend=True)

    def watch(self, param: nn.Parameter) -> None:
        """Register the post-accumulate-grad hook that notices gradients arriving at ``param``."""
        if id(param) in self._watched or not param.requires_grad:
            return
        self._watched[id(param)] = param
        self._restore_param_hooks.append((param, param._post_accumulate_grad_hooks))
        self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))

    def detach(self, owner: Any) -> None:
        """Remove every hook, restore the parameters' hook tables and give up ``owner``'s claims."""
        for handle in self._handles:
            handle.remove()
        for param, previous in self._restore_param_hooks:
            param._post_accumulate_grad_hooks = previous
        self._handles.clear()
        self._restore_param_hooks.clear()
        self._watched.clear()
        self.layers.clear()
        claims.release(owner, list(self.param_names))
        _ATTACHED.pop(self.module, None)
        draw_watch.stop()  # the draw it watched was for this controller, or another one's: that one falls back
        follow_unseen()  # the guard of operations run with torch functions off leaves with the last tracker
        self.attached = False

    def owners(self) -> Dict[int, List[nn.Module]]:
        """id(parameter) -> the hooked modules holding it directly."""
        owners: Dict[int, List[nn.Module]] = {}
        for module, layer in self.layers.items():
            for param in layer.params.values():
                owners.setdefault(id(param), []).append(module)
        return owners

    def unwatched_parameters_with_grads(self, covered: set) -> List[nn.Parameter]:
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


_TOKEN_WISE = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)


def _token_wise(module: nn.Module, norm_sampler: Optional[NormSampler]) -> bool:
    """Whether the layer acts on each position of ``(B, *middle, F)`` on its own (so a sample's rows
    can stand side by side in the middle dims): its norm sampler says so (looked up in every mode),
    or it is a built-in token-wise layer."""
    if norm_sampler is not None:
        return norm_sampler.token_wise
    name = type(module).__name__
    return isinstance(module, _TOKEN_WISE) or name == "Conv1D" or name.endswith("RMSNorm") or name == "T5LayerNorm"

"""Registries that map module types to per-sample gradient functions, and the trust placed in them.

A grad sampler is a pure function ``(module, activations, backprops) -> {param: grad_sample}``:
``activations`` is the tuple of tensor inputs of one call of ``module`` (batch first),
``backprops`` the gradient of the loss with respect to that call's output (batch first,
already scaled so that row ``i`` is the gradient of sample ``i``'s loss). It returns, for each
direct parameter of ``module`` that requires grad, a tensor of shape ``(batch, *param.shape)``.

Lookup order: exact type, then along the type's MRO, then duck-typed rules (predicates over the
module instance, such as the HF RMSNorm family). Registration may happen at any time before a
controller attaches. The registry imports no layer: the built-in layer families
(``dptorch.grad_sample.layers``) register themselves when the package ``dptorch.grad_sample`` loads.

A sampler knows its layer's forward, not a subclass's: a subclass that overrides ``forward`` (a
scaled or masked ``nn.Linear``) may compute anything from the same parameters. Such a class gets
the inherited sampler (and norm sampler) only after it reproduces ``torch.func`` on a probe
input (once per class, with the probe registered for the base type: ``register_grad_sampler(...,
probe=)``); otherwise none, and the controller uses the exact torch.func fallback. A subclass
that keeps the parent's ``forward`` inherits the sampler unchecked, and a sampler registered for
the exact type is always trusted. Duck rules may carry the same check (``verify=``).
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn

from dptorch.grad_sample.norms.linear_forms import form_inner_products

GradSampler = Callable[[nn.Module, Tuple[torch.Tensor, ...], torch.Tensor], Dict[nn.Parameter, torch.Tensor]]
ModulePredicate = Callable[[nn.Module], bool]
#: ``probe(module, generator) -> inputs``: a batch of 2 example inputs (CPU tensors) for one call of ``module``.
Probe = Callable[[nn.Module, torch.Generator], Tuple[torch.Tensor, ...]]

_GRAD_SAMPLERS: Dict[Type[nn.Module], GradSampler] = {}
_PROBES: Dict[Type[nn.Module], Probe] = {}
_DUCK_RULES: List[Tuple[ModulePredicate, GradSampler, Optional[ModulePredicate]]] = []
# Verdicts of the numerical checks, per module instance: an instance's attributes (a scale, a
# mask) can change what its forward computes, so one instance never vouches for another.
_VERIFIED: "weakref.WeakKeyDictionary[nn.Module, Dict[Any, bool]]" = weakref.WeakKeyDictionary()


def register_grad_sampler(*module_types: Type[nn.Module], probe: Optional[Probe] = None):
    """Decorator registering a grad sampler for one or more module types.

    ``probe(module, generator)``, if given, returns example inputs (batch of 2, on the CPU) for a
    module of these types; with it, subclasses that override ``forward`` can be checked against
    ``torch.func`` and keep the sampler when they match (without it they fall back to torch.func).
    A single list or tuple of types is accepted too (Opacus' ``register_grad_sampler([A, B])``).
    """
    if len(module_types) == 1 and isinstance(module_types[0], (list, tuple)):
        module_types = tuple(module_types[0])
    if not module_types:
        raise TypeError("register_grad_sampler needs at least one module type")

    def decorator(fn: GradSampler) -> GradSampler:
        for module_type in module_types:
            _GRAD_SAMPLERS[module_type] = fn
            if probe is not None:
                _PROBES[module_type] = probe
        return fn

    return decorator


def register_duck_grad_sampler(predicate: ModulePredicate, *, verify: Optional[ModulePredicate] = None):
    """Decorator registering a grad sampler for every module for which ``predicate`` is true.

    Duck rules are consulted only when no registered type matches, in registration order.
    ``verify(module)``, if given, checks the sampler numerically on one instance of each class;
    a class that fails it gets no sampler from this rule (the torch.func fallback then applies).
    """

    def decorator(fn: GradSampler) -> GradSampler:
        _DUCK_RULES.append((predicate, fn, verify))
        return fn

    return decorator


def find_grad_sampler(module: nn.Module) -> Optional[GradSampler]:
    """The sampler for ``module``: exact type, then MRO (checked if ``forward`` is overridden),
    then duck rules; None if none (the torch.func fallback)."""
    found = _registered_base(_GRAD_SAMPLERS, module)
    if found is not None:
        base, sampler = found
        return sampler if _trusted_for(module, base, sampler) else None
    for predicate, sampler, verify in _DUCK_RULES:
        if predicate(module) and _verified(module, sampler, verify):
            return sampler
    return None


def _registered_base(table: Dict[Type[nn.Module], Any], module: nn.Module) -> Optional[Tuple[Type[nn.Module], Any]]:
    """``(class, entry)`` for the module's type or its nearest registered base class, else None."""
    for cls in type(module).__mro__:
        if cls in table:
            return cls, table[cls]
        if cls is nn.Module:
            break
    return None


def overrides_forward(cls: Type[nn.Module], base: Type[nn.Module]) -> bool:
    """Whether ``cls`` (a subclass of ``base``) or a class between them defines its own forward."""
    for klass in cls.__mro__:
        if klass is base:
            return False
        if "forward" in vars(klass) or "__call__" in vars(klass):
            return True
    return False


def registered_probe(cls: Type[nn.Module]) -> Optional[Probe]:
    """The probe registered for ``cls`` (built-in layers register one), else None."""
    return _PROBES.get(cls)


def _trusted_for(module: nn.Module, base: Type[nn.Module], entry: Any, norm: bool = False) -> bool:
    """An entry registered for ``base`` holds for ``module`` unless its class changed ``forward``
    since ``base`` and does not reproduce torch.func on ``base``'s probe (checked per instance)."""
    cls = type(module)
    if cls is base or not overrides_forward(cls, base):
        return True

    def check() -> bool:
        probe = _PROBES.get(base)
        return probe is not None and (
            matches_torch_func(module, probe, norm_sampler=entry) if norm else matches_torch_func(module, probe, sampler=entry)
        )

    return _verdict(module, (base, entry), check)


def _verified(module: nn.Module, fn: Any, verify: Optional[ModulePredicate]) -> bool:
    if verify is None:
        return True
    return _verdict(module, fn, lambda: bool(verify(module)))


def _verdict(module: nn.Module, key: Any, check: Callable[[], bool]) -> bool:
    """``check()`` once per (module instance, key)."""
    verdicts = _VERIFIED.setdefault(module, {})
    if key not in verdicts:
        verdicts[key] = check()
    return verdicts[key]


NormFunction = Callable[[nn.Module, Tuple[torch.Tensor, ...], torch.Tensor], Dict[nn.Parameter, torch.Tensor]]


@dataclass(frozen=True)
class NormSampler:
    """Per-sample squared norms, and batch gradients from per-sample scaled backprops.

    ``token_wise`` layers act on each position of ``(B, *middle, F)`` independently, so the rows
    of one privacy unit can be concatenated along the middle dimensions. ``linear_form``, if
    given, returns the weight's per-sample gradient as factors ``sum_t left_t (x) right_t`` so that
    a weight shared with another layer (tied embeddings) needs no instantiation either.

    ``kept_clipped_sum(module, kept, factors, dropped)``, if given, forms the clipped sum from what
    ``norms_sq(module, activations, backprops, keep=kept)`` left in ``kept`` (a dict its caller holds
    for that one layer call) and each sample's factor ``factors`` ``(B,)``, instead of recomputing it
    from scaled output gradients: what it sums is then the gradient whose norm ``norms_sq`` bounded.
    The rows of the samples in the bool mask ``dropped`` (None: none) must add exactly 0 (by
    ``torch.where``: they may hold inf or NaN). Where no norm pass was kept, ``clipped_sum`` runs.
    """

    norms_sq: NormFunction
    clipped_sum: NormFunction
    token_wise: bool = False
    linear_form: Optional[Callable] = None
    kept_clipped_sum: Optional[Callable] = None


_NORM_SAMPLERS: Dict[Type[nn.Module], Tuple[NormSampler, Optional[ModulePredicate]]] = {}
_NORM_DUCK_RULES: List[Tuple[ModulePredicate, NormSampler]] = []


def register_norm_sampler(
    *module_types: Type[nn.Module],
    clipped_sum: NormFunction,
    predicate: Optional[ModulePredicate] = None,
    token_wise: bool = False,
    linear_form: Optional[Callable] = None,
    kept_clipped_sum: Optional[Callable] = None,
):
    """Decorator registering ``norms_sq(module, activations, backprops)`` for ghost/BK modes.

    ``clipped_sum(module, activations, scaled_backprops)`` must return the batch gradient of each
    trainable direct parameter given backprops already multiplied by each sample's clip factor.
    With ``kept_clipped_sum`` (see ``NormSampler``), ``norms_sq`` also takes ``keep=``.
    Give module types (with a ``predicate``, the rule holds only for the instances it accepts),
    or a ``predicate`` alone for duck-typed families.
    """
    if not module_types and predicate is None:
        raise TypeError("register_norm_sampler needs module types or a predicate")

    def decorator(fn: NormFunction) -> NormFunction:
        sampler = NormSampler(fn, clipped_sum, token_wise, linear_form, kept_clipped_sum)
        for module_type in module_types:
            _NORM_SAMPLERS[module_type] = (sampler, predicate)
        if not module_types:
            _NORM_DUCK_RULES.append((predicate, sampler))
        return fn

    return decorator


def find_norm_sampler(module: nn.Module) -> Optional[NormSampler]:
    """The norm sampler for ``module`` (type, MRO, then duck rules), or None.

    Only modules whose grad sampler is trusted (``find_grad_sampler``) get one, and a subclass
    that overrides ``forward`` only if the norm sampler itself reproduces torch.func.
    """
    if find_grad_sampler(module) is None:
        return None
    found = _registered_base(_NORM_SAMPLERS, module)
    if found is not None:
        base, (sampler, predicate) = found
        if predicate is not None and not predicate(module):
            return None
        return sampler if _trusted_for(module, base, sampler, norm=True) else None
    for predicate, sampler in _NORM_DUCK_RULES:
        if predicate(module):
            return sampler
    return None


# ----------------------------------------------------------------------------- numerical check


class _ForwardWithoutHooks(nn.Module):
    """Calls ``inner.forward`` directly, so hooks on ``inner`` (ours included) never see the probe."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.inner.forward(*inputs)


def _probe_device(module: nn.Module) -> torch.device:
    tensors = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
    return tensors[0].device if tensors else torch.device("cpu")


def matches_torch_func(
    module: nn.Module, probe: Probe, *, sampler: Optional[GradSampler] = None, norm_sampler: Optional[NormSampler] = None
) -> bool:
    """Whether ``sampler`` (or ``norm_sampler``) reproduces ``torch.func`` on ``module``'s own forward.

    The check runs on a shallow copy of ``module`` whose direct parameters are replaced by random
    trainable float32 ones and whose buffers by float32 copies (so the result depends neither on
    the instance's dtype nor on which of its parameters are frozen; ``module`` is untouched), in
    training mode, with ``probe``'s inputs, random output gradients and a fixed seed. A norm
    sampler must give the squared norms, the clipped sum for random factors and, if it has one,
    the linear form of the same per-sample gradients. Modules with children are not checked (their
    forward runs code this check cannot isolate). Any error means False.
    """
    params = {name: p for name, p in module._parameters.items() if p is not None}
    if not params or any(True for _ in module.children()):
        return False
    from torch.func import functional_call, grad, vmap

    device = _probe_device(module)
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    try:
        copied = copy.copy(module)
        copied._parameters = {n: None if p is None else nn.Parameter(random(*p.shape)) for n, p in module._parameters.items()}
        copied._buffers = {
            n: None if b is None else b.detach().clone().to(torch.float32 if b.is_floating_point() else b.dtype)
            for n, b in module._buffers.items()
        }
        copied.training = True
        wrapper = _ForwardWithoutHooks(copied)
        values = {f"inner.{n}": p.detach() for n, p in copied._parameters.items() if p is not None}
        with torch.inference_mode(False), torch.autocast(device.type, enabled=False), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vmap's "no batching rule, performance drop" notes
            inputs = tuple(t.to(device) for t in probe(copied, generator))
            with torch.no_grad():
                out = wrapper(*inputs)
            if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != inputs[0].shape[0]:
                return False
            backprops = random(*out.shape)

            def sample_loss(p, sample_inputs, g_i):
                output = functional_call(wrapper, p, tuple(x.unsqueeze(0) for x in sample_inputs))
                return (output * g_i.unsqueeze(0)).sum()

            expected = vmap(grad(sample_loss), in_dims=(None, 0, 0))(values, inputs, backprops)
            expected = {copied._parameters[name[len("inner."):]]: g for name, g in expected.items()}
            if sampler is not None and not _grads_match(sampler(copied, inputs, backprops), expected):
                return False
            if norm_sampler is not None and not _norm_sampler_matches(norm_sampler, copied, inputs, backprops, expected, random):
                return False
        return sampler is not None or norm_sampler is not None
    except Exception:  # a class whose forward cannot even run the probe is not trusted
        return False


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = float(want.abs().max()) if want.numel() else 0.0
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=1e-3, atol=1e-5 * max(1.0, scale))


def _grads_match(computed: Dict[nn.Parameter, torch.Tensor], expected: Dict[nn.Parameter, torch.Tensor]) -> bool:
    return set(computed) == set(expected) and all(_close(computed[p], want) for p, want in expected.items())


def _norm_sampler_matches(norm_sampler, module, inputs, backprops, expected, random) -> bool:
    kept: Dict[str, Any] = {}
    keep = {} if norm_sampler.kept_clipped_sum is None else {"keep": kept}
    squared = norm_sampler.norms_sq(module, inputs, backprops, **keep)
    want_squared = {p: g.flatten(1).pow(2).sum(1) for p, g in expected.items()}
    if not _grads_match(squared, want_squared):
        return False
    factors = random(backprops.shape[0]).abs()
    scaled = backprops * factors.view(-1, *([1] * (backprops.dim() - 1)))
    want_sums = {p: torch.einsum("i,i...->...", factors, g) for p, g in expected.items()}
    if not _grads_match(norm_sampler.clipped_sum(module, inputs, scaled), want_sums):
        return False
    if keep and not _grads_match(norm_sampler.kept_clipped_sum(module, kept, factors, None), want_sums):
        return False
    if norm_sampler.linear_form is None:
        return True
    forms = norm_sampler.linear_form(module, inputs, backprops)
    return set(forms) <= set(expected) and all(_close(form_inner_products(f, f), want_squared[p]) for p, f in forms.items())

"""Which attached controller captures each parameter: a registry keyed by parameter, weak on both sides.

A controller claims the parameters of its model when it attaches and gives them up at
``cleanup()``. A ``DPOptimizer`` built without ``hooks=`` (Opacus' engine-less spelling) finds its
controller here, and is refused when its parameters have none, or more than one (two models sharing
a parameter, each with a controller: its per-sample gradients would be split between them).
Neither parameters nor controllers are kept alive by the registry.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

from torch import nn

# id(parameter) -> [(weak parameter, weak controller)]; the id is checked against the live parameter,
# so an id reused by a new tensor never finds the old entry.
_CLAIMS: Dict[int, List[Tuple["weakref.ref[nn.Parameter]", "weakref.ref[Any]"]]] = {}


def claim(controller: Any, params: Sequence[nn.Parameter]) -> None:
    """Record that ``controller`` captures the per-sample gradients of ``params``."""
    for param in params:
        key = id(param)
        entries = _live(key)
        entries.append((weakref.ref(param, _forget(key)), weakref.ref(controller)))
        _CLAIMS[key] = entries


def release(controller: Any, params: Sequence[nn.Parameter]) -> None:
    """Drop the claims of ``controller`` on ``params`` (at its ``cleanup()``)."""
    for key in {id(param) for param in params}:
        entries = [entry for entry in _live(key) if entry[1]() is not controller]
        if entries:
            _CLAIMS[key] = entries
        else:
            _CLAIMS.pop(key, None)


def claimants(param: nn.Parameter) -> List[Any]:
    """The attached controllers that claim ``param``, each once."""
    found: List[Any] = []
    for param_ref, controller_ref in _CLAIMS.get(id(param), ()):
        controller = controller_ref()
        if param_ref() is param and controller is not None and controller.attached and controller not in found:
            found.append(controller)
    return found


def controller_of(params: Sequence[nn.Parameter], who: str = "DPOptimizer") -> Any:
    """The one controller that claims every parameter of ``params``; refused otherwise, saying what to do."""
    if not params:
        raise ValueError(f"{who} has no trainable parameters to find a per-sample gradient controller for")
    by_param = [(index, param, claimants(param)) for index, param in enumerate(params)]
    _refuse_shared(who, [(index, found) for index, _, found in by_param])
    controllers = {id(found[0]): found[0] for _, _, found in by_param if found}
    unclaimed = [f"{index} (shape {tuple(param.shape)})" for index, param, found in by_param if not found]
    if not controllers:
        raise RuntimeError(
            f"{who}: no per-sample gradient controller is attached to the optimizer's parameters, so no gradient "
            "could be clipped per sample. Attach one before building the optimizer: "
            "`hooks = dptorch.grad_sample.utils.wrap_model(model, grad_sample_mode='hooks', wrap_model=False)` "
            "(or `GradSampleModule(model)`, `GradSampleHooks(model)`), build the torch optimizer from that model's "
            "parameters, or pass hooks= to the DPOptimizer"
        )
    if len(controllers) > 1 or unclaimed:
        detail = (f"parameters {', '.join(unclaimed[:5])} have no controller" if unclaimed
                  else f"its parameters belong to {len(controllers)} different controllers")
        raise RuntimeError(
            f"{who}: {detail}; one controller must capture every parameter the optimizer updates, or some "
            "gradients would reach the update unclipped. Build the optimizer from the parameters of the one model "
            "the controller is attached to (attach it after adding heads or adapters), or pass hooks="
        )
    return next(iter(controllers.values()))


def check_sole_claim(controller: Any, params: Sequence[nn.Parameter], who: str = "DPOptimizer") -> None:
    """Refuse ``params`` when another attached controller than ``controller`` also claims one of them."""
    _refuse_shared(who, [(index, [controller] + [c for c in claimants(param) if c is not controller])
                         for index, param in enumerate(params)])


def _refuse_shared(who: str, found_by_index: Sequence[Tuple[int, List[Any]]]) -> None:
    """Refuse when a parameter is claimed by more than one controller (``(index, claimants)`` pairs)."""
    for index, found in found_by_index:
        if len(found) > 1:
            models = " and ".join(type(c.module).__name__ for c in found)
            raise RuntimeError(
                f"{who}: parameter {index} of the optimizer is captured by {len(found)} controllers (attached to "
                f"{models}): its per-sample gradients would be split between them and no clipping bound would "
                "hold. Attach one controller to one model holding every trained parameter"
            )


def _live(key: int) -> List[Tuple["weakref.ref[nn.Parameter]", "weakref.ref[Any]"]]:
    return [(p, c) for p, c in _CLAIMS.get(key, ()) if p() is not None and c() is not None]


def _forget(key: int) -> Callable[[Any], None]:
    def forget(_: Any) -> None:
        entries = _live(key)
        if entries:
            _CLAIMS[key] = entries
        else:
            _CLAIMS.pop(key, None)

    return forget


__all__ = ["claim", "claimants", "controller_of", "release"]

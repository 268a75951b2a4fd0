"""dptorch: differentially private training and fine-tuning for PyTorch.

Public names load on first use, so ``import dptorch.grad_sample`` stays light.
"""

from importlib import import_module
from typing import Any

from dptorch.compat import paths as _paths

__version__ = "0.1.0"

_EXPORTS = {
    "PrivacyEngine": "dptorch.engine",
    "DPOptimizer": "dptorch.optim",
    "capture_step": "dptorch.optim",
    "DPDataLoader": "dptorch.data",
    "BatchMemoryManager": "dptorch.data",
    "GradSampleHooks": "dptorch.grad_sample",
    "GradSampleModule": "dptorch.grad_sample",
    "register_grad_sampler": "dptorch.grad_sample",
    "ModuleValidator": "dptorch.validate",
    "DPLoss": "dptorch.grad_sample.capture.dp_loss",
    "packed_loss": "dptorch.grad_sample.units.packed_loss",
}

_paths.install()  # Opacus' import paths and dptorch's earlier ones (dptorch.compat)

__all__ = sorted(_EXPORTS)


def __dir__() -> list:
    """The public names (for tab completion), not the helpers this file imports."""
    return sorted({*_EXPORTS, "__version__"} | {n for n in globals() if n.startswith("__")})


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dptorch' has no attribute {name!r}")

"""``opacus.validators.errors``: Opacus' error classes for incompatible modules.

dptorch raises one class for every incompatible module, :class:`UnsupportedModuleError` (a
``ValueError``; ``ModuleValidator.validate(strict=True)`` and attaching a controller raise it), with
the module, the reason and the fix in its message. Opacus' finer classes are its subclasses, so an
``except`` clause written for Opacus still catches what dptorch raises where it names the base.
"""

from dptorch.grad_sample.errors import UnsupportedModuleError

#: Opacus' base of every "unsupported" error.
UnsupportedError = UnsupportedModuleError


class UnsupportableModuleError(UnsupportedModuleError):
    """A module that can never be trained with per-sample gradients (BatchNorm mixes the samples)."""


class NotYetSupportedModuleError(UnsupportedModuleError):
    """A module with no per-sample gradient rule yet."""


class ShouldReplaceModuleError(UnsupportedModuleError):
    """A module supported through a replacement (``ModuleValidator.fix`` swaps it in)."""


class IllegalModuleConfigurationError(UnsupportedModuleError):
    """A module configured in a way that mixes samples (InstanceNorm tracking running statistics, eval mode)."""


__all__ = [
    "IllegalModuleConfigurationError",
    "NotYetSupportedModuleError",
    "ShouldReplaceModuleError",
    "UnsupportableModuleError",
    "UnsupportedError",
    "UnsupportedModuleError",
]

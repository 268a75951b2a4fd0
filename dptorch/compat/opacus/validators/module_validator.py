"""``opacus.validators.module_validator``: ModuleValidator (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import ModuleValidator

__all__ = ["ModuleValidator"]

"""``opacus.validators.module_validator``: ModuleValidator (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import ModuleValidator

__all__ = ["ModuleValidator"]

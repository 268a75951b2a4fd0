"""``opacus.validators``: ModuleValidator and fixer registration (see dptorch.opacus_compat)."""

from dptorch.opacus_compat import ModuleValidator, register_module_fixer

__all__ = ["ModuleValidator", "register_module_fixer"]

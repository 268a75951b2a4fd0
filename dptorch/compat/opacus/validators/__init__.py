"""``opacus.validators``: ModuleValidator and fixer registration (see dptorch.compat.opacus)."""

from dptorch.compat.opacus import VALIDATORS_UNMAPPED, ModuleValidator, register_module_fixer, unmapped_names

__all__ = ["ModuleValidator", "register_module_fixer"]
__getattr__ = unmapped_names(__name__, VALIDATORS_UNMAPPED)

"""ModuleValidator and its fixers; checks are the registry of ``dptorch.grad_sample.layers.checks``."""

from dptorch.grad_sample.layers.checks import Incompatibility, register_module_check
from dptorch.validate.fixers import find_module_fixer, register_module_fixer
from dptorch.validate.validator import ModuleValidator

__all__ = ["Incompatibility", "ModuleValidator", "find_module_fixer", "register_module_check", "register_module_fixer"]

"""ModuleValidator: list what keeps a model from exact per-sample gradients, and fix it.

Validation reads the rule registry of ``dptorch.grad_sample.layers.checks`` (the one the controller
enforces at attach time); fixing applies the fixer registered for each flagged module's type to
a deep copy of the model.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List

from torch import nn

from dptorch.grad_sample.errors import UnsupportedModuleError
from dptorch.grad_sample.layers.checks import Incompatibility, incompatibilities
from dptorch.validate.fixers import apply_fixer, find_module_fixer, known_options

logger = logging.getLogger(__name__)


class ModuleValidator:
    """``validate``/``is_valid`` check a model; ``fix`` returns a compatible deep copy of it."""

    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> List[Incompatibility]:
        """Every incompatible module (path, type, why and how to fix); raise instead if ``strict``."""
        problems = incompatibilities(module)
        if strict and problems:
            raise UnsupportedModuleError(_report("the model is not compatible with per-sample gradients", problems))
        return problems

    @staticmethod
    def is_valid(module: nn.Module) -> bool:
        return not incompatibilities(module)

    @staticmethod
    def fix(module: nn.Module, **options: Any) -> nn.Module:
        """A deep copy of ``module`` with every flagged module replaced by its fixer's result.

        ``module`` itself is never modified. Options go to the fixers that accept them, e.g.
        ``batchnorm="instancenorm"``. Raises ``UnsupportedModuleError`` if anything is still
        incompatible afterwards (no fixer registered for it, or a fixer that did not fix it).
        """
        accepted = known_options()
        unknown = sorted(set(options) - accepted) if accepted is not None else []
        if unknown:
            raise TypeError(f"unknown fix option(s) {unknown}; the registered fixers accept {sorted(accepted or ())}")
        model = copy.deepcopy(module)
        replacements: Dict[nn.Module, nn.Module] = {}
        for problem in incompatibilities(model):
            target = model.get_submodule(problem.path)
            fixer = find_module_fixer(target)
            if fixer is not None and target not in replacements:
                replacements[target] = apply_fixer(fixer, target, options)
                logger.info("Replaced sub_module %s : %s with %s", problem.path, target, replacements[target])
        for parent in list(model.modules()):
            for name, child in list(parent._modules.items()):  # named_children() skips repeats
                if child in replacements:
                    setattr(parent, name, replacements[child])
        model = replacements.get(model, model)
        remaining = incompatibilities(model)
        if remaining:
            raise UnsupportedModuleError(
                _report("ModuleValidator.fix could not make the model compatible (register a fixer with "
                        "dptorch.validate.register_module_fixer)", remaining)
            )
        return model

    @staticmethod
    def fix_and_validate(module: nn.Module, **options: Any) -> nn.Module:
        """Opacus' name for ``fix``, which already validates its result."""
        return ModuleValidator.fix(module, **options)


def _report(headline: str, problems: List[Incompatibility]) -> str:
    return headline + ":\n" + "\n".join(f"  - {p}" for p in problems)

"""The error for another library's name that dptorch does not provide, and the module
``__getattr__`` that raises it naming the replacement."""

from __future__ import annotations

from typing import Any, Callable, Mapping


class OpacusCompatibilityError(ImportError, NotImplementedError):
    """An Opacus (or dp-transformers) name or option with no dptorch counterpart; the message names
    the replacement."""


def unmapped_names(module_name: str, replacements: Mapping[str, str], *, foreign_path: str, guide: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` raising :class:`OpacusCompatibilityError` for the names of another
    library's module ``foreign_path`` (e.g. ``opacus.validators``) that dptorch does not provide.

    ``replacements`` maps each such name of ``module_name`` (the path scripts import, e.g.
    ``dptorch.validators``) to what to use instead; ``guide`` is where the migration guide says more.
    Other missing names raise the usual ``AttributeError`` (so ``hasattr`` and tools that probe
    modules keep working).
    """

    def __getattr__(name: str) -> Any:
        if name in replacements:
            raise OpacusCompatibilityError(
                f"{foreign_path}.{name} has no dptorch counterpart: {replacements[name]} (see {guide})",
                name=module_name,
            )
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__

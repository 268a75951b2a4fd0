"""Serves import paths that are not where the module lives: Opacus' (from ``dptorch.compat.opacus``)
and dptorch's own earlier ones (after a move); and Opacus' names on the dptorch packages whose path
Opacus shares (``SHARED``).

``import dptorch`` puts :class:`AliasFinder` first on ``sys.meta_path``. It answers only for the
names of :data:`ALIASES`; importing one gives the very module object of its target (one module,
two names: classes and registries are not duplicated), and ``python -m <alias>`` runs the
target's code. A package of :data:`SHARED` loads as usual and then answers, for the names its twin
in ``dptorch.compat.opacus`` lists and it does not define, with the twin's objects (loaded on first
use). This module imports nothing of dptorch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Dict, Optional

#: Opacus 1.6 paths served under ``dptorch`` (``opacus.X`` is ``dptorch.X``), from the mirror of
#: Opacus' layout in ``dptorch.compat.opacus``. Paths Opacus shares with dptorch's own packages
#: (``opacus.grad_sample``, ``opacus.layers``, ``opacus.distributed``) are the dptorch packages.
OPACUS_PATHS = (
    "accountants",
    "accountants.analysis",
    "accountants.analysis.rdp",
    "accountants.rdp",
    "accountants.registry",
    "accountants.utils",
    "data_loader",
    "grad_sample.conv",
    "grad_sample.embedding_norm_sample",
    "grad_sample.grad_sample_module",
    "grad_sample.grad_sample_module_fast_gradient_clipping",
    "grad_sample.gsm_exp_weights",
    "grad_sample.linear",
    "grad_sample.utils",
    "layers.dp_multihead_attention",
    "layers.dp_rnn",
    "optimizers",
    "optimizers.adaclipoptimizer",
    "optimizers.ddp_perlayeroptimizer",
    "optimizers.ddpoptimizer",
    "optimizers.ddpoptimizer_fast_gradient_clipping",
    "optimizers.optimizer",
    "optimizers.optimizer_fast_gradient_clipping",
    "optimizers.perlayeroptimizer",
    "privacy_engine",
    "schedulers",
    "schedulers.grad_clip_scheduler",
    "schedulers.noise_scheduler",
    "utils",
    "utils.adaptive_clipping",
    "utils.adaptive_clipping.adaptive_clipping_utils",
    "utils.batch_memory_manager",
    "utils.fast_gradient_clipping_utils",
    "utils.module_utils",
    "utils.packed_sequences",
    "utils.per_sample_gradients_utils",
    "utils.tensor_utils",
    "utils.uniform_sampler",
    "validators",
    "validators.errors",
    "validators.module_validator",
)

#: dptorch's own earlier paths -> where the module lives now.
MOVED = {
    "dptorch.opacus_compat": "dptorch.compat.opacus",
    "dptorch.loss": "dptorch.grad_sample.capture.dp_loss",
    "dptorch.report": "dptorch.accounting.report",
    "dptorch.optim.clipping": "dptorch.clipping.factors",
    "dptorch.optim.adaptive": "dptorch.clipping.adaptive",
    "dptorch.noise_mechanisms": "dptorch.noise.banded",
    "dptorch.noise_mechanisms.accounting": "dptorch.noise.banded.accounting",
    "dptorch.noise_mechanisms.banded": "dptorch.noise.banded.toeplitz",
    "dptorch.noise_mechanisms.choose": "dptorch.noise.banded.choose",
    "dptorch.noise_mechanisms.optimize": "dptorch.noise.banded.optimize",
    "dptorch.noise_mechanisms.streaming": "dptorch.noise.banded.streaming",
    "dptorch.noise_mechanisms.wiring": "dptorch.noise.banded.mechanism",
    "dptorch.examples": "dptorch.cli.examples",
    "dptorch.examples.digits": "dptorch.cli.examples.digits",
    "dptorch.examples.minilm": "dptorch.cli.examples.minilm",
    "dptorch.examples.flags": "dptorch.cli.examples.flags",
    "dptorch.examples.plots": "dptorch.cli.examples.plots",
    # "House order, round two": grad_sample/ as stage subpackages
    "dptorch.grad_sample.registry": "dptorch.grad_sample.layers.registry",
    "dptorch.grad_sample.validation": "dptorch.grad_sample.layers.checks",
    "dptorch.grad_sample.layers.norms": "dptorch.grad_sample.layers.normalization",
    "dptorch.grad_sample.certified": "dptorch.grad_sample.norms.certified",
    "dptorch.grad_sample.linear_forms": "dptorch.grad_sample.norms.linear_forms",
    "dptorch.grad_sample.shared_inputs": "dptorch.grad_sample.norms.shared_inputs",
    "dptorch.grad_sample.token_units": "dptorch.grad_sample.units.token_units",
    "dptorch.grad_sample.packed_affine": "dptorch.grad_sample.units.packed_affine",
    "dptorch.grad_sample.packed_loss": "dptorch.grad_sample.units.packed_loss",
    "dptorch.grad_sample.tracking.tokens": "dptorch.grad_sample.units.token_tracker",
    # strategies.py split up (modes/): book_keeping holds BookKeeping and imports Instantiate and LayerCall
    "dptorch.grad_sample.strategies": "dptorch.grad_sample.modes.book_keeping",
    "dptorch.grad_sample.modes.strategies": "dptorch.grad_sample.modes.book_keeping",
    "dptorch.grad_sample.functorch": "dptorch.grad_sample.modes.functorch",
    "dptorch.grad_sample.expanded_weights": "dptorch.grad_sample.modes.expanded_weights",
    "dptorch.grad_sample.auto": "dptorch.grad_sample.modes.auto",
    "dptorch.grad_sample.buffers": "dptorch.grad_sample.modes.buffers",
    "dptorch.grad_sample.linear_head": "dptorch.grad_sample.modes.linear_head",
    "dptorch.grad_sample.stacked_calls": "dptorch.grad_sample.modes.stacked_calls",
    "dptorch.grad_sample.hooks": "dptorch.grad_sample.capture.hooks",
    "dptorch.grad_sample.claims": "dptorch.grad_sample.capture.claims",
    "dptorch.grad_sample.buffer_check": "dptorch.grad_sample.capture.buffer_check",
    "dptorch.grad_sample.module": "dptorch.grad_sample.capture.wrapper",
    "dptorch.grad_sample.fast_gradient_clipping": "dptorch.compat.opacus.grad_sample.grad_sample_module_fast_gradient_clipping",
    "dptorch.grad_sample.dp_loss": "dptorch.grad_sample.capture.dp_loss",
    "dptorch.integrations.hf.losses": "dptorch.grad_sample.units.per_sample_losses",
}

#: dptorch packages whose path Opacus shares -> the module that holds Opacus' further names on it.
SHARED: Dict[str, str] = {"dptorch.grad_sample": "dptorch.compat.opacus.grad_sample"}

#: Every served path -> the module that answers it.
ALIASES: Dict[str, str] = {
    **{f"dptorch.{path}": f"dptorch.compat.opacus.{path}" for path in OPACUS_PATHS},
    **MOVED,
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as its target module itself; gives the target's code to ``runpy``."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the target ran when it was imported."""

    def get_code(self, fullname: str):
        return importlib.util.find_spec(self.target).loader.get_code(self.target)

    def is_package(self, fullname: str) -> bool:
        return importlib.util.find_spec(self.target).submodule_search_locations is not None


class _SharedLoader(importlib.abc.Loader):
    """Loads a package of :data:`SHARED` with its own loader, then gives it the ``__getattr__`` of its twin's names."""

    def __init__(self, loader: importlib.abc.Loader, twin: str):
        self.loader, self.twin = loader, twin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__getattr__ = twin_names(module.__name__, self.twin)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)  # get_code, get_source, resources: the package's own loader's


def twin_names(package: str, twin: str):
    """A module ``__getattr__`` for ``package``: the names in ``twin``'s ``__all__``, else AttributeError."""

    def __getattr__(name: str):
        if not name.startswith("_"):
            module = importlib.import_module(twin)
            if name in module.__all__:
                return getattr(module, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the names of :data:`ALIASES` and :data:`SHARED` (and no other)."""

    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname in SHARED:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _SharedLoader(spec.loader, SHARED[fullname])
            return spec
        if fullname not in ALIASES:
            return None
        real = importlib.util.find_spec(ALIASES[fullname])
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(real.name), origin=real.origin,
                                              is_package=real.submodule_search_locations is not None)
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        spec.has_location = real.has_location
        return spec


def install() -> None:
    """Put one :class:`AliasFinder` first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())

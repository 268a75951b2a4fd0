"""Serves import paths that are not where the module lives: Opacus' (from ``dptorch.compat.opacus``)
and dptorch's own earlier ones (after a move).

``import dptorch`` puts :class:`AliasFinder` first on ``sys.meta_path``. It answers only for the
names of :data:`ALIASES`; importing one gives the very module object of its target (one module,
two names: classes and registries are not duplicated), and ``python -m <alias>`` runs the
target's code. This module imports nothing of dptorch.
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
    "dptorch.loss": "dptorch.grad_sample.dp_loss",
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
}

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


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the names of :data:`ALIASES` (and no other)."""

    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
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

"""The import hook of dptorch.compat.paths: each served path is its target module itself, every
module of the Opacus mirror is served, and ``python -m`` runs a moved module."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dptorch
from dptorch.compat import paths
from dptorch.compat.unmapped import OpacusCompatibilityError

MIRROR = Path(paths.__file__).parent / "opacus"
#: Packages of the mirror that only hold served submodules: Opacus' own ``grad_sample`` and
#: ``layers`` are dptorch's real packages.
NOT_SERVED = {"grad_sample", "layers"}


@pytest.mark.parametrize("alias", sorted(paths.ALIASES))
def test_a_served_path_is_its_target_module_itself(alias):
    served = importlib.import_module(alias)
    assert served is importlib.import_module(paths.ALIASES[alias])
    assert sys.modules[alias] is served


def test_every_module_of_the_opacus_mirror_is_served():
    mirrored = {".".join(p.relative_to(MIRROR).with_suffix("").parts[:-1] if p.name == "__init__.py"
                         else p.relative_to(MIRROR).with_suffix("").parts) for p in MIRROR.rglob("*.py")}
    mirrored -= {""} | NOT_SERVED
    assert mirrored == set(paths.OPACUS_PATHS)


def test_the_finder_answers_for_its_names_only():
    finder = next(f for f in sys.meta_path if isinstance(f, paths.AliasFinder))
    assert finder.find_spec("dptorch.engine") is None
    assert finder.find_spec("dptorch.validators").name == "dptorch.validators"
    paths.install()
    assert sum(isinstance(f, paths.AliasFinder) for f in sys.meta_path) == 1


def test_an_opacus_only_name_is_refused_under_the_path_the_script_imported():
    with pytest.raises(OpacusCompatibilityError) as caught:
        from dptorch.layers.dp_rnn import DPLSTMCell  # noqa: F401
    assert caught.value.name == "dptorch.layers.dp_rnn"
    assert "opacus.layers.dp_rnn.DPLSTMCell" in str(caught.value)


def test_python_m_runs_a_moved_module():
    done = subprocess.run([sys.executable, "-m", "dptorch.examples.digits", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=Path(dptorch.__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert "--epsilon" in done.stdout


@pytest.mark.parametrize("package", sorted(paths.SHARED))
def test_a_shared_package_serves_its_twins_names_and_no_other(package):
    served, twin = importlib.import_module(package), importlib.import_module(paths.SHARED[package])
    assert twin.__all__
    for name in twin.__all__:
        assert getattr(served, name) is getattr(twin, name)
        assert name not in vars(served)  # served from the twin, not defined in dptorch's package
    with pytest.raises(AttributeError, match="no attribute 'not_an_opacus_name'"):
        served.not_an_opacus_name  # noqa: B018
    assert not hasattr(served, "__not_a_dunder__")


def test_an_opacus_script_renamed_imports_the_fast_gradient_clipping_classes_from_grad_sample():
    done = subprocess.run([sys.executable, "-c", "from dptorch.grad_sample import GradSampleModuleFastGradientClipping as G, "
                           "GradSampleModule; import torch; m = G(torch.nn.Linear(2, 1), max_grad_norm=1.0); "
                           "print(isinstance(m, GradSampleModule), m.hooks.grad_sample_mode)"],
                          capture_output=True, text=True, timeout=120, cwd=Path(dptorch.__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "ghost"]

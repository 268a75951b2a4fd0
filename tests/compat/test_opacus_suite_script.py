"""scripts/opacus_suite.py on a small stand-in for Opacus' test folder: the rename, the temp copy, the figures."""

import importlib.util
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "opacus_suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("opacus_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rename_is_a_migrating_users(suite):
    source = "from opacus.tests.utils import X\nimport opacus\nfrom opacus.layers import DPLSTM  # opacus_like stays\n"
    assert suite.rename(source) == (
        "from opacus_tests.utils import X\nimport dptorch\nfrom dptorch.layers import DPLSTM  # opacus_like stays\n")


def _fake_opacus(root: Path) -> Path:
    tests = root / "opacus" / "tests"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "helpers.py").write_text("from opacus.privacy_engine import PrivacyEngine\n")
    (tests / "engine_test.py").write_text(
        "from opacus.tests.helpers import PrivacyEngine\n"
        "import pytest\n\n"
        "def test_engine_is_dptorchs():\n    assert PrivacyEngine.__module__.startswith('dptorch')\n\n"
        "def test_fails():\n    assert 1 == 2\n\n"
        "@pytest.mark.skip('no GPU')\ndef test_skipped():\n    pass\n")
    (tests / "missing_test.py").write_text("from opacus.no_such_module import thing\n")
    return root


def test_the_figures_of_a_run(suite, tmp_path, capsys):
    root = _fake_opacus(tmp_path / "installed")
    suite.main(["--opacus-path", str(root), "--failures"])
    out = capsys.readouterr().out
    assert "test files importing: 1 of 2" in out
    assert "not importing: opacus_tests.missing_test: ModuleNotFoundError" in out
    assert "tests collected: 3, passed 1, failed 1, skipped 1: 33.3% of collected tests pass" in out
    assert "FAILED opacus_tests.engine_test::test_fails" in out
    assert not (root / "opacus_tests").exists()  # the renamed copy went to a temporary folder


def test_the_tests_come_from_the_wheel_too(suite, tmp_path):
    root = _fake_opacus(tmp_path / "installed")
    wheel = tmp_path / "opacus-1.6.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in (root / "opacus").rglob("*.py"):
            archive.write(path, path.relative_to(root).as_posix())
    tests = suite.opacus_tests_from(None, wheel, tmp_path / "scratch")
    written = suite.write_renamed_suite(tests, tmp_path / "suite", max_examples=5)
    assert sorted(written) == ["opacus_tests/engine_test.py", "opacus_tests/missing_test.py"]
    assert "max_examples=5" in (tmp_path / "suite" / "conftest.py").read_text()
    assert "from dptorch.privacy_engine" in (tmp_path / "suite" / "opacus_tests" / "helpers.py").read_text()
    with pytest.raises(SystemExit, match="opacus/tests"):
        suite.opacus_tests_from(tmp_path / "nowhere", None, tmp_path / "scratch")


def test_the_suite_tests_this_checkouts_dptorch(suite, tmp_path, capsys):
    """Not an installed dptorch of another checkout (an editable install elsewhere, a wheel)."""
    root = tmp_path / "installed"
    tests = root / "opacus" / "tests"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "where_test.py").write_text(
        "import opacus\n\n"
        # reversed: the rename must not touch this checkout's path (it may hold the word)
        f"def test_checkout():\n    assert opacus.__file__.startswith({str(SCRIPT.parents[1] / 'dptorch')[::-1]!r}[::-1])\n")
    suite.main(["--opacus-path", str(root)])
    assert "tests collected: 1, passed 1, failed 0" in capsys.readouterr().out

"""The command starts at once: ``python -m dptorch``, and ``--help`` / ``--version`` without the accountants."""

import subprocess
import sys
from pathlib import Path

from dptorch.cli import commands

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_python_dash_m_dptorch_is_the_command():
    done = subprocess.run([sys.executable, "-m", "dptorch", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"dptorch {commands.__version__}"


def test_help_and_version_load_neither_the_accountants_nor_torch():
    loaded = _run(
        "import contextlib, io, sys\n"
        "from dptorch.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0 and main(['--version']) == 0 and main(['epsilon', '--help']) == 0\n"
        "print(sorted(m for m in ('dptorch.accounting', 'scipy', 'torch', 'dp_accounting') if m in sys.modules))"
    )
    assert loaded.strip() == "[]"


def test_the_help_texts_name_the_accountants_the_library_has():
    from dptorch import accounting

    assert commands.ACCOUNTANTS == tuple(accounting.ACCOUNTANTS)
    assert commands.DEFAULT_ACCOUNTANT == accounting.DEFAULT_ACCOUNTANT

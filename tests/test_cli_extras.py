"""`dptorch --version`, `noise --plot`, `--tolerance` errors in the option's own name, and the
benchmarks' command lines (--help, unknown layers refused, no profiler lines among the table)."""

import subprocess
import sys
from pathlib import Path

import pytest

from dptorch import __version__
from dptorch.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dptorch {__version__}"


def test_a_bad_tolerance_names_the_option_not_an_internal_variable(capsys):
    args = ["noise", "--target-epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "100"]
    assert main(args + ["--tolerance", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tolerance must be in (0, 1), got 2.0" in err and "epsilon_tolerance" not in err
    assert main(["noise", "--help"]) == 0
    assert "epsilon_tolerance" not in capsys.readouterr().out


def test_noise_plot_draws_sigma_against_epsilon(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    picture = tmp_path / "noise.png"
    args = ["noise", "--target-epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "100"]
    assert main(args + ["--plot", str(picture)]) == 0
    assert f"plot written to {picture}" in capsys.readouterr().out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(args + ["--plot", str(tmp_path / "missing" / "noise.png")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["accounting.py", "layers.py", "models.py", "noise.py", "packing.py"])
def test_benchmarks_answer_help(script):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), run.stderr[-500:]


def test_layer_benchmark_refuses_an_unknown_layer_and_keeps_its_table_clean(tmp_path):
    script = str(ROOT / "benchmarks" / "layers.py")
    run = subprocess.run([sys.executable, script, "--layers", "bogus"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "invalid choice: 'bogus' (choose from 'linear'" in run.stderr
    assert "Traceback" not in run.stderr
    run = subprocess.run([sys.executable, script, "--layers", "linear", "--modes", "nonprivate", "bk", "--batch", "2",
                          "--repeats", "1", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-500:]
    lines = (run.stdout + run.stderr).splitlines()
    assert [line.split()[:2] for line in lines[1:-1]] == [["linear", "nonprivate"], ["linear", "bk"]], lines
    assert lines[-1] == f"written: {tmp_path / 'layers.json'}" and (tmp_path / "layers.json").is_file()

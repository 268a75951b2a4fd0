"""The dptorch command line: subcommands in-process, one real subprocess, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dptorch.accounting import PLDAccountant
from dptorch.cli import COMMANDS, main

EPSILON_ARGS = ["epsilon", "--noise-multiplier", "1.1", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5"]


def pld_epsilon(sigma=1.1, q=0.01, steps=1000, delta=1e-5):
    accountant = PLDAccountant()
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(delta)


def test_epsilon_human_output(capsys):
    assert main(EPSILON_ARGS) == 0
    out, err = capsys.readouterr()
    assert out == f"epsilon = {pld_epsilon():.4g} (delta = 1e-05, pld, 1000 steps, sigma = 1.1, q = 0.01)\n"
    assert err == ""


def test_epsilon_json_with_several_accountants(capsys):
    assert main(EPSILON_ARGS + ["--accountant", "pld,rdp", "--accountant", "gdp", "--json"]) == 0
    out, err = capsys.readouterr()
    payload = json.loads(out)
    assert payload["accountant"] == "pld"
    assert payload["epsilon"] == pytest.approx(pld_epsilon())
    assert list(payload["epsilons"]) == ["pld", "rdp", "gdp"]
    assert payload["epsilons"]["pld"] <= payload["epsilons"]["rdp"]
    assert payload["steps"] == 1000 and payload["noise_multiplier"] == 1.1 and payload["sample_rate"] == 0.01
    # The GDP warning reaches the user once, as one line, not as a Python traceback-style warning.
    assert err.count("dptorch: warning: GDPAccountant is a central-limit approximation") == 1


def test_gdp_is_labelled_in_human_output(capsys):
    assert main(EPSILON_ARGS + ["--accountant", "gdp"]) == 0
    assert "gdp approximation, not a bound" in capsys.readouterr().out


def test_noise_round_trip(capsys):
    args = ["noise", "--target-epsilon", "2", "--delta", "1e-5", "--sample-rate", "0.01", "--epochs", "5", "--json"]
    assert main(args) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["steps"] == 500
    assert payload["epsilon"] <= 2.0
    assert pld_epsilon(payload["noise_multiplier_rounded"], 0.01, 500) <= 2.0
    assert payload["noise_multiplier_rounded"] >= payload["noise_multiplier"]


def test_noise_human_output(capsys):
    args = ["noise", "--target-epsilon", "8", "--delta", "1e-5", "--sample-rate", "0.04", "--steps", "2250"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("noise multiplier = ") and "(target epsilon = 8, delta = 1e-05, pld, 2250 steps" in out
    assert out.count("\n") == 1


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    target = tmp_path / "curve.png"
    args = ["epsilon", "--noise-multiplier", "1.1", "--sample-rate", "0.01", "--steps", "200", "--delta", "1e-5",
            "--accountant", "pld,rdp", "--plot", str(target)]
    assert main(args) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {target}" in capsys.readouterr().out


def test_plot_to_unwritable_place_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = EPSILON_ARGS + ["--plot", str(tmp_path / "missing" / "dir" / "x.png")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("dptorch: error: cannot write the plot") and err.count("\n") == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["epsilon", "--noise-multiplier", "1", "--sample-rate", "1.5", "--steps", "10", "--delta", "1e-5"],
         "--sample-rate must be in (0, 1], got 1.5"),
        (["epsilon", "--noise-multiplier", "-1", "--sample-rate", "0.5", "--steps", "10", "--delta", "1e-5"],
         "--noise-multiplier must be a finite number >= 0, got -1.0"),
        (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.5", "--steps", "-4", "--delta", "1e-5"],
         "--steps must be a whole number >= 0, got -4"),
        (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.5", "--steps", "10", "--delta", "2"],
         "--delta must be a number in (0, 1), got 2.0"),
        (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.5", "--steps", "10", "--delta", "1e-5",
          "--accountant", "moments"],
         "--accountant must be one of 'pld', 'prv', 'rdp', 'gdp', got 'moments'"),
        (["epsilon", "--noise-multiplier", "x"], "argument --noise-multiplier: invalid float value: 'x'"),
        (["noise", "--target-epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.1"],
         "one of the arguments --epochs --steps is required"),
        (["noise", "--target-epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.1", "--epochs", "1",
          "--steps", "3"], "not allowed with argument"),
        (["noise", "--target-epsilon", "-1", "--delta", "1e-5", "--sample-rate", "0.1", "--steps", "3"],
         "--target-epsilon must be a finite number > 0, got -1.0"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_input_is_exit_2_and_one_line(args, message, capsys):
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("dptorch: error: ") and err.count("\n") == 1
    assert message in err


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "epsilon" in out and "noise" in out


def test_commands_are_a_list_to_extend():
    assert [command.__name__ for command in COMMANDS] == [
        "add_epsilon_command", "add_noise_command", "add_example_command", "add_audit_command"]


def _dptorch_executable():
    candidate = Path(sys.executable).with_name("dptorch")
    if candidate.exists():
        return [str(candidate)]
    return [sys.executable, "-m", "dptorch.cli"]


def test_console_script_in_a_subprocess():
    done = subprocess.run(
        _dptorch_executable() + EPSILON_ARGS + ["--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS=""),
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert json.loads(done.stdout)["epsilon"] == pytest.approx(pld_epsilon())

"""The command line refuses what the Python API refuses, with the API's message (issue 31):
every subcommand's bad values go through the checks of dptorch.accounting.validation, named
after the option, and exit 2; --epochs or --steps on both epsilon and noise; defaults in --help."""

import inspect
import math

import pytest

from dptorch.accounting import validation
from dptorch.cli import main

EPSILON = ["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"]
NOISE = ["noise", "--target-epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "100"]
AUDIT = ["audit", "--canaries", "20", "--steps", "1", "--sample-rate", "0.5"]


def _with(args, option, value):
    """``args`` with ``option`` set to ``value`` (replaced where it is, else appended)."""
    args = list(args)
    if option in args:
        args[args.index(option) + 1] = value
    else:
        args += [option, value]
    return args


def _refusal(check, *arguments, **options):
    with pytest.raises(ValueError) as refusal:
        check(*arguments, **options)
    return str(refusal.value)


def _api_refusals():
    """(command line, the API's message for the same value) for each subcommand and option."""
    delta = validation.check_delta_for_units
    cases = []
    for base, q in ((EPSILON, 0.01), (NOISE, 0.01), (AUDIT, 0.5)):
        cases += [
            (_with(base, "--delta", "0.5"), _refusal(delta, 0.5, None, "--delta", sample_rate=q)),
            (_with(base, "--delta", "2"), _refusal(delta, 2.0, None, "--delta", sample_rate=q)),
            (_with(base, "--sample-rate", "1.5"), _refusal(validation.check_sample_rate, 1.5, "--sample-rate")),
            (_with(base, "--sample-rate", "0"), _refusal(validation.check_sample_rate, 0.0, "--sample-rate")),
            (_with(base, "--steps", "-3"), _refusal(validation.check_steps, -3, "--steps")),
        ]
    for base in (EPSILON, NOISE):
        cases += [
            (_with(_with(base, "--dataset-size", "1000"), "--delta", "0.001"), _refusal(delta, 1e-3, 1000, "--delta")),
            ([a for a in base if a not in ("--steps", "100")] + ["--epochs", "-1"],
             _refusal(validation.check_positive, -1.0, "--epochs")),
        ]
    cases += [
        (_with(EPSILON, "--noise-multiplier", "-1"), _refusal(validation.check_non_negative, -1.0, "--noise-multiplier")),
        (_with(NOISE, "--target-epsilon", "0"), _refusal(validation.check_epsilon, 0.0, "--target-epsilon")),
        (_with(AUDIT, "--noise-multiplier", "-1"), _refusal(validation.check_noise_multiplier, -1.0, "--noise-multiplier")),
    ]
    return cases


@pytest.mark.parametrize("args,message", _api_refusals())
def test_every_subcommand_refuses_a_bad_value_with_the_apis_message(args, message, capsys):
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"dptorch: error: {message}\n"


def test_the_delta_the_engine_refuses_the_command_line_refuses_in_the_same_words(capsys):
    from dptorch import plan

    assert plan.check_delta_for_units is validation.check_delta_for_units  # one check, shared
    engine_message = _refusal(plan.check_delta_for_units, 0.01, 1000, "target_delta")
    assert main(_with(_with(EPSILON, "--dataset-size", "1000"), "--delta", "0.01")) == 2
    assert capsys.readouterr().err == "dptorch: error: " + engine_message.replace("target_delta", "--delta") + "\n"
    # the example: delta 0.5 printed "epsilon = -0.6931" and exit 0
    assert main(_with(EPSILON, "--delta", "0.5")) == 2
    assert "is not below the sample rate 0.01" in capsys.readouterr().err


def test_a_delta_above_the_total_variation_gives_epsilon_zero_not_a_negative_one():
    from dptorch.accounting import create_accountant

    epsilons = {}
    for name in ("pld", "prv", "rdp"):
        accountant = create_accountant(name)
        accountant.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=100)
        epsilons[name] = accountant.get_epsilon(0.5)
    assert epsilons["pld"] == 0.0 and epsilons["rdp"] == 0.0  # the PLD found -0.6931 here
    assert 0.0 <= epsilons["prv"] <= 0.0011  # PRV's upper bound carries its epsilon error (0.001)


def test_no_noise_is_an_infinite_epsilon_as_in_the_plan(capsys):
    assert main(_with(EPSILON, "--noise-multiplier", "0") + ["--json"]) == 0
    assert '"epsilon": null' in capsys.readouterr().out  # JSON has no infinity
    assert main(_with(EPSILON, "--noise-multiplier", "0")) == 0
    assert capsys.readouterr().out.startswith("epsilon = inf (")


def test_epsilon_takes_epochs_as_noise_does_and_noise_takes_steps(capsys):
    import json

    epochs = [a for a in EPSILON if a not in ("--steps", "100")] + ["--epochs", "1", "--json"]
    assert main(epochs) == 0
    by_epochs = json.loads(capsys.readouterr().out)
    assert main(EPSILON + ["--json"]) == 0
    by_steps = json.loads(capsys.readouterr().out)
    assert by_epochs["steps"] == 100 and by_epochs["epsilon"] == by_steps["epsilon"] and by_epochs["epochs"] == 1
    assert main(NOISE + ["--json"]) == 0 and json.loads(capsys.readouterr().out)["steps"] == 100


@pytest.mark.parametrize("command", [EPSILON, NOISE])
def test_epochs_and_steps_exactly_one(command, capsys):
    neither = [a for a in command if a not in ("--steps", "100")]
    assert main(neither) == 2
    assert "one of the arguments --epochs --steps is required" in capsys.readouterr().err
    assert main(command + ["--epochs", "1"]) == 2
    assert "argument --epochs: not allowed with argument --steps" in capsys.readouterr().err


def test_help_names_the_defaults(capsys):
    from dptorch.accounting import DEFAULT_ACCOUNTANT
    from dptorch.engine import PrivacyEngine

    assert main(["noise", "--help"]) == 0
    assert f"(default {DEFAULT_ACCOUNTANT})" in " ".join(capsys.readouterr().out.split())
    library_default = inspect.signature(PrivacyEngine.make_private).parameters["grad_sample_mode"].default
    assert main(["audit", "--help"]) == 0
    assert f"(default {library_default}, as make_private)" in " ".join(capsys.readouterr().out.split())


def test_a_tiny_noise_multiplier_answers_with_a_bound_and_a_warning(capsys):
    assert main(_with(_with(EPSILON, "--noise-multiplier", "1e-6"), "--sample-rate", "0.1")) == 0
    out, err = capsys.readouterr()
    epsilon = float(out.split()[2])
    assert math.isfinite(epsilon) and epsilon > 5e11  # above the exact one-step epsilon, 5.0e11 and up
    assert "noise_multiplier=1e-06" in err and "RDP bound" in err

"""The examples under examples/ run end to end (two steps each) and report a positive epsilon."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    sys.path.insert(0, str(EXAMPLES))  # the examples import their helpers as `common`
    try:
        spec = importlib.util.spec_from_file_location(f"dptorch_example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize(
    "name, run",
    [
        ("trainer_causal_lm", lambda m: m.main(["--max_steps", "2", "--logging_steps", "1"])),
        ("seq2seq", lambda m: m.main(["--max_steps", "2", "--logging_steps", "1"])),
        ("lora", lambda m: m.main(2)),
        ("sft", lambda m: m.main(2)),
        ("dpo", lambda m: m.main(2)),
    ],
)
def test_example_runs_and_reports_epsilon(name, run, capsys):
    result = run(load(name))
    assert 0 < result["epsilon"] < math.inf
    assert "epsilon =" in capsys.readouterr().out

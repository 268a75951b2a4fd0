"""DeepSpeed's "Setting accelerator to CPU" notice stays out of a Trainer run on a CPU-only machine."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("needs DeepSpeed and transformers (dptorch[hf,deepspeed])", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
#: What the HF Trainer runs when DeepSpeed is installed (its accelerator detection), then another DeepSpeed warning.
DEEPSPEED = (
    "from deepspeed.accelerator import get_accelerator\n"
    "get_accelerator()\n"
    "import deepspeed.utils\n"
    "deepspeed.utils.logger.warning('another DeepSpeed warning')\n"
)


def _output(code: str) -> str:
    """What the code prints, both streams (DeepSpeed logs to stdout)."""
    env = {name: value for name, value in os.environ.items() if name != "DS_ACCELERATOR"}  # DeepSpeed detects
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the notice is left out only where torch sees no accelerator")
def test_the_notice_is_left_out_and_other_deepspeed_messages_are_not():
    plain = _output(DEEPSPEED)
    assert "Setting accelerator to CPU" in plain  # what a user saw in every Trainer run
    quiet = _output("import dptorch.integrations.hf\n" + DEEPSPEED)
    assert "Setting accelerator to CPU" not in quiet and "another DeepSpeed warning" in quiet

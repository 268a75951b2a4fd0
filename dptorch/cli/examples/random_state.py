"""Running the non-private baseline between the private run's set-up and its training, without
changing what the private run draws."""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch


@contextmanager
def global_generators_kept() -> Iterator[None]:
    """Run the block, then put Python's, numpy's and torch's global generators back as they were:
    a private run set up before the block trains as if the block had not run (its figures stay
    those of a run without it)."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])

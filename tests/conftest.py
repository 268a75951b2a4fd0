"""Test isolation: no batch tracker or recorded DP batch outlives the test that made it.

A test that leaves a controller attached (or a refused step un-detached) would otherwise leave its
tracker on torch's process-wide function-mode stack (and the unseen-operation guard on its dispatch
stack: a Python call for every ATen operation), and the DP loaders' latest batch recorded, for every
later test in the same process.
"""

import pytest
import torch

from dptorch.data import drawn
from dptorch.grad_sample.tracking import unseen
from dptorch.grad_sample.tracking.mode import BatchTracker


@pytest.fixture(autouse=True)
def _no_tracker_outlives_its_test():
    yield
    modes = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    if any(isinstance(m, BatchTracker) for m in modes):
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        for m in modes:
            if isinstance(m, BatchTracker):
                m.close()
            else:
                torch._C._push_on_torch_function_stack(m)
    drawn.hand_out(())
    unseen.off()  # and the guard of unseen operations, on torch's dispatch stack while a tracker followed the loop

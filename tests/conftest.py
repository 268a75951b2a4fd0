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


#: Session fixtures that launch processes, shared by several files: a file using one runs on the worker that
#: holds the launch (``make test`` runs the suite on two workers, ``--dist loadgroup``), so each launches once.
_SHARED_LAUNCHES = {"spawned": "engine-launch", "result": "engine-launch", "hf_ddp": "hf-launch", "hf_fsdp": "hf-launch",
                    "hf_offload": "hf-launch", "hf_hsdp": "hf-launch", "hf_ddp4": "hf-launch"}


def pytest_collection_modifyitems(items):
    """Each test in one group with its file (module fixtures made once), files sharing a launch in one group."""
    files = {}
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            if name in _SHARED_LAUNCHES:
                files[item.path] = _SHARED_LAUNCHES[name]
    for item in items:
        item.add_marker(pytest.mark.xdist_group(files.get(item.path, str(item.path))))


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


#: Test files that share a session fixture launching processes (``tests/distributed/conftest.py``), by the
#: launch they share: a parallel run (``make test WORKERS=2``: ``-n 2 --dist loadfile``) sends each set to one worker,
#: so the launch is made once, as every other file's module fixtures are.
SHARED_LAUNCHES = {
    "engine": ("tests/distributed/test_ddp.py", "tests/distributed/test_fsdp.py",
               "tests/distributed/test_nonfinite_sharded.py"),
    "hf": ("tests/distributed/test_hf_ddp.py", "tests/distributed/test_hf_deepspeed.py",
           "tests/distributed/test_hf_fsdp.py", "tests/distributed/test_hf_hsdp.py", "tests/distributed/test_hf_trl.py"),
}
_LAUNCH_FIXTURES = {"spawned", "result", "hf_ddp", "hf_fsdp", "hf_offload", "hf_hsdp", "hf_ddp4"}  # in tests/distributed
_GROUP_OF_FILE = {path: group for group, paths in SHARED_LAUNCHES.items() for path in paths}


def _file_of(nodeid: str) -> str:
    """The test file of a node id, as the rootdir-relative path ``SHARED_LAUNCHES`` lists."""
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """A file using a shared launch must be listed in ``SHARED_LAUNCHES``, under one group with the other users
    of that launch (else a parallel run would launch it once per worker)."""
    groups = {}
    for item in items:
        path = _file_of(item.nodeid)
        if not path.startswith("tests/distributed/"):  # the fixtures' conftest is there (other files' names are their own)
            continue
        for name in _LAUNCH_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            groups.setdefault(name, set()).add(_GROUP_OF_FILE.get(path, path))
    split = {name: sorted(found) for name, found in groups.items() if len(found) > 1 or not found <= set(SHARED_LAUNCHES)}
    if split:
        raise pytest.UsageError(f"tests/conftest.py: list the files using these launches under one group of "
                                f"SHARED_LAUNCHES: {split}")


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the files of one shared launch sent to one worker as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LoadFileSharingLaunches(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = _file_of(nodeid)
            return _GROUP_OF_FILE.get(path, path)

    return LoadFileSharingLaunches(config, log)

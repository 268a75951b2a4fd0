"""One launch of ``WORLD`` processes for every engine-level distributed test (the suite's time budget)."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def spawned():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from tests.distributed.workers import spawn_all

    return spawn_all()


@pytest.fixture
def result(spawned):
    """``result(name, rank)``: what scenario ``name`` returned on ``rank`` (its traceback if it failed)."""

    def get(name, rank):
        value = spawned[(name, rank)]
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{value['error']}")
        return value

    return get

"""One intra-op thread: the migration scripts train tiny models on a shared 2-core machine."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

"""One intra-op thread for these tests: the models are tiny, and on a shared 2-core machine two
spinning OpenMP threads per process cost several times the work (measured: 26 s against 151 s)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

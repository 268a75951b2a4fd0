"""is_arange in a captured step's trace: proven by how the trace made the index (arange, then views, unwritten),
refused for anything else, whatever the values would have been."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dptorch.grad_sample.tracking.traced_values import is_arange


def traced(make, n=4):
    """``is_arange(make(n), n)`` evaluated inside a fake-tensor trace."""
    found = []

    def step(x):
        found.append(is_arange(make(x.shape[0]), x.shape[0]))
        return x + 1

    make_fx(step, tracing_mode="fake")(torch.zeros(n, 2))
    return found[0]


def written_through_a_view(n):
    a = torch.arange(n)
    a[:2].add_(1)
    return a[:, None]


def written_through_data(n):
    a = torch.arange(n)
    a.data.mul_(0)
    return a[:, None, None]


PROVEN = {
    "arange": lambda n: torch.arange(n),
    "arange(0, n)": lambda n: torch.arange(0, n),
    "HF's batch_arange[:, None, None, None]": lambda n: torch.arange(n)[:, None, None, None],
    "a view": lambda n: torch.arange(n).view(n, 1),
}
UNPROVEN = {
    "arange(1, n + 1)": lambda n: torch.arange(1, n + 1),
    "arange(0, 2n, 2)": lambda n: torch.arange(0, 2 * n, 2),
    "reversed": lambda n: torch.arange(n).flip(0),
    "written through a view": written_through_a_view,
    "written through .data": written_through_data,
    "a copy": lambda n: torch.arange(n).to(torch.int32),
    "zeros": lambda n: torch.zeros(n, dtype=torch.long),
    "part of a longer arange": lambda n: torch.arange(n + 2)[:n],
}


@pytest.mark.parametrize("name", list(PROVEN))
def test_an_arange_and_its_views_are_proven(name):
    assert traced(PROVEN[name])


@pytest.mark.parametrize("name", list(UNPROVEN))
def test_anything_else_is_not(name):
    assert not traced(UNPROVEN[name])


def test_outside_a_trace_the_values_decide():
    assert is_arange(torch.arange(5), 5) and not is_arange(torch.arange(5).flip(0), 5)

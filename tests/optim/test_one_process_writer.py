"""One process: the noised gradient is (s + z) / divisor element by element, z the one flat draw, written into
new tensors (the held sums, which a state_dict may hold, stay as they were)."""

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPOptimizer


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 3), nn.Linear(3, 2)
        self.unused = nn.Linear(2, 2)  # trainable, no clipped sum: its gradient is its noise (or zero)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("sigma", [0.0, 0.7])
def test_gradient_is_sum_plus_flat_noise_and_held_sums_stay(reduction, sigma):
    torch.manual_seed(0)
    model = WithUnused()
    hooks = GradSampleHooks(model, loss_reduction=reduction)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=sigma,
                            max_grad_norm=0.5, expected_batch_size=3, loss_reduction=reduction,
                            noise_generator=NoiseGenerator(seed=11))
    loss = model(torch.randn(3, 4)).pow(2)
    (loss.sum() if reduction == "sum" else loss.sum(1).mean()).backward()
    state = optimizer.state_dict()
    held = {i: t.clone() for i, t in state["dp"]["summed"].items()}
    params = list(model.parameters())
    assert sorted(held) == [0, 1, 2, 3]  # the unused layer holds none
    optimizer.step()
    sizes = [p.numel() for p in params]
    if sigma > 0:
        shape_only = torch.zeros(1).expand(sum(sizes))
        flat = NoiseGenerator(seed=11).noise_like(shape_only, optimizer.noise_std).reshape(-1)
    else:
        flat = torch.zeros(sum(sizes))
    divisor = 3.0 if reduction == "mean" else 1.0
    for i, (p, z) in enumerate(zip(params, flat.split(sizes))):
        s = held.get(i, torch.zeros_like(p)).reshape(-1)
        want = (z + s) / divisor if reduction == "mean" else z + s
        assert torch.equal(p.grad.reshape(-1), want), i
        if i in held:
            assert torch.equal(state["dp"]["summed"][i], held[i])  # not written in place
            assert p.grad.data_ptr() != state["dp"]["summed"][i].data_ptr()


def test_sums_sharing_memory_each_get_their_own_noise_and_a_loaded_state_stays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=0.7,
                            max_grad_norm=0.5, expected_batch_size=3, loss_reduction="sum",
                            noise_generator=NoiseGenerator(seed=5))
    model(torch.randn(3, 3)).sum().backward()
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)
    first, second = model[0].weight, model[2].weight
    shared = optimizer._summed[first]
    optimizer._summed[second] = shared  # one tensor held for two parameters: each must get s + its own z
    loaded = {i: t.clone() for i, t in state["dp"]["summed"].items()}
    want = {p: optimizer._summed[p].clone() for p in model.parameters()}
    optimizer.step()
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    flat = NoiseGenerator(seed=5).noise_like(torch.zeros(1).expand(sum(sizes)), optimizer.noise_std).reshape(-1)
    for p, z in zip(params, flat.split(sizes)):
        assert torch.equal(p.grad.reshape(-1), z + want[p].reshape(-1))
    assert first.grad.data_ptr() != second.grad.data_ptr()
    for i, t in state["dp"]["summed"].items():
        assert torch.equal(t, loaded[i])  # load_state_dict took copies


@pytest.mark.parametrize("threads", [1, 2])
def test_large_draw_is_added_chunk_by_chunk_without_a_model_sized_buffer(monkeypatch, threads):
    """Above ``_CPU_CHUNK`` values the noise is drawn and added a chunk at a time (chunks straddle
    parameters): the gradient is the flat draw's ``(s + z) / divisor`` bit for bit, and no tensor of all
    parameters' size is made at the step."""
    import dptorch.noise.gaussian as gaussian
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(gaussian, "_CPU_CHUNK", 7)
    torch.manual_seed(0)
    model = WithUnused()
    hooks = GradSampleHooks(model, loss_reduction="mean")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=0.7,
                            max_grad_norm=0.5, expected_batch_size=3, noise_generator=NoiseGenerator(seed=11))
    model(torch.randn(3, 4)).pow(2).sum(1).mean().backward()
    held = {p: s.clone() for p, s in optimizer._summed.items()}
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    largest = []

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            largest.extend(t.numel() for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor))
            return out

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with Largest():
            optimizer.step()
    finally:
        torch.set_num_threads(before)
    assert sum(sizes) > 2 * 7 and max(largest) < sum(sizes)  # chunks and parameters, never the flat vector
    flat = NoiseGenerator(seed=11).noise_like(torch.zeros(1).expand(sum(sizes)), optimizer.noise_std).reshape(-1)
    for p, z in zip(params, flat.split(sizes)):
        s = held[p].reshape(-1) if p in held else torch.zeros_like(z)
        assert torch.equal(p.grad.reshape(-1), (z + s) / 3.0)

"""A model compiled with dptorch's backend (``torch.compile(model, backend="dptorch")``) after
``make_private(..., wrap_model=False)`` trains exactly as the eager model: the controller's hooks run
eagerly between graphs, and each graph is proven by the batch tracker's own rules, run once on the graph's
code per call signature (``dptorch/grad_sample/tracking/proven_graph.py``), its proven output tags replayed
while the signature and Dynamo's guards hold. What mixes samples inside a graph is refused as in eager."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.tracking import BatchTracker, Lost
from dptorch.grad_sample.tracking.proven_graph import PrivateBackend


class Collecting(PrivateBackend):
    """dptorch's backend, keeping the proven graphs it made (to count proofs and replays)."""

    def __init__(self, inner="eager"):
        super().__init__(inner)
        self.graphs = []

    def __call__(self, gm, example_inputs):
        graph = super().__call__(gm, example_inputs)
        self.graphs.append(graph)
        return graph


class Net(nn.Module):
    def __init__(self, mix=False, graph_break=False):
        super().__init__()
        torch.manual_seed(1)
        self.a, self.norm, self.b = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 2)
        self.mix, self.graph_break = mix, graph_break

    def forward(self, x):
        h = nn.functional.gelu(self.norm(self.a(x))) * 2.0 + 1.0
        if self.graph_break:
            torch._dynamo.graph_break()
        h = h.tanh() * 3.0
        if self.mix:
            h = h - h.mean(0)  # every sample's hidden state moves with the others'
        return self.b(h)


def train(model, mode, backend=None, steps=6):
    """Parameters after ``steps`` private steps (noise 0, loss sum) on the same Poisson draws, the model called
    compiled with ``backend`` (eager when None); an evaluation call between steps."""
    torch._dynamo.reset()
    rows = TensorDataset(torch.randn(40, 6, generator=torch.Generator().manual_seed(3)),
                         torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(4)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        controller, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(rows, batch_size=8, generator=torch.Generator().manual_seed(5)),
            noise_multiplier=0.0, max_grad_norm=0.5, grad_sample_mode=mode, wrap_model=False, loss_reduction="sum")
    call = torch.compile(model, backend=backend) if backend is not None else model
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(call(x), y, reduction="sum").backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            call(rows[:3][0])  # evaluation between steps: its own graphs, no tracker
        model.train()
    controller.cleanup()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_a_model_compiled_with_dptorchs_backend_trains_as_the_eager_model(mode):
    eager = train(Net(), mode)
    backend = Collecting()
    compiled = train(Net(), mode, backend)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    proven = [g for g in backend.graphs if g.proven]
    assert proven, "no graph's proof was kept: every call ran eagerly"
    assert all(len(g.proven) <= g.proofs for g in backend.graphs)


def test_inductor_compiles_the_graphs_and_the_step_stays_exact():
    """``backend="dptorch"``, the entry point: inductor compiles, the tracker proves."""
    eager = train(Net(), "bk", steps=4)
    compiled = train(Net(), "bk", "dptorch", steps=4)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_graph_break_in_the_forward_carries_the_tags_across():
    eager = train(Net(graph_break=True), "hooks")
    compiled = train(Net(graph_break=True), "hooks", Collecting())
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("graph_break", [False, True])
def test_a_graph_that_mixes_samples_is_refused_at_every_call(graph_break):
    """The mean over the batch is inside a compiled graph; the next layer refuses it at each call, as in eager,
    naming the operation (a mean over the batch is a total the tracker keeps: such a graph is proven at every call)."""
    torch._dynamo.reset()
    model = Net(mix=True, graph_break=graph_break)
    backend = Collecting()
    compiled = torch.compile(model, backend=backend)
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        for _ in range(3):
            with pytest.raises(PerSampleGradientError, match="mean"):
                compiled(torch.randn(4, 6)).sum().backward()
            hooks.clear()
    mixing = [g for g in backend.graphs if any(node.target == "mean" for node in g.gm.graph.nodes)]
    assert mixing and sum(g.proofs for g in mixing) == 3 and not any(g.proven for g in mixing)


def follow_compiled(function, n, *inputs, tags=(0,)):
    """``function(*inputs)`` compiled with dptorch's backend, under a batch tracker of batch size ``n`` whose
    inputs carry ``tags``: the output's tag."""
    with BatchTracker(n, skip=lambda: False, quiet=None) as tracker:
        for x, tag in zip(inputs, tags):
            tracker.put(x, tag)
        return tracker.get(function(*inputs))


def test_a_proof_is_kept_for_its_signature_and_made_again_for_another():
    torch._dynamo.reset()
    backend = Collecting()
    f = torch.compile(lambda x, w: (x * w).relu() * 2.0, backend=backend)
    w = torch.randn(4)
    assert follow_compiled(f, 3, torch.randn(3, 4), w, tags=(0, None)) == 0
    assert follow_compiled(f, 3, torch.randn(3, 4), w, tags=(0, None)) == 0
    assert sum(g.proofs for g in backend.graphs) == 1  # the second call replayed the first's proof
    assert follow_compiled(f, 5, torch.randn(5, 4), w, tags=(0, None)) == 0
    assert follow_compiled(f, 5, torch.randn(5, 4), w, tags=(1, None)) == 1  # along dim 1: proven again
    assert sum(g.proofs for g in backend.graphs) == 3


def test_a_lost_batch_is_replayed_lost_and_a_batch_of_one_is_never_kept():
    torch._dynamo.reset()
    backend = Collecting()
    f = torch.compile(lambda x: x.softmax(0) * 2.0, backend=backend)
    for _ in range(2):
        assert isinstance(follow_compiled(f, 3, torch.randn(3, 4)), Lost)
    assert sum(g.proofs for g in backend.graphs) == 1
    for _ in range(2):
        assert follow_compiled(f, 1, torch.randn(1, 4)) is None  # one sample: nothing to lose, nothing kept
    assert sum(g.proofs for g in backend.graphs) == 3
    assert isinstance(follow_compiled(f, 3, torch.randn(3, 4)), Lost)


def test_a_graph_that_writes_in_place_is_proven_at_every_call():
    torch._dynamo.reset()
    backend = Collecting()

    def scale(x, buffer):
        buffer.add_(x.mean(0))  # the batch's mean written into shared memory
        return x * buffer

    f = torch.compile(scale, backend=backend)
    for _ in range(2):
        assert isinstance(follow_compiled(f, 3, torch.randn(3, 4), torch.zeros(4), tags=(0, None)), Lost)
    assert sum(g.proofs for g in backend.graphs) == 2 and not any(g.proven for g in backend.graphs)


def test_after_cleanup_the_compiled_model_runs_as_the_plain_model():
    torch._dynamo.reset()
    model = Net()
    compiled = torch.compile(model, backend=Collecting())
    hooks = GradSampleHooks(model, grad_sample_mode="hooks", loss_reduction="sum")
    compiled(torch.randn(4, 6)).sum().backward()
    hooks.cleanup()
    model.zero_grad()
    x = torch.randn(5, 6)
    compiled(x).sum().backward()  # the hooks Dynamo kept in its frames are inert: nothing is captured
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert torch._C._len_torch_function_stack() == 0

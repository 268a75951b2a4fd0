"""Audit canaries under FSDP2 (``fully_shard``, two gloo processes) and HSDP (2 x 2): each rank adds its shard's
slice of every sampled canary (under HSDP the ranks of replica 0), so the sum over the ranks is one canary;
scores sum the ranks' partial dot products. The run ends where the same run on one process ends, with the same
scores."""

from __future__ import annotations

import pytest
import torch

from dptorch import BatchMemoryManager, PrivacyEngine
from dptorch.data import DPDataLoader
from dptorch.distributed import ShardedNoise
from tests.distributed import workers

CANARIES, AUDIT_SEED = 20, 5  # the model has 32 trainable elements, split unevenly over the two ranks


def train(kind: str, *, distributed: bool, mesh=None) -> dict:
    """One epoch of ``workers.model_like`` with ``CANARIES`` canaries of ``kind``: FSDP2 per layer when
    ``distributed`` (HSDP on a 2-D ``mesh``), else one process without torch.distributed; the same batches,
    noise and canary draws."""
    from torch.distributed.fsdp import fully_shard

    model = workers.model_like()
    if distributed:
        options = {} if mesh is None else {"mesh": mesh}
        for layer in (model[0], model[3]):
            fully_shard(layer, **options)
        fully_shard(model, **options)
    loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=workers.SAMPLING_SEED,
                          distributed=distributed)
    engine = PrivacyEngine(accountant="rdp")
    _, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        noise_multiplier=workers.SIGMA, max_grad_norm=workers.CLIP, loss_reduction="sum", grad_sample_mode="hooks",
        wrap_model=False, noise_generator=ShardedNoise(seed=workers.NOISE_SEED), audit_canaries=CANARIES,
        audit_canary_kind=kind, audit_seed=AUDIT_SEED)
    canaries = engine.audit_canaries
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as batches:
        for x, y in batches:
            ((model(x) - y) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return {"params": workers.flat_params(model), "scores": canaries.scores.clone(), "steps": canaries.steps,
            "included": canaries.included.clone(), "added": canaries.times_added.clone()}


def canaries_only(kind: str) -> dict:
    """Noise 0 and a loss of 0 on FSDP2: the step's full gradient is the sampled canaries' sum alone."""
    from torch.distributed.fsdp import fully_shard

    model = workers.model_like()
    fully_shard(model)
    loader = DPDataLoader(workers.dataset(), sample_rate=0.9, seed=workers.SAMPLING_SEED, distributed=True)
    engine = PrivacyEngine()
    _, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=workers.CLIP, loss_reduction="sum", wrap_model=False, audit_canaries=CANARIES,
        audit_canary_kind=kind, audit_seed=AUDIT_SEED)
    x, _ = next(iter(loader))
    (0.0 * model(x).sum()).backward()
    optimizer.step()
    canaries = engine.audit_canaries
    sampled = canaries.times_added.double() * float(optimizer.unit_factors(torch.tensor([10 * workers.CLIP])) * 10 * workers.CLIP)
    if kind == "dirac":
        directions = torch.zeros(CANARIES, sum(p.numel() for p in optimizer.params), dtype=torch.float64)
        offsets = [sum(p.numel() for p in optimizer.params[:i]) for i in range(len(optimizer.params))]
        for index, local, canary in canaries._blocks:
            directions[canary.cpu(), local.cpu() + offsets[index]] = 1.0
    else:
        directions = canaries._directions.double()
    grad = torch.cat([p.grad.full_tensor().reshape(-1) for p in optimizer.params]).double()
    return {"grad": grad, "expected": sampled @ directions, "scores": canaries.scores.clone(),
            "expected_scores": directions @ grad, "added": int(canaries.times_added.sum()),
            "shards": [p.to_local().numel() for p in optimizer.params]}


def scenarios(rank: int):
    for kind in ("dirac", "random"):
        yield f"canaries-only-{kind}", lambda kind=kind: canaries_only(kind)
        yield f"fsdp-{kind}", lambda kind=kind: train(kind, distributed=True)


def hsdp_scenarios(rank: int):
    from torch.distributed.device_mesh import init_device_mesh

    yield "hsdp-dirac", lambda: train("dirac", distributed=True, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))


def _spawn(runs, world):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return workers.reader(workers.spawn_all(runs, world=world))


@pytest.fixture(scope="module")
def spawned():
    return _spawn(scenarios, workers.WORLD)


@pytest.fixture(scope="module")
def references():
    return {kind: train(kind, distributed=False) for kind in ("dirac", "random")}


@pytest.mark.parametrize("kind", ["dirac", "random"])
def test_each_rank_adds_its_slice_so_the_ranks_add_each_sampled_canary_once(spawned, kind):
    runs = [spawned(f"canaries-only-{kind}", rank) for rank in range(workers.WORLD)]
    held = [sum(run["shards"]) for run in runs]
    assert min(held) > 0 and sum(held) == runs[0]["grad"].numel()  # sharded: every element on one rank
    assert runs[0]["added"] > 0
    for run in runs:  # C per sampled canary along its direction, once (not once per rank), nothing else
        torch.testing.assert_close(run["grad"], runs[0]["expected"], rtol=1e-6, atol=1e-7)
        assert run["expected"].abs().max() > 0.1 * workers.CLIP
        torch.testing.assert_close(run["scores"], run["expected_scores"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(runs[0]["scores"], runs[1]["scores"], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["dirac", "random"])
def test_a_sharded_run_with_canaries_ends_where_one_process_ends_with_the_same_scores(spawned, references, kind):
    _same_run([spawned(f"fsdp-{kind}", rank) for rank in range(workers.WORLD)], references[kind])


def test_an_hsdp_run_with_canaries_ends_where_one_process_ends_with_the_same_scores(references):
    hsdp = _spawn(hsdp_scenarios, 4)
    _same_run([hsdp("hsdp-dirac", rank) for rank in range(4)], references["dirac"])


def _same_run(runs, reference):
    """Every rank's parameters and scores those of one process (each canary added once), the same everywhere."""
    assert all(run["steps"] == reference["steps"] > 1 for run in runs)
    for run in runs:
        assert torch.equal(run["included"], reference["included"]) and torch.equal(run["added"], reference["added"])
        torch.testing.assert_close(run["params"], reference["params"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(run["scores"], reference["scores"], rtol=1e-5, atol=1e-5)
    assert int(reference["added"].sum()) > 0 and reference["scores"].abs().max() > 0.1
    for run in runs[1:]:
        torch.testing.assert_close(run["scores"], runs[0]["scores"], rtol=0, atol=0)
        torch.testing.assert_close(run["params"], runs[0]["params"], rtol=0, atol=0)

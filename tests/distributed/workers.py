"""Scenarios run in real processes (gloo on loopback) by the distributed tests, and their 1-process references.

``spawn_all()`` starts ``WORLD`` processes once and runs every scenario in them; each scenario
returns plain tensors and numbers, collected in a dict by name. The references (``reference_*``)
run the same training in the test process, without torch.distributed, over the same logical
(Poisson) batches and the same noise stream.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

from dptorch import BatchMemoryManager, PrivacyEngine
from dptorch.data import DPDataLoader
from dptorch.distributed import ShardedNoise
from dptorch.grad_sample import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.noise import NoiseGenerator
from dptorch.optim import DPGradScaler, DPOptimizer

WORLD = 2
SAMPLES = 20
SAMPLE_RATE = 0.3
SAMPLING_SEED = 11
NOISE_SEED = 5
SIGMA, CLIP = 0.6, 0.4
DELTA = 1e-5
# noise-only steps: a parameter big enough to measure a standard deviation to ~1 %
BIG_IN, BIG_OUT, BIG_STEPS, BIG_BATCH = 100, 101, 2, 8.0
CHUNK = 997  # a small prime: ShardedNoise chunks cross the shard boundaries
COLLECTIVE_TIMEOUT_S = 60  # a rank left waiting in a collective fails instead of hanging the suite
SPAWN_TIMEOUT_S = 240


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 5, generator=g) * torch.tensor([0.1, 1, 10, 1, 1])
    return TensorDataset(x, torch.randn(SAMPLES, 2, generator=g))


def model_like() -> nn.Module:
    torch.manual_seed(0)  # 3 rows in the first layer: an uneven FSDP2 split over 2 ranks
    return nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3), nn.Tanh(), nn.Linear(3, 2))


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(d_in, 3), nn.LayerNorm(3), nn.Linear(3, d_out)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))


class Blocks(nn.Module):
    """Two blocks, each run under non-reentrant activation checkpointing when ``checkpointed``."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(5, 4), Block(4, 2)])
        self.checkpointed = checkpointed

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


def blocks_like(checkpointed: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Blocks(checkpointed)


def flat_params(model: nn.Module) -> torch.Tensor:
    values = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        values.append(p.detach().flatten())
    return torch.cat(values)


def train(model: nn.Module, mode: str, *, distributed: bool, ddp: bool = False, shard: str = "", physical: int = 1,
          mesh=None, noise_generator=None, fp16: bool = False) -> dict:
    """One epoch of engine training (BatchMemoryManager, physical batches of at most ``physical``);
    parameters, epsilon, batch counts. ``mesh``: the device mesh of ``fully_shard`` (HSDP: 2-D); ``fp16``:
    the forward under float16 autocast, the loss scaled by a fixed ``DPGradScaler``."""
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    if shard:
        from torch.distributed.fsdp import fully_shard

        kwargs = {} if mesh is None else {"mesh": mesh}
        if shard.startswith("bf16"):  # parameters gathered in bf16 for the forward and backward
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if shard == "offload":  # parameters offloaded to the CPU between uses (pinned memory needs CUDA)
            from torch.distributed.fsdp import CPUOffloadPolicy

            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        if shard in ("per-layer", "offload"):
            for layer in (model[0], model[3]):
                fully_shard(layer, **kwargs)
        elif shard in ("blocks", "bf16-blocks"):
            for block in model.blocks:
                fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DPDataLoader(dataset(), sample_rate=SAMPLE_RATE, seed=SAMPLING_SEED, distributed=distributed)
    engine = PrivacyEngine(accountant="rdp")
    _hooks, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=SIGMA, max_grad_norm=CLIP,
        loss_reduction="sum", grad_sample_mode=mode, wrap_model=False,
        noise_generator=noise_generator or ShardedNoise(seed=NOISE_SEED),
    )
    scaler = DPGradScaler(optimizer, init_scale=2.0**8) if fp16 else None
    per_step, rows_per_step, count, rows = [], [], 0, 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) as batches:
        for x, y in batches:
            count, rows = count + 1, rows + len(x)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                out = model(x)
            loss = ((out.float() - y) ** 2).sum()
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            if not optimizer._last_step_skipped:
                per_step.append(count)
                rows_per_step.append(rows)
                count, rows = 0, 0
    return {
        "params": flat_params(model),
        "epsilon": engine.get_epsilon(DELTA),
        "steps": engine.plan.steps,
        "physical_per_step": per_step,
        "rows_per_step": rows_per_step,
    }


def noise_only(shard: Optional[bool], generator, mesh=None) -> dict:
    """BIG_STEPS noise-only steps (empty batches) on a Linear(BIG_IN, BIG_OUT): the gradient is the noise / B.

    ``shard``: True for FSDP2 (on ``mesh``: HSDP when 2-D), False for DDP, None for one process without
    torch.distributed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(BIG_IN, BIG_OUT))
    if shard:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, **({} if mesh is None else {"mesh": mesh}))
    elif shard is not None:
        model = nn.parallel.DistributedDataParallel(model)
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=SIGMA,
                            max_grad_norm=CLIP, expected_batch_size=BIG_BATCH, noise_generator=generator)
    draws = []
    for _ in range(BIG_STEPS):
        model(torch.zeros(0, BIG_IN)).sum().backward()
        optimizer.step()
        grads = []
        for p in optimizer.params:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads.append(g.flatten())
        local = [p.grad.to_local().flatten() for p in optimizer.params] if shard else []
        draws.append({"full": torch.cat(grads), "local": torch.cat(local) if local else None})
        optimizer.zero_grad()
    hooks.cleanup()
    return {"draws": draws}


class ReadsWeight(nn.Module):
    """Reads its first layer's weight outside that layer's call: a path the controller cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + x @ self.lin.weight.T


def unseen_path_under_ddp() -> str:
    model = nn.parallel.DistributedDataParallel(ReadsWeight())
    hooks = GradSampleHooks(model, loss_reduction="sum")
    DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0,
                expected_batch_size=4)
    try:
        model(torch.randn(3, 4)).sum().backward()
    except PerSampleGradientError as err:
        return str(err)
    finally:
        hooks.cleanup()
    return ""


def ddp_sync_restored() -> dict:
    """After a private forward the DDP module's own sync flag is as before; after cleanup no hook is left."""
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 3))
    hooks = GradSampleHooks(model, loss_reduction="sum", keep_param_grads=False)
    seen = []
    probe = model.register_forward_hook(lambda m, a, o: seen.append(m.require_backward_grad_sync), prepend=True)
    model(torch.randn(2, 3)).sum().backward()
    hooks.clear()
    after_forward = model.require_backward_grad_sync
    hooks.cleanup()
    model(torch.randn(2, 3)).sum().backward()  # plain DDP again: its all-reduce runs
    probe.remove()
    return {"inside": seen, "after": after_forward, "plain_grad": model.module.weight.grad is not None,
            "hooks_left": len(model._forward_pre_hooks) + len(model._forward_hooks)}


class Scaled(nn.Module):
    """A linear layer whose output is scaled by a buffer (DDP broadcasts buffers in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.scale


def ddp_ranks_skip_different_forwards() -> torch.Tensor:
    """Rank 1 skips its first forward (an empty micro-batch, as the private Trainer does): the only
    collective left is the step's all-reduce, so the ranks neither hang nor pair different collectives."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Scaled())
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=4)
    for step in range(3):
        if not (rank == 1 and step == 0):
            model(torch.full((2, 3), float(rank + step))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    hooks.cleanup()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _sharded_private(seed: int, folder: Optional[str] = None, mesh=None, tensor_parallel=None):
    """A per-layer FSDP2 model (on ``mesh``: HSDP when 2-D; or ``tensor_parallel(model)``'s split one, from
    ``tensor_parallel.model``, its loader sharded as ``tensor_parallel.distributed()`` says), momentum SGD and
    the engine (rdp), made private; with ``folder``, resumed from it."""
    from torch.distributed.fsdp import fully_shard

    on = {} if mesh is None else {"mesh": mesh}
    model = model_like() if tensor_parallel is None else tensor_parallel.model()
    if seed:
        torch.manual_seed(seed)  # other initial weights: a resumed run must take the checkpoint's
        for p in model.parameters():
            nn.init.normal_(p)
    if tensor_parallel is not None:
        tensor_parallel(model)
    else:
        for layer in (model[0], model[3]):
            fully_shard(layer, **on)
        fully_shard(model, **on)
    engine = PrivacyEngine(accountant="rdp")
    _hooks, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        data_loader=DPDataLoader(dataset(), sample_rate=SAMPLE_RATE, seed=SAMPLING_SEED,
                                 distributed=True if tensor_parallel is None else tensor_parallel.distributed()),
        noise_multiplier=SIGMA, max_grad_norm=CLIP, loss_reduction="sum", grad_sample_mode="bk", wrap_model=False,
        noise_generator=ShardedNoise(seed=NOISE_SEED),
    )
    if folder is not None:
        engine.load_checkpoint(folder, module=model, optimizer=optimizer, data_loader=loader)
    return engine, model, optimizer, loader


def _sharded_epoch(model, optimizer, loader) -> None:
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as batches:
        for x, y in batches:
            ((model(x) - y) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def sharded_resume(mesh=None, tensor_parallel=None) -> dict:
    """FSDP2 (or tensor-parallel) engine checkpoint: one epoch, save, one more epoch; then a fresh run resumed
    from the save takes the same second epoch. Parameters and epsilon of both, and a save refused mid-step."""
    box = [tempfile.mkdtemp(prefix="dptorch-sharded-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    folder = os.path.join(box[0], "checkpoint")
    engine, model, optimizer, loader = _sharded_private(seed=0, mesh=mesh, tensor_parallel=tensor_parallel)
    _sharded_epoch(model, optimizer, loader)
    engine.save_checkpoint(folder, module=model, optimizer=optimizer, data_loader=loader)
    _sharded_epoch(model, optimizer, loader)
    first = {"params": flat_params(model), "epsilon": engine.get_epsilon(DELTA), "steps": engine.plan.steps}
    engine, model, optimizer, loader = _sharded_private(seed=3, folder=folder, mesh=mesh, tensor_parallel=tensor_parallel)
    _sharded_epoch(model, optimizer, loader)
    resumed = {"params": flat_params(model), "epsilon": engine.get_epsilon(DELTA), "steps": engine.plan.steps}
    x, y = next(iter(loader))
    ((model(x) - y) ** 2).sum().backward()
    try:
        engine.save_checkpoint(os.path.join(box[0], "mid-step"), module=model, optimizer=optimizer)
        mid_step = "accepted"
    except ValueError as error:
        mid_step = str(error)
    return {"first": first, "resumed": resumed, "mid_step": mid_step}


def sharding_refusal() -> str:
    """The error attaching a controller raises on HSDP's placements on a 2-D mesh made by hand (no
    all-gather ever happens; ``"accepted"`` if none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6))
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    for name, p in list(model[0].named_parameters()):
        setattr(model[0], name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate(), Shard(0)])))
    try:
        GradSampleHooks(model, loss_reduction="sum").cleanup()
    except ValueError as error:
        return str(error)
    return "accepted"


def scenarios(rank: int):
    yield "allreduce-hooks", lambda: train(model_like(), "hooks", distributed=True)  # no DDP wrapper at all
    yield "ddp-hooks", lambda: train(model_like(), "hooks", distributed=True, ddp=True)
    yield "ddp-bk", lambda: train(model_like(), "bk", distributed=True, ddp=True)
    yield "ddp-fp16-bk", lambda: train(model_like(), "bk", distributed=True, ddp=True, fp16=True)
    yield "fsdp-per-layer-hooks", lambda: train(model_like(), "hooks", distributed=True, shard="per-layer", physical=3)
    yield "fsdp-whole-bk", lambda: train(model_like(), "bk", distributed=True, shard="whole", physical=3)
    yield "fsdp-per-layer-bk", lambda: train(model_like(), "bk", distributed=True, shard="per-layer", physical=3)
    yield "fsdp-offload-bk", lambda: train(model_like(), "bk", distributed=True, shard="offload", physical=3)
    yield "fsdp-checkpointed-bk", lambda: train(blocks_like(True), "bk", distributed=True, shard="blocks", physical=3)
    yield "fsdp-bf16-checkpointed-hooks", lambda: train(blocks_like(True), "hooks", distributed=True,
                                                        shard="bf16-blocks", physical=3)
    torch.manual_seed(100 + rank)  # the ranks' own generators differ: the stream must still be rank 0's
    yield "noise-fsdp", lambda: noise_only(True, ShardedNoise(NoiseGenerator(seed=NOISE_SEED + rank), chunk_size=CHUNK))
    yield "noise-fsdp-plain-generator", lambda: noise_only(True, NoiseGenerator(seed=NOISE_SEED + rank))
    yield "noise-ddp", lambda: noise_only(False, NoiseGenerator(seed=NOISE_SEED + rank))
    yield "unseen-ddp", unseen_path_under_ddp
    yield "ddp-sync", ddp_sync_restored
    yield "ddp-uneven-forwards", ddp_ranks_skip_different_forwards
    yield "fsdp-resume", sharded_resume


def worker(rank: int, store: str, results, runs=scenarios, world: int = WORLD) -> None:
    # A file store: no TCP port to pick, so concurrent test runs cannot meet in one rendezvous.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.set_num_threads(1)
    try:
        for name, run in runs(rank):
            try:
                results[(name, rank)] = run()
            except Exception:  # reported by the test that reads it
                results[(name, rank)] = {"error": traceback.format_exc()}
                raise
        dist.barrier()  # every rank done before any leaves: one exiting while gloo serves another's work aborts it
    finally:
        dist.destroy_process_group()


def spawn_all(runs=scenarios, world: int = WORLD) -> dict:
    """Run the scenarios of ``runs(rank)`` in ``world`` processes; their results by ``(name, rank)``."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as folder:
        results = manager.dict()
        context = mp.spawn(worker, args=(os.path.join(folder, "store"), results, runs, world), nprocs=world, join=False)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                raise TimeoutError(f"the {world} processes did not finish within {SPAWN_TIMEOUT_S} s; "
                                   f"finished scenarios: {sorted(dict(results))}")
        return dict(results)


def reader(runs: dict):
    """``get(name, rank)``: what scenario ``name`` returned on ``rank``; the test fails with its traceback if it raised."""
    import pytest

    def get(name, rank):
        value = runs[(name, rank)]
        if isinstance(value, dict) and "error" in value:
            pytest.fail(f"scenario {name} failed on rank {rank}:\n{value['error']}")
        return value

    return get


def reference(mode: str = "hooks", model=model_like) -> dict:
    """The same epoch in one process, no torch.distributed: the whole logical batches, the same noise."""
    return train(model(), mode, distributed=False)


def reference_noise(generator) -> list:
    """The noise-only gradients of ``noise_only`` drawn in one process from ``generator`` (rank 0's)."""
    return [draw["full"] for draw in noise_only(None, generator)["draws"]]

"""DP-SGD under DeepSpeed ZeRO on CPU (gloo), run by ``torchrun`` from ``test_deepspeed.py``.

``deepspeed_script.py OUT`` trains the distributed tests' model at ZeRO stages 1 and 2 with the
engine (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``), takes noise-only steps, and
records the refusals; each rank writes ``OUT/deepspeed-rank<r>.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dptorch import BatchMemoryManager, PrivacyEngine  # noqa: E402
from dptorch.data import DPDataLoader  # noqa: E402
from dptorch.distributed import ShardedNoise  # noqa: E402
from tests.distributed import workers  # noqa: E402

# DeepSpeed compiles a shared-memory all-reduce for inference (minutes, once per machine); training never uses it.
# The module, not the attribute: ``deepspeed.comm.torch`` as an attribute is the torch package.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            **extra}


def initialize(model: nn.Module, stage: int, lr: float = 0.5, **extra):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage, **extra))[0]


def train(stage: int, mode: str, physical: int = 1, **extra) -> dict:
    """The distributed tests' epoch (``workers.train``: sum loss, physical batches of at most ``physical``) through
    the DeepSpeed engine; ``extra``: more of DeepSpeed's config."""
    engine = initialize(workers.model_like(), stage, **extra)
    loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=workers.SAMPLING_SEED,
                          distributed=True)
    privacy = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = privacy.make_private(
        module=engine, optimizer=engine.optimizer, data_loader=loader, noise_multiplier=workers.SIGMA,
        max_grad_norm=workers.CLIP, loss_reduction="sum", grad_sample_mode=mode,
        noise_generator=ShardedNoise(seed=workers.NOISE_SEED),
    )
    assert model is engine
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) as batches:
        for x, y in batches:
            dtype = next(engine.module.parameters()).dtype  # bf16: DeepSpeed cast the model, the inputs follow
            loss = ((engine(x.to(dtype)).float() - y) ** 2).sum()
            engine.backward(loss)
            engine.step()
    try:
        privacy.save_checkpoint(os.path.join(tempfile.mkdtemp(prefix="dptorch-ds-"), "checkpoint.pt"), module=engine,
                                optimizer=optimizer)
        checkpoint = "accepted"
    except NotImplementedError as error:
        checkpoint = str(error)
    privacy.detach()
    return {"params": workers.flat_params(engine.module).tolist(), "epsilon": privacy.get_epsilon(workers.DELTA),
            "steps": privacy.plan.steps, "global_steps": engine.global_steps, "checkpoint": checkpoint}


def with_epsilon(stage: int) -> dict:
    """``make_private_with_epsilon`` on a DeepSpeed engine: one epoch at the calibrated noise."""
    engine = initialize(workers.model_like(), stage)
    loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=workers.SAMPLING_SEED,
                          distributed=True)
    privacy = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = privacy.make_private_with_epsilon(
        module=engine, optimizer=engine.optimizer, data_loader=loader, target_epsilon=5.0,
        target_delta=workers.DELTA, max_grad_norm=workers.CLIP, epochs=1, loss_reduction="sum")
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as batches:
        for x, y in batches:
            engine.backward(((model(x) - y) ** 2).sum())
            engine.step()
    privacy.detach()
    return {"same_engine": model is engine, "epsilon": privacy.get_epsilon(workers.DELTA),
            "global_steps": engine.global_steps, "steps": privacy.plan.steps}


def noise_only(stage: int) -> list:
    """BIG_STEPS steps of a Linear(BIG_IN, BIG_OUT) on a loss that is 0 for every sample, lr 1, mean over
    E[B] = BIG_BATCH: each update is minus the noise / BIG_BATCH."""
    torch.manual_seed(0)
    engine = initialize(nn.Sequential(nn.Linear(workers.BIG_IN, workers.BIG_OUT)), stage, lr=1.0)
    rows = 2 * int(workers.BIG_BATCH)
    data = torch.utils.data.TensorDataset(torch.ones(rows, workers.BIG_IN))
    loader = DPDataLoader(data, sample_rate=workers.BIG_BATCH / rows, seed=0, distributed=True)
    privacy = PrivacyEngine(accountant="rdp")
    _, _, loader = privacy.make_private(module=engine, optimizer=engine.optimizer, data_loader=loader,
                                        noise_multiplier=workers.SIGMA, max_grad_norm=workers.CLIP,
                                        loss_reduction="mean", noise_generator=ShardedNoise(seed=workers.NOISE_SEED))
    assert privacy.plan.expected_batch_size == workers.BIG_BATCH
    draws = []
    for _, (x,) in zip(range(workers.BIG_STEPS), loader):
        before = workers.flat_params(engine.module)
        engine.backward((engine(x) * 0).mean())
        engine.step()
        draws.append((before - workers.flat_params(engine.module)).tolist())
    privacy.detach()
    return draws


def refusal(stage: int, client_optimizer: bool = False, **extra) -> str:
    """The error make_private raises for a DeepSpeed set-up (``"accepted"`` if none); ``client_optimizer``: pass
    the torch optimizer DeepSpeed wrapped instead of the one it returned."""
    model = workers.model_like()
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, _optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config(stage, **extra))
    loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=0, distributed=True)
    try:
        PrivacyEngine().make_private(module=engine, optimizer=client if client_optimizer else engine.optimizer,
                                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
    except ValueError as error:
        return str(error)
    return "accepted"


def unseen_path(stage: int) -> dict:
    """A weight read outside its layer's call (``workers.ReadsWeight``): the error of the backward, on every rank,
    and whether DeepSpeed took the raw gradient that reached the weight into its reduction before the refusal."""
    from dptorch.grad_sample.errors import PerSampleGradientError

    torch.manual_seed(0)
    engine = initialize(workers.ReadsWeight(), stage)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    loader = DPDataLoader(data, sample_rate=0.5, seed=0, distributed=True)
    privacy = PrivacyEngine()
    _, _, loader = privacy.make_private(module=engine, optimizer=engine.optimizer, data_loader=loader,
                                        noise_multiplier=1.0, max_grad_norm=1.0, loss_reduction="sum")
    error = "accepted"
    try:
        engine.backward(engine(torch.randn(3, 4)).sum())
    except PerSampleGradientError as refused:
        error = str(refused)
    reduced = sum(bucket.elements for bucket in engine.optimizer.ipg_buckets.values())  # ZeRO-2's gradient buckets
    privacy.detach()
    return {"error": error, "reduced_by_deepspeed": reduced}


def main(out: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    report = {
        "zero1-hooks": train(1, "hooks"),
        "zero2-bk": train(2, "bk", physical=3),
        "zero2-bf16-bk": train(2, "bk", physical=3, bf16={"enabled": True}),
        "noise-zero2": noise_only(2),
        "zero1-with-epsilon": with_epsilon(1),
        "refused-clipping": refusal(2, gradient_clipping=1.0),
        "refused-accumulation": refusal(1, gradient_accumulation_steps=2),
        "unseen-zero2": unseen_path(2),
        "refused-stage3": refusal(3),
        "refused-stage0": refusal(0),
        "refused-offload": refusal(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                   zero_force_ds_cpu_optimizer=False),
        "refused-client-optimizer": refusal(2, client_optimizer=True),
    }
    (out / f"deepspeed-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

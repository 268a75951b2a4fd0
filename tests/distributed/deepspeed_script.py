"""DP-SGD under DeepSpeed ZeRO on CPU (gloo), run by ``torchrun`` from ``test_deepspeed.py``.

``deepspeed_script.py OUT`` trains the distributed tests' model at ZeRO stages 1, 2 and 3 with the
engine (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``), takes noise-only steps, and
records the refusals; each rank writes ``OUT/deepspeed-rank<r>.json``. ZeRO-3 runs with
``stage3_param_persistence_threshold: 0``: every parameter is released outside its module's calls
(by default DeepSpeed keeps parameters under 100k elements whole, which would hide the partitioning).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from dptorch import BatchMemoryManager, PrivacyEngine  # noqa: E402
from dptorch.data import DPDataLoader  # noqa: E402
from dptorch.distributed import ShardedNoise  # noqa: E402
from dptorch.distributed import partitions  # noqa: E402
from tests.distributed import workers  # noqa: E402

# DeepSpeed compiles a shared-memory all-reduce for inference (minutes, once per machine); training never uses it.
# The module, not the attribute: ``deepspeed.comm.torch`` as an attribute is the torch package.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


#: ZeRO-3 with every parameter partitioned and released after each use (none kept whole as "persistent").
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


class TinyLlama(nn.Module):
    """A full fine-tune of a tiny Llama (``nn.Embedding``, ``LlamaRMSNorm``, ``nn.Linear``, untied head) as a regressor of
    the distributed tests' rows: each row's 5 features bucketed into 5 token ids, the last position's first 2 logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=8, tie_word_embeddings=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.detach().abs() * 4).long().clamp(max=15)
        return self.llama(input_ids=ids).logits[:, -1, :2].float()


def config(stage: int, **extra) -> dict:
    if stage == 3:
        extra.setdefault("zero_optimization", ZERO3)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            **extra}


def initialize(model: nn.Module, stage: int, lr: float = 0.5, **extra):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage, **extra))[0]


def full_params(engine) -> torch.Tensor:
    """The model's parameters, flat; under ZeRO-3 gathered from the ranks' partitions (collective: every rank)."""
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return workers.flat_params(engine.module)


def train(stage: int, mode: str, physical: int = 1, bucket: Optional[int] = None, model=workers.model_like,
          phantoms: bool = False, **extra) -> dict:
    """The distributed tests' epoch (``workers.train``: sum loss, physical batches of at most ``physical``) through
    the DeepSpeed engine; ``extra``: more of DeepSpeed's config; ``bucket``: the clipped sums' reduce-scatter bucket
    (in elements of all ranks' rows; default ``partitions.BUCKET``); ``model``: builds the model;
    ``phantoms``: an empty physical batch runs as a phantom (``DPOptimizer.phantom``), for a model that cannot take
    zero rows."""
    if bucket is not None:
        partitions.BUCKET, default = bucket, partitions.BUCKET
        try:
            return train(stage, mode, physical, model=model, phantoms=phantoms, **extra)
        finally:
            partitions.BUCKET = default
    engine = initialize(model(), stage, **extra)
    loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=workers.SAMPLING_SEED,
                          distributed=True)
    privacy = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = privacy.make_private(
        module=engine, optimizer=engine.optimizer, data_loader=loader, noise_multiplier=workers.SIGMA,
        max_grad_norm=workers.CLIP, loss_reduction="sum", grad_sample_mode=mode,
        noise_generator=ShardedNoise(seed=workers.NOISE_SEED),
    )
    assert model is engine
    empty, kept = 0, {"max_held": 0, "held_params": 0}
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer) as batches:
        for x, y in batches:
            empty += not len(x)  # every rank still runs its forward and backward (ZeRO-3 gathers in both)
            dtype = next(engine.module.parameters()).dtype  # bf16: DeepSpeed cast the model, the inputs follow
            if not len(x) and phantoms:  # a model that cannot run on zero rows: a zero row whose backward adds nothing
                with optimizer.phantom():
                    engine.backward((engine(x.new_zeros(1, x.shape[1]).to(dtype)) * 0).sum())
            else:
                engine.backward(((engine(x.to(dtype)).float() - y) ** 2).sum())
            kept = kept_state(optimizer, kept)
            engine.step()
    try:
        privacy.save_checkpoint(os.path.join(tempfile.mkdtemp(prefix="dptorch-ds-"), "checkpoint.pt"), module=engine,
                                optimizer=optimizer)
        checkpoint = "accepted"
    except NotImplementedError as error:
        checkpoint = str(error)
    privacy.detach()
    whole = sum(p.numel() for p in engine.module.parameters())  # ZeRO-3: 0, every parameter released to partitions
    kept.update(owned=owned_elements(engine.optimizer, stage), numels=[int(p.ds_numel if stage == 3 else p.numel())
                                                                       for p in optimizer.params],
                writer=type(optimizer.gradient_writer).__name__, add_noise_replaced="add_noise" in vars(optimizer))
    return {"params": full_params(engine).tolist(), "whole": whole, "epsilon": privacy.get_epsilon(workers.DELTA),
            "steps": privacy.plan.steps, "global_steps": engine.global_steps, "checkpoint": checkpoint, "empty": empty,
            "kept": kept}


def kept_state(optimizer, kept: dict) -> dict:
    """``kept`` after one more backward pass: the most elements of clipped sums the DP optimizer held between the
    passes, and the most parameters it held a part of."""
    held = optimizer._summed
    return {"max_held": max(kept["max_held"], sum(t.numel() for t in held.values())),
            "held_params": max(kept["held_params"], len(held))}


def owned_elements(zero, stage: int) -> int:
    """The elements of trainable parameters in this rank's partitions, by DeepSpeed's own book-keeping: ZeRO-1/2's
    partition size less its padding (``groups_padding``) per group; ZeRO-3's partition of each parameter, less the
    last rank's padding."""
    if stage == 3:
        rank = torch.distributed.get_rank()
        return sum(max(0, min(int(p.partition_numel()), int(p.ds_numel) - rank * int(p.partition_numel())))
                   for group in zero.fp16_groups for p in group)
    return sum(int(size) - int(padding) for size, padding in zip(zero.partition_size, zero.groups_padding))


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


def noise_only(stage: int, secure: bool = False) -> list:
    """BIG_STEPS steps of a Linear(BIG_IN, BIG_OUT) on a loss that is 0 for every sample, lr 1, mean over
    E[B] = BIG_BATCH: each update is minus the noise / BIG_BATCH. ``secure``: secure_mode, each rank's own stream."""
    torch.manual_seed(0)
    engine = initialize(nn.Sequential(nn.Linear(workers.BIG_IN, workers.BIG_OUT)), stage, lr=1.0)
    rows = 2 * int(workers.BIG_BATCH)
    data = torch.utils.data.TensorDataset(torch.ones(rows, workers.BIG_IN))
    loader = DPDataLoader(data, sample_rate=workers.BIG_BATCH / rows, seed=0, distributed=True)
    if secure:  # make_private samples it with the OS CSPRNG, each rank its shard
        loader = torch.utils.data.DataLoader(data, batch_size=int(workers.BIG_BATCH))
    privacy = PrivacyEngine(accountant="rdp", secure_mode=secure)
    _, _, loader = privacy.make_private(module=engine, optimizer=engine.optimizer, data_loader=loader,
                                        noise_multiplier=workers.SIGMA, max_grad_norm=workers.CLIP,
                                        loss_reduction="mean",
                                        noise_generator=None if secure else ShardedNoise(seed=workers.NOISE_SEED))
    assert privacy.plan.expected_batch_size == workers.BIG_BATCH
    draws = []
    for _, (x,) in zip(range(workers.BIG_STEPS), loader):
        before = full_params(engine)
        engine.backward((engine(x) * 0).mean())
        engine.step()
        draws.append((before - full_params(engine)).tolist())
    privacy.detach()
    return draws


class Scale(nn.Module):
    """A per-feature scale: a trainable layer no grad sampler is registered for (the torch.func fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.weight


def refusal(stage: int, client_optimizer: bool = False, model=workers.model_like, mode: str = "auto",
            leaf: bool = False, private: Optional[dict] = None, **extra) -> str:
    """The error make_private raises for a DeepSpeed set-up (``"accepted"`` if none); ``client_optimizer``: pass
    the torch optimizer DeepSpeed wrapped instead of the one it returned; ``leaf``: its Linear layers are ZeRO-3
    leaf modules; ``private``: more of make_private's arguments."""
    model = model()
    if leaf:
        deepspeed.utils.set_z3_leaf_modules(model, [nn.Linear])
    client = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, _optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config(stage, **extra))
    loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=0, distributed=True)
    if private and private.get("noise_mechanism") == "bandmf":
        loader = torch.utils.data.DataLoader(workers.dataset(), batch_size=6)  # make_private samples it cyclically
    privacy = PrivacyEngine()
    try:
        privacy.make_private(module=engine, optimizer=client if client_optimizer else engine.optimizer,
                             data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
                             **(private or {}))
    except ValueError as error:
        return str(error)
    privacy.detach()
    return "accepted"


def after_detach(stage: int) -> dict:
    """One private step, ``detach``, then one plain DeepSpeed step: ZeRO's own gradient hooks and reduction are
    back (the plain step moves the weights by the ranks' average gradient)."""
    engine = initialize(workers.model_like(), stage)
    x, y = workers.dataset().tensors
    loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=0, distributed=True)
    privacy = PrivacyEngine()
    _, _, loader = privacy.make_private(module=engine, optimizer=engine.optimizer, data_loader=loader,
                                        noise_multiplier=1.0, max_grad_norm=1.0, loss_reduction="sum")
    batch, target = next(iter(loader))
    engine.backward(((engine(batch) - target) ** 2).sum())
    engine.step()
    privacy.detach()
    before = full_params(engine)
    rank = torch.distributed.get_rank()
    engine.backward(((engine(x[rank::2]) - y[rank::2]) ** 2).sum())  # each rank its half: DeepSpeed averages
    engine.step()
    return {"before": before.tolist(), "after": full_params(engine).tolist()}


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
        # reduce-scatters of 4 columns per rank: a parameter's sum reaches several buckets, the first layer's bias
        # lies in both ranks' partitions; round-robin gradients reorder ZeRO-2's flat buffer
        "zero1-hooks-buckets": train(1, "hooks", bucket=8),
        "zero2-bk-round-robin": train(2, "bk", physical=3, bucket=8,
                                      zero_optimization={"stage": 2, "round_robin_gradients": True}),
        "zero2-bf16-bk": train(2, "bk", physical=3, bf16={"enabled": True}),
        "zero1-bf16-hooks": train(1, "hooks", bf16={"enabled": True}),
        # fp32 gradient accumulation: ZeRO-2 keeps its own gradient partition buffer, which the step reads past
        "zero2-bf16-fp32-accumulation-bk": train(2, "bk", physical=3, bf16={"enabled": True},
                                                 data_types={"grad_accum_dtype": "fp32"}),
        "noise-zero2": noise_only(2),
        "zero1-with-epsilon": with_epsilon(1),
        "refused-clipping": refusal(2, gradient_clipping=1.0),
        "refused-accumulation": refusal(1, gradient_accumulation_steps=2),
        "unseen-zero2": unseen_path(2),
        "zero3-hooks": train(3, "hooks", bucket=8),  # several reduce-scatters: buckets of 1 to 2 parameters
        "zero3-bk": train(3, "bk", physical=3),
        "zero3-ghost": train(3, "ghost", physical=3),
        "zero3-bf16-bk": train(3, "bk", physical=3, bf16={"enabled": True}),
        # a full fine-tune: Embedding, LlamaRMSNorm, Linear (a Llama cannot run on zero rows: phantoms)
        "zero3-llama-hooks": train(3, "hooks", model=TinyLlama, phantoms=True),
        "zero3-llama-bk": train(3, "bk", physical=3, model=TinyLlama, phantoms=True),
        "noise-zero3": noise_only(3),
        "noise-zero3-secure": noise_only(3, secure=True),
        "unseen-zero3": unseen_path(3),
        "after-detach-zero3": after_detach(3),
        "refused-zero3-no-sampler": refusal(3, model=lambda: nn.Sequential(nn.Linear(5, 2), Scale())),
        "refused-zero3-conv": refusal(3, model=lambda: nn.Sequential(nn.Conv1d(2, 2, 1))),
        "refused-zero3-functorch": refusal(3, mode="functorch"),
        "refused-zero3-leaf": refusal(3, leaf=True),
        "refused-zero3-bandmf": refusal(3, private={"noise_mechanism": "bandmf", "bands": 2}),
        "refused-zero2-bandmf": refusal(2, private={"noise_mechanism": "bandmf", "bands": 2}),
        "refused-stage0": refusal(0),
        "refused-offload": refusal(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                   zero_force_ds_cpu_optimizer=False),
        "refused-client-optimizer": refusal(2, client_optimizer=True),
    }
    (out / f"deepspeed-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Step time, peak memory and collective bytes per rank: 1, 2 and 4 processes, non-private against private.

    python benchmarks/distributed.py [--width 256] [--layers 4] [--seq 32] [--batch 32] [--steps 7]
                                     [--modes bk hooks] [--device cpu|cuda] [--configs ...]
    python benchmarks/distributed.py --comm-table   # computed collective bytes, 8B Llama on 64 GPUs

A small transformer-shaped model (token embedding, ``--layers`` blocks of LayerNorm + two-layer MLP
of width ``4 * --width``, LM head; no attention, which has no parameters to clip) trained on random
tokens. The *global* batch is ``--batch`` sequences of ``--seq`` tokens: one process takes all of
it, two or four processes split it (DDP; FSDP2 with ``fully_shard`` on every block and the
root; HSDP: the same on a 2 x 2 ``(replicate, shard)`` mesh; ZeRO-1, 2, 3: DeepSpeed's engine, its loop
``engine(x)``, ``engine.backward(loss)``, ``engine.step()``, made private as ``make_private`` makes it); under tensor
parallelism (TP: every block's MLP split column-wise then row-wise) every process runs the whole batch. Every configuration runs in fresh processes (gloo on loopback for 2 CPU processes, one
intra-op thread each); the step is forward, backward and optimizer step (plus clipping and noise
when private), median of ``--steps`` steps after two warm-up steps.

Collective bytes per rank per step: the size of the full tensor of every collective called through
``torch.distributed``'s Python API (all-reduce, reduce-scatter, all-gather, broadcast; object
collectives by their pickled size), counted by wrapping those functions (FSDP2's own all-gathers
and reduce-scatters included). What a rank sends on a ring is (n-1)/n of that (2(n-1)/n for an
all-reduce). DDP's own gradient
all-reduce runs in its C++ reducer and is not seen: for plain DDP it is the parameters' bytes per
step (added to the figure, marked ``+reducer``); private DDP switches it off and all-reduces the
clipped sums through the Python API (counted). Tensor parallelism's own all-reduces of activations go
through functional collectives and are not counted either (``plain TP`` shows 0); ``private TP`` shows
what DP adds: the partial per-sample norms, rank 0's step key and the replicated parameters' gradients.
DeepSpeed's collectives go through ``torch.distributed`` too; for its rows the functions it calls besides
(``reduce``, ``reduce_scatter``, ``all_gather``, ``distributed_c10d._all_gather_base``) are counted as well, wrapped
before DeepSpeed's backend caches them.

Peak memory per rank: on CPU the growth of the process's peak RSS over the step loop (the model
and optimizer state are built before, so what shows is activations, gradients and what DP adds);
on CUDA ``torch.cuda.max_memory_allocated`` over the loop. The largest rank is reported. Prints a
table and writes ``distributed.json`` into a fresh folder (``--out-dir``; printed at the end), or
into ``benchmarks/results/`` with ``--update-committed``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from benchmarks.output_place import RESULTS, OutputPlace, add_output_flags
except ImportError:  # run as a script: benchmarks/ is on the path
    from output_place import RESULTS, OutputPlace, add_output_flags

CONFIGS = [
    # (name, processes, parallel, private)
    ("plain", 1, "none", False),
    ("plain DDP", 2, "ddp", False),
    ("plain FSDP2", 2, "fsdp", False),
    ("private", 1, "none", True),
    ("private DDP", 2, "ddp", True),
    ("private FSDP2", 2, "fsdp", True),
    ("plain DDP x4", 4, "ddp", False),
    ("plain FSDP2 x4", 4, "fsdp", False),
    ("plain HSDP 2x2", 4, "hsdp", False),
    ("private DDP x4", 4, "ddp", True),
    ("private FSDP2 x4", 4, "fsdp", True),
    ("private HSDP 2x2", 4, "hsdp", True),
    ("plain TP", 2, "tp", False),
    ("private TP", 2, "tp", True),
    ("plain TP x4", 4, "tp", False),
    ("private TP x4", 4, "tp", True),
    ("plain ZeRO-1", 2, "zero1", False),
    ("private ZeRO-1", 2, "zero1", True),
    ("plain ZeRO-2", 2, "zero2", False),
    ("private ZeRO-2", 2, "zero2", True),
    ("plain ZeRO-3", 2, "zero3", False),
    ("private ZeRO-3", 2, "zero3", True),
    ("plain ZeRO-1 x4", 4, "zero1", False),
    ("private ZeRO-1 x4", 4, "zero1", True),
    ("plain ZeRO-2 x4", 4, "zero2", False),
    ("private ZeRO-2 x4", 4, "zero2", True),
    ("plain ZeRO-3 x4", 4, "zero3", False),
    ("private ZeRO-3 x4", 4, "zero3", True),
]
DEEPSPEED = ("zero1", "zero2", "zero3")

#: The ``torch.distributed`` functions whose payload is counted, and the argument holding the full tensor
#: (the one reduced, scattered from, or gathered into).
COUNTED = {"all_reduce": 0, "broadcast": 0, "reduce_scatter_tensor": 1, "reduce_scatter_single": 1,
           "_reduce_scatter_base": 1, "all_gather_into_tensor": 0, "all_gather_single": 0, "_all_gather_base": 0}
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object")
#: What DeepSpeed's ``deepspeed.comm`` calls besides (list arguments: their tensors' bytes added up); wrapped before
#: DeepSpeed's backend caches ``all_gather_into_tensor`` and ``reduce_scatter_tensor``. ``_all_gather_base`` it calls
#: on ``distributed_c10d``.
DEEPSPEED_COUNTED = {"reduce": 0, "reduce_scatter": 1, "all_gather": 0, "all_reduce_coalesced": 0,
                     "all_to_all_single": 1}


def count_collective_bytes(deepspeed: bool = False) -> dict:
    """Wrap ``torch.distributed``'s collectives to add their payload bytes to the returned counter (``deepspeed``:
    also those ``deepspeed.comm`` calls, :data:`DEEPSPEED_COUNTED`)."""
    import pickle

    counter = {"bytes": 0}

    def wrap(function, position):
        import inspect

        signature = inspect.signature(function)
        name = list(signature.parameters)[position]

        def counted(*args, **kwargs):
            tensor = signature.bind_partial(*args, **kwargs).arguments.get(name)  # FSDP2 passes keywords
            for piece in tensor if isinstance(tensor, (list, tuple)) else [tensor]:
                if isinstance(piece, torch.Tensor):
                    counter["bytes"] += piece.numel() * piece.element_size()
            return function(*args, **kwargs)
        return counted

    def wrap_objects(function):
        def counted(objects, *args, **kwargs):
            counter["bytes"] += len(pickle.dumps(objects))
            return function(objects, *args, **kwargs)
        return counted

    for name, position in {**COUNTED, **(DEEPSPEED_COUNTED if deepspeed else {})}.items():
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name), position))
    if deepspeed:
        c10d = dist.distributed_c10d
        c10d._all_gather_base = wrap(c10d._all_gather_base, 0)
    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, wrap_objects(getattr(dist, name)))
    return counter


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([MLPBlock(width) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run(rank: int, world: int, port: int, opts: dict, parallel: str, private: bool, mode: str, results) -> None:
    device = torch.device(opts["device"], rank) if opts["device"] == "cuda" else torch.device("cpu")
    if opts["device"] == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(opts["threads"])
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if opts["device"] == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    counter = count_collective_bytes(parallel in DEEPSPEED) if world > 1 else {"bytes": 0}
    torch.manual_seed(0)
    vocab, width, layers, seq = opts["vocab"], opts["width"], opts["layers"], opts["seq"]
    model = TinyLM(vocab, width, layers).to(device)
    local_batch = opts["batch"] if parallel == "tp" else opts["batch"] // world
    engine = None
    if parallel in DEEPSPEED:
        engine = deepspeed_engine(model, int(parallel[-1]), local_batch, rank, world, device)
    elif parallel == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif parallel in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape = (2, world // 2) if parallel == "hsdp" else (world,)
        names = ("replicate", "shard") if parallel == "hsdp" else ("shard",)
        mesh = {"mesh": init_device_mesh(device.type, shape, mesh_dim_names=names)}
        for block in model.blocks:
            fully_shard(block, **mesh)
        fully_shard(model, **mesh)
    elif parallel == "tp":  # each block's MLP split: up by columns, down by rows (every rank runs the whole batch)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if engine is None else None
    if private:
        from dptorch.grad_sample import GradSampleHooks
        from dptorch.optim import DPOptimizer

        if engine is not None:  # what make_private does with a DeepSpeed engine
            from dptorch.distributed import deepspeed as ds_zero

            optimizer = ds_zero.DeepSpeedHandOver(engine)
        hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode)
        optimizer = DPOptimizer(optimizer, hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0,
                                expected_batch_size=float(opts["batch"]))
        if engine is not None:
            ds_zero.attach(engine, optimizer)  # engine.step() is the DP step
    generator = torch.Generator().manual_seed(0 if parallel == "tp" else rank)
    batches = [torch.randint(0, vocab, (local_batch, seq + 1), generator=generator).to(device)
               for _ in range(opts["steps"] + 2)]
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    if opts["device"] == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_rss_mib()
    times, sent = [], []
    for ids in batches:
        counted = counter["bytes"]
        start = time.perf_counter()
        if engine is not None:  # DeepSpeed's loop
            logits = engine(ids[:, :-1])
            engine.backward(loss_fn(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)))
            engine.step()
        else:
            logits = model(ids[:, :-1])
            loss_fn(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()
        if opts["device"] == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        sent.append(counter["bytes"] - counted)
    if opts["device"] == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = peak_rss_mib() - before
    reducer = 0
    if parallel == "ddp" and not private:  # DDP's C++ reducer all-reduces every gradient: not seen by the wrapper
        reducer = sum(p.numel() * p.element_size() for p in model.parameters())
    results[rank] = {"step_ms": 1000 * statistics.median(times[2:]), "peak_mib": peak,
                     "comm_mib": (statistics.median(sent[2:]) + reducer) / 2**20, "reducer": bool(reducer)}
    if world > 1:
        dist.destroy_process_group()


def deepspeed_engine(model: nn.Module, stage: int, local_batch: int, rank: int, world: int, device: torch.device):
    """``model`` under DeepSpeed ZeRO ``stage`` (SGD, fp32, no gradient clipping, DeepSpeed's other defaults), on the
    process group already initialised."""
    import importlib

    if device.type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # inference only; minutes to build
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": local_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=config)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, world: int, parallel: str, private: bool, mode: str, opts: dict) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(run, args=(world, free_port(), opts, parallel, private, mode, results), nprocs=world, join=True)
        per_rank = [results[r] for r in range(world)]
    return {
        "config": name, "processes": world, "mode": mode if private else "-",
        "step_ms": max(r["step_ms"] for r in per_rank), "peak_mib_per_rank": max(r["peak_mib"] for r in per_rank),
        "comm_mib_per_rank": max(r["comm_mib"] for r in per_rank), "reducer_added": per_rank[0]["reducer"],
    }


# ------------------------------------------------------------------------------------------------
# Computed (not measured) memory per rank for Llama-shaped 7B / 70B models in "bk" mode.

MODELS = {
    # name: (layers, width, mlp width, key/value width (GQA), vocab)
    "7B": (32, 4096, 11008, 4096, 32000),
    "70B": (80, 8192, 28672, 1024, 32000),
}
GiB = 2**30


def model_sizes(layers, d, d_ff, d_kv, vocab):
    """(parameters in total, parameters of one decoder layer, largest single parameter)."""
    per_layer = 2 * d * d + 2 * d * d_kv + 3 * d * d_ff + 2 * d
    return layers * per_layer + 2 * vocab * d + d, per_layer, max(vocab * d, d * d_ff)


def kept_values_per_token(layers, d, d_ff, d_kv, vocab, lora_rank=None):
    """Values bk keeps per token until the end of backward: each hooked call's input (A) and output gradient (B).

    Full fine-tuning: every Linear (q, k, v, o, gate, up, down), both RMSNorms, the embedding's B
    and the LM head (B is a whole vocabulary row per token). Calls that share their input tensor
    (q/k/v, gate/up) keep it once. LoRA (rank r on q and v): lora_A keeps x (shared) and its
    r-wide B, lora_B keeps its r-wide A and a d- or d_kv-wide B.
    """
    if lora_rank is not None:
        r = lora_rank
        return layers * (d + 2 * r + 2 * r + d + d_kv)
    a = 3 * d + d_ff + 2 * d  # inputs of q/k/v, o, gate/up, down; the two norms
    b = d + 2 * d_kv + d + 2 * d_ff + d + 2 * d
    return layers * (a + b) + d + (d + vocab) + 2 * d  # embedding B, LM head A and B, final norm


def memory_rows(tokens_per_rank: int = 4 * 2048, lora_rank: int = 16):
    """One row per (model, method, parallelism, processes, tokens per physical batch): GiB per rank."""
    rows = []
    small = max(tokens_per_rank // 8, 1)  # the physical batch full 70B fine-tuning can afford
    plans = [("7B", "LoRA", "DDP", 8, tokens_per_rank), ("7B", "LoRA", "FSDP2", 8, tokens_per_rank),
             ("7B", "full", "FSDP2", 8, tokens_per_rank), ("70B", "LoRA", "FSDP2", 8, tokens_per_rank),
             ("70B", "full", "FSDP2", 8, small), ("70B", "full", "FSDP2", 32, small)]
    for name, method, parallel, ranks, tokens_per_rank in plans:
        layers, d, d_ff, d_kv, vocab = MODELS[name]
        total, per_layer, largest = model_sizes(layers, d, d_ff, d_kv, vocab)
        shards = ranks if parallel == "FSDP2" else 1
        if method == "full":
            # fp32 master parameters 4 + Adam m, v 8 + DP accumulator 4 + p.grad at the step 4, all sharded
            state = 20 * total / shards
            kept = kept_values_per_token(layers, d, d_ff, d_kv, vocab)
            transient = 4 * largest  # one parameter's full-size fp32 clipped sum before its reduce-scatter
        else:
            lora = layers * 2 * lora_rank * (d + (d + d_kv) / 2)
            state = 2 * total / shards + 20 * lora  # bf16 frozen base (sharded or not) + adapter training state
            kept = kept_values_per_token(layers, d, d_ff, d_kv, vocab, lora_rank)
            transient = 0
        gathered = 2 * 2 * per_layer if parallel == "FSDP2" else 0  # bf16 layer in use + the prefetched one
        activations = tokens_per_rank * (2 * layers * d + 2 * 12 * d + 2 * 4 * vocab)  # checkpoints, 1 layer, fp32 logits + grad
        dp_kept = 2 * tokens_per_rank * kept  # bf16
        rows.append({
            "model": name, "method": method, "parallel": parallel, "ranks": ranks, "tokens": tokens_per_rank,
            "kept_mib_per_1k_tokens": 2 * 1024 * kept / 2**20,
            "params_B": total / 1e9, "state": state / GiB, "gathered": (gathered + transient) / GiB,
            "activations": activations / GiB, "bk_kept": dp_kept / GiB,
            "total": (state + gathered + transient + activations + dp_kept) / GiB,
        })
    return rows


def print_memory_table(tokens_per_rank: int, lora_rank: int) -> None:
    print(f"Computed, not measured: bf16 weights and activations, activation checkpointing per layer, AdamW "
          f"(fp32 states), LoRA rank {lora_rank} on q and v; tokens = tokens per rank per physical batch.")
    print("| model | method | parallel | ranks | tokens | training state | gathered + clipped-sum buffers "
          "| activations | bk: kept A and B (per 1k tokens) | total per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in memory_rows(tokens_per_rank, lora_rank):
        print(f"| {r['model']} ({r['params_B']:.2f} B) | {r['method']} | {r['parallel']} | {r['ranks']} | "
              f"{r['tokens']} | {r['state']:.1f} GiB | {r['gathered']:.1f} GiB | {r['activations']:.1f} GiB | "
              f"{r['bk_kept']:.1f} GiB ({r['kept_mib_per_1k_tokens']:.0f} MiB) | **{r['total']:.1f} GiB** |")


# ------------------------------------------------------------------------------------------------
# Computed (not measured) collective bytes per rank and optimizer step: 8B Llama on 64 GPUs.

LLAMA_8B = (32, 4096, 14336, 1024, 128256)  # layers, width, MLP width, key/value width (GQA), vocab


def ring(kind: str, size: float, ranks: int) -> float:
    """Bytes one rank sends in a ring collective over ``ranks`` whose full tensor has ``size`` bytes."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    return 2 * share * size if kind == "all_reduce" else share * size  # reduce-scatter, all-gather: once


def comm_rows(micro_batches: int = 1, gpus: int = 64, replicas: int = 8):
    """(set-up, plain bytes, private bytes, what differs) per rank and optimizer step of ``micro_batches``
    backward passes: bf16 parameters gathered for forward and backward, gradients reduced in fp32
    (private: the clipped sums, always fp32)."""
    params = model_sizes(*LLAMA_8B)[0]
    k, shards = micro_batches, gpus // replicas
    fp32, bf16 = 4 * params, 2 * params
    key = 8 * 2  # the step's noise key, broadcast (sharded noise): one int, pickled
    rows = [
        ("DDP, 64 ranks", ring("all_reduce", fp32, gpus) * k, ring("all_reduce", fp32, gpus),
         "one all-reduce per step, of the noised clipped sums (rank 0 adds the noise first); plain DDP all-reduces "
         "every backward pass unless the loop uses no_sync()"),
        ("FSDP2, 64 shards", k * (2 * ring("all_gather", bf16, gpus) + ring("reduce_scatter", fp32, gpus)),
         k * (2 * ring("all_gather", bf16, gpus) + ring("reduce_scatter", fp32, gpus)) + key,
         "the same; plus the noise key (16 bytes); a bf16 reduce_dtype halves plain's reduce-scatter, not ours"),
        (f"HSDP, {replicas} x {shards}",
         k * (2 * ring("all_gather", bf16, shards) + ring("reduce_scatter", fp32, shards)
              + ring("all_reduce", fp32 / shards, replicas)),
         k * (2 * ring("all_gather", bf16, shards) + ring("reduce_scatter", fp32, shards))
         + ring("all_reduce", fp32 / shards, replicas) + key,
         "the replicas' all-reduce runs once per step (FSDP2's default: once per backward pass)"),
        tp_fsdp_row(k, gpus, replicas),
    ]
    return params, rows


def tp_fsdp_row(k: int, gpus: int, tp: int, batch_per_rank: int = 16):
    """TP x FSDP2 (``gpus / tp`` dp ranks x ``tp``): every Linear of the decoder layers split over tp (the
    usual plan), the embedding, the norms and the LM head replicated over tp (dptorch refuses a row-split
    embedding) and FSDP2-sharded over dp. Tensor parallelism's own activation all-reduces are the same
    with and without DP and are left out."""
    layers, d, d_ff, d_kv, vocab = LLAMA_8B
    total, per_layer, _ = model_sizes(*LLAMA_8B)
    split = layers * (2 * d * d + 2 * d * d_kv + 3 * d * d_ff)  # q, k, v, o, gate, up, down
    whole = total - split  # embedding, LM head, norms
    dp = gpus // tp
    per_rank = split / tp + whole  # a rank's tensor-parallel slice of every parameter (before FSDP2)
    plain = k * (2 * ring("all_gather", 2 * per_rank, dp) + ring("reduce_scatter", 4 * per_rank, dp))
    norms = k * ring("all_reduce", 4 * batch_per_rank * layers * 7, tp)  # partial norms, once per backward
    replicated = ring("all_gather", 4 * whole / dp, tp)  # rank 0's sums of the tp-replicated shards, broadcast
    private = plain + norms + replicated + 16
    return (f"TP x FSDP2, {dp} x {tp}", plain, private,
            f"the same gathers and reduce-scatters (of each slice over dp); plus the partial per-sample norms "
            f"({batch_per_rank} samples per rank, all-reduced over tp per backward pass) and the tp-replicated "
            f"parameters' clipped sums ({whole / 1e9:.2f} B: embedding, LM head, norms; this rank's dp shard), "
            "broadcast over tp once per step")


def print_comm_table(micro_batches: int) -> None:
    params, rows = comm_rows(micro_batches)
    print(f"Computed, not measured: {params / 1e9:.2f} B parameters (8B Llama), {micro_batches} backward pass(es) per "
          "step, ring collectives (a rank sends 2(n-1)/n of an all-reduce's tensor, (n-1)/n of a reduce-scatter's or "
          "an all-gather's); bf16 gathers, fp32 gradient reduction.")
    print("| set-up | plain (GB per rank and step) | private (GB per rank and step) | what private changes |")
    print("|---|---|---|---|")
    for name, plain, private, note in rows:
        print(f"| {name} | {plain / 1e9:.2f} | {private / 1e9:.2f} | {note} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-table", action="store_true", help="print the computed 7B/70B table and exit")
    parser.add_argument("--comm-table", action="store_true",
                        help="print the computed collective bytes of an 8B Llama on 64 GPUs and exit")
    parser.add_argument("--micro-batches", type=int, default=1, help="backward passes per step (--comm-table)")
    parser.add_argument("--tokens-per-rank", type=int, default=4 * 2048)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--modes", nargs="+", default=["bk"], help="private modes (hooks, bk, ghost)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--configs", nargs="+", default=None, help="subset of: " + ", ".join(c[0] for c in CONFIGS))
    add_output_flags(parser, "benchmarks/results/distributed.json")
    args = parser.parse_args()
    if args.memory_table:
        print_memory_table(args.tokens_per_rank, args.lora_rank)
        return
    if args.comm_table:
        print_comm_table(args.micro_batches)
        return
    opts = {k: getattr(args, k) for k in ("width", "layers", "vocab", "seq", "batch", "steps", "threads", "device")}
    if args.device == "cuda":
        opts["threads"] = max(opts["threads"], 1)
    rows = []
    for name, world, parallel, private in CONFIGS:
        if args.configs and name not in args.configs:
            continue
        if args.device == "cuda" and world > torch.cuda.device_count():
            print(f"skipping {name}: needs {world} GPUs")
            continue
        for mode in (args.modes if private else ["-"]):
            rows.append(measure(name, world, parallel, private, mode, opts))
            r = rows[-1]
            print(f"{r['config']:<17} {r['processes']:>2} proc  {r['mode']:<5} {r['step_ms']:9.1f} ms/step  "
                  f"{r['peak_mib_per_rank']:8.1f} MiB/rank  {r['comm_mib_per_rank']:8.2f} MiB sent/rank", flush=True)
    params = sum(p.numel() for p in TinyLM(args.vocab, args.width, args.layers).parameters())
    print(f"\nmodel: {params / 1e6:.2f} M parameters; global batch {args.batch} x {args.seq} tokens; device {args.device}")
    print("| config | processes | mode | step (ms) | peak memory per rank (MiB) | collective payload per rank and step (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        reducer = " (+reducer)" if r["reducer_added"] else ""
        print(f"| {r['config']} | {r['processes']} | {r['mode']} | {r['step_ms']:.1f} | {r['peak_mib_per_rank']:.1f} | "
              f"{r['comm_mib_per_rank']:.2f}{reducer} |")
    place = OutputPlace(args, "distributed")
    place.file("distributed.json", RESULTS / "distributed.json").write_text(json.dumps({"options": opts, "rows": rows}, indent=1))
    place.report()


if __name__ == "__main__":
    main()

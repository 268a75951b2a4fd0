"""End-to-end step time and peak memory of tiny transformers, non-private against private modes.

    python benchmarks/models.py [--shapes narrow wide] [--modes nonprivate hooks] [--steps 7]
    python benchmarks/models.py --summarize run1.json run2.json run3.json
    python benchmarks/models.py --device cuda --dtype bfloat16 --shapes gpt2-small llama-1b
    python benchmarks/models.py --shapes narrow-mixtral   # mixture of experts (opt-in; floor skips expert banks)
    python benchmarks/models.py --shapes narrow-gpt2-tied --modes nonprivate bk compiled-plain compiled-bk compiled-hooks
    python benchmarks/models.py --shapes narrow-gpt2-tied wide-gpt2 long-gpt2 --modes nonprivate compiled-plain captured-bk
    python benchmarks/models.py --device cuda --dtype bfloat16 --shapes llama-1b --batch 8 --seq 1024 --lora 16 \
        --modes nonprivate bk compiled-plain compiled-bk compiled-hooks

Each (model, mode) runs in its own process: one full optimizer step per iteration (forward,
backward, and for private modes clipping, noise and the update), median of ``--steps`` steps
after two warm-up steps, with the optimizer built by hand (a fixed batch). Peak memory is the
process's peak RSS over the step loop. Then each dptorch mode and the plain step run again in
their own processes through the path users take (``--engine-steps``, default 10; 0 skips it):
``make_private`` with its Poisson DP data loader, the same draws (seed 0) for the plain step (plain
SGD on the same loader), each step's peak RSS and the RSS after it recorded, so a private step is
compared with the plain step on the same batch and a climb over the steps shows.
Prints a table and writes models.json into a fresh folder (``--out-dir``; printed at the end), or
into benchmarks/results/ with ``--update-committed``. Opacus (an optional peer, ``pip install
dptorch[bench]``) runs the same model and batch in modes ``opacus-hooks`` and ``opacus-ghost``
(its ghost clipping with ``DPLossFastGradientClipping``); hooks and bk are compared against them.
Mode ``floor`` is the non-private step plus the work no exact DP-SGD step can skip, timed alone:
each trainable Linear / Conv1D / Embedding call's per-sample gradient norms, ghost or
instantiated as bk chooses (``shared_inputs.ghost_norms_chosen``; a tied weight's uses each once: a lower bound; an
instantiated gradient stands in for the weight gradient, so only its norm and its weighted sum
are counted), and one Gaussian draw per parameter; bk is reported against it.
Modes ``captured-bk`` and ``captured-hooks`` (opt-in) run the fixed batch through ``dptorch.capture_step``: forward,
loss, backward and clipping one graph traced once, compiled by inductor, then ``optimizer.step()``; compared with
``compiled-plain`` like the compiled modes (not through make_private: its Poisson sizes would each be a trace;
benchmarks/captured_step.py times that path with fixed-shape draws).
Modes ``compiled-plain``, ``compiled-bk`` and ``compiled-hooks`` (opt-in; benchmarks/compiled.py) run the
step with the model under ``torch.compile``, the private ones compiled after the controller is attached
(``make_private(..., wrap_model=False)``'s order; through make_private exactly that, the batch dim marked
dynamic for the Poisson draws; their private forwards run eagerly); each is compared with ``compiled-plain``. The compile time (the warm-up
steps beyond as many median steps), the graphs compiled, the graph breaks and the recompilations after
the first step are reported apart from the step time. ``--lora R`` trains LoRA adapters of rank R on
every linear layer (peft) instead of all the weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:
    from benchmarks.compiled import MODES as COMPILED_MODES
    from benchmarks.compiled import CompileWatch, compile_seconds, describe, max_difference, split_mode
    from benchmarks.output_place import RESULTS, OutputPlace, add_output_flags
except ImportError:  # run as a script: benchmarks/ is on the path
    from compiled import MODES as COMPILED_MODES
    from compiled import CompileWatch, compile_seconds, describe, max_difference, split_mode
    from output_place import RESULTS, OutputPlace, add_output_flags

SHAPES = {
    # name: (family, layers, width, seq, batch, vocab, tied[, key-value heads (Llama GQA), default: all heads])
    "narrow-gpt2-tied": ("gpt2", 4, 256, 128, 16, 5000, True),
    "narrow-gpt2-untied": ("gpt2", 4, 256, 128, 16, 5000, False),
    "narrow-llama": ("llama", 4, 256, 128, 16, 5000, False),
    "wide-gpt2": ("gpt2", 2, 768, 128, 16, 5000, True),
    "wide-llama": ("llama", 2, 768, 128, 16, 5000, False, 4),
    "long-gpt2": ("gpt2", 4, 256, 2048, 4, 5000, True),
}
GPU_SHAPES = {  # B x T = 16 x 1024, for --device cuda (too large for the CPU defaults)
    "gpt2-small": ("gpt2", 12, 768, 1024, 16, 50257, True),  # 124M parameters
    "llama-1b": ("llama", 16, 2048, 1024, 16, 32000, False, 8),  # a 1B Llama shape with GQA
}
MOE_SHAPES = {  # opt-in (--shapes narrow-mixtral): Mixtral's expert banks, 4 experts, top-2 per token
    "narrow-mixtral": ("mixtral", 4, 256, 128, 16, 5000, False, 4),
}
DISPATCH_BOUND_SHAPES = {  # opt-in: the host-bound shape of docs/performance.md (12 x 64, B 1, T 4)
    "tiny-gpt2": ("gpt2", 12, 64, 4, 1, 5000, True),
}
CPU_SHAPES = list(SHAPES)
SHAPES.update(GPU_SHAPES)
SHAPES.update(MOE_SHAPES)
SHAPES.update(DISPATCH_BOUND_SHAPES)
#: The captured private step (dptorch.capture_step), its graph compiled by inductor: on the fixed batch only.
CAPTURED_MODES = ("captured-bk", "captured-hooks")
MODES = ("nonprivate", "floor", "hooks", "bk", "ghost", "ew", "functorch", "opacus-hooks", "opacus-ghost", *COMPILED_MODES,
         *CAPTURED_MODES)


def build(family, layers, width, vocab, tied, kv_heads=None):
    import transformers

    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1), vocab_size=vocab,
                                      n_positions=2048, tie_word_embeddings=tied, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        return transformers.GPT2LMHeadModel(cfg)
    if family == "mixtral":  # kv_heads slot: the number of experts; no router auxiliary loss (it couples samples)
        cfg = transformers.MixtralConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
                                         num_attention_heads=max(width // 64, 1), num_key_value_heads=max(width // 64, 1),
                                         num_local_experts=kv_heads or 4, num_experts_per_tok=2, vocab_size=vocab,
                                         max_position_embeddings=2048, tie_word_embeddings=tied, router_aux_loss_coef=0.0,
                                         router_jitter_noise=0.0)
        return transformers.MixtralForCausalLM(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=4 * width,
                                   num_attention_heads=max(width // 64, 1), num_key_value_heads=kv_heads or max(width // 64, 1),
                                   vocab_size=vocab, max_position_embeddings=2048, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def with_lora(model, rank: int):
    """``model`` with LoRA adapters of rank ``rank`` on every linear layer (peft), only they trainable; as is for 0."""
    if not rank:
        return model
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    return peft.get_peft_model(model, config)


def split(mode: str):
    """(the mode compiled or not, whether compiled): ``compiled-plain`` is ``nonprivate`` compiled, ``captured-bk``
    is bk captured and compiled."""
    if mode in CAPTURED_MODES:
        return mode.split("-", 1)[1], True
    base, compiled = split_mode(mode)
    return ("nonprivate" if base == "plain" else base), compiled


def measure(shape: str, mode: str, steps: int, seq: int | None, batch: int | None, device: str = "cpu",
            dtype: str = "float32", lora: int = 0) -> dict:
    """One (shape, mode) in this process; peak memory is the RSS on the CPU, allocated memory on CUDA."""
    import torch

    from dptorch.grad_sample import GradSampleHooks
    from dptorch.grad_sample.capture.dp_loss import DPLoss
    from dptorch.optim import DPOptimizer

    family, layers, width, default_seq, default_batch, vocab, tied, *kv_heads = SHAPES[shape]
    seq, batch = seq or default_seq, batch or default_batch
    name, (mode, compiled) = mode, split(mode)
    torch.manual_seed(0)
    model = build(family, layers, width, vocab, tied, *kv_heads).to(device=device, dtype=getattr(torch, dtype))
    model = with_lora(model, lora).train()
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    # Explicit (B, T) position ids, in memory of their own: Opacus cannot take GPT-2's default
    # broadcast (1, T) ones, and its ghost embedding norm views the ids (an expanded tensor fails).
    inputs = {"input_ids": ids, "position_ids": torch.arange(seq, device=device).expand(batch, seq).contiguous()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    criterion = torch.nn.CrossEntropyLoss()
    if mode.startswith("opacus"):
        model, optimizer, criterion = opacus_private(model, optimizer, criterion, mode.split("-")[1], batch)
    elif mode == "floor":
        optimizer = FloorStep(model, inputs, optimizer)
    elif mode != "nonprivate":
        hooks = GradSampleHooks(model, grad_sample_mode=mode, keep_param_grads=False)  # as PrivacyEngine does
        optimizer = DPOptimizer(optimizer, hooks=hooks, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=batch)
        if mode == "ghost":
            criterion = DPLoss(criterion, hooks)
    watch = CompileWatch() if compiled else None
    captured = name in CAPTURED_MODES
    call = watch.compile(model) if compiled and not captured else model  # make_private(..., wrap_model=False)'s order
    if compiled and not captured:
        with torch.no_grad():
            eager_logits = model(**inputs).logits  # what the compiled model's first step must compute
    if captured:  # forward, loss, backward and clipping one graph, compiled by the watch (inductor)
        from dptorch.optim.captured_step import capture_step

        # criterion's mean over the tokens as the mean of per-token losses: a trace cannot read the targets to see
        # that none is ignored (cross_entropy's mean divides by the count of the others), so it takes the per-token form
        captured = capture_step(optimizer, lambda ids, positions: torch.nn.functional.cross_entropy(
            model(input_ids=ids, position_ids=positions).logits.transpose(1, 2), ids, reduction="none").mean(),
            compile={"backend": watch})

    def step():
        optimizer.zero_grad()
        if captured:
            captured(inputs["input_ids"], inputs["position_ids"])
            optimizer.step()
            return None
        logits = call(**inputs).logits
        loss = criterion(logits.transpose(1, 2), ids)  # per-sample friendly: (B, V, T) against (B, T)
        loss.backward()
        optimizer.step()
        return logits

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm_up = []
    for _ in range(2):
        start = time.perf_counter()
        logits = step()
        sync()
        warm_up.append(time.perf_counter() - start)
        if watch and watch.graphs_after_first_step is None:
            watch.first_step_done()
            difference = None if captured else max_difference(eager_logits, logits)
    logits = eager_logits = None  # not held through the timed steps (their peak memory)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss
    row = {"shape": shape, "mode": name, "seq": seq, "batch": batch, "median_s": statistics.median(times),
           "min_s": min(times), "max_s": max(times), "peak_mib": peak, "peak_kind": "CUDA allocated" if cuda else "RSS",
           "peak_rss_mib": rss, "rss_growth_mib": rss - rss_before / 1024, "threads": torch.get_num_threads(),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": dtype, "lora": lora}
    if compiled:
        row.update(compile_s=compile_seconds(warm_up, row["median_s"]), **watch.summary())
        if difference is not None:  # a captured step's exactness is tested (tests/models/test_zoo.py), not sampled here
            row["forward_max_diff"] = difference
    return row


ENGINE_MODES = ("nonprivate", "hooks", "bk", "ghost", "ew", "functorch", *COMPILED_MODES)  # the modes make_private runs


class StepPeak:
    """Peak memory of each step: RSS on the CPU (the kernel's high-water mark, reset before each step
    through ``/proc/self/clear_refs``; where that cannot be written, the process's peak so far),
    allocated memory on CUDA."""

    def __init__(self, device: str):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.per_step = self.cuda
        if not self.cuda:
            try:
                self.reset()
                self.per_step = True
            except OSError:
                pass

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # resets the peak resident set size (VmHWM)

    def peak_mib(self) -> float:
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the high-water mark, reset or not

    def now_mib(self) -> float:
        import torch

        if self.cuda:
            return torch.cuda.memory_allocated() / 2**20
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def measure_engine(shape: str, mode: str, steps: int, seq: int | None, batch: int | None, device: str = "cpu",
                   dtype: str = "float32", lora: int = 0) -> dict:
    """``steps`` steps through ``make_private`` (its defaults: the wrapped model) with its Poisson DP data
    loader, or (mode ``nonprivate``) plain SGD on the same loader: each step's peak memory, the memory
    after it, its batch size and time. Expected batch ``batch`` (sample rate 1/20), seed 0 for the draws.
    A compiled mode compiles the model after ``make_private(..., wrap_model=False)``, each batch's dim 0
    marked dynamic (``maybe_mark_dynamic``): the graphs compiled after the first step are recompilations."""
    import torch

    from dptorch import PrivacyEngine
    from dptorch.data import DPDataLoader

    family, layers, width, default_seq, default_batch, vocab, tied, *kv_heads = SHAPES[shape]
    seq, batch = seq or default_seq, batch or default_batch
    name, (mode, compiled) = mode, split(mode)
    torch.manual_seed(0)
    model = build(family, layers, width, vocab, tied, *kv_heads).to(device=device, dtype=getattr(torch, dtype))
    model = with_lora(model, lora).train()
    rows = torch.utils.data.TensorDataset(torch.randint(0, vocab, (batch * 20, seq)))
    loader = DPDataLoader.from_data_loader(torch.utils.data.DataLoader(rows, batch_size=batch), seed=0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if mode != "nonprivate":
        made, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode=mode, wrap_model=not compiled)
        model = model if compiled else made  # compiled: the user keeps calling their own model
    watch = CompileWatch() if compiled else None
    call = watch.compile(model) if compiled else model
    meter = StepPeak(device)
    sync = torch.cuda.synchronize if meter.cuda else (lambda: None)
    records, draws = [], iter(loader)
    while len(records) < steps:
        try:
            (ids,) = next(draws)
        except StopIteration:
            draws = iter(loader)
            continue
        if not len(ids):  # an empty Poisson draw: HF models cannot run 0 rows
            continue
        ids = ids.to(device)
        if compiled:
            torch._dynamo.maybe_mark_dynamic(ids, 0)  # Poisson batches change size: one graph for every size
        meter.reset()
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(call(input_ids=ids).logits.transpose(1, 2), ids).backward()
        optimizer.step()
        sync()
        if watch and not records:
            watch.first_step_done()
        records.append({"batch": len(ids), "ms": round(1000 * (time.perf_counter() - start)),
                        "peak_mib": round(meter.peak_mib()), "after_mib": round(meter.now_mib())})
    return {"shape": shape, "mode": name, "seq": seq, "batch": batch, "steps": records,
            "peak_mib": max(r["peak_mib"] for r in records), "per_step_peaks": meter.per_step,
            "peak_kind": "CUDA allocated" if meter.cuda else "RSS", "threads": torch.get_num_threads(), "lora": lora,
            **(watch.summary() if watch else {})}


def engine_line(private: dict, plain: dict | None) -> str:
    """The engine run's peak against the plain one's, and each step's against the plain step on the same draw."""
    line = f"through make_private: peak {private['peak_kind']} {private['peak_mib']:7.0f} MiB"
    if plain is not None and plain is not private:
        line += f"  x{private['peak_mib'] / plain['peak_mib']:.2f}"
        if private["per_step_peaks"] and plain["per_step_peaks"]:
            line += "; per step x " + " ".join(f"{a['peak_mib'] / b['peak_mib']:.2f}" for a, b in zip(private["steps"], plain["steps"]))
    line += "; after each step " + " ".join(str(r["after_mib"]) for r in private["steps"]) + " MiB"
    if "graphs" in private:  # a compiled mode: the first step compiles
        line += "; step ms " + " ".join(str(r["ms"]) for r in private["steps"]) + "; " + describe(private)
    return line


class FloorStep:
    """The plain optimizer step followed by the private work no exact step can skip: per-sample
    norms of every trainable Linear / Conv1D / Embedding call (on random tensors of the call's
    shapes, grouped by shared input as bk groups them; where bk instantiates, the norm and
    the weighted sum of a per-sample gradient, which replaces the weight gradient's matmul) and
    one Gaussian draw per parameter."""

    def __init__(self, model, inputs, optimizer):
        import dataclasses

        import torch

        from dptorch.grad_sample.norms.shared_inputs import AffineUse, memory_key, shared_affine_norms_and_grads
        from dptorch.grad_sample.layers.hf_conv1d import looks_like_hf_conv1d

        self.optimizer, self.affine, self.embeddings, shared = optimizer, [], [], {}

        def record(module, args, output):
            a, trainable = args[0], lambda p: p is not None and p.requires_grad
            if isinstance(module, torch.nn.Embedding):
                self.embeddings.append((torch.randint(0, module.num_embeddings, a.shape, device=a.device), torch.randn_like(output)))
            elif trainable(module.weight) or trainable(module.bias):
                if memory_key(a) not in shared:
                    shared[memory_key(a)] = torch.randn_like(a)
                self.affine.append(AffineUse(shared[memory_key(a)], torch.randn_like(output),
                                             module.weight if trainable(module.weight) else None,
                                             module.bias if trainable(module.bias) else None,
                                             looks_like_hf_conv1d(module)))

        layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) or looks_like_hf_conv1d(m)]
        handles = [m.register_forward_hook(record) for m in layers if m.weight.requires_grad]
        with torch.no_grad():
            model(**inputs)
            instantiated = [grads.get(use.weight) for use, grads in zip(self.affine, shared_affine_norms_and_grads(self.affine)[1])]
        for handle in handles:
            handle.remove()
        self.per_sample = [g for g in instantiated if g is not None]
        self.affine = [u if g is None else dataclasses.replace(u, weight=None) for u, g in zip(self.affine, instantiated)]
        param = next(model.parameters())
        self.like = param.new_empty(sum(p.numel() for p in model.parameters() if p.requires_grad))
        self.generator = torch.Generator(device=param.device).manual_seed(0)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        import torch

        from dptorch.grad_sample.layers.embedding import embedding_norms_sq_by_rows
        from dptorch.grad_sample.norms.linear_forms import squared_norms, weighted_sum
        from dptorch.grad_sample.norms.shared_inputs import shared_affine_norms_sq
        from dptorch.noise import gaussian_noise

        self.optimizer.step()
        with torch.no_grad():
            shared_affine_norms_sq(self.affine)
            for ids, backprops in self.embeddings:
                embedding_norms_sq_by_rows(ids, backprops, None)
            for grad in self.per_sample:
                weighted_sum(squared_norms(grad), grad)
            gaussian_noise(self.like, 1.0, self.generator)


class SequenceCrossEntropy:
    """Token cross-entropy averaged per sequence when ``reduction="none"`` (Opacus' ghost loss
    wrapper needs one loss per sample and does not check the shape it gets)."""

    def __init__(self):
        self.reduction = "mean"

    def __call__(self, logits, target):
        import torch

        tokens = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        return tokens.mean(1) if self.reduction == "none" else tokens.mean()


def opacus_private(model, optimizer, criterion, mode, batch):
    """Opacus 1.6 as a peer (optional; never a dependency of dptorch)."""
    import torch
    from opacus import PrivacyEngine as OpacusEngine

    criterion = SequenceCrossEntropy() if mode == "ghost" else criterion

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(batch * 4, 1)), batch_size=batch)
    result = OpacusEngine(accountant="rdp").make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False, grad_sample_mode=mode, **({"criterion": criterion} if mode == "ghost" else {}),
    )
    if mode == "ghost":
        model, optimizer, criterion, _ = result
    else:
        model, optimizer, _ = result
    return model, optimizer, criterion


OPACUS_PEERS = {"hooks": "opacus-hooks", "bk": "opacus-ghost"}  # each dptorch mode against its Opacus counterpart
FLOOR_PEERS = {"bk": "floor"}


def versus(rows: list, shape: str, ours: str, theirs: str) -> str:
    """``bk vs opacus-ghost: 1.84x faster`` for the last rows of ``shape`` (empty if either is missing)."""
    found = {r["mode"]: r for r in rows if r["shape"] == shape and r["mode"] in (ours, theirs)}
    if ours not in found or theirs not in found or "error" in found[ours]:
        return ""
    peer = found[theirs]
    if "error" in peer:
        return f"{ours} vs {theirs}: {theirs} {'fails: ' if peer['error'] != 'not installed' else ''}{peer['error']}"
    speedup = peer["median_s"] / found[ours]["median_s"]
    return f"{ours} vs {theirs}: " + (f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower")


def summarize(paths: list) -> str:
    """A markdown table from several runs' JSON: per shape and mode, the median time ratio over the
    runs (min-max) / the median peak-RSS ratio, then bk / floor and the speed-ups over Opacus, then
    the compiled modes where the runs have them."""
    runs = [json.loads(Path(path).read_text()) for path in paths]
    modes = ["floor", "hooks", "bk", "opacus-hooks", "opacus-ghost"]
    compiled = [m for m in (*COMPILED_MODES, *CAPTURED_MODES) if any(r["mode"] == m for r in runs[0])]
    comparisons = [("bk", "floor", "bk / floor"), ("opacus-hooks", "hooks", "hooks vs Opacus hooks"),
                   ("opacus-ghost", "bk", "bk vs Opacus ghost")]

    def spread(values: list) -> str:
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    lines = ["| shape | non-private | " + " | ".join(modes + [c[2] for c in comparisons] + compiled) + " |",
             "|" + "---|" * (2 + len(modes) + len(comparisons) + len(compiled))]
    for shape in dict.fromkeys(r["shape"] for r in runs[0]):
        by_mode = [{r["mode"]: r for r in run if r["shape"] == shape} for run in runs]
        ok = lambda mode: all(mode in rows and "error" not in rows[mode] for rows in by_mode)
        cells = [f"{statistics.median(rows['nonprivate']['median_s'] for rows in by_mode) * 1000:.0f} ms"]
        for mode in modes:
            if not ok(mode):
                cells.append("fails" if any("error" in rows.get(mode, {}) for rows in by_mode) else "not run")
                continue
            peak = statistics.median(rows[mode]["peak_ratio"] for rows in by_mode)
            cells.append(f"{spread([rows[mode]['time_ratio'] for rows in by_mode])} / {peak:.2f}x")
        for slower, faster, _ in comparisons:
            ratios = [rows[slower]["median_s"] / rows[faster]["median_s"] for rows in by_mode] if ok(slower) and ok(faster) else None
            cells.append(spread(ratios) if ratios else "-")
        cells += [compiled_cell(mode, [rows.get(mode, {}) for rows in by_mode]) for mode in compiled]
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    if compiled:
        lines += ["", "compiled-plain: its median step and compile time; compiled-bk / compiled-hooks / captured-*: time over "
                  "compiled-plain's, median (min-max) over the runs / peak over its peak; compile time; operators compiled "
                  "in the last run (0: Dynamo ran the model eagerly)"]
    return "\n".join(lines + summarize_engine(runs))


def compiled_cell(mode: str, rows: list) -> str:
    """One compiled mode's cell of the summary from its row in each run (``{}`` where it did not run)."""
    if any("error" in row for row in rows):
        return "fails"
    if not all("compile_s" in row for row in rows):
        return "not run"
    compile_s = statistics.median(row["compile_s"] for row in rows)
    if mode == "compiled-plain":
        return f"{statistics.median(row['median_s'] for row in rows) * 1000:.0f} ms, compile {compile_s:.0f} s"
    if not all("compiled_time_ratio" in row for row in rows):
        return "no compiled-plain"
    times = [row["compiled_time_ratio"] for row in rows]
    peak = statistics.median(row["compiled_peak_ratio"] for row in rows)
    wrong = any(row.get("forward_max_diff", 0) > 1e-2 for row in rows)  # the bug of batch size 1 (benchmarks/compiled.py)
    return (f"{statistics.median(times):.2f}x ({min(times):.2f}-{max(times):.2f}) / {peak:.2f}x, compile "
            f"{compile_s:.0f} s, {rows[-1]['graph_ops']} ops compiled" + (", FORWARD OFF EAGER" if wrong else ""))


def summarize_engine(runs: list) -> list:
    """Lines of a markdown table of the runs through ``make_private``: the plain step's peak RSS (median
    over the runs) and each dptorch mode's peak over it, median (min-max) over the runs."""
    engine = [[r for r in run if "engine_peak_ratio" in r] for run in runs]
    modes = [m for m in ENGINE_MODES[1:] if all(any(r["mode"] == m for r in rows) for rows in engine)]
    if not all(engine) or not modes:
        return []
    lines = ["", "Peak RSS through make_private (same Poisson draws), over the plain step's (compiled modes: over "
             "compiled-plain's):", "",
             "| shape | plain | " + " | ".join(modes) + " |", "|" + "---|" * (2 + len(modes))]
    for shape in dict.fromkeys(r["shape"] for r in engine[0]):
        found = [{r["mode"]: r for r in rows if r["shape"] == shape} for rows in engine]
        if not all("nonprivate" in rows for rows in found):
            continue
        cells = [f"{statistics.median(rows['nonprivate']['engine']['peak_mib'] for rows in found):,.0f} MiB"]
        for mode in modes:
            ratios = [rows[mode]["engine_peak_ratio"] for rows in found if mode in rows]
            cells.append(f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) == len(found) else "-")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return lines


def run_engine(args, rows: list, shape: str, seq, batch) -> None:
    """The engine runs of this shape's measured dptorch modes (``measure_engine``), the plain step first,
    each added to its mode's row (``engine``, and ``engine_peak_ratio`` against the plain run)."""
    measured = {r["mode"]: r for r in rows if r["shape"] == shape and r.get("seq") == (seq or SHAPES[shape][3])
                and r.get("batch") == (batch or SHAPES[shape][4]) and "error" not in r}
    modes = [m for m in ENGINE_MODES if m in measured] if args.engine_steps > 0 else []
    plains = {}  # the plain run each mode is against: nonprivate, or compiled-plain for a compiled mode
    for mode in modes:
        cmd = [sys.executable, __file__, "--engine-steps", str(args.engine_steps), "--device", args.device, "--dtype", args.dtype,
               "--lora", str(args.lora), "--one-engine", shape, mode, str(seq or 0), str(batch or 0)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            error = (run.stderr.strip().splitlines() or ["failed"])[-1][:90]
            measured[mode]["engine"] = {"error": error}
            print(f"{shape:20s} {mode:13s} through make_private fails: {error}", flush=True)
            continue
        engine = json.loads(run.stdout.strip().splitlines()[-1])
        if mode in ("nonprivate", "compiled-plain"):
            plains[mode] = engine
        plain = plains.get(reference_mode(mode))
        measured[mode]["engine"] = engine
        if plain is not None:
            measured[mode]["engine_peak_ratio"] = engine["peak_mib"] / plain["peak_mib"]
        print(f"{shape:20s} {mode:13s} {engine_line(engine, plain)}", flush=True)


def compiled_line(row: dict) -> str:
    """A compiled mode's figures apart from its step time (empty for the others)."""
    if "compile_s" not in row:
        return ""
    against = (f"; x{row['compiled_time_ratio']:.2f} time, x{row['compiled_peak_ratio']:.2f} peak of compiled-plain"
               if "compiled_time_ratio" in row else "")
    return f"   compile {row['compile_s']:.1f} s, {describe(row)}{against}"


def reference_mode(mode: str) -> str:
    """What a mode is compared with: ``nonprivate``, or ``compiled-plain`` for a compiled mode."""
    return "compiled-plain" if split(mode)[1] else "nonprivate"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=CPU_SHAPES, choices=list(SHAPES))
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's parameters")
    parser.add_argument("--modes", nargs="+", default=["nonprivate", "floor", "hooks", "bk", "ghost", "opacus-hooks", "opacus-ghost"], choices=list(MODES))
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--engine-steps", type=int, default=10,
                        help="steps of each dptorch mode and the plain step through make_private (0: skip)")
    parser.add_argument("--seq", type=int, nargs="+", default=[None], help="sequence lengths to sweep")
    parser.add_argument("--batch", type=int, nargs="+", default=[None], help="batch sizes to sweep")
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="train LoRA adapters of rank R on every linear layer (peft) instead of all weights")
    parser.add_argument("--summarize", nargs="+", metavar="JSON", help="print the table of several runs' results")
    add_output_flags(parser, "benchmarks/results/models.json")
    parser.add_argument("--one", nargs=4, metavar=("SHAPE", "MODE", "SEQ", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--one-engine", nargs=4, metavar=("SHAPE", "MODE", "SEQ", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    if args.one:
        shape, mode, seq, batch = args.one
        print(json.dumps(measure(shape, mode, args.steps, int(seq) or None, int(batch) or None, args.device, args.dtype,
                                 args.lora)))
        return
    if args.one_engine:
        shape, mode, seq, batch = args.one_engine
        print(json.dumps(measure_engine(shape, mode, args.engine_steps, int(seq) or None, int(batch) or None, args.device,
                                        args.dtype, args.lora)))
        return
    rows = []
    for shape in args.shapes:
        for seq in args.seq:
            for batch in args.batch:
                bases = {}
                for mode in args.modes:
                    if mode.startswith("opacus") and importlib.util.find_spec("opacus") is None:
                        rows.append({"shape": shape, "mode": mode, "error": "not installed"})
                        print(f"{shape:20s} {mode:13s} not installed (pip install opacus --no-deps; opt_einsum)", flush=True)
                        continue
                    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--device", args.device, "--dtype", args.dtype,
                           "--lora", str(args.lora), "--one", shape, mode, str(seq or 0), str(batch or 0)]
                    run = subprocess.run(cmd, capture_output=True, text=True)
                    if run.returncode != 0:
                        error = (run.stderr.strip().splitlines() or ["failed"])[-1][:90]
                        rows.append({"shape": shape, "mode": mode, "error": error})
                        print(f"{shape:20s} {mode:13s} fails: {error}", flush=True)
                        continue
                    row = json.loads(run.stdout.strip().splitlines()[-1])
                    base = bases.setdefault("first", row)
                    row["time_ratio"] = row["median_s"] / base["median_s"]
                    row["peak_ratio"] = row["peak_mib"] / base["peak_mib"]
                    if mode == "compiled-plain":
                        bases[mode] = row
                    if split(mode)[1] and mode != "compiled-plain" and "compiled-plain" in bases:  # against compiled-plain
                        row["compiled_time_ratio"] = row["median_s"] / bases["compiled-plain"]["median_s"]
                        row["compiled_peak_ratio"] = row["peak_mib"] / bases["compiled-plain"]["peak_mib"]
                    rows.append(row)
                    print(f"{row['shape']:20s} T={row['seq']:<5d} B={row['batch']:<4d} {row['mode']:13s} "
                          f"{row['median_s'] * 1000:8.1f} ms  x{row['time_ratio']:.2f}   peak {row['peak_kind']} {row['peak_mib']:7.0f} MiB  x{row['peak_ratio']:.2f}"
                          + compiled_line(row), flush=True)
                run_engine(args, rows, shape, seq, batch)
                for ours, theirs in [*OPACUS_PEERS.items(), *FLOOR_PEERS.items()]:
                    line = versus(rows, shape, ours, theirs)
                    if line:
                        print(f"{shape:20s} {line}", flush=True)
    place = OutputPlace(args, "models")
    place.file("models.json", RESULTS / "models.json").write_text(json.dumps(rows, indent=1))
    place.report()


if __name__ == "__main__":
    main()

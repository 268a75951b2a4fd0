"""Peak RSS of a causal LM step at a Llama-3 vocabulary: full logits against ChunkedCausalLMLoss, plain and private.

    python benchmarks/lm_head_memory.py                       # every configuration, each in its own process
    python benchmarks/lm_head_memory.py --config private-chunked --steps 2

A tiny-width Llama built from a config (vocabulary 128,256, width 64, 2 layers, untied head), rows of T = 1024
tokens, 2 rows a step. Configurations:

* ``plain-full``: the model's own loss from its ``(B, T, V)`` logits, a plain SGD step;
* ``plain-chunked``: ``ChunkedCausalLMLoss`` (no logits held), a plain SGD step;
* ``private-full``: ``make_private`` (bk) with its loader, each row's token-mean loss from the logits (today's
  private step);
* ``private-chunked``: ``make_private`` (bk) with its loader and ``ChunkedCausalLMLoss``.

Every configuration draws Poisson batches of expected size 2 from 40 rows (the plain ones through ``DPDataLoader``
alone, the private ones through ``make_private``'s loader), with the global seed fixed (``--seed``), so all see the
same batch sizes (printed). Each configuration runs in a fresh subprocess and reports the
process's peak RSS (``ru_maxrss``, as the OS counts it) after its steps, and the median step time (a shared machine:
timings are indicative only). docs/performance.md and docs/hf.md quote these figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

CONFIGS = ("plain-full", "plain-chunked", "private-full", "private-chunked")


def build(vocab: int, width: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).train()


def run(config: str, steps: int, vocab: int, width: int, tokens: int, rows: int, seed: int) -> dict:
    from dptorch.grad_sample.units.chunked_lm_loss import ChunkedCausalLMLoss
    from dptorch.grad_sample.units.per_sample_losses import token_per_sample_loss

    torch.manual_seed(0)
    model = build(vocab, width)
    chunked = ChunkedCausalLMLoss() if config.endswith("chunked") else None
    if chunked is not None:
        chunked.install(model)
    ids = torch.randint(0, vocab, (20 * rows, tokens))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=rows)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if config.startswith("private"):
        from dptorch import PrivacyEngine

        _, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode="bk", loss_reduction="sum", wrap_model=False)
    else:  # the same Poisson draws, without dptorch's per-sample machinery
        from dptorch.data.poisson import DPDataLoader

        loader = DPDataLoader.from_data_loader(loader)
    torch.manual_seed(seed)  # the Poisson draws: the same batch sizes in every configuration (printed)
    times, sizes, batches = [], [], iter(loader)
    while len(times) < steps:
        try:
            (x,) = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        if x.shape[0] == 0:
            continue
        start = time.perf_counter()
        optimizer.zero_grad()
        if chunked is not None:
            losses, _ = chunked(model, {"input_ids": x}, x)
        elif config.startswith("private"):
            losses = token_per_sample_loss(model(input_ids=x, use_cache=False).logits, x, shift=True)
        else:
            losses = model(input_ids=x, labels=x, use_cache=False).loss.unsqueeze(0)
        losses.sum().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        sizes.append(x.shape[0])
    return {"config": config, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "median_step_s": statistics.median(times), "batch_sizes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=CONFIGS, help="one configuration in this process (default: all, each "
                        "in its own subprocess)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.config is not None:
        torch.set_num_threads(args.threads)
        print(json.dumps(run(args.config, args.steps, args.vocab, args.width, args.tokens, args.rows, args.seed)))
        return
    results = {}
    for config in CONFIGS:
        command = [sys.executable, __file__, "--config", config] + [
            f"--{name}={getattr(args, name)}" for name in ("steps", "vocab", "width", "tokens", "rows", "seed", "threads")]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[config] = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(results[config]), flush=True)
    base = results["plain-chunked"]["peak_rss_mb"]
    for config, result in results.items():
        print(f"{config:16s} peak RSS {result['peak_rss_mb']:8.0f} MB  {result['peak_rss_mb'] / base:5.2f}x "
              f"plain-chunked  median step {result['median_step_s']:6.1f} s (shared machine)")


if __name__ == "__main__":
    main()

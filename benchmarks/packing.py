"""Packed against padded DP-SGD batches: real tokens per second, padding and loss at equal epsilon.

    python benchmarks/packing.py [--arch gpt2|llama|qwen2-moe] [--steps 20] [--batch 16] [--max-length 128] [--nonprivate]
    python benchmarks/packing.py --width 256 --layers 4 --steps 30 --batch 32   # a bigger run

The examples are the paragraphs of the repository's own docs (docs/*.md, real English text with a
long-tailed length distribution), split into words and punctuation, each truncated to
``--max-length`` tokens and ended with EOS. Both runs train the same tiny decoder (built from a
config, sdpa attention, no dropout) with DP-SGD (``--mode``, default book-keeping; flat clipping):
the same Poisson draws of examples (one seeded sampler each, same rate), the same noise multiplier
and noise seed, so the same epsilon. ``padded``: each drawn example its own row, padded to the
draw's longest, with an attention mask and one loss per row. ``packed``: the drawn examples packed
into rows of ``--max-length`` tokens by best-fit decreasing (``dptorch.integrations.hf.packing``),
position ids restarting at 0 per example, one privacy unit per example (``set_privacy_units``) and
``dptorch.packed_loss`` (transformers warns once that this forward has no attention mask: as
meant, it builds the block-diagonal mask from the position ids). The runs alternate step by step,
so the machine's load falls on all alike; an empty draw is a step of noise only.

Timed: whole steps (collate, forward, backward, clip, noise, update). Reported: the median of real
(non-pad) tokens per second after ``--warmup`` steps, the padding fraction, the held-out loss
after the last step, and how far apart the two private runs are: each drawn example's gradient
norm on the (untimed) warm-up steps, and the final models (the same draws and noise make both
equal up to float rounding: packing changes nothing but the speed). ``--nonprivate`` also trains
both layouts without DP on the same draws: the speed-up packing gives there is the ceiling of the
private one.
Prints a table and writes packing.json into a fresh folder (``--out-dir``; printed at the end),
or into benchmarks/results/ with ``--update-committed``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

try:
    from benchmarks.output_place import REPOSITORY, RESULTS, OutputPlace, add_output_flags
except ImportError:  # run as a script: benchmarks/ is on the path
    from output_place import REPOSITORY, RESULTS, OutputPlace, add_output_flags

PAD, UNK, EOS = 0, 1, 2
WORD = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")
KINDS = ("padded", "packed")


def doc_paragraphs(folder: Path = REPOSITORY / "docs", min_words: int = 4) -> List[str]:
    """The blank-line separated paragraphs of ``folder/*.md`` (files in name order) with ``min_words`` words or more."""
    paragraphs = []
    for path in sorted(folder.glob("*.md")):
        paragraphs += [p for p in re.split(r"\n\s*\n", path.read_text()) if len(WORD.findall(p.lower())) >= min_words]
    return paragraphs


def word_ids(texts: Sequence[str], vocab_size: int, max_length: int) -> List[List[int]]:
    """Each text as word ids: the ``vocab_size - 3`` most frequent words (ties: first seen) and UNK, truncated
    to ``max_length - 1`` and ended with EOS."""
    if vocab_size < 4 or max_length < 2:
        raise ValueError(f"--vocab must be >= 4 and --max-length >= 2, got {vocab_size} and {max_length}")
    words = [WORD.findall(t.lower()) for t in texts]
    counts = collections.Counter(w for ws in words for w in ws)
    ids = {w: i + 3 for i, (w, _) in enumerate(counts.most_common(vocab_size - 3))}
    return [[ids.get(w, UNK) for w in ws[: max_length - 1]] + [EOS] for ws in words]


def length_summary(lengths: Sequence[int]) -> Dict[str, float]:
    ordered = sorted(lengths)
    return {"count": len(ordered), "mean": statistics.mean(ordered), "median": statistics.median(ordered),
            "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1]}


def pad_collate(examples: List[Dict[str, List[int]]]) -> Dict[str, "torch.Tensor"]:
    """Each example its own row, right-padded to the longest: ``input_ids``, ``attention_mask``, ``labels`` (-100 on pads)."""
    import torch

    width = max((len(e["input_ids"]) for e in examples), default=1)
    ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = torch.as_tensor(example["input_ids"])
        mask[row, : len(example["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build_model(arch: str, vocab: int, width: int, layers: int, max_length: int):
    """A tiny decoder from a config: sdpa attention, no dropout, untied head for Llama."""
    import transformers

    heads = max(width // 32, 1)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads, n_positions=max_length,
                                         resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=EOS, eos_token_id=EOS,
                                         pad_token_id=PAD, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(config)
    common = dict(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), max_position_embeddings=max_length,
                  bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                  attn_implementation="sdpa")
    if arch == "qwen2-moe":  # four experts of half the MLP's width, top 2, a shared expert; no auxiliary loss
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=width, shared_expert_intermediate_size=width,
            router_aux_loss_coef=0.0, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


class Run:
    """One training of the benchmark's model on padded or packed batches: DP-SGD, or with ``private=False``
    the same draws without clipping or noise (the ceiling of what packing can gain)."""

    def __init__(self, kind: str, args: argparse.Namespace, train: List[Dict[str, List[int]]], private: bool = True):
        import torch

        from dptorch import PrivacyEngine
        from dptorch.data import DPDataLoader
        from dptorch.integrations.hf.packing import PackingCollator

        self.kind, self.name = kind, kind if private else f"{kind}, non-private"
        torch.manual_seed(args.seed)
        self.model = build_model(args.arch, args.vocab, args.width, args.layers, args.max_length).to(args.device).train()
        self.device = torch.device(args.device)
        collate = pad_collate if kind == "padded" else PackingCollator(PAD, max_length=args.max_length)
        loader = DPDataLoader(train, sample_rate=args.batch / len(train), collate_fn=collate,
                              generator=torch.Generator().manual_seed(args.seed))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.engine = self.hooks = None
        if private:
            self.engine = PrivacyEngine()
            self.hooks, self.optimizer, loader = self.engine.make_private(
                module=self.model, optimizer=self.optimizer, data_loader=loader, noise_multiplier=args.noise,
                max_grad_norm=1.0, loss_reduction="sum", grad_sample_mode=args.mode, wrap_model=False,
                noise_generator=torch.Generator(device=args.device).manual_seed(args.seed + 1))
        self.batches = iter(loader)
        self.times: List[float] = []
        self.real_tokens: List[int] = []
        self.all_tokens: List[int] = []
        self.examples: List[int] = []
        self.rows: List[int] = []

    def step(self, check_norms: bool = False) -> Optional["torch.Tensor"]:
        """One private step, timed from collating the draw to the parameter update; with ``check_norms``
        (an untimed step), each drawn example's gradient norm, in draw order."""
        import torch

        from dptorch import packed_loss
        from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss
        from dptorch.integrations.hf.sampling import UNIT_IDS_KEY

        start = time.perf_counter()
        batch = {key: value.to(self.device) for key, value in next(self.batches).items()}
        norms = None
        if batch["input_ids"].shape[0] == 0:  # an empty Poisson draw: a step of noise only
            real, examples = batch["input_ids"], 0
        elif self.kind == "padded":
            real = batch["attention_mask"]
            out = self.model(input_ids=batch["input_ids"], attention_mask=real, use_cache=False)
            loss = causal_lm_per_sample_loss(out, batch["labels"]).sum()
            examples = batch["input_ids"].shape[0]
        else:
            units = batch[UNIT_IDS_KEY]
            if self.hooks is not None:
                self.hooks.set_privacy_units(units)
            out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
            loss = packed_loss(out.logits, batch["labels"], self.hooks) if self.hooks else plain_packed_loss(out.logits, batch["labels"], units)
            real = units >= 0
            examples = int(torch.unique(units[units >= 0]).numel())
        if examples:
            loss.backward()
            norms = unit_norms(self.hooks) if check_norms and self.hooks else None
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        self.real_tokens.append(int(real.sum()))
        self.all_tokens.append(batch["input_ids"].numel())
        self.examples.append(examples)
        self.rows.append(batch["input_ids"].shape[0])
        return norms

    def summary(self, warmup: int, delta: float) -> dict:
        rates = [n / t for n, t in zip(self.real_tokens[warmup:], self.times[warmup:])]
        epsilon = self.engine.get_epsilon(delta) if self.engine else float("inf")
        return {"kind": self.kind, "private": self.engine is not None, "steps": len(self.times), "timed_steps": len(rates),
                "median_real_tokens_per_s": statistics.median(rates), "median_step_s": statistics.median(self.times[warmup:]),
                "padding_fraction": 1 - sum(self.real_tokens) / sum(self.all_tokens),
                "mean_rows_per_step": statistics.mean(self.rows),
                "mean_examples_per_step": statistics.mean(self.examples), "examples_per_step": self.examples,
                "real_tokens_per_step": self.real_tokens,
                "step_s": self.times, "epsilon": epsilon}


def plain_packed_loss(logits: "torch.Tensor", labels: "torch.Tensor", units: "torch.Tensor") -> "torch.Tensor":
    """What ``packed_loss`` computes, without a controller: each example's mean loss over its own targets, summed."""
    import torch.nn.functional as F

    from dptorch.grad_sample.units.packed_loss import per_unit_losses, unit_token_targets
    from dptorch.grad_sample.units.token_units import TokenUnits

    token_units = TokenUnits(units)
    targets, unit, keep = unit_token_targets(token_units, labels, shift=True)
    token_losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none")
    return per_unit_losses(token_losses.view(targets.shape), unit, keep, token_units.num_units, "mean").sum()


def unit_norms(hooks) -> "torch.Tensor":
    """Each privacy unit's whole-model gradient norm (units in ascending id order: the draw order for both
    collators here)."""
    squares = [n.double() ** 2 for n in hooks.per_sample_norms().values()]
    return sum(squares).sqrt() if squares else None


def mean_example_loss(model, examples: List[Dict[str, List[int]]], device: str, chunk: int = 32) -> float:
    """The next-token loss averaged over each example's own targets, then over the examples (no gradients)."""
    import torch

    from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss

    losses = []
    with torch.no_grad():
        for i in range(0, len(examples), chunk):
            batch = {key: value.to(device) for key, value in pad_collate(examples[i: i + chunk]).items()}
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            losses.append(causal_lm_per_sample_loss(out, batch["labels"]))
    return float(torch.cat(losses).mean())


def max_relative_difference(first, second) -> float:
    """max over parameters of |a - b| / |a| (Frobenius norms)."""
    pairs = zip(first.parameters(), second.parameters())
    return max(float((a - b).detach().norm() / a.detach().norm().clamp(min=1e-30)) for a, b in pairs)


COLUMNS = [  # (heading, key in a run's summary, format)
    ("real tok/s", "median_real_tokens_per_s", "11.0f"), ("step ms", "median_step_ms", "8.1f"),
    ("padding", "padding_fraction", "8.1%"), ("examples", "mean_examples_per_step", "9.1f"),
    ("rows", "mean_rows_per_step", "6.1f"), ("loss", "held_out_loss", "7.3f"), ("epsilon", "epsilon", "8.3f"),
]


def print_table(result: dict) -> None:
    print(f"{'batches':20s} " + " ".join(f"{heading:>{fmt.split('.')[0]}s}" for heading, _, fmt in COLUMNS))
    for name, row in result["runs"].items():
        cells = {**row, "median_step_ms": row["median_step_s"] * 1000}
        print(f"{name:20s}" + " ".join(format(cells[key], fmt) for _, key, fmt in COLUMNS))
    gap, models = result["max_relative_unit_norm_difference"], result["max_relative_parameter_difference"]
    print(f"packed / padded: {result['speedup']:.2f}x real tokens per second; held-out loss "
          f"{result['initial_held_out_loss']:.3f} before training"
          + ("" if result["speedup_nonprivate"] is None else
             f"; without DP (the ceiling): {result['speedup_nonprivate']:.2f}x"))
    print(f"same draws, same noise: per-example gradient norms differ by {'-' if gap is None else f'{gap:.1e}'} "
          f"(relative, warm-up steps), final models by {models:.1e} (relative, largest parameter)")


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gpt2", choices=["gpt2", "llama", "qwen2-moe"])
    parser.add_argument("--mode", default="bk", choices=["bk", "ghost", "hooks"], help="dptorch's per-sample mode")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (the loader and packing stay on the CPU)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2000, help="word vocabulary (most frequent words; the rest UNK)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per example (truncated) and per packed row")
    parser.add_argument("--batch", type=int, default=16, help="expected examples per draw (sample rate = batch / examples)")
    parser.add_argument("--steps", type=int, default=20, help="private steps of each run")
    parser.add_argument("--warmup", type=int, default=2,
                        help="first steps, left out of the timing; on them each example's gradient norm is compared")
    parser.add_argument("--noise", type=float, default=1.0, help="noise multiplier")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--holdout", type=float, default=0.1, help="fraction of the paragraphs kept out for the loss")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nonprivate", action="store_true",
                        help="also train both layouts without DP (same draws, no clipping or noise): the ceiling of the speed-up")
    add_output_flags(parser, "benchmarks/results/packing.json")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): no step would be timed")
    import torch

    torch.set_num_threads(args.threads)
    tokens = word_ids(doc_paragraphs(), args.vocab, args.max_length)
    order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(args.seed)).tolist()
    held = max(int(args.holdout * len(tokens)), 1)
    evaluation = [{"input_ids": tokens[i]} for i in order[:held]]
    train = [{"input_ids": tokens[i]} for i in order[held:]]
    if args.batch > len(train):
        parser.error(f"--batch {args.batch} exceeds the {len(train)} training examples")
    lengths = length_summary([len(e["input_ids"]) for e in train])
    print(f"{len(train)} training examples (docs/*.md paragraphs), {held} held out; tokens per example: mean "
          f"{lengths['mean']:.1f}, median {lengths['median']}, p90 {lengths['p90']}, max {lengths['max']} "
          f"(truncated to {args.max_length})", flush=True)
    runs = [Run(kind, args, train, private) for private in (True, False)[: 1 + args.nonprivate] for kind in KINDS]
    initial = mean_example_loss(runs[0].model, evaluation, args.device)
    norm_gaps = []
    for step in range(args.steps):
        norms = [run.step(check_norms=step < args.warmup) for run in runs]  # alternating: the load falls on all alike
        if norms[0] is not None:
            norm_gaps.append(float(((norms[1] - norms[0]).abs() / norms[0]).max()))
    rows = {}
    for run in runs:
        if run.hooks is not None:
            run.hooks.cleanup()
        rows[run.name] = run.summary(args.warmup, args.delta)
        rows[run.name]["held_out_loss"] = mean_example_loss(run.model.eval(), evaluation, args.device)
    rate = lambda name: rows[name]["median_real_tokens_per_s"]
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("out_dir", "update_committed")},
              "threads": torch.get_num_threads(), "lengths": lengths, "initial_held_out_loss": initial, "runs": rows,
              "speedup": rate("packed") / rate("padded"),
              "speedup_nonprivate": rate("packed, non-private") / rate("padded, non-private") if args.nonprivate else None,
              "max_relative_unit_norm_difference": max(norm_gaps, default=None),
              "max_relative_parameter_difference": max_relative_difference(runs[0].model, runs[1].model)}
    print_table(result)
    place = OutputPlace(args, "packing")
    place.file("packing.json", RESULTS / "packing.json").write_text(json.dumps(result, indent=1))
    place.report()
    return result


if __name__ == "__main__":
    main()

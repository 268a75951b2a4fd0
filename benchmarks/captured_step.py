"""A private step captured whole: the measured route to a compiled private step (issue "The compiled private step").

    python benchmarks/captured_step.py [--shape dispatch-gpt2] [--batch 1] [--seq 4] [--steps 20]
    python benchmarks/captured_step.py --device cuda --dtype bfloat16 --shape gpt2-small --batch 16 --seq 1024

The bk step (forward, loss, backward with the controller's capture, certified per-sample norms, clip
factors, clipped sums) is traced once by ``make_fx`` in fake-tensor mode *while the
batch tracker follows it*: the tracker sees every torch call the trace makes, as in an eager step,
and refuses a step whose samples meet before any graph exists. The ATen graph that comes out holds
the parameters by reference; it is compiled with ``torch.compile`` (no tracker on the stack then, so
Dynamo's fault under a function mode cannot arise) and replayed on later batches of the same shape;
the noise is the library's draw and the SGD update one ``torch._foreach_add_``, outside the graph. Timed against the library's eager bk step
(``GradSampleHooks`` + ``DPOptimizer``), the eager plain step and ``torch.compile`` of the plain model
(forward, backward, SGD step). On the CPU one thread; on CUDA every timing synchronizes the device.
Medians of ``--steps`` steps after three warm-up steps.

A prototype, not the library's path: no DP loader (the tracker takes dim 0 of the inputs as the
batch), one static shape per graph, and position ids given per row (GPT-2's own ``(1, T)`` positions
meet the batch as a shared tensor, whose per-sample gradients are checked against their total by
value, which a fake-tensor trace cannot do). docs/architecture.md ("capture the whole step") says
what the library still needs before it can offer this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from benchmarks.models import build
except ImportError:  # run as a script: benchmarks/ is on the path
    from models import build

SHAPES = {  # name: (layers, width, vocab), GPT-2 with its head tied to the token embedding
    "dispatch-gpt2": (12, 64, 5000),
    "narrow-gpt2": (4, 256, 5000),
    "gpt2-small": (12, 768, 50257),  # for --device cuda
}


def median_ms(run, steps: int, sync) -> float:
    for _ in range(3):
        run()
    return statistics.median(timed(run, sync) for _ in range(steps)) * 1e3


def timed(run, sync) -> float:
    sync()
    start = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - start


class Peak:
    """On CUDA, the most memory allocated from its making to ``read`` (``<name>_peak_mib``); nothing on the CPU."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.cuda = cuda
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def read(self, result: dict, name: str) -> None:
        import torch

        if self.cuda:
            result[f"{name}_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20


def main() -> None:
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from dptorch.clipping.factors import clip_factors
    from dptorch.grad_sample import GradSampleHooks
    from dptorch.noise.gaussian import add_gaussian_noise_
    from dptorch.optim import DPOptimizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dispatch-gpt2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:
        torch.set_num_threads(1)
    layers, width, vocab = SHAPES[args.shape]
    torch.manual_seed(0)
    model = build("gpt2", layers, width, vocab, True).to(device=args.device, dtype=getattr(torch, args.dtype)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=args.device)
    positions = torch.arange(args.seq, device=args.device).expand(args.batch, args.seq).contiguous()  # per row (docstring)
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    lr, clip, sigma = 1e-3, 1.0, 1.0
    result = {"shape": args.shape, "batch": args.batch, "seq": args.seq, "device": args.device, "dtype": args.dtype,
              "threads": None if cuda else 1}

    def plain_step(call, optimizer):
        optimizer.zero_grad(set_to_none=True)
        criterion(call(input_ids=ids, position_ids=positions).logits.transpose(1, 2), ids).backward()
        optimizer.step()

    sgd = torch.optim.SGD(params, lr=lr)
    result["eager_plain_ms"] = median_ms(lambda: plain_step(model, sgd), args.steps, sync)
    compiled_model = torch.compile(model)
    result["compiled_plain_compile_s"] = timed(lambda: plain_step(compiled_model, sgd), sync)
    peak = Peak(cuda)
    result["compiled_plain_ms"] = median_ms(lambda: plain_step(compiled_model, sgd), args.steps, sync)
    peak.read(result, "compiled_plain")

    hooks = GradSampleHooks(model, grad_sample_mode="bk", loss_reduction="sum", keep_param_grads=False)
    private = DPOptimizer(torch.optim.SGD(params, lr=lr), hooks=hooks, noise_multiplier=sigma, max_grad_norm=clip,
                          expected_batch_size=args.batch, loss_reduction="sum")
    result["eager_bk_ms"] = median_ms(lambda: plain_step(model, private), args.steps, sync)
    private.detach()

    def clipped_sums(batch_ids):
        """Forward, backward, per-sample norms, clip factors and clipped sums: what the trace captures."""
        criterion(model(input_ids=batch_ids, position_ids=positions).logits.transpose(1, 2), batch_ids).backward()
        norms = hooks.per_sample_norms()
        factors = clip_factors(torch.stack([norms[p].double() for p in params]).pow(2).sum(0).sqrt(), clip)
        sums = hooks.clipped_sums({p: factors.float() for p in params})
        hooks.clear()
        return [sums[p] for p in params]

    eager_sums = clipped_sums(ids)
    start = time.perf_counter()
    graph = make_fx(clipped_sums, tracing_mode="fake", _allow_non_fake_inputs=True)(ids)
    result["trace_s"] = time.perf_counter() - start
    result["graph_nodes"] = len(graph.graph.nodes)
    compiled_sums = torch.compile(graph)

    def captured_step():
        with torch.no_grad():
            sums = compiled_sums(ids)
            add_gaussian_noise_(sums, sigma * clip)  # the library's draw, outside the graph (inductor's CPU randn
            torch._foreach_add_(params, sums, alpha=-lr / args.batch)  # measured 8x slower than torch's)

    with torch.no_grad():
        result["captured_sums_compile_s"] = timed(lambda: compiled_sums(ids), sync)
        replayed = compiled_sums(ids)
        result["captured_vs_eager_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(replayed, eager_sums))
        result["captured_vs_eager_max_entry"] = max(float(b.abs().max()) for b in eager_sums)
        result["captured_sums_ms"] = median_ms(lambda: compiled_sums(ids), args.steps, sync)
    result["captured_bk_compile_s"] = timed(captured_step, sync)
    peak = Peak(cuda)
    result["captured_bk_ms"] = median_ms(captured_step, args.steps, sync)
    peak.read(result, "captured_bk")
    hooks.cleanup()
    result["captured_bk_over_compiled_plain"] = result["captured_bk_ms"] / result["compiled_plain_ms"]
    result["eager_bk_over_captured_bk"] = result["eager_bk_ms"] / result["captured_bk_ms"]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()

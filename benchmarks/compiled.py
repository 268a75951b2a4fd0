"""The compiled modes of the step benchmarks: ``compiled-X`` is mode X with the model under ``torch.compile``.

``compiled-plain`` compiles the non-private model; ``compiled-bk`` and ``compiled-hooks`` compile the
model after the private controller is attached to it, as a user would after
``make_private(..., wrap_model=False)``: their private forwards run eagerly (the root pre-hook turns
Dynamo off for the compiled call, docs/errors.md), so their rows show what compiling costs a private step
until a compiled private step exists. :class:`CompileWatch` is the
backend (inductor, its on-disk caches off, so that the compile time is a first run's) that counts the
graphs Dynamo hands it, their operators, the graph breaks and the graphs compiled after the first step
(recompilations). Compile time is never in a step time: it is the warm-up steps' time beyond as many
median steps (:func:`compile_seconds`). Each compiled mode also reports how far its first step's output
is from the eager model's on the same input (``forward_max_diff``).
"""

from __future__ import annotations

from typing import Sequence, Tuple

PREFIX = "compiled-"
MODES = ("compiled-plain", "compiled-bk", "compiled-hooks")


def split_mode(mode: str) -> Tuple[str, bool]:
    """``("bk", True)`` for ``compiled-bk``; ``("bk", False)`` for ``bk``."""
    return (mode[len(PREFIX):], True) if mode.startswith(PREFIX) else (mode, False)


class CompileWatch:
    """A ``torch.compile`` backend: inductor, counting each graph it compiles and its operators."""

    def __init__(self) -> None:
        import torch._dynamo

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        torch.compiler.config.force_disable_caches = True  # a first run's compile time, whatever ran before
        self.graphs, self.graph_ops, self.graphs_after_first_step = 0, 0, None

    def __call__(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        self.graph_ops += sum(node.op.startswith("call") for node in graph.graph.nodes)
        return compile_fx(graph, example_inputs)

    def compile(self, model):
        import torch

        return torch.compile(model, backend=self)

    def first_step_done(self) -> None:
        self.graphs_after_first_step = self.graphs

    def summary(self) -> dict:
        """Graphs and operators compiled, graph breaks (Dynamo's counters), graphs compiled after step 1."""
        import torch._dynamo

        first = self.graphs if self.graphs_after_first_step is None else self.graphs_after_first_step
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        return {"graphs": self.graphs, "graph_ops": self.graph_ops, "graph_breaks": breaks,
                "recompiles": self.graphs - first}


def max_difference(eager, compiled) -> float:
    """The largest absolute difference between the eager and the compiled output, relative to the eager's largest."""
    return ((compiled.detach().float() - eager.float()).abs().max() / eager.float().abs().max().clamp_min(1e-12)).item()


def compile_seconds(warm_up: Sequence[float], median: float) -> float:
    """The warm-up steps' time beyond as many median steps: what compiling cost (never below 0)."""
    return max(sum(warm_up) - len(warm_up) * median, 0.0)


def describe(summary: dict) -> str:
    """``12 graphs (340 ops), 3 breaks, 0 recompiles``; ``no operator compiled (ran eager)`` when none was."""
    if not summary["graph_ops"]:
        text = f"no operator compiled (ran eager), {summary['graph_breaks']} breaks"
    else:
        text = (f"{summary['graphs']} graphs ({summary['graph_ops']} ops), {summary['graph_breaks']} breaks, "
                f"{summary['recompiles']} recompiles")
    if "forward_max_diff" in summary:
        text += f", forward off eager by {summary['forward_max_diff']:.0e} (relative)"
    return text

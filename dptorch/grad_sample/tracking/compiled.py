"""Code that torch.compile (Dynamo) traces or runs, met by the batch tracker: refused.

Dynamo compiles around a ``TorchFunctionMode`` whose ``__torch_function__`` breaks its graph, and in
torch 2.13 it can then run a graph compiled for one operation in place of another: under the tracker,
a compiled model forward (GPT-2's MLP block) came out 5e-2 off at batch size 1, and a compiled loss
``((o * 2.0) * 3.0 + 5.0).sum()`` gave -14.80 for 7.04. So the root forward and every operation a live
tracker follows (the forward, its loss, the draw watch) refuse to run under Dynamo.
"""

from __future__ import annotations

import torch

COMPILED_CODE = (
    "torch.compile runs code that dptorch's batch tracker follows (a model compiled after make_private(..., "
    "wrap_model=False), a compiled loss or step function, or compiled code run while a DP loader's batch is "
    "watched, until the loop is done with it or the controller's cleanup()): Dynamo compiles around the tracker, and there "
    "torch 2.13 can run a graph compiled for one operation in place of another (measured: GPT-2's MLP block off "
    "by 5e-2 at batch size 1; a compiled loss ((o * 2.0) * 3.0 + 5.0).sum() gave -14.80 for 7.04), a wrong "
    "gradient; at 2 or more rows nothing is compiled (Dynamo skips every frame under the tracker's dispatch "
    "guard) and the step runs 5x slower than eager. Run the training step uncompiled (the private step does not "
    "run compiled yet), and compiled evaluation after controller.cleanup()"
)


def under_torch_compile() -> bool:
    """Whether this call runs in code that torch.compile (Dynamo) traces or compiled: Dynamo's frame
    callback is set for the whole compiled call, graph breaks included (an untraceable call: it always
    runs eagerly)."""
    return torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)

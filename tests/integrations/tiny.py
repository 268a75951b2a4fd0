"""Tiny offline models, tokenizer and datasets for the HF integration tests.

The builders live in ``examples/common.py`` (shared with the examples, which must run from a
plain checkout); this module loads them by path and adds what only the tests need.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import torch

_COMMON = Path(__file__).resolve().parents[2] / "examples" / "common.py"
_spec = importlib.util.spec_from_file_location("dptorch_examples_common", _COMMON)
common = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = common
_spec.loader.exec_module(common)

word_tokenizer = common.word_tokenizer
tiny_gpt2 = common.tiny_gpt2
tiny_llama = common.tiny_llama
tiny_t5 = common.tiny_t5
tiny_bart = common.tiny_bart
place_dataset = common.place_dataset
lm_dataset = common.lm_dataset
text_dataset = common.text_dataset
preference_dataset = common.preference_dataset
cpu_training_args = common.cpu_training_args


def without_dropout(model):
    """Set every dropout probability of ``model`` to 0 (per-sample gradient comparisons)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def assert_torch_compile_trains_as_uncompiled(trained):
    """``trained(folder, **training_args)`` trains a tiny model (no dropout, the same draws) and returns the trainer:
    with ``torch_compile=True`` the model is compiled, and the steps are the uncompiled run's to the bit."""
    def run(folder, **args):
        torch._dynamo.reset()
        torch.manual_seed(0)
        return trained(folder, **args)

    plain, compiled = run("plain"), run("compiled", torch_compile=True, torch_compile_backend="eager")
    assert isinstance(compiled.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    for p, q in zip(plain.model.parameters(), compiled.model.parameters()):
        assert torch.equal(p, q)


def trainable_copy(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def clipped_unit_update(model, units, collate, per_sample_loss, clip, lr):
    """The batch-of-one reference of one noiseless step at q = 1: ``-lr * sum over units of
    clip(sum of the unit's row gradients) / number of units``, each row alone through a copy of
    ``model`` (nothing shared with any other sample). ``units``: lists of rows for ``collate``;
    ``per_sample_loss=None``: the model's own loss of the row alone (the labels go into the model)."""
    model = copy.deepcopy(model).train()
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for rows in units:
        model.zero_grad()
        for row in rows:
            batch = collate([row])
            if per_sample_loss is None:
                model(**batch).loss.backward()
            else:
                labels = batch.pop("labels")
                per_sample_loss(model(**batch), labels).sum().backward()
        grads = [p.grad.clone() for p in params]
        factor = min(1.0, clip / (torch.stack([g.norm() for g in grads]).norm().item() + 1e-6))
        total = [t + factor * g for t, g in zip(total, grads)]
    return [-lr * t / len(units) for t in total]

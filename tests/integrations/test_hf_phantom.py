"""Phantom micro-batches (what a rank runs for an empty Poisson micro-batch on several processes), in one process.

The 2-process runs are in tests/distributed (test_hf_ddp, test_hf_fsdp, test_hf_trl); here: the
phantom batch holds no data, and a phantom backward round leaves the DP optimizer's step unchanged.
"""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from dptorch.grad_sample import GradSampleHooks  # noqa: E402
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling  # noqa: E402
from dptorch.integrations.hf.metrics import dropped_metrics  # noqa: E402
from dptorch.integrations.hf.phantom import PhantomBatch, neutral_batch  # noqa: E402
from dptorch.noise import NoiseGenerator  # noqa: E402
from dptorch.optim import DPOptimizer  # noqa: E402
from tests.integrations.tiny import lm_dataset, word_tokenizer  # noqa: E402


def test_the_phantom_batch_has_the_structure_of_a_row_and_none_of_its_values():
    tokenizer = word_tokenizer()
    collator = DataCollatorForPrivateCausalLanguageModeling(tokenizer)
    dataset = lm_dataset(tokenizer, 4)
    calls = []
    phantom = PhantomBatch(lambda rows: calls.append(rows) or collator(rows), dataset)
    batch = phantom()
    template = collator([dataset[0]])
    assert batch.keys() == template.keys() and len(calls) == 1
    for key, value in batch.items():
        assert value.shape == template[key].shape and value.dtype == template[key].dtype
        assert torch.all(value == (1 if "mask" in key else 0))  # constants only: no token of the row survives
    again = phantom()
    assert again is not batch and again.keys() == batch.keys() and len(calls) == 1  # built once, a new dict each time
    with pytest.raises(TypeError, match="tensors only"):
        neutral_batch({"input_ids": torch.ones(1, 3, dtype=torch.long), "text": ["a private sentence"]})


def private_step(phantom_rows):
    """One step: a real backward round of 3 rows, then (if given) a phantom round; the privatised gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.7,
                            max_grad_norm=0.05, expected_batch_size=3.0, clipping_stats="raw",
                            noise_generator=NoiseGenerator(seed=5))
    model(torch.randn(3, 4)).pow(2).sum().backward()
    if phantom_rows is not None:
        with optimizer.phantom():  # a non-zero loss: the optimizer alone discards the round
            model(phantom_rows).pow(2).sum().backward()
    optimizer.step()
    grads = [p.grad.clone() for p in model.parameters()]
    hooks.cleanup()
    return grads, optimizer.last_clipping_stats


def test_a_phantom_round_adds_no_gradient_no_unit_and_no_clipping_statistic():
    grads, stats = private_step(None)
    with_phantom, phantom_stats = private_step(torch.randn(5, 4) * 100)
    for plain, phantom in zip(grads, with_phantom):
        assert torch.equal(plain, phantom)  # bit for bit: the clipped sum and the noise are unchanged
    assert phantom_stats == stats and stats["units"] == 3  # the phantom's 5 rows are no units


def test_trl_metrics_of_a_micro_batch_empty_on_every_rank_are_dropped():
    class Trainer:
        _metrics = {"train": {"rewards": [0.5], "num_tokens": [10]}, "eval": {}}

    trainer = Trainer()
    with dropped_metrics(trainer, when=lambda: False):  # some rank had rows: TRL's values stay
        trainer._metrics["train"]["rewards"].append(0.7)
    assert trainer._metrics["train"]["rewards"] == [0.5, 0.7]
    with dropped_metrics(trainer, when=lambda: True):  # no rank had rows: what TRL appended goes
        trainer._metrics["train"]["rewards"].append(float("nan"))
        trainer._metrics["train"]["num_tokens"] = [10]  # TRL re-sets the running total (unchanged: no token)
        trainer._metrics["train"]["entropy"] = [0.0]
    assert trainer._metrics == {"train": {"rewards": [0.5, 0.7], "num_tokens": [10]}, "eval": {}}

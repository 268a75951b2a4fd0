"""grad_sample_mode="ew": torch's expanded weights, in non-wrapping mode and with keyword inputs."""

import pytest
import torch
from torch import nn

from dptorch.grad_sample import GradSampleHooks, PerSampleGradientError, UnsupportedModuleError
from tests.grad_sample.test_hf_models import tiny_bert, tiny_gpt2, tiny_llama
from tests.helpers import check_per_sample_grads, snapshot


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_supported_layers_match_the_oracle_with_keyword_inputs(reduction):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    check_per_sample_grads(model, {"input": torch.randint(0, 10, (3, 5))}, grad_sample_mode="ew", loss_reduction=reduction)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(12, 2))
    check_per_sample_grads(model, (torch.randn(3, 2, 4, 4),), grad_sample_mode="ew", loss_reduction=reduction)


def test_bert_with_per_row_position_ids():
    torch.manual_seed(0)
    model = tiny_bert()
    ids = torch.randint(0, 61, (3, 6))
    inputs = {"input_ids": ids, "position_ids": torch.arange(6).expand(3, 6), "token_type_ids": torch.zeros_like(ids)}
    check_per_sample_grads(model, inputs, loss_fn=lambda out: out.logits.pow(2).sum(1), grad_sample_mode="ew")


def test_cleanup_leaves_nothing():
    model = nn.Sequential(nn.Linear(4, 3))
    before = snapshot(model)
    with GradSampleHooks(model, grad_sample_mode="ew", loss_reduction="sum"):
        model(torch.randn(2, 4)).sum().backward()
    assert snapshot(model) == before


@pytest.mark.parametrize("build,culprit", [(tiny_gpt2, "Conv1D"), (tiny_llama, "LlamaRMSNorm")])
def test_unsupported_operations_are_named_with_the_fix(build, culprit):
    with pytest.raises(UnsupportedModuleError, match=rf"{culprit}.*grad_sample_mode='hooks'"):
        GradSampleHooks(build(), grad_sample_mode="ew")


def test_broadcast_input_is_a_clear_error():
    torch.manual_seed(0)
    model = tiny_bert()
    ids = torch.randint(0, 61, (3, 6))
    with GradSampleHooks(model, grad_sample_mode="ew"):
        with pytest.raises(PerSampleGradientError, match=r"position_embeddings.*1 rows.*grad_sample_mode='hooks'"):
            model(input_ids=ids, token_type_ids=torch.zeros_like(ids))
        # BERT's default token_type_ids, expanded from a buffer, have 3 rows that are not the batch's
        with pytest.raises(PerSampleGradientError, match=r"token_type_embeddings.*\(3, 6\).*not the batch's"):
            model(input_ids=ids)


def test_frozen_broadcast_modules_are_left_alone():
    torch.manual_seed(0)
    model = tiny_bert()
    model.bert.embeddings.position_embeddings.weight.requires_grad_(False)
    ids = torch.randint(0, 61, (3, 6))
    check_per_sample_grads(model, {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)},
                           loss_fn=lambda out: out.logits.pow(2).sum(1), grad_sample_mode="ew")

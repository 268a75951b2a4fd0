"""A mixture-of-experts router's auxiliary (load-balancing) loss couples the samples: refused at backward."""

import pytest
import torch

from dptorch import GradSampleHooks
from dptorch.grad_sample.errors import PerSampleGradientError
from tests.grad_sample.test_experts_sampler import config

transformers = pytest.importorskip("transformers")

MODELS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_the_router_aux_loss_is_refused(family, mode):
    made = config(family, "eager")
    made.router_aux_loss_coef, made.output_router_logits = 0.02, True
    torch.manual_seed(0)
    model = getattr(transformers, MODELS[family])(made).train()
    hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    ids = torch.randint(1, 100, (3, 5))
    out = model(input_ids=ids)
    per_token = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 100), ids[:, 1:].reshape(-1),
                                                  reduction="sum")
    with pytest.raises(PerSampleGradientError, match="couples every sample's gradient"):
        (per_token + made.router_aux_loss_coef * out.aux_loss).backward()
    assert all(p.grad is None for p in model.parameters())
    hooks.cleanup()

"""ModelGuard: every change a captured graph could depend on fails it, and putting the value back restores it."""

import pytest
import torch
import transformers
from torch import nn

from dptorch.optim.step_guards import ModelGuard


def tiny_gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8, bos_token_id=0, eos_token_id=0))


CHANGES = {  # name: (change, undo) on a tiny GPT-2
    "train/eval": (lambda m: m.eval(), lambda m: m.train()),
    "dropout p": (lambda m: setattr(m.transformer.drop, "p", 0.5), lambda m: setattr(m.transformer.drop, "p", 0.1)),
    "config": (lambda m: setattr(m.config, "use_cache", not m.config.use_cache),
               lambda m: setattr(m.config, "use_cache", not m.config.use_cache)),
    "requires_grad": (lambda m: m.lm_head.weight.requires_grad_(False), lambda m: m.lm_head.weight.requires_grad_(True)),
    "new attribute": (lambda m: setattr(m.transformer, "scale", 2.0), lambda m: delattr(m.transformer, "scale")),
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_change_fails_the_guard_and_its_undoing_restores_it(name):
    model = tiny_gpt2().train()
    guard = ModelGuard(model)
    assert guard.holds()
    change, undo = CHANGES[name]
    change(model)
    assert not guard.holds()
    undo(model)
    assert guard.holds()


def test_replaced_objects_fail_the_guard():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model[0].register_buffer("scale", torch.ones(3))
    model[0].cache = torch.zeros(2, 2)
    checks = [
        lambda: setattr(model[0], "weight", nn.Parameter(model[0].weight.detach().clone())),
        lambda: model[0].register_buffer("scale", torch.ones(3)),
        lambda: setattr(model[0], "cache", torch.zeros(2, 2)),  # a tensor attribute: its == has no truth value
        lambda: model.append(nn.Linear(3, 3)),
        lambda: model[1].register_forward_hook(lambda *args: None),
        lambda: model[0].register_full_backward_hook(lambda *args: None),
        lambda: nn.modules.module.register_module_forward_pre_hook(lambda *args: None),
    ]
    for change in checks:
        guard = ModelGuard(model)
        change()
        assert not guard.holds()
    for hook in list(nn.modules.module._global_forward_pre_hooks):
        del nn.modules.module._global_forward_pre_hooks[hook]


def test_a_removed_hook_and_a_patched_forward_fail_the_guard():
    model = nn.Sequential(nn.Linear(3, 3))
    handle = model[0].register_forward_hook(lambda *args: None)
    guard = ModelGuard(model)
    handle.remove()
    assert not guard.holds()

    class Patched(nn.Linear):
        pass

    model = nn.Sequential(Patched(3, 3))
    guard = ModelGuard(model)
    Patched.forward = lambda self, x: x
    assert not guard.holds()

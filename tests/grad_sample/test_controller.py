"""GradSampleHooks: attach/cleanup guarantees, rounds, edge cases and clear errors."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dptorch.grad_sample import (
    GradSampleHooks,
    GradSampleModule,
    PerSampleGradientError,
    UnsupportedModuleError,
    register_grad_sampler,
)
from tests.helpers import check_per_sample_grads, snapshot


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_cleanup_leaves_model_exactly_as_before():
    model = mlp()
    before = snapshot(model)
    state = copy.deepcopy(model.state_dict())
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        model(torch.randn(5, 4)).sum().backward()
        assert all(hasattr(p, "grad_sample") for p in model.parameters())
        assert snapshot(model) != before
    assert not hooks.attached
    assert snapshot(model) == before
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_non_wrapping_keeps_identity_and_state_dict_keys():
    model = mlp()
    keys = list(model.state_dict())
    hooks = GradSampleHooks(model, loss_reduction="sum")
    assert isinstance(model, nn.Sequential) and list(model.state_dict()) == keys
    model(torch.randn(2, 4)).sum().backward()
    assert hooks.grad_samples[model[0].weight].shape == (2, 8, 4)
    hooks.cleanup()


def test_wrapper_composes_and_unwraps():
    model = mlp()
    before = snapshot(model)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    assert wrapped._module is model and not isinstance(wrapped, GradSampleHooks)
    wrapped(torch.randn(3, 4)).sum().backward()
    assert wrapped.grad_samples[model[2].bias].shape == (3, 3)
    assert wrapped.to_standard_module() is model
    assert snapshot(model) == before


def test_attaching_twice_raises():
    model = mlp()
    hooks = GradSampleHooks(model, loss_reduction="sum")
    with pytest.raises(RuntimeError, match="already has GradSampleHooks"):
        GradSampleHooks(model)
    hooks.cleanup()
    GradSampleHooks(model).cleanup()


def test_eval_mode_and_no_grad_capture_nothing():
    model = mlp()
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        with torch.no_grad():
            model(torch.randn(3, 4))
        model.eval()
        model(torch.randn(3, 4)).sum().backward()
        assert hooks.grad_samples == {}


def test_empty_batch():
    model = mlp()
    check_per_sample_grads(model, (torch.randn(0, 4),), loss_reduction="sum")


def test_batch_first_false_sequence_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    check_per_sample_grads(model, (torch.randn(5, 3, 4),), batch_first=False)


def test_in_place_operations_after_hooked_layers():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            h = self.a(x)
            h += x  # in place on a hooked layer's output
            return self.b(self.act(self.b(h)))  # ReLU(inplace=True) on a hooked layer's output

    torch.manual_seed(0)
    check_per_sample_grads(Residual(), (torch.randn(4, 4),))
    check_per_sample_grads(Residual(), (torch.randn(4, 3, 4),))


def test_module_called_twice_and_shared_across_modules():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.head = nn.Linear(4, 4)
            self.head.weight = self.lin.weight  # tied

        def forward(self, x):
            return self.head(torch.tanh(self.lin(self.lin(x))))

    torch.manual_seed(0)
    check_per_sample_grads(Twice(), (torch.randn(3, 4),))


def test_frozen_parameters_get_nothing():
    model = mlp()
    model[0].weight.requires_grad_(False)
    got = check_per_sample_grads(model, (torch.randn(3, 4),))
    assert model[0].weight not in got and model[0].bias in got


def test_functorch_mode_everywhere():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.LayerNorm(12), nn.Linear(12, 2))
    check_per_sample_grads(model, (torch.randn(3, 2, 4, 4),), grad_sample_mode="functorch")


def test_parent_with_direct_parameters_and_children():
    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, 4)
            self.cls = nn.Parameter(torch.randn(1, 1, 4))
            self.pos = nn.Parameter(torch.randn(1, 6, 4))

        def forward(self, x, *, scale=1.0):
            h = self.proj(x)
            h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], dim=1)
            return (h + self.pos) * scale

    torch.manual_seed(0)
    model = Embeddings()
    check_per_sample_grads(model, {"x": torch.randn(3, 5, 3), "scale": 0.5})


def test_checkpointed_module_called_twice_is_exact():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    class Model(nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.block, self.reentrant = Block(), reentrant

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=self.reentrant)

    for reentrant in (False, True):
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=reentrant)
        check_per_sample_grads(Model(reentrant), (x,))


def test_batch_norm_is_refused_with_the_fix():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(UnsupportedModuleError, match=r"1 \(BatchNorm2d\).*ModuleValidator.fix"):
        GradSampleHooks(model)
    with pytest.warns(UserWarning, match="BatchNorm2d"):
        GradSampleHooks(model, strict=False).cleanup()


def test_random_ops_in_fallback_name_the_module_and_fix():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return nn.functional.dropout(x * self.w, 0.5, self.training)

    model = Noisy()
    with GradSampleHooks(model, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match="Noisy.*random.*register_grad_sampler"):
            model(torch.randn(3, 4)).sum().backward()


def test_second_backward_without_clearing_raises():
    model = mlp()
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(PerSampleGradientError, match="second backward"):
            model(torch.randn(3, 4)).sum().backward()
        hooks.clear()
        model(torch.randn(2, 4)).sum().backward()
        assert hooks.grad_samples[model[0].weight].shape[0] == 2


def test_backward_of_a_forward_made_before_attaching_raises():
    model = mlp()
    loss = model(torch.randn(3, 4)).sum()
    with GradSampleHooks(model, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match="no per-sample gradient"):
            loss.backward()


def test_module_added_after_attach_is_an_error_not_a_silent_gradient():
    model = mlp()
    hooks = GradSampleHooks(model, loss_reduction="sum")
    model.append(nn.Linear(3, 2))
    with pytest.raises(PerSampleGradientError, match=r"3\.weight.*no per-sample gradient"):
        model(torch.randn(3, 4)).sum().backward()
    hooks.cleanup()


def test_listener_consumes_each_round():
    model = mlp()
    seen = []
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        hooks.add_backward_listener(lambda h: seen.append(h.grad_samples[model[0].weight].shape[0]))
        for n in (3, 5):
            model(torch.randn(n, 4)).sum().backward()
    assert seen == [3, 5]


def test_shared_output_is_refused():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):  # the samples' rows interleaved (x.reshape(-1, 4) alone keeps each sample's rows together)
            return self.lin(x.transpose(0, 1).reshape(-1, 4))

    model = Flat()
    with GradSampleHooks(model, loss_reduction="sum"):
        with pytest.raises(PerSampleGradientError, match=r"lin \(Linear\).*\(6, 4\)"):
            model(torch.randn(3, 2, 4))


def test_registration_after_import_is_honoured():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.s

    calls = []

    @register_grad_sampler(Scale)
    def scale_sampler(module, activations, backprops):
        calls.append(1)
        return {module.s: (activations[0] * backprops).reshape(backprops.shape[0], -1, 4).sum(1)}

    torch.manual_seed(0)
    check_per_sample_grads(Scale(), (torch.randn(3, 4),))
    assert calls


def test_privacy_units_sum_rows_before_clipping():
    torch.manual_seed(0)
    model = mlp()
    x = torch.randn(6, 4)
    units = torch.tensor([3, 1, 3, 7, 1, 7])  # three units of two rows each
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        model(x).sum().backward()
        rows = hooks.grad_samples
        hooks.clear()
        model.zero_grad()
        hooks.set_privacy_units(units)
        model(x).sum().backward()
        grouped = hooks.grad_samples
        for p in model.parameters():
            assert grouped[p].shape[0] == 3
            for k, unit in enumerate([1, 3, 7]):
                torch.testing.assert_close(grouped[p][k], rows[p][units == unit].sum(0))
        hooks.clear()
        hooks.set_privacy_units(torch.tensor([0, 1]))
        with pytest.raises(PerSampleGradientError, match="privacy units name 2 rows"):
            model(x).sum().backward()


def test_without_param_grads_per_sample_grads_stay_exact():
    model = mlp()
    x = torch.randn(4, 4)
    with GradSampleHooks(model, loss_reduction="sum") as hooks:
        model(x).sum().backward()
        reference = {p: g.clone() for p, g in hooks.grad_samples.items()}
    model.zero_grad(set_to_none=True)
    with GradSampleHooks(model, loss_reduction="sum", keep_param_grads=False) as hooks:
        model(x).sum().backward()
        assert all(p.grad is None for p in model.parameters())  # autograd skipped them
        for p, g in reference.items():
            torch.testing.assert_close(hooks.grad_samples[p], g)
    assert all(p.requires_grad for p in model.parameters())


def test_the_unhooked_parameter_check_sees_every_parameter_once():
    """The walk behind the check for gradients on parameters without a hook finds what ``parameters()``
    finds, in its order: nested and shared modules, a tied weight once, a None bias skipped."""
    from dptorch.grad_sample.capture.attachment import _all_parameters

    shared = nn.Linear(3, 3, bias=False)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Sequential(shared, nn.LayerNorm(3)), shared, nn.Linear(3, 5))
    model[0].weight = model[3].weight  # tied: (5, 3) both
    found = _all_parameters(model)
    assert len(found) == len(list(model.parameters()))
    assert all(a is b for a, b in zip(found, model.parameters()))

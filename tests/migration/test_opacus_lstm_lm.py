"""Issue 49: a program that adopted Opacus 1.6's non-wrapping mode runs renamed (``opacus_lstm_lm.py``),
and each thing it relies on keeps the privacy rules: ``hooks._module``, ``optimizer._is_last_step_skipped``,
Opacus' DPLSTM submodule paths and ``make_private(model_loss=)``."""

import importlib.util

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from dptorch.accountants import RDPAccountant  # noqa: E402
from dptorch.grad_sample import GradSampleHooks  # noqa: E402
from dptorch.grad_sample.capture.attachment import is_attached  # noqa: E402
from dptorch.grad_sample.errors import PerSampleGradientError  # noqa: E402
from dptorch.grad_sample.units.per_sample_losses import token_per_sample_loss  # noqa: E402
from tests.migration.opacus_lstm_lm import CharLSTMConfig, CharLSTMForCausalLM, dataset, train  # noqa: E402


def fingerprint(model):
    return (type(model), {name: sorted(vars(m)) for name, m in model.named_modules()}, list(model.state_dict()),
            [dict(p.__dict__) for p in model.parameters()],
            [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()])


def build(seed=0):
    torch.manual_seed(seed)
    return CharLSTMForCausalLM(CharLSTMConfig())


def test_the_tied_aliases_in_opacus_layout_tie_the_lstm_weights_without_changing_its_parameters():
    model = build()
    lstm = model.lstm
    assert model.get_submodule("lstm.l1.ih").weight is lstm.weight_ih_l0 is lstm.weight_ih_l1
    assert lstm.l1.hh.bias is lstm.bias_hh_l0 is lstm.bias_hh_l1
    assert lstm.l0.hh.weight is not lstm.l1.hh.weight  # untied ones stay apart
    params = list(model.parameters())
    assert len(params) == len({id(p) for p in params}) == 3 + 4 + 2 + 2 - 2  # no duplicate, two tied away
    assert "lstm.weight_ih_l1" in model.state_dict() and not any(".l0." in k or ".ih." in k for k in model.state_dict())


def test_the_program_trains_with_the_steps_and_epsilon_the_accountant_gives():
    model = build()
    before, weights = fingerprint(model), {k: v.clone() for k, v in model.state_dict().items()}
    steps, epsilon, returned = train(model, model_loss="mean")
    assert returned is model
    assert steps == 2 * 4  # two epochs of len(loader) = 64 / 16 logical steps, each counted once
    expected = RDPAccountant()
    expected.history = [(1.0, 16 / 64, steps)]
    assert epsilon == pytest.approx(expected.get_epsilon(1e-5), rel=1e-9)
    assert all(not torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert fingerprint(model) == before  # cleanup left the model as it was: no loss hook either


def test_without_the_switch_the_batch_token_mean_is_refused_naming_it():
    with pytest.raises(PerSampleGradientError, match="model_loss='mean'"):
        train(build())


def test_the_switched_loss_is_the_mean_of_each_rows_own_token_mean():
    model = build()
    ids, labels = dataset()[:8]
    with GradSampleHooks(model) as hooks:
        hooks.use_model_loss("mean")
        outputs = model(input_ids=ids, labels=labels)
        expected = token_per_sample_loss(outputs.logits, labels, shift=True).mean()
        assert outputs.loss.item() == pytest.approx(expected.item(), rel=1e-6)
        outputs.loss.backward()
        norms = hooks.per_sample_norms()
        hooks.use_model_loss("sum")
        hooks.clear()
        outputs = model(input_ids=ids, labels=labels)  # each row's token sum, averaged over the rows
        summed = token_per_sample_loss(outputs.logits, labels, shift=True, per_unit="sum").mean()
        assert outputs.loss.item() == pytest.approx(summed.item(), rel=1e-6) and summed > expected
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels).loss is not None  # detached: the model's own loss again
    # each row's norm is that of its own loss's gradient, computed alone
    for i in range(8):
        model.zero_grad()
        row = token_per_sample_loss(model(input_ids=ids[i:i + 1]).logits, labels[i:i + 1], shift=True).sum()
        row.backward()
        alone = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
        by_controller = torch.sqrt(sum(n[i] ** 2 for n in norms.values()))
        assert by_controller.item() == pytest.approx(alone.item(), rel=1e-4)


def test_a_model_without_transformers_loss_function_is_refused_with_the_one_line_change():
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))
    before = fingerprint(model)
    from torch.utils.data import DataLoader

    from dptorch import PrivacyEngine

    with pytest.raises(ValueError, match="token_per_sample_loss"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(dataset(), batch_size=16), noise_multiplier=1.0,
                                     max_grad_norm=1.0, wrap_model=False, model_loss="mean")
    assert not is_attached(model) and fingerprint(model) == before


def test_the_served_names_are_read_only():
    from torch.utils.data import DataLoader

    from dptorch import PrivacyEngine

    model = build()
    hooks, optimizer, _ = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(dataset(), batch_size=16),
        noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    assert hooks._module is model and optimizer._is_last_step_skipped is False
    with pytest.raises(AttributeError):
        hooks._module = build(1)  # the controller keeps watching the model it hooked
    with pytest.raises(AttributeError):
        optimizer._is_last_step_skipped = True  # a step's kind is the optimizer's decision (signal_skip_step)
    hooks.cleanup()


@pytest.mark.skipif(importlib.util.find_spec("opacus") is None, reason="Opacus is not installed (not a dependency)")
def test_opacus_gives_the_same_steps_and_epsilon():  # pragma: no cover - needs Opacus
    import opacus
    from opacus.utils.batch_memory_manager import BatchMemoryManager as OpacusManager

    model = build()
    engine = opacus.PrivacyEngine(accountant="rdp")
    from torch.utils.data import DataLoader

    hooks, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(), batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    steps = 0
    for _ in range(2):
        with OpacusManager(data_loader=loader, max_physical_batch_size=6, optimizer=optimizer) as batches:
            for input_ids, labels in batches:
                optimizer.zero_grad()
                model(input_ids=input_ids, labels=labels).loss.backward()
                optimizer.step()
                steps += not optimizer._is_last_step_skipped
    ours_steps, ours_epsilon, _ = train(build(), model_loss="mean")
    assert steps == ours_steps and engine.get_epsilon(1e-5) == pytest.approx(ours_epsilon, rel=1e-3)

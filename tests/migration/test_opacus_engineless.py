"""Opacus' engine-less API after the rename: the optimizer finds its controller by parameter, the
skip queue, the accountant hook, and ghost mode's loss wrapper around a transformers loss."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch.accountants import RDPAccountant
from dptorch.data_loader import DPDataLoader
from dptorch.grad_sample import GradSampleHooks, GradSampleModule
from dptorch.grad_sample.utils import wrap_model
from dptorch.optimizers import DPOptimizer
from dptorch.plan import SamplingMismatchError
from dptorch.utils.batch_memory_manager import wrap_data_loader
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping


def opacus_optimizer(params, **extra):
    return DPOptimizer(optimizer=torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, expected_batch_size=8,
                       max_grad_norm=1.0, loss_reduction="mean", **extra)


def summed_and_accounted(model, expected_batch_size, sample_rate):
    """Opacus' engine-less set-up with summed losses: controller, optimizer, accountant hook."""
    wrap_model(model, grad_sample_mode="hooks", wrap_model=False, loss_reduction="sum")
    optimizer = DPOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=expected_batch_size, loss_reduction="sum")
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate))
    return optimizer, accountant


@pytest.mark.parametrize("attach", ["wrap_model", "GradSampleModule"])
def test_without_hooks_the_optimizer_takes_the_controller_attached_to_its_parameters(attach):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    controller = (wrap_model(model, grad_sample_mode="hooks", wrap_model=False) if attach == "wrap_model"
                  else GradSampleModule(model).hooks)
    optimizer = opacus_optimizer(model.parameters())
    assert optimizer.hooks is controller
    controller.cleanup()
    with pytest.raises(RuntimeError, match=r"no per-sample gradient controller is attached.*wrap_model=False"):
        opacus_optimizer(model.parameters())  # cleaned up: nothing claims the parameters any more


def test_the_optimizer_refuses_parameters_no_controller_or_two_controllers_claim():
    model, head = nn.Linear(4, 3), nn.Linear(3, 2)
    hooks = GradSampleHooks(model)
    with pytest.raises(RuntimeError, match=r"parameters 2 \(shape \(2, 3\)\), 3 \(shape \(2,\)\) have no controller"):
        opacus_optimizer([*model.parameters(), *head.parameters()])
    shared = nn.Linear(4, 4)
    first, second = nn.Sequential(shared), nn.Sequential(shared, nn.ReLU())
    one, two = GradSampleHooks(first), GradSampleHooks(second)
    with pytest.raises(RuntimeError, match=r"captured by 2 controllers \(attached to Sequential and Sequential\)"):
        opacus_optimizer(first.parameters())
    with pytest.raises(RuntimeError, match=r"captured by 2 controllers"):  # naming one of them does not help
        opacus_optimizer(first.parameters(), hooks=one)
    two.cleanup()
    assert opacus_optimizer(first.parameters()).hooks is one
    for controller in (hooks, one):
        controller.cleanup()


def test_signals_queued_ahead_make_the_right_steps_real_and_each_is_accounted_once():
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    wrap_model(model, grad_sample_mode="hooks", wrap_model=False)
    optimizer = opacus_optimizer(model.parameters())
    accountant, q = RDPAccountant(), 16 / 64
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(q))
    loader = DPDataLoader(TensorDataset(torch.randn(64, 5), torch.randint(0, 2, (64,))), sample_rate=q, seed=3)
    physical = wrap_data_loader(data_loader=loader, optimizer=optimizer, max_batch_size=4)
    expected = [closes for _, closes in physical._plan]  # the batch plan: which physical batch closes a draw
    batches, real = list(physical), []  # every batch fetched first: all signals queued ahead of the steps
    assert optimizer._step_skip_queue == [not closes for closes in expected]
    for x, y in batches:
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
        steps = len(accountant)
        optimizer.step()
        real.append(len(accountant) > steps)
        optimizer.zero_grad()
    assert real == expected and sum(real) == len(loader)
    assert accountant.history == [[1.0, q, len(loader)]]
    reference = RDPAccountant()
    reference.step(noise_multiplier=1.0, sample_rate=q, num_steps=len(loader))
    assert math.isclose(accountant.get_epsilon(1e-5), reference.get_epsilon(1e-5), rel_tol=1e-9)


def test_without_virtual_steps_two_backward_passes_in_one_step_are_refused_before_anything_changes():
    model = nn.Linear(3, 1)
    optimizer, accountant = summed_and_accounted(model, expected_batch_size=4, sample_rate=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # two batches under one noise draw: one draw in two parts, or two draws merged?
        model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(SamplingMismatchError, match="2 backward passes since the last step"):
        optimizer.step()
    assert accountant.history == []
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    optimizer.zero_grad()
    model(torch.randn(4, 3)).sum().backward()  # one pass per step: one step at the rate
    optimizer.step()
    assert accountant.history == [[1.0, 0.1, 1]]


def _ghost_with_the_models_own_loss(model, batch_size):
    hooks = wrap_model(model, grad_sample_mode="ghost", wrap_model=False)
    optimizer = DPOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                            max_grad_norm=1e6, expected_batch_size=batch_size, loss_reduction="mean")
    assert not hasattr(model.loss_function, "reduction")  # a transformers loss function
    model.loss_function = DPLossFastGradientClipping(hooks, optimizer, model.loss_function, "mean")
    return hooks, optimizer


def test_ghost_loss_wrapper_takes_a_transformers_loss_without_reduction():
    """The model's own loss, wrapped as the example does: the private step without noise and with an
    unreachable bound is the ordinary gradient of that loss."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                      num_labels=3, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config)
    ids, labels = torch.randint(1, 30, (4, 6)), torch.randint(0, 3, (4,))
    model(input_ids=ids, labels=labels).loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    hooks, optimizer = _ghost_with_the_models_own_loss(model, 4)
    model(input_ids=ids, labels=labels).loss.backward()
    optimizer.step()
    for p, expected in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6)
    hooks.cleanup()


def test_a_token_mean_over_the_batch_is_refused_before_any_update():
    """A causal LM's built-in loss divides by the batch's token count: each sample's clipped share would
    depend on the others' lengths. Opacus treats that scalar as one sample; here it is refused."""
    transformers = pytest.importorskip("transformers")
    from dptorch.grad_sample.errors import PerSampleGradientError

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=30, n_positions=8, n_embd=16, n_layer=1,
                                                                  n_head=2, bos_token_id=0, eos_token_id=0))
    hooks, optimizer = _ghost_with_the_models_own_loss(model, 3)
    ids = torch.randint(0, 30, (3, 6))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PerSampleGradientError, match=r"divisor counted from the data.*per-sample loss"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    hooks.cleanup()


def test_a_pass_stopped_inside_a_draw_leaves_nothing_for_the_next_pass():
    """The Trainer reads len() once; a later epoch may be longer and end inside a Poisson draw. Its
    held clipped gradients and signals are dropped when the next pass starts, not merged into a step."""
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    optimizer, accountant = summed_and_accounted(model, expected_batch_size=16, sample_rate=0.25)
    loader = DPDataLoader(TensorDataset(torch.randn(64, 5), torch.randint(0, 2, (64,))), sample_rate=0.25, seed=1)
    physical = wrap_data_loader(data_loader=loader, optimizer=optimizer, max_batch_size=2)
    for x, y in physical:  # stop at the first physical batch that does not close its draw
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad()
        if optimizer._last_step_skipped:
            break
    assert optimizer.accumulated_iterations > 0 and len(accountant) == 0
    batches = iter(physical)
    assert optimizer.accumulated_iterations == 0 and optimizer._step_skip_queue == []
    rows = []
    for x, y in batches:  # the next pass: its first real step holds its first draw's batches only
        rows.append(len(y))
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        held = optimizer.accumulated_iterations
        optimizer.step()
        optimizer.zero_grad()
        if len(accountant):
            break
    assert held == len(rows) and sum(rows) == physical._opens[0][1] and len(accountant) == 1


def test_opacus_shape_argument_gives_one_loss_per_sequence():
    """``criterion(logits.view(-1, V), labels.view(-1), shape=(B, T, V))``: each sequence's mean over its
    own non-ignored tokens, the batch's mean of those; its private step is the gradient of that loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    ids = torch.randint(0, 11, (3, 5))
    labels = ids.clone()
    labels[0, 3:] = -100  # sequence 0 has 3 targets, the others 5
    criterion = nn.CrossEntropyLoss(ignore_index=-100)
    per_token = nn.functional.cross_entropy(model(ids).reshape(15, 11), labels.reshape(15), reduction="none")
    expected = (per_token.reshape(3, 5).sum(1) / torch.tensor([3.0, 5.0, 5.0])).mean()
    expected.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    hooks = wrap_model(model, grad_sample_mode="ghost", wrap_model=False)
    optimizer = DPOptimizer(optimizer=torch.optim.SGD(model.parameters(), lr=0.0), noise_multiplier=0.0,
                            max_grad_norm=1e6, expected_batch_size=3, loss_reduction="mean")
    wrapped = DPLossFastGradientClipping(hooks, optimizer, criterion, "mean")
    logits = model(ids)
    loss = wrapped(logits.reshape(15, 11), labels.reshape(15), shape=logits.shape)
    torch.testing.assert_close(loss.detach(), expected.detach())
    loss.backward()
    optimizer.step()
    for p, grad in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, grad, rtol=1e-4, atol=1e-6)
    hooks.cleanup()

"""Opacus call shapes of the engine: checkpoints, compatibility helpers, optimizer counters,
``criterion=``, ``noise_generator=torch.Generator``, loaders with a batch sampler, and the
``wrap_model=False`` idiom.

Each test is written against Opacus 1.6's behaviour (the first four were strict xfails until the
engine part of the migration issue landed). The script-level ones (``criterion=`` 4-tuple,
``noise_generator=torch.Generator``, a loader built on ``UniformWithReplacementSampler``) are in
``test_scripts.py``.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import GradSampleHooks, PrivacyEngine
from dptorch.accountants import RDPAccountant


def _setup(model=None, accountant="rdp"):
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = model or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return PrivacyEngine(accountant=accountant), model, optimizer, DataLoader(dataset, batch_size=16)


def _train(model, optimizer, loader):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_optimizer_counts_accumulated_iterations_as_opacus_does():
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    hook_accountant = RDPAccountant()
    optimizer.attach_step_hook(hook_accountant.get_optimizer_hook_fn(sample_rate=loader.sample_rate))
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    assert optimizer.accumulated_iterations == 1
    optimizer.step()
    assert hook_accountant.history == engine.accountant.history


def test_checkpoint_with_opacus_keywords_round_trips_scheduler_and_extra_entries(tmp_path):
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _train(model, optimizer, loader)
    scheduler.step()
    path = tmp_path / "checkpoint.pt"
    engine.save_checkpoint(path=path, module=model, optimizer=optimizer, optimizer_scheduler=scheduler,
                           checkpoint_dict={"epoch": 3})

    engine2, model2, optimizer2, loader2 = _setup()
    model2, optimizer2, loader2 = engine2.make_private(module=model2, optimizer=optimizer2, data_loader=loader2,
                                                      noise_multiplier=1.0, max_grad_norm=1.0)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=1, gamma=0.5)
    checkpoint = engine2.load_checkpoint(path=path, module=model2, optimizer=optimizer2, optimizer_scheduler=scheduler2)
    assert checkpoint["epoch"] == 3
    assert scheduler2.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 1
    assert engine2.accountant.history == engine.accountant.history
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5)


def test_checkpoint_file_in_opacus_layout_loads(tmp_path):
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    saved_weights = {k: torch.full_like(v, 0.25) for k, v in model._module.state_dict().items()}
    path = tmp_path / "opacus.pt"
    torch.save({
        "module_state_dict": {f"_module.{k}": v for k, v in saved_weights.items()},  # Opacus saves the wrapper's keys
        "privacy_accountant_state_dict": {"history": [(1.0, 0.25, 12)], "mechanism": "rdp"},
        "optimizer_state_dict": optimizer.original_optimizer.state_dict(),
        "epoch": 5,
    }, path)
    checkpoint = engine.load_checkpoint(path=path, module=model, optimizer=optimizer)
    assert checkpoint["epoch"] == 5
    assert engine.accountant.history == [[1.0, 0.25, 12]]
    assert all(torch.equal(model._module.state_dict()[k], v) for k, v in saved_weights.items())


def test_engine_compatibility_helpers_as_in_opacus():
    from dptorch.grad_sample import UnsupportedModuleError

    bn_model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    engine, model, optimizer, loader = _setup(model=bn_model)
    assert engine.is_compatible(module=model, optimizer=optimizer, data_loader=loader) is False
    with pytest.raises(UnsupportedModuleError):
        engine.validate(module=model, optimizer=optimizer, data_loader=loader)
    fixed = PrivacyEngine.get_compatible_module(model)
    assert not any(isinstance(m, nn.BatchNorm1d) for m in fixed.modules())
    optimizer = torch.optim.SGD(fixed.parameters(), lr=0.1)
    assert engine.is_compatible(module=fixed, optimizer=optimizer, data_loader=loader) is True


# ------------------------------------------------------------------ criterion=


def _rdp_epsilon(history, delta=1e-5):
    accountant = RDPAccountant()
    for sigma, q, steps in history:
        accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
def test_criterion_argument_returns_the_wrapped_criterion_in_every_mode(mode):
    from dptorch import DPLoss

    engine, model, optimizer, loader = _setup()
    result = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                 max_grad_norm=1.0, grad_sample_mode=mode, criterion=nn.CrossEntropyLoss())
    assert len(result) == 4 and isinstance(result[2], DPLoss)
    model, optimizer, criterion, loader = result
    x, y = next(iter(loader))
    optimizer.zero_grad()
    loss = criterion(model(x), y)
    assert loss.per_sample.shape == (len(y),)
    loss.backward()
    optimizer.step()
    assert engine.plan.steps == 1

    engine, model, optimizer, loader = _setup()
    assert len(engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                   max_grad_norm=1.0, grad_sample_mode=mode)) == 3


def test_wrapped_criterion_gives_the_update_of_the_plain_mean_loss():
    def run(wrapped):
        engine, model, optimizer, loader = _setup()
        extra = {"criterion": nn.CrossEntropyLoss()} if wrapped else {}
        result = engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                                     max_grad_norm=0.5, noise_generator=torch.Generator().manual_seed(3), **extra)
        model, optimizer, loader = (result[0], result[1], result[-1])
        criterion = result[2] if wrapped else nn.CrossEntropyLoss()
        torch.manual_seed(4)
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.allclose(run(True), run(False), atol=1e-6)


def test_make_private_with_epsilon_passes_the_criterion_on():
    engine, model, optimizer, loader = _setup()
    result = engine.make_private_with_epsilon(module=model, optimizer=optimizer, data_loader=loader, target_epsilon=3.0,
                                              target_delta=1e-5, epochs=2, max_grad_norm=1.0,
                                              criterion=nn.CrossEntropyLoss())
    assert len(result) == 4


# ------------------------------------------------------------------ noise_generator= and accumulated_iterations


def test_a_torch_generator_for_the_noise_is_adopted_and_checkpointed():
    engine, model, optimizer, loader = _setup()
    generator = torch.Generator().manual_seed(0)
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=generator)
    assert optimizer.noise_generator.generator is generator
    before = generator.get_state()
    _train(model, optimizer, loader)
    assert not torch.equal(generator.get_state(), before)  # the noise came from the caller's generator
    assert torch.equal(optimizer.state_dict()["dp"]["noise_generator"]["rng_state"], generator.get_state())


def test_noise_from_a_generator_on_another_device_is_drawn_from_its_stream_and_moved():
    from dptorch.noise import NoiseGenerator

    adopted = NoiseGenerator(generator=torch.Generator().manual_seed(0))
    noise = adopted.noise_like(torch.empty(5, device="meta"), 2.0)  # stands for a CUDA model's gradient
    assert noise.device.type == "meta" and noise.shape == (5,)
    replay = torch.Generator().manual_seed(0)
    torch.randn(5, generator=replay)
    assert torch.equal(adopted.generator.get_state(), replay.get_state())


def test_secure_mode_refuses_a_seedable_noise_generator():
    engine, model, optimizer, loader = _setup()
    engine = PrivacyEngine(accountant="rdp", secure_mode=True)
    with pytest.raises(ValueError, match="secure_mode"):
        engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                            max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(0))


def test_accumulated_iterations_count_backward_passes_until_the_step():
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    torch.manual_seed(1)
    x, y = next(iter(loader))
    half = len(y) // 2
    optimizer.zero_grad()
    assert optimizer.accumulated_iterations == 0
    nn.functional.cross_entropy(model(x[:half]), y[:half]).backward()
    nn.functional.cross_entropy(model(x[half:]), y[half:]).backward()
    assert optimizer.accumulated_iterations == 2  # two physical batches of one Poisson draw
    optimizer.step()
    assert optimizer.accumulated_iterations == 0


def test_accumulated_iterations_survive_a_skipped_step_and_a_checkpoint():
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    x, y = next(iter(loader))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.signal_skip_step(True)
    optimizer.step()
    optimizer.zero_grad()
    assert optimizer.accumulated_iterations == 1
    state = optimizer.state_dict()
    optimizer.step()  # the real step privatises the held gradients
    assert optimizer.accumulated_iterations == 0
    optimizer.load_state_dict(state)
    assert optimizer.accumulated_iterations == 1


# ------------------------------------------------------------------ checkpoints


def _opacus_checkpoint(path, model, history, mechanism="rdp", epoch=5):
    """A checkpoint file as Opacus 1.6 writes it: the wrapper's keys, tuples in the accountant history."""
    from collections import OrderedDict

    weights = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    twin = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    twin.load_state_dict(weights)
    inner = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    nn.functional.cross_entropy(twin(torch.randn(3, 4)), torch.tensor([0, 1, 0])).backward()
    inner.step()
    accountant_state = OrderedDict(history=[tuple(entry) for entry in history], mechanism=mechanism)
    torch.save({"module_state_dict": {f"_module.{k}": v for k, v in weights.items()},
                "privacy_accountant_state_dict": accountant_state,
                "optimizer_state_dict": inner.state_dict(), "epoch": epoch}, path)
    return weights, inner


def _momentum_setup():
    engine, model, _, loader = _setup()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return engine, model, optimizer, loader


def test_a_run_started_with_opacus_continues_with_the_same_epsilon(tmp_path):
    engine, model, optimizer, loader = _momentum_setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    history = [(1.3, 0.25, 8), (1.0, 0.25, 3)]  # 2 epochs at sigma 1.3, then 3 steps at 1.0
    weights, inner = _opacus_checkpoint(tmp_path / "opacus.pt", model._module, history)
    checkpoint = engine.load_checkpoint(path=tmp_path / "opacus.pt", module=model, optimizer=optimizer)
    assert checkpoint["epoch"] == 5 and "optimizer_state_dict" not in checkpoint
    assert engine.get_epsilon(1e-5) == pytest.approx(_rdp_epsilon(history), rel=1e-12)
    assert all(torch.equal(model._module.state_dict()[k], v) for k, v in weights.items())
    restored = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    saved = [inner.state[p]["momentum_buffer"] for p in inner.param_groups[0]["params"]]
    assert all(torch.equal(a, b) for a, b in zip(restored, saved))

    _train(model, optimizer, loader)  # one more epoch: 4 steps at sigma 1.0
    assert engine.plan.steps == 15
    expected = _rdp_epsilon([(1.3, 0.25, 8), (1.0, 0.25, 7)])
    assert engine.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-12)


def test_an_opacus_checkpoint_of_another_accountant_loads_its_history_with_a_warning(tmp_path):
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    _opacus_checkpoint(tmp_path / "opacus.pt", model._module, [(1.0, 0.25, 4)], mechanism="prv")
    with pytest.warns(UserWarning, match="'prv'"):
        engine.load_checkpoint(path=tmp_path / "opacus.pt", module=model, optimizer=optimizer)
    assert engine.accountant.history == [[1.0, 0.25, 4]] and engine.plan.steps == 4


def test_steps_without_noise_in_an_opacus_history_make_epsilon_infinite(tmp_path):
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    _opacus_checkpoint(tmp_path / "opacus.pt", model._module, [(0.0, 0.25, 2), (1.0, 0.25, 4)])
    engine.load_checkpoint(path=tmp_path / "opacus.pt", module=model, optimizer=optimizer)
    assert engine.plan.steps == 6 and engine.get_epsilon(1e-5) == float("inf")


def test_own_checkpoint_round_trips_extra_and_checkpoint_dict_entries_and_a_file_object(tmp_path):
    import io

    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    _train(model, optimizer, loader)
    entries = {"epoch": 1}
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=model, optimizer=optimizer, data_loader=loader,
                           checkpoint_dict=entries, extra={"step": 4})
    assert entries == {"epoch": 1}  # Opacus adds its entries to the caller's dict; dptorch leaves it alone
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert {"module_state_dict", "privacy_accountant_state_dict", "optimizer_state_dict", "dptorch"} <= set(saved)
    assert set(saved["module_state_dict"]) == set(model._module.state_dict())

    engine2, model2, optimizer2, loader2 = _setup()
    model2, optimizer2, loader2 = engine2.make_private(module=model2, optimizer=optimizer2, data_loader=loader2,
                                                      noise_multiplier=1.0, max_grad_norm=1.0)
    buffer.seek(0)
    checkpoint = engine2.load_checkpoint(buffer, module=model2, optimizer=optimizer2, data_loader=loader2)
    assert checkpoint["epoch"] == 1 and checkpoint["step"] == 4
    assert engine2.plan.steps == engine.plan.steps == 4
    assert loader2.state_dict() == loader.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_checkpoint_entries_that_clash_with_the_checkpoint_are_refused(tmp_path):
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="module_state_dict"):
        engine.save_checkpoint(path=tmp_path / "a.pt", module=model, checkpoint_dict={"module_state_dict": 1})
    with pytest.raises(ValueError, match="epoch"):
        engine.save_checkpoint(path=tmp_path / "a.pt", module=model, checkpoint_dict={"epoch": 1}, extra={"epoch": 2})
    assert not (tmp_path / "a.pt").exists()


def test_checkpoint_of_the_earlier_layout_still_loads(tmp_path):
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    _train(model, optimizer, loader)
    torch.save({"module": model._module.state_dict(), "accountant": engine.accountant.state_dict(),
                "plan": engine.plan.state_dict(), "torch_rng_state": torch.get_rng_state(), "extra": {"step": 4},
                "optimizer": optimizer.state_dict(), "data_loader": loader.state_dict()}, tmp_path / "old.pt")

    engine2, model2, optimizer2, loader2 = _setup()
    model2, optimizer2, loader2 = engine2.make_private(module=model2, optimizer=optimizer2, data_loader=loader2,
                                                      noise_multiplier=1.0, max_grad_norm=1.0)
    checkpoint = engine2.load_checkpoint(tmp_path / "old.pt", module=model2, optimizer=optimizer2, data_loader=loader2)
    assert checkpoint["step"] == 4
    assert engine2.get_epsilon(1e-5) == engine.get_epsilon(1e-5) > 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_checkpoint_of_a_run_that_sampled_differently_is_refused_before_anything_loads(tmp_path):
    engine, model, optimizer, loader = _setup()
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0)
    _train(model, optimizer, loader)
    engine.save_checkpoint(path=tmp_path / "c.pt", module=model, optimizer=optimizer)

    torch.manual_seed(0)
    other_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    other = PrivacyEngine(accountant="rdp")
    dataset = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    other_model, other_optimizer, _ = other.make_private(
        module=other_model, optimizer=torch.optim.SGD(other_model.parameters(), lr=0.1),
        data_loader=DataLoader(dataset, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0)
    before = [p.detach().clone() for p in other_model.parameters()]
    with pytest.raises(ValueError, match="sample_rate"):
        other.load_checkpoint(path=tmp_path / "c.pt", module=other_model, optimizer=other_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, other_model.parameters()))
    assert other.plan.steps == 0


# ------------------------------------------------------------------ compatibility helpers


def test_is_compatible_also_checks_what_make_private_refuses_and_changes_nothing():
    engine, model, optimizer, loader = _setup()
    state = torch.get_rng_state()
    assert engine.is_compatible(module=model, optimizer=optimizer, data_loader=loader) is True
    assert torch.equal(torch.get_rng_state(), state)  # no seed drawn, no loader built

    foreign = torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
    assert engine.is_compatible(module=model, optimizer=foreign, data_loader=loader) is False
    with pytest.raises(ValueError, match="not in the model"):
        engine.validate(module=model, optimizer=foreign, data_loader=loader)

    model.eval()
    assert engine.is_compatible(module=model, optimizer=optimizer, data_loader=loader) is False
    model.train()

    unbatched = DataLoader(loader.dataset, batch_size=None)
    assert engine.is_compatible(module=model, optimizer=optimizer, data_loader=unbatched) is False


# ------------------------------------------------------------------ loaders with a batch sampler


class _LengthGroupedBatches:
    """A batch sampler of variable-size batches (no batch_size attribute)."""

    def __iter__(self):
        yield from ([0, 1, 2], [3, 4], list(range(5, 64)))

    def __len__(self):
        return 3


def test_loader_with_a_fixed_size_batch_sampler_gets_one_over_its_length():
    from torch.utils.data import BatchSampler, RandomSampler

    from dptorch.data import DPDataLoader

    _, _, _, loader = _setup()
    source = DataLoader(loader.dataset, batch_sampler=BatchSampler(RandomSampler(loader.dataset), 16, False))
    assert source.batch_size is None
    dp_loader = DPDataLoader.from_data_loader(source)
    assert dp_loader.sample_rate == 1 / 4 and len(dp_loader) == 4


def test_accelerate_prepared_loaders_keep_their_sample_rate():
    accelerate = pytest.importorskip("accelerate.data_loader")
    from dptorch.data import PoissonBatchSampler

    engine, model, optimizer, loader = _setup()
    options = dict(device=torch.device("cpu"), num_processes=1, process_index=0, put_on_device=False)
    prepared = accelerate.prepare_data_loader(DataLoader(loader.dataset, batch_size=16, shuffle=True), **options)
    assert prepared.batch_size is None
    model, optimizer, dp_loader = engine.make_private(module=model, optimizer=optimizer, data_loader=prepared,
                                                      noise_multiplier=1.0, max_grad_norm=1.0)
    assert engine.sample_rate == 1 / len(prepared) == 1 / 4
    _train(model, optimizer, dp_loader)
    assert engine.plan.steps == 4

    poisson = DataLoader(loader.dataset, batch_sampler=PoissonBatchSampler(64, 0.3, steps=5))
    from dptorch.data import DPDataLoader

    dp_loader = DPDataLoader.from_data_loader(accelerate.prepare_data_loader(poisson, **options))
    assert dp_loader.sample_rate == 0.3 and len(dp_loader) == 5


def test_loaders_whose_batches_no_sample_rate_describes_are_refused():
    from dptorch.data import DPDataLoader

    _, _, _, loader = _setup()
    with pytest.raises(ValueError, match="no sample rate"):
        DPDataLoader.from_data_loader(DataLoader(loader.dataset, batch_sampler=_LengthGroupedBatches()))
    with pytest.raises(ValueError, match="unbatched"):
        DPDataLoader.from_data_loader(DataLoader(loader.dataset, batch_size=None))


# ------------------------------------------------------------------ wrap_model=False


def test_wrap_model_false_returns_the_controller_as_opacus_does_without_a_warning(recwarn):
    engine, model, optimizer, loader = _setup()
    hooks, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                   noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    assert isinstance(hooks, GradSampleHooks) and hooks is engine.hooks and hooks.module is model
    assert not [w for w in recwarn if issubclass(w.category, UserWarning) and "wrap_model" in str(w.message)]
    hooks.cleanup()
    assert not engine.hooks.attached


def test_the_old_dptorch_idiom_fails_with_the_fix_in_the_message():
    engine, model, optimizer, loader = _setup()
    old_name_for_hooks, optimizer, loader = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                                                noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
    x, _ = next(iter(loader))
    with pytest.raises(TypeError, match=r"not the model.*hooks, optimizer, data_loader = engine.make_private"):
        old_name_for_hooks(x)
    with pytest.raises(TypeError, match=r"indexed like a model \(\[0\]\).*hooks.cleanup\(\)"):
        old_name_for_hooks[0]
    for name in ("parameters", "train", "state_dict", "to"):
        with pytest.raises(AttributeError, match=rf"model attribute '{name}'.*hooks.cleanup\(\)"):
            getattr(old_name_for_hooks, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'$"):
        old_name_for_hooks.no_such_thing  # not a model attribute either: the plain error
    old_name_for_hooks.cleanup()

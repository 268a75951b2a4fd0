"""Opacus scripts, renamed to dptorch, train and report Opacus' RDP epsilon.

Each ``opacus_*.py`` next to this file is an Opacus example or tutorial whose only change is
``opacus`` -> ``dptorch`` in the imports (plus offline data). Each test checks that it trains and
that its epsilon is the RDP figure for the same settings, computed here with
``dptorch.accounting.RDPAccountant``: sample rate ``1 / len(data_loader)`` and ``epochs *
len(data_loader)`` steps, as Opacus' ``make_private`` sets them up.
"""

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dptorch.accounting import RDPAccountant, get_noise_multiplier

from . import opacus_char_lstm, opacus_ghost_clipping, opacus_image_classifier, opacus_mnist, opacus_readme

HERE = Path(__file__).resolve().parent


def rdp_epsilon(noise_multiplier, sample_rate, steps, delta):
    accountant = RDPAccountant()
    accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("script", sorted(HERE.glob("opacus_*.py")), ids=lambda p: p.stem)
def test_scripts_import_only_opacus_paths_renamed(script):
    """Renaming dptorch back to opacus gives imports that exist in Opacus (the guide's table)."""
    from .test_import_paths import OPACUS_PATHS

    imports = re.findall(r"^(?:from|import) (dptorch[\w.]*)", script.read_text(), flags=re.MULTILINE)
    assert imports, script.name
    for path in imports:
        assert "opacus" + path[len("dptorch"):] in OPACUS_PATHS, f"{script.name}: {path}"


def test_readme_quick_start_trains_and_reports_the_rdp_epsilon():
    result = opacus_readme.main(epochs=3)
    assert result["loss_after"] < 0.7 * result["loss_before"]
    steps_per_epoch = math.ceil(512 / 64)
    assert result["data_loader"].sample_rate == 1 / steps_per_epoch and len(result["data_loader"]) == steps_per_epoch
    expected = rdp_epsilon(1.1, 1 / steps_per_epoch, 3 * steps_per_epoch, 1e-5)
    assert result["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert 0 < result["epsilon"] < 10


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_mnist_example_trains_and_reports_the_rdp_epsilon_every_epoch(capsys):
    result = opacus_mnist.main(["-n", "3", "-b", "64", "--n-train", "640", "--n-test", "256", "--lr", "0.5"])
    out = capsys.readouterr().out
    assert "Train Epoch: 3" in out and "Test set:" in out
    assert result["accuracy"][0] > 0.5  # ten classes: chance is 0.1
    losses = [loss for loss, _ in result["history"]]
    assert losses[-1] < 0.5 * losses[0]
    q = 1 / 10  # 640 samples in batches of 64
    for epoch, (_, epsilon) in enumerate(result["history"], start=1):
        assert epsilon == pytest.approx(rdp_epsilon(1.0, q, 10 * epoch, 1e-5), rel=1e-12)
    assert result["privacy_engine"].get_epsilon(1e-5) == result["history"][-1][1]


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_char_lstm_example_trains_a_dplstm_and_reports_the_rdp_epsilon(capsys):
    argv = ["--epochs", "3", "--n-names", "600", "--hidden-size", "32", "--embedding-size", "16",
            "--learning-rate", "1.0", "-b", "32"]
    result = opacus_char_lstm.main(argv)
    assert "Test Accuracy" in capsys.readouterr().out
    assert result["accuracy"] > 1 / result["n_classes"] + 0.2  # three languages: chance is 1/3
    assert result["losses"][-1] < result["losses"][0]
    steps_per_epoch = math.ceil(480 / 32)
    assert len(result["train_loader"]) == steps_per_epoch
    expected = rdp_epsilon(1.0, 1 / steps_per_epoch, 3 * steps_per_epoch, 8e-5)
    assert result["privacy_engine"].get_epsilon(8e-5) == pytest.approx(expected, rel=1e-12)


def test_image_classifier_tutorial_fixes_batchnorm_calibrates_and_trains_with_batch_memory_manager(capsys):
    tutorial = opacus_image_classifier
    result = tutorial.main()
    assert "Using sigma=" in capsys.readouterr().out
    assert result["errors_before_fix"] and all("BatchNorm" in str(e) for e in result["errors_before_fix"])
    assert result["errors_after_fix"] == []
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in result["model"].modules())
    steps_per_epoch = math.ceil(result["train_size"] / tutorial.BATCH_SIZE)
    q, steps = 1 / steps_per_epoch, tutorial.EPOCHS * steps_per_epoch
    sigma = get_noise_multiplier(target_epsilon=tutorial.EPSILON, target_delta=tutorial.DELTA, sample_rate=q,
                                 epochs=tutorial.EPOCHS, accountant="rdp")
    assert result["optimizer"].noise_multiplier == sigma
    assert result["epsilon"] == pytest.approx(rdp_epsilon(sigma, q, steps, tutorial.DELTA), rel=1e-12)
    assert tutorial.EPSILON * 0.99 <= result["epsilon"] <= tutorial.EPSILON
    assert result["physical_batches"] > steps  # logical batches of 128 split into physical ones of 48
    assert result["test_accuracy"] > 0.6  # ten digits: chance is 0.1


def test_text_classifier_tutorial_fine_tunes_a_tiny_bert_and_reports_the_rdp_epsilon():
    pytest.importorskip("transformers")
    from . import opacus_text_classifier as tutorial

    result = tutorial.main()
    (loss_before, accuracy_before), (loss_after, accuracy_after) = result["eval_before"], result["eval_after"]
    assert loss_after < loss_before - 0.1
    assert accuracy_after > 0.8 > accuracy_before  # labels are 10% noisy: 0.9 is the best possible
    steps_per_epoch = math.ceil(512 / tutorial.BATCH_SIZE)
    q = 1 / steps_per_epoch
    sigma = get_noise_multiplier(target_epsilon=tutorial.EPSILON, target_delta=tutorial.DELTA, sample_rate=q,
                                 epochs=tutorial.EPOCHS, accountant="rdp")
    assert result["optimizer"].noise_multiplier == sigma
    expected = rdp_epsilon(sigma, q, tutorial.EPOCHS * steps_per_epoch, tutorial.DELTA)
    assert result["epsilon"] == pytest.approx(expected, rel=1e-12) and result["epsilon"] <= tutorial.EPSILON


# ------------------------------------------------------------------ waiting for the engine part


def test_ghost_clipping_recipe_with_criterion_trains_and_reports_the_rdp_epsilon():
    result = opacus_ghost_clipping.main(epochs=3)
    assert sum(result["losses"][-8:]) < sum(result["losses"][:8])
    assert result["epsilon"] == pytest.approx(rdp_epsilon(1.1, 1 / 8, 24, 1e-5), rel=1e-12)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_char_lstm_example_on_a_uniform_with_replacement_sampler_keeps_its_sample_rate():
    argv = ["--epochs", "1", "--n-names", "300", "--hidden-size", "16", "--embedding-size", "8", "-b", "30",
            "--uniform-sampler"]
    result = opacus_char_lstm.main(argv)
    assert result["train_loader"].sample_rate == pytest.approx(30 / 240)
    expected = rdp_epsilon(1.0, 30 / 240, len(result["train_loader"]), 8e-5)
    assert result["privacy_engine"].get_epsilon(8e-5) == pytest.approx(expected, rel=1e-12)


def _quick_start_run(seed):
    torch.manual_seed(1)
    dataset = opacus_readme.synthetic_dataset()
    model = opacus_readme.Net()
    from dptorch import PrivacyEngine

    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=torch.utils.data.DataLoader(dataset, batch_size=64), noise_multiplier=1.1, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(seed),
    )
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_quick_start_with_a_seeded_torch_generator_for_the_noise_is_reproducible():
    first, again, other = _quick_start_run(0), _quick_start_run(0), _quick_start_run(1)
    assert torch.equal(first, again) and not torch.equal(first, other)

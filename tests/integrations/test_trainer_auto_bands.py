"""bands="auto" in the private Trainer: PrivacyArguments(noise_mechanism="bandmf", bands="auto", target_epsilon=...).

The Trainer runs the b that choose_bands picks for DP-SGD's sample rate (expected logical batch /
units) and the run's total steps; the sampler, the plan, the report and the checkpoints all see that b."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import HfArgumentParser, TrainingArguments  # noqa: E402

from dptorch.integrations.hf import PRIVACY_STATE_NAME, PrivacyArguments  # noqa: E402
from dptorch.integrations.hf.trainer import PRIVACY_REPORT_KEY  # noqa: E402
from dptorch.noise.banded import choose_bands  # noqa: E402
from tests.integrations.test_trainer_bandmf import ROWS, bandmf, make_trainer  # noqa: E402

STEPS, DELTA = 8, 1e-3
RATE = 2 * 2 / ROWS  # DP-SGD's q: per_device_train_batch_size 2 * gradient_accumulation_steps 2 over the units


@pytest.mark.parametrize("epsilon, banded", [(0.5, False), (8.0, True)])
def test_trainer_runs_the_bands_choose_bands_picks(tmp_path, epsilon, banded):
    choice = choose_bands(target_epsilon=epsilon, target_delta=DELTA, steps=STEPS, sample_rate=RATE)
    assert (choice.bands > 1) == banded  # low epsilon: DP-SGD's b = 1; high epsilon: a banded strategy
    b = choice.bands
    privacy = bandmf("auto", target_epsilon=epsilon)
    trainer = make_trainer(tmp_path, privacy, max_steps=STEPS)
    assert privacy.bands == "auto"  # the user's arguments are left as given
    assert trainer.privacy_args.bands == trainer.privacy_args.banded == b
    assert trainer.sampling_plan.bands == trainer.privacy_plan.bands == b
    assert trainer.privacy_plan.sample_rate == pytest.approx(b * RATE)
    assert trainer.noise_multiplier == pytest.approx(choice.noise_multipliers[b], rel=1e-3)
    trainer.train()
    assert trainer._dp_sampler.bands == b
    report = trainer.state.log_history[-1][PRIVACY_REPORT_KEY]
    assert report == trainer.privacy_report()
    assert report["noise_mechanism"] == "bandmf" and report["bands"] == b
    assert report["epsilon"] <= epsilon
    assert trainer.privacy_state_dict()["sampling"]["bands"] == b


def test_auto_counts_the_steps_of_dp_sgd_epochs(tmp_path):
    """With num_train_epochs, the steps are DP-SGD's epochs: 2 * ceil(32 units / 4)."""
    trainer = make_trainer(tmp_path, bandmf("auto", target_epsilon=8.0), max_steps=-1, num_train_epochs=2)
    choice = choose_bands(target_epsilon=8.0, target_delta=DELTA, steps=2 * ROWS // 4, sample_rate=RATE)
    assert trainer.privacy_args.bands == trainer.privacy_plan.bands == choice.bands


def test_resume_with_auto_continues_the_run(tmp_path):
    settings = dict(max_steps=STEPS, save_strategy="steps", save_steps=4)
    full = make_trainer(tmp_path / "full", bandmf("auto", target_epsilon=8.0), **settings)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-4"
    assert torch.load(checkpoint / PRIVACY_STATE_NAME, weights_only=True)["sampling"]["bands"] > 1
    resumed = make_trainer(tmp_path / "resumed", bandmf("auto", target_epsilon=8.0), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.privacy_plan.bands == full.privacy_plan.bands
    assert resumed.get_epsilon() == full.get_epsilon()
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_auto_needs_a_target_epsilon():
    with pytest.raises(ValueError, match="bands='auto' chooses the bands .* noise_multiplier=1.0 is given instead: "
                                         "give target_epsilon"):
        bandmf("auto", noise_multiplier=1.0)
    with pytest.raises(ValueError, match="option of noise_mechanism='bandmf'"):
        PrivacyArguments(target_epsilon=8.0, bands="auto")


def parse(*argv):
    parser = HfArgumentParser((TrainingArguments, PrivacyArguments))
    _, privacy = parser.parse_args_into_dataclasses(["--output_dir", "out", "--target_epsilon", "8",
                                                     "--noise_mechanism", "bandmf", *argv])
    return privacy


def test_bands_from_the_command_line():
    assert parse("--bands", "auto").bands == "auto"
    four = parse("--bands", "4")
    assert four.bands == four.banded == 4 and isinstance(four.bands, int)
    with pytest.raises(ValueError, match="a whole number >= 1 \\(or 'auto' with a target epsilon\\), got 'four'"):
        parse("--bands", "four")
    with pytest.raises(ValueError, match="bands"):
        parse()  # bandmf needs bands

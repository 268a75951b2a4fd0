"""With disable_tqdm=True, DPTrainer.save_model draws no progress bar (transformers' "Writing model
shards" bar does not read the flag); without it the bar is transformers' to show."""

import pytest

pytest.importorskip("transformers")
from datasets import Dataset  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments  # noqa: E402
from transformers.utils import logging  # noqa: E402

from dptorch.integrations.hf import DPTrainer, PrivacyArguments  # noqa: E402


def saved_output(tmp_path, capfd, disable_tqdm):
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
    data = Dataset.from_dict({"input_ids": [[1, 5, 7, 2]] * 16, "labels": [0, 1] * 8})
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=1, use_cpu=True,
                             report_to=[], disable_tqdm=disable_tqdm, save_strategy="no")
    trainer = DPTrainer(model=model, args=args, train_dataset=data,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-2))
    capfd.readouterr()
    trainer.save_model()
    return capfd.readouterr().err


@pytest.fixture
def bars_on():
    """transformers' progress bars on (another test or example may have switched them off), as they were after."""
    were = logging.is_progress_bar_enabled()
    logging.enable_progress_bar()
    yield
    (logging.enable_progress_bar if were else logging.disable_progress_bar)()


def test_save_model_under_disable_tqdm_draws_no_progress_bar_and_leaves_the_setting(tmp_path, capfd, bars_on):
    assert "Writing model shards" not in saved_output(tmp_path, capfd, disable_tqdm=True)
    assert logging.is_progress_bar_enabled()  # switched back on after the save
    assert (tmp_path / "out" / "README.md").is_file()


def test_without_disable_tqdm_the_bar_is_shown_as_transformers_draws_it(tmp_path, capfd, bars_on):
    assert "Writing model shards" in saved_output(tmp_path, capfd, disable_tqdm=False)

"""The private Trainer's report: the engine's vocabulary, in the model card, in the logs at the end."""

import json
import logging
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers")

from dptorch import PrivacyEngine  # noqa: E402
from dptorch.integrations.hf import (  # noqa: E402
    DataCollatorForPrivateCausalLanguageModeling,
    DPTrainer,
    PrivacyArguments,
)
from dptorch.accounting.report import MODEL_CARD_HEADING, add_to_model_card  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, word_tokenizer  # noqa: E402

TOKENIZER = word_tokenizer()


def trainer(tmp_path, **privacy):
    torch.manual_seed(0)
    args = cpu_training_args(str(tmp_path), max_steps=2, per_device_train_batch_size=8)
    return DPTrainer(model=tiny_gpt2(TOKENIZER), args=args, train_dataset=lm_dataset(TOKENIZER, 32),
                     data_collator=DataCollatorForPrivateCausalLanguageModeling(TOKENIZER),
                     privacy_args=PrivacyArguments(**{"noise_multiplier": 1.0, "target_delta": 1e-3, **privacy}))


def test_trainer_and_engine_reports_share_one_vocabulary(tmp_path):
    dp = trainer(tmp_path)
    engine = PrivacyEngine()
    model = nn.Linear(4, 2)
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        data_loader=DataLoader(TensorDataset(torch.randn(32, 4), torch.zeros(32).long()), batch_size=8),
                        noise_multiplier=1.0, max_grad_norm=1.0)
    ours, theirs = dp.privacy_report(), engine.privacy_report(1e-3)
    assert set(ours) == set(theirs)
    assert "per_sample_max_grad_norm" not in ours and ours["max_grad_norm"] == 1.0  # PrivacyArguments' name maps here
    assert ours["grad_sample_mode"] == dp.grad_sample_mode == "bk"  # "auto" on GPT-2: its layers have norm samplers
    assert ours["privacy_unit"] == "row" and ours["num_units"] == 32


def test_trainer_refuses_an_unknown_mode_and_keeps_an_explicit_one(tmp_path):
    assert trainer(tmp_path, grad_sample_mode="hooks").grad_sample_mode == "hooks"
    with pytest.raises(ValueError, match="grad_sample_mode must be one of"):
        PrivacyArguments(noise_multiplier=1.0, grad_sample_mode="fast")


def test_the_saved_model_card_and_the_final_logs_hold_the_report(tmp_path):
    dp = trainer(tmp_path)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("dptorch.integrations.hf.trainer")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        dp.train()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    last = dp.state.log_history[-1]
    assert "train_runtime" in last and last["privacy_report"] == dp.privacy_report()
    assert any("privacy report: epsilon" in record.getMessage() for record in records)
    dp.save_state()
    with open(os.path.join(tmp_path, "trainer_state.json")) as handle:
        saved = json.load(handle)["log_history"][-1]["privacy_report"]
    assert saved["epsilon"] == pytest.approx(dp.get_epsilon()) and saved["delta"] == 1e-3
    dp.save_model(str(tmp_path / "final"))
    card = (tmp_path / "final" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- differential-privacy\n- dptorch\n---\n")
    assert MODEL_CARD_HEADING in card and f"({dp.get_epsilon():.4g}, 0.001)-differential privacy" in card
    for key in ("accountant", "noise_multiplier", "sample_rate", "max_grad_norm", "privacy_unit", "dptorch_version"):
        assert f"| {key} |" in card
    dp.save_model(str(tmp_path / "final"))  # saving again refreshes the section, never doubles it
    again = (tmp_path / "final" / "README.md").read_text()
    assert again.count(MODEL_CARD_HEADING) == 1 and again.count("- differential-privacy") == 1


def test_the_privacy_section_joins_an_existing_card_and_replaces_only_itself():
    report = {"epsilon": 1.5, "delta": 1e-5, "accountant": "pld", "steps": 3, "privacy_unit": "row"}
    card = add_to_model_card("---\nlibrary_name: peft\n---\n# Adapter\n\n## Usage\nload it\n", report)
    assert card.startswith("---\nlibrary_name: peft") and "## Usage\nload it" in card
    again = add_to_model_card(card.replace("## Usage", "## Usage"), {**report, "epsilon": 2.5})
    assert again.count(MODEL_CARD_HEADING) == 1 and "(2.5, 1e-05)" in again and "(1.5, 1e-05)" not in again
    middle = add_to_model_card(f"# Card\n\n{MODEL_CARD_HEADING}\nold\n\n## Usage\nload it\n", report)
    assert "old" not in middle and middle.endswith("## Usage\nload it\n") and middle.count(MODEL_CARD_HEADING) == 1


def test_the_card_header_keeps_what_is_there_and_adds_the_private_tags():
    from dptorch.integrations.hf.model_card import card_metadata

    peft = {"library_name": "peft", "base_model": "tiny", "tags": ["lora", "dptorch"]}
    assert card_metadata(peft, is_adapter=True) == {
        "library_name": "peft", "base_model": "tiny", "tags": ["lora", "dptorch", "differential-privacy"]}
    assert card_metadata({"tags": "text"}, is_adapter=True) == {
        "tags": ["text", "differential-privacy", "dptorch"], "library_name": "peft"}
    assert card_metadata({}, is_adapter=False)["library_name"] == "transformers"

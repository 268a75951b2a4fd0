"""The one-run audit in the private Trainer: PrivacyArguments(audit_canaries=m) on a real (tiny) GPT-2 run."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from dptorch.accounting.report import MODEL_CARD_HEADING  # noqa: E402
from dptorch.auditing import audit_run, plot_audit_history  # noqa: E402
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from dptorch.optim.canaries import CanaryError  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, word_tokenizer  # noqa: E402

TOKENIZER = word_tokenizer()


def trainer(tmp_path, steps=4, **privacy):
    torch.manual_seed(0)
    args = cpu_training_args(str(tmp_path), max_steps=steps, per_device_train_batch_size=8)
    settings = {"noise_multiplier": 1.0, "target_delta": 1e-4, "sampling_seed": 0, "noise_seed": 0, "audit_seed": 0,
                **privacy}
    return DPTrainer(model=tiny_gpt2(TOKENIZER), args=args, train_dataset=lm_dataset(TOKENIZER, 32),
                     data_collator=DataCollatorForPrivateCausalLanguageModeling(TOKENIZER),
                     privacy_args=PrivacyArguments(**settings))


def test_the_logs_report_and_model_card_hold_both_audited_bounds(tmp_path):
    dp = trainer(tmp_path, audit_canaries=500)
    dp.train()
    logged = [entry for entry in dp.state.log_history if "loss" in entry]
    assert len(logged) == 4 and all({"audit_epsilon_steinke", "audit_epsilon_fdp", "epsilon"} <= set(e) for e in logged)
    history = dp.dp_audit.history
    assert [audit.step for audit in history] == [1, 2, 3, 4]
    assert [a.claimed_epsilon for a in history] == pytest.approx([e["epsilon"] for e in logged])
    assert [a.fdp_epsilon for a in history] == [e["audit_epsilon_fdp"] for e in logged]
    report = dp.privacy_report()["audit"]
    assert report["num_canaries"] == 500 and report["steps"] == 4 and report["confidence"] == 0.95
    assert report["consistent"] and 0 <= report["steinke_epsilon"] <= report["claimed_epsilon"]
    assert dp.state.log_history[-1]["privacy_report"]["audit"] == report
    same = audit_run(dp, delta=1e-4)  # the Trainer is a run audit_run reads
    assert (same.steinke_epsilon, same.fdp_epsilon) == (report["steinke_epsilon"], report["fdp_epsilon"])
    dp.save_model(str(tmp_path / "final"))
    dp.save_model(str(tmp_path / "final"))  # refreshed, never doubled
    card = (tmp_path / "final" / "README.md").read_text()
    assert card.count("### Empirical privacy audit") == 1 and card.index(MODEL_CARD_HEADING) < card.index("### Empirical")
    assert "500 dirac gradient canaries" in card and f"{report['fdp_epsilon']:.4g} (f-DP" in card
    assert "| audit |" not in card  # the audit is its own subsection, not a table row
    pytest.importorskip("matplotlib")
    plot_audit_history(history, str(tmp_path / "audit.png"))
    assert (tmp_path / "audit.png").stat().st_size > 1000


def test_without_noise_the_trainer_audit_is_large_and_without_canaries_nothing_changes(tmp_path):
    with pytest.warns(UserWarning):
        dp = trainer(tmp_path / "zero", steps=8, noise_multiplier=0.0, audit_canaries=1000)
        dp.train()
    audit = dp.dp_audit.history[-1]
    assert math.isinf(audit.claimed_epsilon) and audit.fdp_epsilon > 3.0
    plain = trainer(tmp_path / "plain", steps=2)
    plain.train()
    assert plain.dp_audit is None and plain.audit_canaries is None and "audit" not in plain.privacy_report()
    assert not any(key.startswith("audit_") for entry in plain.state.log_history for key in entry)


def test_audit_arguments_are_checked():
    with pytest.raises(ValueError, match="audit_canaries"):
        PrivacyArguments(noise_multiplier=1.0, audit_canaries=1)
    with pytest.raises(ValueError, match="audit_confidence"):
        PrivacyArguments(noise_multiplier=1.0, audit_canaries=100, audit_confidence=1.0)


def test_a_trainer_run_the_audit_cannot_cover_is_refused_before_any_step(tmp_path):
    dp = trainer(tmp_path, audit_canaries=100, noise_multiplier=0.5, clipping_stats="private")
    with pytest.raises(CanaryError, match="released count"):
        dp.train()
    assert dp.state.global_step == 0

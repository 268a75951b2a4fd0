"""DPTrainer with model_init (a new private run per model) and hyperparameter_search (Optuna): the
random-stopping protocol's report, its refusals, and the plain search's per-trial report."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")
optuna = pytest.importorskip("optuna")

from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from dptorch.integrations.hf import tuning as hf_tuning  # noqa: E402
from dptorch.tuning import SELECTION_NOT_ACCOUNTED, selection_report  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, word_tokenizer  # noqa: E402

TOKENIZER = word_tokenizer()
PRIVACY = dict(target_epsilon=2.0, target_delta=1e-3)


def make_trainer(tmp_path, privacy=None, **args):
    models = []

    def model_init():
        models.append(tiny_gpt2(TOKENIZER))
        return models[-1]

    settings = dict(max_steps=2, per_device_train_batch_size=4, optim="sgd", lr_scheduler_type="constant",
                    learning_rate=0.05, max_grad_norm=0.0, eval_strategy="no")
    settings.update(args)
    trainer = DPTrainer(model_init=model_init, args=cpu_training_args(str(tmp_path), **settings),
                        train_dataset=lm_dataset(TOKENIZER, 32), eval_dataset=lm_dataset(TOKENIZER, 8),
                        data_collator=DataCollatorForPrivateCausalLanguageModeling(TOKENIZER),
                        privacy_args=privacy or PrivacyArguments(**PRIVACY))
    return trainer, models


def space(trial):
    return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True),
            "per_sample_max_grad_norm": trial.suggest_float("per_sample_max_grad_norm", 0.1, 2.0)}


def test_each_train_with_model_init_is_a_new_private_run_on_the_new_model(tmp_path):
    trainer, models = make_trainer(tmp_path)
    epsilons, plans, hooks = [], [], []
    for _ in range(2):
        trainer.train()
        epsilons.append(trainer.get_epsilon())
        plans.append(trainer.privacy_plan)
        hooks.append(trainer.dp_hooks)
        assert trainer.model is models[-1] and trainer.dp_hooks.module is models[-1]
    assert len(models) == 3  # the constructor's, then one per train()
    assert plans[0] is not plans[1] and hooks[0] is not hooks[1]
    assert plans[1].steps == 2 and epsilons[0] == epsilons[1] > 0  # a new accountant: not the two runs composed
    assert not any(p.grad is not None and p.grad.abs().sum() > 0 for p in models[0].parameters())


def test_a_trainer_without_model_init_keeps_its_plan(tmp_path):
    trainer = DPTrainer(model=tiny_gpt2(TOKENIZER), args=cpu_training_args(str(tmp_path), max_steps=1,
                        per_device_train_batch_size=4, max_grad_norm=0.0),
                        train_dataset=lm_dataset(TOKENIZER, 32),
                        data_collator=DataCollatorForPrivateCausalLanguageModeling(TOKENIZER),
                        privacy_args=PrivacyArguments(**PRIVACY))
    plan, hooks = trainer.privacy_plan, trainer.dp_hooks
    trainer.train()
    assert trainer.privacy_plan is plan and trainer.dp_hooks is hooks and plan.steps == 1


def test_the_protocol_releases_the_best_trial_with_the_selections_epsilon(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(hf_tuning, "draw_trial_count", lambda mean, shape: drawn.append((mean, shape)) or 2)
    trainer, models = make_trainer(tmp_path)
    bound = [(trainer.privacy_plan.noise_multiplier, trainer.privacy_plan.sample_rate, 2)]
    seen = []

    def objective(metrics):
        seen.append((metrics["eval_loss"], trainer.privacy_plan.max_grad_norm, trainer.privacy_args.target_epsilon))
        return metrics["eval_loss"]

    best = trainer.hyperparameter_search(space, objective, expected_trials=10, trials_shape=1, direction="minimize")
    assert drawn == [(10, 1)] and len(seen) == 2 and len(models) == 3
    assert best.objective == min(loss for loss, _, _ in seen)
    clips = [clip for _, clip, _ in seen]  # each trial ran at the clipping bound its search space drew
    assert len(set(clips)) == 2 and best.hyperparameters["per_sample_max_grad_norm"] in clips
    report = trainer.tuning_report
    assert report == selection_report(bound, expected_trials=10, shape=1, delta=1e-3)
    assert report["per_trial_epsilon"] == pytest.approx(2.0, abs=0.05) and report["epsilon"] > 2 * 2.0
    assert trainer.privacy_args.per_sample_max_grad_norm == PrivacyArguments(**PRIVACY).per_sample_max_grad_norm


def test_the_protocol_may_draw_no_trial(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_tuning, "draw_trial_count", lambda mean, shape: 0)
    trainer, models = make_trainer(tmp_path)
    assert trainer.hyperparameter_search(space, expected_trials=1) is None
    assert len(models) == 1 and trainer.tuning_report["trials_distribution"] == "Poisson"


def test_a_trial_above_the_per_trial_bound_is_refused_before_its_first_step(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_tuning, "draw_trial_count", lambda mean, shape: 1)
    trainer, models = make_trainer(tmp_path)
    steps = []
    monkeypatch.setattr(type(trainer), "training_step", lambda *a, **k: steps.append(1))
    with pytest.raises(ValueError, match="spends more privacy than the per-trial bound"):
        trainer.hyperparameter_search(lambda trial: {"max_steps": 4}, expected_trials=5, trials_shape=0)
    assert steps == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(sampler=optuna.samplers.TPESampler()), "RandomSampler"),
    (dict(pruner=optuna.pruners.MedianPruner()), "pruner"),
    (dict(timeout=10), "timeout"),
    (dict(direction=["minimize", "maximize"]), "several objectives"),
    (dict(backend="ray"), "backend"),
    (dict(n_trials=3), "not both"),
])
def test_what_the_protocol_does_not_cover_is_refused_before_any_trial(tmp_path, kwargs, message):
    trainer, models = make_trainer(tmp_path)
    with pytest.raises(ValueError, match=message):
        trainer.hyperparameter_search(space, expected_trials=5, **kwargs)
    assert len(models) == 1


def test_the_protocol_refuses_fixed_seeds(tmp_path):
    trainer, _ = make_trainer(tmp_path, PrivacyArguments(**PRIVACY, noise_seed=3))
    with pytest.raises(ValueError, match="independent, secret"):
        trainer.hyperparameter_search(space, expected_trials=5)


def test_a_plain_search_says_its_epsilon_is_per_trial(tmp_path):
    trainer, models = make_trainer(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.hyperparameter_search(space, n_trials=2, sampler=optuna.samplers.TPESampler(seed=0))
    assert any(SELECTION_NOT_ACCOUNTED in str(w.message) for w in caught)
    report = trainer.tuning_report
    assert report["selection_accounted"] is False and report["trials"] == 2 and len(models) == 3
    assert report["per_trial_epsilon"] == pytest.approx(2.0, abs=0.05)


def test_model_init_is_refused_on_several_processes_only():
    from tests.distributed.test_parts import fake_trainer

    from dptorch.integrations.hf.checks import setup_problems

    privacy = PrivacyArguments(noise_multiplier=1.0)
    for world_size, refused in ((1, False), (2, True)):
        trainer = fake_trainer(world_size=world_size)
        trainer.model_init = lambda: None
        problems = setup_problems(trainer, privacy)
        assert any("model_init" in p for p in problems) == refused


def _card(folder) -> str:
    import glob
    import os

    cards = sorted(glob.glob(os.path.join(str(folder), "**", "README.md"), recursive=True))
    assert cards, "no model card written"
    return open(cards[0], encoding="utf-8").read()


def test_a_trials_model_card_states_the_selections_epsilon_and_a_later_run_the_composition(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_tuning, "draw_trial_count", lambda mean, shape: 1)
    trainer, _ = make_trainer(tmp_path / "search", save_strategy="steps", save_steps=2)
    trainer.hyperparameter_search(space, lambda metrics: metrics["eval_loss"], expected_trials=10, trials_shape=1,
                                  direction="minimize")
    report = trainer.tuning_report
    card = _card(tmp_path / "search")
    assert "### Hyperparameter selection" in card and "a trial of a hyperparameter search" in card
    assert f"({report['epsilon']:.4g}, 0.001)-DP" in card  # the release's epsilon, selection included
    trainer.args.output_dir = str(tmp_path / "after")
    trainer.train()
    trainer.save_model()
    after = open(tmp_path / "after" / "README.md", encoding="utf-8").read()
    assert f"epsilon <= {report['epsilon'] + trainer.get_epsilon():.4g} at delta = 0.002" in after


def test_a_plain_searchs_trial_card_says_the_selection_is_not_accounted(tmp_path):
    trainer, _ = make_trainer(tmp_path, save_strategy="steps", save_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.hyperparameter_search(space, lambda metrics: metrics["eval_loss"], n_trials=1, backend="optuna",
                                      direction="minimize")
    card = _card(tmp_path)
    assert "one of 1 trials of a plain hyperparameter search" in card and "**not accounted**" in card

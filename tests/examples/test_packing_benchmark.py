"""benchmarks/packing.py: packed and padded DP-SGD runs see the same draws and noise; packing only removes padding."""

import json

import pytest

from benchmarks import packing

TINY = ["--width", "16", "--layers", "1", "--vocab", "60", "--max-length", "40", "--warmup", "1"]


#: A fixed corpus of varied lengths (3 to 47 words, the longest truncated): the draws do not follow
#: edits of docs/, whose paragraphs the benchmark reads by default (an edit once left a draw that
#: packing could not shorten).
VARIED = [" ".join(f"w{(7 * i + j) % 50}" for j in range(3 + (13 * i) % 45)) for i in range(120)]


def test_a_tiny_run_writes_its_table_and_the_packed_run_has_less_padding_at_the_same_epsilon(tmp_path, capsys,
                                                                                             monkeypatch):
    monkeypatch.setattr(packing, "doc_paragraphs", lambda: VARIED)
    result = packing.main(TINY + ["--batch", "6", "--steps", "3", "--nonprivate", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == f"written: {tmp_path / 'packing.json'}"
    assert json.loads((tmp_path / "packing.json").read_text()) == json.loads(json.dumps(result))
    padded, packed = result["runs"]["padded"], result["runs"]["packed"]
    assert [line[:20].strip() for line in out.splitlines()[2:6]] == list(result["runs"]) == [
        "padded", "packed", "padded, non-private", "packed, non-private"]
    assert padded["steps"] == packed["steps"] == 3 and padded["timed_steps"] == 2
    assert packed["mean_examples_per_step"] == padded["mean_examples_per_step"] > 0  # the same Poisson draws
    assert packed["real_tokens_per_step"] == padded["real_tokens_per_step"]
    assert packed["epsilon"] == padded["epsilon"] and 0 < padded["epsilon"] < float("inf")
    assert packed["padding_fraction"] < padded["padding_fraction"]
    assert packed["mean_rows_per_step"] < padded["mean_rows_per_step"]
    assert result["lengths"]["max"] == 40 and result["lengths"]["mean"] < 40
    # Each example clipped on its own in both layouts: its gradient norm is the same up to float rounding.
    assert result["max_relative_unit_norm_difference"] < 1e-4
    assert result["speedup"] == packed["median_real_tokens_per_s"] / padded["median_real_tokens_per_s"]
    for kind in ("padded", "packed"):  # without DP: the same draws, so the same batches; no epsilon
        plain = result["runs"][f"{kind}, non-private"]
        assert plain["private"] is False and plain["epsilon"] == float("inf")
        assert plain["padding_fraction"] == result["runs"][kind]["padding_fraction"]
        assert plain["examples_per_step"] == result["runs"][kind]["examples_per_step"]
    assert result["speedup_nonprivate"] > 0


def test_word_ids_truncate_and_end_every_example_with_eos_and_pad_collate_masks_the_padding():
    ids = packing.word_ids(["b a a c .", "a b"], vocab_size=5, max_length=4)
    assert ids == [[4, 3, 3, packing.EOS], [3, 4, packing.EOS]]  # "a" most frequent, then "b"; the rest UNK
    assert packing.word_ids(["c d"], vocab_size=4, max_length=3) == [[3, packing.UNK, packing.EOS]]
    batch = packing.pad_collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, packing.PAD, packing.PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    with pytest.raises(ValueError, match="--vocab must be >= 4"):
        packing.word_ids(["a"], vocab_size=3, max_length=8)


def test_a_run_with_no_timed_step_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        packing.main(["--steps", "2", "--warmup", "2"])
    assert exit_.value.code == 2 and "--steps (2) must exceed --warmup (2)" in capsys.readouterr().err


def test_an_empty_draw_is_a_step_of_noise_only_in_both_runs(tmp_path, monkeypatch):
    texts = [" ".join(["word"] * (4 + i % 30)) for i in range(100)]  # fixed: the draws do not follow edits of docs/
    monkeypatch.setattr(packing, "doc_paragraphs", lambda: texts)
    result = packing.main(TINY + ["--batch", "1", "--steps", "4", "--out-dir", str(tmp_path)])
    padded, packed = result["runs"]["padded"], result["runs"]["packed"]
    assert padded["examples_per_step"] == packed["examples_per_step"] and 0 in padded["examples_per_step"]
    assert len(packed["step_s"]) == 4 and packed["epsilon"] == padded["epsilon"]


def test_a_mixture_of_experts_model_packs_with_each_example_clipped_as_when_padded(tmp_path, monkeypatch):
    monkeypatch.setattr(packing, "doc_paragraphs", lambda: VARIED)
    result = packing.main(TINY + ["--arch", "qwen2-moe", "--batch", "6", "--steps", "3", "--out-dir", str(tmp_path)])
    padded, packed = result["runs"]["padded"], result["runs"]["packed"]
    assert packed["epsilon"] == padded["epsilon"] and packed["padding_fraction"] < padded["padding_fraction"]
    assert result["max_relative_unit_norm_difference"] < 1e-4

"""A benchmark a user runs writes to a fresh folder and prints it; the committed results change only
with --update-committed (benchmarks/output_place.py, used by every benchmark that writes files)."""

import argparse
import json
import tempfile

import pytest

from benchmarks import bandmf_common
from benchmarks.output_place import IMAGES, REPOSITORY, RESULTS, OutputPlace, add_output_flags


def parse(argv):
    parser = argparse.ArgumentParser()
    bandmf_common.add_grid_flags(parser, epsilons=[1.0, 8.0], bands=["2"], name="bandmf_digits")
    return parser.parse_args(argv)


def fake_run(epsilon, mechanism, bands, seed):
    """What one_run returns, without training: enough for the summary and the figure."""
    return {"accuracy": 0.5 + epsilon / 100 + seed / 1000, "epsilon": epsilon, "noise_multiplier": 1.0,
            "sample_rate": 0.1, "steps": 10, "bands": bands or 1}


def test_by_default_the_runs_and_the_figure_go_to_a_fresh_folder_that_is_printed(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the fresh folder lands in pytest's tmp_path
    committed = bandmf_common.committed_files("bandmf_digits")
    before = {name: path.read_bytes() for name, path in committed.items()}
    args = parse(["--seeds", "0", "1"])
    place = OutputPlace(args, "bandmf_digits")
    runs = bandmf_common.run_grid(fake_run, args, place, "bandmf_digits")
    bandmf_common.finish(runs, place, "bandmf_digits", "fake")
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith("dptorch-bench-bandmf_digits-")
    assert sorted(p.name for p in folder.iterdir()) == ["bandmf-digits.png", "runs.jsonl"]
    assert [json.loads(line)["seed"] for line in (folder / "runs.jsonl").read_text().splitlines()] == [0, 1] * 4
    out = capsys.readouterr().out
    assert "run 8/8 done" in out  # 2 epsilons x (DP-SGD, b=2) x 2 seeds, with a progress line after each
    assert out.rstrip().splitlines()[-1] == f"written: {folder / 'runs.jsonl'}, {folder / 'bandmf-digits.png'}"
    assert {name: path.read_bytes() for name, path in committed.items()} == before


def test_out_dir_is_used_as_given_and_update_committed_names_the_committed_files(tmp_path):
    place = OutputPlace(parse(["--out-dir", str(tmp_path / "mine")]), "bandmf_digits")
    assert place.file("runs.jsonl", RESULTS / "bandmf_digits.jsonl") == tmp_path / "mine" / "runs.jsonl"
    assert (tmp_path / "mine").is_dir()
    place = OutputPlace(parse(["--update-committed"]), "bandmf_digits")
    assert place.file("runs.jsonl", RESULTS / "bandmf_digits.jsonl") == RESULTS / "bandmf_digits.jsonl"
    assert bandmf_common.committed_files("bandmf_minilm") == {
        "runs": RESULTS / "bandmf_minilm.jsonl", "figure": IMAGES / "bandmf-minilm.png"}
    assert RESULTS.parent.parent == REPOSITORY and (REPOSITORY / "docs" / "images" / "bandmf-minilm.png").is_file()


def test_out_dir_and_update_committed_together_are_refused(capsys):
    parser = argparse.ArgumentParser()
    add_output_flags(parser, "benchmarks/results/x.json")
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--out-dir", "here", "--update-committed"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

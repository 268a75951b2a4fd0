"""The compiled modes of benchmarks/models.py and benchmarks/host_overhead.py: the compiled plain step reports its
compile time and graphs apart from its step time, a compiled private step that its forward ran eagerly; the tables
show the columns."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import host_overhead, models
from benchmarks.compiled import compile_seconds, describe, split_mode

TINY = ("gpt2", 1, 16, 4, 3, 40, True)  # family, layers, width, seq, batch, vocab, tied
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_shape(monkeypatch):
    config = torch.compiler.config
    caches_off = config.force_disable_caches  # restored below: the benchmark sets it (monkeypatch would delete it)
    monkeypatch.setitem(models.SHAPES, "tiny-test", TINY)
    monkeypatch.setitem(host_overhead.SHAPES, "tiny-test", TINY)
    yield "tiny-test"
    config.force_disable_caches = caches_off


def test_the_compiled_plain_step_reports_compile_time_and_graphs_apart_from_the_step():
    """In a fresh process, as the benchmark runs each mode (in this one, earlier tests' controllers, never
    detached, may still watch their last draw, and compiled code is refused while a batch is watched)."""
    code = ("import json, sys; from benchmarks import models; models.SHAPES['tiny-test'] = %r; "
            "print(json.dumps(models.measure('tiny-test', 'compiled-plain', steps=1, seq=None, batch=None)))" % (TINY,))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    assert row["mode"] == "compiled-plain" and row["median_s"] > 0
    assert row["compile_s"] > 0 and row["recompiles"] == 0 and row["graphs"] >= 1 and row["graph_ops"] > 0
    assert row["forward_max_diff"] < 1e-5  # the compiled model computes the eager forward


@pytest.mark.parametrize("mode", ["compiled-bk", "compiled-hooks"])
def test_a_compiled_private_step_is_reported_eager(tiny_shape, mode):
    """The private forward turns Dynamo off for the compiled call: nothing is compiled, the forward is the eager one."""
    for row in (models.measure(tiny_shape, mode, steps=1, seq=None, batch=None),
                host_overhead.measure(tiny_shape, mode, steps=1, device="cpu", dtype="float32")):
        assert row["mode"] == mode and row["graph_ops"] == 0 and row["forward_max_diff"] == 0.0


def test_compile_time_is_the_warm_up_beyond_as_many_median_steps():
    assert compile_seconds([5.0, 1.5], 1.0) == pytest.approx(4.5)
    assert compile_seconds([0.9, 1.0], 1.0) == 0.0
    assert split_mode("compiled-bk") == ("bk", True) and split_mode("bk") == ("bk", False)
    assert models.split("compiled-plain") == ("nonprivate", True)
    assert describe({"graphs": 1, "graph_ops": 0, "graph_breaks": 5, "recompiles": 0}).startswith("no operator compiled")
    assert describe({"graphs": 2, "graph_ops": 9, "graph_breaks": 0, "recompiles": 1, "forward_max_diff": 0.05}) == (
        "2 graphs (9 ops), 0 breaks, 1 recompiles, forward off eager by 5e-02 (relative)")
    assert host_overhead.reference_mode("compiled-hooks") == "compiled-plain"
    assert host_overhead.reference_mode("hooks") == "plain"
    assert host_overhead.compile_cells({"aten_ops": [1, 2, 3]}) == "1 / 2 / 3 | - | -"
    assert host_overhead.compile_cells({"compile_s": 61.04, "graphs": 1, "graph_ops": 50, "graph_breaks": 0,
                                        "recompiles": 0}) == "- | 61.0 | 1 graphs (50 ops), 0 breaks, 0 recompiles"


def row(mode, median_s, peak, **extra):
    return {"shape": "narrow", "mode": mode, "median_s": median_s, "peak_mib": peak, "time_ratio": median_s / 0.1,
            "peak_ratio": peak / 100, **extra}


def test_the_summary_shows_the_compiled_columns_when_the_runs_have_them(tmp_path):
    paths = []
    for index, factor in enumerate([1.0, 1.2, 1.1]):
        run = [row("nonprivate", 0.1, 100), row("bk", 0.2, 120),
               row("compiled-plain", 0.05, 110, compile_s=60.0 + index, graphs=1, graph_ops=50, graph_breaks=0,
                   compiled_time_ratio=1.0, compiled_peak_ratio=1.0),
               row("compiled-bk", 0.1 * factor, 121, compile_s=5.0, graphs=0, graph_ops=0, graph_breaks=17,
                   compiled_time_ratio=2.0 * factor, compiled_peak_ratio=1.1)]
        paths.append(tmp_path / f"run{index}.json")
        paths[-1].write_text(json.dumps(run))
    header, _, line, *rest = models.summarize(paths).splitlines()
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["compiled-plain"] == "50 ms, compile 61 s"
    assert cells["compiled-bk"] == "2.20x (2.00-2.40) / 1.10x, compile 5 s, 0 ops compiled"
    assert "compiled-hooks" not in cells  # not in the runs: no column
    run = json.loads(paths[1].read_text())
    run[-1]["forward_max_diff"] = 0.5  # a compiled forward that is not the eager one is flagged
    paths[1].write_text(json.dumps(run))
    assert models.summarize(paths).splitlines()[2].endswith("0 ops compiled, FORWARD OFF EAGER |")
    assert any("compiled-plain's" in text for text in rest)
    paths[0].write_text(json.dumps([r for r in json.loads(paths[0].read_text()) if not r["mode"].startswith("compiled")]))
    assert "compiled-bk" not in models.summarize(paths[:1])

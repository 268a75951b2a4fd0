"""What the DP-BandMF benchmarks share: the run grid, the per-run JSON lines, the summary table and the plot.

Each finished run is appended to a JSON-lines file as soon as it ends (an interrupted grid keeps
what it ran; ``--summarise`` reads the file back), with a progress line (runs done, time spent and
left). A summary groups runs by (target epsilon, mechanism, bands) and gives the mean, min and max
accuracy over seeds. The runs file and the figure go to a fresh folder (``--out-dir``, printed
at the end); ``--update-committed`` appends to ``benchmarks/results/NAME.jsonl`` and redraws
``docs/images/NAME.png`` (``output_place``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Sequence

try:
    from benchmarks.output_place import IMAGES, REPOSITORY, RESULTS, OutputPlace, add_output_flags
except ImportError:  # run as a script: benchmarks/ is on the path
    from output_place import IMAGES, REPOSITORY, RESULTS, OutputPlace, add_output_flags

Run = Dict[str, Any]


def committed_files(name: str) -> Dict[str, Path]:
    """The committed runs file and figure of benchmark ``name`` (``bandmf_digits``, ...)."""
    return {"runs": RESULTS / f"{name}.jsonl", "figure": IMAGES / f"{name.replace('_', '-')}.png"}


def add_grid_flags(parser: argparse.ArgumentParser, *, epsilons: Sequence[float], bands: Sequence[str],
                   name: str) -> None:
    """--epsilons, --bands (ints or "auto"; DP-SGD always runs), --seeds, --summarise, --out-dir,
    --update-committed."""
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(epsilons))
    parser.add_argument("--bands", nargs="*", default=list(bands),
                        help='bandmf band counts (whole numbers or "auto"); DP-SGD runs too unless --no-dpsgd')
    parser.add_argument("--no-dpsgd", action="store_true", help="skip the independent-noise (DP-SGD) runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--summarise", metavar="JSONL", nargs="+",
                        help="train nothing: print the summary of the runs in these files and draw it")
    committed = committed_files(name)
    add_output_flags(parser, f"append the runs to {committed['runs'].relative_to(REPOSITORY)} and redraw "
                     f"{committed['figure'].relative_to(REPOSITORY)}")


def parse_bands(value: str):
    return value if value == "auto" else int(value)


def run_grid(one_run: Callable[..., Run], args: argparse.Namespace, place: OutputPlace, name: str,
             **settings: Any) -> List[Run]:
    """``one_run(epsilon, mechanism, bands, seed, **settings)`` for every cell; each run printed and
    appended to the runs file as it ends, with the progress of the grid."""
    mechanisms = ([] if args.no_dpsgd else [("independent", None)]) + [("bandmf", parse_bands(b)) for b in args.bands]
    cells = [(e, m, b, s) for e in args.epsilons for m, b in mechanisms for s in args.seeds]
    out = place.file("runs.jsonl", committed_files(name)["runs"])
    print(f"{len(cells)} runs; each is appended to {out} as it ends", flush=True)
    runs, began = [], time.perf_counter()
    for epsilon, mechanism, bands, seed in cells:
        start = time.perf_counter()
        run = one_run(epsilon, mechanism, bands, seed, **settings)
        run.update(epsilon_target=epsilon, mechanism=mechanism, bands_asked=bands or 1, seed=seed,
                   seconds=round(time.perf_counter() - start, 1), **settings)
        runs.append(run)
        print(json.dumps(run), flush=True)
        with open(out, "a") as handle:
            handle.write(json.dumps(run) + "\n")
        print(progress(len(runs), len(cells), time.perf_counter() - began), flush=True)
    return runs


def progress(done: int, total: int, seconds: float) -> str:
    """``run 3/36 done, 0:04:30 spent, about 0:49:30 left`` (left: the mean run time so far)."""
    left = seconds / done * (total - done)
    return f"run {done}/{total} done, {_clock(seconds)} spent, about {_clock(left)} left"


def _clock(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def read_runs(paths: Iterable[str]) -> List[Run]:
    runs = []
    for path in paths:
        with open(path) as handle:
            runs.extend(json.loads(line) for line in handle if line.strip())
    return runs


def label(run: Run) -> str:
    if run["mechanism"] == "independent" and run["bands_asked"] != "auto":
        return "DP-SGD"
    return f"BandMF b={run['bands_asked']}" + (" (momentum)" if run.get("workload") == "momentum" else "")


def summarise(runs: Sequence[Run]) -> List[Dict[str, Any]]:
    """One row per (target epsilon, label): mean, min, max accuracy over seeds, sigma, q, bands used."""
    groups: Dict[tuple, List[Run]] = {}
    for run in runs:
        groups.setdefault((run["epsilon_target"], label(run)), []).append(run)
    rows = []
    for (epsilon, name), group in sorted(groups.items(), key=lambda item: (item[0][0], _order(item[0][1]))):
        accs = [r["accuracy"] for r in group]
        rows.append({
            "epsilon_target": epsilon, "label": name, "seeds": len(group), "mean": statistics.mean(accs),
            "min": min(accs), "max": max(accs), "noise_multiplier": group[0]["noise_multiplier"],
            "sample_rate": group[0]["sample_rate"], "bands": sorted({r.get("bands", 1) for r in group}),
            "epsilon": max(r["epsilon"] for r in group), "steps": group[0]["steps"],
        })
    return rows


def _order(name: str):
    bands = name.split("=")[1].split(" ")[0] if "=" in name else "1"
    return (name != "DP-SGD", "momentum" in name, bands == "auto", int(bands) if bands.isdigit() else 0)


def markdown(rows: Sequence[Dict[str, Any]]) -> str:
    """The summary as a markdown table: epsilon, then a cell per mechanism (mean, [min, max], sigma, q)."""
    names = sorted({r["label"] for r in rows}, key=_order)
    lines = ["| epsilon | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for epsilon in sorted({r["epsilon_target"] for r in rows}):
        cells = []
        for name in names:
            row = next((r for r in rows if r["epsilon_target"] == epsilon and r["label"] == name), None)
            if row is None:
                cells.append("")
                continue
            used = "" if "auto" not in name else f", b={'/'.join(map(str, row['bands']))}"
            cells.append(f"{row['mean']:.3f} [{row['min']:.3f}, {row['max']:.3f}] "
                         f"(σ {row['noise_multiplier']:.2f}, q {row['sample_rate']:.3g}{used})")
        lines.append(f"| {epsilon:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[Dict[str, Any]], path: str, title: str) -> str:
    """Accuracy against epsilon (log axis), one line per mechanism: mean, shaded min-max over seeds; and
    on the right, each mean minus DP-SGD's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axes, gap) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    epsilons = sorted({r["epsilon_target"] for r in rows})
    baseline = {r["epsilon_target"]: r["mean"] for r in rows if r["label"] == "DP-SGD"}
    for name in sorted({r["label"] for r in rows}, key=_order):
        mine = sorted((r for r in rows if r["label"] == name), key=lambda r: r["epsilon_target"])
        x = [r["epsilon_target"] for r in mine]
        style = dict(color="black", linestyle="--") if name == "DP-SGD" else {}
        line, = axes.plot(x, [r["mean"] for r in mine], marker="o", label=name, **style)
        axes.fill_between(x, [r["min"] for r in mine], [r["max"] for r in mine], color=line.get_color(), alpha=0.12)
        paired = [r for r in mine if r["epsilon_target"] in baseline]
        gap.plot([r["epsilon_target"] for r in paired], [100 * (r["mean"] - baseline[r["epsilon_target"]]) for r in paired],
                 marker="o", color=line.get_color(), **({"linestyle": "--"} if name == "DP-SGD" else {}))
    for ax in (axes, gap):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(epsilons)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlabel("epsilon")
        ax.grid(alpha=0.3)
    axes.set_ylabel("test accuracy (mean, min-max over seeds)")
    gap.set_ylabel("mean accuracy minus DP-SGD's (points)")
    axes.legend()
    figure.suptitle(title + " (same delta, steps and hyper-parameters)", fontsize=10)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def finish(runs: Sequence[Run], place: OutputPlace, name: str, title: str) -> str:
    """Print the markdown summary of ``runs``, draw it, and print the files written."""
    rows = summarise(runs)
    print(markdown(rows))
    figure = place.file(f"{name.replace('_', '-')}.png", committed_files(name)["figure"])
    plot(rows, str(figure), title)
    place.report()
    return str(figure)

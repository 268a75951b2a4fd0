"""The fuzzer's verdicts as a list: which compositions still leak, crash or are refused.

``python -m tests.privacy.fuzz_report OUT.md [EXAMPLES]`` runs
``test_fuzzed_composition_is_refused_or_exact`` and the explicit cases (mixing after the last
layer and in the loss, HF's built-in loss, the labels-given positive case) with ``DPTORCH_FUZZ_RECORD`` set (every verdict
is recorded instead of asserted, so the drawn compositions are the test's own, past the first
failure too) and writes the failing compositions (operation, position, mode, measured move),
then the false refusals of row-wise compositions, to ``OUT.md``.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time


def run(examples: int) -> list:
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        record = f.name
    env = {**os.environ, "DPTORCH_FUZZ_RECORD": record, "DPTORCH_FUZZ_EXAMPLES": str(examples), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/privacy/test_sensitivity.py", "-k", "fuzzed or mixing_after or hf_"], env=env, check=False)
    with open(record) as f:
        verdicts = [json.loads(line) for line in f]
    os.unlink(record)
    return verdicts


def _move(v: dict) -> str:
    parts = [f"{k.split('_')[0]} {v[k]:.2f}x" for k in ("replaced_move_over_bound", "removed_move_over_bound") if k in v]
    return ", ".join(parts) or "-"


def markdown(verdicts: list, examples: int, seconds: float) -> str:
    failing = [v for v in verdicts if v["problems"]]
    counts = collections.Counter(v["outcome"] for v in verdicts)
    lines = [
        "# Fuzzer: compositions that are neither refused nor exact",
        "",
        f"Written by `python -m tests.privacy.fuzz_report` at {time.strftime('%H:%M UTC', time.gmtime())}: "
        f"{len(verdicts)} verdicts ({examples} drawn compositions per mode, the issue's measured cases and the "
        "explicit tests), "
        f"{seconds:.0f} s. Outcomes: {dict(counts)}.",
        "Moves are the measured move of the noiseless clipped sum over its bound (replace-one: 2C, add/remove: C);"
        " > 1.00x is a leak. 'inexact' with moves <= 1 still differs from the batch-of-one reference.",
        "",
        f"## Failing ({len(failing)})",
        "",
        "| composition (ops and positions, loss, placement) | mode | outcome | move / bound | problems |",
        "| --- | --- | --- | --- | --- |",
    ]
    for v in sorted(failing, key=lambda v: (v["composition"], v["mode"])):
        problem = "; ".join(v["problems"]).replace("|", "/")[:240]
        lines.append(f"| `{v['composition']}` | {v['mode']} | {v['outcome']} | {_move(v)} | {problem} |")
    refused_rowwise = [v for v in verdicts if v["outcome"] == "refused" and not v["mixing"]]
    lines += ["", f"## Row-wise compositions refused (false refusals, allowed by the oracle: {len(refused_rowwise)})", ""]
    for v in sorted(refused_rowwise, key=lambda v: (v["composition"], v["mode"])):
        lines.append(f"- `{v['composition']}` [{v['mode']}]: {v.get('message', '')[:200]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    out = sys.argv[1]
    examples = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    start = time.time()
    verdicts = run(examples)
    with open(out, "w") as f:
        f.write(markdown(verdicts, examples, time.time() - start))
    print(f"{sum(bool(v['problems']) for v in verdicts)} failing of {len(verdicts)} verdicts -> {out}")


if __name__ == "__main__":
    main()

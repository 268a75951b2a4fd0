"""Where a benchmark writes: a fresh folder by default, the committed results only when asked.

A benchmark a user runs must not change the repository: its files go to ``--out-dir DIR`` or,
without it, to a new folder in the temporary directory, and the paths are printed at the end.
``--update-committed`` writes the committed files instead (``benchmarks/results/``,
``docs/images/``): the way the figures the docs show are refreshed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import List, Optional

REPOSITORY = Path(__file__).resolve().parents[1]
RESULTS = REPOSITORY / "benchmarks" / "results"
IMAGES = REPOSITORY / "docs" / "images"


def add_output_flags(parser: argparse.ArgumentParser, committed: str) -> None:
    """--out-dir DIR or --update-committed (which writes ``committed``, named in the help)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--out-dir", metavar="DIR",
                       help="folder for the results (default: a new folder in the temporary directory; the paths "
                       "are printed at the end)")
    group.add_argument("--update-committed", action="store_true",
                       help=f"write the committed results instead ({committed}): only to refresh what the docs show")


class OutputPlace:
    """The files one benchmark run writes: ``file(name, committed)`` is ``committed`` under
    ``--update-committed``, else ``name`` in the run's folder (made on first use)."""

    def __init__(self, args: argparse.Namespace, benchmark: str):
        self.update_committed = bool(args.update_committed)
        self.folder: Optional[Path] = Path(args.out_dir) if args.out_dir else None
        self.benchmark = benchmark
        self.written: List[Path] = []

    def file(self, name: str, committed: Path) -> Path:
        if self.update_committed:
            path = committed
        else:
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix=f"dptorch-bench-{self.benchmark}-"))
            path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path not in self.written:
            self.written.append(path)
        return path

    def report(self) -> None:
        """Print the files this run wrote (nothing when it wrote none)."""
        if self.written:
            print("written: " + ", ".join(str(path) for path in self.written), flush=True)

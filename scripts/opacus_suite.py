"""Run Opacus 1.6's own test suite against dptorch, renamed as a migrating user would rename it.

The tests are taken from an installed Opacus (``--opacus-path``, the folder holding the ``opacus``
package) or its wheel (``--wheel``), copied to a temporary folder (never into this project),
``opacus.tests`` renamed to the local package ``opacus_tests`` and then every ``opacus`` to
``dptorch``; pytest runs them with this Python, with Opacus itself *not* importable, and the
figures are printed: test files importing, tests collected / passed / failed / skipped, pass rate.

Needs pytest, pytest-timeout and hypothesis (``pip install -e .[opacus-suite]``); torchvision and
opt_einsum, which some Opacus test files import, may instead sit in ``--deps-path`` (a folder put
on ``PYTHONPATH``). A torchvision whose C ops do not load on this torch (a CUDA wheel beside a CPU
torch) still imports: the schemas its import registers are defined first (the tests run none of
its ops). Opacus is never a dependency; fetch it for this check only::

    pip install --no-deps --target /tmp/opacus_pkg opacus==1.6.0
    pip install --no-deps --target /tmp/suite_deps opt_einsum torchvision==<the one for your torch>
    python scripts/opacus_suite.py --opacus-path /tmp/opacus_pkg --deps-path /tmp/suite_deps

``--keep DIR`` writes the renamed suite to DIR (and keeps it); ``--junit FILE`` keeps pytest's
report; ``--failures`` lists every failing test with the last line of its error; ``--max-examples N``
caps hypothesis' examples per test (a quicker run; its default is 100); extra arguments after ``--``
go to pytest (``-- -k privacy_engine``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

#: The checkout this script belongs to: its dptorch is the one tested (not another one installed).
PROJECT_ROOT = Path(__file__).resolve().parents[1]

#: The package name the renamed ``opacus.tests`` gets.
LOCAL_PACKAGE = "opacus_tests"

#: Put in the suite's conftest: Opacus must not be importable (the tests would silently test it), and
#: a torchvision whose compiled ops cannot load still imports its Python parts.
CONFTEST = '''\
"""Written by scripts/opacus_suite.py."""
import importlib.util

import torch

if importlib.util.find_spec("opacus") is not None:
    raise RuntimeError("opacus is importable: the renamed suite must run against dptorch alone")


def _torchvision_op_schemas():
    """torchvision registers fake kernels for nms and qnms even when its C ops failed to load."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or hasattr(torch.ops.torchvision, "nms"):
        return
    try:
        torch.ops.load_library(next(iter(__import__("glob").glob(spec.submodule_search_locations[0] + "/_C*.so"))))
        return
    except (OSError, StopIteration, RuntimeError):
        pass
    global _TORCHVISION_SCHEMAS
    _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _TORCHVISION_SCHEMAS.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


_torchvision_op_schemas()
'''

#: Appended to the conftest with ``--max-examples N``: hypothesis draws at most N examples per test.
HYPOTHESIS_PROFILE = '''
from hypothesis import settings

settings.register_profile("opacus_suite", max_examples={count})
settings.load_profile("opacus_suite")
'''


def rename(source: str) -> str:
    """A test file's text after the rename: ``opacus.tests`` -> the local package, then ``opacus`` -> ``dptorch``."""
    source = re.sub(r"\bopacus\.tests\b", LOCAL_PACKAGE, source)
    return re.sub(r"\bopacus\b", "dptorch", source)


def opacus_tests_from(opacus_path: Optional[Path], wheel: Optional[Path], scratch: Path) -> Path:
    """The folder of Opacus' ``opacus/tests`` (from the wheel, extracted into ``scratch``)."""
    if wheel is not None:
        with zipfile.ZipFile(wheel) as archive:
            members = [name for name in archive.namelist() if name.startswith("opacus/tests/")]
            if not members:
                raise SystemExit(f"{wheel} holds no opacus/tests/: pass an Opacus wheel (opacus-1.6.0-py3-none-any.whl)")
            archive.extractall(scratch / "wheel", members)
        return scratch / "wheel" / "opacus" / "tests"
    if opacus_path is None:
        raise SystemExit("pass --opacus-path (the folder holding the opacus package) or --wheel")
    tests = opacus_path / "opacus" / "tests"
    if not tests.is_dir():
        tests = opacus_path / "tests"  # the opacus package folder itself
    if not tests.is_dir():
        raise SystemExit(f"no opacus/tests under {opacus_path}: pass the folder `pip install --target` filled")
    return tests


def write_renamed_suite(tests: Path, destination: Path, max_examples: Optional[int] = None) -> List[str]:
    """Copy the ``.py`` files of ``tests`` under ``destination/opacus_tests``, renamed; return the test files.
    ``max_examples`` caps hypothesis' examples per test (its default is 100)."""
    package = destination / LOCAL_PACKAGE
    test_files = []
    for path in sorted(tests.rglob("*.py")):
        relative = path.relative_to(tests)
        target = package / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rename(path.read_text()))
        if path.name.endswith("_test.py"):
            test_files.append(str(Path(LOCAL_PACKAGE) / relative))
    profile = HYPOTHESIS_PROFILE.format(count=int(max_examples)) if max_examples else ""
    (destination / "conftest.py").write_text(CONFTEST + profile)
    return test_files


def run_pytest(root: Path, junit: Path, deps_path: Optional[Path], timeout: int, extra: List[str]) -> int:
    """pytest over the renamed suite in ``root``; its exit status."""
    paths = [str(root), str(PROJECT_ROOT), str(deps_path or ""), os.environ.get("PYTHONPATH", "")]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=*_test.py",
               f"--timeout={timeout}", f"--junitxml={junit}", "-rN", "--continue-on-collection-errors", LOCAL_PACKAGE, *extra]
    return subprocess.run(command, cwd=root, env=environment).returncode


def read_report(junit: Path) -> Tuple[Dict[str, int], Dict[str, str], List[Tuple[str, str]]]:
    """From pytest's junit file: counts by outcome, the files that failed to import (with the error's last
    line) and the failing tests (with theirs)."""
    counts: Dict[str, int] = collections.Counter()
    import_errors: Dict[str, str] = {}
    failures: List[Tuple[str, str]] = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None and (not case.get("classname") or problem.get("message") == "collection failure"):
            import_errors[case.get("name")] = _last_line(problem)
        elif problem is not None:
            counts["failed"] += 1
            failures.append((name, _last_line(problem)))
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, import_errors, failures


def _last_line(element: ElementTree.Element) -> str:
    text = (element.text or element.get("message") or "").strip().splitlines()
    errors = [line for line in text if line.startswith("E ")]
    return (errors[-1][1:].strip() if errors else (text[-1] if text else ""))[:300]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opacus-path", type=Path, help="the folder holding the installed opacus package")
    parser.add_argument("--wheel", type=Path, help="an Opacus wheel file (instead of --opacus-path)")
    parser.add_argument("--deps-path", type=Path, help="a folder of test-only packages (torchvision, opt_einsum)")
    parser.add_argument("--keep", type=Path, help="write the renamed suite here and keep it")
    parser.add_argument("--junit", type=Path, help="keep pytest's junit report here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--failures", action="store_true", help="list every failing test and its error")
    parser.add_argument("--max-examples", type=int, help="hypothesis examples per test (default: hypothesis' 100)")
    arguments, extra = parser.parse_known_args(argv)
    extra = [item for item in extra if item != "--"]
    with tempfile.TemporaryDirectory(prefix="opacus_suite_") as scratch_name:
        scratch = Path(scratch_name)
        root = arguments.keep or scratch / "suite"
        if arguments.keep is not None and root.exists():
            shutil.rmtree(root / LOCAL_PACKAGE, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        test_files = write_renamed_suite(opacus_tests_from(arguments.opacus_path, arguments.wheel, scratch), root,
                                         arguments.max_examples)
        junit = arguments.junit or scratch / "junit.xml"
        run_pytest(root, junit, arguments.deps_path, arguments.timeout, extra)
        counts, import_errors, failures = read_report(junit)
    collected = sum(counts.values())
    importing = len(test_files) - len(import_errors)
    print(f"\ntest files importing: {importing} of {len(test_files)}")
    for module, error in sorted(import_errors.items()):
        print(f"  not importing: {module}: {error}")
    rate = 100.0 * counts["passed"] / collected if collected else 0.0
    print(f"tests collected: {collected}, passed {counts['passed']}, failed {counts['failed']}, "
          f"skipped {counts['skipped']}: {rate:.1f}% of collected tests pass")
    if arguments.failures:
        for name, error in failures:
            print(f"  FAILED {name}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

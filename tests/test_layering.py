"""The layering of docs/architecture.md, enforced: every import of every module outside tests/ (at the top or
inside a function) goes along an arrow the table allows, and no room imports another room's private names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "architecture.md"
EVERY = "every room"


def read_table(text: str) -> dict[str, set[str]]:
    """Room -> the rooms and modules it may import, from the table between the layering markers."""
    body = text.split("<!-- layering:begin -->", 1)[1].split("<!-- layering:end -->", 1)[0]
    table: dict[str, set[str]] = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        room = re.match(r"`([\w.]+)`", cells[0])[1]
        table[room] = {EVERY} if cells[1] == EVERY else set(re.findall(r"`([\w.]+)`", cells[1]))
    return table


def package_dirs() -> dict[str, str]:
    """Top-level folder -> its package (pyproject's package-dir: ``export`` -> ``e3.export``)."""
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r"^package-dir\s*=\s*\{(.*)\}", text, re.M)[1]
    return {folder: package for package, folder in re.findall(r'"([\w.]+)"\s*=\s*"([\w/]+)"', line)}


def module_name(path: Path, dirs: dict[str, str]) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([dirs[parts[0]], *parts[1:]])


def room_of(module: str, rooms) -> str | None:
    """The longest room (or allowed module) that ``module`` is, or lies below."""
    hits = [r for r in rooms if module == r or module.startswith(r + ".")]
    return max(hits, key=len) if hits else None


def imports_of(path: Path, me: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every import of ours in ``path``; relative imports
    resolved, ``from e3.x import y`` read as module ``e3.x.y`` when ``y`` is a module (a folder or file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "e3"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            if module.split(".")[0] != "e3":
                continue
            for alias in node.names:
                out.append((node.lineno, module, [alias.name]))
    return sorted(out)


def sources(dirs: dict[str, str]) -> list[Path]:
    return sorted(p for folder in dirs for p in (ROOT / folder).rglob("*.py"))


def forbidden_arrows(table: dict[str, set[str]], dirs: dict[str, str]) -> list[str]:
    rooms = set(table)
    allowed_targets = rooms | {t for ts in table.values() for t in ts if t != EVERY}
    problems = []
    for path in sources(dirs):
        me = module_name(path, dirs)
        mine = room_of(me, rooms)
        rel = path.relative_to(ROOT)
        if mine is None:
            problems.append(f"{rel}: module {me} lies in no room of the table")
            continue
        for line, module, names in imports_of(path, me):
            targets = [f"{module}.{n}" for n in names] or [module]
            for target, name in zip(targets, names or [None]):
                room = room_of(target, allowed_targets) or room_of(module, allowed_targets)
                their = room_of(target, rooms) or room_of(module, rooms)
                allowed = table[mine]
                ok = (their == mine or EVERY in allowed or room in allowed or their in allowed)
                if not ok:
                    problems.append(f"{rel}:{line}: {mine} -> {their} (import of {target}) is not in the table")
                if name and name.startswith("_") and not name.startswith("__") and their != mine:
                    problems.append(f"{rel}:{line}: {mine} imports {module}.{name}, a private name of {their}")
    return problems


def test_the_table_names_every_room_once_bottom_up():
    table = read_table(TABLE.read_text())
    dirs = package_dirs()
    assert set(dirs.values()) <= {room_of(p, table) for p in dirs.values()} | set(table), "a package in no room"
    order = list(table)
    for i, room in enumerate(order):
        for target in table[room] - {EVERY}:
            below = room_of(target, order[:i])
            assert below is not None, f"{room} may import {target}, which is not a room listed above it"


def test_every_import_follows_the_table():
    problems = forbidden_arrows(read_table(TABLE.read_text()), package_dirs())
    if problems:
        pytest.fail(f"{len(problems)} import(s) against docs/architecture.md's layering:\n" + "\n".join(problems))


def test_the_floor_imports_no_room_above_it():
    """e3/ holds only the floor (e3.core, e3.paths): no module there imports another room."""
    dirs = package_dirs()
    table = read_table(TABLE.read_text())
    for path in (ROOT / "e3").rglob("*.py"):
        for line, module, names in imports_of(path, module_name(path, dirs)):
            for target in [f"{module}.{n}" for n in names] or [module]:
                assert room_of(target, table) == "e3", f"{path.relative_to(ROOT)}:{line} imports {target}"


def test_the_checker_sees_imports_inside_functions_and_from_e3_forms(tmp_path, monkeypatch):
    """The checker itself: a planted forbidden arrow in each form is reported with its file, line and arrow."""
    table = {"e3": set(), "e3.serving": {"e3"}, "e3.controller": {"e3", "e3.serving"}}
    (tmp_path / "e3").mkdir()
    (tmp_path / "serving").mkdir()
    (tmp_path / "e3" / "__init__.py").write_text("")
    (tmp_path / "serving" / "bad.py").write_text(
        "import e3.core.names\n"
        "def f():\n    from e3.controller import loop\n"
        "from e3 import controller\n"
        "from e3.serving.router import _private\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    problems = forbidden_arrows(table, {"e3": "e3", "serving": "e3.serving"})
    assert problems == ["serving/bad.py:3: e3.serving -> e3.controller (import of e3.controller.loop) is not in "
                        "the table",
                        "serving/bad.py:4: e3.serving -> e3.controller (import of e3.controller) is not in the table"]


def test_nothing_outside_tests_imports_from_tests():
    """Product code and benchmarks do not reach into tests/ (by import or by sys.path): what a benchmark needs
    from a test's helpers belongs in a room of the product."""
    dirs = package_dirs()
    offenders = []
    for path in sources(dirs):
        text = path.read_text()
        if re.search(r"^\s*(from|import) (tests|helpers|planner_oracle)\b", text, re.M) or \
                re.search(r"sys\.path\.insert\([^)]*[\"']tests[\"']", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"these import from tests/: {offenders}"


def room_graph(table: dict[str, set[str]], dirs: dict[str, str]) -> dict[str, set[str]]:
    """Room -> the rooms its modules really import (each module in its longest room of the table)."""
    rooms = set(table)
    graph: dict[str, set[str]] = {r: set() for r in rooms}
    for path in sources(dirs):
        me = module_name(path, dirs)
        mine = room_of(me, rooms)
        for _, module, names in imports_of(path, me):
            for target in [f"{module}.{n}" for n in names] or [module]:
                their = room_of(target, rooms) or room_of(module, rooms)
                if mine and their and their != mine:
                    graph[mine].add(their)
    return graph


def test_no_loop_between_rooms():
    """The rooms as they import each other form no loop (a room below another, e3.serving.ebird under
    e3.serving, counts as a room of its own): every import goes one way."""
    graph = room_graph(read_table(TABLE.read_text()), package_dirs())
    state: dict[str, int] = {}
    loops: list[list[str]] = []

    def visit(room: str, path: list[str]) -> None:
        state[room] = 1
        for nxt in sorted(graph[room]):
            if state.get(nxt) == 1:
                loops.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[room] = 2

    for room in sorted(graph):
        if room not in state:
            visit(room, [room])
    assert not loops, f"rooms importing each other in a loop: {loops}"


def _named_in(doc: str, name: str) -> bool:
    """``name`` named as a module in a docstring: ``name.py``, ``name/``, a ``name`` literal, ``:mod:`...name```,
    or a line of a listing that starts with it."""
    n = re.escape(name)
    return bool(re.search(rf"(?<![\w-]){n}(\.py\b|/)|``{n}``|`{n}`|:mod:`[~.\w]*\b{n}`|^\s*[*-]?\s*{n}\s", doc, re.M))


def test_every_package_lists_what_it_holds_or_nothing():
    """A package's docstring either names none of its modules (it describes the room in words) or names every
    one of them: a listing that has gone stale fails here."""
    import ast
    stale = []
    for folder in package_dirs():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            pkg = init.parent
            names = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
            names |= {d.name for d in pkg.iterdir() if (d / "__init__.py").exists()}
            said = {n for n in names if _named_in(doc, n)}
            if said and said != names:
                stale.append(f"{init.relative_to(ROOT)} lists {sorted(said)} but not {sorted(names - said)}")
    assert not stale, "\n".join(stale)


def test_no_module_is_over_600_lines():
    """A module that grows past 600 lines holds more than one job: split it by what it does."""
    dirs = package_dirs()
    long = {str(p.relative_to(ROOT)): n for p in sources(dirs) if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines: {long}"



def _import_lines(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The file's lines and the (first, last) line of every import inside a function."""
    import ast
    spans = []
    for fn in ast.walk(ast.parse(text)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            spans += [(n.lineno, n.end_lineno) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return text.splitlines(), sorted(set(spans))


def unexplained_deferred_imports(path: Path) -> list[str]:
    """Imports inside functions that say no reason. One is explained by a comment on its own lines, by a comment
    line heading the group of imports it stands in, or, for the whole module, by a top-level comment line
    starting ``# Deferred imports:`` (a CLI module whose verbs each load their room)."""
    lines, spans = _import_lines(path.read_text())
    if any(line.startswith("# Deferred imports:") for line in lines):
        return []
    out = []
    for first, last in spans:
        if any("#" in lines[i] for i in range(first - 1, last)):
            continue
        i = first - 2   # walk up over the imports of the same group
        while i >= 0 and lines[i].strip() and not lines[i].strip().startswith("#") and \
                re.match(r"\s*(import |from |\)|\w.*,$)", lines[i]):
            i -= 1
        if i >= 0 and lines[i].strip().startswith("#"):
            continue
        out.append(f"{path.relative_to(ROOT)}:{first}: {lines[first - 1].strip()}")
    return out


def test_imports_sit_at_the_module_top_unless_a_comment_says_why():
    """Imports at the top show the module's arrows to a reader; one deferred into a function (torch kept out of
    Triton's processes, a slow client loaded by the verb that needs it) says why in a comment."""
    bad = [o for p in sources(package_dirs()) for o in unexplained_deferred_imports(p)]
    assert not bad, f"{len(bad)} import(s) inside functions with no reason given:\n" + "\n".join(bad)


def test_the_import_check_reads_group_comments_and_module_notes(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    f = tmp_path / "m.py"
    f.write_text("def a():\n    import json\n\n\ndef b():\n    # deferred: heavy\n    import torch\n    from x import (y,\n"
                 "                   z)\n\n\ndef c():\n    import numpy as np  # deferred: light start\n")
    assert unexplained_deferred_imports(f) == ["m.py:2: import json"]
    f.write_text("# Deferred imports: every verb loads its own room\ndef a():\n    import json\n")
    assert unexplained_deferred_imports(f) == []

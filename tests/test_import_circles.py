"""No import circle between the project's files: when two files need each other, a piece lives in
the wrong one (move it to its owner, or into a small module both import). Every import counts,
inside a function too (an import moved into a function to dodge a circle still ties the two files
together); imports under ``if TYPE_CHECKING:`` do not (annotations only).

The installed library is checked: ``archsearch/``, ``trainers/`` and ``benchmarks/`` (as
``archsearch.trainers`` and ``archsearch.benchmarks``), not the benchmark scripts, which no
library file imports (tests/test_packaging.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"archsearch": "archsearch", "trainers": "archsearch.trainers", "benchmarks": "archsearch.benchmarks"}

# Circles known and not yet taken apart, each with where its pieces belong: none. An entry that no
# longer occurs fails the test (remove it then, so that the circle cannot come back unnoticed).
KNOWN: set[frozenset[str]] = set()


def library_sources() -> tuple[dict[str, str], set[str]]:
    """(module name -> source text of every library file, the names that are packages)."""
    sources, packages = {}, set()
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "benchmarks" and rel[0] == "scripts":
                continue
            name = ".".join((package, *rel)).removesuffix(".__init__")
            sources[name] = path.read_text()
            if path.name == "__init__.py":
                packages.add(name)
    return sources, packages


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(sources: dict[str, str], packages: set[str]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file (itself and its ancestors,
    which Python has imported before it, aside). ``packages``: the names that are packages."""

    def owner(dotted: str) -> str | None:  # the deepest project module a dotted name lies in
        while dotted and dotted not in sources:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for me, text in sources.items():
        tree = ast.parse(text, me)
        here = me.split(".") if me in packages else me.split(".")[:-1]
        skip, found = _type_checking_only(tree), set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                found |= {owner(f"{base}.{a.name}") for a in node.names}
        graph[me] = {m for m in found if m and m != me and not me.startswith(m + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The import circles: strongly connected groups of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.add(frozenset(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_project_files():
    found = circles(imports(*library_sources()))
    new = [sorted(c) for c in found - KNOWN]
    assert not new, f"import circles: {new}; move the piece that both files need to its owner"
    gone = [sorted(c) for c in KNOWN - found]
    assert not gone, f"no longer circles: {gone}; remove them from KNOWN"


def test_the_scale_out_layer_sits_below_the_study():
    """``cluster/`` submits, tracks and records jobs: none of its modules imports the packages of the
    study it runs (the job bodies live in trainers/, the search workers in search/)."""
    above = tuple(f"archsearch.{p}" for p in ("search", "trainers", "planning", "laws", "evaluation", "benchmarks",
                                              "cli"))
    graph = imports(*library_sources())
    up = {m: sorted(t for t in targets if t.startswith(above)) for m, targets in graph.items()
          if m.startswith("archsearch.cluster")}
    assert up and not any(up.values()), f"cluster/ reaches up: { {m: t for m, t in up.items() if t} }"


def test_the_circle_check_sees_each_form():
    """Top-level, in-function and relative imports make a circle; TYPE_CHECKING imports do not."""
    sources = {
        "archsearch.a": "from archsearch.b import x\n",
        "archsearch.b": "def f():\n    from . import a\n",
        "archsearch.c": "import archsearch.d.e\n",
        "archsearch.d": "",
        "archsearch.d.e": "from ..c import y\n",
        "archsearch.f": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from archsearch.g import z\n",
        "archsearch.g": "from archsearch.f import w\n",
        "archsearch.h": "import archsearch\nfrom archsearch import h\n",  # an ancestor and itself: no edge
    }
    graph = imports(sources, {"archsearch.d"})
    assert circles(graph) == {frozenset({"archsearch.a", "archsearch.b"}),
                              frozenset({"archsearch.c", "archsearch.d.e"})}
    assert graph["archsearch.h"] == set()

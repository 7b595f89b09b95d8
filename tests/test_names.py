"""Names say what a thing is, once: no two library modules share a file name, and no two share a
public top-level function or class name, but for the patterns listed below with their reason (a
module or function that plays the same role in each of several places)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("archsearch", "trainers", "benchmarks")

# file names several packages use for the same role
SHARED_FILES = {
    "__init__.py": "a package",
    "config.py": "each package's own config dataclasses (search: the study, trainers: a run, cluster: the jobs)",
    "arch.py": "archsearch/cli/ names its modules after the subcommands (archsearch arch)",
}
# public names several modules define for the same role
SHARED_NAMES = {
    "register": "every CLI module registers its subcommand",
    "main": "a module's command-line entry",
    "engine_kwargs": "each engine backend's own engine arguments (one interface)",
}


def _library_files() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py")) if "scripts" not in p.parts]


def test_no_two_library_modules_share_a_file_name():
    by_name = defaultdict(list)
    for p in _library_files():
        by_name[p.name].append(str(p.relative_to(ROOT)))
    clashes = {n: ps for n, ps in by_name.items() if len(ps) > 1 and n not in SHARED_FILES}
    assert not clashes, f"name these modules for what each holds: {clashes}"


def test_no_two_library_modules_define_the_same_public_name():
    by_name = defaultdict(list)
    for p in _library_files():
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                by_name[node.name].append(str(p.relative_to(ROOT)))
    clashes = {n: ps for n, ps in by_name.items() if len(ps) > 1 and n not in SHARED_NAMES}
    assert not clashes, f"one name, two things: {clashes}"

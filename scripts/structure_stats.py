"""Structure counts of the installed library: lines per package, import circles between project
files, and imports inside functions (all, of project modules, of heavy engines).

Run from the repository root: ``python scripts/structure_stats.py`` (``--json`` for one JSON line).
The circles are found as tests/test_import_circles.py finds them; the benchmark scripts
(``benchmarks/scripts``) are counted apart, as they are not part of the library.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the engines the library may import inside a function (each costs seconds or a GPU to load)
HEAVY = ("torch", "vllm", "sglang", "transformers", "optuna", "matplotlib", "scipy", "lm_eval", "submitit", "peft")


def _circle_check():
    spec = importlib.util.spec_from_file_location("_circles", ROOT / "tests" / "test_import_circles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(path: Path) -> str:
    """The package a file is counted under: archsearch's first-level subpackage, trainers, benchmarks."""
    rel = path.relative_to(ROOT).parts
    if rel[0] == "archsearch":
        return "archsearch" if len(rel) == 2 else f"archsearch.{rel[1]}"
    if rel[:2] == ("benchmarks", "scripts"):
        return "benchmarks/scripts"
    return rel[0]


def _is_project(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] in ("archsearch", "trainers", "benchmarks")
    return any(a.name.split(".")[0] in ("archsearch", "trainers", "benchmarks") for a in node.names)


def _is_heavy(node: ast.Import | ast.ImportFrom) -> bool:
    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    return not (isinstance(node, ast.ImportFrom) and node.level) and any(
        n.split(".")[0] in HEAVY for n in names)


def _imports(tree: ast.Module) -> tuple[list, list]:
    """(import statements at module level or in class bodies/ifs/trys, those inside a function)."""
    top, inner = [], []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if in_function else top).append(child)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return top, inner


def stats() -> dict:
    lines: Counter = Counter()
    counts = {"library": Counter(), "benchmarks/scripts": Counter()}
    for folder in ("archsearch", "trainers", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            package = _package(path)
            lines[package] += len(text.splitlines())
            top, inner = _imports(ast.parse(text, str(path)))
            c = counts["benchmarks/scripts" if package == "benchmarks/scripts" else "library"]
            c["top-level"] += len(top)
            c["in-function"] += len(inner)
            c["in-function, project module"] += sum(map(_is_project, inner))
            c["in-function, heavy engine"] += sum(map(_is_heavy, inner))
            c["in-function, other"] += sum(not _is_project(n) and not _is_heavy(n) for n in inner)
    check = _circle_check()
    found = check.circles(check.imports(*check.library_sources()))
    return {"lines": dict(sorted(lines.items())), "lines_total": sum(lines.values()),
            "imports": {k: dict(v) for k, v in counts.items()},
            "circles": sorted((sorted(c) for c in found), key=len, reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    out = stats()
    if args.json:
        print(json.dumps(out))
        return
    print("lines per package:")
    for package, n in out["lines"].items():
        print(f"  {package:24s} {n:6d}")
    print(f"  {'total':24s} {out['lines_total']:6d}")
    for where, c in out["imports"].items():
        print(f"imports ({where}): " + ", ".join(f"{k} {v}" for k, v in c.items()))
    print(f"import circles: {len(out['circles'])}")
    for c in out["circles"]:
        print(f"  {len(c)} modules: {', '.join(c)}")


if __name__ == "__main__":
    main()

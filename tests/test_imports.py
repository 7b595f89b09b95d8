"""Import discipline: importing a package of archsearch imports only the sibling packages it
needs, and no heavy engine (torch, vLLM, transformers, lm-eval, Optuna, ...) until a function
that uses one is called. Each module is imported in a fresh interpreter; the table below is the
declared dependency graph (a new edge is a decision: add it here, with a reason, or lazy-import).

No module reaches into another's privates: what a second module uses is public where it belongs
(:func:`test_no_module_imports_another_modules_private_name`). A project module is imported at the
top of the file, not inside a function, but for the few kept there with a reason
(:func:`test_project_modules_are_imported_at_the_top_of_the_file`).

The same check by hand: ``python -c "import archsearch.trainers, sys; print(sorted(m for m in
sys.modules if m.startswith('archsearch.')))"``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

# imported at module level by every engine path: never in a dependency list
HEAVY = ("torch", "vllm", "sglang", "transformers", "lm_eval", "optuna", "matplotlib", "submitit",
         "accelerate", "peft", "datasets", "scipy", "pandas", "psycopg2", "tokenizers")
# small shared modules any package may use (errors, accounting, the named shapes, files, provenance, messages,
# the runs table, the YAML reader, the bounds on counts, what is done before transformers loads a model)
BASE = {"_lazy", "errors", "arch", "presets", "configio", "fileio", "provenance", "hardware", "candidates", "logs",
        "rundata", "yamlio", "bounds", "hf"}

# module -> the archsearch subpackages it may import (besides itself and BASE), heavy modules it may import
ALLOWED: dict[str, tuple[set[str], set[str]]] = {
    "archsearch": (set(), set()),
    "archsearch.cli": ({"figures"}, set()),               # subcommands load their engines on use; figures: the env check (matplotlib stays lazy)
    "archsearch.laws": (set(), {"numpy"}),
    "archsearch.laws.fit": (set(), {"numpy"}),
    "archsearch.laws.lawfile": (set(), {"numpy"}),
    "archsearch.planning": (set(), {"numpy"}),
    "archsearch.trainers": (set(), set()),
    "archsearch.trainers.config": (set(), set()),
    "archsearch.trainers.loop": ({"modelcard"}, set()),    # torch only inside train(); a run writes its model card
    "archsearch.benchmarks": (set(), set()),
    "archsearch.benchmarks.paired": (set(), set()),
    "archsearch.benchmarks.vllm_backend": (set(), set()),  # vLLM only when an engine starts
    "archsearch.benchmarks.hf_backend": (set(), set()),
    "archsearch.cluster": (set(), set()),
    "archsearch.cluster.executor": (set(), set()),         # submitit only when jobs are submitted
    "archsearch.evaluation": (set(), set()),
    "archsearch.evaluation.suites": (set(), set()),
    # the study's schema nests the types it configures: build settings, measurement settings,
    # limits, sweeps/training, cluster, the law fit's options
    "archsearch.search.config": ({"benchmarks", "planning", "trainers", "cluster", "laws"}, {"numpy"}),
    # the study's checks name the evaluation's tasks at load (archsearch.evaluation.suites), and the
    # deployment targets draw their figure (archsearch.figures: matplotlib only when drawn)
    "archsearch.search.pipeline": ({"benchmarks", "planning", "trainers", "cluster", "laws", "modelcard", "evaluation",
                                    "figures"}, {"numpy"}),
    "archsearch.search.report": ({"benchmarks", "planning", "trainers", "cluster", "laws", "figures", "modelcard",
                                  "evaluation"}, {"numpy"}),
}

_PROBE = """
import json, sys
import {mod}
print(json.dumps(sorted(m for m in sys.modules)))
"""


@pytest.mark.parametrize("mod", sorted(ALLOWED))
def test_importing_a_package_imports_only_what_it_declares(mod):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(mod=mod)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    own = mod.split(".")[1] if "." in mod else None
    siblings, heavy_ok = ALLOWED[mod]
    subpkgs = {m.split(".")[1] for m in loaded if m.startswith("archsearch.")}
    extra = subpkgs - BASE - siblings - {own}
    assert not extra, f"importing {mod} imports archsearch.{sorted(extra)}: lazy-import it or declare the edge"
    heavy = sorted(({m.split(".")[0] for m in loaded} & {*HEAVY, "numpy"}) - heavy_ok)
    assert not heavy, f"importing {mod} imports {heavy} at module level"


ROOT = Path(__file__).resolve().parents[1]
PENDING: set[tuple[str, str]] = set()  # (file, private name) pairs allowed for now: none


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("trainers", "benchmarks"):
        parts.insert(0, "archsearch")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[1:2] in (["trainers"], ["benchmarks"]):  # installed as archsearch.trainers, .benchmarks
        parts = parts[1:]
    where = ROOT.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def private_reach_ins(path: Path, text: str | None = None, pending=PENDING) -> list[str]:
    """``module._name`` of another project module that ``path`` imports or reads (dunders aside)."""
    me, tree = _module_name(path), ast.parse(path.read_text() if text is None else text, str(path))
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    names: dict[str, str] = {}  # local name -> the dotted project name it stands for
    used: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                names[a.asname or a.name] = f"{base}.{a.name}"
                used.append((node.lineno, f"{base}.{a.name}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, n = [node.attr], node.value
            while isinstance(n, ast.Attribute):
                chain.insert(0, n.attr)
                n = n.value
            if isinstance(n, ast.Name) and n.id in names:
                used.append((node.lineno, ".".join([names[n.id], *chain])))
    out = []
    for line, dotted in used:
        owner, _, name = dotted.rpartition(".")
        if (dotted.startswith("archsearch.") and name.startswith("_") and not name.startswith("__")
                and owner != me and not _is_module(dotted)  # a package's own helper module (_lazy, _common)
                and (str(path.relative_to(ROOT)), dotted) not in pending):
            out.append(f"{path.relative_to(ROOT)}:{line} {dotted}")
    return sorted(set(out))


def _engine_sources():
    for folder in ("archsearch", "trainers", "benchmarks", "scripts"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_module_imports_another_modules_private_name():
    bad = [hit for path in _engine_sources() for hit in private_reach_ins(path)]
    assert not bad, "make these public where they belong (or move them): " + ", ".join(bad)
    for file, dotted in PENDING:  # an entry that no longer occurs is removed, not kept as a licence
        hits = private_reach_ins(ROOT / file, pending=frozenset())
        assert any(h.endswith(f" {dotted}") for h in hits), f"{file} no longer uses {dotted}: drop it from PENDING"


def test_the_private_reach_in_check_sees_each_form():
    text = ("from archsearch.laws.fit import _x, ok\nfrom ..laws import fit as f\nimport archsearch.laws.forms as forms\n"
            "from . import report\nf._y(); forms._z; report._w; f.__doc__; _own()\nfrom archsearch import _lazy\n")
    assert private_reach_ins(ROOT / "archsearch" / "search" / "_probe_for_test.py", text) == [f"archsearch/search/_probe_for_test.py:{n} archsearch.{d}" for n, d in
                                      ((1, "laws.fit._x"), (5, "laws.fit._y"), (5, "laws.forms._z"),
                                       (5, "search.report._w"))]


# (file, project module) pairs imported inside a function, and why; every other project module is
# imported at the top of the file, so that a file's header says what it depends on
IN_FUNCTION: dict[tuple[str, str], str] = {
    ("archsearch/cluster/executor.py", "archsearch.cluster._job"): "imports submitit: local and Slurm executors only",
    # the import-cost table above keeps these modules free of numpy, which planning, the data
    # pipeline and the law fit import
    ("trainers/config.py", "archsearch.planning.lora"): "numpy",
    ("trainers/loop.py", "archsearch.planning.lora"): "numpy",
    ("trainers/loop.py", "archsearch.trainers.data"): "numpy",
    ("trainers/loop.py", "archsearch.laws.fit"): "numpy",
    # the active proxy plan's acquisition math and data pipeline load numpy: imported where the plan runs
    ("trainers/active_proxies.py", "archsearch.trainers.data"): "numpy",
    ("trainers/active_proxies.py", "archsearch.laws.acquisition"): "numpy",
}


def in_function_project_imports(path: Path, text: str | None = None) -> set[tuple[str, str]]:
    """(file, project module) of every import of a project module inside a function of ``path``."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    me = _module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = set()

    def walk(node, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.Import):
                    mods = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                    mods = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in child.names]
                for m in mods:
                    if m.split(".")[0] in ("archsearch", "trainers", "benchmarks"):
                        found.add((str(path.relative_to(ROOT)), m))
            walk(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return found


def _library_sources():
    for folder in ("archsearch", "trainers", "benchmarks"):
        yield from (p for p in sorted((ROOT / folder).rglob("*.py")) if "scripts" not in p.relative_to(ROOT).parts)


def test_project_modules_are_imported_at_the_top_of_the_file():
    found = set().union(*(in_function_project_imports(p) for p in _library_sources()))
    new = sorted(found - set(IN_FUNCTION))
    assert not new, f"import these at the top of the file (or say in IN_FUNCTION why not): {new}"
    gone = sorted(set(IN_FUNCTION) - found)
    assert not gone, f"no longer imported inside a function: {gone}; drop them from IN_FUNCTION"


def test_the_in_function_check_sees_each_form():
    text = ("import json\nfrom archsearch.arch import x\ndef f():\n    from archsearch.fileio import y\n"
            "    import archsearch.errors\n    from . import report\n    import numpy\n")
    assert in_function_project_imports(ROOT / "archsearch" / "search" / "_probe_for_test.py", text) == {
        ("archsearch/search/_probe_for_test.py", m)
        for m in ("archsearch.fileio", "archsearch.errors", "archsearch.search.report")}


_NO_SKLEARN = """
import json, sys
from archsearch.arch import ArchSpec
from archsearch.hf import without_sklearn
from archsearch.trainers.loop import build_model

build_model(ArchSpec(n_layers=1, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=128,
                     vocab_size=128))
from transformers.generation import candidate_generator
loaded_first = "sklearn" in sys.modules
import sklearn
print(json.dumps({"sklearn_at_build": loaded_first,
                  "assisted_calibration": candidate_generator.is_sklearn_available(),
                  "again": without_sklearn()}))
"""


def test_a_model_loads_without_scikit_learn():
    """archsearch.hf.without_sklearn: a proxy model built by the trainer (the call site every
    training run takes) loads transformers' generation code without importing scikit-learn, which
    transformers then sees as absent; with scikit-learn loaded, the switch does nothing."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-c", _NO_SKLEARN], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"sklearn_at_build": False, "assisted_calibration": False, "again": False}

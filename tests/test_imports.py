"""Import discipline: importing a package of archsearch imports only the sibling packages it
needs, and no heavy engine (torch, vLLM, transformers, lm-eval, Optuna, ...) until a function
that uses one is called. Each module is imported in a fresh interpreter; the table below is the
declared dependency graph (a new edge is a decision: add it here, with a reason, or lazy-import).

The same check by hand: ``python -c "import archsearch.trainers, sys; print(sorted(m for m in
sys.modules if m.startswith('archsearch.')))"``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# imported at module level by every engine path: never in a dependency list
HEAVY = ("torch", "vllm", "sglang", "transformers", "lm_eval", "optuna", "matplotlib", "submitit",
         "accelerate", "peft", "datasets", "scipy", "pandas", "psycopg2", "tokenizers")
# small shared modules any package may use (errors, accounting, files, provenance)
BASE = {"_lazy", "errors", "arch", "configio", "fileio", "provenance", "hardware", "candidates"}

# module -> the archsearch subpackages it may import (besides itself and BASE), heavy modules it may import
ALLOWED: dict[str, tuple[set[str], set[str]]] = {
    "archsearch": (set(), set()),
    "archsearch.cli": (set(), set()),                      # subcommands load their engines on use
    "archsearch.laws": (set(), {"numpy"}),
    "archsearch.laws.fit": (set(), {"numpy"}),
    "archsearch.planning": (set(), {"numpy"}),
    "archsearch.trainers": (set(), set()),
    "archsearch.trainers.config": (set(), set()),
    "archsearch.trainers.loop": (set(), set()),            # torch only inside train()
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
    "archsearch.search.pipeline": ({"benchmarks", "planning", "trainers", "cluster", "laws"}, {"numpy"}),
    "archsearch.search.report": ({"benchmarks", "planning", "trainers", "cluster", "laws", "figures"}, {"numpy"}),
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

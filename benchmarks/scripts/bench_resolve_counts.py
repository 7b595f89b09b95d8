"""Benchmark: how often a study's config is checked and its values derived, in the code and in one
dry run.

Two counts, on the tree whose ``archsearch`` Python imports (run it from the repository root; a
copy of another commit is counted by running this file from that copy's root with
``PYTHONPATH=.``):

- call sites: calls of each derivation (the vocabulary, the build settings, the baseline, the
  baseline as measured, the measured scale, the fit options, the proxy sweeps and their shapes,
  the targets' views) in the library and the benchmark scripts (tests aside, and
  ``archsearch/search/resolved.py``, which builds the resolved study; a file reached through a
  symbolic link is counted once, where it lies);
- one ``archsearch search --dry-run`` per config, in this process: how many times each of those
  functions ran, how many times ``archsearch/search/checks.py`` was entered from outside it, and
  how many times each check ran.

It prints one JSON line per config and appends it with provenance to
``results/bench/resolve_counts.jsonl``.

    python -m archsearch.benchmarks.scripts.bench_resolve_counts --label this-commit
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

# function name -> the files that define it, in the code before and after the redesign (a call of
# that name anywhere is a call site)
DERIVATIONS = {"vocab_size": ("search/checks.py",), "build_settings": ("search/study.py", "search/derived.py"),
               "baseline_spec": ("search/checks.py",), "measured_baseline": ("search/checks.py",),
               "measure_scale": ("search/study.py", "search/derived.py"), "fit_options": ("search/config.py",),
               "proxy_sweeps": ("search/checks.py", "search/derived.py"), "sweep_specs": ("trainers/sweep.py",),
               "study_views": ("search/targets.py",), "target_views": ("search/checks.py",)}
# the config's checks: the one entry point before, the steps resolve runs after
CHECKS = ("validate", "resolve", "check_settings", "check_search_space", "check_study",
          "check_reference_batches")
SOURCES = ("archsearch", "trainers", "benchmarks")


def call_sites(root: Path) -> dict[str, int]:
    """Calls of each derivation by name in the library and the benchmark scripts."""
    sites: Counter = Counter()
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            if path.resolve() != path or path.parts[-3:] == ("archsearch", "search", "resolved.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in DERIVATIONS:
                    sites[name] += 1
    return dict(sorted(sites.items()))


def dry_run_calls(config: Path, gpus: str) -> dict:
    """Each watched function's calls, and the entries into checks.py from outside it, during one
    dry run of ``config`` priced on ``gpus``."""
    from archsearch.cli import main

    calls: Counter = Counter()
    entered = 0

    def profile(frame, event, arg):
        nonlocal entered
        if event != "call":
            return
        code = frame.f_code
        here = code.co_filename.replace("\\", "/")
        caller = frame.f_back.f_code.co_filename
        if here.endswith("search/checks.py") and not caller.endswith("search/checks.py") \
                and not code.co_name.startswith("<"):
            entered += 1
        if code.co_name in CHECKS and here.endswith(("search/checks.py", "search/resolved.py")) or \
                code.co_name in DERIVATIONS and here.endswith(DERIVATIONS[code.co_name]):
            calls[code.co_name] += 1

    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        sys.setprofile(profile)
        try:
            main(["search", "--config", str(config), "--dry-run", "--gpus", gpus,
                  "--out", str(Path(out) / "o")])
        finally:
            sys.setprofile(None)
    return {"calls": dict(sorted(calls.items())), "checks_py_entered": entered}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["configs/demo-cpu.yaml", "configs/paper-1b.yaml",
                                                      "configs/paper-1b-targets-rehearsal.yaml"])
    ap.add_argument("--gpus", default="8xH100", help="what the dry run prices on")
    ap.add_argument("--label", required=True, help="which code this counts (e.g. a commit), recorded with it")
    ap.add_argument("--out", default="results/bench/resolve_counts.jsonl")
    args = ap.parse_args()
    import archsearch
    from archsearch.benchmarks.base import append_jsonl
    from archsearch.provenance import provenance

    root = Path(archsearch.__file__).resolve().parents[1]
    sites = call_sites(root)
    for config in args.configs:
        rec = {"bench": "resolve_counts", "label": args.label, "tree": str(root), "config": config,
               "gpus": args.gpus, "call_sites": sites, "dry_run": dry_run_calls(Path(config), args.gpus),
               "provenance": provenance(device=False)}
        print(json.dumps({k: rec[k] for k in ("label", "config", "call_sites", "dry_run")}))
        append_jsonl(args.out, rec)


if __name__ == "__main__":
    main()

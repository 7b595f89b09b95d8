"""What a refactor of the study's stages must not change, as one JSON snapshot: for every study
config under ``configs/``, its dry-run plan (as ``archsearch search --dry-run --json`` prints it,
without and with ``--gpus 8xH100``), each stage's recorded settings and fingerprint; for every
example study under ``results/examples/``, what resuming it would redo (nothing, for a folder that
is current). Run it before and after a change and compare the two files byte for byte:

    PYTHONPATH=$PWD python scripts/stage_parity.py > /tmp/before.json   # on the old code
    PYTHONPATH=$PWD python scripts/stage_parity.py > /tmp/after.json    # on the new code
    cmp /tmp/before.json /tmp/after.json

Nothing is written to the example folders: resuming is planned (``plan_resume``), not run. The
dry runs plan into a folder that does not exist, so no study folder's records enter them.

``--run DIR`` also runs the rehearsal studies (``configs/*-rehearsal.yaml``: the analytic roofline,
a minute each) afresh in ``DIR/<name>`` (deleted first: give the same DIR before and after) and adds
their answers: the summary's target, baseline, chosen shape, gains, GQA search and trials, and
``trials.csv`` (provenance, timings and paths left out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

# the data cache changes as other work fills it: plan against an empty one, the same on every run
os.environ["ARCHSEARCH_CACHE"] = "/nonexistent/stage-parity-cache"

from archsearch.errors import ArchsearchError  # noqa: E402 (after the cache is set)
from archsearch.search.config import load_study_config
from archsearch.search.dryrun import dry_run, render
from archsearch.search.inputs import fingerprints, plan_resume, stage_inputs
from archsearch.search import pipeline
from archsearch.search.pipeline import STAGE_NAMES, STAGES, StudyState
from archsearch.search.resolved import resolve

ROOT = Path(__file__).resolve().parents[1]
PLAN_OUT = Path("/nonexistent/stage-parity")  # the same string on every run: it is part of the plan


def study_configs() -> list[Path]:
    """The configs that are studies (sweep configs and the like are not)."""
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        try:
            load_study_config(path)
        except (ArchsearchError, TypeError, ValueError, KeyError):
            continue
        out.append(path)
    return out


def snapshot() -> dict:
    snap: dict = {"stages": list(STAGE_NAMES), "configs": {}, "examples": {}}
    for path in study_configs():
        cfg = load_study_config(path)
        entry: dict = {}
        try:
            study = resolve(cfg, for_plan=True)
            entry["plan"] = dry_run(study, PLAN_OUT / cfg.name)
            entry["plan_8xH100"] = dry_run(study, PLAN_OUT / cfg.name, gpus="8xH100")
            entry["text"] = render(entry["plan"]) + render(entry["plan_8xH100"])  # as printed, in its key order
        except ArchsearchError as e:
            entry["refused"] = f"{e.field}: {e.problem}"
        applies = {st.name: st.applies(cfg) for st in STAGES}
        entry["applies"] = applies
        entry["inputs"] = stage_inputs(cfg)
        entry["fingerprints"] = fingerprints(cfg, applies)
        snap["configs"][path.name] = entry
    for folder in sorted(p for p in (ROOT / "results" / "examples").iterdir() if (p / "state.json").is_file()):
        config = ROOT / "configs" / f"{folder.name}.yaml"
        if not config.is_file():
            continue
        cfg = load_study_config(config)
        state = StudyState(folder).data
        applies = {st.name: st.applies(cfg) for st in STAGES}
        plan = plan_resume(cfg, folder, state, set(STAGE_NAMES), applies, default_storage=True)
        recorded = json.loads((folder / "stage_inputs.json").read_text()) if (folder / "stage_inputs.json").is_file() else {}
        now = fingerprints(cfg, applies)
        snap["examples"][folder.name] = {
            "stale": plan.stale, "keep": sorted(plan.keep),
            "fingerprints_differ": sorted(s for s, rec in recorded.items() if rec.get("fingerprint") != now.get(s))}
    return snap


ANSWER_KEYS = ("target_loss", "target_source", "baseline", "chosen", "throughput_gain_vs_baseline",
               "significantly_faster", "trials", "gqa_search", "pareto", "loss_margins")


def rehearsals(folder: Path) -> dict:
    """Each rehearsal study run afresh in ``folder/<name>``: its answer, as its summary gives it."""
    out = {}
    for path in sorted((ROOT / "configs").glob("*-rehearsal.yaml")):
        cfg = load_study_config(path)
        study = folder / cfg.name
        shutil.rmtree(study, ignore_errors=True)
        summary = pipeline.run(cfg, study, progress=False)
        out[path.name] = {"summary": {k: summary.get(k) for k in ANSWER_KEYS},
                          "trials_csv": (study / "trials.csv").read_text()}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, metavar="DIR", help="also run the rehearsal studies afresh in DIR")
    args = ap.parse_args()
    snap = snapshot()
    if args.run:
        snap["rehearsals"] = rehearsals(args.run)
    print(json.dumps(snap, indent=1, sort_keys=True, default=str))

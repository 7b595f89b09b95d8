"""Benchmark (issue 17): the dry-run plan's predicted wall time per stage against what the study
then records, on the CI-sized local-cluster study (configs/ci-cluster.yaml: 6 proxies as jobs
two at a time, 2 Optuna workers with the hf engine, all on this CPU).

Prices the plan with ``--gpus {jobs_at_once}xcpu`` (the measured CPU entry of
archsearch.hardware: each proxy job on one CPU "device" at the planner's MFU, measurements with
the CPU roofline and the assumed hf engine start), runs the study in a fresh folder with
``python -m archsearch search``, and prints per stage the predicted and the measured seconds
(``state.json``) and their ratio; appends the table with provenance to
``results/bench/plan_accuracy.jsonl``.

    python -m archsearch.benchmarks.scripts.bench_plan_accuracy [--config configs/ci-cluster.yaml]

A single run on a shared machine: the ratios say how far the planner's assumptions are from
this machine, not a precise figure (rerun to see the spread).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from archsearch.fileio import append_line

OUT = Path("results/bench/plan_accuracy.jsonl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/ci-cluster.yaml"))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", type=Path, default=None, help="study folder to keep (default: a temporary one)")
    a = ap.parse_args(argv)

    from archsearch.provenance import provenance
    from archsearch.search.config import load_study_config
    from archsearch.search.plan import plan

    cfg = load_study_config(a.config)
    gpus = f"{cfg.cluster.jobs_at_once}xcpu"
    with tempfile.TemporaryDirectory() as tmp:
        study = a.keep or Path(tmp) / "study"
        p = plan(cfg, study, gpus=gpus)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "archsearch", "search", "--config", str(a.config),
                            "--out", str(study), "--json"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"), check=False)
        total = time.perf_counter() - t0
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        state = json.loads((study / "state.json").read_text())
    rows = []
    for st in p["stages"]:
        pred = st.get("wall_hours")
        meas = state.get(st["stage"], {}).get("seconds")
        rows.append({"stage": st["stage"], "predicted_s": None if pred is None else pred * 3600,
                     **({"predicted_low_s": st["wall_hours_low"] * 3600} if "wall_hours_low" in st else {}),
                     "measured_s": meas,
                     "measured_over_predicted": (meas / (pred * 3600)) if pred and meas else None})
    print(f"plan vs study on {gpus} ({a.config}); the study took {total:.0f} s in all")
    print(f"  {'stage':<8} {'predicted s':>12} {'measured s':>11} {'measured/predicted':>19}")
    for row in rows:
        pr = "-" if row["predicted_s"] is None else f"{row['predicted_s']:.1f}"
        if "predicted_low_s" in row:
            pr = f"{row['predicted_low_s']:.1f}-{pr}"
        me = "-" if row["measured_s"] is None else f"{row['measured_s']:.1f}"
        ra = "-" if row["measured_over_predicted"] is None else f"{row['measured_over_predicted']:.2f}"
        print(f"  {row['stage']:<8} {pr:>12} {me:>11} {ra:>19}")
    for line in [*p["compute"]["assumptions"], *p["compute"].get("measure", {}).get("assumptions", []),
                 *p.get("assumptions", [])]:
        print(f"  assumption: {line}")
    rec = {"bench": "plan_accuracy", "config": str(a.config), "gpus": gpus, "study_seconds": total,
           "stages": rows, "assumptions": p["compute"]["assumptions"] + p.get("assumptions", []),
           "provenance": provenance()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    append_line(a.out, json.dumps(rec))
    print(f"appended to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

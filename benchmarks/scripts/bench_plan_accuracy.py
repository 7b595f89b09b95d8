"""Benchmark: the dry-run plan's predicted wall time per stage against what the study
then records, on the CI-sized local-cluster study (configs/ci-cluster.yaml: 6 proxies as jobs
two at a time, 2 Optuna workers with the hf engine, all on this CPU), with start-ups measured on
this machine.

1. Calibration (unless ``--profile`` names a machine profile): the study runs once in a fresh
   folder; the start-ups it records (``startups.json``: proxy jobs' submission to first step, the
   search workers' start, engine processes and engines) become a machine profile
   (``archsearch profile``), written to ``--profile-out``.
2. ``--runs`` times: a fresh study folder is planned with that profile (``--gpus
   {jobs_at_once}xcpu``: each proxy job on one CPU "device" at the planner's MFU, measurements
   with the CPU roofline) and then run with ``python -m archsearch search``; per stage the
   predicted and measured seconds (``state.json``) and their ratio, and the run's own start-ups
   against the profile's.

Training is priced with ``--mfu``: ``measured`` (default, with a calibration study): the
calibration's proxy runs' own training seconds expressed as the MFU of the device entry the
plan prices with (per run, estimate_training's seconds at MFU 1 over its measured
``train_time_s``; the median), passed as ``archsearch search --dry-run --mfu``; ``assumed``: the
planner's assumed 0.40; or a number.

Prints the table and the ratios' median and range over the runs, and appends everything with
provenance to ``results/bench/plan_accuracy.jsonl``. ``--label quiet|loaded`` says whether the
machine was quiet (nothing else running) while it ran.

    python -m archsearch.benchmarks.scripts.bench_plan_accuracy --runs 2 --label quiet

Each study uses the shared data cache (``$ARCHSEARCH_CACHE``): after the first, its tokenisation
is found there and costs nothing, while the plan still prices it (printed: data predicted and
measured); ``--fresh-cache`` gives each study its own empty cache (the tokenizer is then trained
too, which the plan does not price).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from archsearch.fileio import append_line, write_json

OUT = Path("results/bench/plan_accuracy.jsonl")


def _run_study(config: Path, study: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "archsearch", "search", "--config", str(config),
                        "--out", str(study), "--json"], capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise SystemExit(f"the study in {study} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def measured_mfu(study: Path, gpus: str) -> list[float]:
    """Per proxy run of ``study``: its training seconds as the planner prices them at MFU 1 on one
    job's device (``1x<device>`` of ``gpus``) over its measured ``train_time_s``: the MFU that
    prices that run's training as it went, relative to the device entry the plan uses."""
    from archsearch.arch import ArchSpec
    from archsearch.planning import estimate_training
    from archsearch.planning.time import split_gpus

    device = "1x" + split_gpus(gpus)[1]
    out = []
    for f in sorted(study.glob("proxies/*/runs/*/run.json")):
        rec = json.loads(f.read_text())
        if rec.get("status") != "ok" or not rec.get("train_time_s"):
            continue
        e = estimate_training(ArchSpec.from_dict(rec["spec"]), rec["tokens"], device, mfu=1.0)
        out.append(e.hours * 3600 / rec["train_time_s"])
    if not out:
        raise SystemExit(f"no finished proxy run in {study} to measure the MFU on")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/ci-cluster.yaml"))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--runs", type=int, default=2, help="planned-then-run studies (after the calibration)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="a machine profile to plan with (default: calibrate on this machine first)")
    ap.add_argument("--profile-out", type=Path, default=None,
                    help="where the calibration's profile is written (default: kept only in the record)")
    ap.add_argument("--label", choices=["quiet", "loaded", "unlabelled"], default="unlabelled",
                    help="the machine's state while this ran (quiet: nothing else running)")
    ap.add_argument("--fresh-cache", action="store_true", help="each study its own empty data cache")
    ap.add_argument("--keep", type=Path, default=None, help="folder to keep the studies in (default: temporary)")
    ap.add_argument("--mfu", default="measured",
                    help="measured (from the calibration study's proxy runs) | assumed | a number in (0, 1]")
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error("--runs must be >= 1")

    from archsearch.cluster.startup import STARTUPS_FILE, build_profile, load_profile
    from archsearch.provenance import provenance
    from archsearch.search.config import load_study_config
    from archsearch.search.dryrun import dry_run

    cfg = load_study_config(a.config)
    gpus = f"{cfg.cluster.jobs_at_once}xcpu"
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)

        def env_for(name: str) -> dict[str, str]:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if a.fresh_cache:
                env["ARCHSEARCH_CACHE"] = str(root / f"cache-{name}")
            return env

        calibration = None
        profile = a.profile
        if profile is None:
            cal = root / "calibration"
            secs = _run_study(a.config, cal, env_for("calibration"))
            prof = build_profile([cal])
            profile = a.profile_out or root / "profile.json"
            write_json(profile, prof)
            calibration = {"study_seconds": secs, "profile": str(profile), "figures": prof["figures"]}
            print(f"calibration study: {secs:.0f} s; profile -> {profile}")
        figures = {k: {"value": f.value, "n": f.n, "low": f.low, "high": f.high}
                   for k, f in load_profile(profile).items()}
        mfu, mfu_runs = None, []
        if a.mfu == "measured" and calibration is not None:
            mfu_runs = measured_mfu(root / "calibration", gpus)
            mfu = statistics.median(mfu_runs)
            calibration["mfu_per_run"] = mfu_runs
            print(f"training priced at the calibration's measured MFU {mfu:.3g} (per run "
                  f"{min(mfu_runs):.3g}-{max(mfu_runs):.3g}, n={len(mfu_runs)})")
        elif a.mfu not in ("measured", "assumed"):
            mfu = float(a.mfu)
        runs = []
        for i in range(a.runs):
            study = root / f"run-{i}"
            if a.fresh_cache:  # the plan reads the same (empty) cache the study will fill
                os.environ["ARCHSEARCH_CACHE"] = env_for(f"run-{i}")["ARCHSEARCH_CACHE"]
            p = dry_run(cfg, study, gpus=gpus, profile=profile, mfu=mfu)
            total = _run_study(a.config, study, env_for(f"run-{i}"))
            state = json.loads((study / "state.json").read_text())
            own = json.loads((study / STARTUPS_FILE).read_text())["runs"]
            rows = []
            for st in p["stages"]:
                pred = st.get("wall_hours")
                meas = state.get(st["stage"], {}).get("seconds")
                rows.append({"stage": st["stage"], "predicted_s": None if pred is None else pred * 3600,
                             **({"predicted_low_s": st["wall_hours_low"] * 3600} if "wall_hours_low" in st else {}),
                             **({"predicted_data_s": st["data_wall_hours"] * 3600} if "data_wall_hours" in st else {}),
                             "measured_s": meas,
                             "measured_over_predicted": (meas / (pred * 3600)) if pred and meas else None})
            data_meas = sum(r.get("data_prep_s") or 0.0 for r in own if r["stage"] == "proxy")
            runs.append({"study_seconds": total, "stages": rows, "measured_data_prep_s": data_meas,
                         "startups": {k: v for r in own for k, v in r["samples"].items()}})
            print(f"run {i}: the study took {total:.0f} s; data preparation measured {data_meas:.1f} s")
            print(f"  {'stage':<8} {'predicted s':>14} {'measured s':>11} {'measured/predicted':>19}")
            for row in rows:
                pr = "-" if row["predicted_s"] is None else f"{row['predicted_s']:.1f}"
                if "predicted_low_s" in row:
                    pr = f"{row['predicted_low_s']:.1f}-{pr}"
                me = "-" if row["measured_s"] is None else f"{row['measured_s']:.1f}"
                ra = "-" if row["measured_over_predicted"] is None else f"{row['measured_over_predicted']:.2f}"
                print(f"  {row['stage']:<8} {pr:>14} {me:>11} {ra:>19}")
    summary = {}
    for stage in [r["stage"] for r in runs[0]["stages"] if r["predicted_s"]]:
        ratios = [r["measured_over_predicted"] for run in runs for r in run["stages"]
                  if r["stage"] == stage and r["measured_over_predicted"]]
        if ratios:
            summary[stage] = {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
                              "n": len(ratios)}
    print(f"measured/predicted over {a.runs} run(s) on {gpus} ({a.config}, machine {a.label}):")
    for stage, s in summary.items():
        print(f"  {stage:<8} median {s['median']:.2f} (range {s['low']:.2f}-{s['high']:.2f}, n={s['n']})")
    print("profile figures (median s, n): " + ", ".join(f"{k} {v['value']:.2f} ({v['n']})" for k, v in figures.items()))
    for line in [*p["compute"]["assumptions"], *p["compute"].get("measure", {}).get("assumptions", []),
                 *p.get("assumptions", [])]:
        print(f"  assumption: {line}")
    rec = {"bench": "plan_accuracy", "config": str(a.config), "gpus": gpus, "machine": a.label,
           "fresh_cache": a.fresh_cache, "profile": str(a.profile) if a.profile else "calibrated in this run",
           "mfu": mfu, "mfu_from": ("the calibration study's proxy runs" if a.mfu == "measured" and mfu is not None
                                    else "given" if mfu is not None else "the planner's assumed MFU"),
           "calibration": calibration, "profile_figures": figures, "runs": runs, "summary": summary,
           "assumptions": p["compute"]["assumptions"] + p["compute"].get("measure", {}).get("assumptions", [])
           + p.get("assumptions", []), "provenance": provenance()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    append_line(a.out, json.dumps(rec))
    print(f"appended to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

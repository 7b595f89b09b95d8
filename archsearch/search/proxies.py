"""The study's proxy stage: train the proxy sweeps (every grid point, or the runs the active plan
chooses) into the study's ``proxies/`` folder and merge their tables into ``proxies/runs.csv``,
the table the fit stage reads."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from archsearch.cluster.startup import record_tail
from archsearch.fileio import atomic_write
from archsearch.rundata import write_runs
from archsearch.search import log
from archsearch.search.resolved import ResolvedStudy
from archsearch.search.config import StudyConfig
from archsearch.search.measurements import file_lock
from archsearch.search.report import active_markdown, active_plan_summary, active_plot
from archsearch.search.workers import JOBS_DIR
from archsearch.trainers import run_sweep
from archsearch.trainers.active_proxies import run_active
from archsearch.trainers.jobs import (content_key, has_record, link_shared_runs, link_to_store, run_proxy_jobs,
                                      run_train_jobs)
from archsearch.trainers.loop import read_record, token_budget
from archsearch.trainers.sweep import train_or_fail


def train_proxy_grid(study: ResolvedStudy, out: Path, runs_path: Path) -> dict[str, Any]:
    """Train every proxy sweep (each resumes and skips its finished runs) into
    ``proxies/<sweep name>/`` and merge their tables into ``proxies/runs.csv``."""
    cfg, records = study.cfg, []
    for sweep in study.sweeps:
        jobs = None
        log(f"proxy sweep {sweep.name} into {out / 'proxies' / sweep.name}")
        if cfg.proxy.store:  # runs live in the shared store, keyed by content; this study links them
            reused = link_shared_runs(sweep, out / "proxies" / sweep.name, Path(cfg.proxy.store))
            log(f"proxy store {cfg.proxy.store}: {len(reused)} run(s) of {sweep.name} already trained there")
        if cfg.cluster.parallel:  # train the runs as jobs; the sweep below then only collects them
            t_sub = time.time()
            jobs = run_proxy_jobs(sweep, out / "proxies" / sweep.name, cfg.cluster, out / JOBS_DIR / sweep.name,
                                  study=out)
            sweep = replace(sweep, retry_failed=False)
        records += run_sweep(sweep, out / "proxies" / sweep.name)
        if jobs is not None:  # the coordinator's seconds after the sweep's jobs until its runs are collected
            record_tail(out, "proxy", "proxy_tail_s", jobs, since=t_sub)
    write_runs(runs_path, records)
    return {"proxy_runs": len(records), "ok": sum(1 for x in records if x.status == "ok")}


def train_active_proxies(study: ResolvedStudy, out: Path, runs_path: Path) -> dict[str, Any]:
    """``proxy.plan: active``: train the runs the active plan chooses (``archsearch.trainers.active_proxies``)
    into ``proxies/active/``; its table becomes ``proxies/runs.csv``."""
    cfg = study.cfg
    log(f"active proxy plan into {out / 'proxies' / 'active'}")
    # a best-observed L_opt exists only at a trained size: the target size joins the initial design
    anchors = [cfg.params] if cfg.law.fit.reference == "best-observed" else []
    records = run_active(list(study.sweeps), cfg.law.form, study.fit, cfg.proxy.active,
                         out / "proxies" / "active", anchor_params=anchors)
    write_active_plan_report(out)
    with file_lock(out / ".stage.lock"):
        write_runs(runs_path, records)
    return {"plan": "active", "proxy_runs": len(records), "ok": sum(1 for x in records if x.status == "ok")}


def write_active_plan_report(out: Path) -> None:
    """The plan's section and plot on their own (``proxies/active/plan.md``, ``plots/active_proxies.png``),
    readable before the search stage; the study's report repeats them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plan = active_plan_summary(out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    active_plot(plan, out / "plots", plt)
    atomic_write(out / "proxies" / "active" / "plan.md", "\n".join(active_markdown(plan)[1:]) + "\n\n"
                 "![plot](../../plots/active_proxies.png)\n")


def train_runs(cfg: StudyConfig, sweep, runs: list[tuple[str, Any, Any]], folder: Path, data=None,
               progress: bool = True) -> tuple[dict[str, dict], list[str]]:
    """Train extra proxy runs ((run id, spec, train config) each, on ``sweep``'s data) into
    ``folder/runs/<run id>`` the way the proxy stage trains its sweeps: linked into ``proxy.store``
    where the study has one (a run any study trained there is reused), as the cluster's jobs where
    ``cluster.parallel``, else here one after another. A finished run (ok, or failed by the loop)
    is never trained again. ``data``: the sweep's prepared data (inline training reads it).
    Returns run id -> its ``run.json`` record, and the ids trained by this call."""
    dirs = {run_id: folder / "runs" / run_id for run_id, _, _ in runs}
    if cfg.proxy.store:
        for run_id, _spec, tc in runs:
            link_to_store(dirs[run_id], Path(cfg.proxy.store) / content_key(run_id, tc, sweep.data))
    todo = [run for run in runs if not has_record(dirs[run[0]])]
    if todo and cfg.cluster.parallel:
        run_train_jobs(todo, sweep.data, dirs, cfg.cluster, folder.parent / JOBS_DIR / folder.name)
    elif todo:
        for run_id, spec, tc in todo:
            train_or_fail(spec, tc, sweep, dirs[run_id], data, progress, token_budget(spec, tc), tc.seed)
    return {run_id: read_record(d) for run_id, d in dirs.items()}, [run[0] for run in todo]

"""The search stage as jobs: ``cluster.measure_workers`` Optuna workers on the study's shared
storage, each measuring on its own job's device until the study has its trials.

A worker writes only into the study folder (the shared storage and measurement store) and is
done once the study has its ``optuna.n_shapes`` shapes, so a restarted coordinator finds its result
whatever happened to itself.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from archsearch.cluster import startup
from archsearch.cluster.executor import Task, TaskResult, run_tasks
from archsearch.fileio import atomic_write
from archsearch.hardware import local_device_name
from archsearch.search import log
from archsearch.search.checks import check_reference_batch
from archsearch.search.context import search_context
from archsearch.search.resolved import as_resolved
from archsearch.search.callbacks import distinct_measured
from archsearch.search.study import load_study, run_study
from archsearch.search.trials import trial_times

# the folder of a study's job ledgers and logs
JOBS_DIR = "cluster"


def search_worker(study, out: str, marker: str) -> None:
    """Job: one Optuna worker on the study's shared storage, measuring on this job's device
    until the study has its ``optuna.n_shapes`` shapes (the workers share the count); then ``marker``.
    ``study``: the coordinator's resolved study (archsearch.search.resolved), or a config."""
    study = as_resolved(study)
    cfg = study.cfg
    # on Slurm the coordinator cannot know the jobs' GPUs: each worker checks its own before measuring
    check_reference_batch(cfg, cfg.measure.bench.device_spec or local_device_name(), study.measured_baseline)
    run_study(search_context(study, Path(out)), progress=False)
    atomic_write(marker, "done\n")


def run_search_workers(study, out: Path, stage_start: float | None = None) -> dict[str, TaskResult]:
    """The search stage as ``measure_workers`` jobs (one engine, one GPU each where GPUs are
    used); a worker is done once the study has its trials. ``study``: the resolved study
    (archsearch.search.resolved), handed to each job as it is. ``stage_start``: when the search
    stage began (its lead is measured from there; default: this call)."""
    t_enter = time.time()
    stage_start = t_enter if stage_start is None else min(stage_start, t_enter)
    cfg = study.cfg
    ctx = search_context(study, out)
    inline = study.with_cluster(replace(cfg.cluster, executor="inline", jobs_at_once=1, measure_workers=1))
    gpus = min(1, cfg.cluster.gpus_per_job)

    def study_done() -> bool:
        study = load_study(ctx)
        return study is not None and distinct_measured(study) >= cfg.optuna.n_shapes

    folder = out / JOBS_DIR / "search"
    folder.mkdir(parents=True, exist_ok=True)
    tasks = []
    for i in range(cfg.cluster.measure_workers):
        marker = folder / f"worker-{i}.done"
        tasks.append(Task(key=f"search-worker-{i}", fn=search_worker, args=(inline, str(out), str(marker)),
                          is_done=lambda m=marker: m.is_file() or study_done(), gpus=gpus))
    log(f"search: {len(tasks)} Optuna workers as {cfg.cluster.executor} jobs")
    results = run_tasks(tasks, cfg.cluster, folder)
    subs = [r.submitted for r in results.values() if r.submitted is not None and r.submitted >= t_enter]
    startup.record(out, "search", cfg.cluster.executor,
                   startup.search_samples(results, trial_times(load_study(ctx)), ctx.measurer.store.comparison_times(),
                                          cfg.measure.bench.backend, min(subs) - stage_start if subs else None,
                                          since=t_enter))
    return results

"""Proxy training runs as scheduler jobs: the job a run is, the distinct runs of a sweep, a run's
key in a shared proxy store, and a sweep's runs submitted and waited for.

A job writes only into its run folder and its result is read from there (``run.json``), so a
restarted coordinator finds it whatever happened to itself.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from functools import partial
from pathlib import Path

import yaml

from archsearch.cluster import startup
from archsearch.cluster.executor import Task, TaskResult, run_tasks
from archsearch.configio import to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_write, write_json
from archsearch.logs import get_logger
from archsearch.trainers.data import SHARD_DOCS, check_epochs, prepare_data
from archsearch.trainers.launch import accelerate_config, launch_commands, write_accelerate_config
from archsearch.trainers.loop import RUN_FILE, read_record, run_id_for, token_budget, train
from archsearch.trainers.sweep import failed_record, sweep_specs


def _log(msg: str) -> None:  # a line of the study's progress (archsearch.search.log)
    get_logger("search").info(f"[search] {msg}")


def has_record(run_dir: Path) -> bool:
    """A proxy run is finished when its ``run.json`` says ok, or failed by the loop itself (e.g.
    diverged: training it again would give the same); a run's record says running meanwhile."""
    rec = read_record(run_dir)
    return rec is not None and rec.get("status") in ("ok", "failed")


def train_proxy(spec, tc, data_cfg, run_dir: str, gpus: int) -> None:
    """Job: train one proxy run into ``run_dir`` (resumes from its checkpoint); with more than
    one GPU through ``accelerate launch`` of ``archsearch train`` on the same folder."""
    out = Path(run_dir)
    startup.note_process_start(out)
    if gpus <= 1:
        train(spec, tc, data_cfg, out, progress=False)
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "spec.json", spec.to_dict())
    atomic_write(out / "train.yaml", yaml.safe_dump({"train": to_dict(tc), "data": to_dict(data_cfg)}))
    acc = write_accelerate_config(out / "accelerate_config.yaml", accelerate_config(spec, num_processes=gpus))
    cmd = launch_commands(acc, ["--arch", str(out / "spec.json"), "--config", str(out / "train.yaml"),
                                "--out", str(out), "--no-progress"])[0]
    subprocess.run(cmd, check=True)


# fields that change how a run is executed or logged, not what it computes
_NOT_DETERMINING = {"train": {"log_interval", "checkpoint_interval", "keep_checkpoints", "cpu_threads",
                              "eval_interval", "compile"},
                    "data": {"cache_dir", "max_epochs"}}


def sweep_runs(sweep, data_info: dict | None = None) -> list[tuple[str, object, object]]:
    """(run id, spec, train config) of every distinct run of ``sweep``, after the data check
    (the coordinator tokenizes once into the shared cache; every job then reads it from there).
    ``data_info``: filled with the prepared data's info (``shards_tokenized_now``...)."""
    budgets = [token_budget(s, sweep.train_for(p["level"])) for p, s, _ in sweep_specs(sweep, 32000) if s]
    data = prepare_data(sweep.data, min_train_tokens=int(max(budgets, default=0)) + 1)
    check_epochs(data, max(budgets, default=0), sweep.data.max_epochs, f"sweep {sweep.name}'s largest run")
    if data_info is not None:
        data_info.update(data.info)
    runs, seen = [], set()
    for point, spec, _err in sweep_specs(sweep, data.vocab_size):
        if spec is None:
            continue
        tc = sweep.train_for(point["level"]).replace(seed=point["seed"])
        run_id = run_id_for(spec, token_budget(spec, tc), point["seed"])
        if run_id not in seen:  # snapping may map two grid points to one shape
            seen.add(run_id)
            runs.append((run_id, spec, tc))
    return runs


def content_key(run_id: str, tc, data_cfg) -> str:
    """A run's key in a shared store: its id (shape, D, seed) plus a hash of every setting that
    determines its result (training and data settings, not logging or checkpoint cadence)."""
    what = {"train": {k: v for k, v in to_dict(tc).items() if k not in _NOT_DETERMINING["train"]},
            "data": {k: v for k, v in to_dict(data_cfg).items() if k not in _NOT_DETERMINING["data"]}}
    if any(s.startswith("hf:") for s in data_cfg.sources):
        # a streamed source: the run reads the shortest run of shards holding its own budget
        # (its D is in the run id), so the shard size determines its sequences too; runs trained
        # before this, on the prefix of their sweep's largest budget, have other keys
        what["data_prefix"] = {"read": "own budget", "shard_docs": SHARD_DOCS}
    return f"{run_id}-{hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:10]}"


def link_shared_runs(sweep, out_dir: Path, store: Path) -> list[str]:
    """Point ``out_dir/runs/<run id>`` at ``store/<content key>`` for every run of ``sweep``, so
    that a run trained by any study that shares the store is reused, and a new one is trained
    into the store. Returns the keys already finished there."""

    store.mkdir(parents=True, exist_ok=True)
    reused = []
    for run_id, _spec, tc in sweep_runs(sweep):
        target = link_to_store(out_dir / "runs" / run_id, store / content_key(run_id, tc, sweep.data))
        if has_record(target):
            reused.append(target.name)
    return reused


def link_to_store(link: Path, target: Path) -> Path:
    """Point the run folder ``link`` at ``target``, its folder in a shared proxy store (created
    empty when no study trained it yet); returns the target."""
    target = target.resolve()
    if link.is_symlink() and link.resolve() == target:
        return target
    if link.exists() or link.is_symlink():
        raise ArchsearchError("proxy.store", f"{link} already exists and is not a link to {target}",
                              "use a fresh study folder with a shared store, or drop proxy.store")
    target.mkdir(parents=True, exist_ok=True)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=True)
    return target


def run_train_jobs(runs: list[tuple[str, object, object]], data_cfg, run_dirs: dict[str, Path], cluster,
                   jobs_dir: Path) -> dict[str, TaskResult]:
    """Train ``runs`` ((run id, spec, train config) each, into ``run_dirs[run id]``) as one job each
    and wait; a run whose jobs all failed gets a failed ``run.json``, as a proxy sweep's does."""
    tasks = [Task(key=run_id, fn=train_proxy, args=(spec, tc, data_cfg, str(run_dirs[run_id]), cluster.gpus_per_job),
                  is_done=partial(has_record, run_dirs[run_id]), gpus=cluster.gpus_per_job)
             for run_id, spec, tc in runs]
    results = run_tasks(tasks, cluster, jobs_dir)
    for run_id, spec, tc in runs:
        r = results[run_id]
        if r.status == "failed":
            run_dirs[run_id].mkdir(parents=True, exist_ok=True)
            write_json(run_dirs[run_id] / RUN_FILE, failed_record(spec, run_id, token_budget(spec, tc), tc.seed,
                                                                  f"{r.attempts} job(s) failed: {r.reason}"), default=str)
    return results


def run_proxy_jobs(sweep, out_dir: Path, cluster, jobs_dir: Path, study: Path | None = None) -> dict[str, TaskResult]:
    """Train every run of ``sweep`` not yet in ``out_dir/runs/`` as one job each and wait; a run
    whose jobs all failed gets a failed ``run.json`` (the sweep then lists it and goes on).
    ``study``: the study folder, whose ``startups.json`` gets the jobs' measured start-ups."""
    t_enter = time.time()
    tasks = []
    data_info: dict = {}
    runs = sweep_runs(sweep, data_info)  # the coordinator has tokenized up to the sweep's largest budget
    # timed apart: the plan prices the tokenisation as data preparation, not as start-up; with
    # nothing tokenized (every shard in the cache) it is a sample of data_cached_s
    prep_s = time.time() - t_enter
    cached = data_info.get("shards_tokenized_now") == 0
    # every job reads the prefix of those shards for its own budget (a streamed source), as an
    # inline sweep's runs do: a run's data does not depend on the sweep it is part of
    data_cfg = sweep.data
    for run_id, spec, tc in runs:
        run_dir = out_dir / "runs" / run_id
        tasks.append(Task(key=run_id, fn=train_proxy, args=(spec, tc, data_cfg, str(run_dir), cluster.gpus_per_job),
                          is_done=partial(has_record, run_dir), gpus=cluster.gpus_per_job))
    _log(f"proxy sweep {sweep.name}: {len(tasks)} runs as {cluster.executor} jobs "
         f"({cluster.jobs_at_once} at once)")
    results = run_tasks(tasks, cluster, jobs_dir)
    if study is not None:
        # this coordinator's own submissions (not the jobs it adopted from an earlier one)
        subs = [r.submitted for r in results.values() if r.submitted is not None and r.submitted >= t_enter]
        lead = min(subs) - t_enter - prep_s if subs else None
        run_dirs = {t.key: Path(t.args[3]) for t in tasks}
        startup.record(study, "proxy", cluster.executor,
                       {**startup.proxy_samples(results, run_dirs, {k: read_record(d) for k, d in run_dirs.items()},
                                                lead, since=t_enter),
                        "data_cached_s": [prep_s] if cached else []},
                       data_prep_s=round(prep_s, 3), data_tokenized_shards=data_info.get("shards_tokenized_now"))
    for t in tasks:
        r = results[t.key]
        if r.status == "failed":
            spec, tc = t.args[0], t.args[1]
            run_dir = Path(t.args[3])
            run_dir.mkdir(parents=True, exist_ok=True)
            write_json(run_dir / RUN_FILE, failed_record(spec, t.key, token_budget(spec, tc), tc.seed,
                                                         f"{r.attempts} job(s) failed: {r.reason}"), default=str)
    return results

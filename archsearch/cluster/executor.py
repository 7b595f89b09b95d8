"""Run keyed tasks as scheduler jobs and wait for them, surviving the coordinator's restart.

A task is done when its own output says so (``Task.is_done``: e.g. a run folder's ``run.json``
with status ok), never because a job exited. The ledger (``<folder>/ledger.json``) records
every submission (job id, GPUs, process start time), so a coordinator that restarts:

- collects what finished meanwhile (its output is there),
- adopts jobs still running or queued (the ledger names them; they are not submitted again),
- submits again a task whose job ended without its output, up to ``max_retries`` times,
  then reports it failed with the tail of the job's stderr.

One window is not covered: a coordinator killed after the scheduler accepted a job but before
its ledger entry was written (the milliseconds of one ``submit``) does not know that job, and its
successor submits the task again, so that task may run twice at once.

The job outputs (submitit's pickles and logs) stay under ``folder``; submitit pickles the
submitted call there and the job unpickles it: both are written by this user for this study.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archsearch.cluster.config import ClusterConfig
from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.fileio import read_json_tolerant
from archsearch.logs import get_logger


@dataclass(frozen=True)
class Task:
    """One job: ``fn(*args)`` (a module-level function, so that it pickles) whose result is on
    disk once ``is_done()``; ``gpus``: devices the job needs (0 on CPU)."""

    key: str
    fn: Callable[..., Any]
    args: tuple
    is_done: Callable[[], bool]
    gpus: int = 0


@dataclass(frozen=True)
class TaskResult:
    key: str
    status: str  # "ok" or "failed"
    attempts: int  # submissions over every coordinator run
    reason: str | None = None
    # the last job's submission, and when this coordinator saw it end (None where it did not see
    # it run: done before this coordinator started, or inline)
    submitted: float | None = None
    ended: float | None = None


class Ledger:
    """``ledger.json``: key -> list of submissions, rewritten atomically after each change."""

    def __init__(self, path: Path):
        self.path = path

        # one cut by a killed write is read as empty (with a line saying so): its tasks' jobs are
        # then found done by their results, or submitted again
        self.data: dict[str, list[dict[str, Any]]] = read_json_tolerant(path, "the job ledger") or {}

    def attempts(self, key: str) -> list[dict[str, Any]]:
        return self.data.get(key, [])

    def add(self, entries: list[tuple[str, dict[str, Any]]]) -> None:
        """Record ``(key, submission)`` pairs in one write: the jobs of one submission (a Slurm
        array) are in the ledger all or none. (Written one by one, a coordinator killed between
        two writes left array tasks running that no ledger knew, and the next coordinator
        submitted their tasks again: two jobs training one run.)"""
        for key, entry in entries:
            self.data.setdefault(key, []).append(entry)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)


def visible_gpus() -> list[int]:
    """Indices of the GPUs this process may use (``CUDA_VISIBLE_DEVICES``, else nvidia-smi)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(x) for x in env.split(",") if x.strip().isdigit()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return list(range(sum(1 for line in out.splitlines() if line.startswith("GPU "))))


def check_cluster(cfg: ClusterConfig) -> None:
    """Fail before any work where ``cfg``'s executor cannot run here."""
    if cfg.executor == "inline":
        return
    try:
        import submitit  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError("cluster.executor", f"{cfg.executor} needs submitit ({e})",
                                     "pip install 'archsearch[cluster]'") from e
    if cfg.executor == "slurm" and shutil.which("sbatch") is None:
        raise MissingDependencyError("cluster.executor", "slurm: sbatch is not on PATH",
                                     "run the study on a Slurm login node, or use executor: local")
    if cfg.executor == "local" and cfg.gpus_per_job and len(visible_gpus()) < cfg.gpus_per_job:
        raise ArchsearchError("cluster.gpus_per_job", f"a job needs {cfg.gpus_per_job} GPU(s), "
                              f"{len(visible_gpus())} are visible here",
                              "lower gpus_per_job (0 on a machine without GPUs) or run where the GPUs are")


# squeue states of a job that has ended (squeue lists them for MinJobAge after the end)
SLURM_ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
               "OUT_OF_MEMORY", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


class _Backend:
    """A submitit executor plus what the ledger needs to find its jobs again."""

    def __init__(self, cfg: ClusterConfig, folder: Path):
        check_cluster(cfg)
        import submitit

        self.cfg, self.folder, self.submitit = cfg, folder, submitit
        self._squeue: tuple[float, set[str]] | None = None
        if cfg.executor == "local":
            self.ex = submitit.LocalExecutor(folder=folder / "%j")
            self.ex.update_parameters(timeout_min=cfg.timeout_min)
        else:
            self.ex = submitit.SlurmExecutor(folder=folder / "%j")
            self.ex.update_parameters(time=int(cfg.timeout_min), array_parallelism=cfg.jobs_at_once,
                                      **cfg.slurm)

    def submit(self, batch: list[tuple[Task, list[int]]]) -> list[dict[str, Any]]:
        """Submit ``(task, gpu indices)`` pairs; returns one ledger entry per task."""
        from archsearch.cluster._job import JobCall

        entries = []
        if self.cfg.executor == "slurm":
            gpus = max(t.gpus for t, _ in batch)
            self.ex.update_parameters(gpus_per_node=gpus or None)
            with self.ex.batch():  # one job array
                jobs = [self.ex.submit(JobCall(t.fn, *t.args)) for t, _ in batch]
            for job in jobs:
                entries.append({"job_id": job.job_id, "submitted": time.time()})
            return entries
        import psutil

        for task, gpus in batch:
            self.ex.update_parameters(gpus_per_node=len(gpus), visible_gpus=tuple(gpus))
            job = self.ex.submit(JobCall(task.fn, *task.args))
            entries.append({"job_id": job.job_id, "gpus": gpus, "submitted": time.time(),
                            "started": psutil.Process(int(job.job_id)).create_time()})
        return entries

    def _queued(self) -> set[str] | None:
        """Ids of this user's Slurm jobs (array tasks one by one) queued or running, from one
        ``squeue`` call per poll (not one per job); None where squeue fails."""
        now = time.time()
        if self._squeue is not None and now - self._squeue[0] < self.cfg.poll_s / 2:
            return self._squeue[1]
        r = subprocess.run(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i %T"],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            return None
        ids = {f[0] for f in (line.split() for line in r.stdout.splitlines()) if len(f) == 2 and f[1] not in SLURM_ENDED}
        self._squeue = (now, ids)
        return ids

    def alive(self, entry: dict[str, Any]) -> bool:
        """Is this submission still queued or running (in this or an earlier coordinator)?"""
        if self.cfg.executor == "slurm":
            job = self.submitit.SlurmJob(self.folder / "%j", entry["job_id"])
            if job.paths.result_pickle.exists():
                return False
            # squeue, not sacct: a cluster without accounting storage (slurmdbd) has no sacct,
            # and submitit would then never see a job that died without its result as ended
            queued = self._queued()
            return entry["job_id"] in queued if queued is not None else not job.done(force_check=True)
        import psutil

        try:
            p = psutil.Process(int(entry["job_id"]))
            if abs(p.create_time() - entry["started"]) > 1e-3:  # the pid was reused
                return False
            if p.status() == psutil.STATUS_ZOMBIE:
                p.wait(timeout=0) if p.ppid() == os.getpid() else None
                return False
            return True
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            return False

    def reason(self, entry: dict[str, Any]) -> str:
        """The last lines of the job's stderr: why it ended without its result."""
        paths = self.submitit.core.utils.JobPaths(self.folder / "%j", entry["job_id"], 0)
        try:
            lines = paths.stderr.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"job {entry['job_id']} ended without its result and left no stderr"
        tail = [x for x in lines if x.strip()][-3:]
        return f"job {entry['job_id']}: " + " | ".join(tail)


def run_tasks(tasks: list[Task], cfg: ClusterConfig, folder: Path,
              log: Callable[[str], None] | None = None) -> dict[str, TaskResult]:
    """Run every task not yet done on ``cfg``'s executor and wait for all; see the module docstring.
    ``log``: where the progress lines go (default: the ``archsearch.cluster`` logger)."""
    if log is None:
        log = get_logger("cluster").info
    keys = [t.key for t in tasks]
    if len(set(keys)) != len(keys):
        raise ValueError(f"task keys repeat: {keys}")
    if cfg.executor == "inline":
        return _run_inline(tasks, cfg, log)
    folder = Path(folder)
    backend = _Backend(cfg, folder)
    gpus = visible_gpus() if cfg.executor == "local" else []
    ledger = Ledger(folder / "ledger.json")
    results: dict[str, TaskResult] = {}
    running: dict[str, dict[str, Any]] = {}
    waiting: list[Task] = []
    for t in tasks:
        past = ledger.attempts(t.key)
        if t.is_done():
            results[t.key] = TaskResult(t.key, "ok", len(past))
        elif past and backend.alive(past[-1]):
            running[t.key] = past[-1]
            log(f"[cluster] {t.key}: job {past[-1]['job_id']} still running from an earlier coordinator")
        elif len(past) > cfg.max_retries:  # the limit holds over every coordinator run
            results[t.key] = TaskResult(t.key, "failed", len(past), backend.reason(past[-1]))
        else:
            waiting.append(t)
    by_key = {t.key: t for t in tasks}
    while waiting or running:
        for key, entry in list(running.items()):
            if backend.alive(entry):
                continue
            del running[key]
            n = len(ledger.attempts(key))
            if by_key[key].is_done():
                results[key] = TaskResult(key, "ok", n, submitted=entry.get("submitted"), ended=time.time())
                log(f"[cluster] {key}: done (job {entry['job_id']})")
            elif n > cfg.max_retries:
                results[key] = TaskResult(key, "failed", n, backend.reason(entry))
                log(f"[cluster] {key}: failed after {n} attempt(s): {results[key].reason}")
            else:
                log(f"[cluster] {key}: job {entry['job_id']} ended without its result; retrying "
                    f"({backend.reason(entry)})")
                waiting.append(by_key[key])
        busy = [g for e in running.values() for g in e.get("gpus", [])]
        free = [g for g in gpus if g not in busy]
        batch = []
        while waiting and (cfg.executor == "slurm" or len(running) + len(batch) < cfg.jobs_at_once):
            t = waiting[0]
            if cfg.executor == "slurm":  # Slurm allocates each job its GPUs (gpus_per_node)
                batch.append((waiting.pop(0), []))
                continue
            if t.gpus > len(free):
                break
            batch.append((waiting.pop(0), free[:t.gpus]))
            free = free[t.gpus:]
        if batch:
            submitted = [(t.key, entry) for (t, _), entry in zip(batch, backend.submit(batch))]
            ledger.add(submitted)
            for (t, _), (_, entry) in zip(batch, submitted):
                running[t.key] = entry
                log(f"[cluster] {t.key}: submitted as job {entry['job_id']}"
                    f"{' on GPUs ' + str(entry['gpus']) if entry.get('gpus') else ''}")
        if running:
            time.sleep(cfg.poll_s)
    return {k: results[k] for k in keys}


def _run_inline(tasks: list[Task], cfg: ClusterConfig, log: Callable[[str], None]) -> dict[str, TaskResult]:
    """This process, one task after another (an exception is the failed attempt's reason)."""
    results = {}
    for t in tasks:
        attempts, reason = 0, None
        while not t.is_done() and attempts <= cfg.max_retries:
            attempts += 1
            try:
                t.fn(*t.args)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - the task's output decides; this is the reason
                reason = f"{type(e).__name__}: {e}"
                log(f"[cluster] {t.key}: attempt {attempts} failed: {reason}")
        results[t.key] = TaskResult(t.key, "ok" if t.is_done() else "failed", attempts,
                                    None if t.is_done() else reason)
    return results

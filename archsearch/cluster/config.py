"""Where a study's jobs run: one typed config, importable without submitit."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archsearch.bounds import check_count
from archsearch.cluster.startup import load_profile
from archsearch.errors import ArchsearchError

EXECUTORS = ("inline", "local", "slurm")


@dataclass(frozen=True)
class ClusterConfig:
    """``executor``: ``inline`` (this process, one run after another), ``local`` (submitit's
    local executor: ``jobs_at_once`` jobs side by side on this machine, each on its own
    ``gpus_per_job`` of the visible GPUs) or ``slurm`` (submitit job arrays, at most
    ``jobs_at_once`` running, requeued on preemption; ``slurm`` holds submitit's ``slurm_*``
    parameters without the prefix, e.g. ``{partition: gpu, account: me}``).

    A proxy run with ``gpus_per_job > 1`` trains through ``accelerate launch`` inside its job.
    ``measure_workers`` Optuna workers (one engine each, sharing the study's storage) run the
    search stage as jobs. A job that ends without its result is submitted again up to
    ``max_retries`` times. ``profile``: a machine profile of measured start-ups (jobs, engine
    processes, engines; ``archsearch profile``) that ``--dry-run`` prices the plan with."""

    executor: str = "inline"
    jobs_at_once: int = 1
    gpus_per_job: int = 0
    measure_workers: int = 1
    max_retries: int = 2
    poll_s: float = 5.0
    timeout_min: float = 24 * 60.0
    slurm: dict[str, Any] = field(default_factory=dict)
    profile: str | None = None

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ArchsearchError("cluster.executor", f"unknown executor {self.executor!r}",
                                  f"use one of {list(EXECUTORS)}")
        for name in ("jobs_at_once", "measure_workers"):
            if getattr(self, name) < 1:
                raise ArchsearchError(f"cluster.{name}", f"must be >= 1, got {getattr(self, name)}")
            check_count(f"cluster.{name}", getattr(self, name), "jobs")
        if self.gpus_per_job < 0:
            raise ArchsearchError("cluster.gpus_per_job", f"must be >= 0, got {self.gpus_per_job}")
        if self.max_retries < 0:
            raise ArchsearchError("cluster.max_retries", f"must be >= 0, got {self.max_retries}")
        if not self.poll_s > 0:
            raise ArchsearchError("cluster.poll_s", f"must be positive, got {self.poll_s}")
        if not self.timeout_min > 0:
            raise ArchsearchError("cluster.timeout_min", f"must be positive, got {self.timeout_min}")
        if self.executor == "inline" and (self.jobs_at_once > 1 or self.measure_workers > 1):
            raise ArchsearchError("cluster.executor", "inline runs one job at a time, but jobs_at_once/"
                                  "measure_workers ask for more", "use executor: local or slurm")
        if self.profile is not None:  # read now: a broken profile must not wait for a dry run
            load_profile(Path(self.profile).expanduser())
        if self.slurm and self.executor != "slurm":
            raise ArchsearchError("cluster.slurm", f"is set but executor is {self.executor!r}",
                                  "set executor: slurm, or drop the slurm section")

    @property
    def parallel(self) -> bool:
        return self.executor != "inline"

"""Scale-out: proxy runs and measurement workers as jobs on an existing scheduler.

The engine is `submitit <https://github.com/facebookincubator/submitit>`_: Slurm jobs (with
requeue on preemption) on a cluster, its local executor (one job per visible GPU) on one
machine, or ``inline`` (in this process, one after another; the default). See
``docs/cluster.md``.
"""

from __future__ import annotations

from archsearch._lazy import lazy_getattr

__all__ = ["ClusterConfig", "Task", "run_tasks"]

__getattr__ = lazy_getattr(__name__, {"ClusterConfig": "archsearch.cluster.config",
                                      "Task": "archsearch.cluster.executor",
                                      "run_tasks": "archsearch.cluster.executor"})

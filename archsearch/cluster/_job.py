"""The callable a job runs (imports submitit: loaded only by the local and Slurm executors)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import submitit


class JobCall(submitit.helpers.Checkpointable):
    """``fn(*args)``; on preemption or time-out submitit requeues the same call (Checkpointable),
    and the work resumes from what it wrote (a training run resumes from its checkpoint)."""

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self.fn, self.args = fn, args

    def __call__(self) -> Any:
        return self.fn(*self.args)

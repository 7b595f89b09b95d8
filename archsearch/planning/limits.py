"""The study's optional serving limits: TTFT, TPOT and peak memory at a batch size.

A candidate whose measurement at a batch size breaks a limit is infeasible; the reason names
the limit, the measured value and the batch size, and goes into the trial. A limit that is set
but whose quantity was not measured makes the candidate infeasible too (it cannot be shown to
hold), never silently feasible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from archsearch.errors import ArchsearchError

# Limit field -> (key in BatchResult / its to_dict(), unit, scale from measured unit to limit unit)
_CHECKS = (
    ("max_ttft_s", "ttft_mean", "s", 1.0),
    ("max_tpot_s", "tpot_mean", "s", 1.0),
    ("max_peak_memory_gib", "peak_memory_bytes", "GiB", 1.0 / 2**30),
)


@dataclass(frozen=True)
class Limits:
    """Upper limits a candidate's measurements must respect; None means no limit."""

    max_ttft_s: float | None = None
    max_tpot_s: float | None = None
    max_peak_memory_gib: float | None = None

    def __post_init__(self) -> None:
        for name, *_ in _CHECKS:
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ArchsearchError(f"limits.{name}", f"must be a positive number or null, got {v!r}")

    @property
    def active(self) -> bool:
        return any(getattr(self, name) is not None for name, *_ in _CHECKS)

    def to_dict(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name, *_ in _CHECKS}


def _field(result: Any, key: str) -> Any:
    return result.get(key) if isinstance(result, Mapping) else getattr(result, key, None)


def _measured(result: Any, key: str) -> float | None:
    v = _field(result, key)
    return None if v is None else float(v)


def check_limits(limits: Limits, result: Any, batch_size: int | None = None) -> tuple[bool, str]:
    """(feasible, reason) for one batch size's measurement.

    ``result`` is a BatchResult or its ``to_dict()``: anything with ``ttft_mean`` (s),
    ``tpot_mean`` (s) and ``peak_memory_bytes``. ``batch_size`` defaults to the result's
    ``batch_size`` and is named in the reason. A result with ``ok`` false (the engine failed at
    that batch size, e.g. out of memory) is infeasible whenever a limit is set.
    """
    if batch_size is None:
        batch_size = _measured(result, "batch_size")
    at = f" at batch size {int(batch_size)}" if batch_size is not None else ""
    if limits.active and _field(result, "ok") is False:
        return False, f"measurement failed{at}: {_field(result, 'error') or 'no error recorded'}"
    broken = []
    for name, key, unit, scale in _CHECKS:
        limit = getattr(limits, name)
        if limit is None:
            continue
        value = _measured(result, key)
        if value is None or not math.isfinite(value):
            broken.append(f"{name}={limit:g} {unit} is set but {key} was not measured{at}")
        elif value * scale > limit:
            broken.append(f"{name}={limit:g} {unit} exceeded: {key}={value * scale:.4g} {unit}{at}")
    if broken:
        return False, "; ".join(broken)
    return True, ("within limits" + at) if limits.active else "no limits set"

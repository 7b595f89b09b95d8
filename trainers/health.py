"""Proxy health: scaling-law-guided retuning of a sweep's runs. This is the project's form of
the training-time paper's Scaling Laws Smart Tuning (SLST; Wang et al., MLArchSys 2025: "an
intelligent tuning algorithm ... for efficient sample data collection"), compared with grid
search as that paper's Table II does by ``bench_proxy_health`` (docs/planning.md, docs/training.md).

A proxy sweep feeds a scaling-law fit only if its losses behave like one:

* **curve**: each run's held-out loss falls as tokens grow, checked at every evaluation
  checkpoint along its curve (a later checkpoint may not exceed an earlier one by more than
  the tolerance);
* **size**: at matched tokens, a larger model beats the smaller one of the same shape family
  (same requested d/sqrt(N), r and seed, one N level down): the larger run's curve, read at
  the token count where the smaller run ended (linear in log tokens between checkpoints),
  may not exceed the smaller run's final loss by more than the tolerance.

A run that breaks either is retrained with adjusted hyper-parameters, one change per attempt:
halve the global batch down to the level's ``min_batch``, else double the learning rate up
to the level's ``max_lr``; at most ``retries`` attempts. Each attempt trains in its own
folder (``<run_id>.retune<k>``: resumable, the original kept) and is recorded with its reason
in ``health.jsonl``. A run still unhealthy when the budget or the bounds run out is marked
non-compliant: its row in ``runs.csv`` gets status ``failed`` (so no law fit uses it) with
the reason; ``sweep.json`` counts compliant, retuned and non-compliant runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from archsearch.trainers.config import HealthConfig, TrainConfig


def _curve(rec: dict) -> list[tuple[float, float]]:
    """(tokens, eval loss) at every checkpoint of a finished run."""
    per_step = rec["tokens"] / rec["steps"]
    return [(e["step"] * per_step, e["eval_loss"]) for e in rec.get("eval_history", [])
            if e.get("eval_loss") is not None]


def curve_violation(rec: dict, tolerance: float) -> str | None:
    """Why the run's loss does not fall with tokens, or None."""
    pts = _curve(rec)
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if l1 > l0 + tolerance:
            return (f"curve: eval loss rose from {l0:.4f} at {t0:,.0f} tokens to {l1:.4f} at "
                    f"{t1:,.0f} tokens (tolerance {tolerance})")
    return None


def loss_at_tokens(rec: dict, tokens: float) -> float | None:
    """The run's eval loss at ``tokens`` (linear in log tokens between checkpoints); None
    outside the curve."""
    pts = _curve(rec)
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return l0 + w * (l1 - l0)
    return pts[-1][1] if pts and math.isclose(pts[-1][0], tokens) else None


def size_violation(smaller: dict, larger: dict, tolerance: float) -> str | None:
    """Why ``larger`` does not beat ``smaller`` at matched tokens, or None."""
    t = smaller["tokens"]
    big = loss_at_tokens(larger, t)
    if big is None:  # the larger run never reached the smaller one's budget: compare at its end
        t = larger["tokens"]
        small = loss_at_tokens(smaller, t)
        big = larger["final_eval_loss"]
    else:
        small = smaller["final_eval_loss"]
    if small is not None and big is not None and big > small + tolerance:
        return (f"size: N={larger['n_params_non_embedding']:.4g} reached {big:.4f} at {t:,.0f} tokens, "
                f"the smaller N={smaller['n_params_non_embedding']:.4g} {small:.4f} (tolerance {tolerance})")
    return None


def family_key(point: dict) -> tuple:
    """Runs of one shape family differ only in N level."""
    return (point["hidden_over_sqrt_n"], point["mlp_to_attn"], point["seed"])


def retune(tc: TrainConfig, cfg: HealthConfig, level: int) -> tuple[TrainConfig, str] | None:
    """The next hyper-parameters to try, or None when both bounds are reached."""
    floor = cfg.bound("min_batch", level)
    if tc.global_batch_size // 2 >= floor:
        new = tc.global_batch_size // 2
        mbs = tc.micro_batch_size if tc.micro_batch_size and new % tc.micro_batch_size == 0 else None
        return tc.replace(global_batch_size=new, micro_batch_size=mbs), f"global batch {tc.global_batch_size} -> {new}"
    ceiling = cfg.bound("max_lr", level)
    if tc.lr * 2 <= ceiling * (1 + 1e-9):
        return tc.replace(lr=tc.lr * 2), f"lr {tc.lr:g} -> {tc.lr * 2:g}"
    return None


@dataclass
class HealthMonitor:
    """Checks each finished run of a sweep (in level order) and retrains unhealthy ones."""

    cfg: HealthConfig
    attempts: list[dict[str, Any]] = field(default_factory=list)
    _by_family: dict[tuple, tuple[int, dict]] = field(default_factory=dict)

    def _violation(self, point: dict, rec: dict) -> str | None:
        why = curve_violation(rec, self.cfg.tolerance)
        below = self._by_family.get(family_key(point))
        if why is None and below is not None and below[0] == point["level"] - 1:
            why = size_violation(below[1], rec, self.cfg.tolerance)
        return why

    def check(self, point: dict, tc: TrainConfig, rec: dict,
              retrain: Callable[[TrainConfig, str], dict]) -> dict:
        """The run's final record: ``rec`` when healthy, else the last retrained attempt's, marked
        ``compliant`` False (and status failed) when no attempt within the bounds was healthy.
        ``retrain(train_config, folder_suffix)`` trains one attempt and returns its record."""
        if rec.get("status") != "ok":
            return rec
        why = self._violation(point, rec)
        attempt = 0
        while why is not None:
            nxt = retune(tc, self.cfg, point["level"]) if attempt < self.cfg.retries else None
            entry = {"run_id": rec["run_id"], "attempt": attempt, "reason": why,
                     "global_batch_size": tc.global_batch_size, "lr": tc.lr,
                     "final_eval_loss": rec.get("final_eval_loss")}
            if nxt is None:
                limit = "retry budget" if attempt >= self.cfg.retries else "batch floor and LR ceiling"
                self.attempts.append({**entry, "action": f"none: {limit} reached; marked non-compliant"})
                rec = {**rec, "status": "failed", "compliant": False, "retune_attempts": attempt,
                       "reason": f"non-compliant after {attempt} retune(s): {why}"}
                break
            tc, change = nxt
            self.attempts.append({**entry, "action": f"retrain: {change}"})
            attempt += 1
            rec = retrain(tc, f"retune{attempt}")
            if rec.get("status") != "ok":
                break
            why = self._violation(point, rec)
        else:
            rec = {**rec, "compliant": True, "retune_attempts": attempt}
        if rec.get("status") == "ok":
            self._by_family[family_key(point)] = (point["level"], rec)
        return rec

    def summary(self, records: list[dict]) -> dict[str, int]:
        done = [r for r in records if "compliant" in r]
        return {"compliant": sum(r["compliant"] for r in done),
                "retuned": sum(r.get("retune_attempts", 0) > 0 for r in done),
                "compliant_after_retune": sum(r["compliant"] and r["retune_attempts"] > 0 for r in done),
                "non_compliant": sum(not r["compliant"] for r in done),
                "retrain_attempts": sum(r.get("retune_attempts", 0) for r in done)}


def proxies_health(proxies_dir) -> dict[str, Any] | None:
    """The proxy-health counts of every sweep under a study's ``proxies/`` folder (each
    ``<sweep>/sweep.json``'s ``health``), summed, with the sweeps named; None when no sweep
    there ran with ``health`` on. For the study's report: how many runs were retuned and how
    many were left out of the law fit as non-compliant."""
    total: dict[str, Any] | None = None
    for p in sorted(Path(proxies_dir).glob("*/sweep.json")):
        try:
            h = json.loads(p.read_text()).get("health")
        except (OSError, ValueError):
            continue
        if not h:
            continue
        total = total or {"sweeps": []}
        total["sweeps"].append(p.parent.name)
        for k, v in h.items():
            total[k] = total.get(k, 0) + v
    return total

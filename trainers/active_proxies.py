"""The active proxy plan's driver: train the runs ``archsearch.laws.acquisition`` proposes.

The pool of candidate runs is every buildable, distinct point of the study's sweeps (their
shapes, token budgets and training settings, exactly as ``run_sweep`` would train them). Each
worker loops: under the plan lock, read the finished runs, fit, decide (initial design, then the
acquisition), claim the proposed runs and log the decision; then train them through
``archsearch.trainers.loop.train`` (same run folders and ids as a sweep, so a killed run resumes from its
checkpoint). A claim is an ``flock`` held while training: when a worker dies the OS drops it,
and the run is proposed again. Runs in flight are conditioned on by the acquisition, so several
workers propose different runs.

Outputs in ``out_dir``: ``runs/<run_id>/`` (as a sweep), ``runs.csv``, ``decisions.jsonl``
(``fit``, ``propose`` and ``stop`` events: each with its reason and the optimum's interval),
``plan.json`` (the pool and the settings).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from archsearch.configio import to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import append_line, read_jsonl_lines, write_json
from archsearch.logs import get_logger
from archsearch.rundata import RunRecord, write_runs
from archsearch.trainers.loop import RUN_FILE, read_record, run_id_for, token_budget, train
from archsearch.trainers.sweep import failed_record, sweep_specs, to_run_record

DECISIONS = "decisions.jsonl"


class _Claims:
    """Per-run ``flock`` claims under ``out/claims/``: held while a run trains."""

    def __init__(self, out: Path):
        self.dir = out / "claims"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.held: dict[str, FileLock] = {}

    def _path(self, run_id: str) -> Path:
        return self.dir / f"{run_id}.lock"

    def _lock(self, run_id: str) -> FileLock:
        # a try-lock (timeout 0 raises Timeout when held); not thread-local: a claim taken on one
        # thread may be released on another
        return FileLock(self._path(run_id), timeout=0, thread_local=False, fallback_to_soft=False)

    def in_flight(self, run_id: str) -> bool:
        """Held by a live worker (this one included)."""
        if run_id in self.held:
            return True
        if not self._path(run_id).exists():
            return False
        probe = self._lock(run_id)
        try:
            probe.acquire()
        except Timeout:
            return True
        probe.release()
        return False

    def abandoned(self, run_id: str) -> bool:
        """Claimed once by a worker that is gone (the claim file is there, nobody holds it)."""
        return self._path(run_id).exists() and not self.in_flight(run_id)

    def take(self, run_id: str) -> None:
        lock = self._lock(run_id)
        lock.acquire()
        self._path(run_id).write_text(f"{platform.node()}:{os.getpid()}\n")  # who holds it, for a reader
        self.held[run_id] = lock

    def release(self, run_id: str) -> None:
        self.held.pop(run_id).release()


def build_pool(sweeps: list, vocab_size: int) -> list[dict[str, Any]]:
    """Every buildable, distinct point of the sweeps: point, spec, train config, tokens, run id,
    size level (index of its N among all the sweeps' N values)."""
    sizes = sorted({float(n) for s in sweeps for n in s.params})
    out, seen = [], set()
    for sweep in sweeps:
        for point, spec, _err in sweep_specs(sweep, vocab_size):
            if spec is None:
                continue
            tc = sweep.train_for(point["level"]).replace(seed=point["seed"])
            tokens = token_budget(spec, tc)
            run_id = run_id_for(spec, tokens, point["seed"])
            if run_id in seen:
                continue
            seen.add(run_id)
            out.append({"point": point, "spec": spec, "train": tc, "data": sweep.data, "tokens": tokens,
                        "run_id": run_id, "level": sizes.index(float(point["params"]))})
    if not out:
        raise ArchsearchError("proxy.sweep", "no point of the sweeps builds", "widen the box or change the sizes")
    return out


def _append(path: Path, rec: dict) -> None:
    append_line(path, json.dumps(rec, default=str))


def run_active(sweeps: list, law: str, fit_options, cfg, out_dir: str | Path, *,
               anchor_params: list[float] = (), progress: bool = True) -> list[RunRecord]:
    """Run (or resume, or join as another worker) the active plan; returns the finished runs'
    rows (also in ``runs.csv``). ``cfg``: ``archsearch.search.config.ActiveProxyConfig``;
    ``fit_options``: the study's ``FitOptions`` (the loop refits with ``cfg.bootstrap``);
    ``anchor_params``: sizes whose box centre joins the initial design (the nearest level)."""
    import dataclasses

    from archsearch.laws.acquisition import Pool, propose  # numpy: imported where the plan runs
    from archsearch.trainers.data import prepare_data

    datas = {json.dumps(dataclasses.asdict(s.data), sort_keys=True, default=str) for s in sweeps}
    if len(datas) != 1:
        raise ArchsearchError("proxy.sweeps", "the active plan trains one pool on one data set, and the "
                              "sweeps' data sections differ", "give every sweep the same data section")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = (lambda m: get_logger("train").info(f"[active] {m}")) if progress else (lambda m: None)
    pre = build_pool(sweeps, 32000)   # N, hence the token budgets, do not depend on the vocabulary
    data = prepare_data(sweeps[0].data, min_train_tokens=int(max(e["tokens"] for e in pre)) + 1)
    pool_entries = build_pool(sweeps, data.vocab_size)
    pool = Pool.of([e["spec"] for e in pool_entries], [e["tokens"] for e in pool_entries],
                   [e["level"] for e in pool_entries])
    loop_opts = dataclasses.replace(fit_options, bootstrap=cfg.bootstrap, n_starts=min(fit_options.n_starts, 3))
    sizes = sorted({float(n) for s in sweeps for n in s.params})
    anchors = sorted({min(range(len(sizes)), key=lambda i: abs(math.log(sizes[i] / a))) for a in anchor_params})
    claims = _Claims(out)
    decisions = out / DECISIONS
    lock = out / ".plan.lock"
    worker = f"{platform.node()}:{os.getpid()}"

    with FileLock(lock, fallback_to_soft=False):
        if not (out / "plan.json").is_file():
            write_json(out / "plan.json", {"settings": to_dict(cfg), "law": law, "pool": [
                {"run_id": e["run_id"], "params": float(pool.X["N"][i]), "tokens": e["tokens"],
                 "hidden_over_sqrt_n": float(pool.X["x1"][i]), "mlp_to_attn_ratio": float(pool.X["x2"][i]),
                 "flops": float(pool.flops[i]), "level": e["level"]} for i, e in enumerate(pool_entries)]},
                       default=str)

    def records():
        return {i: read_record(out / "runs" / e["run_id"]) for i, e in enumerate(pool_entries)}

    while True:
        mine: list[int] = []
        with FileLock(lock, fallback_to_soft=False):
            recs = records()
            observed = {i: float(r["final_eval_loss"]) for i, r in recs.items() if r and r.get("status") == "ok"}
            failed = [i for i, r in recs.items() if r and r.get("status") == "failed"]
            pending = [i for i, e in enumerate(pool_entries)
                       if i not in observed and i not in failed and claims.in_flight(e["run_id"])]
            spent = float(sum(pool.flops[i] for i in [*observed, *failed, *pending]))
            left = math.inf if cfg.budget_flops is None else cfg.budget_flops - spent
            prop = propose(pool, observed, pending, law, loop_opts, k=cfg.batch_size, initial=cfg.initial,
                           noise_floor=cfg.noise_floor, level=cfg.level, exclude=failed, max_cost=left,
                           anchors=anchors)
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            interval = prop.interval.to_dict() if prop.interval else None
            past = read_jsonl_lines(decisions) if decisions.is_file() else []
            runs_now = sorted(pool_entries[i]["run_id"] for i in observed)
            last_fit = next((e for e in reversed(past) if e.get("event") == "fit"), None)
            if prop.interval is not None and (last_fit is None or last_fit.get("runs") != runs_now):
                _append(decisions, {"event": "fit", "time": now, "worker": worker, "n_runs": len(observed),
                                    "runs": sorted(pool_entries[i]["run_id"] for i in observed),
                                    "flops_spent": float(sum(pool.flops[i] for i in observed)),
                                    "interval": interval, "optimum": prop.optimum, "noise": prop.noise,
                                    "note": prop.note})
            stop = None
            if prop.interval is not None and prop.interval.width <= cfg.tolerance:
                stop = f"the optimum's interval half-width {prop.interval.width:.4f} <= tolerance {cfg.tolerance}"
            elif not prop.picks and not pending:
                untried = len(pool) - len(observed) - len(failed)
                affordable = untried and bool((pool.flops[[i for i in range(len(pool)) if i not in observed
                                                           and i not in failed]] <= left).any())
                stop = ("no remaining candidate narrows the optimum: " + prop.note if affordable and
                        "narrows" in prop.note else
                        f"compute budget: no remaining run fits in the {max(left, 0.0):.3g} FLOPs left of "
                        f"{cfg.budget_flops:.3g}" if cfg.budget_flops is not None and untried
                        else "every candidate run is trained")
            if stop is None:
                for pk in prop.picks:
                    i = pk["index"]
                    if cfg.budget_flops is not None and spent + pool.flops[i] > cfg.budget_flops:
                        break   # the batch together would overrun the budget
                    e = pool_entries[i]
                    again = claims.abandoned(e["run_id"])
                    claims.take(e["run_id"])
                    spent += float(pool.flops[i])
                    mine.append(i)
                    _append(decisions, {
                        "event": "propose", "time": now, "worker": worker, "run_id": e["run_id"],
                        "params": float(pool.X["N"][i]), "tokens": e["tokens"],
                        "hidden_over_sqrt_n": float(pool.X["x1"][i]), "mlp_to_attn_ratio": float(pool.X["x2"][i]),
                        "flops": float(pool.flops[i]), "flops_committed": spent,
                        "reason": pk["reason"] + ("; proposed again: the worker that claimed it is gone"
                                                  if again else ""),
                        **{k: pk[k] for k in ("variance_reduction", "score_per_flop",
                                              "expected_half_width_after") if k in pk},
                        "interval_before": interval})
            elif not pending:
                last = read_jsonl_lines(decisions)
                if not any(e.get("event") == "stop" and e.get("n_runs") == len(observed) for e in last):
                    _append(decisions, {"event": "stop", "time": now, "worker": worker, "reason": stop,
                                        "n_runs": len(observed), "flops_spent": spent, "interval": interval,
                                        "optimum": prop.optimum})
                log(f"stop: {stop}")
                break
        if not mine:
            time.sleep(2)   # others are training: their results decide what comes next
            continue
        for i in mine:
            e = pool_entries[i]
            run_dir = out / "runs" / e["run_id"]
            log(f"train {e['run_id']} (N={pool.X['N'][i]:.3g}, d/sqrtN={pool.X['x1'][i]:.3g}, "
                f"r={pool.X['x2'][i]:.3g})")
            try:
                train(e["spec"], e["train"], e["data"], run_dir, progress=progress, data=data)
            except KeyboardInterrupt:
                raise
            except Exception as err:  # one bad run is recorded; the plan goes on without it
                run_dir.mkdir(parents=True, exist_ok=True)
                write_json(run_dir / RUN_FILE, failed_record(e["spec"], e["run_id"], e["tokens"],
                                                              e["point"]["seed"], str(err)), default=str)
            finally:
                claims.release(e["run_id"])
    rows = [to_run_record(r, pool_entries[i]["point"]) for i, r in records().items() if r]
    write_runs(out / "runs.csv", rows)
    return rows

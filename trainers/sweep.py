"""Proxy sweeps: N levels x (d/sqrt(N), r) at fixed layers and GQA, trained one after another.

Every grid point becomes one run folder ``out_dir/runs/<run_id>/`` (the id is stable: shape,
D and seed), so running the same sweep again skips finished runs, resumes a run that was
killed from its last checkpoint, and retries nothing that failed unless ``retry_failed``.
A point whose shape does not build, or whose run fails, is recorded and the sweep goes on.

Outputs in ``out_dir``: ``runs.csv`` (archsearch.rundata format, held-out eval loss,
rewritten after every run), ``failures.jsonl`` (points that did not build, did not train, or
duplicate another point's shape after snapping, with the reason), ``sweep.json`` (the resolved config, provenance and a summary).
On a cluster, run one ``archsearch train`` per point through ``accelerate launch`` instead:
the run folders and the table are the same.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

from archsearch.arch import ArchSpec, non_embedding_params
from archsearch.candidates import build_candidate
from archsearch.configio import to_dict
from archsearch.fileio import atomic_write, write_json
from archsearch.errors import ArchsearchError
from archsearch.logs import get_logger
from archsearch.provenance import provenance
from archsearch.rundata import RunRecord, write_runs
from archsearch.trainers.config import SweepConfig
from archsearch.trainers.data import check_epochs, prepare_data
from archsearch.trainers.health import HealthMonitor
from archsearch.trainers.loop import RUN_FILE, read_record, run_id_for, token_budget, train


def sweep_points(cfg: SweepConfig) -> Iterator[dict[str, Any]]:
    """The grid, in a fixed order: N level, d/sqrt(N), r, seed."""
    seeds = cfg.seeds if cfg.seeds is not None else [cfg.train.seed]
    for level, n in enumerate(cfg.params):
        for x1, r, seed in itertools.product(cfg.hidden_over_sqrt_n, cfg.mlp_to_attn, seeds):
            yield {"params": n, "n_layers": cfg.layers_for(level), "hidden_over_sqrt_n": x1,
                   "mlp_to_attn": r, "gqa": cfg.gqa, "head_dim": cfg.head_dim, "seed": seed,
                   "level": level}


def sweep_specs(cfg: SweepConfig, vocab_size: int) -> list[tuple[dict, ArchSpec | None, str | None]]:
    """(point, spec or None, error or None) for every grid point, shapes built by
    archsearch.candidates.build_candidate with the tokenizer's vocabulary."""
    # proxies are data: a shape whose realised r drifts from the grid's is still trained (and
    # flagged), since the law is fitted on the realised r
    settings = dataclasses.replace(cfg.build, vocab_size=vocab_size, on_r_drift="flag")
    out = []
    for p in sweep_points(cfg):
        try:
            cand = build_candidate(p["params"], p["n_layers"], p["hidden_over_sqrt_n"],
                                   p["mlp_to_attn"], gqa=p["gqa"], head_dim=p["head_dim"],
                                   settings=settings)
            out.append((p, cand.spec, None))
        except ArchsearchError as e:
            out.append((p, None, str(e)))
    return out


def to_run_record(rec: dict, point: dict | None = None) -> RunRecord:
    """A run.json record -> one row of the laws' run table (loss = held-out eval loss)."""
    spec = ArchSpec.from_dict(rec["spec"])
    ok = rec.get("status") == "ok"
    extra = {"smoothed_train_loss": rec.get("smoothed_train_loss"),
             "tokens_per_s": rec.get("tokens_per_s"), "mfu": rec.get("mfu"),
             "reason": rec.get("reason"), "compliant": rec.get("compliant"),
             "retune_attempts": rec.get("retune_attempts")}
    if point:
        extra.update({"requested_params": point["params"],
                      "requested_hidden_over_sqrt_n": point["hidden_over_sqrt_n"],
                      "requested_mlp_to_attn": point["mlp_to_attn"]})
    return RunRecord.from_arch(
        spec, tokens=float(rec.get("tokens") or 0.0),
        loss=float(rec["final_eval_loss"]) if ok else float("nan"),
        loss_kind="eval", seed=rec.get("seed"), run_id=rec.get("run_id"),
        status="ok" if ok else "failed", wall_time_s=rec.get("wall_time_s"),
        n_devices=rec.get("n_devices"), device=rec.get("device"), extra=extra)


def failed_record(spec: ArchSpec, run_id: str, tokens: float, seed: int, reason: str) -> dict:
    """The ``run.json`` of a run that failed: its spec, budget and reason, with provenance."""
    return {"run_id": run_id, "status": "failed", "reason": reason, "spec": spec.to_dict(),
            "n_params_non_embedding": non_embedding_params(spec), "tokens": tokens, "seed": seed,
            "final_eval_loss": None, "provenance": provenance(device=False)}




def train_or_fail(spec: ArchSpec, tc, cfg: SweepConfig, run_dir: Path, data, progress: bool,
                   tokens: float, seed: int) -> dict:
    """Train one run (or resume/skip it); a failure is recorded in its run.json, not raised."""
    try:
        return train(spec, tc, cfg.data, run_dir, progress=progress, data=data)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # record it and go on: one bad point must not stop the sweep
        reason = (str(e) if isinstance(e, ArchsearchError)
                  else f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)}")
        rec = failed_record(spec, run_dir.name, tokens, seed, reason)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / RUN_FILE, rec, default=str)
        return rec


def run_sweep(cfg: SweepConfig, out_dir: str | Path, *, progress: bool = True) -> list[RunRecord]:
    """Train every buildable grid point of ``cfg`` (see the module docstring); returns the rows
    of ``runs.csv`` (ok and failed runs; points that do not build are in failures.jsonl)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # N (non-embedding) does not depend on the vocabulary, so budgets are known before the
    # tokenizer exists; a streamed dataset is read up to the largest of them.
    budgets = [token_budget(s, cfg.train_for(p["level"])) for p, s, _ in sweep_specs(cfg, 32000) if s is not None]
    data = prepare_data(cfg.data, min_train_tokens=int(max(budgets, default=0)) + 1)
    check_epochs(data, max(budgets, default=0), cfg.data.max_epochs, f"sweep {cfg.name}'s largest run")
    specs = sweep_specs(cfg, data.vocab_size)
    t0 = time.perf_counter()
    rows: list[RunRecord] = []
    failures: list[dict] = []
    seen: dict[str, str] = {}
    health = HealthMonitor(cfg.health) if cfg.health is not None else None
    final_records: list[dict] = []
    log = get_logger("train").info if progress else (lambda msg: None)
    for i, (point, spec, err) in enumerate(specs, 1):
        tag = (f"[{i}/{len(specs)}] N={point['params']:.4g} L={point['n_layers']} "
               f"d/sqrtN={point['hidden_over_sqrt_n']:g} r={point['mlp_to_attn']:g} seed={point['seed']}")
        if spec is None:
            failures.append({**point, "stage": "build", "reason": err})
            log(f"{tag}: does not build: {err}")
            continue
        tc = cfg.train_for(point["level"]).replace(seed=point["seed"])
        tokens = token_budget(spec, tc)
        run_id = run_id_for(spec, tokens, point["seed"])
        if run_id in seen:  # snapping mapped two grid points to one shape: train and list it once
            failures.append({**point, "run_id": run_id, "stage": "duplicate",
                             "reason": f"builds the same shape as {seen[run_id]}"})
            log(f"{tag}: same shape as {seen[run_id]} (already in the table)")
            continue
        seen[run_id] = f"point {i}"
        run_dir = out / "runs" / run_id
        prev = read_record(run_dir)
        if prev and prev.get("status") == "failed" and not cfg.retry_failed:
            rec = prev
            log(f"{tag}: {run_id} failed before ({prev.get('reason')}); retry_failed is off")
        else:
            started = time.perf_counter()
            rec = train_or_fail(spec, tc, cfg, run_dir, data, progress, tokens, point["seed"])
            if health is not None:  # retrains a run that breaks the scaling orderings
                rec = health.check(point, tc, rec, lambda tc2, sfx: train_or_fail(
                    spec, tc2, cfg, run_dir.with_name(f"{run_id}.{sfx}"), data, progress, tokens, point["seed"]))
            skipped = prev is not None and prev.get("status") == "ok"
            loss = rec.get("final_eval_loss")
            log(f"{tag}: {run_id} {'skipped (done)' if skipped else rec['status']}"
                f"{f' eval loss {loss:.4f}' if loss is not None else ''}"
                f"{'' if rec['status'] == 'ok' else ' - ' + str(rec.get('reason'))}"
                f" ({time.perf_counter() - started:.1f} s)")
        if rec.get("status") != "ok":
            failures.append({**point, "run_id": run_id, "stage": "train", "reason": rec.get("reason")})
        rows.append(to_run_record(rec, point))
        final_records.append(rec)
        write_runs(out / "runs.csv", rows)  # after every run: a killed sweep leaves a valid table
        if health is not None:
            atomic_write(out / "health.jsonl", "".join(json.dumps(a, default=str) + "\n" for a in health.attempts))
    write_runs(out / "runs.csv", rows)
    atomic_write(out / "failures.jsonl", "".join(json.dumps(f, default=str) + "\n" for f in failures))
    ok = [r for r in rows if r.status == "ok"]
    summary = {"name": cfg.name, "config": to_dict(cfg), "points": len(specs), "runs_ok": len(ok),
               "runs_failed": len(rows) - len(ok), "not_built": sum(s is None for _, s, _ in specs),
               "best": min(ok, key=lambda r: r.loss).run_id if ok else None,
               "health": health.summary(final_records) if health is not None else None,
               "elapsed_s": time.perf_counter() - t0, "data": {k: v for k, v in data.info.items()},
               "provenance": provenance()}
    write_json(out / "sweep.json", summary, default=str)
    log(f"sweep {cfg.name}: {len(ok)} ok, {len(rows) - len(ok)} failed, "
        f"{summary['not_built']} not built -> {out / 'runs.csv'}")
    if health is not None:
        h = summary["health"]
        log(f"proxy health: {h['compliant']} compliant ({h['compliant_after_retune']} after retuning), "
            f"{h['retuned']} retuned, {h['non_compliant']} non-compliant (not fitted) -> {out / 'health.jsonl'}")
    return rows

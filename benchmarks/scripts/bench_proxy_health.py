"""Proxy-health benchmark: trials (trainings) needed to reach a compliant sweep by
scaling-law-guided retuning versus a full learning-rate x batch-size grid, at demo scale on
the real corpus (two N levels, one shape family). The retuning is this project's form of the
training-time paper's scaling-law smart tuning (SLST; Wang et al., MLArchSys 2025), and this is
its Table II comparison with grid search: trainings spent and the final loss each reached (per
N level: the retuned sweep's accepted run; the grid's best run, and its best compliant pairing).

``--start violating`` (the default) starts the sweep where it breaks the size ordering: the
smaller level at a good point of the grid (lr 4.8e-3, batch 4), the larger one at a
too-small learning rate and a too-large batch (lr 3e-4, batch 8), so the larger model ends
above the smaller one and retuning has to act (halve the batch, then double the LR). The
per-level start is sweep config (``health.start_lr`` / ``health.start_batch``, one value per N
level, within the level's bounds). ``--start compliant``: both levels at lr 3e-4, batch 8
(the earlier run, where no retuning was needed).

Retuning: one sweep with ``health`` on; trials = runs + retrain attempts. Grid: every
(lr, batch) of the same bounds trained at every level; trials = grid size x levels, and the
grid counts as reaching a compliant sweep when some choice per level passes every check.
Prints one JSON object; ``--out`` also writes it (with provenance) and keeps the sweeps.

    python -m archsearch.benchmarks.scripts.bench_proxy_health [--out results/proxy-health]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from archsearch.benchmarks.scripts import emit
from archsearch.candidates import BuildSettings
from archsearch.fileio import read_jsonl_lines
from archsearch.provenance import provenance
from archsearch.rundata import read_runs
from archsearch.trainers import run_sweep
from archsearch.trainers.config import DataConfig, HealthConfig, SweepConfig, TrainConfig
from archsearch.trainers.health import curve_violation, size_violation

PARAMS = [3e4, 6e4]
START = {"lr": 3e-4, "global_batch_size": 8}
LRS = [3e-4, 1.2e-3, 4.8e-3]  # the grid spans the retuning bounds: LR up to the ceiling
BATCHES = [8, 4]               # and batch down to the floor
TOKENS = 32 * 8 * 64


VIOLATING = [{"lr": 4.8e-3, "global_batch_size": 4}, {"lr": 3e-4, "global_batch_size": 8}]


def _cfg(name, params, lr, batch, health=None):
    return SweepConfig(name=name, params=params, n_layers=2, hidden_over_sqrt_n=[0.25], mlp_to_attn=[1.0],
                       gqa=2, head_dim=32, build=BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.15),
                       train=TrainConfig(tokens=TOKENS, global_batch_size=batch, lr=lr, eval_batches=4,
                                         eval_interval=8),
                       data=DataConfig(source="shakespeare", tokenizer="bpe:2048", seq_len=64), health=health)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--start", choices=["violating", "compliant"], default="violating")
    ap.add_argument("--retries", type=int, default=6, help="retune attempts per run")
    ap.add_argument("--out")
    args = ap.parse_args()

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="proxy-health-"))
    load0, t0 = os.getloadavg(), time.perf_counter()
    per_level = VIOLATING if args.start == "violating" else None
    start = ({"start_lr": [v["lr"] for v in per_level], "start_batch": [v["global_batch_size"] for v in per_level]}
             if per_level else {})
    hc = HealthConfig(min_batch=min(BATCHES), max_lr=max(LRS), retries=args.retries, tolerance=args.tolerance, **start)
    run_sweep(_cfg("retune", PARAMS, START["lr"], START["global_batch_size"], hc), out / "retune",
              progress=False)
    h = json.loads((out / "retune" / "sweep.json").read_text())["health"]
    accepted = sorted(read_runs(out / "retune" / "runs.csv"), key=lambda r: r.n_params)
    retune = {"trials": len(PARAMS) + h["retrain_attempts"], "compliant_sweep": h["non_compliant"] == 0,
              "final_loss_per_level": [r.loss if r.status == "ok" else None for r in accepted],
              "health": h, "attempts": read_jsonl_lines(out / "retune" / "health.jsonl"),
              "seconds": time.perf_counter() - t0}
    t1 = time.perf_counter()
    grid = {}
    for lr, b in itertools.product(LRS, BATCHES):
        for level, n in enumerate(PARAMS):
            d = out / "grid" / f"lr{lr:g}-b{b}-L{level}"
            run_sweep(_cfg("grid", [n], lr, b), d, progress=False)
            (rec,) = [json.loads(p.read_text()) for p in (d / "runs").glob("*/run.json")]
            grid[(lr, b, level)] = rec
    ok_pairs = [(c0, c1) for c0 in itertools.product(LRS, BATCHES) for c1 in itertools.product(LRS, BATCHES)
                if all(grid[(*c, lv)]["status"] == "ok" and curve_violation(grid[(*c, lv)], args.tolerance) is None
                       for c, lv in ((c0, 0), (c1, 1)))
                and size_violation(grid[(*c0, 0)], grid[(*c1, 1)], args.tolerance) is None]
    loss = {k: grid[k].get("final_eval_loss") for k in grid}
    best_pair = min(ok_pairs, key=lambda cc: loss[(*cc[0], 0)] + loss[(*cc[1], 1)]) if ok_pairs else None
    grid_best = [min(v for (lr, b, lv), v in loss.items() if lv == level and v is not None) for level in range(len(PARAMS))]
    result = {"benchmark": "proxy_health", "levels": PARAMS, "start": per_level or START, "start_kind": args.start,
              "retries": args.retries, "tokens": TOKENS,
              "tolerance": args.tolerance, "retune": retune,
              "grid": {"lrs": LRS, "batches": BATCHES, "trials": len(grid),
                       "compliant_sweep": bool(ok_pairs), "compliant_choices": len(ok_pairs),
                       "best_final_loss_per_level": grid_best,
                       "best_compliant_pairing": None if best_pair is None else {
                           "choices": [{"lr": c[0], "global_batch_size": c[1]} for c in best_pair],
                           "final_loss_per_level": [loss[(*best_pair[0], 0)], loss[(*best_pair[1], 1)]]},
                       "losses": {f"lr{k[0]:g}-b{k[1]}-L{k[2]}": v.get("final_eval_loss") for k, v in grid.items()},
                       "seconds": time.perf_counter() - t1},
              "load_avg_before": load0, "load_avg_after": os.getloadavg(), "provenance": provenance()}
    print(f"SLST (retuning) vs grid search, {len(PARAMS)} N levels: trainings {retune['trials']} vs {len(grid)}; "
          f"final loss per level {_fmt(retune['final_loss_per_level'])} vs the grid's best {_fmt(grid_best)}"
          + (f" (best compliant pairing {_fmt(result['grid']['best_compliant_pairing']['final_loss_per_level'])})"
             if best_pair else ""), file=sys.stderr)
    return emit(result, out if args.out else None)


def _fmt(losses) -> str:
    return "/".join("-" if v is None else f"{v:.3f}" for v in losses)


if __name__ == "__main__":
    sys.exit(main())

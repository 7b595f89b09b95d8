"""Benchmark: does the search (Optuna + local GQA search) find what a dense scan of the same box finds?

For a study measured with the analytic backend (the paper rehearsals), every shape of the box
is cheap to predict, so the search's answer can be checked against exhaustion:

* the Optuna space: every (d/sqrt(N), r) on the study's knob grid x every GQA of the search space
  (``search_space.gqa: divisors``: every integer GQA the box holds); a seeded published shape
  (``optuna.seed_shapes``) is in neither space, so an answer that is one may exceed the scan's best;
* the GQA search's space: every feasible shape of that grid x every head pair
  (:func:`archsearch.search.gqa.gqa_pairs`) at the same attention share, within the walk's
  bounds (``gqa_search.max_gqa`` / ``min_kv_heads``; a study without proxies cannot check loss).

Both spaces are held to what the study holds its own trials to: the same predictor (its
``measure.calibration`` applied), the law's fitted range (unless ``law.allow_extrapolation``)
and the GQA walk's bounds.

It also reports how far the built shapes' realised r and d/sqrt(N) drift from the knobs over
the grid (the worst drift, and how many knob points the r tolerance refused).

It prints one JSON line (the best feasible shape of each space, the study's Optuna best and its
final answer, and their ratios) and appends it to ``results/bench/rehearsal_scan.jsonl``.

    python -m archsearch.benchmarks.scripts.bench_rehearsal_scan --config configs/paper-1b-rehearsal.yaml
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _grid(lo_hi, step):
    lo, hi = lo_hi
    return np.arange(lo, hi + step / 2, step) if step else np.geomspace(lo, hi, 25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--study", help="the study folder (default: the config's)")
    ap.add_argument("--out", default="results/bench/rehearsal_scan.jsonl")
    args = ap.parse_args()

    from archsearch.errors import ArchsearchError
    from archsearch.hardware import get_device
    from archsearch.laws import load_law
    from archsearch.provenance import provenance
    from archsearch.search.config import load_study_config
    from archsearch.search.gqa import gqa_pairs
    from archsearch.search.resolved import derive
    from archsearch.candidates import build_candidate
    from archsearch.search import margins
    from archsearch.search.constraint import outside_gqa_bounds
    from archsearch.benchmarks.calibration import Calibration
    from archsearch.benchmarks.analytic import predict_batch
    from archsearch.benchmarks.base import append_jsonl, resolve_dtype

    cfg = load_study_config(args.config)
    if cfg.measure.bench.backend != "analytic" or not cfg.law.file:
        raise SystemExit("this check needs a study measured by the analytic backend with a law file")
    t0 = time.perf_counter()
    law = load_law(cfg.law.file)
    study = derive(cfg)
    lt, build = study.target_loss(law), study.build
    device = get_device(cfg.measure.bench.device_spec)
    dtype = resolve_dtype(cfg.measure.bench.dtype, on_gpu=True)
    b, m = cfg.measure.ref_batch, cfg.measure
    cal = Calibration.load(m.calibration) if m.calibration else None

    def evaluate(spec):
        loss = law.predict(spec, cfg.tokens, params=cfg.params)
        tput = predict_batch(spec, device, dtype, b, m.bench.input_len, m.bench.output_len, cal).output_throughput
        return {"spec": spec.to_dict(), "predicted_loss": loss, "throughput": tput}

    def allowed(spec) -> bool:  # what the study refuses unmeasured, the scan refuses too
        return ((cfg.law.allow_extrapolation or margins.outside_range(law, spec) is None)
                and outside_gqa_bounds(study, spec) is None)

    s = cfg.search_space
    box, seen = [], set()
    drift = {"built": 0, "refused_r_drift": 0, "worst_r_drift": 0.0, "worst_hidden_over_sqrt_n_drift": 0.0}
    for x1 in _grid(s.hidden_over_sqrt_n, s.hidden_over_sqrt_n_step):
        for r in _grid(s.mlp_to_attn, s.mlp_to_attn_step):
            for g in cfg.gqa_values:  # the listed GQAs, or every divisor pair's
                try:
                    cand = build_candidate(cfg.params, cfg.n_layers, float(x1), float(r), gqa=g,
                                           head_dim=s.head_dim, settings=build)
                except ArchsearchError as e:
                    drift["refused_r_drift"] += e.field == "mlp_to_attn"
                    continue
                spec = cand.spec
                drift["built"] += 1
                drift["worst_r_drift"] = max(drift["worst_r_drift"], abs(cand.r_drift))
                drift["worst_hidden_over_sqrt_n_drift"] = max(drift["worst_hidden_over_sqrt_n_drift"],
                                                              abs(cand.x1_drift))
                if spec not in seen:
                    seen.add(spec)
                    box.append(spec)
    scored = [evaluate(sp) for sp in box if allowed(sp)]
    feasible = [p for p in scored if p["predicted_loss"] <= lt and p["throughput"] is not None]
    best_box = max(feasible, key=lambda p: p["throughput"])
    from archsearch.arch import ArchSpec

    # the head pairs the GQA search may reach from each feasible shape (allowed: within its bounds)
    with_pairs, seen_pairs = list(feasible), set(seen)
    for p in feasible:
        for v in gqa_pairs(ArchSpec.from_dict(p["spec"]), cfg.params, build).values():
            if v not in seen_pairs and allowed(v):
                seen_pairs.add(v)
                q = evaluate(v)
                if q["predicted_loss"] <= lt and q["throughput"] is not None:
                    with_pairs.append(q)
    best_pairs = max(with_pairs, key=lambda p: p["throughput"])

    study = Path(args.study or cfg.out_dir())
    summary = json.loads((study / "summary.json").read_text())
    optuna_best = max((p["throughput"] for p in summary.get("pareto", [])), default=None)
    chosen = (summary.get("chosen") or {}).get("throughput")
    row = {
        "benchmark": "rehearsal_scan", "config": args.config, "study": str(study),
        "target_loss": lt, "device": device.name, "batch_size": b,
        "calibration": m.calibration or "uncalibrated roofline",
        "input_len": m.bench.input_len, "output_len": m.bench.output_len,
        "knob_grid_drift": drift,
        "dense_box": {"shapes": len(box), "feasible": len(feasible), "best": best_box},
        "dense_box_with_gqa_pairs": {"shapes": len(seen_pairs), "feasible": len(with_pairs), "best": best_pairs},
        "study_optuna_best_throughput": optuna_best,
        "study_chosen_throughput": chosen,
        "optuna_best_over_dense_box": optuna_best / best_box["throughput"] if optuna_best else None,
        "chosen_over_dense_with_pairs": chosen / best_pairs["throughput"] if chosen else None,
        "seconds": round(time.perf_counter() - t0, 1),
        "provenance": provenance(device=False),
    }
    append_jsonl(args.out, row)
    print(json.dumps(row))


if __name__ == "__main__":
    main()

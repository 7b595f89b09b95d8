"""Benchmark: does calibration make the roofline predict held-out shapes?

For each measured backend in a ``bench --out``-style JSONL (default: the data the engines
benchmark measures with ``--grid calibration``: 12 shapes over d/sqrt(N), r and GQA, each at
two batch sizes), fit a calibration (``archsearch.benchmarks.calibration``) on four shapes (all
their batch sizes) and predict the others at every batch size: mean absolute percentage error
and Spearman of predicted vs measured throughput, per batch size and over all, uncalibrated and
calibrated. The four are chosen from the shapes' features alone, never from their throughputs:
``--fit-on d-optimal`` (default) takes the four that maximise det(X'X) of X = [1, log d/sqrt(N),
log r, log GQA], so that no two knobs move together in the fitted set (the corners of the
(d/sqrt(N), r) box, ``--fit-on corners``, pair r = 1 with GQA 1 and r = 5 with GQA 4 in this grid,
so a fit on them cannot tell the MLP ratio's effect from the KV heads'). With ``--results``
given more than once (independent passes over the same grid), every pass's points are fitted,
held-out shapes are scored against the passes' geometric mean, and the Spearman between the
passes themselves is printed: the ceiling any predictor can reach on these data. Appended to
``OUT_DIR/calibration.jsonl`` with provenance.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_engines_cpu --grid calibration \
        --batch-sizes 4,16 --batch-size 16 --backends hf,vllm         # the data, ~20 min on 2 cores
    .venv/bin/python -m archsearch.benchmarks.scripts.bench_calibration

At a study's own measured setting (its box, ``measure.params``, lengths and dtype; ~25 min a pass):

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_engines_cpu --grid calibration \
        --config configs/demo-cpu.yaml --batch-sizes 4,16 --batch-size 4 --backends vllm,hf --out-dir A
    .venv/bin/python -m archsearch.benchmarks.scripts.bench_calibration \
        --results A/calibration_data.jsonl --results B/calibration_data.jsonl --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from archsearch.arch import ArchSpec, hidden_over_sqrt_n, mlp_to_attn_ratio
from archsearch.provenance import provenance
from archsearch.benchmarks import BenchSettings, append_jsonl, measure, read_jsonl
from archsearch.benchmarks.calibration_fit import fit_calibration


def _spec(r):
    return ArchSpec.from_record(r.architecture)


def _predict(results, batch: int, cal_path: str | None, device_spec: str) -> list[float]:
    out = []
    for r in results:
        s = BenchSettings(backend="analytic", batch_sizes=[batch], input_len=r.settings["input_len"],
                          output_len=r.settings["output_len"], dtype=r.dtype or "float32", device_spec=device_spec,
                          engine_args={"calibration": cal_path} if cal_path else {})
        out.append(measure(_spec(r), s).throughput(batch))
    return out


def corners(results) -> list:
    """The results at the four corners of the (d/sqrt(N), r) box: extremes of log x +- log r."""
    import math

    xr = [(math.log(hidden_over_sqrt_n(_spec(r))), math.log(mlp_to_attn_ratio(_spec(r)))) for r in results]
    picks = {min(range(len(xr)), key=lambda i: xr[i][0] + xr[i][1]), max(range(len(xr)), key=lambda i: xr[i][0] + xr[i][1]),
             min(range(len(xr)), key=lambda i: xr[i][0] - xr[i][1]), max(range(len(xr)), key=lambda i: xr[i][0] - xr[i][1])}
    return [results[i] for i in sorted(picks)]


def d_optimal(results, k: int = 4) -> list:
    """The ``k`` results whose features [1, log x, log r, log GQA] have the largest det(X'X)
    (the first such subset in the results' order)."""
    import itertools
    import math

    import numpy as np

    feats = [[1.0, math.log(hidden_over_sqrt_n(_spec(r))), math.log(mlp_to_attn_ratio(_spec(r))),
              math.log(_spec(r).n_heads // _spec(r).n_kv_heads)] for r in results]
    best = max(itertools.combinations(range(len(results)), k),
               key=lambda c: round(float(np.linalg.det(np.array([feats[i] for i in c]).T @ np.array([feats[i] for i in c]))), 9))
    return [results[i] for i in best]


def _metrics(pred: list[float], meas: list[float]) -> dict:
    from scipy.stats import spearmanr

    return {"mape": sum(abs(p / m - 1) for p, m in zip(pred, meas)) / len(meas),
            "spearman": float(spearmanr(pred, meas).statistic) if len(meas) > 2 else None, "n": len(meas)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", action="append",
                    help="bench JSONL of the grid (repeatable: independent passes); default "
                         "results/bench/calibration_data.jsonl")
    ap.add_argument("--fit-on", choices=("d-optimal", "corners"), default="d-optimal")
    ap.add_argument("--device-spec", default="cpu")
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args(argv)
    import math

    sources = args.results or ["results/bench/calibration_data.jsonl"]
    passes = [[r for r in read_jsonl(f) if not r.predicted and r.ok] for f in sources]
    every = passes[0]
    name = lambda r: r.architecture.get("name")  # noqa: E731
    rows = []
    for backend in sorted({r.backend for r in every}):
        rs = [r for r in every if r.backend == backend]
        fit_on = (d_optimal if args.fit_on == "d-optimal" else corners)(rs)
        held = [r for r in rs if r not in fit_on]
        chosen = {name(r) for r in fit_on}
        same = [[r for r in p if r.backend == backend] for p in passes]
        cal = fit_calibration([r for p in same for r in p if name(r) in chosen], args.device_spec)

        def measured(r, b):  # geometric mean over the passes that measured this shape at b
            xs = [q.throughput(b) for p in same for q in p if name(q) == name(r) and q.throughput(b)]
            return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None
        batches = sorted({b.batch_size for r in held for b in r.per_batch if b.ok})
        per_batch, pooled = {}, {"measured": [], "uncalibrated": [], "calibrated": []}
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "cal.json")
            cal.save(path)
            for b in batches:
                on = [r for r in held if measured(r, b)]
                meas = [measured(r, b) for r in on]
                unc, calibrated = _predict(on, b, None, args.device_spec), _predict(on, b, path, args.device_spec)
                ceiling = None
                if len(same) >= 2:  # pass 1 vs pass 2 on the held-out shapes both measured
                    from scipy.stats import spearmanr

                    both = [(r.throughput(b), q.throughput(b)) for r in on for q in same[1]
                            if name(q) == name(r) and r.throughput(b) and q.throughput(b)]
                    if len(both) > 2:
                        ceiling = float(spearmanr(*zip(*both)).statistic)
                per_batch[b] = {"uncalibrated": _metrics(unc, meas), "calibrated": _metrics(calibrated, meas),
                                "spearman_between_passes": ceiling,
                                "held_out": [{"shape": r.architecture.get("name"), "measured": m, "calibrated": p,
                                              "uncalibrated": u} for r, m, p, u in zip(on, meas, calibrated, unc)]}
                for k, v in (("measured", meas), ("uncalibrated", unc), ("calibrated", calibrated)):
                    pooled[k] += v
        row = {"backend": backend, "n_fit": len(fit_on), "n_held_out": len(held), "batch_sizes": batches,
               "fit_on": [r.architecture.get("name") for r in fit_on], "fit_rule": args.fit_on, "passes": len(same),
               "uncalibrated": _metrics(pooled["uncalibrated"], pooled["measured"]),
               "calibrated": _metrics(pooled["calibrated"], pooled["measured"]),
               "per_batch": per_batch,
               "calibration": {k: getattr(cal, k) for k in ("compute_efficiency", "memory_efficiency",
                                                            "step_overhead_s", "seq_overhead_s", "head_overhead_s",
                                                            "kv_head_overhead_s", "combine")}
               | {"fit": cal.fit}}
        rows.append(row)
        print(json.dumps({"backend": backend, "n_fit": len(fit_on), "n_held_out": len(held),
                          "variant": cal.fit.get("variant"), "pooled": {k: row[k] for k in ("uncalibrated", "calibrated")},
                          "fit_on": row["fit_on"],
                          "per_batch": {b: {k: v[k] for k in ("uncalibrated", "calibrated", "spearman_between_passes")}
                                        for b, v in per_batch.items()}}))
    append_jsonl(Path(args.out_dir) / "calibration.jsonl", {
        "benchmark": "roofline_calibration_held_out", "results": sources, "rows": rows,
        "command": " ".join([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_calibration", *(argv or sys.argv[1:])]),
        "load_average_1_5_15min": list(os.getloadavg()), "provenance": provenance(device=False)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

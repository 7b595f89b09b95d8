"""Benchmark: does calibration make the roofline predict held-out shapes?

For each measured backend in a ``bench --out``-style JSONL (default: the data the engines
benchmark measures with ``--grid calibration``: 12 shapes over d/sqrt(N), r and GQA, each at
two batch sizes), fit a calibration (``archsearch.benchmarks.calibration``) on the four corner
shapes of the (d/sqrt(N), r) box (all their batch sizes) and predict the others at every batch
size: mean absolute percentage error and Spearman of predicted vs measured throughput, per
batch size and over all, uncalibrated and calibrated. Appended to ``OUT_DIR/calibration.jsonl``
with provenance.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_engines_cpu --grid calibration \
        --batch-sizes 4,16 --batch-size 16 --backends hf,vllm         # the data, ~20 min on 2 cores
    .venv/bin/python -m archsearch.benchmarks.scripts.bench_calibration
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from archsearch.provenance import provenance
from archsearch.benchmarks import append_jsonl, read_jsonl


def _spec(r):
    from archsearch.arch import ArchSpec

    return ArchSpec.from_dict({k: v for k, v in r.architecture.items() if k in ArchSpec.__dataclass_fields__})


def _predict(results, batch: int, cal_path: str | None, device_spec: str) -> list[float]:
    from archsearch.benchmarks import BenchSettings, measure

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

    from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio

    xr = [(math.log(hidden_over_sqrt_n(_spec(r))), math.log(mlp_to_attn_ratio(_spec(r)))) for r in results]
    picks = {min(range(len(xr)), key=lambda i: xr[i][0] + xr[i][1]), max(range(len(xr)), key=lambda i: xr[i][0] + xr[i][1]),
             min(range(len(xr)), key=lambda i: xr[i][0] - xr[i][1]), max(range(len(xr)), key=lambda i: xr[i][0] - xr[i][1])}
    return [results[i] for i in sorted(picks)]


def _metrics(pred: list[float], meas: list[float]) -> dict:
    from scipy.stats import spearmanr

    return {"mape": sum(abs(p / m - 1) for p, m in zip(pred, meas)) / len(meas),
            "spearman": float(spearmanr(pred, meas).statistic) if len(meas) > 2 else None, "n": len(meas)}


def main(argv: list[str] | None = None) -> int:
    from archsearch.benchmarks.calibration import fit_calibration

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="results/bench/calibration_data.jsonl")
    ap.add_argument("--device-spec", default="cpu")
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args(argv)
    every = [r for r in read_jsonl(args.results) if not r.predicted and r.ok]
    rows = []
    for backend in sorted({r.backend for r in every}):
        rs = [r for r in every if r.backend == backend]
        fit_on = corners(rs)
        held = [r for r in rs if r not in fit_on]
        cal = fit_calibration(fit_on, args.device_spec)
        batches = sorted({b.batch_size for r in held for b in r.per_batch if b.ok})
        per_batch, pooled = {}, {"measured": [], "uncalibrated": [], "calibrated": []}
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "cal.json")
            cal.save(path)
            for b in batches:
                on = [r for r in held if r.throughput(b)]
                meas = [r.throughput(b) for r in on]
                unc, calibrated = _predict(on, b, None, args.device_spec), _predict(on, b, path, args.device_spec)
                per_batch[b] = {"uncalibrated": _metrics(unc, meas), "calibrated": _metrics(calibrated, meas),
                                "held_out": [{"shape": r.architecture.get("name"), "measured": m, "calibrated": p,
                                              "uncalibrated": u} for r, m, p, u in zip(on, meas, calibrated, unc)]}
                for k, v in (("measured", meas), ("uncalibrated", unc), ("calibrated", calibrated)):
                    pooled[k] += v
        row = {"backend": backend, "n_fit": len(fit_on), "n_held_out": len(held), "batch_sizes": batches,
               "fit_on": [r.architecture.get("name") for r in fit_on],
               "uncalibrated": _metrics(pooled["uncalibrated"], pooled["measured"]),
               "calibrated": _metrics(pooled["calibrated"], pooled["measured"]),
               "per_batch": per_batch,
               "calibration": {k: getattr(cal, k) for k in ("compute_efficiency", "memory_efficiency",
                                                            "step_overhead_s", "seq_overhead_s", "combine")}
               | {"fit": cal.fit}}
        rows.append(row)
        print(json.dumps({"backend": backend, "n_fit": len(fit_on), "n_held_out": len(held),
                          "variant": cal.fit.get("variant"), "pooled": {k: row[k] for k in ("uncalibrated", "calibrated")},
                          "per_batch": {b: {k: v[k] for k in ("uncalibrated", "calibrated")}
                                        for b, v in per_batch.items()}}))
    append_jsonl(Path(args.out_dir) / "calibration.jsonl", {
        "benchmark": "roofline_calibration_held_out", "results": args.results, "rows": rows,
        "command": " ".join([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_calibration", *(argv or sys.argv[1:])]),
        "load_average_1_5_15min": list(os.getloadavg()), "provenance": provenance(device=False)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

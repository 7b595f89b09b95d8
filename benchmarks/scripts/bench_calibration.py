"""Benchmark: does calibration make the roofline predict held-out shapes?

For each measured backend in a ``bench --out``-style JSONL (default: the engines benchmark's
``results/bench/engines_cpu.jsonl``), fit a calibration (``archsearch.benchmarks.calibration``) on
``--n-fit`` shapes spread over the file's order and predict the others: mean absolute
percentage error and Spearman of predicted vs measured throughput, uncalibrated and
calibrated. Appended to ``OUT_DIR/calibration.jsonl`` with provenance.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_calibration [--results FILE.jsonl] [--n-fit 4]
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


def _predict(results, cal_path: str | None, device_spec: str) -> list[float]:
    from archsearch.arch import ArchSpec
    from archsearch.benchmarks import BenchSettings, measure

    out = []
    for r in results:
        spec = ArchSpec.from_dict({k: v for k, v in r.architecture.items() if k in ArchSpec.__dataclass_fields__})
        b = r.per_batch[0].batch_size
        s = BenchSettings(backend="analytic", batch_sizes=[b], input_len=r.settings["input_len"],
                          output_len=r.settings["output_len"], dtype=r.dtype or "float32", device_spec=device_spec,
                          engine_args={"calibration": cal_path} if cal_path else {})
        out.append(measure(spec, s).throughput(b))
    return out


def _metrics(pred: list[float], meas: list[float]) -> dict:
    from scipy.stats import spearmanr

    return {"mape": sum(abs(p / m - 1) for p, m in zip(pred, meas)) / len(meas),
            "spearman": float(spearmanr(pred, meas).statistic) if len(meas) > 2 else None}


def main(argv: list[str] | None = None) -> int:
    from archsearch.benchmarks.calibration import fit_calibration

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="results/bench/engines_cpu.jsonl")
    ap.add_argument("--n-fit", type=int, default=4)
    ap.add_argument("--device-spec", default="cpu")
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args(argv)
    every = [r for r in read_jsonl(args.results) if not r.predicted and r.ok]
    rows = []
    for backend in sorted({r.backend for r in every}):
        rs = [r for r in every if r.backend == backend]
        step = max(1, len(rs) // args.n_fit)
        fit_idx = set(range(0, len(rs), step)[: args.n_fit])
        fit_on = [r for i, r in enumerate(rs) if i in fit_idx]
        held = [r for i, r in enumerate(rs) if i not in fit_idx]
        cal = fit_calibration(fit_on, args.device_spec)
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "cal.json")
            cal.save(path)
            calibrated = _predict(held, path, args.device_spec)
        meas = [r.per_batch[0].output_throughput for r in held]
        row = {"backend": backend, "n_fit": len(fit_on), "n_held_out": len(held),
               "batch_sizes": sorted({r.per_batch[0].batch_size for r in held}),
               "uncalibrated": _metrics(_predict(held, None, args.device_spec), meas),
               "calibrated": _metrics(calibrated, meas),
               "calibration": {k: getattr(cal, k) for k in ("compute_efficiency", "memory_efficiency",
                                                            "step_overhead_s")} | {"fit": cal.fit},
               "held_out": [{"shape": r.architecture.get("name"), "measured": m, "calibrated": p}
                            for r, m, p in zip(held, meas, calibrated)]}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("backend", "n_fit", "n_held_out", "uncalibrated", "calibrated")}))
    append_jsonl(Path(args.out_dir) / "calibration.jsonl", {
        "benchmark": "roofline_calibration_held_out", "results": args.results, "rows": rows,
        "command": " ".join([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_calibration", *(argv or sys.argv[1:])]),
        "load_average_1_5_15min": list(os.getloadavg()), "provenance": provenance(device=False)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

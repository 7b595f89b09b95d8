"""Benchmark: how well do the shipped GPU calibrations predict throughput they were not fitted on?

For each calibration file (default: every ``configs/calibration/*.json``), refit its variant on its
source table (``source.path``) with each shape held out in turn (leave-one-shape-out: the shape's rows
on every device and engine left out of the fit) and with each batch size held out in turn
(leave-one-batch-out), and print the mean and worst absolute percentage error of the held-out
predictions, the uncalibrated roofline's error on the same rows beside them, and, where the file's
rows hold both at one batch size, the LLaMA-3.2-3B vs Qwen2.5-3B throughput ratio predicted (roofline,
calibrated) vs measured. Appended to ``OUT_DIR/gpu_calibration.jsonl`` with provenance.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_gpu_calibration      # ~2-5 min on 2 cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from archsearch.benchmarks import append_jsonl
from archsearch.benchmarks.analytic import predict_batch
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks.calibration_fit import held_out_errors, model_variants, read_throughput_table, shape_key, table_devices
from archsearch.provenance import provenance

PAIR = ("LLaMA-3.2-3B", "Qwen2.5-3B")  # same size, 8 vs 2 KV heads (28 vs 36 layers)


def evaluate(path: Path) -> dict:
    """One calibration file's held-out errors, the roofline's beside them, and the KV-reduction ratio."""
    import numpy as np

    cal = Calibration.load(path)
    pts, source = read_throughput_table(cal.source["path"])
    devices = table_devices(pts)
    variant = next(v for v in model_variants(pts, devices) if v.name == cal.fit["variant"])
    mine = [p for p in pts if (p.device, p.engine) == (cal.device, cal.engine)]

    def errs(rows):
        e = np.array([r["error"] for r in rows if (r["device"], r["engine"]) == (cal.device, cal.engine)])
        return {"mape": float(e.mean()), "worst": float(e.max()), "n": int(e.size)}

    def tput(p, c):
        return predict_batch(p.spec, devices[p.device_spec], p.dtype, p.batch, p.input_len, p.output_len,
                             c).output_throughput
    roof = np.array([abs(tput(p, None) / p.measured - 1) for p in mine])
    loso = held_out_errors(pts, variant, devices, shape_key)["rows"]
    out = {"file": str(path), "device": cal.device, "engine": cal.engine, "variant": cal.fit["variant"],
           "source": {k: cal.source.get(k) for k in ("path", "sha256", "tables")},
           "rows": len(mine), "in_sample_mape": cal.fit["mape_on_fitted"],
           "leave_one_shape_out": errs(loso),
           "leave_one_batch_out": errs(held_out_errors(pts, variant, devices, lambda p: p.batch)["rows"]),
           "roofline_uncalibrated": {"mape": float(roof.mean()), "worst": float(roof.max()), "n": int(roof.size)}}
    for b in sorted({p.batch for p in mine}):
        pair = {p.label: p for p in mine if p.batch == b and p.label in PAIR and p.input_len == 4096}
        if len(pair) == 2:
            a, q = pair[PAIR[0]], pair[PAIR[1]]
            held = {r["model"]: r["predicted"] for r in loso if (r["device"], r["engine"], r["batch_size"],
                    r["input_len"]) == (cal.device, cal.engine, b, 4096) and r["model"] in PAIR}
            out["kv_reduction_ratio"] = {
                "pair": f"{PAIR[1]} / {PAIR[0]} at batch {b}", "measured": q.measured / a.measured,
                "roofline": tput(q, None) / tput(a, None), "calibrated": tput(q, cal) / tput(a, cal),
                # each of the two predicted by a fit without its own shape
                "calibrated_held_out": held[PAIR[1]] / held[PAIR[0]]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", action="append", help="calibration files (default: configs/calibration/*.json)")
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args(argv)
    files = [Path(f) for f in args.calibration] if args.calibration else sorted(Path("configs/calibration").glob("*.json"))
    rerun = "python -m archsearch.benchmarks.scripts.bench_gpu_calibration" + "".join(
        f" --calibration {f}" for f in (args.calibration or []))
    rows = []
    for f in files:
        r = evaluate(f)
        rows.append(r)
        lo, lb, rf = r["leave_one_shape_out"], r["leave_one_batch_out"], r["roofline_uncalibrated"]
        print(f"{r['device']}/{r['engine']} ({r['variant']}, {r['rows']} rows): leave-one-shape-out MAPE "
              f"{lo['mape']:.1%} (worst {lo['worst']:.1%}), leave-one-batch-out {lb['mape']:.1%} "
              f"(worst {lb['worst']:.1%}), in-sample {r['in_sample_mape']:.1%}; uncalibrated roofline "
              f"{rf['mape']:.1%} (worst {rf['worst']:.1%})")
        if "kv_reduction_ratio" in r:
            k = r["kv_reduction_ratio"]
            print(f"  {k['pair']}: measured x{k['measured']:.2f}, roofline x{k['roofline']:.2f}, "
                  f"calibrated x{k['calibrated']:.2f} (fitted on both), x{k['calibrated_held_out']:.2f} (each held out)")
    print(f"rerun: {rerun}")
    out = Path(args.out_dir) / "gpu_calibration.jsonl"
    append_jsonl(out, {"benchmark": "gpu_calibration", "rerun": rerun, "results": rows,
                       "provenance": provenance(device=False)})
    print(f"appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

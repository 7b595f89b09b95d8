"""Does the answer change with the workload? The 1B rehearsal's candidate shapes and LLaMA-3.2-1B
ranked under each deployment workload (benchmarks/workloads.py) with the shipped H200 calibrations.

Every figure is a PREDICTION (the calibrated roofline, and for ``chat`` the serving simulator over it),
never a measurement: no GPU ran, and no online GPU measurement validates the simulator. Prints one
JSON line and appends it with provenance to ``results/bench/workloads.jsonl``.

    python -m archsearch.benchmarks.scripts.bench_workloads [--calibrations h200-sglang h200-vllm]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from archsearch.arch import ArchSpec
from archsearch.presets import get_preset
from archsearch.provenance import provenance
from archsearch.benchmarks import append_jsonl
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks.workloads import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]
# the feasible Pareto set of the 1B rehearsal as recorded before its 2026-11-27 rerun (its trial numbers;
# that study is kept in tests/data/recorded-1b/study) (trial: hidden, heads/KV, ffn),
# 16 layers, head size 64, LLaMA-3.2's vocabulary and tied embeddings
REHEARSAL = {"trial56": (2432, 32, 4, 6912), "trial47": (2688, 40, 5, 5888), "trial45": (2560, 48, 6, 5888),
             "trial21": (2560, 64, 8, 5120), "trial0": (2560, 76, 19, 4096)}
BATCH = {"offline-4k-1k": 128, "long-context": 64}  # the static batch of the offline workloads


def candidates() -> dict[str, ArchSpec]:
    base = get_preset("llama-3.2-1b")
    out = {"LLaMA-3.2-1B": base}
    for name, (d, h, kv, ffn) in REHEARSAL.items():
        out[name] = replace(base, hidden_size=d, n_heads=h, n_kv_heads=kv, ffn=ffn, name=name)
    return out


def score(spec: ArchSpec, workload, cal_path: Path) -> tuple[float, dict]:
    """The workload's score for one shape (higher is better) and the figures behind it."""
    from archsearch.benchmarks.analytic import AnalyticBackend
    from archsearch.benchmarks.base import BatchResult
    from archsearch.benchmarks.simulator import SimulatedBackend

    s = workload.bench_settings("H200", str(cal_path), batch_size=BATCH.get(workload.name))
    backend = SimulatedBackend() if s.backend == "simulated" else AnalyticBackend()
    out = backend.run({"arch": spec.to_dict(), "settings": s.to_dict(), "batch_sizes": s.batch_sizes}, lambda e: None)
    b = BatchResult.from_dict(out["per_batch"][0])
    figures = {"output_tok_s": b.output_throughput, "ttft_s": b.ttft_mean, "tpot_s": b.tpot_mean,
               "e2e_s": b.e2e_latency_mean}
    if b.online:
        figures.update({k: b.online[k] for k in ("goodput", "slo_attainment", "tpot_p99", "ttft_p99")})
    return workload.score(b), figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrations", nargs="+", default=["h200-sglang", "h200-vllm"])
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "workloads.jsonl"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    shapes = candidates()
    results = {}
    for cal_name in args.calibrations:
        cal_path = ROOT / "configs" / "calibration" / f"{cal_name}.json"
        cal = Calibration.load(cal_path)
        per_workload = {}
        for w in WORKLOADS.values():
            rows = {}
            for name, spec in shapes.items():
                sc, figures = score(spec, w, cal_path)
                rows[name] = {"score": sc, **figures}
            base = rows["LLaMA-3.2-1B"]["score"]
            for r in rows.values():
                r["ratio_to_llama"] = r["score"] / base
            winner = max(rows, key=lambda n: rows[n]["score"])
            per_workload[w.name] = {"objective": w.objective, "winner": winner, "shapes": rows}
            print(f"{cal_name:12s} {w.name:14s} ({w.objective}): winner {winner} "
                  + " ".join(f"{n}={r['ratio_to_llama']:.3f}" for n, r in rows.items()), flush=True)
        results[cal_name] = {"calibration": cal.describe(cal_path), "workloads": per_workload}
    record = {"benchmark": "workloads", "predicted": True,
              "note": "predictions (calibrated roofline; chat: the serving simulator over it); no GPU ran and no "
                      "online GPU measurement validates the simulator",
              "shapes": {n: {"hidden_size": s.hidden_size, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads,
                             "ffn": s.ffn, "n_layers": s.n_layers} for n, s in shapes.items()},
              "workloads": {w.name: {"objective": w.objective, "input_len": w.input_len, "output_len": w.output_len,
                                     "batch_size": w.batch_size or BATCH.get(w.name), "rate": w.rate,
                                     "n_requests": w.n_requests, "slo": w.slo and vars(w.slo)}
                            for w in WORKLOADS.values()},
              "results": results, "seconds": round(time.perf_counter() - t0, 1),
              "provenance": provenance(device=False)}
    print(json.dumps({k: record[k] for k in ("benchmark", "seconds")}
                     | {c: {w: r["winner"] for w, r in v["workloads"].items()} for c, v in results.items()}))
    append_jsonl(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

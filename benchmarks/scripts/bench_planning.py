"""Planning benchmark: the training-time law on CPU-measured proxy runs, and predicted vs
measured peak memory. Prints one JSON object (``--out`` also writes it and the runs).

Time law: a dozen tiny LLaMA runs (fp32, plain AdamW loop, random tokens) at several (N, D)
are timed here; every form is fit on the smaller models and predicts the held-out larger ones
(extrapolation in N), and the leave-one-out table over the fit runs is reported. CPU timing
on a shared 2-core machine is noisy: the numbers are this machine's, at this load.

Memory: fp32 CPU inference (prefill + decode) and training steps, each measured in a fresh
subprocess (peak RSS above the pre-model baseline), beside the prediction.

    python -m archsearch.benchmarks.scripts.bench_planning [--quick] [--out results/planning]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from archsearch.arch import ArchSpec
from archsearch.benchmarks.scripts import emit
from archsearch.planning import fit_time_law, predict_inference_memory, predict_training_memory
from archsearch.planning.measured import measure_peak_memory, measure_training_time
from archsearch.provenance import provenance
from archsearch.rundata import RunRecord, write_runs

# (n_layers, hidden, heads, kv_heads, ffn); head_dim 64, vocab 2048
SHAPES = [(2, 64, 1, 1, 192), (2, 128, 2, 1, 384), (4, 128, 2, 1, 384), (4, 192, 3, 1, 512),
          (4, 256, 4, 2, 768), (6, 256, 4, 2, 768)]
TOKENS = [8192, 24576]  # batch 8 x seq 128 = 1024 tokens per step
HOLDOUT_LARGEST = 1  # shapes (largest N) held out of the fit
MEMORY_POINTS = [("inference", (4, 256, 4, 2, 768, 8000), 8, 512, 32),
                 ("inference", (8, 512, 8, 2, 1536, 16000), 4, 1024, 64),
                 ("training", (4, 256, 4, 2, 768, 8000), 8, 256, 2),
                 ("training", (8, 512, 8, 2, 1536, 16000), 4, 256, 2)]


def _spec(n_layers, hidden, heads, kv, ffn, vocab=2048):
    return ArchSpec(n_layers=n_layers, hidden_size=hidden, n_heads=heads, n_kv_heads=kv,
                    head_dim=64, ffn=ffn, vocab_size=vocab)


def time_runs(shapes, tokens, threads: int) -> list:
    runs = []
    for sh in shapes:
        spec = _spec(*sh)
        for d in tokens:
            m = measure_training_time(spec, d, batch_size=8, seq_len=128, threads=threads)
            runs.append(RunRecord.from_arch(spec, tokens=m["tokens"], loss=1.0,  # loss unused here
                                            run_id=f"L{sh[0]}-d{sh[1]}-D{m['tokens']}",
                                            wall_time_s=m["wall_time_s"], n_devices=1, tp=1, pp=1,
                                            device="cpu", extra={"cpu_time_s": m["cpu_time_s"],
                                                                 "loss_note": "placeholder, time-only run"}))
            print(f"# {runs[-1].run_id}: {m['wall_time_s']:.2f} s wall, {m['cpu_time_s']:.2f} s cpu",
                  file=sys.stderr)
    return runs


def memory_points(points) -> list[dict]:
    out = []
    for kind, sh, b, a, o in points:
        spec = _spec(*sh)
        m = measure_peak_memory(kind, spec, b, a, o)
        p = (predict_inference_memory(spec, b, a, o, "float32") if kind == "inference"
             else predict_training_memory(spec, b, a, "float32"))
        out.append({"kind": kind, "shape": sh, "batch": b, "len_a": a, "len_b": o,
                    "predicted_bytes": p["total"], "measured_bytes": m["peak_bytes"],
                    "predicted_weights": p["weights"], "measured_weights_rss": m["weights_rss_bytes"],
                    "rel_gap": (p["total"] - m["peak_bytes"]) / m["peak_bytes"]})
        print(f"# memory {kind} {sh} b={b}: predicted {p['total'] / 2**20:.1f} MiB, "
              f"measured {m['peak_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer runs and memory points")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="folder for runs.csv, time_law.json and result.json")
    args = ap.parse_args()

    shapes = SHAPES[::2] + SHAPES[-1:] if args.quick else SHAPES
    runs = time_runs(shapes, TOKENS, args.threads)
    cut = sorted({r.n_params for r in runs})[-HOLDOUT_LARGEST]
    fit_runs = [r for r in runs if r.n_params < cut]
    held = [r for r in runs if r.n_params >= cut]
    fit = fit_time_law(fit_runs, holdout=held)
    law = fit.law
    # the same protocol on process CPU time (less disturbed by the other jobs on the machine)
    as_cpu = lambda rs: [dataclasses.replace(r, wall_time_s=r.extra["cpu_time_s"]) for r in rs]  # noqa: E731
    fit_cpu = fit_time_law(as_cpu(fit_runs), holdout=as_cpu(held))
    mem = memory_points(MEMORY_POINTS[::2] if args.quick else MEMORY_POINTS)
    result = {
        "benchmark": "planning",
        "time_law": {"n_fit_runs": len(fit_runs), "n_holdout_runs": len(held),
                     "holdout": "the largest-N shape(s), extrapolation",
                     "chosen": {"form": law.form, "residual_model": law.residual_model},
                     "chosen_holdout": fit.holdout, "measured_mfu": law.mfu,
                     "params": law.params, "notes": law.notes, "candidates": fit.selection},
        "time_law_on_cpu_time": {"chosen": {"form": fit_cpu.law.form,
                                            "residual_model": fit_cpu.law.residual_model},
                                 "chosen_holdout": fit_cpu.holdout, "candidates": fit_cpu.selection},
        "memory": mem,
        "memory_max_abs_rel_gap": max(abs(m["rel_gap"]) for m in mem),
        "runs": [{"run_id": r.run_id, "n_params_non_embedding": r.n_params, "tokens": r.tokens,
                  "wall_time_s": r.wall_time_s, "cpu_time_s": r.extra["cpu_time_s"]} for r in runs],
        "caveat": "2 shared CPU cores, other jobs running: wall times are noisy",
        "provenance": provenance(),
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_runs(out / "runs.csv", runs)
        law.save(out / "time_law.json")
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())

"""Batch-law benchmark: the throughput-vs-batch and max-batch laws (docs/method.md section 8) fitted to training-step
timings measured here, on a dense and a mixture-of-experts tiny model (two sparsities), with
the largest batch of each model held out (extrapolation in batch). Prints one JSON object and,
with ``--out``, writes the timings (the format ``archsearch estimate batch-laws`` reads), the
laws and the result with provenance.

Throughput: fp32 AdamW steps on random tokens (``planning.measure.measure_training_time``),
training tokens/s, best of ``--repeats`` (the machine is shared; the best is the least
disturbed). Peak memory: one fresh subprocess per point (peak RSS above baseline).

    python -m archsearch.benchmarks.scripts.bench_batch_laws [--quick] [--out results/batch-laws]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from archsearch.arch import ArchSpec, sparsity
from archsearch.benchmarks.scripts import emit
from archsearch.fileio import atomic_write, write_json
from archsearch.planning.batchlaws import fit_max_batch_law, fit_throughput_law, read_points
from archsearch.planning.measured import measure_peak_memory, measure_training_time
from archsearch.provenance import provenance

BATCHES = [1, 2, 4, 8, 16]
SEQ = 128


def _specs():
    common = dict(n_layers=2, hidden_size=128, n_heads=2, n_kv_heads=1, head_dim=64, vocab_size=2048)
    return [ArchSpec(name="dense", ffn=512, **common),
            ArchSpec(name="moe-8e-top2", ffn=128, family="mixtral", n_experts=8, experts_per_token=2, **common)]


def measure(spec, batches, repeats: int, threads: int) -> list[dict]:
    rows = []
    for b in batches:
        runs = [measure_training_time(spec, 3 * b * SEQ, b, SEQ, threads=threads) for _ in range(repeats)]
        best = max(r["tokens"] / r["wall_time_s"] for r in runs)
        peak = measure_peak_memory("training", spec, b, SEQ, 2, threads=threads)["peak_bytes"]
        rows.append({"architecture": spec.to_dict(), "batch_size": b, "seq_len": SEQ, "dtype": "float32",
                     "device": "cpu", "tokens_per_s": best,
                     "tokens_per_s_all": [r["tokens"] / r["wall_time_s"] for r in runs],
                     "peak_memory_bytes": peak, "threads": threads})
        print(f"# {spec.name} b={b}: {best:.0f} tok/s, peak {peak / 2**20:.1f} MiB", file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="folder for timings.jsonl, holdout.jsonl, laws.json, result.json")
    args = ap.parse_args()

    load0 = os.getloadavg()
    rows = [r for s in _specs() for r in measure(s, BATCHES, 1 if args.quick else args.repeats, args.threads)]
    fit_rows = [r for r in rows if r["batch_size"] < BATCHES[-1]]
    held_rows = [r for r in rows if r["batch_size"] == BATCHES[-1]]
    out = Path(args.out) if args.out else Path(os.environ.get("TMPDIR", "/tmp")) / "archsearch-batch-laws"
    out.mkdir(parents=True, exist_ok=True)
    for name, rs in (("timings.jsonl", fit_rows), ("holdout.jsonl", held_rows), ("all.jsonl", rows)):
        atomic_write(out / name, "".join(json.dumps(r) + "\n" for r in rs))
    q, tp, mb, dev = read_points(out / "timings.jsonl")
    _, htp, _, _ = read_points(out / "holdout.jsonl")
    _, _, all_mb, _ = read_points(out / "all.jsonl")
    tl = fit_throughput_law(tp, q, dev, holdout=htp)
    # max batch: peaks up to batch 8 give the fit points, the 8-16 bracket the held-out one
    held_mb = [p for p in all_mb if p.max_batch > BATCHES[-2]]
    ml = fit_max_batch_law(mb, dev, holdout=held_mb)
    write_json(out / "laws.json", {"throughput": tl.to_dict(), "max_batch": ml.to_dict()})
    result = {"benchmark": "batch_laws", "quantity": q, "seq_len": SEQ, "batches": BATCHES,
              "holdout": f"batch {BATCHES[-1]} of each model (throughput), the 8-16 bracket (max batch)",
              "models": {s.name: {"sparsity": sparsity(s), "spec": s.to_dict()} for s in _specs()},
              "throughput_law": tl.to_dict(), "max_batch_law": ml.to_dict(),
              "rows": rows, "load_avg_before": load0, "load_avg_after": os.getloadavg(),
              "caveat": "2 shared CPU cores, other jobs running; tokens/s is the best of the repeats",
              "provenance": provenance()}
    return emit(result, out if args.out else None)


if __name__ == "__main__":
    sys.exit(main())

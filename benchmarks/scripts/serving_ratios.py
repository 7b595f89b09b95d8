"""Measured against predicted: each shape's serving throughput as a ratio to a baseline shape's, at each
batch size, from a JSONL file of ``archsearch bench`` results that holds both a measuring backend's
records (hf, vllm, sglang) and the analytic predictor's, for the same shapes and lengths.

The search ranks shapes by such ratios (docs/method.md), so this is the predictor's test that
matters: ``gap`` = measured ratio / predicted ratio - 1, per shape and batch size. Written by
benchmarks/scripts/gpu_checks.sh after its serving step; prints a table and writes one JSON file.

    python -m archsearch.benchmarks.scripts.serving_ratios serving.jsonl [--baseline llama-3.2-1b] [--out ratios.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from archsearch.provenance import provenance


def shape_name(arch: dict) -> str | None:
    """The record's architecture by its name, or (a folder's shape, unnamed) by its dimensions."""
    if arch.get("name"):
        return arch["name"]
    try:
        return (f"L{arch['n_layers']} d{arch['hidden_size']} h{arch['n_heads']}/{arch['n_kv_heads']}"
                f"x{arch['head_dim']} ffn{arch['ffn']}")
    except KeyError:
        return None


def throughputs(lines: list[dict]) -> dict[str, dict[str, dict[int, float]]]:
    """{backend: {shape name: {batch size: output tokens/s}}}, the batches that ran, gathered over
    the records (one a batch size, or several in one); a later record of the same backend, shape and
    batch size replaces an earlier one (a rerun)."""
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(dict)
    for rec in lines:
        name = shape_name(rec.get("architecture") or {})
        if not name or not rec.get("backend"):
            continue
        out[rec["backend"]].setdefault(name, {}).update(
            {int(b["batch_size"]): float(b["output_throughput"])
             for b in rec.get("per_batch") or [] if b.get("ok") and b.get("output_throughput")})
    return dict(out)


def ratios(tp: dict[str, dict[str, dict[int, float]]], baseline: str, predictor: str = "analytic") -> list[dict]:
    """One row per (measuring backend, shape other than the baseline, batch size measured for both)."""
    rows = []
    predicted = tp.get(predictor, {})
    for backend, shapes in tp.items():
        if backend == predictor or baseline not in shapes:
            continue
        for name, per_batch in shapes.items():
            if name == baseline:
                continue
            for b, value in sorted(per_batch.items()):
                base = shapes[baseline].get(b)
                if base is None:
                    continue
                row = {"backend": backend, "shape": name, "baseline": baseline, "batch_size": b,
                       "measured": value, "measured_baseline": base, "measured_ratio": value / base}
                p, pb = predicted.get(name, {}).get(b), predicted.get(baseline, {}).get(b)
                if p and pb:
                    row.update(predicted_ratio=p / pb, gap=(value / base) / (p / pb) - 1,
                               measured_over_predicted=value / p, baseline_measured_over_predicted=base / pb)
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="JSONL of archsearch bench results (measured and analytic)")
    ap.add_argument("--baseline", help="the shape the others are divided by (default: the first in the file)")
    ap.add_argument("--out", help="write the rows and their provenance here (JSON)")
    args = ap.parse_args()
    lines = [json.loads(ln) for ln in Path(args.results).read_text().splitlines() if ln.strip()]
    if not lines:
        raise SystemExit(f"{args.results}: no results")
    baseline = args.baseline or shape_name(lines[0].get("architecture") or {})
    rows = ratios(throughputs(lines), baseline)
    print(f"{'backend':8} {'shape':28} {'batch':>5} {'measured':>9} {'predicted':>9} {'gap':>7}")
    for r in rows:
        pred = f"{r['predicted_ratio']:9.3f}" if "predicted_ratio" in r else f"{'-':>9}"
        gap = f"{r['gap']:+7.1%}" if "gap" in r else f"{'-':>7}"
        print(f"{r['backend']:8} {r['shape'][:28]:28} {r['batch_size']:5d} {r['measured_ratio']:9.3f} {pred} {gap}")
    if not rows:
        print(f"no shape was measured beside {baseline!r} at a common batch size")
    if args.out:
        Path(args.out).write_text(json.dumps({"baseline": baseline, "rows": rows, "source": str(args.results),
                                              "provenance": provenance(device=False)}, indent=1) + "\n")


if __name__ == "__main__":
    main()

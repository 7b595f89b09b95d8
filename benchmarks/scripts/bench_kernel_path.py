"""Can the published throughput fit SGLang's decode-kernel switch? The CUDA-core decode-attention term
(``+seq+attn``: FlashInfer's CUDA-core decode kernel below a GQA group of 5, its attention FLOPs at a
fitted rate; benchmarks/calibration.py) fitted on every row of the published table, its fitted rate per
SGLang device, and what it does to the predicted gain over LLaMA-3.2-1B of shapes past the threshold
(group 8 and 16), beside the shipped H200/SGLang file; then its leave-one-shape-out error on the SGLang
rows beside the shipped variant's. Predictions only. Prints one JSON line and appends it with provenance
to ``results/bench/kernel_path.jsonl``.

    python -m archsearch.benchmarks.scripts.bench_kernel_path
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from archsearch.hardware import get_device
from archsearch.presets import get_preset
from archsearch.provenance import provenance
from archsearch.benchmarks import append_jsonl
from archsearch.benchmarks.analytic import predict_batch
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks import calibration_fit as cf

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "configs" / "calibration" / "published-throughput.csv"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    t0 = time.perf_counter()
    pts, source = cf.read_throughput_table(TABLE)
    devices = cf.table_devices(pts)
    shipped = Calibration.load(ROOT / "configs" / "calibration" / "h200-sglang.json")
    variant = cf.Variant("sum", ("seq", "attn"), "pooled")
    cals = cf.fit_variant(pts, variant, devices)
    h200 = get_device("H200")
    base = get_preset("llama-3.2-1b")
    shapes = {"32/4 (hidden 2432, ffn 6912)": replace(base, hidden_size=2432, n_heads=32, n_kv_heads=4, ffn=6912),
              "64/4 (head 32)": replace(base, n_heads=64, n_kv_heads=4, head_dim=32)}
    gains = {}
    for name, s in shapes.items():
        gains[name] = {}
        for b in (16, 32, 64, 128):
            r = [predict_batch(s, h200, "bfloat16", b, 4096, 1024, c).output_throughput
                 / predict_batch(base, h200, "bfloat16", b, 4096, 1024, c).output_throughput
                 for c in (shipped, cals[("H200", "sglang", "bfloat16")])]
            gains[name][b] = {"shipped": r[0], "with_attn_term": r[1]}
    held = cf.held_out_errors(pts, variant, devices, cf.shape_key)
    loso = {}
    for dev in ("H200", "A100-40GB"):
        errs = [r["error"] for r in held["rows"] if r["engine"] == "sglang" and r["device"] == dev]
        mine = Calibration.load(ROOT / "configs" / "calibration" / cf.file_name(dev, "sglang"))
        loso[dev] = {"with_attn_term": sum(errs) / len(errs), "worst": max(errs),
                     "shipped_variant": mine.fit["variant"], "shipped": mine.fit["leave_one_shape_out"]["mape"]}
    out = {"benchmark": "kernel_path", "predicted": True, "table": source, "variant": variant.name,
           "attn_core_flops": {f"{d}/{e}": c.attn_core_flops for (d, e, _), c in cals.items() if e == "sglang"},
           "attn_core_flops_upper_bound": 1e16, "gain_over_llama_3_2_1b_h200_sglang": gains,
           "leave_one_shape_out_sglang": loso, "seconds": round(time.perf_counter() - t0, 1),
           "provenance": provenance(device=False)}
    print(json.dumps({k: out[k] for k in ("attn_core_flops", "leave_one_shape_out_sglang", "seconds")}))
    append_jsonl(ROOT / "results" / "bench" / "kernel_path.jsonl", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

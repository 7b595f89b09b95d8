"""Benchmark 1: do vLLM-CPU, transformers and the analytic roofline rank shapes alike?

At one non-embedding parameter budget, shapes that differ in hidden size, MLP/attention ratio
r and GQA (built by ``archsearch.candidates.build_candidate``) are measured with ``vllm`` and
``hf`` and predicted with ``analytic`` on this machine's measured CPU entry. Printed: one
JSON line per result, then one summary line with the Spearman rank correlation of output
throughput between each pair. Every result is appended to ``OUT_DIR/engines_cpu.jsonl``
(already measured (backend, shape, settings) are skipped unless ``--fresh``), the summary to
``OUT_DIR/engines_cpu_summary.jsonl``.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_engines_cpu            # ~10-20 min on 2 cores

``--grid calibration`` measures the calibration benchmark's 12 shapes (bench_calibration); with
``--config STUDY.yaml`` they are laid over that study's box and measured as the study measures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from archsearch.arch import describe
from archsearch.candidates import BuildSettings, build_candidate
from archsearch.errors import ArchsearchError
from archsearch.provenance import provenance
from archsearch.benchmarks import BenchSettings, append_jsonl, measure, read_jsonl

# (d/sqrt(N), r, GQA): hidden size from narrow to wide, MLP-heavy to attention-heavy, MHA to GQA
SHAPES = [(0.10, 1.0, 1), (0.10, 1.0, 4), (0.10, 4.0, 1), (0.10, 2.5, 4),
          (0.15, 1.0, 1), (0.15, 2.5, 4), (0.15, 4.0, 2), (0.22, 1.0, 1), (0.22, 2.5, 1)]
# the calibration benchmark's 4 x 3 grid (d/sqrt(N) x r), GQA cycling 1, 2, 4 across it: four shapes
# chosen D-optimally calibrate, the eight others are held out (bench_calibration)
CALIBRATION_SHAPES = [(x1, r, (1, 2, 4)[(i + j) % 3]) for i, x1 in enumerate((0.08, 0.12, 0.18, 0.26))
                      for j, r in enumerate((1.0, 2.5, 5.0))]
GRIDS = {"engines": SHAPES, "calibration": CALIBRATION_SHAPES}


def shapes(budget: float, layers: int, grid: str = "engines") -> list:
    bs = BuildSettings(vocab_size=2048, max_position_embeddings=512, tolerance=0.05,
                       on_r_drift="error" if grid == "engines" else "flag")  # the realised r is what is measured
    out = []
    for x1, r, g in GRIDS[grid]:
        spec = build_candidate(budget, layers, x1, r, gqa=g, head_dim=64, settings=bs).spec
        out.append(spec.replace(name=f"N{budget:.0e}-x{x1}-r{r}-g{g}"))
    return out


def study_shapes(cfg) -> list:
    """The calibration grid laid over a study's search box, each shape as the study measures it
    (built at the study's N with its build settings, then rebuilt at ``measure.params`` where
    set): 4 values of d/sqrt(N) x 3 of r, geometric over the box, the box's GQA values cycling
    across it. Knob points that do not build are skipped, as the study skips them."""
    import numpy as np

    from archsearch.search.resolved import derive
    from archsearch.search.derived import expand

    study = derive(cfg)
    box, build, scale = cfg.search_space, study.build, study.measured
    out, seen = [], set()
    for i, x1 in enumerate(np.geomspace(*box.hidden_over_sqrt_n, 4)):
        for j, r in enumerate(np.geomspace(*box.mlp_to_attn, 3)):
            g = box.gqa[(i + j) % len(box.gqa)]
            try:
                spec = scale(expand(cfg, build, float(x1), float(r), int(g)))
            except ArchsearchError as e:
                print(f"skipped x{x1:.3g} r{r:.3g} g{g}: {e}", file=sys.stderr)
                continue
            key = (spec.hidden_size, spec.n_heads, spec.n_kv_heads, spec.ffn)
            if key not in seen:
                seen.add(key)
                out.append(spec.replace(name=f"{cfg.name}-x{x1:.3g}-r{r:.3g}-g{g}"))
    return out


def _same(rec, spec, settings: BenchSettings) -> bool:
    mine = settings.to_dict()
    theirs = {k: v for k, v in rec.settings.items() if k in mine}
    return rec.architecture.get("name") == spec.name and theirs == mine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=16e6, help="non-embedding parameters")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="batch size of the rank comparison")
    ap.add_argument("--batch-sizes", default=None,
                    help="comma-separated batch sizes each engine measures (default: --batch-size)")
    ap.add_argument("--grid", choices=sorted(GRIDS), default="engines",
                    help="engines: 9 shapes; calibration: 12 (the calibration benchmark's data)")
    ap.add_argument("--config", default=None,
                    help="a study config: the calibration grid over its search box, its shapes as the study "
                         "measures them (measure.params), its prompt and output lengths and dtype (with "
                         "--grid calibration; --budget, --layers, --input-len and --output-len are then the study's)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="analytic,hf,vllm")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for hf; vLLM-CPU runs its worker on one thread here "
                         "(it reserves a core for its front end)")
    ap.add_argument("--out-dir", default="results/bench")
    ap.add_argument("--fresh", action="store_true", help="measure again what is already there")
    args = ap.parse_args(argv)
    from scipy.stats import spearmanr

    if args.config and args.grid != "calibration":
        ap.error("--config lays the calibration grid over a study's box: use it with --grid calibration")
    cfg = None
    if args.config:
        from archsearch.search.config import load_study_config

        cfg = load_study_config(args.config)
        args.input_len, args.output_len = cfg.measure.bench.input_len, cfg.measure.bench.output_len
        args.budget, args.layers = cfg.measure.params or cfg.params, cfg.n_layers
    out = Path(args.out_dir) / ("engines_cpu.jsonl" if args.grid == "engines" else f"{args.grid}_data.jsonl")
    done = read_jsonl(out) if out.exists() and not args.fresh else []
    specs = study_shapes(cfg) if cfg else shapes(args.budget, args.layers, args.grid)
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [args.batch_size]
    if args.batch_size not in sizes:
        ap.error(f"--batch-size {args.batch_size} must be one of --batch-sizes {sizes}")
    backends = args.backends.split(",")
    tput: dict[str, list[float | None]] = {b: [] for b in backends}
    for backend in backends:
        for spec in specs:
            s = BenchSettings(backend=backend, batch_sizes=sizes, input_len=args.input_len,
                              output_len=args.output_len, warmup=1, repeats=args.repeats,
                              dtype=cfg.measure.bench.dtype if cfg else "auto",
                              device_spec="cpu" if backend == "analytic" else None,
                              engine_args={"torch_threads": args.threads} if backend == "hf" else {},
                              timeout_s=900)
            prev = next((r for r in done if r.backend == backend and _same(r, spec, s)), None)
            r = prev or measure(spec, s)
            if prev is None:
                append_jsonl(out, r)
            tput[backend].append(r.throughput(args.batch_size))
            print(json.dumps({"backend": backend, "shape": spec.name, "ok": r.ok, "error": r.error,
                              "output_throughput": r.throughput(args.batch_size),
                              "ttft": r.ttft(args.batch_size),
                              "engine_start_s": r.timing.get("engine_start_s"),
                              "reused": prev is not None}), flush=True)

    pairs = {}
    for i, a in enumerate(backends):
        for b in backends[i + 1:]:
            ok = [(x, y) for x, y in zip(tput[a], tput[b]) if x is not None and y is not None]
            rho = spearmanr([x for x, _ in ok], [y for _, y in ok]).statistic if len(ok) > 2 else None
            pairs[f"{a}~{b}"] = {"spearman": None if rho is None else float(rho), "n": len(ok)}
    summary = {
        "benchmark": "engines_cpu_rank_agreement",
        "budget_non_embedding": args.budget, "layers": args.layers, "batch_size": args.batch_size,
        "grid": args.grid, "config": args.config, "data": str(out),
        "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats,
        "hf_torch_threads": args.threads,
        "shapes": [{k: describe(s)[k] for k in ("name", "hidden_size", "n_heads", "n_kv_heads", "ffn",
                                               "mlp_to_attn_ratio", "n_params_non_embedding")}
                   for s in specs],
        "output_throughput": tput, "spearman": pairs,
        "command": " ".join([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_engines_cpu", *(argv or sys.argv[1:])]),
        # other work on the shared cores slows engines unevenly: say how busy the machine was
        "load_average_1_5_15min": list(os.getloadavg()),
        "provenance": provenance(extra_packages=("vllm-cpu", "vllm")),
    }
    append_jsonl(Path(args.out_dir) / "engines_cpu_summary.jsonl", summary)
    print(json.dumps({k: summary[k] for k in ("benchmark", "spearman", "output_throughput")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

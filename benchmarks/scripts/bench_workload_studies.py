"""Does the answer change with the workload? One full study per workload, side by side.

Reads the four recorded studies ``results/examples/paper-1b-workload-<workload>/`` (the 1B rehearsal,
configs/paper-1b-workload-*.yaml: the published law, Optuna search, solve, local GQA walk and report,
each with one H200 / vLLM target serving one workload preset), takes each study's answer and scores it,
beside LLaMA-3.2-1B, under every workload with the settings of that workload's own study (its target's
backend, lengths, batching, rate and SLO): a 4 x 4 table of ratios to LLaMA-3.2-1B in which the diagonal
is each study on its own workload (checked to reproduce the study's own recorded ratio). Writes the
tables (``results/examples/workloads/tables.md``) and one figure (``workloads.png`` + .pdf), prints one
JSON line and appends it with provenance to ``results/bench/workload_studies.jsonl``.

Every figure is a PREDICTION (the roofline calibrated on published H200 / vLLM throughput; for ``chat``
the serving simulator over it), never a measurement: no GPU ran, and no online GPU measurement
validates the simulator. A prediction has no noise, so no ratio here has an interval.

    python -m archsearch.benchmarks.scripts.bench_workload_studies   # ~1-3 min (chat simulates 500 requests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.benchmarks import append_jsonl, measure
from archsearch.benchmarks.workloads import WORKLOADS, objective_score, objective_words
from archsearch.errors import ArchsearchError
from archsearch.presets import get_preset
from archsearch.provenance import provenance
from archsearch.search.config import load_study_config
from archsearch.search.deployment import study_objective, target_measure

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "llama-3.2-1b"
SHORT = {"offline-4k-1k": "offline 4K/1K", "chat": "chat", "long-context": "long context\n32K",
         "single-stream": "single\nstream"}


def study_folder(examples: Path, workload: str) -> Path:
    return examples / f"paper-1b-workload-{workload}"


def answer_spec(summary: dict[str, Any], base: ArchSpec) -> ArchSpec:
    """The study's answer as an ArchSpec: the baseline's family, vocabulary and context with the
    answer's widths and heads (what the study measured)."""
    a = summary["chosen"]["architecture"]
    return dataclasses.replace(base, name=None, n_layers=a["n_layers"], hidden_size=a["hidden_size"],
                               n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"], head_dim=a["head_dim"], ffn=a["ffn"])


def figure_of(spec: ArchSpec, settings, objective: str, details: list[dict[str, Any]] | None = None) -> float:
    """The workload's objective for one shape as a higher-is-better score (``objective_score``); the
    figures behind it (latency, TPOT, SLO attainment) appended to ``details``."""
    b = measure(spec, settings).per_batch[0]
    if details is not None:
        on = b.online or {}
        details.append({"output_tok_s": b.output_throughput, "e2e_s": b.e2e_latency_mean, "tpot_s": b.tpot_mean,
                        **{k: on.get(k) for k in ("goodput", "slo_attainment", "tpot_p99", "ttft_p99") if on}})
    return objective_score(objective, b, "workload score")


def shape_label(a: dict[str, Any]) -> str:
    return f"d{a['hidden_size']} {a['n_heads']}/{a['n_kv_heads']} ffn{a['ffn']}"


def draw(path: Path, workloads: list[str], rows: dict[str, dict[str, Any]], cross: dict[str, dict[str, float]]) -> list[str]:
    """Left: each study's answer (rows) scored under each workload (columns), the ratio to LLaMA-3.2-1B
    written in each cell, coloured by its share of the column's best (so a 1% lead under chat shows as
    plainly as a 30% one at 32K), the diagonal (each study on its own workload) boxed, each column's best
    in bold. Right: the shapes chosen, hidden size against query heads."""
    from archsearch.figures import save, styled

    @styled
    def _draw() -> Path:
        import matplotlib.pyplot as plt
        import numpy as np

        m = np.array([[cross[r][c] for c in workloads] for r in workloads])
        share = m / m.max(axis=0, keepdims=True)
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.25, 1]})
        im = ax.imshow(share, cmap="viridis", vmin=0.95, vmax=1.0)  # within 5% of the best: a lead of 1% shows
        for i in range(len(workloads)):
            for j in range(len(workloads)):
                best = m[i, j] >= m[:, j].max() - 1e-12
                ax.text(j, i, f"x{m[i, j]:.3f}", ha="center", va="center", fontsize=10,
                        fontweight="bold" if best else "normal", color="k" if share[i, j] > 0.985 else "w")
            ax.add_patch(plt.Rectangle((i - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec="tab:red"))
        ax.set_xticks(range(len(workloads)), [f"{SHORT[w]}\n({WORKLOADS[w].objective})" for w in workloads], fontsize=8)
        ax.set_yticks(range(len(workloads)), [f"{SHORT[w]} study's answer\n{shape_label(rows[w]['architecture'])}"
                                              for w in workloads], fontsize=8)
        ax.set_xlabel("scored under workload (its objective)")
        ax.grid(False)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the column's best (<= 0.95: darkest)")
        ax.set_title("each answer under every workload: ratio to LLaMA-3.2-1B\n"
                     "(red box: its own study; bold: the column's best)", fontsize=10)
        # right: the shapes, hidden size against query heads, sized by FFN, each named heads/KV
        base = get_preset(BASELINE)
        base_row = {"hidden_size": base.hidden_size, "n_heads": base.n_heads, "n_kv_heads": base.n_kv_heads,
                    "ffn": base.ffn, "n_layers": base.n_layers}
        for k, (label, a, marker) in enumerate([*((SHORT[w].replace("\n", " "), rows[w]["architecture"], "o")
                                                  for w in workloads), ("LLaMA-3.2-1B", base_row, "*")]):
            color = f"C{k}" if marker == "o" else "k"
            ax2.scatter(a["hidden_size"], a["n_heads"], s=a["ffn"] / 20, color=color, alpha=0.75, marker=marker,
                        label=f"{label}: {shape_label(a)}, {a['n_layers']} layers")
            ax2.annotate(f"{a['n_heads']}/{a['n_kv_heads']}", (a["hidden_size"], a["n_heads"]), xytext=(12, -4),
                         textcoords="offset points", fontsize=8)
        ax2.set_xlabel("hidden size")
        ax2.set_ylabel("query heads (label: heads/KV heads)")
        ax2.margins(0.2)
        ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), markerscale=0.4, ncol=1)
        ax2.set_title("the shapes chosen (marker area: FFN width)", fontsize=10)
        fig.suptitle("1B rehearsal: one study per workload on H200 / vLLM - PREDICTED (calibrated roofline; "
                     "chat: serving simulator), not measured", fontsize=11)
        fig.tight_layout()
        return save(fig, path, dpi=130)

    png = _draw()
    return [str(png), str(png.with_suffix(".pdf"))]


def tables(workloads: list[str], rows: dict[str, dict[str, Any]], cross: dict[str, dict[str, float]],
           scores: dict[str, dict[str, float]], baseline_scores: dict[str, float]) -> str:
    """The side-by-side table (one row per study) and the cross table, as markdown."""
    lines = ["| workload | objective | answer: hidden | heads/KV | ffn | layers | chosen by | predicted loss "
             "| its figure (LLaMA-3.2-1B's), predicted | ratio to LLaMA-3.2-1B, predicted |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        r = rows[w]
        a = r["architecture"]
        words = objective_words(r["objective"], WORKLOADS[w].slo)
        f = ".0f" if r["objective"] == "throughput" else ".4g"
        fig = f"{words.shown(scores[w][w]):{f}} ({words.shown(baseline_scores[w]):{f}}) {words.column}"
        what = ("end-to-end latency of one request (s, lower is better; the ratio is LLaMA-3.2-1B's latency / "
                "the answer's)" if r["objective"] == "latency" else r["objective_meaning"])
        lines.append(f"| {w} | {what} | {a['hidden_size']} | "
                     f"{a['n_heads']}/{a['n_kv_heads']} | {a['ffn']} | {a['n_layers']} | {r['source']} | "
                     f"{r['predicted_loss']:.4f} | {fig} | x{r['ratio']:.3f} (no interval: a prediction) |")
    lines += ["", "Each answer (rows) scored under every workload (columns), ratio to LLaMA-3.2-1B under that "
              "workload's objective (predicted; **bold**: the column's best; the diagonal is each study on its own "
              "workload):", "",
              "| answer of the study for | " + " | ".join(f"{w} ({WORKLOADS[w].objective})" for w in workloads)
              + " | wins its own? |", "|---|" + "---|" * (len(workloads) + 1)]
    for r in workloads:
        cells = []
        for c in workloads:
            v = cross[r][c]
            best = v >= max(cross[x][c] for x in workloads) - 1e-12
            txt = f"x{v:.3f}"
            txt = f"**{txt}**" if best else txt
            cells.append(f"[{txt}]" if r == c else txt)
        own = cross[r][r] >= max(cross[x][r] for x in workloads) - 1e-12
        lines.append(f"| {r}: {shape_label(rows[r]['architecture'])} | " + " | ".join(cells)
                     + f" | {'yes' if own else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", default=str(ROOT / "results" / "examples"))
    ap.add_argument("--out-dir", default=str(ROOT / "results" / "examples" / "workloads"))
    ap.add_argument("--out", default=str(ROOT / "results" / "bench" / "workload_studies.jsonl"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    examples, out_dir = Path(args.examples), Path(args.out_dir)
    workloads = list(WORKLOADS)
    base = get_preset(BASELINE)
    rows: dict[str, dict[str, Any]] = {}
    settings = {}
    for w in workloads:
        folder = study_folder(examples, w)
        if not (folder / "summary.json").is_file():
            raise ArchsearchError(str(folder), "no summary.json: the study has not run",
                                  f"python -m archsearch search --config configs/paper-1b-workload-{w}.yaml "
                                  f"--out {folder}")
        s = json.loads((folder / "summary.json").read_text())
        cfg = load_study_config(ROOT / "configs" / f"paper-1b-workload-{w}.yaml")
        (target,) = cfg.measure.targets
        if target.workload != w:
            raise ArchsearchError(f"configs/paper-1b-workload-{w}.yaml", f"its target serves {target.workload}",
                                  f"give it workload: {w}")
        m = target_measure(cfg.measure, target)
        settings[w] = (m.bench, m.objective)
        q = s["chosen"]["ratio"] if not s["chosen"]["is_baseline"] else {"ratio": 1.0}
        rows[w] = {"study": str(folder.relative_to(ROOT)), "architecture": s["chosen"]["architecture"],
                   "is_baseline": s["chosen"]["is_baseline"], "source": s["chosen"].get("source"),
                   "predicted_loss": s["chosen"]["predicted_loss"], "ratio": q["ratio"],
                   "predicted": bool(q.get("predicted", True)), "objective": m.objective,
                   "objective_meaning": study_objective(cfg).meaning, "target": target.name,
                   "settings": m.bench.to_dict(), "report_time_utc": s["provenance"]["time_utc"],
                   "git": s["provenance"]["git"]}
    details: dict[str, dict[str, list[dict[str, Any]]]] = {BASELINE: {w: [] for w in workloads}}
    baseline_scores = {w: figure_of(base, *settings[w], details[BASELINE][w]) for w in workloads}
    cross: dict[str, dict[str, float]] = {}
    scores: dict[str, dict[str, float]] = {}
    for r in workloads:
        spec = base if rows[r]["is_baseline"] else answer_spec({"chosen": rows[r]}, base)
        details[r] = {w: [] for w in workloads}
        scores[r] = {c: figure_of(spec, *settings[c], details[r][c]) for c in workloads}
        cross[r] = {c: scores[r][c] / baseline_scores[c] for c in workloads}
        print(f"{r:14s} answer {shape_label(rows[r]['architecture'])}: "
              + " ".join(f"{c}=x{cross[r][c]:.3f}" for c in workloads), flush=True)
    # the diagonal is each study's own ratio, predicted again here: the two must agree
    drift = {w: cross[w][w] / rows[w]["ratio"] - 1 for w in workloads}
    bad = {w: d for w, d in drift.items() if abs(d) > 1e-6}
    if bad:
        raise ArchsearchError("diagonal", f"the studies' own ratios are not reproduced: {bad}",
                              "rerun the studies with this code (the calibration or the model changed)")
    out_dir.mkdir(parents=True, exist_ok=True)
    md = tables(workloads, rows, cross, scores, baseline_scores)
    (out_dir / "tables.md").write_text(md)
    fig = draw(out_dir / "workloads.png", workloads, rows, cross)
    own_wins = {w: cross[w][w] >= max(cross[x][w] for x in workloads) - 1e-12 for w in workloads}
    distinct = len({shape_label(rows[w]["architecture"]) for w in workloads})
    record = {"benchmark": "workload_studies", "predicted": True,
              "note": "predictions (the roofline calibrated on published H200/vLLM throughput; chat: the serving "
                      "simulator over it); no GPU ran and no online GPU measurement validates the simulator",
              "studies": rows, "baseline": BASELINE, "baseline_scores": baseline_scores, "scores": scores, "figures": {k: {w: v[0] for w, v in d.items()} for k, d in details.items()},
              "cross_ratio_to_baseline": cross, "own_answer_wins_own_workload": own_wins,
              "distinct_answers": distinct, "figure": [str(Path(p).relative_to(ROOT)) for p in fig],
              "seconds": round(time.perf_counter() - t0, 1), "provenance": provenance(device=False)}
    print(json.dumps({"benchmark": "workload_studies", "distinct_answers": distinct, "own_answer_wins": own_wins,
                      "answers": {w: shape_label(rows[w]["architecture"]) for w in workloads},
                      "seconds": record["seconds"]}))
    append_jsonl(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

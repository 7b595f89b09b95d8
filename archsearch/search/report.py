"""The study folder a person reads: ``summary.json``, ``report.md``, ``trials.csv``, plots."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe
from archsearch.benchmarks.base import backend_packages
from archsearch.benchmarks.workloads import ObjectiveWords, objective_words
from archsearch.configio import redact, to_dict
from archsearch.figures import legend, log_axis, save, styled
from archsearch.fileio import atomic_write, read_jsonl_lines, write_json, write_table
from archsearch.modelcard import write_study_cards
from archsearch.provenance import provenance
from archsearch.search import log, margins
from archsearch.search.answer import Answer, predicted_interval
from archsearch.search.checks import baseline_loss, baseline_note
from archsearch.search.margins import describe_margin
from archsearch.search.constraint import loss_margin
from archsearch.search.deployment import study_objective
from archsearch.search.objective import trial_is_feasible, was_measured
from archsearch.search.solution import calibration_label
from archsearch.search.storage import storage_url
from archsearch.search.targets import targets_figure, targets_markdown, targets_summary
from archsearch.search.verify import head_to_head_markdown
from archsearch.trainers.health import proxies_health


def _complete(study):
    """Completed trials with a measurement (loss-infeasible ones complete unmeasured)."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if was_measured(t)]


def _throughput(t) -> float:
    """Measured tokens/s at the reference batch (paired trials keep it in the user attrs;
    their objective value is the ratio to the baseline)."""
    tp = t.user_attrs.get("throughput") or {}
    if t.user_attrs.get("ratio") and tp:
        return float(next(iter(tp.values())))
    return float(t.values[0])


def _point(t) -> dict[str, Any]:
    ratio = t.user_attrs.get("ratio")
    return {"trial": t.number, "spec": t.user_attrs["spec"], "throughput": _throughput(t),
            "ratio": ratio, "score": ratio["ratio"] if ratio else _throughput(t),
            "predicted_loss": t.user_attrs["predicted_loss"],
            "predicted_loss_interval": t.user_attrs.get("predicted_loss_interval"),
            "loss_margin": t.user_attrs.get("loss_margin"),
            "knobs": dict(t.params), "source": f"Optuna trial {t.number}"}


def _distinct_feasible(study) -> list[dict[str, Any]]:
    """Feasible measured shapes, each once, under its first trial."""
    pts, seen = [], set()
    for t in sorted(_complete(study), key=lambda t: t.number):
        key = t.user_attrs.get("spec_key")
        if trial_is_feasible(t) and key not in seen:
            seen.add(key)
            pts.append(_point(t))
    return pts


def pareto_set(study) -> list[dict[str, Any]]:
    """Feasible measured shapes not dominated in (throughput up, predicted loss down); a shape
    proposed by several trials appears once, under its first trial."""
    pts = _distinct_feasible(study)
    front = [p for p in pts if not any(
        q["score"] >= p["score"] and q["predicted_loss"] <= p["predicted_loss"]
        and (q["score"] > p["score"] or q["predicted_loss"] < p["predicted_loss"]) for q in pts)]
    return sorted(front, key=lambda p: -p["score"])


def tied_with(best: dict[str, Any], p: dict[str, Any]) -> bool:
    """Statistically tied in throughput: the two ratio intervals (each vs the baseline) overlap."""
    a, b = best.get("ratio"), p.get("ratio")
    return bool(a and b) and a["lo"] <= b["hi"] and b["lo"] <= a["hi"]


def chosen_from_study(study) -> dict[str, Any] | None:
    """The feasible trial with the highest throughput estimate (paired ratio to the baseline)."""
    front = pareto_set(study)
    return front[0] if front else None


def top_k_candidates(study, ctx, k: int) -> list[dict[str, Any]]:
    """Predict-rank-select: the k best distinct feasible shapes by a joint rank of measured
    throughput (the paired ratio estimate where there is one) and predicted loss (sum of the two
    ranks, ties by throughput). A shape proposed by several trials counts once, under its first trial."""
    pts = _distinct_feasible(study)
    by_t = sorted(pts, key=lambda p: -p["score"])
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
            **{k: v for k, v in ua.items() if k.startswith("realised_")},
            **{f"realised_{k}": v for k, v in (ua.get("realised") or {}).items()},  # studies before flat attrs
            "predicted_loss": ua.get("predicted_loss"),
            "predicted_loss_lo": (ua.get("predicted_loss_interval") or [None, None])[0],
            "predicted_loss_hi": (ua.get("predicted_loss_interval") or [None, None])[1],
            "feasible": trial_is_feasible(t) if t.state.name == "COMPLETE" else ua.get("feasible_loss"),
            "objective": t.values[0] if t.values and ua.get("measured") is not False else None,
            **{f"ratio_{k}": (ua.get("ratio") or {}).get(k) for k in ("ratio", "lo", "hi", "significantly_faster")},
            # deployment targets: each target's ratio, its bounds and how it is known, and the binding one
            **{f"target_{r['target']}_{k}": r.get(k) for r in (ua.get("ratio") or {}).get("per_target") or []
               for k in ("ratio", "lo", "hi", "source")},
            **({"binding_target": ua["binding_target"]} if ua.get("binding_target") else {}),
            "paired_rounds": ua.get("rounds"),
            "loss_upper_bound": (ua.get("loss_upper_bound") or {}).get("value"),
            **{col: (ua.get("loss_margin") or {}).get(k) for col, k in (
                ("loss_margin", "margin"), ("p_loss_within_target", "p_within_target"), ("margin_verdict", "verdict"))},
            **{f"throughput_b{b}": v for b, v in (ua.get("throughput") or {}).items()},
            **{f"ttft_s_b{b}": v for b, v in (ua.get("ttft") or {}).items()},
            "measurement_cached": ua.get("measurement_cached"),
            "reason": ua.get("failure_reason") or ua.get("pruned_reason") or ua.get("infeasible_reason")
            or ua.get("limits_reason") or ("the baseline itself: ratio 1 by definition, not measured"
                                            if ua.get("is_baseline") else None),
            "retry_of": ua.get("retry_of"),
        })
    write_table(path, rows)


@styled
def _plots(ctx, study, chosen, base_point, out: Path, words: ObjectiveWords) -> list[str]:
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    made = []
    # 1. Pareto frontier: the objective (ratio to the baseline, paired, with its interval) vs
    # predicted loss, the front as a step line, points tied with the best ringed; every axis and
    # title names the study's objective (``words``), never throughput for a goodput or latency study
    pts = [_point(t) | {"feasible": trial_is_feasible(t)} for t in _complete(study)]
    paired = any(p["ratio"] for p in pts)
    y = (lambda p: p["ratio"]["ratio"]) if paired else (lambda p: p["throughput"])  # noqa: E731
    front = pareto_set(study)
    fig, ax = plt.subplots(figsize=(7, 5))
    for group, style in (([p for p in pts if p["feasible"]], dict(fmt="o", c="tab:blue", label="feasible trials")),
                         ([p for p in pts if not p["feasible"]], dict(fmt="o", c="tab:gray", mfc="none",
                                                                      label="infeasible trials"))):
        if not group:
            continue
        err = None
        if paired:
            err = [[y(p) - p["ratio"]["lo"] for p in group], [p["ratio"]["hi"] - y(p) for p in group]]
        ax.errorbar([p["predicted_loss"] for p in group], [y(p) for p in group], yerr=err, capsize=3,
                    ls="none", **style)
    if front:
        fr = sorted(front, key=lambda p: p["predicted_loss"])
        ax.step([p["predicted_loss"] for p in fr], [y(p) for p in fr], where="post", c="tab:blue", alpha=0.6,
                label="Pareto front")
        tied = [p for p in pts if p["feasible"] and p["trial"] != front[0]["trial"] and tied_with(front[0], p)]
        if tied:
            ax.scatter([p["predicted_loss"] for p in tied], [y(p) for p in tied], s=160, facecolors="none",
                       edgecolors="tab:purple", label="tied with the best (intervals overlap)", zorder=4)
    ax.axvline(ctx.target_loss, ls="--", c="tab:red", label=f"target loss {ctx.target_loss:.3f}")
    base_y = 1.0 if paired else base_point.get("throughput")
    if base_y:
        ax.scatter([base_point["predicted_loss"]], [base_y], marker="*", s=250, c="tab:orange",
                   label="baseline", zorder=5)
    if chosen and not chosen.is_baseline:
        cy = chosen.ratio["ratio"] if paired and chosen.ratio else chosen.throughput
        ax.scatter([chosen.predicted_loss], [cy], marker="D", s=90, c="tab:green", label="chosen", zorder=6)
    ax.set_xlabel("predicted loss")
    predicted = any((p["ratio"] or {}).get("predicted") for p in pts)
    ax.set_ylabel(f"{words.ratio}, predicted (no interval)" if predicted else
                  f"{words.ratio}, paired, {_level(pts)} interval" if paired
                  else f"measured {words.meaning}")
    ax.set_title(f"{ctx.cfg.name}: {words.name} vs predicted loss" + (f" (batch {ctx.ref_batch})"
                                                                      if words.objective == "throughput" else ""))
    legend(ax, fontsize=8)  # a one-shape front's step line draws nothing: no entry for it
    fig.tight_layout()
    made += _save(fig, out, "pareto", plt)
    if paired:
        made += _ratio_chart(ctx, pts, chosen, out, plt, words)
    # 2. U-curves of the law at the target budget
    marks = [("baseline", base_point["architecture"], "tab:orange")]
    if chosen:
        marks.append(("chosen", describe(chosen.spec), "tab:green"))
    made += _ucurves(ctx, out, plt, marks)
    made += optuna_figures(study, out, plt, words)
    plan = active_plan_summary(ctx.out)
    if plan is not None:
        made += active_plot(plan, out, plt)
    return made


def optuna_figures(study, out: Path, plt, words: ObjectiveWords | None = None) -> list[str]:
    """Optuna's own figures (``optuna.visualization.matplotlib``): the optimisation history and,
    with at least two completed trials that vary a knob, the knobs' importances (fANOVA) for the
    first objective, named by ``words`` (the study's objective) rather than the storage's metric name.
    A figure Optuna cannot draw for this study is left out, and said so."""
    import warnings

    import optuna
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    name = f"{words.name} / baseline's" if words is not None else (study.metric_names or ["objective"])[0]
    # always a target: without one, Optuna names the importances by the storage's metric name, not ``name``
    target = (lambda t: t.values[0]) if len(study.directions) > 1 or words is not None else None  # noqa: E731
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    made = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        for fig_name, draw, enough in (
                ("optuna_history", ovm.plot_optimization_history, len(complete) >= 1),
                ("optuna_importances", ovm.plot_param_importances,
                 len(complete) >= 2 and any(len({t.params.get(k) for t in complete}) > 1
                                            for k in complete[0].params))):
            if not enough:
                continue
            try:
                ax = draw(study, target=target, target_name=name)
            except (ValueError, RuntimeError) as e:  # e.g. every trial's value equal: no importance to give
                log(f"plots: Optuna's {fig_name.split('_')[1]} figure not drawn ({e})")
                continue
            fig = ax.figure
            fig.set_size_inches(7, 4.5)
            for loc in ("left", "center"):  # Optuna titles some figures on the left
                if ax.get_title(loc=loc):
                    ax.set_title(f"study {study.study_name}: {ax.get_title(loc=loc)}", loc=loc)
            fig.tight_layout()
            made += _save(fig, out, fig_name, plt)
    return made


def _level(pts) -> str:
    q = next((p["ratio"] for p in pts if p.get("ratio")), None)
    return f"{q['level']:.0%}" if q else ""


def _save(fig, out: Path, name: str, plt) -> list[str]:
    """PNG for the report, PDF for print (:func:`archsearch.figures.save`): their paths in the study folder."""
    save(fig, out / f"{name}.png", dpi=120)
    return [f"plots/{name}.png", f"plots/{name}.pdf"]


def _ratio_chart(ctx, pts, chosen, out: Path, plt, words: ObjectiveWords) -> list[str]:
    """Every measured shape's ratio to the baseline (of the study's objective, ``words``) with its
    interval, best first; written as ``plots/<objective>.png`` (``throughput.png``, ``goodput.png``...)."""
    shapes, seen = [], set()
    for p in sorted(pts, key=lambda p: -p["ratio"]["ratio"] if p["ratio"] else 0):
        key = json.dumps(p["spec"], sort_keys=True)
        if p["ratio"] and key not in seen:
            seen.add(key)
            shapes.append(p)
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(shapes) + 1.5))
    chosen_spec = json.dumps(chosen.spec.to_dict(), sort_keys=True) if chosen and chosen.spec else None
    labels = [f"#{p['trial']} d{p['spec']['hidden_size']} h{p['spec']['n_heads']}/{p['spec']['n_kv_heads']} "
              f"ffn{p['spec']['ffn']}" + ("" if p["feasible"] else " (infeasible)")
              + (" (chosen)" if json.dumps(p["spec"], sort_keys=True) == chosen_spec else "") for p in shapes]
    r = [p["ratio"]["ratio"] for p in shapes]
    err = [[p["ratio"]["ratio"] - p["ratio"]["lo"] for p in shapes], [p["ratio"]["hi"] - p["ratio"]["ratio"] for p in shapes]]
    predicted = any(p["ratio"].get("predicted") for p in shapes)
    # a prediction has no noise: its colour says only which side of 1 it falls on, never significance
    colors = [("tab:olive" if p["ratio"]["ratio"] > 1 else "tab:purple") if p["ratio"].get("predicted") else
              "tab:green" if p["ratio"]["significantly_faster"] else
              "tab:red" if p["ratio"]["significantly_slower"] else "tab:gray" for p in shapes]
    # points with intervals on an axis around 1 (bars from 0 would hide differences of a few %)
    for i, (x, lo, hi, c) in enumerate(zip(r, err[0], err[1], colors)):
        ax.errorbar(x, i, xerr=[[lo], [hi]], fmt="o", color=c, capsize=4, ms=7)
    ax.axvline(1.0, c="k", lw=1, label="baseline")
    ax.margins(x=0.15)
    ax.set_yticks(range(len(shapes)), labels, fontsize=8)
    ax.invert_yaxis()
    meaning = {"tab:green": f"green: significantly {words.better}", "tab:red": f"red: significantly {words.worse}",
               "tab:gray": "grey: tied with the baseline", "tab:olive": f"olive: predicted {words.better}",
               "tab:purple": f"purple: predicted {words.worse}"}
    drawn = [meaning[c] for c in meaning if c in colors] + ["black line: the baseline"]  # only colours drawn
    ax.set_xlabel((f"{words.ratio}, predicted by a formula (no noise: no interval);\n" if predicted else
                   f"{words.ratio} (paired, {_level(pts)} interval);\n") + ", ".join(drawn), fontsize=9)
    fig.tight_layout()
    return _save(fig, out, words.name, plt)


def _ucurves(ctx, out: Path, plt, marks: list[tuple[str, dict[str, Any], str]]) -> list[str]:
    """The law's two factors at the target (N, D) over the search box: predicted loss against
    d/sqrt(N) at the box's best r, and against r at the box's best d/sqrt(N), with the bootstrap
    band where the law has one, the target loss, and where the baseline and chosen shapes
    (``marks``: label, ``describe`` dict, colour) sit on each axis, each with a dot at its own
    predicted loss on its own curve (the law at that shape's other coordinate, in its colour). The curves run past the box to every marked shape (the part outside the box
    shaded), so a shape outside the box still reads off a curve."""
    import numpy as np

    cfg = ctx.cfg
    s = cfg.search_space
    x1 = np.geomspace(*s.hidden_over_sqrt_n, 120)
    x2 = np.geomspace(*s.mlp_to_attn, 120)

    def span(box, key):
        vals = [float(arch[key]) for _, arch, _ in marks if arch.get(key)]
        lo, hi = min([box[0], *vals]), max([box[1], *vals])
        return np.geomspace(lo / 1.1 if lo < box[0] else lo, hi * 1.1 if hi > box[1] else hi, 160)
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
    for ax, xs, box, fixed, key, name in (
            (axes[0], span(s.hidden_over_sqrt_n, "hidden_over_sqrt_n"), s.hidden_over_sqrt_n, best2,
             "hidden_over_sqrt_n", "d / sqrt(N)"),
            (axes[1], span(s.mlp_to_attn, "mlp_to_attn_ratio"), s.mlp_to_attn, best1, "mlp_to_attn_ratio",
             "r = MLP / attention")):
        a, b = (xs, np.full_like(xs, fixed)) if key == "hidden_over_sqrt_n" else (np.full_like(xs, fixed), xs)
        y, boot = curve(a, b)
        ax.plot(xs, y, c="tab:blue", label="law at the box's best")
        if boot is not None:
            lo, hi = np.quantile(boot, [0.05, 0.95], axis=0)
            ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.15, label="90% bootstrap band")
        outside = [(xs[0], box[0]), (box[1], xs[-1])]
        for k, (left, right) in enumerate(o for o in outside if o[1] > o[0]):
            ax.axvspan(left, right, color="tab:gray", alpha=0.15, lw=0, label=None if k else "outside the search box")
        ax.axhline(ctx.target_loss, ls="--", c="tab:red", label=f"target loss {ctx.target_loss:.4g}")
        for label, arch, color in marks:
            own, _ = curve(np.array([float(arch["hidden_over_sqrt_n"])]), np.array([float(arch["mlp_to_attn_ratio"])]))
            # the shape's own curve (its other coordinate held), so its dot lies on a curve drawn for it
            mine = float(arch["mlp_to_attn_ratio"] if key == "hidden_over_sqrt_n" else arch["hidden_over_sqrt_n"])
            if not np.isclose(mine, fixed, rtol=1e-3):
                a2, b2 = (xs, np.full_like(xs, mine)) if key == "hidden_over_sqrt_n" else (np.full_like(xs, mine), xs)
                ax.plot(xs, curve(a2, b2)[0], c=color, lw=1.2, alpha=0.85,
                        label=f"law at the {label}'s {'r' if key == 'hidden_over_sqrt_n' else 'd/sqrt(N)'} = {mine:.3g}")
            ax.axvline(arch[key], ls=":", c=color, label=f"{label} ({arch[key]:.3g}; its loss {float(own[0]):.4g})")
            ax.scatter([arch[key]], [float(own[0])], c=color, s=30, zorder=5)
        log_axis(ax, "x")
        other = f"r = {fixed:.2f}" if key == "hidden_over_sqrt_n" else f"d/sqrt(N) = {fixed:.3f}"
        ax.set_xlabel(f"{name}  (curve at {other}, the box's best)")
        ax.set_ylabel("predicted loss")
        legend(ax, fontsize=7.5)
    fig.suptitle(f"law factors at N={cfg.params:.3g}, D={cfg.tokens:.3g} over the search box")
    fig.tight_layout()
    return _save(fig, out, "ucurves", plt)


def active_plan_summary(out: Path) -> dict[str, Any] | None:
    """The active proxy plan's decisions (``proxies/active/decisions.jsonl``), each with its
    reason and the optimum's interval half-width before it and after its run was fitted."""
    folder = out / "proxies" / "active"
    path = folder / "decisions.jsonl"
    if not path.is_file():
        return None

    events = read_jsonl_lines(path)  # a torn last line (a worker killed mid-append) is skipped
    fits = [e for e in events if e["event"] == "fit"]
    plan = json.loads((folder / "plan.json").read_text()) if (folder / "plan.json").is_file() else {}

    def hw(iv):
        return None if iv is None else max(iv["half_width_hidden_over_sqrt_n"], iv["half_width_mlp_to_attn_ratio"])

    level = {q["run_id"]: q["level"] for q in plan.get("pool", [])}
    decisions = []
    for step, e in enumerate((e for e in events if e["event"] == "propose"), 1):
        after = next((f for f in fits if e["run_id"] in f["runs"]), None)
        decisions.append({"step": step, **{k: e.get(k) for k in (
            "run_id", "params", "tokens", "hidden_over_sqrt_n", "mlp_to_attn_ratio", "flops", "reason",
            "expected_half_width_after", "worker")}, "level": level.get(e["run_id"]),
            "half_width_before": hw(e.get("interval_before")),
            "half_width_after": hw(after["interval"]) if after else None})
    stop = next((e for e in reversed(events) if e["event"] == "stop"), None)
    pool = plan.get("pool", [])
    runs = {d["run_id"]: d["flops"] for d in decisions}  # a run proposed again counts once
    return {"plan": "active", "settings": plan.get("settings"), "decisions": decisions, "stop": stop,
            "runs": len(runs), "flops": sum(runs.values()),
            "grid_runs": len(pool), "grid_flops": sum(p["flops"] for p in pool),
            "interval_trace": [{"flops_spent": f["flops_spent"], "n_runs": f["n_runs"], "interval": f["interval"],
                                "optimum": f["optimum"]} for f in fits],
            "pool": pool, "folder": str(folder)}


def interval_trend(trace: list[dict[str, Any]]) -> str:
    """How the optimum's interval changed over the plan, as a title says it: ``shrank``, ``grew``
    or ``changed`` (one coordinate each way), from the first to the last finite half-widths."""
    keys = ("half_width_hidden_over_sqrt_n", "half_width_mlp_to_attn_ratio")
    ends = [[t["interval"].get(k) for t in trace if (t["interval"].get(k) or 0) > 1e-4] for k in keys]
    moves = {("shrank" if w[-1] < w[0] else "grew" if w[-1] > w[0] else "held") for w in ends if len(w) > 1}
    if not moves:
        return "changed (too few intervals to compare)"
    return moves.pop() if len(moves) == 1 else "changed (" + ", ".join(
        f"{lab} {'shrank' if w[-1] < w[0] else 'grew'}" for lab, w in zip(("d/sqrt(N)*", "r*"), ends) if len(w) > 1) + ")"


def _interval_label(iv: dict[str, Any] | None) -> str:
    """``90% joint`` (both coordinates together) or ``90%`` (each coordinate, older logs)."""
    if not iv:
        return "90%"
    return f"{iv['level']:.0%} joint" if iv.get("method") == "simultaneous" else f"{iv['level']:.0%}"


def _reason_kind(reason: str | None) -> str:
    r = reason or ""
    if r.startswith("initial design"):
        return "initial design"
    if r.startswith("space-filling"):
        return "space-filling (no law yet)"
    return "acquisition: most shrinkage per FLOP"


def active_plot(plan: dict[str, Any], out: Path, plt) -> list[str]:
    """Three panels, each readable alone: (1) the half-width of the optimum's interval, one line
    per coordinate, against the share of the full grid's FLOPs spent, with the tolerance, the
    budget, and a coordinate pinned at the fit's bound drawn as a triangle at the top ("no
    interval": the optimum lies outside the data); (2) the interval itself, one row per
    coordinate (they have different scales), with the box's range shaded and the fitted optimum;
    (3) the chosen runs in the box, coloured by why they were chosen, shaped by size, numbered in
    order (a run proposed again shares its point: "2,8"), with the last interval and the fitted
    optimum (one outside the box drawn at its edge and named)."""
    import numpy as np

    fig = plt.figure(figsize=(17, 6.6))
    gs = fig.add_gridspec(2, 3, width_ratios=[1.1, 1.0, 1.25], hspace=0.12, wspace=0.3)
    a1 = fig.add_subplot(gs[:, 0])
    a3x = fig.add_subplot(gs[0, 1])
    a3r = fig.add_subplot(gs[1, 1], sharex=a3x)
    a2 = fig.add_subplot(gs[:, 2])
    tr = plan["interval_trace"]
    grid = plan.get("grid_flops") or 0.0
    settings = plan.get("settings") or {}
    unit, xlab = (grid, "share of the full grid's proxy FLOPs spent (6ND)") if grid > 0 else \
        (1.0, "proxy training FLOPs spent (6ND)")
    steps = np.cumsum([d["flops"] for d in _first_proposals(plan["decisions"])]) / unit
    right = max([*steps, (settings.get("budget_flops") or 0.0) / unit, 0.0]) * 1.04 or None
    lab_iv = _interval_label(tr[-1]["interval"] if tr else None)
    coords = (("hidden_over_sqrt_n", "d/sqrt(N)*", "tab:blue", "o-"), ("mlp_to_attn_ratio", "r*", "tab:orange", "s-"))
    if tr:
        f = np.array([t["flops_spent"] for t in tr]) / unit
        hws = {key: np.array([t["interval"][f"half_width_{key}"] for t in tr], float) for key, *_ in coords}
        # pinned: flagged, or (older logs) a width of zero: every resample piled on the fit's bound
        pins = {key: np.array([bool((t["interval"].get("pinned_at_bound") or [False, False])[j])
                               or t["interval"][f"half_width_{key}"] < 1e-4 for t in tr])
                for j, (key, *_) in enumerate(coords)}
        finite = np.concatenate([hws[k][~pins[k] & (hws[k] > 0)] for k in hws])
        top = max([1.0, *finite, settings.get("tolerance") or 0.0]) * 2.0
        bottom = min([*finite, settings.get("tolerance") or 1.0, 1.0]) / 2.0
        for key, lab, c, m in coords:
            ok = ~pins[key]
            a1.plot(f[ok], hws[key][ok], m, c=c, label=f"{lab}")
            if pins[key].any():
                a1.plot(f[pins[key]], np.full(int(pins[key].sum()), top * 0.8), "^", c=c, ms=10, mec="k",
                        label=f"{lab}: pinned at the fit's bound (optimum outside the data: no interval)")
        a1.set_ylim(bottom, top)
        first = f[0]
    else:
        first = None
        a1.text(0.5, 0.5, "no interval yet (initial design only)", transform=a1.transAxes, ha="center")
    if first is not None and first > 0:
        a1.axvspan(0, first, color="tab:gray", alpha=0.12, label="initial design (no law yet)")
    if settings.get("tolerance"):
        a1.axhline(settings["tolerance"], ls="--", c="tab:red", label=f"tolerance {settings['tolerance']:g}: stop below")
    if settings.get("budget_flops"):
        a1.axvline(settings["budget_flops"] / unit, ls=":", c="k", label="budget")
    a1.set_xlim(0, right)
    log_axis(a1, "y")
    a1.set_xlabel(xlab)
    a1.set_ylabel(f"relative half-width of the {lab_iv} interval")
    a1.set_title(f"how the optimum's interval {interval_trend(tr)}")
    legend(a1, fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=1, borderaxespad=0.0)

    pool = plan["pool"]
    px = [p["hidden_over_sqrt_n"] for p in pool] or [d["hidden_over_sqrt_n"] for d in plan["decisions"]]
    py = [p["mlp_to_attn_ratio"] for p in pool] or [d["mlp_to_attn_ratio"] for d in plan["decisions"]]
    box = (min(px), max(px), min(py), max(py)) if px else None
    if not tr:
        pins = {key: np.array([], bool) for key, *_ in coords}
    for j, (ax, (key, lab, c, _)) in enumerate(zip((a3x, a3r), coords)):
        if tr:
            f = np.array([t["flops_spent"] for t in tr]) / unit
            lo = np.array([t["interval"][key][0] for t in tr])
            hi = np.array([t["interval"][key][1] for t in tr])
            fe, lo, hi = np.append(f, right or f[-1]), np.append(lo, lo[-1]), np.append(hi, hi[-1])  # held to the end
            ax.fill_between(fe, lo, hi, color=c, alpha=0.3, step="post", label=f"{lab_iv} interval")
            opt = np.array([t["optimum"][j] if t.get("optimum") else np.nan for t in tr], float)
            ax.plot(f, opt, "o-", c=c, ms=4, label="fitted optimum")
            vals = [*lo, *hi, *opt[np.isfinite(opt)]]
            if box:
                ax.axhspan(box[2 * j], box[2 * j + 1], color="tab:green", alpha=0.1, label="the box's range")
                vals += [box[2 * j], box[2 * j + 1]]
            ax.set_ylim(min(vals) / 1.4, max(vals) * 1.4)
            if pins[key][-1]:
                ax.text(0.02, 0.9, "last interval pinned at the fit's bound:\nthe optimum lies outside the data",
                        transform=ax.transAxes, fontsize=8, va="top", color=c)
            log_axis(ax, "y")
            ax.set_xlim(0, right)
            legend(ax, fontsize=7, loc="lower left")
        else:
            ax.text(0.5, 0.5, "no interval yet", transform=ax.transAxes, ha="center")
        ax.set_ylabel(lab)
    a3x.set_title("the interval of the optimum, per coordinate")
    a3x.tick_params(labelbottom=False)
    a3r.set_xlabel(xlab)

    a2.scatter(px, py, s=70, facecolors="none", edgecolors="tab:gray", label="candidates (the grid)")
    kinds = {"initial design": "tab:gray", "space-filling (no law yet)": "tab:purple",
             "acquisition: most shrinkage per FLOP": "tab:red"}
    levels = sorted({d["level"] for d in plan["decisions"]}, key=lambda v: (v is None, v))
    markers = dict(zip(levels, "os^Dv<>p"))
    for lv in levels:
        for kind, c in kinds.items():
            ds = [d for d in plan["decisions"] if d["level"] == lv and _reason_kind(d.get("reason")) == kind]
            if ds:
                a2.scatter([d["hidden_over_sqrt_n"] for d in ds], [d["mlp_to_attn_ratio"] for d in ds], color=c,
                           marker=markers[lv], s=46, edgecolors="k", linewidths=0.5,
                           label=f"{kind}, N~{np.median([d['params'] for d in ds]):.3g}")
    at: dict[tuple, list[str]] = {}
    for d in plan["decisions"]:
        at.setdefault((round(d["hidden_over_sqrt_n"], 6), round(d["mlp_to_attn_ratio"], 6)), []).append(str(d["step"]))
    for (x, y), labels in at.items():
        a2.annotate(",".join(labels), (x, y), fontsize=8, xytext=(5, 4), textcoords="offset points")
    if box:
        pad = lambda lo, hi: (lo / (hi / lo) ** 0.12, hi * (hi / lo) ** 0.12)  # noqa: E731
        xl, yl = pad(box[0], box[1]), pad(box[2], box[3])
        a2.set_xlim(*xl)
        a2.set_ylim(*yl)
        if tr:
            iv = tr[-1]["interval"]
            (x0, x1), (y0, y1) = iv["hidden_over_sqrt_n"], iv["mlp_to_attn_ratio"]
            cx0, cx1, cy0, cy1 = max(x0, xl[0]), min(x1, xl[1]), max(y0, yl[0]), min(y1, yl[1])
            if cx0 < cx1 and cy0 < cy1:
                a2.add_patch(plt.Rectangle((cx0, cy0), cx1 - cx0, cy1 - cy0, fill=True, alpha=0.12,
                                           color="tab:red", label=f"last {lab_iv} interval (clipped to the view)"))
        if tr and tr[-1]["optimum"]:
            ox, oy = tr[-1]["optimum"]
            inside = xl[0] <= ox <= xl[1] and yl[0] <= oy <= yl[1]
            cx, cy = min(max(ox, xl[0]), xl[1]), min(max(oy, yl[0]), yl[1])
            a2.scatter([cx], [cy], marker="*" if inside else "X", s=220, c="gold", edgecolors="k", zorder=5,
                       clip_on=False, label="fitted optimum" if inside else
                       f"fitted optimum ({ox:.3g}, {oy:.3g}): outside the box, drawn at its edge")
    log_axis(a2, "x")
    log_axis(a2, "y")
    a2.set_xlabel("d / sqrt(N)")
    a2.set_ylabel("r = MLP / attention")
    a2.set_title("runs chosen: colour = why, shape = size, number = order")
    legend(a2, fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=1, borderaxespad=0.0)
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.30, top=0.93)
    return _save(fig, out, "active_proxies", plt)


def _first_proposals(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decisions, a run proposed again counted once (its FLOPs are spent once)."""
    seen, out = set(), []
    for d in decisions:
        if d["run_id"] not in seen:
            seen.add(d["run_id"])
            out.append(d)
    return out


def _proxy_loss_txt(q: dict[str, Any] | None, g0: int) -> str:
    """A GQA step's proxy loss cell: the mean over its paired runs, its difference from the baseline
    GQA variant's with the noise margin, or why it was not compared."""
    if not q:
        return "-"
    if q.get("reference"):
        return f"{q['mean_loss']:.4f} (reference)" if q.get("mean_loss") is not None else "no run ok"
    if q.get("worse") is None:
        return "not checkable"
    noise = f" +- {q['margin']:.2%}" if q.get("noise_sd") is not None else " (noise unknown)"
    return f"{q['mean_loss']:.4f} ({q['mean_rel_diff']:+.2%}{noise} vs GQA {g0}, {q['pairs']} pairs)"


def gqa_markdown(g: dict[str, Any], words: ObjectiveWords | None = None) -> list[str]:
    """The local GQA search's table (each variant's predicted and proxy loss beside its ratio of the
    study's objective, ``words``), how loss was checked, and why the walk stopped each way."""
    g0 = g["baseline_gqa"]
    words = words or objective_words("throughput")
    lines = [f"| GQA | heads/KV | pred. loss | feasible | proxy loss | {words.column} | vs baseline | vs start GQA | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for st in g["steps"]:
        pl = f"{st['predicted_loss']:.4f}" if st["predicted_loss"] is not None else "-"
        tp = words.text(st["throughput"])
        r0, r1 = (_ratio_txt(st.get(k)) for k in ("ratio", "ratio_vs_start"))
        hk = f"{st.get('n_heads')}/{st.get('n_kv_heads')}" if st.get("n_heads") else "-"
        ql = "unverified" if g.get("loss_check") == "unverified" and st["feasible"] else \
            _proxy_loss_txt(st.get("proxy_loss"), g0)
        lines.append(f"| {st['gqa']} | {hk} | {pl} | {st['feasible']} | {ql} "
                     f"| {tp} | {r0} | {r1} | {st['note']} |")
    lines.append("")
    b = g.get("bounds") or {}
    bound = ", ".join(x for x in (f"GQA <= {b['max_gqa']}" if b.get("max_gqa") is not None else "",
                                  f"KV heads >= {b['min_kv_heads']}" if b.get("min_kv_heads") is not None else "") if x)
    if g.get("loss_check") == "unverified":
        lines.append(f"- **GQA's effect on loss is unverified**: the study trains no proxies (a law file only), so no "
                     f"variant's loss was checked; the walk stays within {bound or 'no bound'} ({b.get('from')}).")
    elif g.get("loss_check") == "proxies" and not g.get("proxy_runs"):
        lines.append("- Loss check at proxy scale: none needed, no other GQA variant keeps N and r at this head total.")
    elif g.get("loss_check") == "proxies":
        pr = g.get("proxy_runs") or {}
        q = next((st["proxy_loss"] for st in g["steps"] if st.get("proxy_loss") and not st["proxy_loss"].get("reference")
                  and st["proxy_loss"].get("noise_source")), None)
        lines.append(f"- Loss checked at proxy scale: every variant walked to trained beside GQA {g0} at the proxy sizes "
                     + ", ".join(f"{n:.3g}" for n in pr.get("sizes", [])) + f" of sweep {pr.get('sweep')} "
                     f"(same d/sqrt(N) and r, same token budget, seeds {pr.get('seeds')} and data order), in "
                     f"`{pr.get('folder')}`; {pr.get('trained_now', 0)} run(s) trained by this run, "
                     f"{pr.get('reused', 0)} reused. A variant stops the walk when its mean paired loss difference "
                     f"exceeds the slack plus the noise margin"
                     + (f" (slack {q['slack']:.2%}; noise: {q['noise_source']}, one-sided {q['level']:.0%})" if q else "")
                     + "." + (f" Bounds: {bound}." if bound else ""))
    for way, why in (g.get("stops") or {}).items():
        lines.append(f"- Walk toward {'larger GQA (fewer KV heads)' if way == 'up' else 'smaller GQA (more KV heads)'}"
                     f" ended: {why}.")
    return lines


def write_report(ctx, study, chosen: Answer | None, base: ArchSpec, state, gqa: dict[str, Any] | None = None,
                 prs: dict[str, Any] | None = None, verify: dict[str, Any] | None = None) -> dict[str, Any]:
    """The study folder's summary, report and plots. The baseline's throughput is the mean of
    its paired rounds across trials (it is measured beside every candidate)."""
    cfg = ctx.cfg
    out = ctx.out
    b = ctx.ref_batch

    base_ts = [t.user_attrs["baseline_throughput"] for t in _complete(study)
               if t.user_attrs.get("baseline_throughput") is not None]
    base_point = {"architecture": describe(base),
                  "throughput": statistics.fmean(base_ts) if base_ts else None,
                  "throughput_std": statistics.stdev(base_ts) if len(base_ts) > 1 else None,
                  "throughput_note": f"mean over the {len(base_ts)} paired measurements beside the candidates",
                  "predicted_loss": baseline_loss(cfg, ctx.law, base),
                  "predicted_loss_interval": predicted_interval(base, ctx),
                  "size_note": baseline_note(cfg, base)}
    chosen_point = chosen.summary(base_point["throughput"], out / "chosen" / "config.json") if chosen else None
    if chosen_point and not chosen_point["is_baseline"]:
        chosen_point["baseline_throughput_same_rounds"], chosen_point["measurement_key"] = \
            paired_baseline_throughput(study, chosen)
    _add_margins(ctx, chosen, chosen_point, base_point)
    q = (chosen_point or {}).get("ratio")
    gain = q["ratio"] - 1.0 if q else (0.0 if chosen_point and chosen_point["is_baseline"] else None)
    complete = _complete(study)
    summary = {
        "study": cfg.name,
        "measurement_note": ctx.measurer.note,
        "backend": ctx.measurer.backend,
        "calibration": (f"calibrated by {calibration_label(cfg.measure.calibration)}"
                        if cfg.measure.calibration else None),
        "reference_batch_size": b,
        # measure.mode: online: what every comparison served (its ratios compare this objective)
        "online": ({"rate": cfg.measure.rate, "n_requests": cfg.measure.serving_load().n_requests,
                    "slo": to_dict(cfg.measure.slo), "objective": cfg.measure.objective}
                   if cfg.measure.online else None),
        "measured_params": cfg.measure.params,
        "instance_sd": ctx.measurer.instance_var() ** 0.5 or None,  # in every interval (measure.paired)
        "target_loss": ctx.target_loss,
        "target_source": "explicit" if cfg.target.loss is not None else
                         f"baseline predicted loss x (1 + {cfg.target.slack})",
        "baseline": base_point,
        "chosen": chosen_point,
        "throughput_gain_vs_baseline": gain,
        "significantly_faster": bool(q and q.get("significantly_faster")),
        "chance_constraint": cfg.target.confidence,
        "loss_margins": margins_summary(ctx),
        "pareto": [p | {"loss_margin": p["loss_margin"] or loss_margin(ctx, ArchSpec.from_dict(p["spec"]))}
                   for p in pareto_set(study)],
        "trials": {"total": len(study.trials), "complete": len(complete),
                   "distinct_shapes": len({t.user_attrs.get("spec_key") for t in complete}),
                   "feasible": sum(1 for t in complete if trial_is_feasible(t))},
        "proxy_health": proxies_health(out / "proxies"),  # runs retuned or left out (None: checks off)
        "law": {"file": str(out / "law.json") if (out / "law.json").is_file() else cfg.law.file,
                "form": getattr(ctx.law, "law", None) or cfg.law.form, "status": getattr(ctx.law, "status", None),
                "warnings": list(getattr(ctx.law, "warnings", []) or []),
                "metrics": getattr(ctx.law, "metrics", None)},
        "stages": state.data,
        "measurements_taken_this_run": ctx.measurer.measured_now,
        "optuna_storage": redact(storage_url(ctx.cfg, out)),
        "provenance": provenance(extra_packages=(*backend_packages(), "lm_eval")),
        "config": json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else None,
    }
    summary["build_tolerance"] = build_tolerance(ctx)
    seeded = seeded_shapes_summary(ctx, study, chosen)
    if seeded:
        summary["seed_shapes"] = seeded
    if cfg.measure.targets:
        summary["targets"] = targets_summary(cfg, q, summary["pareto"])
    if gqa is not None:
        summary["gqa_search"] = gqa
    if prs is not None:
        summary["predict_rank_select"] = prs
    if verify is not None:  # archsearch.search.verify: the report opens with it
        summary["verify"] = verify
    plan = active_plan_summary(out)
    if plan is not None:
        summary["proxy_plan"] = {k: v for k, v in plan.items() if k != "pool"}
    write_trials_csv(study, out / "trials.csv")
    words = study_objective(cfg)
    summary["objective"] = dataclasses.asdict(words)  # what every ratio, column and axis compares
    summary["plots"] = _plots(ctx, study, chosen, base_point, out / "plots", words)
    if summary.get("targets"):
        t = summary["targets"]
        made = targets_figure(out / "plots" / "targets", [(row["shape"], row["per_target"]) for row in
                                                          [t["answer"], *t["pareto"][:3]]],
                              f"{words.name} ratio per deployment target\n(the objective: their {t['objective']})",
                              words)
        summary["plots"] += [str(Path(p).relative_to(out)) for p in made]
    write_json(out / "summary.json", summary, default=str)
    atomic_write(out / "report.md", render_markdown(summary))
    write_study_cards(out, summary)  # chosen/README.md (and the chosen shape's trained models')
    return summary


def build_tolerance(ctx) -> dict[str, Any]:
    """How close to the budget a built shape lands (``search_space.build``), and how close a
    seeded published shape may be (``optuna.seed_tolerance``, where shapes are seeded)."""
    bs, o = ctx.build, ctx.cfg.optuna
    return {"params_tolerance": bs.tolerance, "r_tolerance": bs.r_tolerance, "on_r_drift": bs.on_r_drift,
            "hidden_multiple": bs.hidden_multiple, "ffn_multiple": bs.ffn_multiple,
            "seed_tolerance": o.seed_tolerance if o.seed_shapes else None}


def seeded_shapes_summary(ctx, study, chosen: Answer | None) -> list[dict[str, Any]]:
    """Each seeded published shape's trial (``optuna.seed_shapes``): the shape, its realised N and
    its distance from the budget, its predicted loss and margin, whether it was feasible and
    measured, its ratio to the baseline and its rank among the measured feasible shapes."""
    done = [t for t in _complete(study) if t.user_attrs.get("seed_shape")]
    if not done:
        return []
    # ranked by the objective (the ratio to the baseline in a paired study), one entry per shape
    ranked = sorted({t.user_attrs.get("spec_key"): t.values[0] for t in _complete(study)
                     if was_measured(t) and trial_is_feasible(t)}.values(), reverse=True)
    rows = []
    for t in done:
        spec = ArchSpec.from_dict(t.user_attrs["spec"])
        n = t.user_attrs.get("realised_n_params_non_embedding")
        measured = was_measured(t) and trial_is_feasible(t)
        rows.append({"name": t.user_attrs["seed_shape"], "trial": t.number, "architecture": describe(spec),
                     "params_error": n / ctx.cfg.params - 1 if n else None,
                     "predicted_loss": t.user_attrs.get("predicted_loss"),
                     "loss_margin": t.user_attrs.get("loss_margin"),
                     "feasible": bool(t.user_attrs.get("feasible_loss")), "measured": measured,
                     "throughput": _throughput(t) if measured else None, "ratio": t.user_attrs.get("ratio"),
                     "rank": 1 + sum(v > t.values[0] for v in ranked) if measured else None,
                     "of": len(ranked), "why_not_measured": t.user_attrs.get("infeasible_reason"),
                     "chosen": bool(chosen and chosen.trial == t.number and chosen.gqa is None)})
    return rows


def seeded_markdown(s: dict[str, Any]) -> list[str]:
    rows = s.get("seed_shapes") or []
    bt = s.get("build_tolerance") or {}
    lines = ["## Search space and published shapes", "",
             f"- Build tolerance: a built shape's non-embedding N is within **{bt.get('params_tolerance', 0):.1%}** "
             f"of the budget and its r within {bt.get('r_tolerance', 0):.0%} of the request ({bt.get('on_r_drift')} "
             f"beyond), widths snapped to {bt.get('hidden_multiple')} and the FFN to {bt.get('ffn_multiple')}."]
    if bt.get("seed_tolerance") is not None:
        lines.append(f"- Published shapes (`optuna.seed_shapes`) are measured as published, not rebuilt: their N "
                     f"may be up to {bt['seed_tolerance']:.0%} from the budget; each is reported with its realised N.")
    if rows:
        lines += ["", "| published shape | trial | hidden | heads/KV | ffn | N (vs budget) | pred. loss | margin to target "
                  "| ratio vs baseline | rank among measured | answer |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            a = r["architecture"]
            q = r.get("ratio") or {}
            rt = ("-" if not q else f"x{q['ratio']:.3f} (predicted)" if q.get("predicted")
                  else f"x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}]")
            lines.append(f"| {r['name']} | {r['trial']} | {a['hidden_size']} | {a['n_heads']}/{a['n_kv_heads']} | {a['ffn']} | "
                         f"{a['n_params_non_embedding'] / 1e6:,.0f}M ({r['params_error']:+.1%}) | {r['predicted_loss']:.4f} | "
                         f"{_margin_cell(r.get('loss_margin'))} | {rt if r['measured'] else 'not measured: ' + str(r['why_not_measured'])} | "
                         f"{str(r['rank']) + ' of ' + str(r['of']) if r['rank'] else '-'} | {'**yes**' if r['chosen'] else ''} |")
    lines.append("")
    return lines


def margins_summary(ctx) -> dict[str, Any]:
    """How the report judges a margin to the target: the law's own error (and its source), the
    verdict's level, the feasibility rule, and the law's fitted range with its rule."""
    c = ctx.cfg.target.confidence
    return {"level": c or margins.DEFAULT_LEVEL, "law_error": margins.law_error(ctx.law),
            "feasibility": (f"P(loss <= target) >= {c:g}, the law's bootstrap and its own error together"
                            if c is not None else
                            "predicted loss <= target (the method's constraint); shapes within the law's error "
                            "of the target stay feasible and are marked so"),
            **margins.range_summary(ctx.law, ctx.cfg.law.allow_extrapolation)}


def _add_margins(ctx, chosen, chosen_point, base_point) -> None:
    """Each reported shape's margin to the target (``archsearch.search.margins``)."""
    base_point["loss_margin"] = loss_margin(ctx, ctx.baseline) if ctx.baseline is not None else None
    if chosen is None or chosen_point is None:
        return
    chosen_point["loss_margin"] = loss_margin(ctx, chosen.spec)
    if chosen.best_candidate is not None and chosen_point.get("best_candidate") is not None:
        chosen_point["best_candidate"]["loss_margin"] = loss_margin(ctx, chosen.best_candidate.spec)


def _margin_cell(m: dict[str, Any] | None) -> str:
    if not m:
        return "-"
    short = {"clears the target": "clears", "misses the target": "misses"}.get(m["verdict"], "within law error")
    return f"{m['margin']:+.2%} ({short}, P {m['p_within_target']:.2f})" + (" extrapolated" if m.get("extrapolated") else "")


def summary_objective(s: dict[str, Any]) -> ObjectiveWords:
    """The words of a summary's objective (``summary.json``'s ``objective``; a summary written before
    it was recorded: its online block's objective, else throughput)."""
    if s.get("objective"):
        return ObjectiveWords(**s["objective"])
    on = s.get("online")
    return objective_words(on["objective"], on.get("slo")) if on else objective_words("throughput")


def _arch_line(a: dict[str, Any]) -> str:
    return (f"{a['n_layers']} layers, hidden {a['hidden_size']}, {a['n_heads']} heads / {a['n_kv_heads']} KV "
            f"(GQA {a['gqa']}) of {a['head_dim']}, ffn {a['ffn']}; N = {a['n_params_non_embedding']:,}, "
            f"r = {a['mlp_to_attn_ratio']:.2f}, d/sqrt(N) = {a['hidden_over_sqrt_n']:.4f}")


def active_markdown(p: dict[str, Any]) -> list[str]:
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    stop = p.get("stop") or {}
    iv = stop.get("interval") or (p["interval_trace"][-1]["interval"] if p["interval_trace"] else None)
    lines = ["", "## Proxy plan: active", "",
             f"{p['runs']} runs ({len(p['decisions'])} decisions) of the grid's {p['grid_runs']}, {p['flops']:.3g} of its {p['grid_flops']:.3g} "
             f"training FLOPs ({p['flops'] / p['grid_flops']:.0%}). Stopped: {stop.get('reason', 'not yet')}."]
    if iv:
        pin = iv.get("pinned_at_bound") or [False, False]
        hw = [("pinned at the fit's bound" if pin[j] or iv[k] < 1e-4 else f"{iv[k]:.3f}") for j, k in
              enumerate(("half_width_hidden_over_sqrt_n", "half_width_mlp_to_attn_ratio"))]
        lines.append(f"Last interval ({_interval_label(iv)}): d/sqrt(N)* in [{iv['hidden_over_sqrt_n'][0]:.4f}, "
                     f"{iv['hidden_over_sqrt_n'][1]:.4f}], r* in [{iv['mlp_to_attn_ratio'][0]:.3f}, "
                     f"{iv['mlp_to_attn_ratio'][1]:.3f}] (half-widths {hw[0]}, {hw[1]})." +
                     ("".join(f" Pinned at the fit's bound (the optimum lies outside the data): {name}; the "
                              "interval is no measure of precision there and the tolerance cannot stop the plan."
                              for name, p in zip(("d/sqrt(N)*", "r*"), iv.get("pinned_at_bound") or ()) if p)))
    lines += ["Half-width: the larger relative half-width of the two, before the decision and once its "
              "run was fitted (`-`: no interval yet). Log: `proxies/active/decisions.jsonl`.", "",
              "| step | N | d/sqrt(N) | r | FLOPs | why | half-width before | after |", "|---|---|---|---|---|---|---|---|"]
    for d in p["decisions"]:
        lines.append(f"| {d['step']} | {d['params']:.3g} | {d['hidden_over_sqrt_n']:.3f} | {d['mlp_to_attn_ratio']:.2f} | "
                     f"{d['flops']:.3g} | {d['reason']} | {f(d['half_width_before'])} | {f(d['half_width_after'])} |")
    return lines


def _ratio_txt(q: dict[str, Any] | None) -> str:
    if not q:
        return "-"
    if q.get("predicted"):  # a deterministic prediction: no noise, so no interval and no rounds
        return f"x{q['ratio']:.3f}, predicted (a formula: no interval)"
    return f"x{q['ratio']:.3f}, {q['level']:.0%} interval [{q['lo']:.3f}, {q['hi']:.3f}] over {q['n']} rounds"


def ratio_verdict(q: dict[str, Any] | None, words: ObjectiveWords | None = None) -> str:
    """How a ratio to the baseline reads: a significance verdict for a measured ratio, the side
    of 1 it falls on for a prediction (which has no noise to be significant against), in the words
    of the study's objective (faster for throughput and latency, better for goodput)."""
    better, worse = (words.better, words.worse) if words is not None else ("faster", "slower")
    if not q:
        return "not compared"
    if q.get("predicted"):
        return (f"predicted {better} than the baseline" if q["ratio"] > 1 else
                f"predicted {worse} than the baseline" if q["ratio"] < 1 else "predicted equal to the baseline")
    return (f"**significantly {better}** than the baseline" if q["significantly_faster"] else
            f"not significantly {better} than the baseline")


def paired_baseline_throughput(study, chosen: Answer | None) -> tuple[float | None, str | None]:
    """The baseline's throughput in the chosen trial's own paired rounds (the rounds its ratio
    comes from) and that measurement's key; (None, None) where the answer came from elsewhere
    (a GQA step, the kept baseline)."""
    if chosen is None or chosen.is_baseline or chosen.gqa is not None or chosen.trial is None:
        return None, None
    t = next((t for t in study.get_trials(deepcopy=False) if t.number == chosen.trial), None)
    return (t.user_attrs.get("baseline_throughput"), t.user_attrs.get("measurement_key")) if t is not None else (None, None)


def render_markdown(s: dict[str, Any]) -> str:
    lines = []
    words = summary_objective(s)
    if s.get("measurement_note"):
        lines.append(f"**Note: {s['measurement_note']}.**\n")
    lines.append(f"# Study {s['study']}\n")
    if s.get("verify"):
        lines += head_to_head_markdown(s["verify"])
    if s.get("measured_params"):
        lines.append(f"{words.name.capitalize()} was measured with every shape rebuilt at "
                     f"N = {s['measured_params']:,.0f} "
                     "non-embedding parameters (`measure.params`; same d/sqrt(N), r and GQA); the loss "
                     "predictions and the shapes below are at the study's N.\n")
    base, ch = s["baseline"], s["chosen"]
    b = s["reference_batch_size"]
    iv = lambda p: (f" ({s['chance_constraint'] or 0.9:.0%} interval {p['predicted_loss_interval'][0]:.4f}"  # noqa: E731
                    f"-{p['predicted_loss_interval'][1]:.4f})" if p.get("predicted_loss_interval") else "")
    if ch is None:
        lines.append("**No feasible shape was measured.** See trials.csv for the reasons.\n")
    else:
        cc = (f"; chance constraint: the {s['chance_constraint']:.0%} upper bound must be under the target"
              if s.get("chance_constraint") else "")
        if ch["is_baseline"]:
            bc = ch.get("best_candidate") or {}
            q = bc.get("ratio") or {}
            lines += [
                f"**Answer: keep the baseline. No feasible shape measured significantly {words.better} than it.**", "",
                f"- Best feasible candidate: {_arch_line(bc['architecture'])}: "
                f"{words.meaning} relative to the "
                f"baseline {_ratio_txt(q)}, " + (
                    f"{ratio_verdict(q, words)}." if q.get("predicted") else
                    f"entirely below 1 (significantly {words.worse})." if q.get("hi") is not None and q["hi"] < 1 else
                    "which includes 1 (a tie within the measurement's noise).")
                if q else "", ""]
        else:
            q = ch.get("ratio")
            verdict = ratio_verdict(q, words)
            t = s.get("targets")
            pb = ch.get("baseline_throughput_same_rounds")
            on = s.get("online")
            same = ((f"; {words.text(ch['throughput'])} {words.unit()} beside the baseline's "
                     f"{words.text(pb)} in the same paired rounds (trial {ch['trial']})") if pb is not None else
                    f"; {words.text(ch['throughput'])} {words.unit()}, the mean of its own rounds")
            lines += [
                f"**Answer:** {_arch_line(ch['architecture'])}.", "",
                (f"- Over {len(t['targets'])} deployment targets (the {t['objective']} of their ratios, each "
                 f"measured or predicted as the Deployment targets section says; binding: "
                 f"{q.get('binding')}): " if t else
                 f"- **Predicted, not measured**: the analytic roofline ({s.get('calibration') or 'uncalibrated'}) "
                 f"at batch {b}: " if s["backend"] == "analytic" else
                 (f"- Measured online with **{s['backend']}**'s server at {on['rate']:g} requests/s (Poisson, "
                  f"{on['n_requests']} requests per shape and round, max_num_seqs {b}), paired and alternating "
                  f"with the baseline: " if on else
                  f"- Measured with **{s['backend']}** at batch {b}, paired and interleaved with the baseline: ")) +
                f"{words.meaning if words.objective != 'throughput' else 'throughput'} **x{q['ratio']:.3f}** "
                f"the baseline's ("
                + ("a formula's figure: no noise, so no interval" if q.get("predicted") else _ratio_txt(q))
                + (f", an engine-instance sd of {s['instance_sd']:.1%} included" if s.get("instance_sd") else "")
                + f"): {verdict}" + (same + "." if not t else ".")
                if q else
                f"- Measured with **{s['backend']}** at batch {b}: {words.text(ch['throughput'])} {words.column}.",
                f"- Chosen by: {ch.get('source')}. Config: `chosen/config.json` (loads in transformers and vLLM).",
                ""]
        lines += [f"- Predicted loss **{ch['predicted_loss']:.4f}**{iv(ch)} against the target "
                  f"**{s['target_loss']:.4f}** ({s['target_source']}{cc}); baseline predicted "
                  f"{base['predicted_loss']:.4f}{iv(base)}"
                  + (f" ({base['size_note']})." if base.get("size_note") else ".")]
        m = (ch.get("best_candidate") or {}).get("loss_margin") if ch["is_baseline"] else ch.get("loss_margin")
        if m:
            lines.append(f"- {'Best candidate' if ch['is_baseline'] else 'Loss'}: **{describe_margin(m)}**"
                         + (f"; **extrapolated**: {m['extrapolated']}" if m.get("extrapolated") else "") + ".")
        lines.append("")
    if s.get("targets"):
        lines += targets_markdown(s["targets"])
    lines += seeded_markdown(s)
    lines += ["## Baseline", "", _arch_line(base["architecture"]), ""]
    lines += [f"## Feasible Pareto set ({words.name} ratio to the baseline vs predicted loss)", "",
              f"| trial | hidden | heads/KV | ffn | r | d/sqrt(N) | pred. loss | margin to target | {words.column} | ratio [interval] "
              "| tied with best |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    front = s["pareto"]
    for p in front[:10]:
        a = describe(ArchSpec.from_dict(p["spec"]))
        rt = ("-" if not p.get("ratio") else f"x{p['ratio']['ratio']:.3f} (predicted)" if p["ratio"].get("predicted")
              else f"x{p['ratio']['ratio']:.3f} [{p['ratio']['lo']:.3f}, {p['ratio']['hi']:.3f}]")
        tie = "best" if p is front[0] else ("yes" if tied_with(front[0], p) else "no")
        lines.append(f"| {p['trial']} | {a['hidden_size']} | {a['n_heads']}/{a['n_kv_heads']} | {a['ffn']} | "
                     f"{a['mlp_to_attn_ratio']:.2f} | {a['hidden_over_sqrt_n']:.4f} | {p['predicted_loss']:.4f} | "
                     f"{_margin_cell(p.get('loss_margin'))} | {words.text(p['throughput'])} | {rt} | "
                     f"{tie} |")
    if "gqa_search" in s:
        g = s["gqa_search"]
        lines += ["", f"## Local GQA search (baseline GQA {g['baseline_gqa']})", "",
                  "Query heads traded against KV heads at a fixed attention share (N and r held).", ""]
        lines += gqa_markdown(g, words)
    if "predict_rank_select" in s:
        p = s["predict_rank_select"]
        rel = (p.get("released") or {}).get("trial")
        lines += ["", f"## Predict-rank-select: the top {len(p['candidates'])} trained and evaluated "
                  f"({p.get('tasks')})", "", f"Release rule: {p['rule']}.", "",
                  f"| trial | hidden | heads/KV | ffn | {words.column} | pred. loss | held-out loss | downstream acc. | released |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in p["candidates"]:
            sp = c["spec"]
            f = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else "-"  # noqa: E731
            lines.append(f"| {c['trial']} | {sp['hidden_size']} | {sp['n_heads']}/{sp['n_kv_heads']} | {sp['ffn']} | "
                         f"{words.text(c.get('throughput'))} | {f(c.get('predicted_loss'), '.4f')} | "
                         f"{f(c.get('eval_loss'), '.4f')} | {f(c.get('downstream_accuracy'), '.4f')} | "
                         f"{'**yes**' if c['trial'] == rel else ''} |")
    if s.get("proxy_plan"):
        lines += active_markdown(s["proxy_plan"])
    law = s["law"]
    lines += ["", "## Law", "", f"{law['form']} ({law['status']}), file `{law['file']}`."]
    lm = s.get("loss_margins")
    if lm:
        e = lm.get("law_error")
        lines.append("- its error against trained models: " + (
            f"{e['relative_sd']:.2%} of the loss (sd; {e['source']})" if e else
            "not stated (no held-out size): margins rest on the bootstrap alone"))
        lines.append(f"- loss constraint: {lm['feasibility']}; a margin is resolved when P(loss <= target) "
                     f">= {lm['level']:.0%} (clears) or <= {1 - lm['level']:.0%} (misses), else the shape is "
                     "within the law's error of the target")
        rg = lm.get("range")
        if rg:
            box = ", ".join(f"{name} [{b[0]:.4g}, {b[1]:.4g}]" if b else f"{name} not stated"
                            for name, b in (("d/sqrt(N)", rg.get("hidden_over_sqrt_n")), ("r", rg.get("mlp_to_attn"))))
            lines.append(f"- fitted range: {box} ({rg.get('source')}); {lm['rule']}")
        else:
            lines.append(f"- fitted range: {lm['rule']}")
    h = s.get("proxy_health")
    if h:
        lines.append(f"- proxy health ({', '.join(h['sweeps'])}): {h.get('retuned', 0)} runs retuned, "
                     f"{h.get('non_compliant', 0)} non-compliant and left out of the fit")
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
              f"This report: {pv['time_utc']} on {pv['host']} ({(pv.get('device') or {}).get('name')}), "
              f"git {pv['git']}; " + ", ".join(f"{k} {v}" for k, v in pv["versions"].items() if v) + ".",
              "Each stage's runs below, and each measurement in `measurements.jsonl`, carry where and "
              "when they were made.", "", "| stage | seconds | runs (UTC time, host, device, git) |",
              "|---|---|---|"]
    for name, st in s["stages"].items():
        runs = "; ".join(f"{r.get('time_utc')} {r.get('host')} {r.get('device')} {r.get('git')} ({r.get('seconds')} s)"
                         for r in st.get("runs") or []) or "not recorded (a study from before per-stage provenance)"
        lines.append(f"| {name} | {st.get('seconds')} | {runs} |")
    lines.append("")
    return "\n".join(lines) + "\n"

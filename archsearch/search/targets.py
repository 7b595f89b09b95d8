"""Deployment targets: one shape chosen for several places it will serve (docs/search.md,
"Deployment targets").

A study may name several targets under ``measure.targets`` (a device, an engine, a batch size and
lengths, and a weight). Every candidate is compared with the baseline on every target, each
through its own :class:`~archsearch.search.measurements.Measurer` (the ``measure`` block with the
target's settings, so its measurements are keyed apart in the one store): measured paired by a
real engine where the target names one, predicted by the analytic roofline with the target's
calibration where it names ``analytic`` (a prediction: labelled so, its interval zero-width).
The objective is one aggregate of the per-target throughput ratios (``optuna.target_objective``):
the worst ratio over the targets (the default: no target loses more than the answer says), or
their weighted geometric mean. The same aggregate ranks the seed shapes and drives the local GQA
search (:func:`aggregate_ratio`), so every stage answers the same question.

Without ``measure.targets`` none of this runs: the ``measure`` block is the one target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.benchmarks import BenchSettings, measure
from archsearch.benchmarks.base import backend_class
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks.workloads import ObjectiveWords, objective_score, objective_words
from archsearch.errors import ArchsearchError
from archsearch.figures import save
from archsearch.logs import get_logger
from archsearch.search.deployment import AGGREGATES, DeploymentTarget, target_measure
from archsearch.search.measurements import Measurer, check_result_limits
from archsearch.search.trials import record_measurement, set_constraint


@dataclass(frozen=True)
class StudyView:
    """The study config as one target measures it; :meth:`named` renames a ``measure.X`` error
    raised in its checks to ``measure.targets[i].X``."""
    cfg: Any
    index: int | None = None

    @contextlib.contextmanager
    def named(self):
        try:
            yield
        except ArchsearchError as e:
            if self.index is None or not e.field.startswith("measure."):
                raise
            name = {"reference_batch_size": "batch_size"}.get(e.field.removeprefix("measure."),
                                                              e.field.removeprefix("measure."))
            raise type(e)(f"measure.targets[{self.index}].{name}", e.problem,
                          (e.fix or "").replace("measure.reference_batch_size", f"measure.targets[{self.index}]"
                                                ".batch_size")) from None


def study_views(cfg) -> list[StudyView]:
    """One :class:`StudyView` per deployment target, or the study itself without targets."""
    if not cfg.measure.targets:
        return [StudyView(cfg)]
    return [StudyView(dataclasses.replace(cfg, measure=target_measure(cfg.measure, t)), i)
            for i, t in enumerate(cfg.measure.targets)]


def describe_target(t: DeploymentTarget, m) -> str:
    """How a report names a target: device, engine, batch, lengths, and how it is known."""
    engine = m.bench.backend
    how = "measured"
    if t.workload is not None:
        cal = m.calibration
        serve = (f"online at {m.bench.engine_args.get('rate')} requests/s, simulated" if m.bench.backend == "simulated"
                 else f"batch {m.ref_batch}, roofline")
        return (f"workload {t.workload} on {m.bench.device_spec or 'local device'}: {m.bench.input_len} in / "
                f"{m.bench.output_len} out, {serve}; objective {m.objective}; predicted "
                f"({'calibrated by ' + cal if cal else 'uncalibrated: peak figures'})")
    if m.bench.backend == "analytic":
        if m.calibration:
            engine = Calibration.load(m.calibration).engine or "engine"
            how = f"predicted (roofline calibrated by {m.calibration})"
        else:
            engine, how = "engine", "predicted (uncalibrated roofline: peak figures)"
    return (f"{m.bench.device_spec or 'local device'} x {engine}, batch {m.ref_batch}, "
            f"{m.bench.input_len} in / {m.bench.output_len} out; objective {m.objective}; {how}")


# -- the study's targets -----------------------------------------------------------------------

@dataclass
class Target:
    """A configured target with the ``measure`` block it measures with and its Measurer."""
    config: DeploymentTarget
    measure: Any  # MeasureConfig
    measurer: Any  # Measurer

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def predicted(self) -> bool:
        return backend_class(self.measurer.backend).predicted


def build_targets(cfg, store, scale=None) -> list[Target] | None:
    """The study's targets, each with its own Measurer on the study's store (None: no targets)."""
    if not cfg.measure.targets:
        return None
    out = []
    for t in cfg.measure.targets:
        m = target_measure(cfg.measure, t)
        out.append(Target(t, m, Measurer(m, store, scale=scale)))
    for t in out[1:]:  # the first target's note is the study's (the report's first line says it)
        if t.measurer.note:
            get_logger("search").warning(f"[search] target {t.name}: {t.measurer.note}")
    uncal = [t.name for t in out if t.predicted and not t.measure.calibration
             and (t.measure.bench.device_spec or "cpu").lower() != "cpu"]
    if uncal:
        get_logger("search").warning(f"[search] targets {uncal} are predicted by an uncalibrated roofline (peak "
                                     "figures): give each a calibration (configs/calibration/) to trust their ratios")
    return out


def aggregate(ratios: list[float], weights: list[float], how: str) -> float:
    """The targets' ratios as one number: the worst (``worst``, weights ignored: every target must
    hold), or the weighted geometric mean (``geomean``). A missing or non-positive ratio makes the
    aggregate 0 (a target that cannot serve the shape)."""
    if how not in AGGREGATES:
        raise ArchsearchError("optuna.target_objective", f"{how!r} is unknown", f"use one of {list(AGGREGATES)}")
    if not ratios or len(ratios) != len(weights):
        raise ValueError("one weight a ratio, at least one ratio")
    if any(r is None or not r > 0 for r in ratios):
        return 0.0
    if how == "worst":
        return float(min(ratios))
    return float(math.exp(sum(w * math.log(r) for r, w in zip(ratios, weights)) / sum(weights)))


def combine(rows: list[dict[str, Any]], how: str, level: float) -> dict[str, Any]:
    """One ratio record (the keys a paired estimate has: ratio, lo, hi, level, n and the
    significance flags) aggregating the per-target rows, with the rows themselves, the aggregate's
    name and the binding target (the one with the lowest ratio). The interval is the aggregate of
    the per-target bounds (each aggregate is increasing in every ratio, so the bounds hold jointly
    when each target's do)."""
    w = [r["weight"] for r in rows]
    est = aggregate([r["ratio"] for r in rows], w, how)
    lo = aggregate([r["lo"] for r in rows], w, how)
    hi = aggregate([r["hi"] for r in rows], w, how)
    binding = min(rows, key=lambda r: r["ratio"] if r["ratio"] is not None else -math.inf)["target"]
    return {"ratio": est, "lo": lo, "hi": hi, "level": level, "n": min(int(r.get("n") or 0) for r in rows),
            "significantly_faster": lo > 1.0, "significantly_slower": hi < 1.0,
            "predicted": all(r.get("source") == "predicted" for r in rows),  # no noise anywhere: no interval
            "aggregate": how, "binding": binding, "per_target": rows}


def _row(t: Target, est: dict[str, Any] | None, throughput=None, base=None, error=None) -> dict[str, Any]:
    row = {"target": t.name, "weight": t.config.weight, "source": "predicted" if t.predicted else "measured",
           "objective": t.measure.objective, "workload": t.config.workload,
           "backend": t.measurer.backend, "device": t.measure.bench.device_spec, "batch_size": t.measure.ref_batch,
           "calibration": t.measure.calibration, "throughput": throughput, "baseline_throughput": base}
    if est is None:
        return {**row, "ratio": None, "lo": None, "hi": None, "n": 0, "error": error}
    if t.predicted:  # a deterministic prediction: no interval to state
        return {**row, "ratio": est["ratio"], "lo": est["ratio"], "hi": est["ratio"], "n": est.get("n")}
    return {**row, "ratio": est["ratio"], "lo": est["lo"], "hi": est["hi"], "n": est.get("n")}


def compare_on_targets(targets: list[Target], group: list[ArchSpec], how: str, attempt: int = 0,
                       ref: int = 0) -> tuple[dict[str, Any] | None, list, str | None]:
    """``group`` (the baseline first) compared on every target; returns the aggregate ratio record
    of the group's last shape against ``group[ref]`` (None if any target failed), the per-target
    measurements, and the first failure."""
    rows, ms, failure = [], [], None
    last = len(group) - 1
    for t in targets:
        m = t.measurer.compare(group, attempt=attempt)
        ms.append(m)
        pr = m.result
        if not pr.ok:
            failure = failure or f"target {t.name}: {pr.error or 'the paired measurement gave fewer than two rounds'}"
            rows.append(_row(t, None, error=pr.error))
            continue
        est = pr.estimate(last, ref=ref, instance_var=t.measurer.instance_var()).to_dict()
        rows.append(_row(t, est, pr.throughput(last), pr.throughput(ref)))
    level = targets[0].measure.paired.level
    return (None if failure else combine(rows, how, level)), ms, failure


def multi_target_objective(trial, ctx, spec: ArchSpec, loss: float):
    """The trial's objective with targets: ``spec`` compared with the baseline on every target, the
    aggregate of its ratios; each target's ratio (measured with its interval, or predicted) kept in
    the trial's ``ratio.per_target`` and ``target_ratios`` user attributes."""
    cfg = ctx.cfg
    if spec == ctx.baseline:
        trial.set_user_attr("measured", False)
        trial.set_user_attr("is_baseline", True)
        set_constraint(trial, "limits_violated", 0.0)
        return (1.0, loss) if cfg.optuna.objective == "pareto" else 1.0
    est, ms, failure = compare_on_targets(ctx.targets, [ctx.baseline, spec], cfg.optuna.target_objective)
    trial.set_user_attr("measurement_keys", {t.name: m.key for t, m in zip(ctx.targets, ms)})
    bad = next((m for m in ms if not m.result.ok), ms[0])
    record_measurement(trial, bad, ",".join(sorted({t.measurer.backend for t in ctx.targets})), failure)
    trial.set_user_attr("ratio", est)
    trial.set_user_attr("target_ratios", {r["target"]: r["ratio"] for r in est["per_target"]})
    trial.set_user_attr("binding_target", est["binding"])
    trial.set_user_attr("rounds", min(len(m.result.rounds) for m in ms))
    broken = []
    for t, m in zip(ctx.targets, ms):
        ok, why = check_result_limits(cfg.limits, m.result.batch_result(1), t.measure.ref_batch)
        if not ok:
            broken.append(f"target {t.name}: {why}")
    batch = ms[0].result.batch_result(1)
    trial.set_user_attr("throughput", {str(ctx.targets[0].measure.ref_batch): batch.output_throughput})
    trial.set_user_attr("baseline_throughput", ms[0].result.throughput(0))
    trial.set_user_attr("measured", True)
    if broken:
        trial.set_user_attr("limits_reason", "; ".join(broken))
    set_constraint(trial, "limits_violated", 1.0 if broken else 0.0)
    return (est["ratio"], loss) if cfg.optuna.objective == "pareto" else est["ratio"]


def gqa_paired_visit(step, group: list[ArchSpec], ctx, attempt: int = 0) -> None:
    """The local GQA search's paired visit with targets: the variant (``group[-1]``) compared on
    every target with the baseline (and the start variant, ``group[1]``), its ratios aggregated as
    the study's objective is."""
    how = ctx.cfg.optuna.target_objective
    est, ms, failure = compare_on_targets(ctx.targets, group, how, attempt)
    step.measured = True
    if est is None:
        step.note = f"measurement failed: {failure}"
        return
    step.throughput = ms[0].result.throughput(len(group) - 1)
    step.ratio = est
    if len(group) > 2:
        step.ratio_vs_start, _, _ = compare_on_targets(ctx.targets, group, how, attempt, ref=1)


def predicted_ratio_fn(ctx):
    """:func:`aggregate_ratio` for the seed ranking: each target's analytic roofline (its device,
    its calibration, its batch and lengths; a measuring target's device and engine predicted by
    the roofline and the calibration it names, uncalibrated without one), the ratio of a shape's
    predicted throughput to the baseline's on it, aggregated as the objective is."""
    scale = ctx.study.measured  # the shape as measured (measure.params)
    fns = []
    for t in ctx.targets:
        m = t.measure
        if t.config.workload is not None:  # the workload's own prediction (simulated online, or the roofline)
            s = m.bench_settings(m.bench.backend)
        else:
            s = BenchSettings(backend="analytic", batch_sizes=[m.ref_batch], input_len=m.bench.input_len,
                              output_len=m.bench.output_len, warmup=0, repeats=1, dtype=m.bench.dtype,
                              device_spec=m.bench.device_spec or "cpu",
                              engine_args={"calibration": m.calibration} if m.calibration else {})
        fns.append((t, s))

    def figure(spec: ArchSpec, t: Target, s: BenchSettings) -> float | None:
        r = measure(scale(spec), s)
        b = next((b for b in r.per_batch if b.batch_size == t.measure.ref_batch and b.ok), None)
        return objective_score(t.measure.objective, b) if b is not None else None
    base = [figure(ctx.baseline, t, s) for t, s in fns]

    def aggregate_ratio(spec: ArchSpec) -> float | None:
        ratios = []
        for (t, s), b in zip(fns, base):
            tp = figure(spec, t, s)
            ratios.append(tp / b if tp and b else None)
        return aggregate(ratios, [t.config.weight for t, _ in fns], ctx.cfg.optuna.target_objective)
    return aggregate_ratio


def ranking_label(cfg) -> str:
    """How the seed ranking is described with targets."""
    return (f"{cfg.optuna.target_objective} predicted ratio to the baseline over targets "
            f"{[t.name for t in cfg.measure.targets]}")


# -- report -----------------------------------------------------------------------------------

def target_rows(ratio: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list((ratio or {}).get("per_target") or [])


def targets_summary(cfg, answer_ratio: dict[str, Any] | None, pareto: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json``'s ``targets`` block: each target (how it is known), and the answer's and the
    Pareto set's per-target ratios with their aggregate and binding target."""
    def shape(label: str, trial, ratio: dict[str, Any] | None) -> dict[str, Any]:
        ratio = ratio or {}
        return {"shape": label, "trial": trial, "ratio": ratio.get("ratio"), "lo": ratio.get("lo"),
                "hi": ratio.get("hi"), "binding": ratio.get("binding"), "per_target": target_rows(ratio)}

    return {"objective": cfg.optuna.target_objective, "level": cfg.measure.paired.level,
            "targets": [{"name": t.name, "weight": t.weight,
                         "description": describe_target(t, target_measure(cfg.measure, t))}
                        for t in cfg.measure.targets],
            "answer": shape("answer", None, answer_ratio),
            "pareto": [shape(f"trial {p.get('trial')}", p.get("trial"), p.get("ratio")) for p in pareto]}


def targets_markdown(s: dict[str, Any]) -> list[str]:
    """The report's "Deployment targets" section from ``summary.json``'s ``targets`` block: each
    target, then one row per shape (the answer, the Pareto set) with its ratio on every target
    (measured with its interval, predicted marked), the aggregate and the binding target."""
    how = "worst" if s["objective"] == "worst" else "weighted geometric mean"
    lines = ["## Deployment targets", "",
             f"Objective: the {how} of the ratios to the baseline over the targets, each of its target's "
             "objective (named in its line below) "
             f"(`optuna.target_objective: {s['objective']}`). Measured ratios carry their {s['level']:.0%} "
             "interval; predicted ones (the analytic roofline) are marked (pred.) and have none.", ""]
    lines += [f"- **{t['name']}** (weight {t['weight']:g}): {t['description']}" for t in s["targets"]] + [""]

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        if r.get("ratio") is None:
            return "failed"
        if r["source"] == "predicted":
            return f"x{r['ratio']:.3f} (pred.)"
        return f"x{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"

    names = [t["name"] for t in s["targets"]]
    lines += ["| shape | " + " | ".join(names) + " | aggregate | binds |", "|---|" + "---|" * (len(names) + 2)]
    for row in [s["answer"], *s["pareto"][:10]]:
        cells = {r["target"]: r for r in row["per_target"]}
        if not cells:
            continue
        lines.append(f"| {row['shape']} | " + " | ".join(cell(cells.get(n)) for n in names) +
                     f" | x{row['ratio']:.3f} [{row['lo']:.3f}, {row['hi']:.3f}] | {row['binding']} |")
    return lines + [""]


def targets_figure(path, shapes: list[tuple[str, list[dict[str, Any]]]], title: str,
                   words: ObjectiveWords | None = None) -> list[str]:
    """Each target's ratio to the baseline (of the study's objective, ``words``: throughput when not
    given) for each shape (``shapes``: label and
    per-target rows, the answer first): points on an axis around 1 (bars from 0 would hide 1.07
    against 1.18), measured ratios with their interval, predicted ones hollow and without one; the
    answer's binding target (its lowest ratio) shaded and named. Written as ``path`` .png and .pdf;
    returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shapes = [(label, rows) for label, rows in shapes if rows]
    if not shapes:
        return []
    names = [r["target"] for r in shapes[0][1]]
    x = np.arange(len(names))
    w = 0.8 / len(shapes)
    answer = [r for r in shapes[0][1] if r.get("ratio") is not None]
    binding = min(answer, key=lambda r: r["ratio"])["target"] if answer else None
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 6.2))
    if binding is not None:
        ax.axvspan(names.index(binding) - 0.45, names.index(binding) + 0.45, color="tab:red", alpha=0.08,
                   label=f"binding target of {shapes[0][0]}: {binding}")
    for i, (label, rows) in enumerate(shapes):
        by = {r["target"]: r for r in rows}
        xs = x + (i - (len(shapes) - 1) / 2) * w
        color = f"C{i}"
        for xi, n in zip(xs, names):
            r = by.get(n)
            if not r or r.get("ratio") is None:
                continue
            predicted = r.get("source") == "predicted"
            err = None if predicted or r.get("lo") is None else [[r["ratio"] - r["lo"]], [r["hi"] - r["ratio"]]]
            ax.errorbar([xi], [r["ratio"]], yerr=err, fmt="o", ms=8, capsize=4, color=color,
                        mfc="none" if predicted else color)
            ax.annotate(f"{r['ratio']:.3f}", (xi, r["ratio"]), xytext=(6, 0), textcoords="offset points",
                        fontsize=8, va="center")
        ax.plot([], [], "o", color=color, label=label)
    ax.plot([], [], "o", color="k", mfc="none", label="hollow: predicted (no interval)")
    ax.axhline(1.0, c="k", lw=0.8, ls="--", label="baseline")
    ax.margins(y=0.25)
    ax.set_xticks(x, [f"{n}\n(binding)" if n == binding else n for n in names])
    ax.set_ylabel(f"{(words or objective_words('throughput')).ratio}\n(filled: measured, with interval)")
    ax.set_title(title)
    # below the axes: inside, it covered points or the baseline line
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1)
    fig.tight_layout()
    png = save(fig, Path(path).with_suffix(".png"), dpi=120)
    return [str(png), str(png.with_suffix(".pdf"))]


def price_targets(cfg, device: str, price) -> dict[str, Any]:
    """The plan's measurement cost with targets: ``price(view_cfg, device)`` (the plan's
    ``measurement_cost``) for each target on its own device (its ``device_spec``, else the plan's),
    summed: every shape is compared with the baseline on each target in turn, so the GPU hours and
    the wall hours add up; each target's own figures are kept under ``targets``."""
    parts = {}
    for view, t in zip(study_views(cfg), cfg.measure.targets):
        dev = view.cfg.measure.bench.device_spec or device
        cost = price(view.cfg, dev)
        if "error" in cost:
            return {**cost, "error": f"target {t.name}: {cost['error']}"}
        parts[t.name] = cost
    # the base of the sum: a target an engine measures (its pairs and rounds priced), else the first
    first = next((p for p in parts.values() if "measurements_low" in p), next(iter(parts.values())))
    out = dict(first)
    for key in ("gpu_hours", "wall_hours"):
        out[key] = {k: sum(p[key][k] for p in parts.values()) for k in first[key]}
    if "gqa" in first:
        gqas = [p["gqa"] for p in parts.values() if "gqa" in p]
        out["gqa"] = {**first["gqa"], **{key: {k: sum(g[key][k] for g in gqas if key in g) for k in first["gqa"][key]}
                                         for key in ("comparisons", "gpu_hours", "wall_hours") if key in first["gqa"]}}
    out["device"] = ", ".join(sorted({str(p.get("device")) for p in parts.values()}))
    out["targets"] = {name: {"device": p.get("device"), "gpu_hours": p["gpu_hours"], "wall_hours": p["wall_hours"]}
                      for name, p in parts.items()}
    out["assumptions"] = [f"{len(parts)} deployment targets: every comparison is taken on each, one after another "
                          "(predicted targets cost nothing); the hours are the targets' sums, each priced on its "
                          "own device and engine: " + "; ".join(
                              f"{n} {p['gpu_hours']['low']:.3g}-{p['gpu_hours']['high']:.3g} GPU-h"
                              for n, p in parts.items())] + [
        a for p in parts.values() for a in p.get("assumptions", [])][:len(first.get("assumptions", []))]
    return out

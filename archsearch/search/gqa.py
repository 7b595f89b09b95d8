"""Local GQA search (docs/method.md section 4, stage 4: gqa).

GQA has no smooth relation to loss, so it is not in the law: it is searched locally around the
chosen shape. With N, the width and r fixed, GQA trades query heads against KV heads while the
attention parameters stay on budget: the attention share per layer is
``2 * d * head_dim * (n_heads + n_kv_heads)``, so every pair with the same head total holds the
same share (GQA 4 with 24+6 heads and GQA 9 with 27+3). :func:`gqa_pairs` enumerates, for each
integer GQA, the pair whose total is nearest the chosen shape's (the MLP is unchanged), and
keeps those whose N is within the budget tolerance and whose r is within the r tolerance.
The GQA=4 variant (``baseline_gqa``, or the nearest enumerated value) is measured first; then
the search walks to larger and to smaller GQA values and stops in each direction at the first
variant that is slower than that baseline (:func:`slower_than_baseline`).

With a study baseline in the context (the pipeline always has one), every variant is measured
paired (``archsearch.benchmarks.paired``) with the study baseline and the GQA=4 variant in one engine
process: "slower" then means significantly slower (the ratio's interval below 1); a variant
that looks slower without being significantly so is measured once more (fresh rounds), and
the walk stops only if that says significantly slower. The pick is the variant with the
highest throughput ratio to the study baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from archsearch.arch import ArchSpec, mlp_to_attn_ratio, non_embedding_params
from archsearch.candidates import BuildSettings
from archsearch.errors import ArchsearchError
from archsearch.search import log as search_log
from archsearch.search.study import loss_bound


def gqa_pairs(spec: ArchSpec, params: float, build: BuildSettings) -> dict[int, ArchSpec]:
    """GQA value -> the variant of ``spec`` with that GQA and (nearly) the same head total,
    for every integer GQA whose variant keeps N and r within ``build``'s tolerances."""
    total = spec.n_heads + spec.n_kv_heads
    r0 = mlp_to_attn_ratio(spec)
    out: dict[int, ArchSpec] = {}
    for g in range(1, total):
        kv = min({max(1, math.floor(total / (g + 1))), max(1, math.ceil(total / (g + 1)))},
                 key=lambda k: (abs(k * (g + 1) - total), k))
        v = spec.replace(n_heads=kv * g, n_kv_heads=kv, name=None)
        if (abs(non_embedding_params(v) / params - 1) <= build.tolerance
                and abs(mlp_to_attn_ratio(v) / r0 - 1) <= build.r_tolerance):
            out[g] = v
    return out


def slower_than_baseline(step: "GQAStep", base: "GQAStep") -> bool:
    """Whether a variant did worse than the baseline GQA variant (the early-stop rule): measured
    paired with it, significantly slower; measured alone, a lower throughput."""
    if step.ratio_vs_start is not None:
        return bool(step.ratio_vs_start["significantly_slower"])
    return base.throughput is not None and step.throughput is not None and step.throughput < base.throughput


@dataclass
class GQAStep:
    gqa: int
    spec: dict[str, Any] | None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    predicted_loss: float | None = None
    feasible: bool = False
    throughput: float | None = None
    measured: bool = False
    note: str = ""
    ratio: dict[str, Any] | None = None  # vs the study baseline (paired)
    ratio_vs_start: dict[str, Any] | None = None  # vs the GQA=4 variant (paired)


@dataclass
class GQAResult:
    baseline_gqa: int
    steps: list[GQAStep] = field(default_factory=list)
    chosen: GQAStep | None = None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"baseline_gqa": self.baseline_gqa, "steps": [asdict(s) for s in self.steps],
                "chosen": asdict(self.chosen) if self.chosen else None}


def local_gqa_search(spec: ArchSpec, ctx, baseline_gqa: int = 4, log: bool = True) -> GQAResult:
    """Measure GQA variants of ``spec`` outward from ``baseline_gqa`` with early stopping."""
    cfg = ctx.cfg
    pairs = gqa_pairs(spec, cfg.params, ctx.build)
    if not pairs:
        raise ArchsearchError("gqa_search", f"no GQA variant of the chosen shape keeps N and r in tolerance "
                              f"(heads {spec.n_heads}+{spec.n_kv_heads})",
                              "raise search_space.build.tolerance or r_tolerance")
    g0 = baseline_gqa if baseline_gqa in pairs else min(pairs, key=lambda g: (abs(g - baseline_gqa), g))
    res = GQAResult(baseline_gqa=g0)

    def visit(g: int) -> GQAStep:
        v = pairs[g]
        loss = float(ctx.law.predict(v, cfg.tokens, params=cfg.params))
        bound = loss_bound(ctx, v)
        step = GQAStep(g, v.to_dict(), v.n_heads, v.n_kv_heads, loss, bound <= ctx.target_loss)
        if not step.feasible:
            step.note = f"skipped: predicted loss {bound:.4f} > target {ctx.target_loss:.4f}"
        elif ctx.baseline is not None:
            paired_visit(step, v)
        else:
            result = ctx.measurer.measure(v).result
            step.measured = True
            step.throughput = result.throughput(ctx.ref_batch)
            if step.throughput is None:
                step.note = f"measurement failed: {result.error}"
        res.steps.append(step)
        if log:
            tp = f"{step.throughput:.1f} tok/s" if step.throughput is not None else "-"
            if step.ratio:
                tp += f", x{step.ratio['ratio']:.3f} [{step.ratio['lo']:.3f}, {step.ratio['hi']:.3f}] vs baseline"
            search_log(f"GQA {g} ({v.n_heads}+{v.n_kv_heads} heads): {tp} {step.note}".rstrip())
        return step

    def paired_visit(step: GQAStep, v: ArchSpec, attempt: int = 0) -> None:
        group = [ctx.baseline, v] if start is None else [ctx.baseline, start, v]
        if getattr(ctx, "targets", None):  # the study's aggregate over its deployment targets
            from archsearch.search.targets import gqa_paired_visit

            return gqa_paired_visit(step, group, ctx, attempt)
        pr = ctx.measurer.compare(group, attempt=attempt).result
        step.measured = True
        if not pr.ok:
            step.note = f"measurement failed: {pr.error}"
            return
        last = len(group) - 1  # the twin, when measured, comes after it
        step.throughput = pr.throughput(last)
        iv = ctx.measurer.instance_var()
        step.ratio = pr.estimate(last, instance_var=iv).to_dict()
        if start is not None:
            step.ratio_vs_start = pr.estimate(last, ref=1, instance_var=iv).to_dict()

    start: ArchSpec | None = None
    base = visit(g0)
    if base.measured and base.spec is not None:
        start = ArchSpec.from_dict(base.spec)
    for direction in (sorted(g for g in pairs if g > g0), sorted((g for g in pairs if g < g0), reverse=True)):
        for g in direction:
            step = visit(g)
            q = step.ratio_vs_start
            if q is not None and q["ratio"] < 1 and not q["significantly_slower"]:
                paired_visit(step, pairs[g], attempt=1)
                step.note = (step.note + "; " if step.note else "") + "re-measured (not significantly slower)"
            if slower_than_baseline(step, base):
                q = step.ratio_vs_start
                why = (f"significantly slower than GQA {g0} (x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}])"
                       if q else "slower than the baseline GQA")
                step.note = (step.note + "; " if step.note else "") + f"{why}: stop"
                break
    measured = [s for s in res.steps if s.feasible and s.throughput is not None]
    key = (lambda s: s.ratio["ratio"]) if ctx.baseline is not None else (lambda s: s.throughput)
    measured = [s for s in measured if ctx.baseline is None or s.ratio]
    res.chosen = max(measured, key=key) if measured else None
    return res

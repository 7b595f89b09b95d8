"""Local GQA search (Algorithm 5, step 3).

GQA has no smooth relation to loss, so it is not in the law: it is searched locally around
the chosen shape. The query-head count and width stay fixed; each feasible KV-head count (a
divisor of the head count) gives one variant, whose MLP is refilled so that N stays on the
budget. The GQA=4 variant (``baseline_gqa``) is measured first; then the search walks to
larger and to smaller GQA values and stops in each direction at the first variant that is
slower than that baseline.

With a study baseline in the context (the pipeline always has one), every variant is measured
paired (``benchmarks.paired``) with the study baseline and the GQA=4 variant in one engine
process: "slower" then means significantly slower (the ratio's interval below 1); a variant
that looks slower without being significantly so is measured once more (fresh rounds), and
the walk stops only if that says significantly slower. The pick is the variant with the
highest throughput ratio to the study baseline.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from archsearch.arch import ArchSpec, attention_params_per_layer, non_embedding_params
from archsearch.candidates import BuildSettings
from archsearch.errors import ArchsearchError
from archsearch.search.measure import paired_from_dict, throughput_at
from archsearch.search.study import loss_bound


def gqa_variant(spec: ArchSpec, gqa: int, params: float, build: BuildSettings) -> ArchSpec:
    """``spec`` with ``n_heads / gqa`` KV heads and the MLP refilled to the budget."""
    if spec.n_heads % gqa:
        raise ArchsearchError("gqa", f"{gqa} does not divide n_heads={spec.n_heads}")
    s = spec.replace(n_kv_heads=spec.n_heads // gqa, name=None)
    rest = params / s.n_layers - attention_params_per_layer(s)
    if rest <= 0:
        raise ArchsearchError("gqa", f"GQA {gqa} leaves no room for the MLP at this budget")
    ffn = max(build.ffn_multiple, int(round(rest / (3 * s.hidden_size) / build.ffn_multiple)) * build.ffn_multiple)
    s = s.replace(ffn=ffn)
    err = non_embedding_params(s) / params - 1
    if abs(err) > build.tolerance:
        raise ArchsearchError("gqa", f"GQA {gqa} misses the budget by {err:+.1%}")
    return s


@dataclass
class GQAStep:
    gqa: int
    spec: dict[str, Any] | None
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
    divisors = [g for g in range(1, spec.n_heads + 1) if spec.n_heads % g == 0]
    g0 = baseline_gqa if baseline_gqa in divisors else min(divisors, key=lambda g: (abs(g - baseline_gqa), g))
    res = GQAResult(baseline_gqa=g0)

    def visit(g: int) -> GQAStep:
        try:
            v = gqa_variant(spec, g, cfg.params, ctx.build)
        except ArchsearchError as e:
            step = GQAStep(g, None, note=f"skipped: {e.problem}")
            res.steps.append(step)
            return step
        loss = float(ctx.law.predict(v, cfg.tokens))
        bound = loss_bound(ctx, v)
        step = GQAStep(g, v.to_dict(), loss, bound <= ctx.target_loss)
        if not step.feasible:
            step.note = f"skipped: predicted loss {bound:.4f} > target {ctx.target_loss:.4f}"
        elif ctx.baseline is not None:
            paired_visit(step, v)
        else:
            result, cached = ctx.measurer.measure(v)
            step.measured = True
            step.throughput = throughput_at(result, ctx.ref_batch)
            if step.throughput is None:
                step.note = f"measurement failed: {result.get('error')}"
        res.steps.append(step)
        if log:
            tp = f"{step.throughput:.1f} tok/s" if step.throughput is not None else "-"
            if step.ratio:
                tp += f", x{step.ratio['ratio']:.3f} [{step.ratio['lo']:.3f}, {step.ratio['hi']:.3f}] vs baseline"
            print(f"[search] GQA {g}: {tp} {step.note}".rstrip(), file=sys.stderr, flush=True)
        return step

    def paired_visit(step: GQAStep, v: ArchSpec, attempt: int = 0) -> None:
        group = [ctx.baseline, v] if start is None else [ctx.baseline, start, v]
        result, _ = ctx.measurer.compare(group, attempt=attempt)
        step.measured = True
        if not result.get("ok"):
            step.note = f"measurement failed: {result.get('error')}"
            return
        pr = paired_from_dict(result)
        last = len(group) - 1
        step.throughput = pr.throughput(last)
        step.ratio = pr.estimate(last).to_dict()
        if start is not None:
            step.ratio_vs_start = pr.estimate(last, ref=1).to_dict()

    start: ArchSpec | None = None
    base = visit(g0)
    if base.measured and base.spec is not None:
        start = ArchSpec.from_dict(base.spec)
    t0 = base.throughput
    for direction in (sorted(g for g in divisors if g > g0), sorted((g for g in divisors if g < g0), reverse=True)):
        for g in direction:
            step = visit(g)
            if step.ratio_vs_start is not None:
                q = step.ratio_vs_start
                if q["ratio"] < 1 and not q["significantly_slower"]:
                    paired_visit(step, ArchSpec.from_dict(step.spec), attempt=1)
                    q = step.ratio_vs_start
                    step.note = (step.note + "; " if step.note else "") + "re-measured (not significantly slower)"
                if q["significantly_slower"]:
                    step.note = (step.note + "; " if step.note else "") + \
                        f"significantly slower than GQA {g0} (x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}]): stop"
                    break
            elif ctx.baseline is None and t0 is not None and step.throughput is not None and step.throughput < t0:
                step.note = (step.note + "; " if step.note else "") + "slower than the baseline GQA: stop"
                break
    measured = [s for s in res.steps if s.feasible and s.throughput is not None]
    key = (lambda s: s.ratio["ratio"]) if ctx.baseline is not None else (lambda s: s.throughput)
    measured = [s for s in measured if ctx.baseline is None or s.ratio]
    res.chosen = max(measured, key=key) if measured else None
    return res

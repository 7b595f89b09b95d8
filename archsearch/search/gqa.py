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
variant that does worse than it. Fewer KV heads are almost always faster, so throughput alone
would walk to one KV head; loss stops the walk:

- a study that trains proxies checks each variant's loss at proxy scale
  (:class:`ProxyLossCheck`): the chosen d/sqrt(N) and r built at every proxy size with the
  baseline GQA, each variant the head pair of the same total there (or, where the fewer heads
  there have no such pair, the nearest larger GQA), trained with the same token budget, seeds
  and data order, through the proxy store and executor; a variant whose loss is
  worse than the baseline GQA variant's by more than ``gqa_search.loss_slack`` plus the paired
  noise margin (the method's rule: "worse than the GQA=4 variant by more than the slack plus the
  noise") stops the walk, even if it is faster;
- a study that cannot train (a law file, no proxy sweep) cannot check loss: the walk stays
  within ``gqa_search.max_gqa`` / ``min_kv_heads`` (without them, at most ``baseline_gqa``) and
  the result says that GQA's effect on loss is unverified.

With a study baseline in the context (the pipeline always has one), every variant is measured
paired (``archsearch.benchmarks.paired``) with the study baseline and the GQA=4 variant in one engine
process: "slower" then means significantly slower (the ratio's interval below 1); a variant
that looks slower without being significantly so is measured once more (fresh rounds), and
the walk stops only if that says significantly slower. The pick is the variant with the
highest throughput ratio to the study baseline among those measured before a stop whose loss
check passed.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from archsearch.arch import ArchSpec, hidden_over_sqrt_n, mlp_to_attn_ratio, non_embedding_params
from archsearch.candidates import BuildSettings, build_candidate
from archsearch.errors import ArchsearchError
from archsearch.search import log as search_log
from archsearch.search.config import gqa_bound_violation
from archsearch.search.proxies import train_runs
from archsearch.search.constraint import loss_bound
from archsearch.search.targets import gqa_paired_visit
from archsearch.trainers.data import prepare_data
from archsearch.trainers.loop import run_id_for, token_budget

if TYPE_CHECKING:
    from archsearch.search.resolved import ResolvedStudy


def gqa_pairs(spec: ArchSpec, params: float, build: BuildSettings) -> dict[int, ArchSpec]:
    """GQA value -> the variant of ``spec`` with that GQA and (nearly) the same head total,
    for every integer GQA whose variant keeps N and r within ``build``'s tolerances. A shape
    further from the budget than the build tolerance (a seeded published shape, measured as
    published: ``optuna.seed_shapes``) keeps its variants within its own distance from it."""
    total = spec.n_heads + spec.n_kv_heads
    r0 = mlp_to_attn_ratio(spec)
    tolerance = max(build.tolerance, abs(non_embedding_params(spec) / params - 1))
    out: dict[int, ArchSpec] = {}
    for g in range(1, total):
        kv = min({max(1, math.floor(total / (g + 1))), max(1, math.ceil(total / (g + 1)))},
                 key=lambda k: (abs(k * (g + 1) - total), k))
        v = spec.replace(n_heads=kv * g, n_kv_heads=kv, name=None)
        if (abs(non_embedding_params(v) / params - 1) <= tolerance
                and abs(mlp_to_attn_ratio(v) / r0 - 1) <= build.r_tolerance):
            out[g] = v
    return out


def bounded_pairs(pairs: dict[int, ArchSpec], max_gqa: int | None, min_kv_heads: int | None) -> dict[int, ArchSpec]:
    """The variants within the walk's bounds (GQA at most ``max_gqa``, at least ``min_kv_heads``)."""
    return {g: v for g, v in pairs.items() if gqa_bound_violation(g, v.n_kv_heads, max_gqa, min_kv_heads) is None}


def slower_than_baseline(step: "GQAStep", base: "GQAStep") -> bool:
    """Whether a variant did worse than the baseline GQA variant (the early-stop rule): measured
    paired with it, significantly slower; measured alone, a lower throughput."""
    if step.ratio_vs_start is not None:
        return bool(step.ratio_vs_start["significantly_slower"])
    return base.throughput is not None and step.throughput is not None and step.throughput < base.throughput


# -- the loss check at proxy scale ---------------------------------------------------------------

def proxy_variants(study: ResolvedStudy, spec: ArchSpec, g0: int) -> list[dict[str, Any]]:
    """For every proxy size of the study's (first) proxy sweep: the chosen shape's d/sqrt(N) and r
    built there with GQA ``g0`` as that sweep builds its shapes (its layers, head size and
    snapping), each GQA variant the head pair of the same total (:func:`gqa_pairs`, so the same N
    and r within the sweep's tolerances), and the training every variant shares: the sweep's
    settings at that size with the ``g0`` variant's token budget (one data prefix and order).
    A size where the ``g0`` variant does not build has ``base`` None and a ``note``."""
    sweep, vocab = study.sweeps[0], study.vocab_size
    x1, r = hidden_over_sqrt_n(spec), mlp_to_attn_ratio(spec)
    settings = replace(sweep.build, vocab_size=vocab, on_r_drift="flag")
    out = []
    for level, n in enumerate(sweep.params):
        item: dict[str, Any] = {"level": level, "params": float(n), "base": None, "variants": {}}
        try:
            base = build_candidate(n, sweep.layers_for(level), x1, r, gqa=g0, head_dim=sweep.head_dim,
                                   settings=settings).spec
        except ArchsearchError as e:
            out.append({**item, "note": f"the GQA {g0} variant does not build at N={n:.3g}: {e}"})
            continue
        tc = sweep.train_for(level)
        variants = {**gqa_pairs(base, n, settings), g0: base}
        out.append({**item, "base": base, "variants": variants, "tokens": token_budget(base, tc), "train": tc})
    return out


def proxy_gqa(item: dict[str, Any], g: int) -> int | None:
    """The GQA that stands for ``g`` at one proxy size: ``g`` itself where that size has it, else
    the nearest larger GQA it has (fewer heads at proxy scale leave gaps; sharing KV heads more is
    the stricter test of loss); None where it has none as large."""
    return min((h for h in item["variants"] if h >= g), default=None)


def proxy_runs(sizes: list[dict[str, Any]], seeds: list[int], g: int) -> list[tuple[int, int, str, ArchSpec, Any]]:
    """(level, seed, run id, spec, train config) of the proxy runs that check GQA ``g``: per size
    its stand-in (:func:`proxy_gqa`) and per seed, each at its size's shared token budget."""
    runs = []
    for item in sizes:
        h = proxy_gqa(item, g)
        if h is None:
            continue
        v = item["variants"][h]
        for seed in seeds:
            tc = item["train"].replace(seed=seed, tokens=item["tokens"], tokens_per_param=None)
            runs.append((item["level"], seed, run_id_for(v, item["tokens"], seed), v, tc))
    return runs


def compare_losses(ref: dict[tuple[int, int], float], var: dict[tuple[int, int], float], *, slack: float,
                   noise: float | None, level: float) -> dict[str, Any]:
    """The paired loss comparison of a variant with the baseline GQA variant: ``ref`` and ``var``
    map (proxy size level, seed) to a run's held-out loss. Per pair d = L_var / L_ref - 1; the
    variant is worse when the mean of d exceeds ``slack`` plus the one-sided ``level`` margin of
    the mean's standard error (the slack is what the study tolerates, the margin what the noise
    could make of a tie: both are added, as the method states the stop rule): ``noise`` (the sd of one d) where given, else the d's own
    spread with Student's t (two pairs or more), else (one pair) the slack alone."""
    from scipy.special import ndtri, stdtrit

    keys = sorted(k for k in var if k in ref and math.isfinite(var[k]) and math.isfinite(ref[k]))
    d = [var[k] / ref[k] - 1 for k in keys]
    if not d:
        return {"pairs": 0, "worse": None, "slack": slack}
    n, m = len(d), statistics.fmean(d)
    if noise is not None:
        sd, source, q = noise, "gqa_search.loss_noise", float(ndtri(level))
    elif n >= 2:
        sd, source = statistics.stdev(d), f"spread of the {n} paired differences"
        q = float(stdtrit(n - 1, level))
    else:
        sd, source, q = None, "unknown (one paired run): the slack alone", 0.0
    margin = q * sd / math.sqrt(n) if sd is not None else 0.0
    return {"pairs": n, "mean_rel_diff": m, "noise_sd": sd, "noise_source": source, "level": level,
            "margin": margin, "slack": slack, "threshold": slack + margin, "worse": m > slack + margin,
            "mean_loss": statistics.fmean(var[k] for k in keys), "ref_mean_loss": statistics.fmean(ref[k] for k in keys)}


class ProxyLossCheck:
    """Trains GQA variants of the chosen shape at the study's proxy sizes (:func:`proxy_variants`)
    into ``gqa/proxies/`` of the study folder (:func:`archsearch.search.proxies.train_runs`: the proxy
    store and executor; nothing trained twice) and compares each with the ``g0`` variant
    (:func:`compare_losses`)."""

    def __init__(self, ctx, spec: ArchSpec, g0: int, progress: bool = True):
        cfg = ctx.cfg
        self.cfg, self.g0, self.progress = cfg, g0, progress
        self.sweep = ctx.study.sweeps[0]
        self.seeds = list(self.sweep.seeds) if self.sweep.seeds is not None else [self.sweep.train.seed]
        self.folder = Path(ctx.out) / "gqa" / "proxies"
        self.vocab = ctx.build.vocab_size  # the study's vocabulary (the resolved study's build settings)
        self.sizes = proxy_variants(ctx.study, spec, g0)
        self.data = None
        self.trained_now: set[str] = set()  # run ids this search trained
        self.used: set[str] = set()  # run ids it compared
        self._losses: dict[int, dict[tuple[int, int], float]] = {}

    def _prepare(self) -> None:
        """The sweep's data, prepared (cached) once for the largest budget; the variants are
        rebuilt with its tokenizer's vocabulary (N and r do not depend on it)."""
        budgets = [item["tokens"] for item in self.sizes if item["base"] is not None]
        self.data = prepare_data(self.sweep.data, min_train_tokens=int(max(budgets, default=0)) + 1)
        if self.data.vocab_size != self.vocab:
            for item in self.sizes:
                item["variants"] = {g: v.replace(vocab_size=self.data.vocab_size) for g, v in item["variants"].items()}

    def losses(self, g: int) -> dict[tuple[int, int], float]:
        """(size level, seed) -> held-out loss of GQA ``g``'s proxy runs (trained where missing;
        a failed run is NaN)."""
        if g not in self._losses:
            if self.data is None and any(proxy_gqa(item, g) is not None for item in self.sizes):
                self._prepare()
            runs = proxy_runs(self.sizes, self.seeds, g)
            records, trained = train_runs(self.cfg, self.sweep, [(rid, v, tc) for _, _, rid, v, tc in runs],
                                          self.folder, data=self.data, progress=self.progress)
            if runs:
                search_log(f"GQA {g} at proxy scale: {len(runs)} run(s) in {self.folder}, {len(trained)} trained now")
            self.trained_now |= set(trained)
            self.used |= {rid for _, _, rid, _, _ in runs}
            self._losses[g] = {
                (level, seed): float(rec["final_eval_loss"]) if rec and rec.get("status") == "ok"
                and rec.get("final_eval_loss") is not None else float("nan")
                for (level, seed, rid, _, _), rec in ((run, records[run[2]]) for run in runs)}
        return self._losses[g]

    def per_size(self, g: int) -> list[dict[str, Any]]:
        """Per proxy size: the variant's heads, N and mean loss over seeds beside the ``g0`` variant's."""
        var, ref = self.losses(g), self.losses(self.g0)
        out = []
        for item in self.sizes:
            h = proxy_gqa(item, g)
            row: dict[str, Any] = {"params": item["params"]}
            if h is None:
                row["note"] = item.get("note") or (f"no variant of GQA {g} or more keeps N and r within the sweep's "
                                                   f"tolerances at N={item['params']:.3g}")
                out.append(row)
                continue
            v = item["variants"][h]
            row["proxy_gqa"] = h
            ls = [var[(item["level"], s)] for s in self.seeds]
            rs = [ref[(item["level"], s)] for s in self.seeds]
            ok = [(a, b) for a, b in zip(ls, rs) if math.isfinite(a) and math.isfinite(b)]
            row.update({"n_heads": v.n_heads, "n_kv_heads": v.n_kv_heads, "n_params": non_embedding_params(v),
                        "tokens": item["tokens"], "seeds": len(self.seeds), "runs_ok": len(ok),
                        "loss": statistics.fmean(a for a, _ in ok) if ok else None,
                        "ref_loss": statistics.fmean(b for _, b in ok) if ok else None})
            if ok:
                row["rel_diff"] = row["loss"] / row["ref_loss"] - 1
            out.append(row)
        return out

    def reference(self) -> dict[str, Any]:
        """The ``g0`` variant's proxy losses (trained where missing): what the others are compared with."""
        ref = [x for x in self.losses(self.g0).values() if math.isfinite(x)]
        return {"reference": True, "mean_loss": statistics.fmean(ref) if ref else None, "runs_ok": len(ref),
                "per_size": self.per_size(self.g0)}

    def compare(self, g: int) -> dict[str, Any]:
        """GQA ``g`` against the ``g0`` variant at proxy scale (:func:`compare_losses`, with the
        study's ``gqa_search`` settings), with its per-size losses; ``worse`` is None where no
        pair could be compared (the variant builds at no proxy size, or its runs failed)."""
        gs = self.cfg.gqa_search
        res = compare_losses(self.losses(self.g0), self.losses(g), slack=gs.loss_slack, noise=gs.loss_noise,
                             level=gs.loss_level)
        return {**res, "per_size": self.per_size(g)}


# -- the walk ------------------------------------------------------------------------------------

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
    measurement_key: str | None = None  # its (last) measurement in the study's store
    proxy_loss: dict[str, Any] | None = None  # the loss check at proxy scale (ProxyLossCheck)
    loss_ok: bool | None = None  # passed the loss check (None: not checked)


@dataclass
class GQAResult:
    baseline_gqa: int
    steps: list[GQAStep] = field(default_factory=list)
    chosen: GQAStep | None = None
    # "proxies": every variant's loss checked at proxy scale; "unverified": the study cannot train
    loss_check: str = "proxies"
    bounds: dict[str, Any] = field(default_factory=dict)  # max_gqa, min_kv_heads, why, excluded GQA values
    stops: dict[str, str] = field(default_factory=dict)  # "up" / "down": why the walk ended there
    proxy_runs: dict[str, Any] = field(default_factory=dict)  # folder, trained now, reused

    def to_dict(self) -> dict[str, Any]:
        return {"baseline_gqa": self.baseline_gqa, "loss_check": self.loss_check, "bounds": self.bounds,
                "stops": self.stops, "proxy_runs": self.proxy_runs, "steps": [asdict(s) for s in self.steps],
                "chosen": asdict(self.chosen) if self.chosen else None}


def _loss_why(q: dict[str, Any], g: int, g0: int) -> str:
    if q["worse"] is None:
        return f"loss not checkable at proxy scale ({(q.get('per_size') or [{}])[0].get('note') or 'no run pair'})"
    return (f"proxy loss {q['mean_rel_diff']:+.2%} vs GQA {g0} over {q['pairs']} paired run(s), beyond "
            f"{q['threshold']:.2%} (slack {q['slack']:.2%} + noise margin {q['margin']:.2%})")


def first_steps(ctx, pairs: dict[int, ArchSpec], g0: int) -> list[ArchSpec]:
    """The first variant the loss constraint admits in each direction of the walk from ``g0``:
    the walk measures these whatever it finds (an infeasible variant is skipped, never a stop)."""
    firsts = []
    for direction in (sorted(g for g in pairs if g > g0), sorted((g for g in pairs if g < g0), reverse=True)):
        firsts += [pairs[g] for g in direction if loss_bound(ctx, pairs[g]) <= ctx.target_loss][:1]
    return firsts


def measure_first_steps_together(ctx, pairs: dict[int, ArchSpec], g0: int, start: ArchSpec, say) -> int:
    """The walk's first step in each direction compared with the baseline and the start variant in
    ONE engine process (``Measurer.compare_together``), before the walk reads each step's group:
    two engine starts fewer per step after the first, same rounds, same keys."""
    firsts = first_steps(ctx, pairs, g0)
    if len(firsts) < 2:
        return 0
    say(f"comparing the walk's first steps (GQA {', '.join(str(v.n_heads // v.n_kv_heads) for v in firsts)}) "
        f"with the baseline and GQA {g0} in one engine process")
    return sum(m.compare_together(ctx.baseline, firsts, fixed=[start]) for m in
               ([t.measurer for t in ctx.targets] if getattr(ctx, "targets", None) else [ctx.measurer]))


def local_gqa_search(spec: ArchSpec, ctx, baseline_gqa: int = 4, log: bool = True,
                     progress: bool = True) -> GQAResult:
    """Measure GQA variants of ``spec`` outward from ``baseline_gqa`` with early stopping on
    throughput and, where the study trains proxies, on loss at proxy scale (module docstring)."""
    cfg = ctx.cfg
    gs = cfg.gqa_search
    all_pairs = gqa_pairs(spec, cfg.params, ctx.build)
    if not all_pairs:
        raise ArchsearchError("gqa_search", f"no GQA variant of the chosen shape keeps N and r in tolerance "
                              f"(heads {spec.n_heads}+{spec.n_kv_heads})",
                              "raise search_space.build.tolerance or r_tolerance")
    can_train = bool(ctx.study.sweeps)
    max_gqa, min_kv, why = gs.bounds(can_train)
    pairs = bounded_pairs(all_pairs, max_gqa, min_kv)
    if not pairs:
        raise ArchsearchError("gqa_search.min_kv_heads" if min_kv is not None else "gqa_search.max_gqa",
                              f"no GQA variant of the chosen shape ({spec.n_heads}+{spec.n_kv_heads} heads) is "
                              f"within the bounds (GQA <= {max_gqa}, KV heads >= {min_kv}): the variants have "
                              + ", ".join(f"GQA {g} / {v.n_kv_heads} KV" for g, v in sorted(all_pairs.items())),
                              "loosen the bound")
    g0 = baseline_gqa if baseline_gqa in pairs else min(pairs, key=lambda g: (abs(g - baseline_gqa), g))
    res = GQAResult(baseline_gqa=g0, loss_check="proxies" if can_train else "unverified",
                    bounds={"max_gqa": max_gqa, "min_kv_heads": min_kv, "from": why,
                            "excluded": sorted(g for g in all_pairs if g not in pairs)})
    check = ProxyLossCheck(ctx, spec, g0, progress=progress) if can_train and len(pairs) > 1 else None
    say = search_log if log else (lambda msg: None)
    if not can_train:
        say(f"GQA's effect on loss is unverified (the study trains no proxies): the walk stays within "
            f"GQA <= {max_gqa if max_gqa is not None else '-'}, KV heads >= {min_kv if min_kv is not None else '-'} "
            f"({why})")

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
            m = ctx.measurer.measure(v)
            result, step.measurement_key = m.result, m.key
            step.measured = True
            step.throughput = result.throughput(ctx.ref_batch)
            if step.throughput is None:
                step.note = f"measurement failed: {result.error}"
        res.steps.append(step)
        tp = f"{step.throughput:.1f} tok/s" if step.throughput is not None else "-"
        if step.ratio:
            tp += (f", x{step.ratio['ratio']:.3f} vs baseline, predicted (no interval)" if step.ratio.get("predicted")
                   else f", x{step.ratio['ratio']:.3f} [{step.ratio['lo']:.3f}, {step.ratio['hi']:.3f}] vs baseline")
        say(f"GQA {g} ({v.n_heads}+{v.n_kv_heads} heads): {tp} {step.note}".rstrip())
        return step

    def paired_visit(step: GQAStep, v: ArchSpec, attempt: int = 0) -> None:
        group = [ctx.baseline, v] if start is None else [ctx.baseline, start, v]
        if getattr(ctx, "targets", None):  # the study's aggregate over its deployment targets
            return gqa_paired_visit(step, group, ctx, attempt)
        m = ctx.measurer.compare(group, attempt=attempt)
        pr, step.measurement_key = m.result, m.key
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

    def add_note(step: GQAStep, text: str) -> None:
        step.note = (step.note + "; " if step.note else "") + text

    start: ArchSpec | None = None
    base = visit(g0)
    if base.measured and base.spec is not None:
        start = ArchSpec.from_dict(base.spec)
    if check is not None:
        base.proxy_loss, base.loss_ok = check.reference(), True
    if start is not None and ctx.baseline is not None:
        measure_first_steps_together(ctx, pairs, g0, start, say)
    for name, direction in (("up", sorted(g for g in pairs if g > g0)),
                            ("down", sorted((g for g in pairs if g < g0), reverse=True))):
        res.stops[name] = (f"the bound ({why})" if name == "up" and any(g > max(pairs) for g in all_pairs)
                           else "no further variant")
        for g in direction:
            step = visit(g)
            q = step.ratio_vs_start
            if q is not None and q["ratio"] < 1 and not q["significantly_slower"]:
                paired_visit(step, pairs[g], attempt=1)
                add_note(step, "re-measured (not significantly slower)")
            if slower_than_baseline(step, base):
                q = step.ratio_vs_start
                stop = ("slower than the baseline GQA" if not q else
                        f"predicted slower than GQA {g0} (x{q['ratio']:.3f}, no interval)" if q.get("predicted") else
                        f"significantly slower than GQA {g0} (x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}])")
                add_note(step, f"{stop}: stop")
                res.stops[name] = f"GQA {g}: {stop}"
                break
            if check is not None and step.feasible and step.throughput is not None:
                step.proxy_loss = check.compare(g)
                step.loss_ok = step.proxy_loss["worse"] is False
                if not step.loss_ok:
                    stop = _loss_why(step.proxy_loss, g, g0)
                    add_note(step, f"{stop}: stop")
                    res.stops[name] = f"GQA {g}: {stop}"
                    say(f"GQA {g}: {stop}: stop")
                    break
    if check is not None:
        res.proxy_runs = {"folder": str(check.folder), "sweep": check.sweep.name, "seeds": check.seeds,
                          "sizes": [item["params"] for item in check.sizes],
                          "runs": len(check.used), "trained_now": len(check.trained_now),
                          "reused": len(check.used - check.trained_now)}
    measured = [s for s in res.steps if s.feasible and s.throughput is not None and s.loss_ok is not False]
    key = (lambda s: s.ratio["ratio"]) if ctx.baseline is not None else (lambda s: s.throughput)
    measured = [s for s in measured if ctx.baseline is None or s.ratio]
    res.chosen = max(measured, key=key) if measured else None
    return res

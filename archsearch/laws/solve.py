"""The loss-optimal shape and the constrained search "max efficiency s.t. loss <= L_t" (docs/method.md sections 3 and 4).

The conditional law is separable, each factor ``c0 + c1 log x + c2 / x`` has its minimum at
``x* = c2 / c1`` (c1, c2 > 0), and its coefficients are shared across N and D: so the
loss-optimal (hidden/sqrt(N), r) is the same closed form at every budget, and only its loss
needs the reference L_opt(N, D).

:func:`solve` scans a grid of (hidden/sqrt(N), r) at fixed N and n_layers, builds each point
with :func:`archsearch.candidates.build_candidate` (so every result is a buildable spec),
predicts its loss, keeps those within the target, and, given a throughput function, returns
the Pareto set of throughput against predicted loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from archsearch.arch import describe, hidden_over_sqrt_n, mlp_to_attn_ratio
from archsearch.candidates import BuildSettings, build_candidate
from archsearch.errors import ArchsearchError
from archsearch.laws import forms
from archsearch.laws.registry import law_form
from archsearch.laws.lawfile import quantiles, reference_loss, spec_arrays

if TYPE_CHECKING:
    from archsearch.arch import ArchSpec
    from archsearch.laws.lawfile import FitResult


@dataclass(frozen=True)
class Optimum:
    """The continuous loss-optimal shape at (N, D), before snapping to buildable sizes."""

    hidden_over_sqrt_n: float
    mlp_to_attn_ratio: float
    params: float
    tokens: float
    loss: float | None                     # None when the law has no reference L_opt
    interval: dict[str, list[float]] | None = None   # bootstrap intervals of the above
    note: str | None = None                # why loss is None, when it is

    def to_dict(self) -> dict[str, Any]:
        return {"hidden_over_sqrt_n": self.hidden_over_sqrt_n, "mlp_to_attn_ratio": self.mlp_to_attn_ratio,
                "params": self.params, "tokens": self.tokens, "loss": self.loss, "interval": self.interval,
                "note": self.note}


def optimum(fit: "FitResult", params: float, tokens: float, level: float = 0.9) -> Optimum:
    """Closed-form optimum (the form's ``optimum``: x1* = a2/a1, r* = b2/b1 for the U-shaped
    factors) of a conditional law, with bootstrap intervals."""
    form = law_form(fit.law)
    if form.optimum is None:
        raise ArchsearchError("law", f"{fit.law} has no closed-form optimum in (hidden/sqrt(N), r)",
                              "fit a conditional law (conditional-multiplicative / conditional-additive)")
    _check_budget(params, tokens)
    c = fit.coefficients
    x1, x2 = form.optimum(c)
    if x1 is None or x2 is None:
        pairs = form.factor_coefficients
        which = ", ".join(pairs[0 if x1 is None else 1]) if len(pairs) == 2 else ""
        var = "hidden/sqrt(N)" if x1 is None else "r"
        raise ArchsearchError(f"coefficients.{which}", f"the {var} factor has no interior minimum "
                              f"(it needs both coefficients > 0)", "refit with the robust method, or "
                              "widen the range of shapes in the runs")
    loss, note = None, None
    if fit.reference is None:
        note = "no reference L_opt: the optimal shape is defined, its loss is not"
    else:
        try:
            loss = _optimum_loss(fit.law, c, x1, x2, fit.reference, params, tokens)
        except ArchsearchError as e:  # best-observed L_opt away from the observed (N, D)
            note = f"loss not predicted: {e}"
    interval = None
    bs = fit.bootstrap
    if bs and bs.get("coefficients"):
        names = bs["names"]
        s1, s2, sl = [], [], []
        for i, row in enumerate(bs["coefficients"]):
            cb = dict(zip(names, row))
            o1, o2 = form.optimum(cb)
            if o1 is None or o2 is None:
                continue
            s1.append(o1)
            s2.append(o2)
            if loss is not None:
                ref = fit.reference
                if bs.get("reference"):
                    ref = {"law": "chinchilla", "coefficients": dict(zip(bs["reference_names"], bs["reference"][i]))}
                sl.append(_optimum_loss(fit.law, cb, o1, o2, ref, params, tokens))
        if s1:
            interval = {"level": level, "n": len(s1),
                        "hidden_over_sqrt_n": list(quantiles(np.array(s1), level)),
                        "mlp_to_attn_ratio": list(quantiles(np.array(s2), level))}
            if sl:
                interval["loss"] = list(quantiles(np.array(sl), level))
    return Optimum(x1, x2, float(params), float(tokens), loss, interval, note)


def _optimum_loss(law, c, x1, x2, ref, params, tokens) -> float:
    X = {"x1": np.array([x1]), "x2": np.array([x2]),
         "Lref": reference_loss(ref, np.array([float(params)]), np.array([float(tokens)]))}
    return float(forms.predict(law, c, X)[0])


def _check_budget(params: float, tokens: float) -> None:
    if not (params > 0 and math.isfinite(params)):
        raise ArchsearchError("params", f"must be a positive number, got {params}")
    if not (tokens > 0 and math.isfinite(tokens)):
        raise ArchsearchError("tokens", f"must be a positive number, got {tokens}")


@dataclass(frozen=True)
class SolvePoint:
    """One buildable candidate of the scan."""

    hidden_over_sqrt_n: float             # requested (the grid value)
    mlp_to_attn_ratio: float              # requested
    spec: "ArchSpec"
    predicted_loss: float | None          # None when the law has no reference L_opt
    throughput: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"requested": {"hidden_over_sqrt_n": self.hidden_over_sqrt_n,
                              "mlp_to_attn_ratio": self.mlp_to_attn_ratio},
                "architecture": describe(self.spec), "predicted_loss": self.predicted_loss,
                "throughput": self.throughput}


@dataclass(frozen=True)
class SolveResult:
    """Candidates of the scan: ``points`` (all buildable, unique), ``feasible`` (predicted loss <=
    target; all points when no target), ``pareto`` (feasible, not beaten on both throughput and
    loss), ``best`` (highest throughput among feasible; without throughputs, the lowest loss)."""

    params: float
    tokens: float
    n_layers: int
    target_loss: float | None
    optimum: Optimum | None
    architecture: SolvePoint | None       # the spec built at the continuous optimum
    points: list[SolvePoint] = field(default_factory=list)
    feasible: list[SolvePoint] = field(default_factory=list)
    pareto: list[SolvePoint] = field(default_factory=list)
    best: SolvePoint | None = None
    n_unbuildable: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self, all_points: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "params": self.params, "tokens": self.tokens, "n_layers": self.n_layers,
            "target_loss": self.target_loss,
            "optimum": self.optimum.to_dict() if self.optimum else None,
            "architecture": self.architecture.to_dict() if self.architecture else None,
            "n_points": len(self.points), "n_feasible": len(self.feasible),
            "n_unbuildable": self.n_unbuildable,
            "pareto": [p.to_dict() for p in self.pareto],
            "best": self.best.to_dict() if self.best else None, "notes": list(self.notes)}
        if all_points:
            d["points"] = [p.to_dict() for p in self.points]
        return d


def default_grid(fit: "FitResult", opt: Optimum | None, n: int = 21) -> tuple[np.ndarray, np.ndarray]:
    """x1 from x1*/3 to 3 x1*, widened to cover the fitted range (an optimum extrapolated far
    outside the data may not build, while the data's shapes do), or the fitted range, or
    0.02..0.2; r over the fit's r range."""
    data = fit.data_ranges.get("hidden_over_sqrt_n")
    if opt is not None:
        lo, hi = opt.hidden_over_sqrt_n / 3.0, opt.hidden_over_sqrt_n * 3.0
        if data:
            lo, hi = min(lo, data[0] / 1.5), max(hi, data[1] * 1.5)
        x1 = np.geomspace(lo, hi, n)
    elif data:
        x1 = np.geomspace(data[0] / 1.5, data[1] * 1.5, n)
    else:
        x1 = np.geomspace(0.02, 0.2, n)
    rr = fit.options.get("r_range") or [0.5, 5.0]
    x2 = np.geomspace(rr[0], rr[1], n)
    if opt is not None:
        x1 = np.sort(np.append(x1, opt.hidden_over_sqrt_n))
        x2 = np.sort(np.append(x2, opt.mlp_to_attn_ratio))
    return x1, x2


def solve(fit: "FitResult", params: float, tokens: float, n_layers: int, target_loss: float | None,
          throughput_fn: Callable[["ArchSpec"], float | None] | None = None, *, gqa: int = 4,
          head_dim: int = 64, build: "BuildSettings | None" = None,
          grid: tuple[Sequence[float], Sequence[float]] | None = None,
          within: dict[str, Any] | None = None) -> SolveResult:
    """Scan (hidden/sqrt(N), r) at fixed N, D, n_layers; see :class:`SolveResult`.

    ``throughput_fn(spec)`` gives a measured or predicted throughput (None = unknown: the point
    stays feasible but is left out of the Pareto set). Needs a law that predicts losses (a
    conditional law with a reference, or the aspect-ratio law). ``within``: the law's fitted
    range (``FitResult.shape_range()``): shapes whose realised ratios lie outside it are never
    feasible, and a closed-form optimum outside it is not the architecture.
    """
    _check_budget(params, tokens)
    form = law_form(fit.law)
    if not form.shaped:
        raise ArchsearchError("law", f"the {fit.law} law does not depend on the architecture",
                              "fit the aspect-ratio or a conditional law")
    if target_loss is not None and not (target_loss > 0 and math.isfinite(target_loss)):
        raise ArchsearchError("target_loss", f"must be a positive loss, got {target_loss}")
    build = build or BuildSettings()
    notes: list[str] = []
    opt = None
    if form.optimum is not None:
        try:
            opt = optimum(fit, params, tokens)
        except ArchsearchError as e:
            if not e.field.startswith("coefficients."):
                raise
            # a factor that is monotone over the data: the best shape lies on the grid's edge
            notes.append(f"no closed-form optimum ({e.problem}); the scan alone decides")
    can_predict = not form.conditional or fit.reference is not None
    if target_loss is not None and not can_predict:
        raise ArchsearchError("reference", "a target loss needs predicted losses, and this law has no "
                              "reference L_opt", "add a reference (--reference-law) or drop --target-loss")
    x1s, x2s = grid if grid is not None else default_grid(fit, opt)
    seen: dict[Any, tuple[float, float, Any]] = {}  # spec -> first grid point that built it
    unbuildable = 0
    for x1 in x1s:
        for x2 in x2s:
            try:
                cand = build_candidate(params, n_layers, float(x1), float(x2), gqa=gqa,
                                       head_dim=head_dim, settings=build)
            except ArchsearchError:
                unbuildable += 1
                continue
            if cand.spec not in seen:
                seen[cand.spec] = (float(x1), float(x2), cand.spec)
    specs = list(seen.values())
    losses = _predict_specs(fit, [s for _, _, s in specs], tokens, can_predict, params)
    points = []
    for (x1, x2, spec), loss in zip(specs, losses):
        if not _inside(spec, within):
            continue
        tp = throughput_fn(spec) if throughput_fn else None
        points.append(SolvePoint(x1, x2, spec, loss, None if tp is None else float(tp)))

    arch = None
    if opt is not None and not inside_range(opt.hidden_over_sqrt_n, opt.mlp_to_attn_ratio, within):
        notes.append(f"the closed-form optimum (d/sqrt(N) {opt.hidden_over_sqrt_n:.4g}, r {opt.mlp_to_attn_ratio:.4g}) "
                     f"lies outside the law's fitted range ({within.get('source')}); the scan stays inside it")
    elif opt is not None:
        try:
            cand = build_candidate(params, n_layers, opt.hidden_over_sqrt_n, opt.mlp_to_attn_ratio,
                                   gqa=gqa, head_dim=head_dim, settings=build)
            loss = _predict_specs(fit, [cand.spec], tokens, can_predict, params)[0]
            tp = throughput_fn(cand.spec) if throughput_fn else None
            arch = SolvePoint(opt.hidden_over_sqrt_n, opt.mlp_to_attn_ratio, cand.spec, loss,
                              None if tp is None else float(tp))
        except ArchsearchError as e:
            notes.append(f"the optimum itself does not build ({e})")
    if arch is None and points and can_predict:
        arch = min(points, key=lambda p: p.predicted_loss)
        notes.append("architecture is the lowest-loss buildable grid point"
                     + (" (no closed-form optimum)" if opt is None else ""))
        if opt is None and (arch.hidden_over_sqrt_n in (min(x1s), max(x1s))
                            or arch.mlp_to_attn_ratio in (min(x2s), max(x2s))):
            notes.append("that point is on the edge of the scanned grid: the law's loss keeps "
                         "falling beyond it, so widen the grid or read it as a bound")
    elif arch is None and not points:
        # say so, rather than leave every field null under a note that promises an architecture
        notes.append(f"no architecture: none of the {unbuildable} scanned grid points builds at "
                     f"N={params:.3g} with {n_layers} layers, heads of {head_dim} and widths in "
                     f"multiples of {build.hidden_multiple} (lower head_dim / hidden_multiple / "
                     "ffn_multiple, or raise the tolerance)")
    elif arch is None:
        notes.append("no architecture: without a reference L_opt the law cannot rank shapes by loss "
                     "(add a reference, e.g. --reference-law)")

    if target_loss is None:
        feasible = list(points)
    else:
        feasible = [p for p in points if p.predicted_loss <= target_loss]
        if not feasible:
            best_loss = min((p.predicted_loss for p in points), default=float("nan"))
            notes.append(f"no candidate meets the target loss {target_loss:.4g} (lowest predicted "
                         f"{best_loss:.4g})")
    pareto = pareto_front(feasible)
    with_tp = [p for p in feasible if p.throughput is not None]
    if with_tp:
        best = max(with_tp, key=lambda p: (p.throughput, -p.predicted_loss))
    elif feasible and can_predict:
        best = min(feasible, key=lambda p: p.predicted_loss)
    else:
        best = None
    return SolveResult(float(params), float(tokens), n_layers, target_loss, opt, arch, points,
                       feasible, pareto, best, unbuildable, notes)


def inside_range(x1: float, r: float, within: dict[str, Any] | None) -> bool:
    """(hidden/sqrt(N), r) lies in ``within`` (a law's ``shape_range()``; None: no range to check)."""
    if within is None:
        return True
    for key, v in (("hidden_over_sqrt_n", x1), ("mlp_to_attn", r)):
        b = within.get(key)
        if b is not None and not b[0] * (1 - 1e-9) <= v <= b[1] * (1 + 1e-9):
            return False
    return True


def _inside(spec, within: dict[str, Any] | None) -> bool:
    """The spec's realised ratios (what the law reads) lie in the fitted range."""
    return within is None or inside_range(hidden_over_sqrt_n(spec), mlp_to_attn_ratio(spec), within)


def _predict_specs(fit, specs, tokens, can_predict, params) -> list[float]:
    """Losses of the shapes' ratios at the budget ``params`` (snapping moves each one's own N)."""
    if not specs:
        return []
    if not can_predict:
        return [None] * len(specs)
    return [float(v) for v in fit.predict_arrays(spec_arrays(specs, [tokens] * len(specs), params))]


def pareto_front(points: Sequence[SolvePoint]) -> list[SolvePoint]:
    """Points with a throughput that no other point beats on both throughput (higher) and loss
    (lower), sorted by loss."""
    pts = sorted((p for p in points if p.throughput is not None and p.predicted_loss is not None),
                 key=lambda p: (p.predicted_loss, -p.throughput))
    out, top = [], -math.inf
    for p in pts:
        if p.throughput > top:
            out.append(p)
            top = p.throughput
    return out

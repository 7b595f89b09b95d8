"""Active proxy plan: which proxy run to train next so that the optimum's interval shrinks most
per training FLOP. Pure math on arrays; the driver that trains is ``archsearch.trainers.active_proxies``.

What the study needs from the proxies is the loss-optimal shape ``(d/sqrt(N)*, r*)`` of the
conditional law (docs/method.md section 3). The law's bootstrap gives an ensemble: for every resample ``b``, the
optimum ``t_b = (log x1*, log r*)`` and the predicted log loss ``y_b(c)`` of every candidate run
``c``. Treating the ensemble as Gaussian (as an ensemble Kalman filter does), observing ``c``
with log-noise variance ``s2`` lowers the variance of ``t_i`` by
``Cov(t_i, y_c)^2 / (Var(y_c) + s2)``. The plan picks the candidate with the largest total
reduction (both coordinates in log units, i.e. relative) per FLOP (``6 N D``). For a batch, it
conditions the ensemble covariance on each pick before the next; the update needs no observed
value, so runs in flight (another worker's) are conditioned on the same way.

The ensemble and the interval of the optimum come from a parametric bootstrap of the law the
plan fits (:func:`offset_bootstrap`): every size's L_opt a free offset, refitted in every
replicate, noise drawn at the residuals' degrees-of-freedom-corrected scale. The interval is a
*simultaneous* one: both coordinates inside together with probability ``level`` (Sidak: each
coordinate's percentile interval at ``sqrt(level)``). Its relative half-width ``(hi - lo) / 2``
in log units is what the tolerance bounds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from archsearch.arch import training_flops
from archsearch.errors import ArchsearchError
from archsearch.laws import forms
from archsearch.laws.fit import fit_law
from archsearch.laws.lawfile import run_arrays, spec_arrays
from archsearch.laws.metrics import cluster
from archsearch.laws.registry import law_form
from archsearch.rundata import RunRecord


@dataclass(frozen=True)
class OptimumInterval:
    """Interval of the optimum (d/sqrt(N)*, r*) from bootstrap optima and its relative half-widths.
    ``level`` is the joint level (both coordinates inside together) when ``method`` says
    ``simultaneous``; each coordinate's own level is then ``sqrt(level)``."""

    hidden_over_sqrt_n: tuple[float, float]
    mlp_to_attn_ratio: tuple[float, float]
    level: float
    n: int                                # usable resamples
    pinned: tuple[bool, bool] = (False, False)   # a quarter or more of the resamples (3+) at a bound
    method: str = "percentile"

    @property
    def half_widths(self) -> tuple[float, float]:
        """(hi - lo) / 2 of log x1* and log r*: a relative half-width (0.05 = about +-5%)."""
        return tuple(0.5 * math.log(hi / lo) for lo, hi in (self.hidden_over_sqrt_n, self.mlp_to_attn_ratio))

    @property
    def width(self) -> float:
        """The larger of the two half-widths: the plan stops when it is below the tolerance.
        Infinite when a coordinate is pinned: resamples piled on one value are optima at the
        fit's bound (outside the data), not a narrow interval."""
        return math.inf if any(self.pinned) else max(self.half_widths)

    def to_dict(self) -> dict[str, Any]:
        return {"hidden_over_sqrt_n": list(self.hidden_over_sqrt_n),
                "mlp_to_attn_ratio": list(self.mlp_to_attn_ratio), "level": self.level, "n": self.n,
                "half_width_hidden_over_sqrt_n": self.half_widths[0],
                "half_width_mlp_to_attn_ratio": self.half_widths[1],
                "pinned_at_bound": list(self.pinned), "method": self.method}


def bootstrap_optima(coefficients: Sequence[dict[str, float]], law: str = "conditional-multiplicative"
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(log optima as rows (log x1*, log r*), indices of the usable resamples) of form ``law``:
    resamples whose factors are not both U-shaped have no optimum and are left out."""
    optimum = law_form(law).optimum
    rows, keep = [], []
    for i, c in enumerate(coefficients):
        o1, o2 = optimum(c)
        if o1 is not None and o2 is not None:
            rows.append((math.log(o1), math.log(o2)))
            keep.append(i)
    return np.array(rows, dtype=float).reshape(-1, 2), np.array(keep, dtype=int)


INTERVALS = ("simultaneous", "percentile")


def optimum_interval(log_optima: np.ndarray, level: float = 0.9, method: str = "simultaneous",
                     bounds: np.ndarray | None = None) -> OptimumInterval:
    """Percentile interval of the bootstrap optima (rows of log x1*, log r*).

    ``simultaneous`` (default): a rectangle that holds the optimum in both coordinates together
    with probability ``level``: each coordinate's percentile interval at ``sqrt(level)`` (Sidak;
    for a Gaussian pair that is at least ``level`` whatever their correlation). ``percentile``:
    each coordinate at ``level`` (their joint coverage is lower). ``bounds``: (2, 2) rows
    (low, high) of the fit's bounds on log x1*, log r*; resamples there are optima the data
    could not place, and a quarter of them at one bound pins the coordinate. Without it (or
    also), many resamples equal to the extreme one count as piled on a bound."""
    if method not in INTERVALS:
        raise ValueError(f"method must be one of {INTERVALS}, got {method!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if log_optima.shape[0] < 2:
        raise ValueError("an interval needs at least 2 usable bootstrap resamples")
    a = (1.0 - (math.sqrt(level) if method == "simultaneous" else level)) / 2.0
    lo, hi = np.exp(np.quantile(log_optima, [a, 1.0 - a], axis=0))
    # continuous resampled optima do not tie; many equal to the extreme one sit on a bound
    ext = [max(np.sum(log_optima[:, j] == log_optima[:, j].max()), np.sum(log_optima[:, j] == log_optima[:, j].min()))
           for j in range(2)]
    if bounds is not None:
        span = np.asarray(bounds, float)
        near = 1e-3 * (span[:, 1] - span[:, 0])
        ext = [max(e, int(np.sum(np.abs(log_optima[:, j] - span[j, 0]) <= near[j])),
                   int(np.sum(np.abs(log_optima[:, j] - span[j, 1]) <= near[j]))) for j, e in enumerate(ext)]
    n = log_optima.shape[0]
    return OptimumInterval((float(lo[0]), float(hi[0])), (float(lo[1]), float(hi[1])), level, int(n),
                           tuple(bool(e >= 3 and e >= 0.25 * n) for e in ext), method)


@dataclass(frozen=True)
class Pick:
    """One chosen candidate: its index, the expected reduction of the optimum's variance
    (sum over log x1*, log r*), that per FLOP, and the expected half-width after the batch so far."""

    index: int
    variance_reduction: float
    score: float
    expected_width_after: float


def expected_width(var: np.ndarray, prior_var: np.ndarray, width: float) -> float:
    """Half-width scaled by the standard deviation ratio of the worse coordinate (Gaussian)."""
    if not math.isfinite(width):
        return width
    ratio = np.sqrt(np.maximum(var, 0.0) / np.maximum(prior_var, 1e-300))
    return float(width * ratio.max())


WEIGHTS = ("log", "relative")


def acquire(log_optima: np.ndarray, log_pred: np.ndarray, cost: np.ndarray, noise_var: float | np.ndarray,
            available: np.ndarray, pending: Sequence[int] = (), k: int = 1,
            width: float | None = None, weights: str = "log") -> list[Pick]:
    """Greedy batch of ``k`` candidates (see the module docstring).

    ``log_optima``: (B, 2) bootstrap optima in logs; ``log_pred``: (B, C) log predicted loss of
    every candidate under the same resamples; ``cost``: (C,) FLOPs; ``noise_var``: the log-noise
    variance of an observation, one for all or (C,) per candidate (``inf``: it tells nothing);
    ``available``: (C,) bool, candidates that may be picked; ``pending``: candidates already
    being trained (conditioned on, never picked); ``width``: the current half-width, to report
    the expected one after. Candidates whose expected reduction is zero are never picked.
    ``weights``: how the two coordinates' variance reductions add up. ``log`` (default): as they
    are; both are variances of logs, i.e. of relative errors, in the same units as the stopping
    rule (the larger half-width) and the benchmark's error (the larger relative error), so the
    coordinate that is known worse gains most from a run. ``relative``: each divided by its
    current variance (the same fraction off both), which spends runs on the coordinate that is
    already known better.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    B, C = log_pred.shape
    if log_optima.shape != (B, 2) or cost.shape != (C,) or available.shape != (C,):
        raise ValueError("shapes of log_optima, log_pred, cost, available do not match")
    if B < 3:
        raise ValueError("the ensemble needs at least 3 resamples")
    Z = np.concatenate([log_optima, log_pred], axis=1)
    Z = Z - Z.mean(axis=0)
    S = Z.T @ Z / (B - 1)                         # joint covariance: 2 targets, then C candidates
    prior = np.diag(S)[:2].copy()
    w = 1.0 / np.maximum(prior, 1e-12) if weights == "relative" else np.ones(2)
    avail = available.copy()
    nv = np.broadcast_to(np.asarray(noise_var, float), (C,))

    def condition(S, j):
        if not np.isfinite(nv[j]):
            return S                              # an observation that tells nothing
        col = S[:, j + 2].copy()
        return S - np.outer(col, col) / (S[j + 2, j + 2] + nv[j])

    for j in pending:
        S = condition(S, j)
        avail[j] = False
    picks: list[Pick] = []
    for _ in range(k):
        if not avail.any():
            break
        cov_t = S[:2, 2:]                         # (2, C)
        var_y = np.diag(S)[2:] + nv
        red = (w[:, None] * cov_t ** 2).sum(axis=0) / var_y
        score = np.where(avail, red / cost, -np.inf)
        j = int(np.argmax(score))
        if not red[j] > 0:
            break                                 # nothing left that narrows the optimum
        S = condition(S, j)
        avail[j] = False
        after = expected_width(np.diag(S)[:2], prior, width) if width is not None else float("nan")
        picks.append(Pick(j, float(red[j]), float(score[j]), after))
    return picks


def space_filling(points: np.ndarray, observed: np.ndarray, cost: np.ndarray,
                  available: np.ndarray) -> int:
    """Before a law can be fitted: among the available candidates of the lowest cost, the one
    farthest (in log coordinates ``points``, (C, dims)) from every observed one. The shape law
    is shared across sizes, so the cheapest runs fill the box as well as dear ones."""
    if not available.any():
        raise ValueError("no candidate is available")
    cheapest = cost[available].min()
    cand = np.flatnonzero(available & (cost <= 1.5 * cheapest))
    if observed.any():
        d = np.min(np.linalg.norm(points[cand][:, None, :] - points[observed][None, :, :], axis=2), axis=1)
    else:
        d = np.zeros(len(cand))
    return int(cand[int(np.argmax(d))])


def noise_variance(log_residuals: np.ndarray, n_params: int, floor: float) -> float:
    """Log-noise variance of one run from the fit's residuals (degrees-of-freedom corrected),
    never below ``floor**2``: with as many runs as parameters the residuals are zero."""
    n = log_residuals.size
    dof = n - n_params
    est = float(np.sum(log_residuals ** 2) / dof) if dof > 0 else 0.0
    return max(est, floor ** 2)


def initial_design(levels: np.ndarray, x1: np.ndarray, r: np.ndarray, kind: str) -> np.ndarray:
    """Indices of the initial runs among candidates with coordinates (level, x1, r): at the
    smallest level, ``corners-centre`` (4 corners of the box and the point nearest its centre
    in logs) or ``grid3`` (corners, edge midpoints, centre)."""
    small = np.flatnonzero(levels == levels.min())
    lx, lr = np.log(x1[small]), np.log(r[small])
    fr = {"grid3": np.linspace(0.0, 1.0, 3), "centre": np.array([])}.get(kind, np.array([0.0, 1.0]))
    targets = [(a, b) for a in fr for b in fr]
    if kind != "grid3":
        targets.append((0.5, 0.5))
    ux = (lx - lx.min()) / max(np.ptp(lx), 1e-12)
    ur = (lr - lr.min()) / max(np.ptp(lr), 1e-12)
    chosen: list[int] = []
    for a, b in targets:
        d = (ux - a) ** 2 + (ur - b) ** 2
        for i in np.argsort(d, kind="stable"):
            if int(small[i]) not in chosen:
                chosen.append(int(small[i]))
                break
    return np.array(chosen, dtype=int)


# -- the plan's fit: L_opt of every size as a fitted offset --------------------------------------

HUBER_K = 1.345   # Huber's tuning constant: 95% of least squares' efficiency under Gaussian noise


def robust_scale(log_residuals: np.ndarray) -> float:
    """Standard deviation of the log residuals, estimated robustly (1.4826 x their median
    absolute deviation from the median), so that a few bad runs do not inflate it."""
    r = np.asarray(log_residuals, float)
    return float(1.4826 * np.median(np.abs(r - np.median(r)))) if r.size else 0.0


def fit_profiled(runs: Sequence, law: str, options: Any, rounds: int = 4, tol: float = 1e-5,
                 scale_huber: bool = True):
    """The conditional law with a best-observed reference whose L_opt per (N, D) group is fitted,
    not read off the group's best run.

    A best-observed L_opt is the minimum of the group's noisy losses. With the full grid at every
    size that minimum sits at a similar shape and noise draw in every group, so its bias is common
    and the factors' a0, b0 absorb it. An active plan trains few runs at some sizes: there the best
    run is at a worse shape and is the minimum of fewer draws, so the groups' L_opt are biased
    differently, and a shared shape factor cannot absorb offsets that differ by size (in the
    synthetic benchmark the optimum's error grew from 2% to 30% as soon as a few runs of the
    next size joined). Here every group's L_opt is refined to the mean of its runs' observed /
    predicted loss (in logs) and the factors refitted, a few rounds: block coordinate descent on
    ``log L = log f_a(x1) + log f_b(r) + c_group``. A group with one run then carries no
    information about the shape (its offset is free), which is the truth of that design.
    Resamples of the bootstrap keep the final offsets (their spread is left out of the interval).

    ``scale_huber``: the Huber loss's delta (``options.huber_delta``, 1e-3 in log units by
    default) is raised to ``1.345 x`` the robust scale of the log residuals once the offsets are fitted
    (:func:`robust_scale`), never lowered. A delta far below the noise turns the Huber loss into
    least absolute deviations, which for Gaussian noise needs about 1.6 times the runs for the
    same precision; in the synthetic benchmark at 1% noise it made the full grid's optimum
    markedly worse (docs/method.md section 3 has the figures).
    1.345 sigma is Huber's constant: 95% of least squares' efficiency when the noise is
    Gaussian, and runs beyond it still count linearly, not quadratically.
    """
    if options.reference != "best-observed" or options.reference_law is not None or not law_form(law).conditional:
        return fit_law(runs, law, options)
    final = options
    options = dataclasses.replace(options, bootstrap=0)   # the rounds need the point fit only
    fit = fit_law(runs, law, options)
    ok = [r for r in runs if r.status == "ok"]
    X, L = run_arrays(ok)
    if options.r_range is not None:
        keep = (X["x2"] >= options.r_range[0]) & (X["x2"] <= options.r_range[1])
        X, L = {k: v[keep] for k, v in X.items()}, L[keep]
    key = cluster(X["N"], options.size_tolerance) * (10 ** 6) + cluster(X["D"], options.size_tolerance)
    groups = {int(k): dict(g) for k, g in zip(np.unique(key), _groups_in_order(fit.reference["groups"], X, key))}

    def profile(fit, options):
        ref = None
        for _ in range(rounds):
            res = np.log(L) - np.log(fit.predict_arrays(X))
            shift = {k: float(np.mean(res[key == k])) for k in groups}
            for k, d in shift.items():
                groups[k]["loss"] *= math.exp(d)
            ref = {"law": "best-observed", "groups": [dict(g) for g in groups.values()], "tolerance": options.size_tolerance}
            fit = fit_law(runs, law, dataclasses.replace(options, reference_law=ref))
            if max(abs(d) for d in shift.values()) < tol:
                break
        return fit, ref

    fit, ref = profile(fit, options)
    if scale_huber:   # the scale of the residuals once every size's offset is fitted
        delta = HUBER_K * robust_scale(np.log(L) - np.log(fit.predict_arrays(X)))
        if delta > options.huber_delta:
            options = dataclasses.replace(options, huber_delta=delta)
            final = dataclasses.replace(final, huber_delta=delta)
            fit, ref = profile(fit_law(runs, law, dataclasses.replace(options, reference_law=ref)), options)
    return fit_law(runs, law, dataclasses.replace(final, reference_law=ref)) if final.bootstrap else fit


def _groups_in_order(groups: list[dict[str, float]], X: dict, key: np.ndarray) -> list[dict[str, float]]:
    """The reference's groups in the order of ``np.unique(key)`` (each matched by its N, D)."""
    out = []
    for k in np.unique(key):
        j = int(np.flatnonzero(key == k)[0])
        n, d = X["N"][j], X["D"][j]
        out.append(min(groups, key=lambda g: abs(math.log(g["params"] / n)) + abs(math.log(g["tokens"] / d))))
    return out


# -- the interval of the optimum: a parametric bootstrap of the plan's law ----------------------

def _shape_logpred(shape: np.ndarray, lx1: np.ndarray, lx2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``log(1 + a h(x1/x1*)) + log(1 + b h(r/r*))`` and its Jacobian in ``(a, log x1*, b, log r*)``:
    the multiplicative law's two factors with the optimum as a parameter, each scaled to 1 at its
    minimum (the scale sits in the size's offset). ``shape`` may be (4,) or (B, 4) with ``lx1``,
    ``lx2`` broadcast against (B, 1)."""
    a, u1, b, u2 = (shape[..., i] for i in range(4))
    if np.ndim(shape) == 2:
        a, u1, b, u2 = (v[:, None] for v in (a, u1, b, u2))
    h1, dh1 = forms.h_and_slope(lx1, u1)
    h2, dh2 = forms.h_and_slope(lx2, u2)
    F, G = 1.0 + a * h1, 1.0 + b * h2
    y = np.log(F) + np.log(G)
    if np.ndim(shape) == 2:
        return y, None
    return y, np.stack([h1 / F, a * dh1 / F, h2 / G, b * dh2 / G], axis=1)


def _fit_offsets(lx1, lx2, group, n_groups, y, start, delta, bounds):
    """The Huber fit (delta in log units) of ``y = c_group + shape(x1, r)`` over the shape and
    every group's offset together (``scipy.optimize.least_squares``, trust-region reflective
    within ``bounds`` on the shape); returns the parameter vector (shape, offsets)."""
    from scipy.optimize import least_squares

    n = y.size
    rows = np.arange(n)

    def fun(th):
        return _shape_logpred(th[:4], lx1, lx2)[0] + th[4:][group] - y

    def jac(th):
        J = np.zeros((n, 4 + n_groups))
        J[:, :4] = _shape_logpred(th[:4], lx1, lx2)[1]
        J[rows, 4 + group] = 1.0
        return J

    lo = np.r_[bounds[:, 0], np.full(n_groups, -np.inf)]
    hi = np.r_[bounds[:, 1], np.full(n_groups, np.inf)]
    span = bounds[:, 1] - bounds[:, 0]
    x0 = np.asarray(start, float).copy()
    x0[:4] = np.clip(x0[:4], bounds[:, 0] + 1e-9 * span, bounds[:, 1] - 1e-9 * span)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        r = least_squares(fun, x0, jac=jac, bounds=(lo, hi), loss="huber", f_scale=delta, x_scale="jac",
                          xtol=1e-10, ftol=1e-10, gtol=1e-10, max_nfev=200)
    return r.x


@dataclass(frozen=True)
class OffsetBootstrap:
    """The plan's law refitted on replicates of its data: the parametric bootstrap behind the
    optimum's interval and the acquisition's ensemble (:func:`offset_bootstrap`).

    ``estimate``: the fit on the data, ``(a, log x1*, b, log r*, offsets...)`` (the law
    ``log L = c_size + log(1 + a h(x1/x1*)) + log(1 + b h(r/r*))``, ``h(t) = log t + 1/t - 1``,
    the multiplicative form with its optimum as a parameter); ``replicates``: (B, 4) the shape
    refitted on every replicate; ``sigma``: the log-noise of one run, ``sqrt(RSS / dof)`` with
    ``dof = runs - 4 - sizes``; ``bounds``: (4, 2) the fit's bounds on the shape."""

    estimate: np.ndarray
    replicates: np.ndarray
    sigma: float
    dof: int
    bounds: np.ndarray

    @property
    def log_optima(self) -> np.ndarray:
        """(B, 2): log x1*, log r* of every replicate."""
        return self.replicates[:, [1, 3]]

    def log_shape(self, X: dict) -> np.ndarray:
        """(B, C): every replicate's log shape factor at points ``X`` (x1, x2): the prediction up
        to the size's offset, which is what the acquisition's ensemble needs."""
        return _shape_logpred(self.replicates, np.log(X["x1"])[None, :], np.log(X["x2"])[None, :])[0]


def size_group_keys(X: dict, tolerance: float) -> np.ndarray:
    """One integer per run naming its (N, D) group, as the fit groups runs for L_opt."""
    return cluster(X["N"], tolerance) * (10 ** 6) + cluster(X["D"], tolerance)


def offset_bootstrap(fit, X: dict, L: np.ndarray, n: int, seed: int = 0,
                     noise_floor: float = 0.0) -> OffsetBootstrap | None:
    """Parametric bootstrap of the optimum of the multiplicative law with every size's L_opt
    free (what :func:`fit_profiled` fits): refit the law jointly (shape and offsets, the Huber
    delta of ``fit``) warm-started at ``fit``; then ``n`` times draw every run's log loss as the
    fitted law plus Gaussian noise and refit shape *and* offsets. The noise scale is the residuals'
    ``sqrt(RSS / dof)`` (at least ``noise_floor``), drawn again for every replicate as
    ``s * sqrt(dof / chi2_dof)``: its uncertainty with few runs widens the interval as a t
    quantile would (for a linear model the replicates' percentile interval is then the exact t
    interval). None when there are no degrees of freedom left (runs <= 4 + sizes).

    Why not the fit's own bootstrap (resampling runs with every size's L_opt held at the point
    fit's): it leaves the offsets' uncertainty out, and with 32 resamples its 5% and 95%
    quantiles are themselves noisy; in the synthetic benchmark its 90% interval held the true
    optimum in 6 of 12 seeds at 1% noise (docs/method.md section 3)."""
    if fit.law != "conditional-multiplicative":
        raise ValueError("offset_bootstrap needs the conditional-multiplicative law")
    tol = float(fit.reference.get("tolerance", 0.05)) if fit.reference else 0.05
    key = size_group_keys(X, tol)
    _, group = np.unique(key, return_inverse=True)
    n_groups = int(group.max()) + 1
    dof = L.size - 4 - n_groups
    if dof < 1:
        return None
    lx1, lx2, y = np.log(X["x1"]), np.log(X["x2"]), np.log(L)
    bounds = np.array(forms.get_form(fit.law).bounds({**X, "Lref": np.ones(L.size)}, L))[[1, 2, 3, 4]]
    c = fit.coefficients
    try:
        k, a1, u1, b1, u2 = forms.CONDITIONAL_MULTIPLICATIVE.from_coefficients(c, None)
        start = np.array([a1 / math.exp(k), u1, b1, u2])
    except ValueError:            # a factor without curvature: start flat at the box centre
        start = np.array([1e-3, 0.5 * (lx1.min() + lx1.max()), 1e-3, 0.5 * (lx2.min() + lx2.max())])
    base = _shape_logpred(start, lx1, lx2)[0]
    start = np.r_[start, [np.mean((y - base)[group == g]) for g in range(n_groups)]]
    delta = float(fit.options.get("huber_delta", 1e-3)) if fit.options else 1e-3
    est = _fit_offsets(lx1, lx2, group, n_groups, y, start, delta, bounds)
    yhat = _shape_logpred(est[:4], lx1, lx2)[0] + est[4:][group]
    s = max(math.sqrt(float(np.sum((y - yhat) ** 2)) / dof), noise_floor)
    rng = np.random.default_rng([seed, L.size, 16])
    reps = np.empty((n, 4))
    for b in range(n):
        sb = s * math.sqrt(dof / rng.chisquare(dof))
        reps[b] = _fit_offsets(lx1, lx2, group, n_groups, yhat + sb * rng.standard_normal(L.size),
                               est, delta, bounds)[:4]
    return OffsetBootstrap(est, reps, s, dof, bounds)


def size_noise(pool: "Pool", observed: Sequence[int], pending: Sequence[int], noise: float, fit) -> np.ndarray:
    """Per candidate, the log-noise variance of what its run tells about the shape. With every
    size's L_opt fitted (:func:`fit_profiled`), a run's loss is read against its size's offset,
    itself the mean of that size's ``n`` runs: the observation's variance is ``noise * (1 + 1/n)``
    (``n`` counts the runs done and in flight there, the new one not included). Alone, the first
    run at a size tells nothing about the shape; with the second the pair tells as much as one
    observation of variance ``2 noise``. A greedy choice that valued the first at nothing would
    never open a size, so it is valued as the second will be (``2 noise``, optimistic for that
    one run): the cost per FLOP still keeps the plan at the cheapest size while it has runs worth
    training. A law with a Chinchilla reference has no per-size offset: ``noise`` for all."""
    out = np.full(len(pool), float(noise))
    if fit.reference is None or fit.reference.get("law") != "best-observed":
        return out
    counts = np.bincount(pool.level[list(observed) + list(pending)], minlength=int(pool.level.max()) + 1)
    n = np.maximum(counts[pool.level].astype(float), 1.0)
    return out * (1.0 + 1.0 / n)


# -- one step of the plan: fit, interval, next runs ---------------------------------------------

INITIAL_DESIGNS = ("corners-centre", "grid3")


@dataclass(frozen=True)
class Pool:
    """The candidate proxy runs (a sweep's grid): shapes, token budgets, size level, FLOPs."""

    specs: tuple
    tokens: np.ndarray
    level: np.ndarray
    X: dict
    flops: np.ndarray

    @classmethod
    def of(cls, specs: Sequence, tokens: Sequence[float], levels: Sequence[int]) -> "Pool":
        return cls(tuple(specs), np.asarray(tokens, float), np.asarray(levels, int),
                   spec_arrays(specs, tokens),
                   np.array([training_flops(s, t) for s, t in zip(specs, tokens)]))

    def __len__(self) -> int:
        return len(self.specs)

    def log_coords(self) -> np.ndarray:
        return np.log(np.stack([self.X["N"], self.X["x1"], self.X["x2"]], axis=1))


@dataclass(frozen=True)
class Proposal:
    """What one step decided: the runs to train (index, reason, score, expected half-width
    after), and the fit it rests on (interval of the optimum, point optimum, noise)."""

    picks: list[dict[str, Any]]
    interval: OptimumInterval | None
    optimum: tuple[float, float] | None
    noise: float | None
    note: str
    coefficients: dict[str, float] | None = None   # the fit's (None before a law is fitted)


@dataclass(frozen=True)
class Ensemble:
    """What a plan step knows once a law is fitted: the fit, its point optimum (None without an
    interior one), the interval of the optimum, the bootstrap optima (B, 2) in logs and every
    candidate's log prediction under the same replicates (B, C), and one run's log-noise variance."""

    fit: Any
    optimum: tuple[float, float] | None
    interval: OptimumInterval
    log_optima: np.ndarray
    log_pred: np.ndarray
    noise: float
    n_usable: int


def ensemble(pool: Pool, observed: dict[int, float], law: str, options: Any, level: float = 0.9,
             noise_floor: float = 0.002, min_resamples: int = 10) -> "Ensemble | str":
    """Fit the law to the finished runs (``observed``: pool index -> loss) and bootstrap it: the
    plan's own law (multiplicative, every size's L_opt fitted) by :func:`offset_bootstrap`
    (``options.bootstrap`` replicates), another law or reference by the fit's own bootstrap over
    runs. Returns the :class:`Ensemble`, or a sentence saying why there is none yet."""
    idx = sorted(observed)
    runs = [RunRecord.from_arch(pool.specs[i], tokens=float(pool.tokens[i]), loss=float(observed[i]),
                                run_id=f"c{i}") for i in idx]
    parametric = (law == "conditional-multiplicative" and options.reference == "best-observed"
                  and options.reference_law is None)
    try:
        fit = fit_profiled(runs, law, dataclasses.replace(options, bootstrap=0) if parametric else options)
    except ArchsearchError as e:
        return f"no law can be fitted yet ({e})"
    c = fit.coefficients
    point = law_form(law).optimum(c)
    r = pool.X["x2"][idx]
    used = [i for i, v in zip(idx, r) if options.r_range is None or options.r_range[0] <= v <= options.r_range[1]]
    X, L = {k: v[used] for k, v in pool.X.items()}, np.array([observed[i] for i in used])
    if parametric:
        ob = offset_bootstrap(fit, X, L, options.bootstrap, seed=options.seed, noise_floor=noise_floor)
        if ob is None:
            return (f"{len(used)} runs leave no degree of freedom for the noise once the law's 4 shape parameters "
                    "and every size's L_opt are fitted")
        ok = np.all(np.isfinite(ob.replicates), axis=1)
        if ok.sum() < min_resamples:
            return f"only {int(ok.sum())} of {ok.size} bootstrap fits are finite"
        return Ensemble(fit, None if None in point else point,
                        optimum_interval(ob.log_optima[ok], level, bounds=ob.bounds[[1, 3]]),
                        ob.log_optima[ok], ob.log_shape(pool.X)[ok], ob.sigma ** 2, int(ok.sum()))
    coefs = [dict(zip(fit.bootstrap["names"], row)) for row in (fit.bootstrap or {}).get("coefficients", [])]
    log_opt, keep = bootstrap_optima(coefs, law)
    if keep.size < min_resamples:
        return f"only {keep.size} of {len(coefs)} bootstrap fits have an interior optimum"
    # L_opt is common to the resamples unless a Chinchilla reference is refitted per resample;
    # a common L_opt only shifts log predictions, so leaving it out keeps every covariance
    try:
        pred = fit.bootstrap_predictions(pool.X)
    except ArchsearchError:
        pred = fit.bootstrap_predictions({**pool.X, "Lref": np.ones(len(pool))})
    res = np.log(fit.predict_arrays(X)) - np.log(L)
    return Ensemble(fit, None if None in point else point, optimum_interval(log_opt, level), log_opt,
                    np.log(np.maximum(pred[keep], 1e-12)), noise_variance(res, 5, noise_floor), int(keep.size))


def propose(pool: Pool, observed: dict[int, float], pending: Sequence[int], law: str, options: Any,
            k: int = 1, initial: str = "grid3", noise_floor: float = 0.002,
            level: float = 0.9, min_resamples: int = 10, exclude: Sequence[int] = (),
            max_cost: float = math.inf, anchors: Sequence[int] = (), weights: str = "log") -> Proposal:
    """The next ``k`` runs given the finished ones (``observed``: pool index -> loss), those in
    flight (``pending``) and those never to propose (``exclude``, e.g. failed); runs dearer
    than ``max_cost`` FLOPs (what is left of a budget) are not proposed. ``anchors``: size levels
    whose box centre joins the initial design (a best-observed L_opt needs a run at the target
    size). ``options``: the :class:`~archsearch.laws.fit.FitOptions` of the fit,
    with the (small) bootstrap the ensemble needs. ``weights``: see :func:`acquire`."""
    taken = set(observed) | set(pending) | set(exclude)
    r = pool.X["x2"]
    in_range = np.ones(len(pool), bool) if options.r_range is None else \
        (r >= options.r_range[0]) & (r <= options.r_range[1])   # the fit would drop the others
    available = np.array([i not in taken for i in range(len(pool))]) & in_range & (pool.flops <= max_cost)
    if not available.any() and not observed:
        return Proposal([], None, None, None, "no candidate left (trained, in flight, or over the budget)")
    sub = np.flatnonzero(in_range)
    design = [int(sub[i]) for i in initial_design(pool.level[sub], pool.X["x1"][sub], r[sub], initial)]
    why = {i: f"initial design ({initial} of the box at the smallest size)" for i in design}
    for lv in anchors:
        at = sub[pool.level[sub] == lv]
        if at.size:
            for i in initial_design(pool.level[at], pool.X["x1"][at], r[at], "centre"):
                design.append(int(at[i]))
                why.setdefault(int(at[i]), "initial design (box centre at the target size: the "
                               "best-observed L_opt needs a run there)")
    todo = [i for i in design if available[i]]
    if todo:
        return Proposal([{"index": i, "reason": why[i]} for i in todo[:k]], None, None, None, "initial design")

    def fill(note):
        picks, avail, obs = [], available.copy(), np.zeros(len(pool), bool)
        obs[list(taken)] = True
        for _ in range(min(k, int(avail.sum()))):
            i = space_filling(pool.log_coords()[:, 1:], obs, pool.flops, avail)
            picks.append({"index": i, "reason": f"space-filling: {note}"})
            avail[i], obs[i] = False, True
        return Proposal(picks, None, None, None, note)

    idx = sorted(observed)
    ens = ensemble(pool, observed, law, options, level=level, noise_floor=noise_floor, min_resamples=min_resamples)
    if isinstance(ens, str):
        return fill(ens) if available.any() else Proposal([], None, None, None, f"no candidate left; {ens}")
    fit, interval, log_opt, log_pred, noise = ens.fit, ens.interval, ens.log_optima, ens.log_pred, ens.noise
    c, point = fit.coefficients, ens.optimum
    if not available.any():
        return Proposal([], interval, point, math.sqrt(noise), "no candidate left (trained, in flight, or over "
                        "the budget)", dict(c))
    picks = acquire(log_opt, log_pred, pool.flops, size_noise(pool, idx, pending, noise, fit), available,
                    [i for i in pending if i not in observed], k, interval.width, weights)
    note = f"fit on {len(idx)} runs, {ens.n_usable} usable resamples"
    if not picks and available.any():
        note += "; no remaining candidate narrows the optimum (the untrained ones are at sizes with no run)"
    return Proposal([{"index": p.index, "reason": "largest expected shrinkage of the optimum's interval per FLOP",
                      "variance_reduction": p.variance_reduction, "score_per_flop": p.score,
                      "expected_half_width_after": p.expected_width_after if math.isfinite(p.expected_width_after)
                      else None} for p in picks],
                    interval, point, math.sqrt(noise), note, dict(c))

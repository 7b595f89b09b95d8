"""Active proxy plan: which proxy run to train next so that the optimum's interval shrinks most
per training FLOP (issue 16). Pure math on arrays; the driver that trains is ``archsearch.trainers.active``.

What the study needs from the proxies is the loss-optimal shape ``(d/sqrt(N)*, r*)`` of the
conditional law (docs/method.md section 3). The law's bootstrap gives an ensemble: for every resample ``b``, the
optimum ``t_b = (log x1*, log r*)`` and the predicted log loss ``y_b(c)`` of every candidate run
``c``. Treating the ensemble as Gaussian (as an ensemble Kalman filter does), observing ``c``
with log-noise variance ``s2`` lowers the variance of ``t_i`` by
``Cov(t_i, y_c)^2 / (Var(y_c) + s2)``. The plan picks the candidate with the largest total
reduction (both coordinates in log units, i.e. relative) per FLOP (``6 N D``). For a batch, it
conditions the ensemble covariance on each pick before the next; the update needs no observed
value, so runs in flight (another worker's) are conditioned on the same way.

The interval of the optimum is the percentile interval of the bootstrap optima; its relative
half-width ``(hi - lo) / 2`` in log units is what the tolerance bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from archsearch.laws import forms


@dataclass(frozen=True)
class OptimumInterval:
    """Percentile interval of the bootstrap optima (d/sqrt(N)*, r*) and its relative half-widths."""

    hidden_over_sqrt_n: tuple[float, float]
    mlp_to_attn_ratio: tuple[float, float]
    level: float
    n: int                                # usable resamples (both factors U-shaped)
    pinned: tuple[bool, bool] = (False, False)   # a quarter or more of the resamples (3+) at one extreme value

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
                "pinned_at_bound": list(self.pinned)}


def bootstrap_optima(coefficients: Sequence[dict[str, float]]) -> tuple[np.ndarray, np.ndarray]:
    """(log optima as rows (log x1*, log r*), indices of the usable resamples): resamples whose
    factors are not both U-shaped have no optimum and are left out."""
    rows, keep = [], []
    for i, c in enumerate(coefficients):
        o1, o2 = forms.factor_optimum(c["a1"], c["a2"]), forms.factor_optimum(c["b1"], c["b2"])
        if o1 is not None and o2 is not None:
            rows.append((math.log(o1), math.log(o2)))
            keep.append(i)
    return np.array(rows, dtype=float).reshape(-1, 2), np.array(keep, dtype=int)


def optimum_interval(log_optima: np.ndarray, level: float = 0.9) -> OptimumInterval:
    """Percentile interval of the bootstrap optima (rows of log x1*, log r*)."""
    if log_optima.shape[0] < 2:
        raise ValueError("an interval needs at least 2 usable bootstrap resamples")
    a = (1.0 - level) / 2.0
    lo, hi = np.exp(np.quantile(log_optima, [a, 1.0 - a], axis=0))
    # continuous resampled optima do not tie; many equal to the extreme one sit on a bound
    ext = [max(np.sum(log_optima[:, j] == log_optima[:, j].max()), np.sum(log_optima[:, j] == log_optima[:, j].min()))
           for j in range(2)]
    n = log_optima.shape[0]
    return OptimumInterval((float(lo[0]), float(hi[0])), (float(lo[1]), float(hi[1])), level, int(n),
                           tuple(bool(e >= 3 and e >= 0.25 * n) for e in ext))


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
    import dataclasses

    from archsearch.laws.diagnostics import cluster
    from archsearch.laws.fit import fit_law, run_arrays

    if options.reference != "best-observed" or options.reference_law is not None or law not in forms.CONDITIONAL:
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
        from archsearch.arch import training_flops
        from archsearch.laws.fit import _spec_arrays

        return cls(tuple(specs), np.asarray(tokens, float), np.asarray(levels, int),
                   _spec_arrays(specs, tokens),
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
    from archsearch.errors import ArchsearchError
    from archsearch.rundata import RunRecord

    taken = set(observed) | set(pending) | set(exclude)
    r = pool.X["x2"]
    in_range = np.ones(len(pool), bool) if options.r_range is None else \
        (r >= options.r_range[0]) & (r <= options.r_range[1])   # the fit would drop the others
    available = np.array([i not in taken for i in range(len(pool))]) & in_range & (pool.flops <= max_cost)
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
    if not available.any():
        return Proposal([], None, None, None, "no candidate left (trained, in flight, or over the budget)")

    def fill(note):
        picks, avail, obs = [], available.copy(), np.zeros(len(pool), bool)
        obs[list(taken)] = True
        for _ in range(min(k, int(avail.sum()))):
            i = space_filling(pool.log_coords()[:, 1:], obs, pool.flops, avail)
            picks.append({"index": i, "reason": f"space-filling: {note}"})
            avail[i], obs[i] = False, True
        return Proposal(picks, None, None, None, note)

    idx = sorted(observed)
    runs = [RunRecord.from_arch(pool.specs[i], tokens=float(pool.tokens[i]), loss=float(observed[i]),
                                run_id=f"c{i}") for i in idx]
    try:
        fit = fit_profiled(runs, law, options)
    except ArchsearchError as e:
        return fill(f"no law can be fitted yet ({e})")
    coefs = [dict(zip(fit.bootstrap["names"], row)) for row in (fit.bootstrap or {}).get("coefficients", [])]
    log_opt, keep = bootstrap_optima(coefs)
    if keep.size < min_resamples:
        return fill(f"only {keep.size} of {len(coefs)} bootstrap fits have an interior optimum")
    interval = optimum_interval(log_opt, level)
    c = fit.coefficients
    point = (forms.factor_optimum(c["a1"], c["a2"]), forms.factor_optimum(c["b1"], c["b2"]))
    # L_opt is common to the resamples unless a Chinchilla reference is refitted per resample;
    # a common L_opt only shifts log predictions, so leaving it out keeps every covariance
    try:
        pred = fit.bootstrap_predictions(pool.X)
    except ArchsearchError:
        pred = fit.bootstrap_predictions({**pool.X, "Lref": np.ones(len(pool))})
    log_pred = np.log(np.maximum(pred[keep], 1e-12))
    X, L = {k2: v[idx] for k2, v in pool.X.items()}, np.array([observed[i] for i in idx])
    res = np.log(fit.predict_arrays(X)) - np.log(L)
    noise = noise_variance(res, 5, noise_floor)
    picks = acquire(log_opt, log_pred, pool.flops, size_noise(pool, idx, pending, noise, fit), available,
                    [i for i in pending if i not in observed], k, interval.width, weights)
    note = f"fit on {len(idx)} runs, {keep.size} usable resamples"
    if not picks and available.any():
        note += "; no remaining candidate narrows the optimum (the untrained ones are at sizes with no run)"
    return Proposal([{"index": p.index, "reason": "largest expected shrinkage of the optimum's interval per FLOP",
                      "variance_reduction": p.variance_reduction, "score_per_flop": p.score,
                      "expected_half_width_after": p.expected_width_after if math.isfinite(p.expected_width_after)
                      else None} for p in picks],
                    interval, point if None not in point else None, math.sqrt(noise), note, dict(c))

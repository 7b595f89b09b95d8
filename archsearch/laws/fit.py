"""Fitting the laws to proxy runs: robust multi-start fits, LM, bootstrap, validation splits.

:func:`fit_law` is the entry point; it returns a :class:`~archsearch.laws.lawfile.FitResult`,
plain data that saves to and loads from JSON (:mod:`archsearch.laws.lawfile`: the law file, its
reference ``L_opt`` and the feature arrays a law reads). See ``docs/laws.md``.

Fitting practice (docs/method.md section 3):

* ``huber-lbfgsb`` (default): minimise the mean Huber loss (small delta) of
  ``log L_pred - log L`` with L-BFGS-B within bounds, from ``n_starts`` seeded starts, on
  inputs normalised by their geometric means (see :mod:`archsearch.laws.forms`). Logs make
  every run count by its relative error; Huber keeps a few bad runs from steering the fit.
* ``lm``: Levenberg-Marquardt (``scipy.optimize.curve_fit``) on the loss itself, the
  paper-parity option: no bounds, no robust loss, conditional factors free to be non-U-shaped.

Conditional laws are fitted in two steps: first the reference ``L_opt(N, D)``, then the
architecture factors against it. ``reference="chinchilla"`` fits a Chinchilla law to the best
observed loss of every (N, D) group (or takes ``reference_law`` as given);
``reference="best-observed"`` uses those best losses as they are, and so can only predict at
an (N, D) that was observed: elsewhere it raises an error naming ``reference`` (give the law a
Chinchilla reference with :meth:`FitResult.with_reference`).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import warnings as _warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from archsearch.bounds import BOUNDS, check_count
from archsearch.errors import ArchsearchError
from archsearch.laws import forms
from archsearch.laws.metrics import cluster, metrics, residual_trends, size_groups
from archsearch.laws.registry import law_form
from archsearch.laws.lawfile import (FitResult, check_predicts, parse_reference, reference_coefficients,
                                     reference_loss, run_arrays)
from archsearch.provenance import provenance
from archsearch.rundata import check_one_loss_kind, check_run_table

if TYPE_CHECKING:
    from archsearch.rundata import RunRecord

METHODS = ("huber-lbfgsb", "lm")
REFERENCES = ("chinchilla", "best-observed")


# 200 runs x 1000 resamples fit in ~14 s here: beyond 1e5 a bootstrap is hours of work that
# moves an interval's end by less than its own Monte-Carlo error.
MAX_BOOTSTRAP = BOUNDS["bootstrap"].limit
# every start is a full L-BFGS-B run over the same data; past 1000 more starts find no other minimum
MAX_STARTS = 1000


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS says), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class FitOptions:
    """How a law is fitted. Every field is validated; errors name the field."""

    method: str = "huber-lbfgsb"
    huber_delta: float = 1e-3
    n_starts: int = 10
    seed: int = 0
    bootstrap: int = 0                    # resamples over runs; 0 = no intervals
    r_range: tuple[float, float] | None = (0.5, 5.0)   # keep runs with r in range; None = keep all
    reference: str = "chinchilla"         # conditional laws: "chinchilla" | "best-observed"
    reference_law: Any = None             # a Chinchilla FitResult / coefficient dict used as L_opt
    tie_exponents: bool = True            # aspect-ratio: alpha = beta = gamma
    holdout_size: float | None = None     # hold out the size nearest this N; metrics on it
    size_tolerance: float = 0.05          # runs within 5% of N (or D) are one size (one budget)
    max_iter: int = 2000
    n_jobs: int = 1                       # processes for the bootstrap (same numbers for any n_jobs)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ArchsearchError("method", f"unknown method {self.method!r}", f"use one of {list(METHODS)}")
        if not (self.huber_delta > 0 and math.isfinite(self.huber_delta)):
            raise ArchsearchError("huber_delta", f"must be positive, got {self.huber_delta}")
        for f in ("n_starts", "max_iter", "n_jobs"):
            if getattr(self, f) < 1:
                raise ArchsearchError(f, f"must be >= 1, got {getattr(self, f)}")
        check_count("max_iter", self.max_iter, "iterations")
        if self.bootstrap < 0:
            raise ArchsearchError("bootstrap", f"must be >= 0, got {self.bootstrap}", "0 means no intervals")
        if self.bootstrap > MAX_BOOTSTRAP:
            raise ArchsearchError("bootstrap", f"{self.bootstrap} resamples would take hours and narrow no "
                                  "interval further", f"give at most {MAX_BOOTSTRAP} (1000 is a good value)")
        if self.n_starts > MAX_STARTS:
            raise ArchsearchError("n_starts", f"{self.n_starts} starts repeat the same optimisation "
                                  "without finding another minimum", f"give at most {MAX_STARTS} (10 is the default)")
        if self.n_jobs > usable_cpus():
            raise ArchsearchError("n_jobs", f"{self.n_jobs} processes on {usable_cpus()} usable CPUs would only "
                                  "compete for them", f"give at most {usable_cpus()}")
        if self.r_range is not None:
            lo, hi = self.r_range
            if not (0 < lo < hi):
                raise ArchsearchError("r_range", f"needs 0 < low < high, got {self.r_range}",
                                      "e.g. (0.5, 5.0), or None to keep every run")
        if self.reference not in REFERENCES:
            raise ArchsearchError("reference", f"unknown reference {self.reference!r}",
                                  f"use one of {list(REFERENCES)}")
        if not 0 < self.size_tolerance < 1:
            raise ArchsearchError("size_tolerance", f"must be in (0, 1), got {self.size_tolerance}")
        if self.holdout_size is not None and not self.holdout_size > 0:
            raise ArchsearchError("holdout_size", f"must be positive, got {self.holdout_size}")
        parse_reference(self.reference_law, "reference_law")  # a malformed one fails here, not mid-fit

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["r_range"] = list(self.r_range) if self.r_range else None
        d["reference_law"] = reference_coefficients(self.reference_law)
        return d


def _group_best(X: forms.Data, L: np.ndarray, tol: float) -> list[dict[str, float]]:
    """Best loss per (N, D) group, at that best run's own N and D."""
    key = cluster(X["N"], tol) * (10 ** 6) + cluster(X["D"], tol)
    out = []
    for k in np.unique(key):
        idx = np.flatnonzero(key == k)
        j = idx[np.argmin(L[idx])]
        out.append({"params": float(X["N"][j]), "tokens": float(X["D"][j]), "loss": float(L[j])})
    return out


# -- core optimisation ------------------------------------------------------------------------

@dataclass
class _Core:
    vector: np.ndarray          # theta (robust) or the LM vector
    coefficients: dict[str, float]
    objective: float
    converged: bool
    warnings: list[str]


def _huber_objective(form, X, logL, nm, delta):
    n = logL.size

    def fun(th):
        y, J = form.logpred(th, X, nm)
        r = y - logL
        a = np.abs(r)
        quad = a <= delta
        # scaled by 1/delta so that values and gradients are O(residual), not O(delta * residual)
        val = np.where(quad, 0.5 * r * r / delta, a - 0.5 * delta)
        psi = np.where(quad, r / delta, np.sign(r))
        return float(val.sum() / n), J.T @ psi / n

    return fun


def _starts(form, X, L, n_starts, rng) -> list[np.ndarray]:
    box = np.array(form.start_box(X, L))
    lo, hi = np.array(form.bounds(X, L)).T
    mid = box.mean(axis=1)
    rand = rng.uniform(box[:, 0], box[:, 1], size=(n_starts - 1, box.shape[0]))
    return [np.clip(s, lo, hi) for s in (mid, *rand)]


def _fit_robust(form, X, L, opts: FitOptions, starts, check: bool) -> _Core:
    from scipy.optimize import minimize

    nm = forms.Norm.of(X)
    logL = np.log(L)
    bounds = form.bounds(X, L)
    fun = _huber_objective(form, X, logL, nm, opts.huber_delta)
    lo, hi = np.array(bounds).T
    results = []
    for s in starts:
        s = np.clip(s, lo, hi)  # a warm start from another data set may sit just outside
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            r = minimize(fun, s, jac=True, method="L-BFGS-B", bounds=bounds,
                         options={"maxiter": opts.max_iter, "ftol": 1e-13, "gtol": 1e-10})
        if np.isfinite(r.fun):
            results.append(r)
    if not results:
        raise ArchsearchError("data", f"the {form.law} fit failed from every start (non-finite loss)",
                              "check the runs for extreme values, or try method=lm")
    best = min(results, key=lambda r: r.fun)
    warns: list[str] = []
    if check:
        warns += _disagreement(form, X, nm, results, best)
        for name, v, (lo, hi) in zip(form.names, best.x, bounds):
            span = hi - lo
            if v - lo <= 1e-6 * span or hi - v <= 1e-6 * span:
                side = "lower" if v - lo <= 1e-6 * span else "upper"
                warns.append(f"parameter at a bound: {name} = {v:.4g} sits at its {side} bound"
                             + _bound_hint(form.law, name, side))
    # A stop on the iteration limit is a real failure; L-BFGS-B's "abnormal line search" at a
    # flat optimum is not (the gradient there is as small as the data allow).
    converged = bool(best.success) or best.nit < opts.max_iter
    return _Core(best.x, form.to_coefficients(best.x, nm), float(best.fun), converged, warns)


def _bound_hint(law: str, name: str, side: str) -> str:
    if name in ("a1", "b1", "b1 (min g = 1)") and side == "lower":
        var = "hidden/sqrt(N)" if name == "a1" else "r"
        return f" (no curvature in {var}: the data show no interior optimum there)"
    if name.startswith("log x1*") or name.startswith("log r*"):
        return " (the optimum lies outside the observed range)"
    if name == "log E" and side == "lower":
        return " (E -> 0: the irreducible loss is not determined by these runs)"
    return ""


def _disagreement(form, X, nm, results, best) -> list[str]:
    """Starts whose objective ties the best's but whose predictions differ (non-identifiable)."""
    near = [r for r in results if r.fun <= best.fun * 1.01 + 1e-12]
    if len(near) < 2:
        return []
    # probe at the data and beyond it (4x N and D), where non-identifiable fits part ways
    Xp = {k: np.concatenate([v, v * 4.0]) if k in ("N", "D") else np.concatenate([v, v])
          for k, v in X.items()}
    preds = np.array([np.exp(form.logpred(r.x, Xp, nm)[0]) for r in near])
    spread = float(np.max((preds.max(axis=0) - preds.min(axis=0)) / preds.min(axis=0)))
    if spread > 0.01:
        return [f"starts disagree: {len(near)} starts reach the same objective but their predictions "
                f"differ by up to {spread:.1%} (at the data or at 4x N and D); the law is not "
                "identified by these runs"]
    return []


def _fit_lm(law, form, X, L, opts: FitOptions, starts, check: bool) -> _Core:
    from scipy.optimize import OptimizeWarning, curve_fit

    nm = forms.Norm.of(X)
    idx = np.arange(L.size)
    lm = law_form(law).lm
    if lm is not None:
        def model(_, *p):
            return lm.model(np.array(p), X)[0]

        def jac(_, *p):
            return lm.model(np.array(p), X)[1]

        to_c = lm.to_coefficients
    else:
        def model(_, *p):
            return np.exp(form.logpred(np.array(p), X, nm)[0])

        def jac(_, *p):
            y, J = form.logpred(np.array(p), X, nm)
            return np.exp(y)[:, None] * J

        to_c = lambda p: form.to_coefficients(p, nm)  # noqa: E731
    results = []
    for s in starts:
        try:
            with _warnings.catch_warnings(), np.errstate(all="ignore"):
                _warnings.simplefilter("ignore", OptimizeWarning)
                p, _ = curve_fit(model, idx, L, p0=s, jac=jac, method="lm", maxfev=opts.max_iter * 10)
        except (RuntimeError, ValueError):
            continue
        sse = float(np.mean((model(idx, *p) - L) ** 2))
        if np.isfinite(sse):
            results.append((sse, p))
    if not results:
        raise ArchsearchError("method", f"Levenberg-Marquardt did not converge from any start for {law}",
                              "use method huber-lbfgsb (bounded, robust)")
    sse, p = min(results, key=lambda t: t[0])
    warns: list[str] = []
    if check and len(results) > 1:
        near = [q for s2, q in results if s2 <= sse * 1.01 + 1e-15]
        if len(near) > 1:
            preds = np.array([model(idx, *q) for q in near])
            spread = float(np.max((preds.max(axis=0) - preds.min(axis=0)) / np.abs(preds).min(axis=0)))
            if spread > 0.01:
                warns.append(f"starts disagree: {len(near)} starts reach the same error but predictions "
                             f"differ by up to {spread:.1%}")
    return _Core(np.asarray(p), to_c(np.asarray(p)), sse, True, warns)


def _lm_starts(law, form, X, L, theta_starts):
    lm = law_form(law).lm
    if lm is None:
        return theta_starts
    nm = forms.Norm.of(X)
    # the flat law (f = 1, g = 1: L = L_opt) first, then the robust parametrisation's starts
    out = [np.array(lm.flat, dtype=float)]
    for th in theta_starts:
        try:
            out.append(lm.from_coefficients(form.to_coefficients(th, nm)))
        except ValueError:
            continue
    return out


def _fit_core(law, form, X, L, opts, starts=None, rng=None, check=True) -> _Core:
    if opts.method == "lm":
        if starts is None:
            starts = _lm_starts(law, form, X, L, _starts(form, X, L, opts.n_starts, rng))
        return _fit_lm(law, form, X, L, opts, starts, check)
    if starts is None:
        starts = _starts(form, X, L, opts.n_starts, rng)
    return _fit_robust(form, X, L, opts, starts, check)


def _vector_from_coefficients(law, form, X, L, opts, coefs) -> np.ndarray:
    """A warm start (for the bootstrap) from fitted coefficients, in the method's parametrisation."""
    lm = law_form(law).lm
    if opts.method == "lm" and lm is not None:
        return lm.from_coefficients(coefs)
    return form.from_coefficients(coefs, forms.Norm.of(X))


# -- the two-step fit -------------------------------------------------------------------------

def _reference_for(law, X, L, opts: FitOptions, ref_fixed, extra_groups=(), warm=None, check=True):
    """(reference dict, Lref array, warnings) for a conditional fit on runs X, L."""
    if not law_form(law).conditional:
        return None, None, []
    if ref_fixed is not None:
        return ref_fixed, reference_loss(ref_fixed, X["N"], X["D"]), []
    groups = _group_best(X, L, opts.size_tolerance)
    if opts.reference == "best-observed":
        ref = {"law": "best-observed", "groups": groups + list(extra_groups), "tolerance": opts.size_tolerance}
        return ref, reference_loss(ref, X["N"], X["D"]), []
    if len(groups) < 5:
        raise ArchsearchError("reference", f"a Chinchilla L_opt needs at least 5 (N, D) groups, the data "
                              f"have {len(groups)}", "use reference=best-observed (--reference "
                              "best-observed) or give a fitted Chinchilla law (--reference-law)")
    gX = {"N": np.array([g["params"] for g in groups]), "D": np.array([g["tokens"] for g in groups])}
    gX["R"] = np.ones_like(gX["N"])
    gL = np.array([g["loss"] for g in groups])
    ropts = dataclasses.replace(opts, method="huber-lbfgsb")
    starts = None if warm is None else [forms.CHINCHILLA.from_coefficients(warm, forms.Norm.of(gX))]
    core = _fit_core("chinchilla", forms.CHINCHILLA, gX, gL, ropts, starts,
                     np.random.default_rng([opts.seed, 2]), check)
    ref = {"law": "chinchilla", "coefficients": core.coefficients}
    warns = [f"reference: {w}" for w in core.warnings]
    if check:
        warns += [f"reference: {w}" for w in _data_warnings("chinchilla", gX, 5, opts)]
    return ref, reference_loss(ref, X["N"], X["D"]), warns


def _data_warnings(law: str, X: forms.Data, n_params: int, opts: FitOptions) -> list[str]:
    n = X["N"].size
    out = []
    if n < 3 * n_params:
        out.append(f"too few points: {n} runs for {n_params} parameters (fewer than 3 per "
                   "parameter); expect wide intervals")

    def distinct(v):
        return int(cluster(v, 0.01).max() + 1)

    lf = law_form(law)
    if not lf.conditional:
        for var, name in (("N", "sizes (N)"), ("D", "token budgets (D)")):
            k = int(cluster(X[var], opts.size_tolerance).max() + 1)
            if k < 3:
                out.append(f"too few points per variable: {k} distinct {name}; its exponent is barely determined")
        ratio = np.log(X["D"] / X["N"])
        if n > 1 and np.ptp(ratio) < math.log1p(opts.size_tolerance) * 2:
            out.append("too few points per variable: tokens are a fixed multiple of params (D/N constant), so "
                       "the N and D terms cannot be told apart; predictions at another D/N are unreliable")
        if "R" in lf.reads and distinct(X["R"]) < 3:
            out.append(f"too few points per variable: {distinct(X['R'])} distinct aspect ratios R")
    else:
        for var, name in (("x1", "hidden/sqrt(N)"), ("x2", "r")):
            k = distinct(X[var])
            if k < 4:
                out.append(f"too few points per variable: {k} distinct {name} values for a 3-coefficient "
                           "U-shaped factor")
    return out


def _summary_ranges(X: forms.Data, runs: Sequence["RunRecord"] = ()) -> dict[str, list[float]]:
    """The ranges of the fitted variables, and of the runs' layer counts (no law reads depth
    beyond N and R: a fit over several depths assumes depth acts through them alone, and says
    so here)."""
    keys = {"N": "params", "D": "tokens", "x1": "hidden_over_sqrt_n", "x2": "mlp_to_attn_ratio",
            "R": "hidden_over_layers"}
    out = {keys[k]: [float(v.min()), float(v.max())] for k, v in X.items() if k in keys and v.size}
    layers = sorted({r.arch.n_layers for r in runs if r.arch is not None})
    return {**out, "n_layers": [float(layers[0]), float(layers[-1])]} if layers else out


def fit_law(runs: Sequence["RunRecord"], law: str, options: FitOptions | None = None) -> FitResult:
    """Fit ``law`` to proxy runs (see the module docstring). Errors name the field to fix."""
    opts = options or FitOptions()
    lf = law_form(law)  # an unknown name fails here, before any work
    ok = [r for r in runs if r.status == "ok"]
    if not ok:
        raise ArchsearchError("data", "no runs with status ok", "add finished runs to the data file")

    check_one_loss_kind(ok)
    check_run_table(ok)
    shapeless = [r for r in ok if not r.has_arch]
    if shapeless and lf.shaped:
        r = shapeless[0]
        raise ArchsearchError(f"run {r.run_id or ok.index(r) + 1}.params",
                              f"{len(shapeless)} run(s) give N only, and {law} needs the architecture",
                              "fit the chinchilla law on them, or give the columns n_layers, hidden_size, "
                              "n_heads, n_kv_heads, head_dim, ffn")
    fit_runs, test = split_holdout(ok, opts.holdout_size, opts.size_tolerance)
    fit = fit_split(fit_runs, test, law, opts, n_failed=len(runs) - len(ok))
    try:  # what a law file must hold to load (an unbounded method can leave it)
        check_predicts(law, fit.coefficients, "law")
    except ArchsearchError as e:
        raise ArchsearchError("law", f"the fitted coefficients cannot be a loss law: {e.problem}",
                              "fit with the default method (bounded), or add runs that span more sizes "
                              "and shapes") from None
    return fit


def split_holdout(runs: Sequence["RunRecord"], holdout_size: float | None,
                  tolerance: float = 0.05) -> tuple[list, list]:
    """(runs to fit, runs of the held-out size): the size whose N is nearest ``holdout_size``."""
    if holdout_size is None:
        return list(runs), []
    groups = size_groups(runs, tolerance)
    sizes = [float(np.exp(np.mean(np.log([runs[i].n_params for i in g])))) for g in groups]
    k = int(np.argmin([abs(math.log(s / holdout_size)) for s in sizes]))
    if abs(math.log(sizes[k] / holdout_size)) > math.log1p(0.25):
        raise ArchsearchError("holdout_size", f"no size within 25% of {holdout_size:.4g}",
                              "sizes in the data: " + ", ".join(f"{s:.4g}" for s in sizes))
    held = set(groups[k])
    fit_runs = [r for i, r in enumerate(runs) if i not in held]
    if not fit_runs:
        raise ArchsearchError("holdout_size", "holding out that size leaves no runs to fit",
                              "hold out a size only when the data have several")
    return fit_runs, [runs[i] for i in sorted(held)]


def _one_blas_thread():
    """L-BFGS-B calls BLAS on tiny matrices: threads only add overhead (10x on a loaded machine)."""
    import scipy.optimize  # noqa: F401  (load its BLAS first: limits apply to loaded libraries only)
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def _r_filter(runs, opts, role):
    if opts.r_range is None:
        return list(runs), []
    lo, hi = opts.r_range
    keep, dropped = [], []
    for i, r in enumerate(runs):
        if not r.has_arch:  # N only (Chinchilla rows): r is unknown, nothing to filter on
            keep.append(r)
            continue
        ratio = r.mlp_to_attn_ratio
        if lo <= ratio <= hi:
            keep.append(r)
        else:
            dropped.append({"run_id": r.run_id, "index": i, "set": role,
                            "mlp_to_attn_ratio": round(ratio, 4), "reason": f"r outside [{lo}, {hi}]"})
    return keep, dropped


def fit_split(fit_runs, test_runs, law: str, opts: FitOptions, n_failed: int = 0) -> FitResult:
    """Fit on ``fit_runs``; metrics on ``fit_runs`` and (if any) the held-out ``test_runs``."""
    with _one_blas_thread():
        return _fit_split_inner(fit_runs, test_runs, law, opts, n_failed)


def _fit_split_inner(fit_runs, test_runs, law, opts, n_failed):
    fit_runs, dropped = _r_filter(fit_runs, opts, "fit")
    test_runs, dropped_t = _r_filter(test_runs, opts, "holdout")
    dropped += dropped_t
    if not fit_runs:
        lo, hi = opts.r_range
        raise ArchsearchError("r_range", f"every run has r = mlp/attn outside [{lo}, {hi}]",
                              "widen --r-range, or pass --no-r-filter to keep all runs")
    form = forms.get_form(law, opts.tie_exponents)
    X, L = run_arrays(fit_runs)
    p = len(form.names)
    if L.size < p:
        raise ArchsearchError("data", f"{L.size} runs to fit but {law} has {p} parameters",
                              f"add runs (at least {p}, ideally {3 * p}+)" +
                              (f"; {len(dropped)} were dropped by the r filter" if dropped else ""))
    Xt, Lt = run_arrays(test_runs) if test_runs else (None, None)
    ref_fixed = parse_reference(opts.reference_law, "reference_law") if opts.reference_law is not None else None
    lf = law_form(law)
    extra = _group_best(Xt, Lt, opts.size_tolerance) if (Xt is not None and lf.conditional) else []
    ref, Lref, warns = _reference_for(law, X, L, opts, ref_fixed, extra)
    if Lref is not None:
        X["Lref"] = Lref
    rng = np.random.default_rng([opts.seed, 1])
    core = _fit_core(law, form, X, L, opts, rng=rng)
    warns += core.warnings + _data_warnings(law, X, p, opts)
    coefs = core.coefficients
    if lf.optimum is not None:
        for i, (o, var) in enumerate(zip(lf.optimum(coefs), ("hidden/sqrt(N)", "r"))):
            if o is None:
                names = lf.factor_coefficients[i] if i < len(lf.factor_coefficients) else ()
                detail = f" ({', '.join(f'{k}={coefs[k]:.3g}' for k in names)})" if names else ""
                warns.append(f"the {var} factor is not U-shaped{detail}: no interior optimum in " + var)
    result = FitResult(law=law, coefficients=coefs, reference=ref, options=opts.to_dict(),
                       dropped=dropped, n_runs=int(L.size), data_ranges=_summary_ranges(X, fit_runs))
    pred = result.predict_arrays(X)
    logres = np.log(pred) - np.log(L)
    trend_vars = {"log N": np.log(X["N"]), "log D": np.log(X["D"])}
    if "R" in lf.reads:
        trend_vars["log R"] = np.log(X["R"])
    if lf.conditional:
        trend_vars.update({"log hidden/sqrt(N)": np.log(X["x1"]), "log r": np.log(X["x2"])})
    warns += residual_trends(logres, trend_vars)
    m: dict[str, Any] = {"fit": metrics(L, pred)}
    if Xt is not None and Lt.size:
        m["holdout"] = metrics(Lt, result.predict_arrays(Xt))
        if lf.conditional:
            m["reference_at_test"] = "observed" if ref["law"] == "best-observed" else ref["law"]
    if n_failed:
        warns.append(f"{n_failed} runs with status failed were not fitted")
    boot = None
    if opts.bootstrap:
        boot, bwarn = _bootstrap(law, form, X, L, opts, core, ref_fixed, ref, extra)
        warns += bwarn
    status = "not_converged" if not core.converged else ("warnings" if warns else "ok")
    return dataclasses.replace(result, status=status, warnings=warns, metrics=m, bootstrap=boot,
                               provenance=provenance(device=False))


# -- bootstrap --------------------------------------------------------------------------------

def _bootstrap_chunk(args) -> list[tuple[list[float] | None, list[float] | None]]:
    law, X, L, opts, warm_coefs, warm_vector, warm_ref, ref_fixed, extra, index_sets = args
    with _one_blas_thread():
        return _bootstrap_fits(law, X, L, opts, warm_coefs, warm_vector, warm_ref, ref_fixed, extra,
                               index_sets)


def _bootstrap_fits(law, X, L, opts, warm_coefs, warm_vector, warm_ref, ref_fixed, extra, index_sets):
    form = forms.get_form(law, opts.tie_exponents)
    names = forms.coefficient_names(law)
    out = []
    for idx in index_sets:
        Xb = {k: v[idx] for k, v in X.items() if k != "Lref"}
        Lb = L[idx]
        try:
            if np.unique(idx).size < len(form.names):
                raise ArchsearchError("bootstrap", "too few distinct runs in the resample")
            ref, Lref, _ = _reference_for(law, Xb, Lb, opts, ref_fixed, extra, warm=warm_ref, check=False)
            if Lref is not None:
                Xb["Lref"] = Lref
            if opts.method != "lm" and law_form(law).conditional:
                start = warm_vector  # conditional theta does not depend on the normalisation
            else:
                start = _vector_from_coefficients(law, form, Xb, Lb, opts, warm_coefs)
            core = _fit_core(law, form, Xb, Lb, opts, starts=[start], check=False)
        except (ArchsearchError, ValueError, FloatingPointError):
            out.append((None, None))
            continue
        refc = None
        if ref is not None and ref["law"] == "chinchilla" and ref_fixed is None:
            refc = [ref["coefficients"][k] for k in forms.coefficient_names("chinchilla")]
        out.append(([core.coefficients[k] for k in names], refc))
    return out


def _bootstrap(law, form, X, L, opts: FitOptions, core: _Core, ref_fixed, ref, extra):
    """Refit on ``opts.bootstrap`` resamples of the runs (with replacement), each warm-started at
    the full fit; a fitted Chinchilla reference is refitted on every resample too."""
    rng = np.random.default_rng([opts.seed, 3])
    n = L.size
    index_sets = [rng.integers(0, n, n) for _ in range(opts.bootstrap)]
    warm_ref = ref["coefficients"] if (ref and ref["law"] == "chinchilla" and ref_fixed is None) else None
    Xc = {k: v for k, v in X.items() if k != "Lref"}
    chunks = [index_sets[i::opts.n_jobs] for i in range(opts.n_jobs)]
    args = [(law, Xc, L, opts, core.coefficients, core.vector, warm_ref, ref_fixed, extra, c)
            for c in chunks]
    if opts.n_jobs == 1:
        parts = [_bootstrap_chunk(args[0])]
    else:
        # spawned, not forked: a fork taken while another thread (torch's, a logger's) holds a lock
        # can deadlock the child
        with ProcessPoolExecutor(opts.n_jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
            parts = list(ex.map(_bootstrap_chunk, args))
    # undo the round-robin split so resample i is row i whatever n_jobs is
    results = [parts[i % opts.n_jobs][i // opts.n_jobs] for i in range(opts.bootstrap)]
    good = [r for r in results if r[0] is not None]
    failed = len(results) - len(good)
    warns = []
    if failed > 0.05 * len(results):
        warns.append(f"bootstrap: {failed} of {len(results)} resamples could not be fitted; intervals "
                     "rest on the others")
    boot = {"n": len(results), "n_failed": failed, "seed": opts.seed,
            "names": list(forms.coefficient_names(law)),
            "coefficients": [c for c, _ in good]}
    if warm_ref is not None:
        boot["reference_names"] = list(forms.coefficient_names("chinchilla"))
        boot["reference"] = [r for _, r in good]
    return boot, warns

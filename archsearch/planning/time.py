"""Training wall time: an analytic estimate and a law fitted to measured runs (docs/method.md section 8).

Analytic: ``T = C / (MFU * peak * devices)`` with ``C = 6 * N_c * D`` training FLOPs (Kaplan
et al. 2020), where ``N_c`` is the non-embedding parameters plus the output head, the matmul
that costs compute (the input lookup is free).

Fitted law, per data-parallel replica of ``TP*PP`` devices, on the device it was fit on::

    T(N, D, TP, PP) = [Nc * N^(aN/aD) + Dc * D]^aD * f(TP, PP)
    amdahl: f = (g/TP + 1 - g) * (h/PP + 1 - h)        g, h in [0, 1]
    power:  f = (TPc/TP)^aTP * (PPc/PP)^aPP            TPc = PPc = 1: a free TPc, PPc only
                                                       rescales Nc, Dc (degenerate), so fixed
    analytic: T = 6 * N * D / (F * TP * PP)            F = effective FLOP/s per device

with ``N`` = ``N_c`` above. Data parallelism is taken as ideal: a run on ``n_devices`` is
counted as ``dp = n_devices / (TP*PP)`` replicas and ``T_replica = wall_time * dp``.
Each form is fit in log space (least squares on log T, multi-start bounded trust-region
least squares, ``scipy.optimize.least_squares``),
optionally followed by a gradient-boosting regressor on the log residuals (features log N,
log D, log TP, log PP, log n_layers, log d_model). The form (with or without the residual
model) is chosen by cross-validated mean absolute error in seconds (leave-one-out up to 8
runs, 8 folds beyond); R^2 is reported beside it.
A parallelism parameter is only identified when the runs vary TP (PP); otherwise it is fixed at
ideal scaling (g = 1, aTP = 1) and the law says so. Where TP and PP only ever vary together, a weak
prior at ideal scaling picks one of the equally good fits (``PRIOR_WEIGHT``) and the law says which
parameters the runs could not tell apart.

The runs the law is fit to are collected as the source paper's *scaling-law smart tuning*:
short runs of small models on few tokens, timed, fitted, and the law extrapolated to the full
run (``archsearch estimate fit``; ``benchmarks/scripts/bench_planning.py`` does it here). Published
coefficients on their natural scale load with :meth:`TimeLaw.from_coefficients`; the log-scale
constants are unbounded (fitted at the runs' reference scale, see ``_PARAMS``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from archsearch.arch import ArchSpec, active_non_embedding_params, non_embedding_params, training_flops
from archsearch.bounds import check_count
from archsearch.configio import PlainData
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_text, write_json
from archsearch.hardware import Device, get_device
from archsearch.logs import get_logger
from archsearch.planning.cost import resolve_price, training_cost
from archsearch.planning.memory import check_parallelism, max_training_batch, predict_training_memory
from archsearch.rundata import MAX_TOKENS

FORMS = ("analytic", "amdahl", "power")
# Assumed MFU when neither the user nor a fitted law gives one. Dense decoder pretraining on
# A100/H100 reports 38-55% (PaLM 46.2%, Chowdhery et al. 2022 Table 3; Megatron-LM 3D
# parallelism 52% at 1T params on A100, Narayanan et al. 2021); 0.40 is the cautious end.
DEFAULT_MFU = 0.40
DEFAULT_MFU_SOURCE = ("assumed 0.40: dense-decoder pretraining reports 38-55% MFU (PaLM 46.2%, "
                      "Chowdhery et al. 2022; Megatron-LM, Narayanan et al. 2021); to use a measured one, "
                      "pass --mfu or --law to `archsearch estimate`, or pass --dry-run --mfu or --time-law "
                      "to `archsearch search`")


def compute_params(spec: ArchSpec) -> int:
    """N_c: non-embedding parameters (active ones for MoE) plus the output head (the matmuls
    of a training step)."""
    return active_non_embedding_params(spec) + spec.vocab_size * spec.hidden_size


def split_gpus(text: str) -> tuple[int, str]:
    """'8xH100' -> (8, 'H100'); 'H200' -> (1, 'H200'): the count and the device's name as written."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?(.+?)\s*", str(text))
    if not m:
        raise ArchsearchError("gpus", f"cannot read {text!r}", "write COUNTxNAME, e.g. 8xH100, or NAME, e.g. H200")
    count = int(m.group(1)) if m.group(1) else 1
    if count < 1:
        raise ArchsearchError("gpus", f"device count must be >= 1 in {text!r}")
    check_count("gpus", count, "devices")
    return count, m.group(2)


def parse_gpus(text: str) -> tuple[int, Device]:
    """'8xH100' -> (8, H100-SXM); 'H200' -> (1, H200); 'cpu' -> (1, this CPU, measured)."""
    count, name = split_gpus(text)
    try:
        device = get_device(name)
    except ArchsearchError as e:
        raise ArchsearchError("gpus", e.problem, e.fix) from None
    return count, device


# -- the law --------------------------------------------------------------------------------

# name: (lower, upper) bounds. The log-scale constants are stored as logs and have no bounds: they
# are fitted as the log of each term at the runs' geometric-mean N and D (``log_Nc + r log N_ref``,
# ``log_Dc + log D_ref``), which is of the order of log T / aD whatever the units, and converted
# back. A fixed box on log Nc itself cannot hold every law: with N ~ 1e9 and r ~ 3, Nc ~ e^-60 and
# below, and published coefficients lie outside the (-60, 60) box the fit used to have.
_INF = float("inf")
_PARAMS = {
    "analytic": {"log_F": (-30.0, 80.0)},
    "amdahl": {"log_Nc": (-_INF, _INF), "log_Dc": (-_INF, _INF), "r": (0.05, 5.0), "aD": (0.05, 5.0),
               "g": (0.0, 1.0), "h": (0.0, 1.0)},
    "power": {"log_Nc": (-_INF, _INF), "log_Dc": (-_INF, _INF), "r": (0.05, 5.0), "aD": (0.05, 5.0),
              "aTP": (0.0, 1.5), "aPP": (0.0, 1.5)},
}
_IDEAL = {"g": 1.0, "h": 1.0, "aTP": 1.0, "aPP": 1.0}
_PAR_VAR = {"g": 2, "h": 3, "aTP": 2, "aPP": 3}  # column of X whose variation identifies it
# The parallelism parameters' prior: one extra residual PRIOR_WEIGHT * (p - ideal) each, beside the runs'
# residuals in log T. Where the runs identify a parameter this moves it by ~PRIOR_WEIGHT^2 / (the runs'
# curvature): below 1e-4 on 24-48 runs (checked: g, h the same to 4 digits with and without). Where they do
# not (a flat valley of equally good fits), it alone decides, so every start and every machine ends at one
# point: without it the point a start stopped at in the valley moved with the CPU's floating-point rounding
# (seen: g, h = 0.67, 0.87 on one CPU, other values on another; a held-out R^2 of 0.88 on one, 0.9+ on the
# other).
PRIOR_WEIGHT = 1e-2
# tolerances that reach the prior's minimum along a flat valley (scipy's defaults, 1e-8, stop on the
# data's cost alone, wherever the valley was entered): the best of the starts is polished with them
_TIGHT = {"xtol": 1e-10, "ftol": 1e-10, "gtol": 1e-10}


def _unidentified(names: list[str], jac: np.ndarray) -> list[str]:
    """Notes for the parameters the runs cannot tell apart: those in a direction of the fit's
    Jacobian (of the runs' residuals alone) along which the runs' residuals do not move."""
    if not jac.size:
        return []
    _, s, vt = np.linalg.svd(jac, full_matrices=False)
    notes = []
    for sv, v in zip(s, vt):
        if sv > 1e-6 * s[0]:
            continue
        who = [n for n, c in zip(names, v) if abs(c) > 0.2]
        parallel = [n for n in who if n in _IDEAL]
        how = ("vary TP and PP apart (some runs with TP > 1 and PP = 1, others the other way round)"
               if parallel else "vary N and D over a wider range")
        taken = (f"; the fit takes {', '.join(parallel)} nearest ideal scaling (1) among "
                 "the equally good values" if parallel else "")
        notes.append(f"{' and '.join(who)} not separately identified by these runs{taken}: {how}")
    return notes


def _log_time(form: str, p: dict[str, float], X: np.ndarray) -> np.ndarray:
    """log T for rows X = [N, D, TP, PP] (replica time, seconds)."""
    N, D, TP, PP = (X[:, i] for i in range(4))
    if form == "analytic":
        return np.log(6.0 * N * D) - p["log_F"] - np.log(TP * PP)
    base = p["aD"] * np.logaddexp(p["log_Nc"] + p["r"] * np.log(N), p["log_Dc"] + np.log(D))
    if form == "amdahl":
        par = np.log(p["g"] / TP + 1 - p["g"]) + np.log(p["h"] / PP + 1 - p["h"])
    else:
        par = -p["aTP"] * np.log(TP) - p["aPP"] * np.log(PP)
    return base + par


def _features(X: np.ndarray, shape: np.ndarray) -> np.ndarray:
    return np.column_stack([np.log(X), np.log(shape)])


def _gbr():
    from sklearn.ensemble import GradientBoostingRegressor

    # few runs: shallow trees, few rounds, fixed seed (deterministic refit on load)
    return GradientBoostingRegressor(n_estimators=60, max_depth=2, learning_rate=0.1,
                                     min_samples_leaf=2, random_state=0)


def _fit_form(form: str, X: np.ndarray, logT: np.ndarray, starts: int = 8,
              seed: int = 0) -> tuple[dict[str, float], list[str]]:
    """Least squares on log T; returns params and notes (unidentified / at-bound parameters)."""
    from scipy.optimize import least_squares

    names = list(_PARAMS[form])
    notes: list[str] = []
    fixed: dict[str, float] = {}
    for n in names:
        if n in _PAR_VAR and np.ptp(X[:, _PAR_VAR[n]]) == 0:
            fixed[n] = _IDEAL[n]
            notes.append(f"{n} not identified (every run has {'TP' if _PAR_VAR[n] == 2 else 'PP'}="
                         f"{X[0, _PAR_VAR[n]]:g}); fixed at {_IDEAL[n]:g} (ideal scaling)")
    free = [n for n in names if n not in fixed]
    if form == "analytic":
        log_F = float(np.mean(np.log(6.0 * X[:, 0] * X[:, 1] / (X[:, 2] * X[:, 3])) - logT))
        return {"log_F": log_F}, notes
    bounds = [_PARAMS[form][n] for n in free]
    log_n_ref, log_d_ref = float(np.mean(np.log(X[:, 0]))), float(np.mean(np.log(X[:, 1])))

    def unpack(v) -> dict[str, float]:
        """Fitted vector (log constants at the reference scale) -> the law's parameters."""
        p = {**fixed, **dict(zip(free, map(float, v)))}
        p["log_Nc"] -= p["r"] * log_n_ref
        p["log_Dc"] -= log_d_ref
        return p

    # a weak prior at ideal scaling for the parallelism parameters (PRIOR_WEIGHT, module note): where the
    # runs cannot tell two of them apart (TP and PP always moved together), the fit takes the values
    # nearest ideal scaling among those that fit as well, instead of wherever a start stopped
    ideal = np.array([_IDEAL.get(n, np.nan) for n in free])
    pulled = ~np.isnan(ideal)

    def resid(v: np.ndarray) -> np.ndarray:
        prior = PRIOR_WEIGHT * (v[pulled] - ideal[pulled])
        return np.concatenate([_log_time(form, unpack(v), X) - logT, prior])

    rng = np.random.default_rng(seed)
    lo, hi = np.array(bounds).T
    # the log terms at the reference scale start around log T; exponents and fractions inside their bounds
    wide = np.array([n in ("log_Nc", "log_Dc") for n in free])
    centre = float(np.mean(logT))
    best = None
    for _ in range(starts):
        inner = rng.uniform(np.where(wide, 0, lo) + 0.1 * np.where(wide, 0, hi - lo),
                            np.where(wide, 1, hi) - 0.1 * np.where(wide, 0, hi - lo))
        v0 = np.where(wide, centre + rng.uniform(-10, 10, len(free)), inner)
        r = least_squares(resid, v0, bounds=(lo, hi), method="trf", x_scale="jac")
        if best is None or r.cost < best.cost:
            best = r
    # the best start polished to the prior's minimum (_TIGHT)
    best = least_squares(resid, best.x, bounds=(lo, hi), method="trf", x_scale="jac", **_TIGHT)
    notes.extend(_unidentified(free, best.jac[:len(logT)]))
    p = unpack(best.x)
    for n, (lo, hi) in zip(free, bounds):
        if n not in ("log_Nc", "log_Dc") and min(abs(p[n] - lo), abs(p[n] - hi)) < 1e-6 * (hi - lo):
            notes.append(f"{n}={p[n]:g} at its bound [{lo:g}, {hi:g}]")
    return p, notes


# below this elasticity (d log T / d log D, or / d log N) a law's time barely moves with its input:
# a degenerate law (published coefficients read in the wrong units, log base or form give one),
# flagged by estimate_training
FLAT_ELASTICITY = 0.1


@dataclass
class TimeLaw(PlainData):
    """A fitted training-time law. ``predict`` gives wall seconds per data-parallel replica."""

    form: str
    params: dict[str, float]
    residual_model: bool = False
    device: str | None = None
    mfu: float | None = None  # measured: effective FLOP/s per device / device peak
    mfu_source: str | None = None
    notes: list[str] = field(default_factory=list)
    n_runs: int = 0
    # what the residual booster is refit on when the law is loaded (deterministic, seed 0)
    train_features: list[list[float]] = field(default_factory=list)
    train_residuals: list[float] = field(default_factory=list)
    selection: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ArchsearchError("time_law.form", f"unknown form {self.form!r}", f"use one of {list(FORMS)}")
        missing = [n for n in _PARAMS[self.form] if n not in self.params]
        if missing:
            raise ArchsearchError(f"time_law.params.{missing[0]}", "missing")
        bad = [n for n, v in self.params.items() if not (isinstance(v, (int, float)) and math.isfinite(v))]
        if bad:
            raise ArchsearchError(f"time_law.params.{bad[0]}", f"must be a finite number, got {self.params[bad[0]]!r}")
        self._booster = None
        self._warned = False  # a degenerate law is logged once, not once per estimate
        if self.residual_model:
            if len(self.train_features) < 3:
                raise ArchsearchError("time_law.train_features", "a residual model needs its training points")
            self._booster = _gbr().fit(np.array(self.train_features), np.array(self.train_residuals))

    @classmethod
    def from_coefficients(cls, form: str = "amdahl", *, Nc: float, Dc: float, aN: float, aD: float,
                          g: float = 1.0, h: float = 1.0, aTP: float = 1.0, aPP: float = 1.0,
                          device: str | None = None, source: str = "") -> "TimeLaw":
        """A law from published coefficients on their natural scale, ``T = [Nc N^(aN/aD) + Dc
        D]^aD * f(TP, PP)`` (seconds, N the compute parameters, D tokens): the constants may be
        as small or large as float64 holds (their logs are stored, unbounded)."""
        if form not in ("amdahl", "power"):
            raise ArchsearchError("time_law.form", f"{form!r} has no such coefficients", "use amdahl or power")
        for name, v in (("Nc", Nc), ("Dc", Dc), ("aD", aD), ("aN", aN)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ArchsearchError(f"time_law.{name}", f"must be a positive finite number, got {v!r}")
        par = {"g": g, "h": h} if form == "amdahl" else {"aTP": aTP, "aPP": aPP}
        return cls(form=form, params={"log_Nc": math.log(Nc), "log_Dc": math.log(Dc), "r": aN / aD, "aD": aD, **par},
                   device=device, notes=[f"from published coefficients{': ' + source if source else ''}"])

    def elasticities(self, spec: ArchSpec, tokens: float, tp: int = 1, pp: int = 1) -> dict[str, float]:
        """``d log T / d log D`` (``tokens``) and ``d log T / d log N`` (``params``) around
        ``spec`` and ``tokens``, each over a 10x span: near 1 where time grows with the tokens and
        the model as it must; near 0 for a degenerate law, one of whose terms is lost beside the
        other, as published coefficients read in the wrong units, log base or form give
        (docs/planning.md)."""
        base = np.array([compute_params(spec), float(tokens), tp, pp], dtype=float)
        shape = np.array([[spec.n_layers, spec.hidden_size]] * 2, dtype=float)
        out = {}
        for name, col in (("params", 0), ("tokens", 1)):
            X = np.array([base, base])
            X[0, col] /= 10 ** 0.5
            X[1, col] *= 10 ** 0.5
            lo, hi = self.predict_array(X, shape)
            out[name] = float(math.log10(hi / lo))
        return out

    def degeneracy(self, spec: ArchSpec, tokens: float, tp: int = 1, pp: int = 1) -> str | None:
        """Why this law is degenerate around ``spec`` and ``tokens`` (an input it barely depends
        on, :data:`FLAT_ELASTICITY`), or None."""
        e = self.elasticities(spec, tokens, tp, pp)
        flat = [k for k in ("tokens", "params") if e[k] < FLAT_ELASTICITY]
        if not flat:
            return None
        return (f"the time law is flat in {' and '.join(flat)} here (d log T / d log D = {e['tokens']:.3g}, "
                f"d log T / d log N = {e['params']:.3g}; below {FLAT_ELASTICITY}): one of its terms is lost beside "
                "the other, so it predicts about the same time for any "
                f"{'token count' if flat == ['tokens'] else 'model size' if flat == ['params'] else 'run'}; "
                "check the coefficients' units (N and D in raw counts?), log base and form (docs/planning.md)")

    def predict_array(self, X: np.ndarray, shape: np.ndarray) -> np.ndarray:
        logT = _log_time(self.form, self.params, X)
        if self._booster is not None:
            logT = logT + self._booster.predict(_features(X, shape))
        return np.exp(logT)

    def predict(self, spec: ArchSpec, tokens: float, tp: int = 1, pp: int = 1) -> float:
        """Wall seconds for one replica of TP*PP devices to train ``spec`` on ``tokens``."""
        X = np.array([[compute_params(spec), float(tokens), tp, pp]], dtype=float)
        shape = np.array([[spec.n_layers, spec.hidden_size]], dtype=float)
        return float(self.predict_array(X, shape)[0])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["formula"] = _FORMULAS[self.form]
        return d

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path, field: str = "--law") -> "TimeLaw":
        """A time law's JSON; ``field`` (the flag that named it) is what an error names."""
        p = Path(path)
        if not p.is_file():
            raise ArchsearchError(field, f"no such file {str(p)!r}", "fit one with archsearch estimate fit")
        try:
            d = json.loads(read_text(p, field))
            if not isinstance(d, dict):
                raise TypeError(f"holds a {type(d).__name__}, not an object")
            return cls.from_dict(d)
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
            raise ArchsearchError(field, f"{p} is not a time-law JSON: {e}",
                                  "give the file archsearch estimate fit --out wrote") from None


_FORMULAS = {
    "analytic": "T = 6*N*D / (F*TP*PP)",
    "amdahl": "T = [Nc*N^r + Dc*D]^aD * (g/TP + 1 - g) * (h/PP + 1 - h), r = aN/aD",
    "power": "T = [Nc*N^r + Dc*D]^aD * TP^-aTP * PP^-aPP, r = aN/aD",
}


def _runs_to_arrays(runs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, str | None]:
    """X = [N_c, D, TP, PP], replica seconds, shape = [L, d], the single device name."""
    rows, T, shape, devices = [], [], [], set()
    for r in runs:
        if getattr(r, "status", "ok") != "ok" or r.wall_time_s is None:
            continue
        where = f"run {r.run_id or '?'}"
        if not (r.wall_time_s > 0 and math.isfinite(r.wall_time_s)):
            raise ArchsearchError(f"{where}.wall_time_s", f"must be positive, got {r.wall_time_s}")
        tp, pp = r.tp or 1, r.pp or 1
        n_dev = r.n_devices or tp * pp
        if n_dev % (tp * pp):
            raise ArchsearchError(f"{where}.n_devices", f"{n_dev} is not a multiple of tp*pp={tp * pp}")
        spec = r.spec
        rows.append([compute_params(spec), r.tokens, tp, pp])
        T.append(r.wall_time_s * (n_dev / (tp * pp)))
        shape.append([spec.n_layers, spec.hidden_size])
        devices.add(r.device)
    if len(devices) > 1:
        raise ArchsearchError("device", f"runs come from several devices {sorted(map(str, devices))}",
                              "fit one law per device (filter the run file)")
    return (np.array(rows, dtype=float), np.array(T, dtype=float), np.array(shape, dtype=float),
            next(iter(devices)) if devices else None)


def _metrics(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    err = pred - y
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return {"mae_s": float(np.mean(np.abs(err))),
            "r2": float(1 - np.sum(err**2) / ss_tot) if ss_tot > 0 else float("nan"),
            "mean_abs_rel_err": float(np.mean(np.abs(err) / y)),
            "r2_log": float(1 - np.sum((np.log(pred) - np.log(y)) ** 2)
                            / max(np.sum((np.log(y) - np.log(y).mean()) ** 2), 1e-300))}


def _fit_one(form: str, gbr: bool, X, logT, shape, device, starts: int = 8) -> TimeLaw:
    params, notes = _fit_form(form, X, logT, starts=starts)
    feats, resid = [], []
    if gbr:
        feats = _features(X, shape).tolist()
        resid = (logT - _log_time(form, params, X)).tolist()
    return TimeLaw(form=form, params=params, residual_model=gbr, device=device, notes=notes,
                   n_runs=len(logT), train_features=feats, train_residuals=resid)


@dataclass
class TimeLawFit:
    """The chosen law (refit on every run), the cross-validation table it was chosen from, and
    the held-out metrics when held-out runs were given."""

    law: TimeLaw
    selection: list[dict[str, Any]]
    holdout: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"law": self.law.to_dict(), "selection": self.selection, "holdout": self.holdout}


def fit_time_law(runs: Sequence[Any], holdout: Sequence[Any] = (), forms: Sequence[str] = FORMS,
                 residual_options: Sequence[bool] = (False, True), max_folds: int = 8) -> TimeLawFit:
    """Fit every form (with / without the boosted residual) to runs with ``wall_time_s``,
    choose by cross-validated MAE (seconds), refit the winner on all runs.

    Cross-validation: ``min(runs, max_folds)`` folds, run i in fold ``i % folds`` (leave-one-out
    up to ``max_folds`` runs).

    ``runs`` are :class:`archsearch.rundata.RunRecord` (rows without ``wall_time_s`` or with
    status ``failed`` are skipped). ``holdout`` runs, when given, are predicted by every
    candidate fit on all of ``runs`` and reported; they never influence the choice.
    """
    for f in forms:
        if f not in FORMS:
            raise ArchsearchError("forms", f"unknown form {f!r}", f"use of {list(FORMS)}")
    X, T, shape, device = _runs_to_arrays(runs)
    if len(T) < 6:
        raise ArchsearchError("wall_time_s", f"{len(T)} usable runs with a wall time; the law needs >= 6",
                              "measure more runs (vary N and D)")
    logT = np.log(T)
    folds = min(len(T), max_folds)
    peak, peak_source = _device_peak(device)
    if holdout:
        Xh, Th, shape_h, dev_h = _runs_to_arrays(holdout)
        if dev_h != device:
            raise ArchsearchError("holdout.device", f"held-out runs are on {dev_h}, the fit on {device}")
    selection = []
    for form in forms:
        for gbr in residual_options:
            cv = np.empty_like(T)
            for k in range(folds):
                test = np.arange(len(T)) % folds == k
                law = _fit_one(form, gbr, X[~test], logT[~test], shape[~test], device, starts=4)
                cv[test] = law.predict_array(X[test], shape[test])
            row: dict[str, Any] = {"form": form, "residual_model": gbr, "cv": _metrics(T, cv)}
            if holdout:
                full = _fit_one(form, gbr, X, logT, shape, device)
                row["holdout"] = _metrics(Th, full.predict_array(Xh, shape_h))
            selection.append(row)
    best = min(selection, key=lambda r: (r["cv"]["mae_s"], -r["cv"]["r2"]))
    law = _fit_one(best["form"], best["residual_model"], X, logT, shape, device)
    # measured MFU: the analytic form's effective FLOP/s per device over the device's peak
    aparams, _ = _fit_form("analytic", X, logT)
    if peak:
        law.mfu = float(math.exp(aparams["log_F"]) / peak)
        law.mfu_source = (f"measured: geometric-mean MFU of {len(T)} runs on {device} "
                          f"(6*N_c*D FLOPs over wall time; peak {peak:.4g} FLOP/s from {peak_source})")
    else:
        law.notes.append(f"no measured MFU: {peak_source}")
    law.selection = selection
    law.notes.append(f"chosen by {folds}-fold cross-validated MAE over {len(T)} runs "
                     f"from {len(selection)} candidates")
    return TimeLawFit(law=law, selection=selection,
                      holdout=next((r["holdout"] for r in selection if r is best), None) if holdout else None)


def _device_peak(device: str | None) -> tuple[float | None, str | None]:
    """(peak FLOP/s, its source), or (None, why not) when the device is not in the table."""
    if device is None:
        return None, "the runs name no device"
    try:
        d = get_device(device)
    except ArchsearchError as e:
        return None, f"device {device!r} has no peak in archsearch.hardware ({e.problem})"
    return d.peak_flops("bfloat16" if not d.measured else "float32"), d.source


# -- the estimate ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainingEstimate:
    """Wall time, device-hours and cost of training one architecture on ``tokens``."""

    hours: float
    gpu_hours: float
    cost_usd: float | None
    method: str
    analytic_hours: float
    law_hours: float | None
    assumptions: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_training(spec: ArchSpec, tokens: float, gpus: str = "8xH100", *, tp: int = 1, pp: int = 1,
                      mfu: float | None = None, price_per_hour: float | None = None,
                      time_law: TimeLaw | str | Path | None = None, dtype: str = "bfloat16",
                      seq_len: int = 2048, parallelism: str = "ddp") -> TrainingEstimate:
    """Time and cost to train ``spec`` on ``tokens`` tokens on ``gpus`` ('8xH100', 'H200', 'cpu').

    The analytic estimate is always computed; with ``time_law`` (a :class:`TimeLaw` or its
    JSON path, fit on the same device) the law's prediction is the answer and the analytic
    one is kept beside it. ``assumptions`` holds every number used and its source, and the
    largest micro-batch of ``seq_len`` tokens that fits per device under ``parallelism``.
    """
    if not (isinstance(tokens, (int, float)) and math.isfinite(tokens) and tokens > 0):
        raise ArchsearchError("tokens", f"must be a positive number, got {tokens!r}")

    if tokens > MAX_TOKENS:
        raise ArchsearchError("tokens", f"{tokens:.3g} tokens is beyond any training run (at most {MAX_TOKENS:.0e}; "
                              "the largest models saw a few 1e13)", "give a budget such as 20B or 2e12")
    n, device = parse_gpus(gpus)
    dp = check_parallelism(spec, tp, pp, n)
    if isinstance(time_law, (str, Path)):
        time_law = TimeLaw.load(time_law)
    if time_law is not None and time_law.device is not None and time_law.device != device.name:
        raise ArchsearchError("gpus", f"the time law was fit on {time_law.device!r}, not {device.name!r}",
                              "fit a law on runs from this device, or leave out the law for the analytic estimate")
    if mfu is not None:
        if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
            raise ArchsearchError("mfu", f"must be in (0, 1], got {mfu!r}")
        mfu_source = "given by the user"
    elif time_law is not None and time_law.mfu is not None:
        mfu, mfu_source = time_law.mfu, time_law.mfu_source
    else:
        mfu, mfu_source = DEFAULT_MFU, DEFAULT_MFU_SOURCE
    peak = device.peak_flops(dtype)
    flops = training_flops(spec, tokens, include_embedding=True)
    analytic_s = flops / (mfu * peak * n)
    law_s = None
    if time_law is not None:
        law_s = time_law.predict(spec, tokens, tp, pp) / dp
    seconds = law_s if law_s is not None else analytic_s
    hours = seconds / 3600
    price = resolve_price(device, price_per_hour)
    mem = predict_training_memory(spec, 1, seq_len, dtype, parallelism=parallelism, n_devices=n, tp=tp, pp=pp)
    max_mb = max_training_batch(spec, device.memory_bytes, seq_len, dtype, parallelism=parallelism,
                                n_devices=n, tp=tp, pp=pp) if device.memory_gib > 0 else None
    assumptions: dict[str, Any] = {
        "device": device.name, "n_devices": n, "tp": tp, "pp": pp, "dp": dp, "dtype": dtype,
        "peak_flops_per_device": peak, "peak_source": device.source,
        "mfu": mfu, "mfu_source": mfu_source,
        "training_flops": flops,
        "flops_formula": "6 * N_c * D, N_c = non-embedding params + output head (Kaplan et al. 2020)",
        "n_compute_params": compute_params(spec), "n_params_non_embedding": non_embedding_params(spec),
        "tokens": float(tokens),
        "price_per_device_hour": price.usd_per_hour, "price_source": price.source,
        "data_parallel": "ideal scaling over dp replicas (law); MFU covers all overheads (analytic)",
        "memory_per_device_gib_at_micro_batch_1": mem["total_gib"],
        "max_micro_batch_per_device": max_mb, "memory_seq_len": seq_len, "memory_parallelism": parallelism,
        "memory_bytes_per_param": mem["assumptions"]["bytes_per_param"],
        "device_memory_gib": device.memory_gib,
    }
    if time_law is not None:
        assumptions.update({"time_law_form": time_law.form, "time_law_formula": _FORMULAS[time_law.form],
                            "time_law_residual_model": time_law.residual_model,
                            "time_law_params": time_law.params, "time_law_runs": time_law.n_runs,
                            "time_law_device": time_law.device, "time_law_notes": time_law.notes})
        assumptions["time_law_elasticities"] = time_law.elasticities(spec, tokens, tp, pp)
        warning = time_law.degeneracy(spec, tokens, tp, pp)
        if warning:
            assumptions["time_law_warning"] = warning
            if not time_law._warned:
                get_logger("estimate").warning(warning)
                time_law._warned = True
    method = (f"fitted law ({time_law.form}{' + boosted residual' if time_law.residual_model else ''})"
              if time_law is not None else "analytic: training FLOPs / (MFU x peak x devices)")
    return TrainingEstimate(hours=hours, gpu_hours=hours * n, cost_usd=training_cost(hours, n, price),
                            method=method, analytic_hours=analytic_s / 3600,
                            law_hours=None if law_s is None else law_s / 3600, assumptions=assumptions)

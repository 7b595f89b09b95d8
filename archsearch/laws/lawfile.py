"""A law file: the fitted (or hand-written) law as plain data, and what reading it needs.

:class:`FitResult` saves to and loads from JSON (:func:`load_law` also reads a law written by
hand, see ``docs/laws.md``); :func:`reference_loss` evaluates its ``L_opt(N, D)`` reference;
:func:`spec_arrays` and :func:`run_arrays` build the feature arrays every law reads. Fitting is
in :mod:`archsearch.laws.fit`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio, non_embedding_params
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_text, write_json
from archsearch.laws import forms
from archsearch.laws.registry import law_form

if TYPE_CHECKING:
    from archsearch.arch import ArchSpec
    from archsearch.rundata import RunRecord

FORMAT = "archsearch-law/1"


# -- the fit result ---------------------------------------------------------------------------

@dataclass(frozen=True)
class FitResult:
    """A fitted (or hand-written) law: plain data, JSON round-trip with :meth:`save` / :func:`load_law`.

    ``reference`` (conditional laws) is ``{"law": "chinchilla", "coefficients": {...}}``,
    ``{"law": "best-observed", "groups": [{"params", "tokens", "loss"}...], "tolerance": t}``,
    ``{"law": "constant", "loss": x}`` or None (the optimum is defined, losses are not).
    ``status`` is ``ok``, ``warnings`` (converged, but read the warnings) or ``not_converged``.

    What the law can be trusted with (docs/laws.md, "Error and range"): ``prediction_error``
    ``{"relative_sd": s, "source": ...}`` is its error against trained models (a held-out size's
    root-mean-square relative error for a fit, a published law's stated error), and
    ``fitted_range`` ``{"hidden_over_sqrt_n": [lo, hi], "mlp_to_attn": [lo, hi], "source": ...}``
    the shapes it was fitted on (a fit's own runs give it as ``data_ranges``).
    """

    law: str
    coefficients: dict[str, float]
    reference: dict[str, Any] | None = None
    status: str = "ok"
    warnings: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    n_runs: int = 0
    data_ranges: dict[str, list[float]] = field(default_factory=dict)
    bootstrap: dict[str, Any] | None = None
    provenance: dict[str, Any] | None = None
    prediction_error: dict[str, Any] | None = None
    fitted_range: dict[str, Any] | None = None

    # -- prediction --
    def predict(self, spec: "ArchSpec", tokens: float, params: float | None = None) -> float:
        """Predicted loss of ``spec`` trained on ``tokens`` tokens. With ``params``, the shape's
        ratios (d/sqrt(N), r, R) at that N instead of its own: two shapes compared at one budget."""
        return float(self.predict_arrays(spec_arrays([spec], [tokens], params))[0])

    def predict_arrays(self, X: forms.Data, coefficients: dict[str, float] | None = None,
                       reference: dict[str, Any] | None = None) -> np.ndarray:
        """Vectorised prediction on arrays N, D, x1, x2, R (see :mod:`archsearch.laws.forms`)."""
        X = dict(X)
        if law_form(self.law).conditional and "Lref" not in X:
            X["Lref"] = reference_loss(reference or self.reference, X["N"], X["D"])
        return forms.predict(self.law, coefficients or self.coefficients, X)

    def reference_loss(self, params: float, tokens: float) -> float:
        """L_opt(N, D) of a conditional law (raises ArchsearchError when it has none there)."""
        return float(reference_loss(self.reference, np.array([float(params)]), np.array([float(tokens)]))[0])

    def predict_interval(self, spec: "ArchSpec", tokens: float, level: float = 0.9,
                         params: float | None = None) -> tuple[float, float] | None:
        """Bootstrap interval of the predicted (mean) loss; None when fitted without bootstrap."""
        samples = self.bootstrap_predictions(spec_arrays([spec], [tokens], params))
        if samples is None:
            return None
        lo, hi = quantiles(samples[:, 0], level)
        return float(lo), float(hi)

    def bootstrap_predictions(self, X: forms.Data) -> np.ndarray | None:
        """Predictions of every bootstrap resample (resamples x points), or None."""
        bs = self.bootstrap
        if not bs or not bs.get("coefficients"):
            return None
        names = bs["names"]
        refs = bs.get("reference")
        if not refs and law_form(self.law).conditional and "Lref" not in X:  # one L_opt for every resample
            X = {**X, "Lref": reference_loss(self.reference, X["N"], X["D"])}
        out = []
        for i, row in enumerate(bs["coefficients"]):
            ref = self.reference
            if refs:
                ref = {"law": "chinchilla", "coefficients": dict(zip(bs["reference_names"], refs[i]))}
            out.append(self.predict_arrays(X, dict(zip(names, row)), ref))
        return np.asarray(out)

    def shape_range(self) -> dict[str, Any] | None:
        """The (hidden/sqrt(N), r) box the law was fitted on, with where that is known from:
        ``fitted_range`` as stated, else the fitted runs' ``data_ranges`` (after the r filter),
        else None (a hand-written law that states none). A coordinate may be None: not stated."""
        if self.fitted_range is not None:
            return dict(self.fitted_range)
        x1, r = self.data_ranges.get("hidden_over_sqrt_n"), self.data_ranges.get("mlp_to_attn_ratio")
        if x1 is None and r is None:
            return None
        return {"hidden_over_sqrt_n": list(x1) if x1 else None, "mlp_to_attn": list(r) if r else None,
                "source": f"the {self.n_runs} fitted runs (after the r filter)"}

    def with_reference(self, reference: Any) -> "FitResult":
        """The same law on another L_opt: a Chinchilla FitResult, its coefficient dict, or a
        reference dict as in the law file. The bootstrap keeps its calibration samples; its
        per-resample references belonged to the old L_opt and are dropped."""
        ref = parse_reference(reference, "reference")
        return dataclasses.replace(self, reference=ref, bootstrap=_drop_reference_samples(self.bootstrap))

    # -- serialisation --
    def to_dict(self) -> dict[str, Any]:
        d = {"format": FORMAT}
        d.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return _jsonable(d)

    def save(self, path: str | Path) -> Path:
        """Write the law as JSON (atomically)."""
        return write_json(path, self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "law file") -> "FitResult":
        """Validate and load a law dict: a saved fit, or hand-written ``{"law", "coefficients"}``."""
        return _from_dict(data, where)


def load_law(path: str | Path) -> FitResult:
    """Load a law file (saved by :meth:`FitResult.save`, or written by hand; see docs/laws.md)."""
    p = Path(path)
    if not p.is_file():
        raise ArchsearchError("--law", f"no such file {str(p)!r}", "fit one with `archsearch fit` or write one by hand")
    try:
        data = json.loads(read_text(p))
    except json.JSONDecodeError as e:
        raise ArchsearchError(str(p), f"invalid JSON: {e}") from None
    return _from_dict(data, str(p))


_KNOWN_KEYS = {f.name for f in dataclasses.fields(FitResult)} | {"format", "L_opt", "comment"}


# Where a law is used: sizes and budgets from a proxy to beyond any trained model, and shape
# ratios across every search box (x1 = d/sqrt(N), x2 = r); the centre is a typical study's point.
_USE_GRID = {"N": (1e5, 1e13), "D": (1e6, 1e15), "R": (0.1, 10.0), "x1": (0.01, 1.0), "x2": (0.1, 20.0)}
_USE_CENTRE = {"N": 1e8, "D": 2e9, "R": 1.0, "x1": 0.1, "x2": 1.0}


def check_predicts(law: str, c: dict[str, float], where: str) -> None:
    """Coefficients that predict a loss: a Chinchilla-type law's exponents are positive (loss
    falls with N and D), predictions are finite wherever a law is used (no overflow from a huge
    coefficient) and positive at a typical point (a negative factor would be printed as a loss,
    with an interval that cannot contain it)."""
    import numpy as np

    for k in law_form(law).falling:
        if not c[k] > 0:
            raise ArchsearchError(f"{where}: coefficients.{k}", f"must be positive (loss falls with size), "
                                  f"got {c[k]}", "refit the law (archsearch fit)")
    axes = np.meshgrid(*(np.geomspace(lo, hi, 7) for lo, hi in _USE_GRID.values()), indexing="ij")
    X = {k: a.ravel() for k, a in zip(_USE_GRID, axes)}
    centre = {k: np.array([v]) for k, v in _USE_CENTRE.items()}
    with np.errstate(all="ignore"):
        spread = forms.predict(law, c, {**X, "Lref": np.ones_like(X["N"])})
        mid = forms.predict(law, c, {**centre, "Lref": np.ones(1)})
    if not np.all(np.isfinite(spread)):
        raise ArchsearchError(f"{where}: coefficients", "predict an infinite or undefined loss at sizes or shape "
                              "ratios a law is used at (a coefficient overflows)", "refit the law (archsearch fit)")
    if not mid[0] > 0:
        raise ArchsearchError(f"{where}: coefficients", f"predict a loss (factor) of {mid[0]:.4g} at N=1e8, "
                              "D=2e9, d/sqrt(N)=0.1, r=1: a loss is positive", "refit the law (archsearch fit)")


def _from_dict(data: Any, where: str) -> FitResult:
    if not isinstance(data, dict):
        raise ArchsearchError(where, "a law must be a JSON object", 'e.g. {"law": ..., "coefficients": {...}}')
    for k in data:
        if k not in _KNOWN_KEYS:
            close = difflib.get_close_matches(k, sorted(_KNOWN_KEYS), n=1)
            raise ArchsearchError(f"{where}: {k}", "unknown key",
                                  f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(_KNOWN_KEYS)}")
    law = data.get("law")
    form = law_form(law, f"{where}: law")
    coefs = data.get("coefficients")
    if not isinstance(coefs, dict):
        raise ArchsearchError(f"{where}: coefficients", "missing or not an object",
                              f"{law} needs {list(forms.coefficient_names(law))}")
    names = forms.coefficient_names(law)
    for k in coefs:
        if k not in names:
            raise ArchsearchError(f"{where}: coefficients.{k}", f"not a coefficient of {law}",
                                  f"{law} has {list(names)}")
    clean = {}
    for k in names:
        v = coefs.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ArchsearchError(f"{where}: coefficients.{k}", f"must be a finite number, got {v!r}",
                                  f"{law} needs {list(names)}")
        clean[k] = float(v)
    for k in form.nonnegative:
        if clean[k] < 0:
            raise ArchsearchError(f"{where}: coefficients.{k}", f"must be >= 0, got {clean[k]}")
    check_predicts(law, clean, where)
    ref = None
    if "reference" in data and "L_opt" in data:
        raise ArchsearchError(f"{where}: L_opt", "give either reference or L_opt, not both")
    if form.conditional:
        if data.get("reference") is not None:
            ref = parse_reference(data["reference"], f"{where}: reference")
        elif data.get("L_opt") is not None:
            ref = _parse_lopt(data["L_opt"], f"{where}: L_opt")
    elif data.get("reference") is not None or data.get("L_opt") is not None:
        raise ArchsearchError(f"{where}: reference", f"{law} is not a conditional law and takes no reference")
    warns = list(data.get("warnings") or [])
    if ref and ref["law"] == "constant" and not any("constant L_opt" in w for w in warns):
        warns.append("constant L_opt: predicted losses ignore N and D (valid only at the (N, D) "
                     "where that L_opt holds)")
    status = data.get("status", "ok")
    if status not in ("ok", "warnings", "not_converged"):
        raise ArchsearchError(f"{where}: status", f"unknown status {status!r}")
    err = _parse_prediction_error(data.get("prediction_error"), f"{where}: prediction_error")
    rng = _parse_fitted_range(data.get("fitted_range"), f"{where}: fitted_range")
    try:
        return FitResult(law=law, coefficients=clean, reference=ref, status=status, warnings=warns,
                         metrics=dict(data.get("metrics") or {}), options=dict(data.get("options") or {}),
                         dropped=list(data.get("dropped") or []), n_runs=int(data.get("n_runs") or 0),
                         data_ranges=dict(data.get("data_ranges") or {}),
                         bootstrap=data.get("bootstrap"), provenance=data.get("provenance"),
                         prediction_error=err, fitted_range=rng)
    except (TypeError, ValueError) as e:
        raise ArchsearchError(where, f"malformed law file: {e}") from None


def _source(v: dict[str, Any], where: str, example: str) -> str:
    src = v.get("source")
    if not isinstance(src, str) or not src.strip():
        raise ArchsearchError(f"{where}.source", "is missing: say where the figure comes from",
                              f"e.g. \"source\": \"{example}\"")
    return src


def _parse_prediction_error(v: Any, where: str) -> dict[str, Any] | None:
    """``{"relative_sd": s >= 0, "source": "..."}`` (other keys kept as they are), or None."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ArchsearchError(where, f"expected an object, got {v!r}",
                              '{"relative_sd": 0.005, "source": "where the 0.5% comes from"}')
    sd = v.get("relative_sd")
    if isinstance(sd, bool) or not isinstance(sd, (int, float)) or not (math.isfinite(sd) and sd >= 0):
        raise ArchsearchError(f"{where}.relative_sd", f"must be a finite number >= 0, got {sd!r}",
                              "the standard deviation of (predicted - trained) / trained loss, e.g. 0.005")
    return {**v, "relative_sd": float(sd), "source": _source(v, where, "held-out size 297M, 25 runs")}


RANGE_KEYS = ("hidden_over_sqrt_n", "mlp_to_attn")


def _parse_fitted_range(v: Any, where: str) -> dict[str, Any] | None:
    """``{"hidden_over_sqrt_n": [lo, hi] | null, "mlp_to_attn": [lo, hi] | null, "source": "..."}``
    (null: the source does not state that coordinate's range), or None."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ArchsearchError(where, f"expected an object, got {v!r}",
                              '{"hidden_over_sqrt_n": [0.04, 0.1], "mlp_to_attn": [0.5, 5], "source": "..."}')
    out: dict[str, Any] = {k: x for k, x in v.items() if k not in RANGE_KEYS}
    for k in RANGE_KEYS:
        if k not in v:
            raise ArchsearchError(f"{where}.{k}", "is missing",
                                  "give [low, high], or null where the source does not state it")
        b = v[k]
        if b is None:
            out[k] = None
            continue
        ok = isinstance(b, list) and len(b) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in b)
        if not ok or not 0 < b[0] < b[1]:
            raise ArchsearchError(f"{where}.{k}", f"must be [low, high] with 0 < low < high, got {b!r}",
                                  "e.g. [0.5, 5.0]")
        out[k] = [float(b[0]), float(b[1])]
    out["source"] = _source(v, where, "the method's r filter [0.5, 5]")
    return out


def parse_reference(ref: Any, where: str) -> dict[str, Any] | None:
    if ref is None:
        return None
    if isinstance(ref, FitResult):
        if ref.law != "chinchilla":
            raise ArchsearchError(where, f"a reference law must be chinchilla, got {ref.law!r}")
        return {"law": "chinchilla", "coefficients": dict(ref.coefficients)}
    if not isinstance(ref, dict):
        raise ArchsearchError(where, f"expected an object, got {ref!r}")
    kind = ref.get("law")
    if kind is None and set(ref) == set(forms.coefficient_names("chinchilla")):
        ref, kind = {"law": "chinchilla", "coefficients": ref}, "chinchilla"
    if kind == "chinchilla":
        inner = _from_dict({"law": "chinchilla", "coefficients": ref.get("coefficients")}, where)
        return {"law": "chinchilla", "coefficients": inner.coefficients}
    if kind == "best-observed":
        groups = ref.get("groups")
        out = _parse_lopt(groups, f"{where}.groups")
        out["tolerance"] = float(ref.get("tolerance", 0.05))
        return out
    if kind == "constant":
        return _parse_lopt(ref.get("loss"), f"{where}.loss")
    raise ArchsearchError(f"{where}.law", f"unknown reference {kind!r}",
                          'use {"law": "chinchilla", "coefficients": {...}}, best-observed or constant')


def _parse_lopt(v: Any, where: str) -> dict[str, Any]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if not (math.isfinite(v) and v > 0):
            raise ArchsearchError(where, f"must be a positive loss, got {v!r}")
        return {"law": "constant", "loss": float(v)}
    if isinstance(v, list) and v:
        groups = []
        for i, g in enumerate(v):
            try:
                row = {k: float(g[k]) for k in ("params", "tokens", "loss")}
            except (KeyError, TypeError, ValueError):
                raise ArchsearchError(f"{where}[{i}]", "needs numbers params, tokens and loss") from None
            if not all(math.isfinite(x) and x > 0 for x in row.values()):
                raise ArchsearchError(f"{where}[{i}]", "params, tokens and loss must be positive")
            groups.append(row)
        return {"law": "best-observed", "groups": groups, "tolerance": 0.05}
    raise ArchsearchError(where, f"expected a loss or a list of {{params, tokens, loss}}, got {v!r}")


def reference_coefficients(ref: Any) -> dict[str, Any] | None:
    """A given reference as written to a law file: a Chinchilla law's coefficients, or the whole
    reference dict for the other kinds (best-observed groups, constant)."""
    if ref is None:
        return None
    parsed = parse_reference(ref, "reference_law")
    return parsed["coefficients"] if parsed["law"] == "chinchilla" else parsed


def reference_loss(ref: dict[str, Any] | None, N: np.ndarray, D: np.ndarray) -> np.ndarray:
    """L_opt at arrays (N, D) from a reference dict; a clear error where it is not defined."""
    if ref is None:
        raise ArchsearchError("reference", "this conditional law has no reference L_opt: it gives the "
                              "optimal shape but no loss", "add a chinchilla reference to the law "
                              "(fit with reference=chinchilla, --reference-law, or \"L_opt\" in the file)")
    if ref["law"] == "chinchilla":
        return forms.predict("chinchilla", ref["coefficients"], {"N": N, "D": D})
    if ref["law"] == "constant":
        return np.full(np.shape(N), ref["loss"], dtype=float)
    tol = ref.get("tolerance", 0.05)
    gN = np.array([g["params"] for g in ref["groups"]])
    gD = np.array([g["tokens"] for g in ref["groups"]])
    gL = np.array([g["loss"] for g in ref["groups"]])
    n, d = np.ravel(N).astype(float)[:, None], np.ravel(D).astype(float)[:, None]  # points x groups
    dn, dd = np.abs(np.log(gN[None, :] / n)), np.abs(np.log(gD[None, :] / d))
    ok = (dn <= math.log1p(tol)) & (dd <= math.log1p(tol))
    missing = np.flatnonzero(~ok.any(axis=1))
    if missing.size:
        i = missing[0]
        raise ArchsearchError(
            "reference", f"best-observed L_opt has no run near N={n[i, 0]:.4g}, D={d[i, 0]:.4g} (observed: "
            + ", ".join(f"N={a:.3g}/D={b:.3g}" for a, b in zip(gN, gD)) + ")",
            "fit with reference=chinchilla or give the law a Chinchilla reference "
            "(--reference-law / FitResult.with_reference)")
    nearest = np.argmin(np.where(ok, dn + dd, np.inf), axis=1)  # the closest group within tolerance
    out = gL[nearest].reshape(np.shape(N)).astype(float)
    return out


# -- arrays from runs -------------------------------------------------------------------------

def spec_arrays(specs: Sequence["ArchSpec"], tokens: Sequence[float],
                params: float | None = None) -> forms.Data:
    """A law's inputs (N, D, hidden/sqrt(N), r, hidden/layers) for architectures trained on
    ``tokens``; ``params`` fixes N for all of them (the solver's iso-parameter slices)."""
    n = [float(params) if params is not None else non_embedding_params(s) for s in specs]
    return {"N": np.array(n, dtype=float),
            "D": np.array(tokens, dtype=float),
            "x1": np.array([hidden_over_sqrt_n(s) for s in specs]),
            "x2": np.array([mlp_to_attn_ratio(s) for s in specs]),
            "R": np.array([s.hidden_size / s.n_layers for s in specs], dtype=float)}




def run_arrays(runs: Sequence["RunRecord"]) -> tuple[forms.Data, np.ndarray]:
    """(inputs, losses) of runs; N, r and hidden/sqrt(N) are derived from the architecture."""
    if all(r.has_arch for r in runs):
        X = spec_arrays([r.spec for r in runs], [r.tokens for r in runs])
    else:  # N-only rows (Chinchilla): the shape variables are unknown
        nan = np.full(len(runs), np.nan)
        X = {"N": np.array([r.n_params for r in runs], dtype=float),
             "D": np.array([r.tokens for r in runs], dtype=float), "x1": nan, "x2": nan.copy(), "R": nan.copy()}
    return X, np.array([r.loss for r in runs], dtype=float)


def quantiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap ``samples``."""
    if not 0 < level < 1:
        raise ArchsearchError("level", f"must be in (0, 1), got {level}")
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(samples, [a, 1.0 - a])
    return float(lo), float(hi)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    return obj


def _drop_reference_samples(boot):
    if not boot or "reference" not in boot:
        return boot
    return {k: v for k, v in boot.items() if k not in ("reference", "reference_names")}

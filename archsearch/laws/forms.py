"""The four law forms of the method (docs/method.md section 3): formulas, fitting parametrisations
and their Jacobians, registered in :mod:`archsearch.laws.registry`.

Each form has two faces:

* **Coefficients** (``E, A, alpha, ...`` / ``a0, a1, a2, b0, b1, b2``): what a law file holds and
  what :func:`predict` evaluates. These are the published formulas, nothing else.
* **Fit parameters** ``theta``: the same law re-expressed so that a bounded optimiser behaves.
  Inputs are normalised by their geometric means (``n = log N - log N0``) and positive scales
  are fitted as logs, so every parameter is O(1). The conditional factors are written as
  ``m + c1 * h(x / x*)`` with ``h(u) = log u + 1/u - 1 >= 0``: the same function as
  ``c0 + c1 log x + c2 / x`` with ``x* = c2 / c1``, but U-shaped and positive by construction
  (``c1 >= 0``, ``m > 0``), which also puts the optimum ``x*`` directly among the parameters.

``logpred(theta, X)`` returns log predicted loss and its Jacobian ``d logpred / d theta``;
the Jacobians are checked against finite differences in the tests.

Scale degeneracy of the multiplicative form: ``(k f) (g / k)`` is the same law for any k, so
one factor's scale must be fixed. The robust fit fixes ``min g = g(r*) = 1``; the factor in
``hidden/sqrt(N)`` then carries the loss ratio of the optimal architecture to ``L_opt``. The
Levenberg-Marquardt option fits the raw coefficients and fixes ``b0 = 1`` instead (paper
parity). Predictions and the optimum do not depend on which is fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from archsearch.laws.registry import LawForm, LmForm, law_form

# Arrays a form reads: N (non-embedding params), D (tokens), x1 = hidden/sqrt(N),
# x2 = r = mlp/attn params, R = hidden/n_layers, Lref = reference loss L_opt(N, D).
Data = dict[str, np.ndarray]


# -- the published formulas, from coefficients -----------------------------------------------

def u_factor(c0: float, c1: float, c2: float, x: np.ndarray) -> np.ndarray:
    """``c0 + c1 log x + c2 / x``: one U-shaped factor of the conditional law."""
    return c0 + c1 * np.log(x) + c2 / x


def predict(law: str, c: dict[str, float], X: Data) -> np.ndarray:
    """Predicted loss of registered form ``law`` from its coefficients (arrays in ``X``; ``Lref``
    for conditional forms)."""
    return law_form(law).predict(c, X)


def coefficient_names(law: str) -> tuple[str, ...]:
    """Names of the coefficients a law file holds for ``law``."""
    return law_form(law).coefficients


def _chinchilla(c: dict[str, float], X: Data) -> np.ndarray:
    return c["E"] + c["A"] * X["N"] ** -c["alpha"] + c["B"] * X["D"] ** -c["beta"]


def _aspect_ratio(c: dict[str, float], X: Data) -> np.ndarray:
    return _chinchilla(c, X) * (1.0 + c["eps"] * X["R"] ** c["gamma"])


def _u_factors(c: dict[str, float], key: str, x: np.ndarray) -> np.ndarray:
    """The conditional forms' factor in ``x1`` (a0, a1, a2) or ``x2`` (b0, b1, b2; b0 = 0 in the
    additive form, which has none)."""
    if key == "x1":
        return u_factor(c["a0"], c["a1"], c["a2"], x)
    return u_factor(c.get("b0", 0.0), c["b1"], c["b2"], x)


def _multiplicative(c: dict[str, float], X: Data) -> np.ndarray:
    return _u_factors(c, "x1", X["x1"]) * _u_factors(c, "x2", X["x2"]) * X["Lref"]


def _additive(c: dict[str, float], X: Data) -> np.ndarray:
    return _u_factors(c, "x1", X["x1"]) + c["b1"] * np.log(X["x2"]) + c["b2"] / X["x2"] + X["Lref"]


def _u_optima(c: dict[str, float]) -> tuple[float | None, float | None]:
    return factor_optimum(c["a1"], c["a2"]), factor_optimum(c["b1"], c["b2"])


def factor_optimum(c1: float, c2: float) -> float | None:
    """Minimiser ``c2 / c1`` of ``c0 + c1 log x + c2 / x``; None unless c1, c2 > 0 (no interior minimum)."""
    if c1 > 0 and c2 > 0:
        return c2 / c1
    return None


# -- fitting parametrisations -----------------------------------------------------------------

@dataclass(frozen=True)
class Norm:
    """Geometric means used to normalise the inputs (log N0, log D0, log R0)."""

    log_n0: float
    log_d0: float
    log_r0: float

    @classmethod
    def of(cls, X: Data) -> "Norm":
        return cls(float(np.mean(np.log(X["N"]))), float(np.mean(np.log(X["D"]))),
                   float(np.mean(np.log(X["R"]))))


@dataclass(frozen=True)
class Form:
    """A law in its fitting parametrisation (see the module docstring)."""

    law: str
    names: tuple[str, ...]                                # theta names, for warnings
    logpred: Callable[[np.ndarray, Data, Norm], tuple[np.ndarray, np.ndarray]]
    to_coefficients: Callable[[np.ndarray, Norm], dict[str, float]]
    from_coefficients: Callable[[dict[str, float], Norm], np.ndarray]
    bounds: Callable[[Data, np.ndarray], list[tuple[float, float]]]
    start_box: Callable[[Data, np.ndarray], list[tuple[float, float]]]


def _lse3(t0, t1, t2):
    m = np.maximum(np.maximum(t0, t1), t2)
    e0, e1, e2 = np.exp(t0 - m), np.exp(t1 - m), np.exp(t2 - m)
    s = e0 + e1 + e2
    return m + np.log(s), e0 / s, e1 / s, e2 / s


def _chin_bounds(X, L):
    lo, hi = math.log(float(L.min())), math.log(float(L.max()))
    return [(lo - 10.0, hi), (lo - 15.0, hi + 5.0), (0.01, 2.5), (lo - 15.0, hi + 5.0), (0.01, 2.5)]


def _chin_box(X, L):
    lo, mid = math.log(float(L.min())), math.log(float(np.median(L)))
    return [(lo + math.log(0.2), lo + math.log(0.9)), (mid - 3.0, mid), (0.1, 0.8),
            (mid - 3.0, mid), (0.1, 0.8)]


def _chin_logpred(th, X, nm):
    e, a, alpha, b, beta = th
    n = np.log(X["N"]) - nm.log_n0
    d = np.log(X["D"]) - nm.log_d0
    y, w0, w1, w2 = _lse3(np.full_like(n, e), a - alpha * n, b - beta * d)
    J = np.stack([w0, w1, -n * w1, w2, -d * w2], axis=1)
    return y, J


def _chin_to(th, nm):
    e, a, alpha, b, beta = (float(v) for v in th)
    # A N^-alpha = exp(a - alpha (log N - log N0))  =>  A = exp(a + alpha log N0)
    return {"E": math.exp(e), "A": math.exp(a + alpha * nm.log_n0), "alpha": alpha,
            "B": math.exp(b + beta * nm.log_d0), "beta": beta}


def _chin_from(c, nm):
    return np.array([math.log(c["E"]), math.log(c["A"]) - c["alpha"] * nm.log_n0, c["alpha"],
                     math.log(c["B"]) - c["beta"] * nm.log_d0, c["beta"]])


CHINCHILLA = Form("chinchilla", ("log E", "log A (normalised)", "alpha", "log B (normalised)", "beta"),
                  _chin_logpred, _chin_to, _chin_from, _chin_bounds, _chin_box)


def _aspect_form(tied: bool) -> Form:
    """``(E + A N^-alpha + B D^-beta)(1 + eps R^gamma)``; tied: alpha = beta = gamma (one k)."""

    def expand(th):
        if tied:
            e, a, b, s, k = th
            return e, a, k, b, k, s, k
        return tuple(th)

    def logpred(th, X, nm):
        e, a, alpha, b, beta, s, gamma = expand(th)
        n = np.log(X["N"]) - nm.log_n0
        d = np.log(X["D"]) - nm.log_d0
        rho = np.log(X["R"]) - nm.log_r0
        y1, w0, w1, w2 = _lse3(np.full_like(n, e), a - alpha * n, b - beta * d)
        z = s + gamma * rho
        y2 = np.logaddexp(0.0, z)          # log(1 + eps R^gamma)
        sig = 0.5 * (1.0 + np.tanh(0.5 * z))
        if tied:
            J = np.stack([w0, w1, w2, sig, -n * w1 - d * w2 + rho * sig], axis=1)
        else:
            J = np.stack([w0, w1, -n * w1, w2, -d * w2, sig, rho * sig], axis=1)
        return y1 + y2, J

    def to_c(th, nm):
        e, a, alpha, b, beta, s, gamma = (float(v) for v in expand(th))
        c = _chin_to(np.array([e, a, alpha, b, beta]), nm)
        c.update({"eps": math.exp(s - gamma * nm.log_r0), "gamma": gamma})
        return c

    def from_c(c, nm):
        base = _chin_from(c, nm)
        s = math.log(c["eps"]) + c["gamma"] * nm.log_r0
        if tied:
            k = (c["alpha"] + c["beta"] + c["gamma"]) / 3.0
            return np.array([base[0], math.log(c["A"]) - k * nm.log_n0,
                             math.log(c["B"]) - k * nm.log_d0, math.log(c["eps"]) + k * nm.log_r0, k])
        return np.array([*base, s, c["gamma"]])

    def bounds(X, L):
        cb = _chin_bounds(X, L)
        if tied:
            return [cb[0], cb[1], cb[3], (-15.0, 3.0), (0.01, 2.5)]
        return [*cb, (-15.0, 3.0), (-2.5, 2.5)]

    def box(X, L):
        cb = _chin_box(X, L)
        if tied:
            return [cb[0], cb[1], cb[3], (-6.0, -1.0), (0.1, 0.8)]
        return [*cb, (-6.0, -1.0), (-0.5, 0.8)]

    names = (("log E", "log A (normalised)", "log B (normalised)", "log eps (normalised)",
              "alpha=beta=gamma") if tied else
             ("log E", "log A (normalised)", "alpha", "log B (normalised)", "beta",
              "log eps (normalised)", "gamma"))
    return Form("aspect-ratio", names, logpred, to_c, from_c, bounds, box)


# Conditional forms: theta = (k, a1, log x1*, b1, log r*) where k is log m (multiplicative: the
# x1 factor's minimum, a loss ratio) or c (additive: the excess loss at the optimum).

def h_and_slope(logx, u):
    """h(x/x*) with u = log x*, and its derivative in u (the conditional forms' Jacobian)."""
    lv = logx - u
    iv = np.exp(-lv)                      # x*/x
    return lv + iv - 1.0, iv - 1.0        # h(x/x*), dh/du




def _cond_box_u(X):
    l1, l2 = np.log(X["x1"]), np.log(X["x2"])
    return (float(l1.min()), float(l1.max())), (float(l2.min()), float(l2.max()))


def _mult_logpred(th, X, nm):
    k, a1, u1, b1, u2 = th
    h1, dh1 = h_and_slope(np.log(X["x1"]), u1)
    h2, dh2 = h_and_slope(np.log(X["x2"]), u2)
    m = math.exp(k)
    F = m + a1 * h1
    G = 1.0 + b1 * h2
    y = np.log(X["Lref"]) + np.log(F) + np.log(G)
    J = np.stack([m / F, h1 / F, a1 * dh1 / F, h2 / G, b1 * dh2 / G], axis=1)
    return y, J


def _mult_to(th, nm):
    k, a1, u1, b1, u2 = (float(v) for v in th)
    return {"a0": math.exp(k) - a1 * (1.0 + u1), "a1": a1, "a2": a1 * math.exp(u1),
            "b0": 1.0 - b1 * (1.0 + u2), "b1": b1, "b2": b1 * math.exp(u2)}


def _mult_from(c, nm):
    # Re-normalise so that min g = 1 (the fitting convention); needs both factors U-shaped.
    x1s, x2s = factor_optimum(c["a1"], c["a2"]), factor_optimum(c["b1"], c["b2"])
    if x1s is None or x2s is None:
        raise ValueError("factor without an interior minimum")
    gmin = c["b0"] + c["b1"] * (1.0 + math.log(x2s))
    fmin = c["a0"] + c["a1"] * (1.0 + math.log(x1s))
    if gmin <= 0 or fmin <= 0:
        raise ValueError("factor with a non-positive minimum")
    return np.array([math.log(fmin * gmin), c["a1"] * gmin, math.log(x1s), c["b1"] / gmin,
                     math.log(x2s)])


def _mult_bounds(X, L):
    (l1, h1), (l2, h2) = _cond_box_u(X)
    return [(math.log(0.2), math.log(5.0)), (0.0, 5.0), (l1 - 2.0, h1 + 2.0), (0.0, 5.0),
            (l2 - 2.0, h2 + 2.0)]


def _mult_box(X, L):
    (l1, h1), (l2, h2) = _cond_box_u(X)
    k = math.log(float(np.median(L / X["Lref"])))
    return [(k - 0.05, k + 0.02), (0.0, 0.2), (l1, h1), (0.0, 0.2), (l2, h2)]


CONDITIONAL_MULTIPLICATIVE = Form(
    "conditional-multiplicative", ("log min f", "a1", "log x1*", "b1 (min g = 1)", "log r*"),
    _mult_logpred, _mult_to, _mult_from, _mult_bounds, _mult_box)


def _add_logpred(th, X, nm):
    c, a1, u1, b1, u2 = th
    h1, dh1 = h_and_slope(np.log(X["x1"]), u1)
    h2, dh2 = h_and_slope(np.log(X["x2"]), u2)
    P = X["Lref"] + c + a1 * h1 + b1 * h2
    P = np.maximum(P, 1e-12)              # c's lower bound keeps P > 0; this only guards round-off
    J = np.stack([1.0 / P, h1 / P, a1 * dh1 / P, h2 / P, b1 * dh2 / P], axis=1)
    return np.log(P), J


def _add_to(th, nm):
    c, a1, u1, b1, u2 = (float(v) for v in th)
    return {"a0": c - a1 * (1.0 + u1) - b1 * (1.0 + u2), "a1": a1, "a2": a1 * math.exp(u1),
            "b1": b1, "b2": b1 * math.exp(u2)}


def _add_from(c, nm):
    x1s, x2s = factor_optimum(c["a1"], c["a2"]), factor_optimum(c["b1"], c["b2"])
    if x1s is None or x2s is None:
        raise ValueError("factor without an interior minimum")
    const = c["a0"] + c["a1"] * (1.0 + math.log(x1s)) + c["b1"] * (1.0 + math.log(x2s))
    return np.array([const, c["a1"], math.log(x1s), c["b1"], math.log(x2s)])


def _add_bounds(X, L):
    (l1, h1), (l2, h2) = _cond_box_u(X)
    lmin, lmax = float(X["Lref"].min()), float(L.max())
    return [(-0.5 * lmin, lmax), (0.0, 5.0 * lmax), (l1 - 2.0, h1 + 2.0), (0.0, 5.0 * lmax),
            (l2 - 2.0, h2 + 2.0)]


def _add_box(X, L):
    (l1, h1), (l2, h2) = _cond_box_u(X)
    c = float(np.median(L - X["Lref"]))
    s = 0.2 * float(np.median(L))
    return [(c - 0.05 * s, c + 0.02 * s), (0.0, s), (l1, h1), (0.0, s), (l2, h2)]


CONDITIONAL_ADDITIVE = Form(
    "conditional-additive", ("excess loss at optimum", "a1", "log x1*", "b1", "log r*"),
    _add_logpred, _add_to, _add_from, _add_bounds, _add_box)


def get_form(law: str, tie_exponents: bool = True) -> Form:
    """The fitting parametrisation of registered form ``law``."""
    return law_form(law).fitting(tie_exponents)


# -- Levenberg-Marquardt (paper parity): plain least squares on the loss ---------------------
# Chinchilla / aspect-ratio: the same theta (positive scales as logs), residuals in loss units
# (their LawForm has no ``lm``). Conditional: the raw coefficients (multiplicative with b0 = 1),
# so nothing forces a U shape.

def _lm_multiplicative(p: np.ndarray, X: Data) -> tuple[np.ndarray, np.ndarray]:
    a0, a1, a2, b1, b2 = p
    lx1, ix1 = np.log(X["x1"]), 1.0 / X["x1"]
    lx2, ix2 = np.log(X["x2"]), 1.0 / X["x2"]
    f = a0 + a1 * lx1 + a2 * ix1
    g = 1.0 + b1 * lx2 + b2 * ix2
    Lr = X["Lref"]
    J = np.stack([Lr * g, Lr * g * lx1, Lr * g * ix1, Lr * f * lx2, Lr * f * ix2], axis=1)
    return Lr * f * g, J


def _lm_additive(p: np.ndarray, X: Data) -> tuple[np.ndarray, np.ndarray]:
    lx1, ix1 = np.log(X["x1"]), 1.0 / X["x1"]
    lx2, ix2 = np.log(X["x2"]), 1.0 / X["x2"]
    J = np.stack([np.ones_like(lx1), lx1, ix1, lx2, ix2], axis=1)
    return X["Lref"] + J @ p, J


def _lm_to(p: np.ndarray, b0: float | None) -> dict[str, float]:
    a0, a1, a2, b1, b2 = (float(v) for v in p)
    c = {"a0": a0, "a1": a1, "a2": a2, "b1": b1, "b2": b2}
    if b0 is not None:
        c["b0"] = b0
    return c


def _lm_from_multiplicative(c: dict[str, float]) -> np.ndarray:
    b0 = c["b0"]  # rescale so that b0 = 1 (the LM convention); f absorbs the scale
    if b0 == 0:
        raise ValueError("b0 = 0 cannot be rescaled to 1")
    return np.array([c["a0"] * b0, c["a1"] * b0, c["a2"] * b0, c["b1"] / b0, c["b2"] / b0])


def _lm_from_additive(c: dict[str, float]) -> np.ndarray:
    return np.array([c["a0"], c["a1"], c["a2"], c["b1"], c["b2"]])


# -- the registered forms (archsearch.laws.registry.FORMS names them) -------------------------

_U_PAIRS = (("a1", "a2"), ("b1", "b2"))

CHINCHILLA_LAW = LawForm(
    "chinchilla", ("E", "A", "alpha", "B", "beta"), _chinchilla, lambda tie: CHINCHILLA, ("N", "D"),
    nonnegative=("E", "A", "B"), falling=("alpha", "beta"))
ASPECT_RATIO_LAW = LawForm(
    "aspect-ratio", ("E", "A", "alpha", "B", "beta", "eps", "gamma"), _aspect_ratio, _aspect_form,
    ("N", "D", "R"), nonnegative=("E", "A", "B", "eps"), falling=("alpha", "beta"))
CONDITIONAL_MULTIPLICATIVE_LAW = LawForm(
    "conditional-multiplicative", ("a0", "a1", "a2", "b0", "b1", "b2"), _multiplicative,
    lambda tie: CONDITIONAL_MULTIPLICATIVE, ("x1", "x2", "Lref"), optimum=_u_optima, factor=_u_factors,
    combine="multiplicative", factor_coefficients=_U_PAIRS,
    lm=LmForm(_lm_multiplicative, lambda p: _lm_to(p, 1.0), _lm_from_multiplicative, (1.0, 0, 0, 0, 0)))
CONDITIONAL_ADDITIVE_LAW = LawForm(
    "conditional-additive", ("a0", "a1", "a2", "b1", "b2"), _additive, lambda tie: CONDITIONAL_ADDITIVE,
    ("x1", "x2", "Lref"), optimum=_u_optima, factor=_u_factors, combine="additive",
    factor_coefficients=_U_PAIRS,
    lm=LmForm(_lm_additive, lambda p: _lm_to(p, None), _lm_from_additive, (0.0, 0, 0, 0, 0)))

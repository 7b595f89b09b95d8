"""Honest margins: how far a shape's predicted loss clears the target, judged against what the
law can resolve, and whether the shape lies where the law was fitted (docs/method.md section 4).

The loss of a shape trained at the study's (N, D) is modelled as the law's prediction under each
bootstrap resample plus the law's own error against trained models (``prediction_error``: a fit's
held-out error, a published law's stated one), a normal term with standard deviation
``relative_sd x predicted loss``. So

    P(loss <= L_t) = mean_i Phi((L_t - s_i) / sigma)

over the bootstrap predictions s_i (the point prediction alone without a bootstrap), the
variance being the bootstrap's plus the law error's. With no law error it is the share of
resamples under the target, and the level-c bound is the bootstrap's c quantile, as before.

A shape *clears* the target when P >= c, *misses* it when P <= 1 - c, and is otherwise
*within the law's error of the target* (c: ``target.confidence``, else 0.9). Feasibility is the
method's ``predicted loss <= L_t`` unless ``target.confidence`` is set; then it is P >= c.

The fitted range: a shape whose realised d/sqrt(N) or r lies outside the box the law was fitted on
(:meth:`archsearch.laws.FitResult.shape_range`) is refused unless ``law.allow_extrapolation``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio
from archsearch.errors import ArchsearchError
from archsearch.laws.lawfile import spec_arrays

if TYPE_CHECKING:
    from archsearch.arch import ArchSpec

DEFAULT_LEVEL = 0.9  # the verdict's level where the target sets no confidence (the report's intervals' level)


def _phi(x: np.ndarray) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr(x)


def law_error(law) -> dict[str, Any] | None:
    """The law's ``prediction_error`` (``relative_sd`` and its ``source``), or None where unknown."""
    return getattr(law, "prediction_error", None)


def law_sd(law) -> float | None:
    e = law_error(law)
    return None if e is None else float(e["relative_sd"])


@dataclass(frozen=True)
class LossDistribution:
    """The predicted loss of one shape: the point prediction, the bootstrap's predictions (None
    without a bootstrap) and the law's error as an absolute standard deviation (None: unknown)."""

    predicted: float
    samples: np.ndarray | None
    law_sd_abs: float | None

    @property
    def bootstrap_sd(self) -> float | None:
        return float(np.std(self.samples)) if self.samples is not None and self.samples.size > 1 else None

    @property
    def total_sd(self) -> float:
        return math.sqrt((self.bootstrap_sd or 0.0) ** 2 + (self.law_sd_abs or 0.0) ** 2)

    def _centres(self) -> np.ndarray:
        return self.samples if self.samples is not None and self.samples.size else np.array([self.predicted])

    def p_below(self, target: float) -> float:
        """P(loss <= target) under the mixture (bootstrap centres, normal law error)."""
        s = self._centres()
        sigma = self.law_sd_abs or 0.0
        if sigma <= 0:
            return float(np.mean(s <= target))
        return float(np.mean(_phi((target - s) / sigma)))

    def quantile(self, level: float) -> float:
        """The loss the shape stays under with probability ``level`` (one-sided upper bound)."""
        s = self._centres()
        sigma = self.law_sd_abs or 0.0
        if sigma <= 0:
            return float(np.quantile(s, level))
        lo, hi = float(s.min()) - 10 * sigma, float(s.max()) + 10 * sigma
        for _ in range(100):  # bisection on a monotone CDF: 100 halvings reach float precision
            mid = 0.5 * (lo + hi)
            if self.p_below(mid) < level:
                lo = mid
            else:
                hi = mid
        return hi


def distribution(law, spec: "ArchSpec", tokens: float, params: float) -> LossDistribution:
    """A shape's predicted loss at the study's N and D with the bootstrap and the law's error."""
    pred = float(law.predict(spec, tokens, params=params))
    boot = law.bootstrap_predictions(spec_arrays([spec], [tokens], params))
    sd = law_sd(law)
    return LossDistribution(pred, None if boot is None else np.asarray(boot)[:, 0],
                            None if sd is None else sd * pred)


def upper_bound(law, spec: "ArchSpec", tokens: float, params: float, level: float) -> float:
    """The chance constraint's bound: the ``level`` quantile of the shape's loss (bootstrap and
    law error); an error naming ``target.confidence`` when the law has neither."""
    d = distribution(law, spec, tokens, params)
    if d.samples is None and d.law_sd_abs is None:
        raise ArchsearchError("target.confidence", "the law has neither a bootstrap nor a stated prediction_error "
                              "to give its loss a distribution",
                              "set law.fit.bootstrap > 0 (e.g. 200), give the law file a prediction_error, "
                              "or drop target.confidence")
    return d.quantile(level)


@dataclass(frozen=True)
class Margin:
    """How a shape's predicted loss stands against the target, and whether the law resolves it."""

    predicted: float
    target: float
    margin: float                   # (target - predicted) / target: > 0 under the target
    p_within_target: float          # P(loss <= target)
    level: float
    verdict: str                    # clears | within the law's error | misses
    law_sd: float | None            # relative; None: the law states no error
    bootstrap_sd: float | None      # absolute
    resolvable: float               # the relative margin the law resolves at `level`

    def to_dict(self) -> dict[str, Any]:
        return {"predicted": self.predicted, "target": self.target, "margin": self.margin,
                "p_within_target": self.p_within_target, "level": self.level, "verdict": self.verdict,
                "law_relative_sd": self.law_sd, "bootstrap_sd": self.bootstrap_sd,
                "resolvable_margin": self.resolvable}


CLEARS, WITHIN, MISSES = "clears the target", "within the law's error of the target", "misses the target"


def margin(law, spec: "ArchSpec", tokens: float, params: float, target: float,
           level: float | None = None) -> Margin:
    """The shape's margin and its verdict at ``level`` (default 0.9)."""
    from scipy.special import ndtri

    level = level or DEFAULT_LEVEL
    d = distribution(law, spec, tokens, params)
    p = d.p_below(target)
    verdict = CLEARS if p >= level else MISSES if p <= 1 - level else WITHIN
    return Margin(d.predicted, float(target), (target - d.predicted) / target, p, level, verdict,
                  law_sd(law), d.bootstrap_sd, float(ndtri(level)) * d.total_sd / target)


def describe_margin(m: dict[str, Any]) -> str:
    """One line for a person: the margin, the verdict and what the law can resolve."""
    err = ("the law's error not stated" if m.get("law_relative_sd") is None
           else f"law error {m['law_relative_sd']:.2%} (sd)")
    return (f"margin {m['margin']:+.3%} of the target: {m['verdict']} (P(loss <= target) = "
            f"{m['p_within_target']:.2f}; {err}; margins within +-{m['resolvable_margin']:.2%} are "
            f"not resolved at {m['level']:.0%})")


# -- the fitted range ---------------------------------------------------------------------------

def shape_range(law) -> dict[str, Any] | None:
    return law.shape_range() if hasattr(law, "shape_range") else None


def outside_range(law, spec: "ArchSpec") -> str | None:
    """Why ``spec`` lies outside the law's fitted range (its realised d/sqrt(N) and r, the values
    the law reads), or None when inside or when the law states no range there."""
    rng = shape_range(law)
    if rng is None:
        return None
    why = []
    for key, name, value in (("hidden_over_sqrt_n", "d/sqrt(N)", hidden_over_sqrt_n(spec)),
                             ("mlp_to_attn", "r", mlp_to_attn_ratio(spec))):
        b = rng.get(key)
        if b is not None and not b[0] * (1 - 1e-9) <= value <= b[1] * (1 + 1e-9):
            why.append(f"{name} = {value:.4g} outside [{b[0]:.4g}, {b[1]:.4g}]")
    if not why:
        return None
    return f"outside the law's fitted range ({'; '.join(why)}; {rng.get('source')})"


def search_box(box: tuple[float, float], law, key: str, allow: bool) -> tuple[float, float]:
    """The search space's ``box`` for ``key`` within the law's fitted range (unless ``allow``):
    trials and seeds outside it would only be refused. An error when they do not overlap."""
    rng = shape_range(law)
    b = None if allow or rng is None else rng.get(key)
    if b is None:
        return tuple(box)
    lo, hi = max(box[0], b[0]), min(box[1], b[1])
    if lo > hi:
        raise ArchsearchError(f"search_space.{key}", f"[{box[0]:g}, {box[1]:g}] lies outside the law's fitted "
                              f"range [{b[0]:.4g}, {b[1]:.4g}] ({rng.get('source')})",
                              "search inside the range, or set law.allow_extrapolation: true to trust the law beyond it")
    return lo, hi


def range_summary(law, allow: bool) -> dict[str, Any]:
    """What the report says about the range: the box, where it is known from, and the rule."""
    rng = shape_range(law)
    if rng is None:
        rule = ("not checked: the law states no fitted range (add fitted_range to the law file, "
                "docs/laws.md)")
    elif allow:
        rule = "shapes outside it are allowed (law.allow_extrapolation: true) and marked extrapolated"
    else:
        rule = "shapes outside it are refused (set law.allow_extrapolation: true to allow them)"
    return {"range": rng, "allow_extrapolation": allow, "rule": rule}

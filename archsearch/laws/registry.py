"""The law forms a fit, a law file and a study may name (``law: conditional-multiplicative``).

A law form is one :class:`LawForm`: its coefficients, its published formula, its fitting
parametrisation and what the rest of the project may do with it (does it read a reference
L_opt, has it a closed-form loss-optimal shape). Every place that used to branch on a form's name
asks the form instead, so adding a form is a new file holding one :class:`LawForm` plus one line
in :data:`FORMS` (``"name": "module:ATTRIBUTE"``, loaded when first named), or a call to
:func:`register` for a form defined at run time (a test's toy form). docs/extending.md has the
recipe; the four forms of the method are in :mod:`archsearch.laws.forms`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from archsearch.errors import ArchsearchError

if TYPE_CHECKING:
    import numpy as np

    from archsearch.laws.forms import Data, Form


# name -> "module:ATTRIBUTE" of its LawForm, imported when the form is first named
FORMS: dict[str, str] = {
    "chinchilla": "archsearch.laws.forms:CHINCHILLA_LAW",
    "aspect-ratio": "archsearch.laws.forms:ASPECT_RATIO_LAW",
    "conditional-multiplicative": "archsearch.laws.forms:CONDITIONAL_MULTIPLICATIVE_LAW",
    "conditional-additive": "archsearch.laws.forms:CONDITIONAL_ADDITIVE_LAW",
}

_loaded: dict[str, "LawForm"] = {}


@dataclass(frozen=True)
class LmForm:
    """A form's Levenberg-Marquardt parametrisation (paper parity), where it is not the robust
    fit's ``theta``: the loss and its Jacobian in raw coefficients ``p``, the two conversions, and
    the first start (the flat law, L = L_opt)."""

    model: Callable[["np.ndarray", "Data"], tuple["np.ndarray", "np.ndarray"]]
    to_coefficients: Callable[["np.ndarray"], dict[str, float]]
    from_coefficients: Callable[[dict[str, float]], "np.ndarray"]
    flat: tuple[float, ...]


@dataclass(frozen=True)
class LawForm:
    """One law form, everything the project needs to know about it.

    Contract: ``predict(coefficients, X)`` is the published formula on the arrays of
    :data:`archsearch.laws.forms.Data` named in ``reads`` (``Lref`` = the reference L_opt(N, D),
    which makes the form *conditional*); ``fitting(tie_exponents)`` is its
    :class:`~archsearch.laws.forms.Form` (a bounded, O(1) parametrisation with an exact Jacobian;
    a conditional form's ``theta`` must not depend on the input normalisation, as the bootstrap
    warm-starts every resample at the full fit's vector). A law file's coefficients must name
    exactly ``coefficients``; those in ``nonnegative`` must be >= 0 and those in ``falling`` > 0
    (exponents: loss falls with N and D). A conditional form that a study may use gives
    ``optimum(coefficients) -> (hidden/sqrt(N)*, r*)`` (None for a factor with no interior
    minimum), ``factor(coefficients, "x1" | "x2", x)`` (its factor in one shape variable, for
    plots) and ``combine`` (``multiplicative``: loss = L_opt f g, so a loss target relative to
    the baseline is the same at every N; ``additive``: loss = L_opt + f + g).
    """

    name: str
    coefficients: tuple[str, ...]
    predict: Callable[[dict[str, float], "Data"], "np.ndarray"]
    fitting: Callable[[bool], "Form"]
    reads: tuple[str, ...]
    nonnegative: tuple[str, ...] = ()
    falling: tuple[str, ...] = ()
    optimum: Callable[[dict[str, float]], tuple[float | None, float | None]] | None = None
    factor: Callable[[dict[str, float], str, "np.ndarray"], "np.ndarray"] | None = None
    combine: str = "multiplicative"
    factor_coefficients: tuple[tuple[str, ...], ...] = ()   # named in a "not U-shaped" warning
    lm: LmForm | None = None

    def __post_init__(self) -> None:
        if self.combine not in ("multiplicative", "additive"):
            raise ArchsearchError("combine", f"unknown combination {self.combine!r}", "multiplicative or additive")
        if self.optimum is not None and not self.conditional:
            raise ArchsearchError("optimum", f"{self.name}: a closed-form shape optimum needs a conditional form "
                                  "(one that reads Lref)")

    @property
    def conditional(self) -> bool:
        """Reads the reference L_opt(N, D) (the architecture factors are relative to it)."""
        return "Lref" in self.reads

    @property
    def shaped(self) -> bool:
        """Depends on the architecture (not N and D alone)."""
        return any(k in self.reads for k in ("x1", "x2", "R"))

    @property
    def searchable(self) -> bool:
        """A study may search with it: conditional, with a closed-form optimum in (hidden/sqrt(N), r)."""
        return self.optimum is not None and self.factor is not None


def register(form: LawForm) -> LawForm:
    """Add ``form`` under its name (a form defined at run time; a form in a file of the package
    is a line in :data:`FORMS` instead). Re-registering a name replaces it."""
    _loaded[form.name] = form
    FORMS.setdefault(form.name, "")
    return form


def unregister(name: str) -> None:
    """Remove a form added by :func:`register` (a test cleans up after itself)."""
    _loaded.pop(name, None)
    if not FORMS.get(name):
        FORMS.pop(name, None)


def law_names() -> list[str]:
    """Every registered form's name."""
    return list(FORMS)


def law_form(name: str, field: str = "law") -> LawForm:
    """The registered form ``name``; an unknown one is an :class:`ArchsearchError` on ``field``."""
    if isinstance(name, str) and name in _loaded:
        return _loaded[name]
    target = FORMS.get(name) if isinstance(name, str) else None
    if not target:
        raise ArchsearchError(field, f"unknown law {name!r}", f"use one of {law_names()}")
    module, attr = target.split(":")
    form = getattr(importlib.import_module(module), attr)
    _loaded[name] = form
    return form

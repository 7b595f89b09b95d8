"""Scaling laws (docs/method.md section 3): fit, diagnose, and solve for the loss-optimal and the
throughput-optimal architecture. See ``docs/laws.md`` for the law-file and run-data formats.

Importing this package imports numpy only; scipy and matplotlib load when used.
"""

from archsearch.laws.diagnostics import leave_one_size_out, progressive_validation
from archsearch.laws.fit import FitOptions, fit_law
from archsearch.laws.lawfile import FitResult, load_law, run_arrays
from archsearch.laws.metrics import metrics
from archsearch.laws.registry import LawForm, law_form, law_names, register
from archsearch.laws.solve import Optimum, SolvePoint, SolveResult, optimum, pareto_front, solve

__all__ = ["FitOptions", "FitResult", "LawForm", "Optimum", "SolvePoint", "SolveResult", "fit_law",
           "law_form", "law_names", "leave_one_size_out", "load_law", "metrics", "optimum", "pareto_front",
           "progressive_validation", "register", "run_arrays", "solve"]

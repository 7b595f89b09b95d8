"""Scores of a law against runs: held-out metrics, residual trends, and the grouping of runs
into sizes (clusters of N) that the fit's hold-out and the validation protocols share."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from archsearch.rundata import RunRecord


def metrics(actual: Sequence[float], predicted: Sequence[float]) -> dict[str, Any]:
    """MSE, R^2, mean absolute relative error, root-mean-square relative error and Spearman rank
    correlation (None where undefined)."""
    from scipy.stats import spearmanr

    y = np.asarray(actual, dtype=float)
    p = np.asarray(predicted, dtype=float)
    n = int(y.size)
    out: dict[str, Any] = {"n": n, "mse": None, "r2": None, "mare": None, "rmsre": None, "spearman": None}
    if n == 0:
        return out
    err = p - y
    out["mse"] = float(np.mean(err ** 2))
    out["mare"] = float(np.mean(np.abs(err) / np.abs(y)))
    out["rmsre"] = float(np.sqrt(np.mean((err / y) ** 2)))
    ss = float(np.sum((y - y.mean()) ** 2))
    if ss > 0:
        out["r2"] = 1.0 - float(np.sum(err ** 2)) / ss
    # Spearman is undefined on fewer than 3 points or on constant data
    if n >= 3 and np.ptp(y) > 0 and np.ptp(p) > 0:
        rho = spearmanr(y, p).statistic
        out["spearman"] = None if math.isnan(rho) else float(rho)
    return out


def residual_trends(residuals: np.ndarray, variables: dict[str, np.ndarray],
                    min_points: int = 10, threshold: float = 0.5, alpha: float = 1e-3) -> list[str]:
    """Warnings for residuals that trend with a variable (Spearman |rho| > threshold, p < alpha).

    A trend means the law's shape in that variable is wrong, even when the overall error is small.
    """
    from scipy.stats import spearmanr

    out = []
    if residuals.size < min_points:
        return out
    for name, v in variables.items():
        if np.ptp(v) <= 0:
            continue
        res = spearmanr(v, residuals)
        if abs(res.statistic) > threshold and res.pvalue < alpha:
            out.append(f"residual trend: log-residuals correlate with {name} (Spearman "
                       f"{res.statistic:+.2f}, p={res.pvalue:.1g}); the law's shape in {name} "
                       "does not match the data")
    return out


def cluster(values: np.ndarray, tolerance: float) -> np.ndarray:
    """Integer labels grouping values within ``tolerance`` (relative) of their cluster's smallest."""
    order = np.argsort(values, kind="stable")
    labels = np.empty(values.size, dtype=int)
    label, start = -1, None
    for i in order:
        if start is None or values[i] > start * (1.0 + tolerance):
            label += 1
            start = values[i]
        labels[i] = label
    return labels


def size_groups(runs: "Sequence[RunRecord]", tolerance: float = 0.05) -> list[list[int]]:
    """Indices of runs per size (clusters of N), smallest size first."""
    n = np.array([r.n_params for r in runs], dtype=float)
    labels = cluster(n, tolerance)
    return [list(np.flatnonzero(labels == k)) for k in range(labels.max() + 1)] if n.size else []

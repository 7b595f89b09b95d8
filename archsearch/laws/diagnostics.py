"""How good a fit is: held-out metrics, residual trends, and the validation protocols (docs/method.md section 3).

Protocols (each row of the table fits on some sizes and tests on one size):

* ``progressive``: fit on every size below k, test on size k (the method's protocol, docs/method.md section 3).
* ``previous-size``: fit only on the size just below k, test on size k.
* ``leave-one-size-out``: fit on every other size, test on size k.

A *size* is a cluster of runs whose non-embedding N lies within ``size_tolerance`` (5%) of
each other: variants built for one budget land within a few percent of it.

With ``reference="best-observed"`` the tested size's L_opt is its own best observed loss (the
only way that reference reaches a new size): such rows test the architecture calibration,
not the extrapolation of L_opt, and say so in the ``reference_at_test`` column. With
``reference="chinchilla"`` the reference is fitted on the training sizes only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from archsearch.errors import ArchsearchError

if TYPE_CHECKING:
    from archsearch.laws.fit import FitOptions
    from archsearch.rundata import RunRecord

PROTOCOLS = ("progressive", "previous-size", "leave-one-size-out")


def metrics(actual: Sequence[float], predicted: Sequence[float]) -> dict[str, Any]:
    """MSE, R^2, mean absolute relative error and Spearman rank correlation (None where undefined)."""
    from scipy.stats import spearmanr

    y = np.asarray(actual, dtype=float)
    p = np.asarray(predicted, dtype=float)
    n = int(y.size)
    out: dict[str, Any] = {"n": n, "mse": None, "r2": None, "mare": None, "spearman": None}
    if n == 0:
        return out
    err = p - y
    out["mse"] = float(np.mean(err ** 2))
    out["mare"] = float(np.mean(np.abs(err) / np.abs(y)))
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


def progressive_validation(runs: "Sequence[RunRecord]", law: str, options: "FitOptions | None" = None,
                           protocols: Sequence[str] = PROTOCOLS) -> list[dict[str, Any]]:
    """The validation table: one row per (protocol, tested size) with held-out metrics.

    A fit that cannot be made (too few runs below the tested size) gives a row with ``error``
    set and no metrics, rather than stopping the table.
    """
    import dataclasses

    from archsearch.laws.fit import FitOptions, fit_split

    opts = options or FitOptions()
    for p in protocols:
        if p not in PROTOCOLS:
            raise ArchsearchError("protocol", f"unknown protocol {p!r}", f"use one of {list(PROTOCOLS)}")
    # Validation refits many times: intervals are not needed, and each fit's own holdout is ours.
    opts = dataclasses.replace(opts, bootstrap=0, holdout_size=None)
    ok = [r for r in runs if r.status == "ok"]
    from archsearch.rundata import check_one_loss_kind

    check_one_loss_kind(ok)
    groups = size_groups(ok, opts.size_tolerance)
    if len(groups) < 2:
        raise ArchsearchError("data", f"validation needs at least 2 sizes, found {len(groups)}",
                              "add runs of another parameter budget")
    sizes = [float(np.exp(np.mean(np.log([ok[i].n_params for i in g])))) for g in groups]
    rows = []
    for protocol in protocols:
        for k in range(len(groups)):
            if protocol == "progressive":
                train_k = list(range(k))
            elif protocol == "previous-size":
                train_k = [k - 1] if k > 0 else []
            else:
                train_k = [j for j in range(len(groups)) if j != k]
            if not train_k:
                continue
            train = [ok[i] for j in train_k for i in groups[j]]
            test = [ok[i] for i in groups[k]]
            row: dict[str, Any] = {
                "protocol": protocol, "test_size": sizes[k],
                "train_sizes": [sizes[j] for j in train_k], "n_train": len(train),
                "n_test": len(test), "reference_at_test": None, "error": None}
            try:
                fit = fit_split(train, test, law, opts)
            except ArchsearchError as e:
                row["error"] = str(e)
                rows.append(row)
                continue
            m = fit.metrics.get("holdout") or {"n": 0}
            row.update({k2: m.get(k2) for k2 in ("mse", "r2", "mare", "spearman")})
            row["n_test"] = m.get("n", 0)
            row["reference_at_test"] = fit.metrics.get("reference_at_test")
            row["status"] = fit.status
            rows.append(row)
    return rows


def leave_one_size_out(runs: "Sequence[RunRecord]", law: str,
                       options: "FitOptions | None" = None) -> list[dict[str, Any]]:
    """The leave-one-size-out rows of :func:`progressive_validation`."""
    return progressive_validation(runs, law, options, protocols=("leave-one-size-out",))

"""How well a law extrapolates: the validation protocols (docs/method.md section 3), built on
:func:`archsearch.laws.fit.fit_split` and scored with :mod:`archsearch.laws.metrics`.

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

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from archsearch.errors import ArchsearchError
from archsearch.laws.fit import FitOptions, fit_split
from archsearch.laws.metrics import size_groups
from archsearch.rundata import check_one_loss_kind, check_run_table

if TYPE_CHECKING:
    from archsearch.rundata import RunRecord

PROTOCOLS = ("progressive", "previous-size", "leave-one-size-out")


def progressive_validation(runs: "Sequence[RunRecord]", law: str, options: FitOptions | None = None,
                           protocols: Sequence[str] = PROTOCOLS) -> list[dict[str, Any]]:
    """The validation table: one row per (protocol, tested size) with held-out metrics.

    A fit that cannot be made (too few runs below the tested size) gives a row with ``error``
    set and no metrics, rather than stopping the table.
    """
    opts = options or FitOptions()
    for p in protocols:
        if p not in PROTOCOLS:
            raise ArchsearchError("protocol", f"unknown protocol {p!r}", f"use one of {list(PROTOCOLS)}")
    # Validation refits many times: intervals are not needed, and each fit's own holdout is ours.
    opts = dataclasses.replace(opts, bootstrap=0, holdout_size=None)
    ok = [r for r in runs if r.status == "ok"]

    check_one_loss_kind(ok)
    check_run_table(ok)
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
            row.update({k2: m.get(k2) for k2 in ("mse", "r2", "mare", "rmsre", "spearman")})
            row["n_test"] = m.get("n", 0)
            row["reference_at_test"] = fit.metrics.get("reference_at_test")
            row["status"] = fit.status
            rows.append(row)
    return rows


def leave_one_size_out(runs: "Sequence[RunRecord]", law: str,
                       options: FitOptions | None = None) -> list[dict[str, Any]]:
    """The leave-one-size-out rows of :func:`progressive_validation`."""
    return progressive_validation(runs, law, options, protocols=("leave-one-size-out",))


def held_out_error(runs: "Sequence[RunRecord]", law: str, options: "FitOptions | None" = None) -> dict[str, Any]:
    """The law's error against trained models it was not fitted on: the last step of the
    progressive protocol (fit on every size below the largest, predict the largest), as a
    ``prediction_error`` entry of the law file: ``relative_sd`` is the root-mean-square relative
    error on the held-out size (it holds the runs' own seed noise too: a trained model has it).

    Where the law's Chinchilla reference cannot be fitted on the smaller sizes alone (fewer than
    5 (N, D) groups), the held-out size's L_opt is its own best run (``reference_at_test:
    observed``): the error of the architecture factors, which is what a target relative to a
    baseline of the same (N, D) depends on. Raises an error naming ``data`` with fewer than two sizes."""
    opts = dataclasses.replace(options or FitOptions(), bootstrap=0, holdout_size=None)
    ok = [r for r in runs if r.status == "ok"]
    groups = size_groups(ok, opts.size_tolerance)
    if len(groups) < 2:
        raise ArchsearchError("data", f"a held-out error needs runs of at least 2 sizes, found {len(groups)}",
                              "train proxies at a second, larger size (the law's error is then measured)")
    sizes = [float(np.exp(np.mean(np.log([ok[i].n_params for i in g])))) for g in groups]
    train = [ok[i] for g in groups[:-1] for i in g]
    test = [ok[i] for i in groups[-1]]
    note = None
    try:
        fit = fit_split(train, test, law, opts)
    except ArchsearchError as e:
        if e.field != "reference" or opts.reference == "best-observed":
            raise
        note = f"the Chinchilla reference could not be fitted on the smaller sizes ({e.problem})"
        fit = fit_split(train, test, law, dataclasses.replace(opts, reference="best-observed"))
    m = fit.metrics.get("holdout") or {}
    if not m.get("n"):
        raise ArchsearchError("data", "no run of the largest size is left to hold out (the r filter dropped them)",
                              "widen law.fit.r_range, or train the largest size inside it")
    source = (f"held out: the largest proxy size ({sizes[-1]:.3g}, {m['n']} runs) predicted by the law fitted "
              f"on the smaller sizes ({', '.join(f'{s:.3g}' for s in sizes[:-1])}; "
              f"{len(fit.dropped)} runs dropped by the r filter)")
    ref = fit.metrics.get("reference_at_test")
    if ref == "observed":
        source += "; L_opt at the held-out size is its best run, so this is the architecture factors' error"
    return {"relative_sd": m["rmsre"], "source": source + (f"; {note}" if note else ""),
            "protocol": "progressive (last step)", "test_size": sizes[-1], "train_sizes": sizes[:-1],
            "n": m["n"], "mare": m["mare"], "spearman": m.get("spearman"), "reference_at_test": ref}


# the held-out error a law may make and still be trusted to extrapolate: 1% of the loss, twice the
# 0.5% the published law files assume (docs/laws.md), so a fit as good as theirs passes with room
DEFAULT_MAX_MARE = 0.01


def validation_verdict(rows: list[dict[str, Any]], max_mare: float = DEFAULT_MAX_MARE) -> dict[str, Any]:
    """The validation's bottom line: whether the law predicts sizes it was not fitted on. It
    holds when every fitted row's mean absolute relative error is at most ``max_mare``;
    ``inconclusive`` when no row could be fitted. The line names the worst row."""
    fitted = [r for r in rows if not r.get("error") and r.get("mare") is not None]
    if not fitted:
        return {"verdict": "inconclusive", "max_mare": max_mare, "rows": len(rows), "fitted": 0,
                "line": f"verdict: inconclusive: none of the {len(rows)} rows could be fitted (add runs of more sizes)"}
    worst = max(fitted, key=lambda r: r["mare"])
    holds = worst["mare"] <= max_mare
    skipped = len(rows) - len(fitted)
    line = (f"verdict: the law {'holds' if holds else 'does NOT hold'} on held-out sizes: worst mean absolute "
            f"relative error {worst['mare']:.2%} ({worst['protocol']}, tested at N = {worst['test_size']:.3g}) "
            f"{'<=' if holds else '>'} {max_mare:.2%} (--max-mare), over {len(fitted)} fitted row(s)"
            + (f"; {skipped} row(s) could not be fitted" if skipped else ""))
    return {"verdict": "holds" if holds else "fails", "max_mare": max_mare, "worst": worst["mare"],
            "worst_protocol": worst["protocol"], "worst_test_size": worst["test_size"], "rows": len(rows),
            "fitted": len(fitted), "line": line}

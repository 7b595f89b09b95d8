"""Diagnostic figures of a fit, each as PNG and PDF (:mod:`archsearch.figures`).

* ``predicted_vs_actual.png``: fitted and held-out runs marked apart, with the y = x line and
  each set's R^2 (of the loss, as ``fit`` reports it).
* ``loss_vs_hidden_over_sqrt_n.png`` / ``loss_vs_r.png``: for a conditional law, the partial
  loss (the run's loss with the other factor and L_opt divided out, or subtracted for the
  additive form) against each variable, with the fitted U-curve and its minimum (the closed-form
  optimum, with its bootstrap interval where the fit has one); for the other laws, the loss
  against the variable; points coloured by model size N, held-out runs as crosses.
* ``residuals.png``: log residuals against N, hidden/sqrt(N) and r.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from archsearch.errors import ArchsearchError
from archsearch.figures import count, legend, log_axis, log_ticks, save, styled
from archsearch.laws.lawfile import reference_loss, run_arrays
from archsearch.laws.metrics import metrics
from archsearch.laws.registry import law_form
from archsearch.laws.solve import optimum

if TYPE_CHECKING:
    from archsearch.laws.lawfile import FitResult
    from archsearch.rundata import RunRecord


@styled
def write_plots(fit: "FitResult", fit_runs: Sequence["RunRecord"], holdout_runs: Sequence["RunRecord"],
                out_dir: str | Path, box: dict[str, tuple[float, float]] | None = None) -> list[Path]:
    """Write the diagnostic figures into ``out_dir``; returns the PNG paths. ``box``: the search
    box (``{"x1": (lo, hi), "x2": (lo, hi)}``, a study's ``search_space``), shaded on the factor
    plots; an optimum outside the runs' range is named as such, with how far."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rr = fit.options.get("r_range")

    def arrays(runs):
        if rr:
            runs = [r for r in runs if rr[0] <= r.mlp_to_attn_ratio <= rr[1]]
        if not runs:
            return None
        X, L = run_arrays(runs)
        if law_form(fit.law).conditional:
            X["Lref"] = reference_loss(fit.reference, X["N"], X["D"])
        return X, L, fit.predict_arrays(X)

    sets = [(name, arrays(r), c) for name, r, c in (("fit", fit_runs, "C0"), ("held out", holdout_runs, "C3"))]
    sets = [(n, a, c) for n, a, c in sets if a is not None]
    paths = []
    sizes = np.concatenate([a[0]["N"] for _, a, _ in sets])
    size_norm = LogNorm(sizes.min(), sizes.max() * (1.0001 if sizes.min() == sizes.max() else 1.0))

    fig, ax = plt.subplots(figsize=(5, 5))
    for name, (X, L, P), color in sets:
        r2 = metrics(L, P)["r2"]
        ax.scatter(L, P, s=14, color=color, alpha=0.8,
                   label=f"{name} ({L.size} runs, R^2 {r2:.3f})" if r2 is not None else f"{name} ({L.size} runs)")
    allv = np.concatenate([np.concatenate([a[1], a[2]]) for _, a, _ in sets])
    lim = [allv.min() * 0.98, allv.max() * 1.02]
    ax.plot(lim, lim, color="k", lw=0.8)
    ax.set(xlabel="actual loss", ylabel="predicted loss", title=f"{fit.law}: predicted vs actual",
           xlim=lim, ylim=lim)
    legend(ax)
    paths.append(save(fig, out / "predicted_vs_actual.png"))

    c = fit.coefficients
    best = _optimum(fit)
    for var, key, fname in (("hidden/sqrt(N)", "x1", "loss_vs_hidden_over_sqrt_n.png"),
                            ("r = mlp/attn", "x2", "loss_vs_r.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, (X, L, P), _color in sets:
            pts = ax.scatter(X[key], _partial(fit.law, c, X, L, key), s=22, c=X["N"], cmap="viridis",
                             norm=size_norm, marker="o" if name == "fit" else "x", label=name, alpha=0.9)
        log_ticks(fig.colorbar(pts, ax=ax, label="N (non-embedding parameters)").ax.yaxis, count)
        if law_form(fit.law).factor is not None:
            lo = min(a[0][key].min() for _, a, _ in sets) / 1.3
            hi = max(a[0][key].max() for _, a, _ in sets) * 1.3
            x_opt, iv = best.get(key, (None, None))
            if x_opt is not None:  # the curve reaches its minimum, even one outside the data
                lo, hi = min(lo, x_opt / 1.3), max(hi, x_opt * 1.3)
            xs = np.geomspace(lo, hi, 200)
            ax.plot(xs, _curve(fit.law, c, key, xs), color="k", lw=1.2, label="fitted factor")
            if box and box.get(key):
                ax.axvspan(*box[key], color="tab:green", alpha=0.10, lw=0,
                           label=f"search box [{box[key][0]:.3g}, {box[key][1]:.3g}]")
            d_lo = min(a[0][key].min() for _, a, _ in sets)
            d_hi = max(a[0][key].max() for _, a, _ in sets)
            if x_opt is not None and not d_lo <= x_opt <= d_hi:  # the data do not hold it: an extrapolation
                how = x_opt / d_hi if x_opt > d_hi else d_lo / x_opt
                ax.text(0.02, 0.02, f"optimum {how:.1f}x {'above' if x_opt > d_hi else 'below'} the runs' range "
                        f"[{d_lo:.3g}, {d_hi:.3g}]:\nthe fit's form, not the data, places it",
                        transform=ax.transAxes, fontsize=8, color="tab:red", va="bottom")
            if x_opt is not None:
                y_opt = float(_curve(fit.law, c, key, np.array([x_opt]))[0])
                if iv is not None:
                    ax.axvspan(iv[0], iv[1], color="tab:red", alpha=0.12, lw=0,
                               label=f"optimum's {best['level']:.0%} interval [{iv[0]:.3g}, {iv[1]:.3g}]")
                ax.axvline(x_opt, color="tab:red", ls="--", lw=1)
                ax.scatter([x_opt], [y_opt], marker="v", s=60, color="tab:red", zorder=5,
                           label=f"optimum {var} = {x_opt:.3g}")
            ylabel = "loss / (L_opt x other factor)" if law_form(fit.law).combine == "multiplicative" \
                else "loss - L_opt - other factor"
        else:
            ylabel = "loss"
        log_axis(ax, "x")
        ax.set(xlabel=var, ylabel=ylabel, title=f"{fit.law}: loss vs {var}")
        legend(ax)
        paths.append(save(fig, out / fname))

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for ax, (key, label) in zip(axes, (("N", "N (non-embedding)"), ("x1", "hidden/sqrt(N)"), ("x2", "r"))):
        for name, (X, L, P), color in sets:
            ax.scatter(X[key], np.log(P) - np.log(L), s=10, color=color, label=name, alpha=0.8)
        ax.axhline(0.0, color="k", lw=0.8)
        log_axis(ax, "x", count if key == "N" else None)
        ax.set(xlabel=label)
    axes[0].set_ylabel("log predicted - log actual")
    legend(axes[0])
    fig.suptitle(f"{fit.law}: residuals")
    paths.append(save(fig, out / "residuals.png"))
    return paths


def _optimum(fit: "FitResult") -> dict:
    """The closed-form optimum of each factor (``{"x1": (x*, interval), ...}``, the interval
    None without a bootstrap); empty for a law without one or a factor that is not U-shaped."""
    if law_form(fit.law).optimum is None:
        return {}
    try:
        o = optimum(fit, 1.0, 1.0)  # the shape optimum is the same at every N and D
    except ArchsearchError:
        return {}
    iv = o.interval or {}
    return {"x1": (o.hidden_over_sqrt_n, iv.get("hidden_over_sqrt_n")),
            "x2": (o.mlp_to_attn_ratio, iv.get("mlp_to_attn_ratio")), "level": iv.get("level", 0.9)}


def _partial(law, c, X, L, key):
    """The run's loss with everything but the factor in ``key`` taken out (conditional laws)."""
    form = law_form(law)
    if form.factor is None:
        return L
    other = "x2" if key == "x1" else "x1"
    if form.combine == "multiplicative":
        return L / (X["Lref"] * _curve(law, c, other, X[other]))
    return L - X["Lref"] - _curve(law, c, other, X[other])


def _curve(law, c, key, x):
    return law_form(law).factor(c, key, x)


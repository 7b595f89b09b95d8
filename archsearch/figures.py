"""One look for every figure archsearch writes: a shared style, readable log ticks, and a save
helper that writes each figure as PNG (for reports) and PDF (for papers). matplotlib is
imported only when a figure is drawn."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_open

F = TypeVar("F", bound=Callable[..., Any])

# Applied only while archsearch draws (rc_context), so a caller's own settings are untouched.
STYLE = {
    "font.family": "DejaVu Sans", "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10,
    "xtick.labelsize": 9, "ytick.labelsize": 9, "legend.fontsize": 8, "figure.titlesize": 12,
    "axes.grid": True, "grid.alpha": 0.25, "savefig.bbox": "tight", "pdf.fonttype": 42,
}


def styled(fn: F) -> F:
    """Run a drawing function with the Agg backend and :data:`STYLE`."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import matplotlib

        matplotlib.use("Agg")
        with matplotlib.rc_context(STYLE):
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


def count(v: float) -> str:
    """200000 -> '200K', 1.5e9 -> '1.5B': sizes and token counts on axes."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:g}{suffix}"
    return f"{v:g}"


def log_ticks(axis, fmt: Callable[[float], str] | None = None) -> None:
    """Label a log-scaled ``axis`` (``ax.xaxis``, a colorbar's ``ax.yaxis``) at 1, 2, 3, 5 x 10^k
    in plain numbers (0.2, 0.3, 1, 2 or 200K), not 2x10^-1; unlabelled minor ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fmt = fmt or (lambda v: f"{v:g}")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: fmt(v)))
    axis.set_minor_formatter(NullFormatter())


def log_axis(ax, axis: str = "x", fmt: Callable[[float], str] | None = None) -> None:
    """Put ``ax``'s ``axis`` on a log scale with :func:`log_ticks`."""
    getattr(ax, f"set_{axis}scale")("log")
    log_ticks(getattr(ax, f"{axis}axis"), fmt)


def draws_something(handle) -> bool:
    """Whether a legend handle (a line, a scatter, an error bar, a filled band, a patch) put any
    mark on the axes: a line of fewer than two finite points and no marker draws nothing, nor do
    a scatter or an error bar without finite points."""
    import numpy as np
    from matplotlib.collections import Collection, PathCollection
    from matplotlib.container import Container
    from matplotlib.lines import Line2D

    if isinstance(handle, Container):  # an error bar: its data line, caps and bars
        parts = [p for c in handle for p in (c if isinstance(c, (tuple, list)) else (c,)) if p is not None]
        return any(draws_something(p) for p in parts)
    if isinstance(handle, Line2D):
        x, y = (np.asarray(v, dtype=float) for v in handle.get_data())
        n = int(np.sum(np.isfinite(x) & np.isfinite(y))) if x.size and y.size else 0
        marker = handle.get_marker()
        has_marker = marker not in (None, "", " ", "None", "none")
        has_line = handle.get_linestyle() not in ("None", "none", "", " ")
        return handle.get_visible() and ((has_marker and n >= 1) or (has_line and n >= 2))
    if isinstance(handle, PathCollection):  # a scatter: its points
        offsets = np.asarray(handle.get_offsets(), dtype=float).reshape(-1, 2)
        return bool(np.isfinite(offsets).all(axis=1).any())
    if isinstance(handle, Collection):  # a filled band, error bars' lines: their paths
        return any(len(p.vertices) for p in handle.get_paths())
    return True


def legend(ax, **kwargs):
    """``ax.legend`` with only the entries that draw something on ``ax`` (:func:`draws_something`):
    an entry whose artist drew nothing (a one-point step line, an empty scatter) is left out; no
    legend at all when nothing is left."""
    handles, labels = ax.get_legend_handles_labels()
    kept = [(h, lab) for h, lab in zip(handles, labels) if draws_something(h)]
    if not kept:
        return None
    return ax.legend(*zip(*kept), **kwargs)


def figures_mode() -> str:
    """``ARCHSEARCH_FIGURES``: 'rendered' (the default) or 'unrendered'; any other value refused,
    naming the variable. The CLI checks it before any work; ``save`` reads it at each figure."""
    mode = os.environ.get("ARCHSEARCH_FIGURES", "rendered")
    if mode not in ("rendered", "unrendered"):
        raise ArchsearchError("ARCHSEARCH_FIGURES", f"{mode!r} is neither 'rendered' (the default) nor 'unrendered'",
                              "set one of them, or unset it; 'unrendered' builds each figure and writes a line naming it")
    return mode


def save(fig, png: str | Path, dpi: int = 150) -> Path:
    """Write ``fig`` as ``png`` and as the same name with ``.pdf``; close it; return the PNG path.

    With ``ARCHSEARCH_FIGURES=unrendered`` in the environment the figure is built (every plotting
    function runs on its data) but not rendered: each of the two files holds one line naming the
    figure instead. Rendering (font layout, PDF font subsetting) is most of a report's figure time;
    the tests whose subject is not the figures set it. Any other value than ``rendered`` (the
    default) or ``unrendered`` is refused, naming the variable."""
    import matplotlib.pyplot as plt

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = figures_mode()
    except ArchsearchError:
        plt.close(fig)
        raise
    if mode == "unrendered":
        for f in (png, png.with_suffix(".pdf")):
            with atomic_open(f, "wb") as fh:
                fh.write(f"figure not rendered (ARCHSEARCH_FIGURES=unrendered): {f.name}\n".encode())
        plt.close(fig)
        return png
    with atomic_open(png, "wb") as fh:  # a kill leaves the old figure or the new, never half
        fig.savefig(fh, format="png", dpi=dpi)
    with atomic_open(png.with_suffix(".pdf"), "wb") as fh:
        fig.savefig(fh, format="pdf")
    plt.close(fig)
    return png


@styled
def sweep_loss_curves(sweep_dir: str | Path) -> list[str]:
    """``SWEEP/plots/loss_curves.png`` (+ .pdf): every run's smoothed training loss against the
    tokens it has seen, read from its ``runs/<id>/metrics.jsonl``, with its held-out evaluations
    as dots; one panel per parameter budget, each run coloured by its d/sqrt(N) (from
    ``runs.csv``). Returns the files written ([] when no run logged a step)."""
    import csv
    import json

    import matplotlib.pyplot as plt

    sweep_dir = Path(sweep_dir)
    table = sweep_dir / "runs.csv"
    if not table.is_file():
        return []
    with open(table, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if (sweep_dir / "runs" / r["run_id"] / "metrics.jsonl").is_file()]
    curves = []
    for r in rows:
        run = sweep_dir / "runs" / r["run_id"]
        rec = json.loads((run / "run.json").read_text()) if (run / "run.json").is_file() else {}
        per_step = (rec.get("global_batch_size") or 1) * (rec.get("seq_len") or 1)
        steps, loss, evals = [], [], []
        for line in (run / "metrics.jsonl").read_text().splitlines():
            try:
                m = json.loads(line)
            except ValueError:  # a torn last line
                continue
            if m.get("smoothed_loss") is not None:
                steps.append(m["step"] * per_step)
                loss.append(m["smoothed_loss"])
            if m.get("eval_loss") is not None:
                evals.append((m["step"] * per_step, m["eval_loss"]))
        if steps:
            curves.append((float(r.get("requested_params") or 0), float(r.get("requested_hidden_over_sqrt_n") or 0),
                           r["run_id"], steps, loss, evals))
    if not curves:
        return []
    sizes = sorted({c[0] for c in curves})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False, sharey=True)
    xs = sorted({c[1] for c in curves})
    cmap = plt.get_cmap("viridis")
    for ax, n in zip(axes[0], sizes):
        for size, x, run_id, steps, loss, evals in (c for c in curves if c[0] == n):
            color = cmap(xs.index(x) / max(1, len(xs) - 1))
            ax.plot(steps, loss, color=color, lw=1, alpha=0.8)
            if evals:
                ax.plot(*zip(*evals), "o", color=color, ms=3)
        ax.set_title(f"N = {count(n)} ({sum(c[0] == n for c in curves)} runs)")
        ax.set_xlabel("tokens seen")
        log_axis(ax, "x", count)
    axes[0][0].set_ylabel("smoothed training loss (dots: held-out eval loss)")
    handles = [plt.Line2D([], [], color=cmap(i / max(1, len(xs) - 1)), label=f"d/sqrt(N) = {x:g}")
               for i, x in enumerate(xs)]
    axes[0][-1].legend(handles=handles, fontsize=8)
    fig.suptitle(f"sweep {sweep_dir.name}: loss curves")
    png = save(fig, sweep_dir / "plots" / "loss_curves.png", dpi=120)
    return [str(png), str(png.with_suffix(".pdf"))]

"""The method's solve step (docs/method.md section 4, step 2): the law's constrained problem,
``argmax_P I(P) s.t. L(P | N, D) <= L_t`` over (d/sqrt(N), r) at fixed ``n_layers``, solved on a
grid of the search box within the law's fitted range (:func:`archsearch.laws.solve`), with
``I(P)`` predicted by a roofline (or the deployment targets' predicted ratios). The search stage
(:data:`archsearch.search.stages.STAGES`) seeds the Optuna study with its solution
(:func:`seed_points`), which the study then measures; the config checks use the same solve
(:func:`solve_law`) to refuse a target no shape can reach."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from archsearch.arch import ArchSpec, hidden_over_sqrt_n, mlp_to_attn_ratio
from archsearch.benchmarks import BenchSettings, measure
from archsearch.benchmarks.calibration import Calibration
from archsearch.candidates import BuildSettings
from archsearch.hardware import local_device_name
from archsearch.laws import solve
from archsearch.logs import get_logger
from archsearch.search.config import StudyConfig
from archsearch.search.constraint import search_ranges
from archsearch.search.targets import predicted_ratio_fn

if TYPE_CHECKING:
    from archsearch.search.context import SearchContext


def box_grid(cfg: StudyConfig, n: int = 9, law=None):
    """A log-spaced grid over the search box (within the law's fitted range, as trials sample
    it), for scans of the law."""
    import numpy as np

    rng = search_ranges(cfg, law)
    return np.geomspace(*rng["hidden_over_sqrt_n"][0], n), np.geomspace(*rng["mlp_to_attn"][0], n)


def solve_law(cfg: StudyConfig, law, target_loss: float, build: BuildSettings, throughput_fn=None):
    """The law's constrained solution over the search box (laws.solve on the box grid, at the
    GQA the local search starts from): returns (the solution, that GQA)."""
    s = cfg.search_space
    g0 = cfg.gqa_search.baseline_gqa if cfg.gqa_search.baseline_gqa in cfg.gqa_values else cfg.gqa_values[0]
    return solve(law, cfg.params, cfg.tokens, cfg.n_layers, target_loss, throughput_fn,
                 gqa=g0, head_dim=s.head_dim, build=build, grid=box_grid(cfg, law=law),
                 within=None if cfg.law.allow_extrapolation else law.shape_range()), g0


def seed_points(ctx: SearchContext) -> list[dict[str, Any]]:
    """The law's solution as starting points: the loss-optimal shape (closed form when the law
    has an interior optimum, else the scan's lowest loss), then the feasible shapes the law and
    an analytic throughput predictor rank highest (docs/method.md section 4, stage 3: search)."""
    cfg = ctx.cfg
    if cfg.optuna.enqueue_solution <= 0:  # the sampler starts on its own
        return []
    ranges = search_ranges(cfg, ctx.law)  # the box within the law's fitted range
    box1, box2 = ranges["hidden_over_sqrt_n"][0], ranges["mlp_to_attn"][0]
    clip = lambda v, lo_hi: min(max(v, lo_hi[0]), lo_hi[1])  # noqa: E731
    if ctx.targets and cfg.optuna.enqueue_solution > 1:  # the targets' aggregate predicted ratio
        tf = predicted_ratio_fn(ctx)
    else:
        device = ranking_device(cfg) if cfg.optuna.enqueue_solution > 1 else None
        tf = analytic_throughput_fn(ctx, device) if device else None
    res, g0 = solve_law(cfg, ctx.law, ctx.target_loss, ctx.build, tf)
    if res.optimum is not None:
        best = (res.optimum.hidden_over_sqrt_n, res.optimum.mlp_to_attn_ratio)
    else:
        p = min((p for p in res.points if p.predicted_loss is not None), key=lambda p: p.predicted_loss)
        best = (p.hidden_over_sqrt_n, p.mlp_to_attn_ratio)
    points = [{"hidden_over_sqrt_n": clip(best[0], box1), "mlp_to_attn": clip(best[1], box2), "gqa": g0}]
    ranked = sorted((p for p in res.feasible if p.throughput is not None), key=lambda p: -p.throughput)
    for p in ranked[: max(0, cfg.optuna.enqueue_solution - 1)]:
        points.append({"hidden_over_sqrt_n": clip(p.hidden_over_sqrt_n, box1),
                       "mlp_to_attn": clip(p.mlp_to_attn_ratio, box2), "gqa": g0})
    for pt in points:  # onto the sampling grid, so enqueued values are valid choices
        for name, ((lo, hi), step) in ranges.items():
            if step:
                k = min(max(round((pt[name] - lo) / step), 0), math.floor((hi - lo) / step + 1e-9))
                pt[name] = lo + k * step
    return points


def seed_shape_points(ctx: SearchContext) -> list[tuple[str, dict[str, Any]]]:
    """Each seeded published shape (``optuna.seed_shapes``) with the knobs its trial records: its
    realised d/sqrt(N), r and GQA on the sampling grid and in the box (the sampler learns from
    them; the trial measures the shape itself, :func:`archsearch.search.objective.trial_spec`)."""
    ranges = search_ranges(ctx.cfg, ctx.law)
    out = []
    for spec in ctx.study.seed_shapes:
        pt: dict[str, Any] = {"hidden_over_sqrt_n": hidden_over_sqrt_n(spec), "mlp_to_attn": mlp_to_attn_ratio(spec)}
        for name, ((lo, hi), step) in ranges.items():
            v = min(max(pt[name], lo), hi)
            if step:
                v = lo + min(max(round((v - lo) / step), 0), math.floor((hi - lo) / step + 1e-9)) * step
            pt[name] = v
        out.append((spec.name, {**pt, "gqa": spec.gqa}))
    return out


def ranking_device(cfg: StudyConfig) -> str | None:
    """The device whose roofline ranks the seed shapes: the one the study names
    (``measure.bench.device_spec``), else the one its measurements run on (the local GPU, or this CPU
    where there is none). None, with a message, for a GPU the table does not know: then only the
    law's optimum seeds the study."""
    if cfg.measure.bench.device_spec:
        return cfg.measure.bench.device_spec
    name = local_device_name()
    if name is None:
        get_logger("search").warning("[search] this GPU is not in the device table: seeds are not ranked by a "
                                     "roofline (set measure.bench.device_spec to rank them)")
    return name


def calibration_label(path: str) -> str:
    """A calibration file as reports name it: the file, its device and engine, what it was fitted on."""
    return Calibration.load(path).describe(path)


def analytic_throughput_fn(ctx: SearchContext, device: str):
    """Predicted throughput at the reference batch size from ``device``'s roofline (ranking only)."""
    m = ctx.cfg.measure
    settings = BenchSettings(backend="analytic", batch_sizes=[ctx.ref_batch], input_len=m.bench.input_len,
                             output_len=m.bench.output_len, warmup=0, repeats=1, device_spec=device,
                             engine_args={"calibration": m.calibration} if m.calibration else {})

    def fn(spec: ArchSpec) -> float | None:  # at the measured scale, as the shapes are measured
        return measure(ctx.study.measured(spec), settings).throughput(ctx.ref_batch)
    return fn

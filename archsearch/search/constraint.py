"""The loss constraint a shape must meet, ``L(P | N, D) <= L_t`` (docs/method.md section 4): its
predicted loss at the study's budget, the bound compared with the target (with ``target.confidence``
a chance constraint, :mod:`archsearch.search.margins`), the refusals outside the law's fitted range
or the GQA bounds, and the knobs' ranges within that range. The Optuna objective, the law's solve
step, the GQA search and the report all judge a shape by these."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from archsearch.arch import ArchSpec
from archsearch.search import margins
from archsearch.search.config import StudyConfig, gqa_bound_violation

if TYPE_CHECKING:
    from archsearch.search.context import SearchContext
    from archsearch.search.resolved import ResolvedStudy


def predict_loss(ctx: SearchContext, spec: ArchSpec) -> tuple[float, tuple[float, float] | None]:
    """Predicted loss (and bootstrap interval) of a shape's ratios at the study's N and D: every
    shape, candidate or baseline, is compared at one budget (snapping moves each one's own N)."""
    loss = float(ctx.law.predict(spec, ctx.cfg.tokens, params=ctx.cfg.params))
    interval = ctx.law.predict_interval(spec, ctx.cfg.tokens, params=ctx.cfg.params)
    return loss, (tuple(float(v) for v in interval) if interval is not None else None)


def loss_bound(ctx: SearchContext, spec: ArchSpec) -> float:
    """What the target is compared with: the predicted loss, or with ``target.confidence`` c
    the loss the shape stays under with probability c, the law's bootstrap and its own error
    against trained models together (a chance constraint, :mod:`archsearch.search.margins`).
    Infinite for a shape outside the law's fitted range unless ``law.allow_extrapolation``."""
    if out_of_range(ctx, spec):
        return math.inf
    c = ctx.cfg.target.confidence
    if c is None:
        return float(ctx.law.predict(spec, ctx.cfg.tokens, params=ctx.cfg.params))
    return margins.upper_bound(ctx.law, spec, ctx.cfg.tokens, ctx.cfg.params, c)


def out_of_range(ctx: SearchContext, spec: ArchSpec) -> str | None:
    """Why ``spec`` is refused as outside the law's fitted range (None: inside, or allowed)."""
    return None if ctx.cfg.law.allow_extrapolation else margins.outside_range(ctx.law, spec)


def outside_gqa_bounds(study: ResolvedStudy, spec: ArchSpec) -> str | None:
    """Why ``spec``'s head pair is refused by the GQA bounds (None: within them). The bounds are
    the local GQA search's (``gqa_search.bounds``): where no proxy checks what GQA does to loss,
    the search samples no shape the walk could not admit, so its best trial is one the walk
    starts from rather than one it must discard."""
    max_gqa, min_kv, why = study.cfg.gqa_search.bounds(bool(study.sweeps))
    beyond = gqa_bound_violation(spec.n_heads // spec.n_kv_heads, spec.n_kv_heads, max_gqa, min_kv)
    return f"{beyond} ({why})" if beyond else None


def loss_margin(ctx: SearchContext, spec: ArchSpec) -> dict[str, Any]:
    """The shape's margin to the target and its verdict (``margins.margin``), marked
    ``extrapolated`` where it lies outside the law's fitted range."""
    m = margins.margin(ctx.law, spec, ctx.cfg.tokens, ctx.cfg.params, ctx.target_loss,
                       ctx.cfg.target.confidence).to_dict()
    outside = margins.outside_range(ctx.law, spec)
    if outside:
        m["extrapolated"] = outside
    return m


def search_ranges(cfg: StudyConfig, law=None) -> dict[str, Any]:
    """The knobs' sampling ranges: the search box, within the law's fitted range unless
    ``law.allow_extrapolation`` (a trial outside it would only be refused)."""
    s = cfg.search_space
    allow = cfg.law.allow_extrapolation or law is None
    return {"hidden_over_sqrt_n": (margins.search_box(s.hidden_over_sqrt_n, law, "hidden_over_sqrt_n", allow),
                                   s.hidden_over_sqrt_n_step or None),
            "mlp_to_attn": (margins.search_box(s.mlp_to_attn, law, "mlp_to_attn", allow), s.mlp_to_attn_step or None)}

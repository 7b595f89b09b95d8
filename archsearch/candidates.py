"""Candidate construction: a few primary knobs -> one concrete, buildable :class:`ArchSpec`.

The search samples (N, n_layers, d/sqrt(N), r, GQA, head_dim); :func:`build_candidate` is the
one deterministic function that expands them (docs/method.md section 2):

1. ``hidden_size = snap(x1 * sqrt(N), hidden_multiple)``.
2. Per layer the budget is ``N / n_layers``; attention gets the share ``1 / (1 + r)``.
   Attention params per layer are ``2 * d * head_dim * n_kv * (gqa + 1)``, which fixes the
   number of KV heads up to rounding. As in the method, ``head_dim`` is fixed and the head
   count moves: heads need not divide the width (hidden 2560 with 72 heads of 64 is normal).
   Of the two KV counts around the ideal one, the one whose realised r is nearest the request
   among those that meet the budget (step 4) once the MLP is snapped.
3. The MLP takes what is left of the per-layer budget: ``ffn = snap(rest / (3 d), ffn_multiple)``.
4. The realised N must be within ``tolerance`` of the budget, and the realised r within
   ``r_tolerance`` of the request: beyond it the shape is refused (``on_r_drift: refuse``) or
   built with a warning (``flag``). The realised values are reported next to the requested ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from archsearch.arch import (MAX_HIDDEN, MAX_LAYERS, SUPPORTED_HEAD_DIMS, ArchSpec, describe,
                             hidden_over_sqrt_n, mlp_to_attn_ratio, non_embedding_params)
from archsearch.errors import ArchsearchError


@dataclass(frozen=True)
class BuildSettings:
    """How sizes are snapped and how close to the budget a candidate must land."""

    hidden_multiple: int = 64
    ffn_multiple: int = 64
    tolerance: float = 0.02
    r_tolerance: float = 0.10  # max relative drift of the realised r from the requested one
    on_r_drift: str = "refuse"  # or "flag": build it, with a warning on the candidate
    vocab_size: int = 32000
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    family: str = "llama"

    def __post_init__(self) -> None:
        for f in ("hidden_multiple", "ffn_multiple", "vocab_size", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ArchsearchError(f, f"must be positive, got {getattr(self, f)}")
        if not 0 < self.tolerance < 1:
            raise ArchsearchError("tolerance", f"must be in (0, 1), got {self.tolerance}",
                                  "0.02 means the realised N is within 2% of the budget")
        if not 0 < self.r_tolerance < 10:
            raise ArchsearchError("r_tolerance", f"must be in (0, 10), got {self.r_tolerance}",
                                  "0.10 means the realised r is within 10% of the requested r")
        if self.on_r_drift not in ("refuse", "flag"):
            raise ArchsearchError("on_r_drift", f"{self.on_r_drift!r} is unknown", "use refuse or flag")


@dataclass(frozen=True)
class Candidate:
    """A built spec with what was asked for and what was realised."""

    spec: ArchSpec
    requested: dict[str, float] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def realised(self) -> dict[str, float]:
        return {
            "params": non_embedding_params(self.spec),
            "hidden_over_sqrt_n": hidden_over_sqrt_n(self.spec),
            "mlp_to_attn_ratio": mlp_to_attn_ratio(self.spec),
            "gqa": self.spec.gqa,
        }

    @property
    def param_error(self) -> float:
        return non_embedding_params(self.spec) / self.requested["params"] - 1.0

    @property
    def r_drift(self) -> float:
        """Realised r relative to the requested r, minus one."""
        return mlp_to_attn_ratio(self.spec) / self.requested["mlp_to_attn_ratio"] - 1.0

    @property
    def x1_drift(self) -> float:
        """Realised d/sqrt(N) relative to the requested one, minus one."""
        return hidden_over_sqrt_n(self.spec) / self.requested["hidden_over_sqrt_n"] - 1.0

    def to_dict(self, dtype: str = "bfloat16") -> dict[str, Any]:
        d = describe(self.spec, dtype)
        d["requested"] = dict(self.requested)
        d["realised"] = self.realised
        d["param_error"] = self.param_error
        d["r_drift"] = self.r_drift
        d["hidden_over_sqrt_n_drift"] = self.x1_drift
        if self.warnings:
            d["warnings"] = list(self.warnings)
        return d


# 1e14 parameters are 200 TB of bf16 weights: beyond any training cluster's memory. Larger
# budgets are typos (1e30), refused before any work.
MAX_PARAMS = 1e14


def _snap(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


# Beyond these a request is a typo, not a model: 10T non-embedding parameters is several times
# the largest dense model trained (MAX_LAYERS, MAX_HIDDEN: see archsearch.arch).
MAX_PARAMS = 1e13


def check_size(params: float, n_layers: int | None = None) -> None:
    """Refuse a parameter budget or depth beyond any buildable model (cheap, up front)."""
    if not (isinstance(params, (int, float)) and math.isfinite(params) and params > 0):
        raise ArchsearchError("params", f"must be a positive finite number, got {params!r}")
    if params > MAX_PARAMS:
        raise ArchsearchError("params", f"{params:.3g} is beyond any buildable model",
                              f"give a budget up to {MAX_PARAMS:.0e} (e.g. 1e9 or 1B)")
    if n_layers is not None and not (isinstance(n_layers, int) and 0 < n_layers <= MAX_LAYERS):
        raise ArchsearchError("layers", f"must be an integer in [1, {MAX_LAYERS}], got {n_layers!r}")


def check_build_request(params: float, n_layers: int, hidden_over_sqrt_n: float,
                        mlp_to_attn: float) -> None:
    """Refuse absurd or non-finite knobs from arithmetic alone, before any shape is searched."""
    for name, v in (("params", params), ("hidden_over_sqrt_n", hidden_over_sqrt_n),
                    ("mlp_to_attn", mlp_to_attn)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise ArchsearchError(name, f"must be a positive finite number, got {v!r}")
    check_size(params, n_layers)
    if hidden_over_sqrt_n * math.sqrt(params) > MAX_HIDDEN:
        raise ArchsearchError("hidden_over_sqrt_n", f"{hidden_over_sqrt_n} x sqrt(N) gives a hidden size "
                              f"of {hidden_over_sqrt_n * math.sqrt(params):.3g}",
                              f"keep the hidden size under {MAX_HIDDEN:,} (typical: 0.03-0.12)")


def box_shape_bound(params: float, n_layers: int, hidden_over_sqrt_n: tuple[float, float],
                    mlp_to_attn: tuple[float, float], gqas: list[int], head_dim: int,
                    settings: BuildSettings | None = None) -> int:
    """At most how many distinct shapes :func:`build_candidate` can give over a box of knobs.

    Its arithmetic, enumerated: the hidden size is a snapped multiple, a monotone step in
    d/sqrt(N), so the box's widths are the multiples between its ends' snaps; at one width and GQA,
    r only moves the ideal KV-head count between its values at the box's r ends, and the builder
    takes its floor or ceiling, which fixes the FFN. Every (width, GQA, KV count) whose shape meets
    the budget within the tolerance is counted, so the true number is at most this."""
    s = settings or BuildSettings()
    lo_d = _snap(hidden_over_sqrt_n[0] * math.sqrt(params), s.hidden_multiple)
    hi_d = _snap(hidden_over_sqrt_n[1] * math.sqrt(params), s.hidden_multiple)
    per_layer = params / n_layers
    count = 0
    for d in range(lo_d, hi_d + 1, s.hidden_multiple):
        for gqa in set(gqas):
            attn_per_kv = 2 * d * head_dim * (gqa + 1)
            kv_lo = per_layer / (1.0 + mlp_to_attn[1]) / attn_per_kv
            kv_hi = per_layer / (1.0 + mlp_to_attn[0]) / attn_per_kv
            for n_kv in range(max(1, math.floor(kv_lo)), max(1, math.ceil(kv_hi)) + 1):
                rest = per_layer - attn_per_kv * n_kv
                if rest <= 0:
                    continue
                ffn = _snap(rest / (3 * d), s.ffn_multiple)
                n = n_layers * (attn_per_kv * n_kv + 3 * d * ffn)
                count += abs(n / params - 1) <= s.tolerance
    return count


def build_candidate(params: float, n_layers: int, hidden_over_sqrt_n: float,
                    mlp_to_attn: float, gqa: int = 4, head_dim: int = 64,
                    settings: BuildSettings | None = None, name: str | None = None) -> Candidate:
    """Expand the primary knobs into a buildable spec (see the module docstring)."""
    check_build_request(params, n_layers, hidden_over_sqrt_n, mlp_to_attn)
    s = settings or BuildSettings()
    if not (params > 0 and math.isfinite(params)):
        raise ArchsearchError("params", f"must be a positive finite number, got {params}")
    if params > MAX_PARAMS:
        raise ArchsearchError("params", f"{params:.3g} parameters need {2 * params:.3g} bytes of bf16 weights, "
                              f"beyond any cluster (over {MAX_PARAMS:.0e} parameters)", "e.g. 1e9 or 1B")
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
        raise ArchsearchError("layers", f"must be a positive integer, got {n_layers!r}")
    if not (hidden_over_sqrt_n > 0 and math.isfinite(hidden_over_sqrt_n)):
        raise ArchsearchError("hidden_over_sqrt_n", f"must be a positive finite number, got {hidden_over_sqrt_n}")
    if not (mlp_to_attn > 0 and math.isfinite(mlp_to_attn)):
        raise ArchsearchError("mlp_to_attn", f"must be a positive finite number, got {mlp_to_attn}")
    if isinstance(gqa, bool) or not isinstance(gqa, int) or gqa <= 0:
        raise ArchsearchError("gqa", f"must be a positive integer, got {gqa!r}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ArchsearchError("head_dim", f"{head_dim} is not supported by the attention kernels",
                              f"use one of {list(SUPPORTED_HEAD_DIMS)}")

    d = _snap(hidden_over_sqrt_n * math.sqrt(params), s.hidden_multiple)
    per_layer = params / n_layers
    attn_per_kv = 2 * d * head_dim * (gqa + 1)  # attention params per layer per KV head
    ideal_kv = per_layer / (1.0 + mlp_to_attn) / attn_per_kv
    options = []
    for n_kv in sorted({max(1, math.floor(ideal_kv)), max(1, math.ceil(ideal_kv))}):
        rest = per_layer - attn_per_kv * n_kv
        if rest <= 0:
            continue
        ffn = _snap(rest / (3 * d), s.ffn_multiple)
        r = 3 * d * ffn / (attn_per_kv * n_kv)
        n = n_layers * (attn_per_kv * n_kv + 3 * d * ffn)
        # within the budget first: the KV count nearer in r may miss N by the FFN snapping
        options.append((abs(n / params - 1) > s.tolerance, abs(r / mlp_to_attn - 1), abs(n / params - 1), n_kv, ffn))
    if not options:
        raise ArchsearchError(
            "params", f"budget {params:.4g} leaves no room for an MLP with {n_layers} layers, "
            f"hidden size {d} and {gqa + 1} heads of {head_dim}",
            "raise the budget, or lower layers / hidden_over_sqrt_n / head_dim")
    *_, n_kv, ffn = min(options)
    n_heads = n_kv * gqa
    spec = ArchSpec(n_layers=n_layers, hidden_size=d, n_heads=n_heads, n_kv_heads=n_kv,
                    head_dim=head_dim, ffn=ffn, vocab_size=s.vocab_size,
                    tie_embeddings=s.tie_embeddings,
                    max_position_embeddings=s.max_position_embeddings,
                    rope_theta=s.rope_theta, family=s.family, name=name)
    cand = Candidate(spec=spec, requested={
        "params": float(params), "hidden_over_sqrt_n": float(hidden_over_sqrt_n),
        "mlp_to_attn_ratio": float(mlp_to_attn), "gqa": gqa, "head_dim": head_dim,
        "n_layers": n_layers})
    if abs(cand.param_error) > s.tolerance:
        raise ArchsearchError(
            "params", f"no shape meets the budget {params:.4g} within {s.tolerance:.1%}: the "
            f"closest is {non_embedding_params(spec):.4g} ({cand.param_error:+.1%}) with "
            f"hidden {d}, {n_heads}x{head_dim} heads, ffn {ffn}",
            "raise the tolerance, use smaller snapping multiples, or change layers/head_dim")
    if abs(cand.r_drift) > s.r_tolerance:
        msg = (f"realised r {mlp_to_attn_ratio(spec):.3g} is {cand.r_drift:+.1%} off the requested "
               f"{mlp_to_attn:.3g} (head granularity: {n_heads}+{n_kv} heads of {head_dim} at width {d})")
        if s.on_r_drift == "refuse":
            raise ArchsearchError("mlp_to_attn", msg, f"raise r_tolerance ({s.r_tolerance:g}), set "
                                  "on_r_drift: flag, or use a smaller head_dim / ffn_multiple")
        cand = dataclasses.replace(cand, warnings=(msg,))
    return cand

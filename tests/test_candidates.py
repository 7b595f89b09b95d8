"""Candidate construction from (N, L, d/sqrt(N), r, GQA, head_dim)."""

from __future__ import annotations

import math

import pytest

from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio, non_embedding_params
from archsearch.candidates import BuildSettings, build_candidate
from archsearch.errors import ArchsearchError


@pytest.mark.parametrize("n, layers, x1, r, gqa, hd", [
    (1e9, 16, 0.066, 4.8, 4, 64),
    (1e9, 16, 0.09, 1.0, 8, 64),
    (3e9, 28, 0.058, 3.0, 4, 128),
    (150e6, 12, 0.06, 2.0, 2, 64),
    (80e6, 10, 0.08, 3.0, 1, 64),
])
def test_build_meets_budget_and_ratios(n, layers, x1, r, gqa, hd):
    c = build_candidate(n, layers, x1, r, gqa=gqa, head_dim=hd)
    s = c.spec
    assert abs(non_embedding_params(s) / n - 1) <= 0.02
    assert s.hidden_size % 64 == 0 and s.ffn % 64 == 0
    assert s.gqa == gqa and s.head_dim == hd and s.n_layers == layers
    # d snapped to the nearest multiple of 64 of x1*sqrt(N)
    assert s.hidden_size == round(x1 * math.sqrt(n) / 64) * 64
    assert c.realised["hidden_over_sqrt_n"] == pytest.approx(hidden_over_sqrt_n(s))
    # the realised r is near the requested one: within the head-count rounding
    assert abs(mlp_to_attn_ratio(s) - r) / r < 0.35
    assert c.requested["mlp_to_attn_ratio"] == r


def test_deterministic():
    a = build_candidate(5e8, 12, 0.07, 3.0, gqa=4)
    b = build_candidate(5e8, 12, 0.07, 3.0, gqa=4)
    assert a.spec == b.spec


def test_snapping_settings():
    c = build_candidate(1e9, 16, 0.066, 4.0, settings=BuildSettings(hidden_multiple=128, ffn_multiple=256))
    assert c.spec.hidden_size % 128 == 0 and c.spec.ffn % 256 == 0


@pytest.mark.parametrize("kw, field", [
    (dict(params=-1), "params"),
    (dict(gqa=0), "gqa"),
    (dict(head_dim=40), "head_dim"),
    (dict(mlp_to_attn=0), "mlp_to_attn"),
    (dict(n_layers=0), "layers"),
])
def test_bad_knobs(kw, field):
    args = dict(params=1e8, n_layers=8, hidden_over_sqrt_n=0.07, mlp_to_attn=3.0)
    args.update(kw)
    with pytest.raises(ArchsearchError) as e:
        build_candidate(**args)
    assert e.value.field == field


def test_budget_unreachable():
    # a tiny budget with a wide model: heads alone overshoot, no room for an MLP
    with pytest.raises(ArchsearchError) as e:
        build_candidate(2e5, 8, 0.5, 3.0, gqa=4, head_dim=64)
    assert e.value.field == "params"
    # tolerance too tight for the snapping
    with pytest.raises(ArchsearchError, match="within"):
        build_candidate(1e6, 2, 0.1, 3.0, gqa=1, head_dim=32, settings=BuildSettings(tolerance=1e-6))


@pytest.mark.parametrize("x1, r, gqa", [(0.15, 0.7, 2), (0.15, 2.0, 2), (0.3, 4.5, 4), (0.5, 1.0, 1)])
def test_heads_divide_hidden_size(x1, r, gqa):
    # transformers' LlamaConfig rejects hidden_size % n_heads != 0: the constructor must not emit it
    c = build_candidate(2e5, 2, x1, r, gqa=gqa, head_dim=32,
                        settings=BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.2))
    assert c.spec.hidden_size % c.spec.n_heads == 0


def test_spec_rejects_heads_not_dividing_width():
    from archsearch.arch import ArchSpec

    with pytest.raises(ArchsearchError) as e:
        ArchSpec(n_layers=2, hidden_size=32, n_heads=10, n_kv_heads=5, head_dim=32, ffn=64)
    assert e.value.field == "n_heads"

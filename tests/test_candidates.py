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


def test_method_shapes_heads_need_not_divide_width():
    # docs/method.md section 2: head_dim fixed, the head count moves to reach r, e.g. hidden 2560 with 72 heads
    # of 64 and 18 KV heads (2560 % 72 != 0)
    c = build_candidate(1e9, 16, 2560 / math.sqrt(1e9), 1.12, gqa=4, head_dim=64)
    s = c.spec
    assert (s.hidden_size, s.n_heads, s.n_kv_heads) == (2560, 72, 18)
    assert s.hidden_size % s.n_heads != 0
    assert abs(c.r_drift) < 0.05 and abs(c.param_error) <= 0.02


@pytest.mark.parametrize("n, layers, x1, r, gqa, hd", [
    (1e9, 16, 0.066, 4.8, 4, 64), (1e9, 16, 0.11, 0.6, 8, 64), (3e9, 28, 0.058, 3.0, 4, 128),
    (3e9, 28, 0.09, 1.0, 2, 128), (150e6, 12, 0.06, 2.0, 2, 64),
])
def test_realised_r_is_the_nearest_head_count(n, layers, x1, r, gqa, hd):
    c = build_candidate(n, layers, x1, r, gqa=gqa, head_dim=hd)
    # one KV head more or fewer (MLP refilled) would not land closer to the requested r
    for dk in (-1, 1):
        kv = c.spec.n_kv_heads + dk
        if kv < 1:
            continue
        attn = 2 * c.spec.hidden_size * hd * kv * (gqa + 1)
        rest = n / layers - attn
        if rest <= 0:
            continue
        ffn = max(64, round(rest / (3 * c.spec.hidden_size) / 64) * 64)
        assert abs(3 * c.spec.hidden_size * ffn / attn / r - 1) >= abs(c.r_drift) - 1e-12
    assert c.to_dict()["r_drift"] == pytest.approx(mlp_to_attn_ratio(c.spec) / r - 1)


def test_kv_count_within_budget_preferred():
    # 1B, GQA 16, wide and attention-heavy: the KV count nearest in r misses the budget by the
    # FFN snapping (+2.0%), the other lands inside it; the shape must build, not be refused
    st = BuildSettings(hidden_multiple=128, ffn_multiple=256, on_r_drift="flag")
    c = build_candidate(1e9, 16, 0.1125, 0.5, gqa=16, head_dim=64, settings=st)
    assert abs(c.param_error) <= st.tolerance


def test_r_drift_refused_or_flagged():
    # a tiny shape: one head pair is a large share of attention, so r cannot be hit closely
    kw = dict(params=2e5, n_layers=2, hidden_over_sqrt_n=0.15, mlp_to_attn=0.7, gqa=2, head_dim=32)
    coarse = dict(hidden_multiple=32, ffn_multiple=32, tolerance=0.2)
    with pytest.raises(ArchsearchError) as e:
        build_candidate(**kw, settings=BuildSettings(**coarse))
    assert e.value.field == "mlp_to_attn" and "r_tolerance" in e.value.fix
    c = build_candidate(**kw, settings=BuildSettings(**coarse, on_r_drift="flag"))
    assert abs(c.r_drift) > 0.10 and c.warnings and "off the requested" in c.warnings[0]
    assert build_candidate(**kw, settings=BuildSettings(**coarse, r_tolerance=0.5)).warnings == ()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_knobs(bad):
    for kw in (dict(params=bad), dict(hidden_over_sqrt_n=bad), dict(mlp_to_attn=bad)):
        args = {**dict(params=1e8, n_layers=8, hidden_over_sqrt_n=0.07, mlp_to_attn=3.0), **kw}
        with pytest.raises(ArchsearchError):
            build_candidate(**args)

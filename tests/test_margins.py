"""Honest margins: the loss constraint with the law's own error, the law's fitted range, the
published law files' error and range, and the data each training needs against its source."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from archsearch.candidates import build_candidate
from archsearch.errors import ArchsearchError
from archsearch.laws import FitOptions, fit_law, load_law
from archsearch.laws.lawfile import FitResult
from archsearch.search import margins

REPO = Path(__file__).resolve().parent.parent
COEF = {"a0": 1.0651, "a1": 0.05, "a2": 0.005, "b0": 0.9153, "b1": 0.05, "b2": 0.1}


def hand_law(**extra) -> FitResult:
    return FitResult.from_dict({"law": "conditional-multiplicative", "coefficients": COEF, "L_opt": 3.0, **extra})


@pytest.fixture(scope="module")
def spec():
    return build_candidate(4e5, 2, 0.12, 2.0, gqa=1, head_dim=32).spec


# -- the chance constraint with the law's error -------------------------------------------------

@pytest.mark.parametrize("sd,verdict", [(0.005, margins.WITHIN), (0.0, margins.CLEARS), (None, margins.CLEARS)])
def test_a_small_margin_is_within_the_law_error_only_when_the_law_has_one(spec, sd, verdict):
    law = hand_law(**({} if sd is None else {"prediction_error": {"relative_sd": sd, "source": "test"}}))
    pred = law.predict(spec, 8e6, params=4e5)
    target = pred / (1 - 0.0003)  # the shape clears it by 0.03%
    m = margins.margin(law, spec, 8e6, 4e5, target)
    assert m.margin == pytest.approx(0.0003)
    assert m.verdict == verdict
    if sd:  # no bootstrap: P = Phi(margin / sd), exactly
        assert m.p_within_target == pytest.approx(norm.cdf((target - pred) / (sd * pred)), rel=1e-12)
        assert m.resolvable == pytest.approx(norm.ppf(0.9) * sd * pred / target)
        assert "within the law's error" in margins.describe_margin(m.to_dict())
    else:
        assert m.p_within_target == 1.0
    # far beyond the error the margin is resolved either way
    assert margins.margin(law, spec, 8e6, 4e5, pred * 1.05).verdict == margins.CLEARS
    assert margins.margin(law, spec, 8e6, 4e5, pred * 0.95).verdict == margins.MISSES


def test_the_bound_adds_the_law_error_to_the_bootstrap(spec):
    law = hand_law(prediction_error={"relative_sd": 0.01, "source": "test"})
    pred = law.predict(spec, 8e6, params=4e5)
    # law error alone: the normal quantile
    assert margins.upper_bound(law, spec, 8e6, 4e5, 0.9) == pytest.approx(pred * (1 + 0.01 * norm.ppf(0.9)), rel=1e-9)
    # a bootstrap alone: its empirical quantile (the old chance constraint, unchanged)
    rng = np.random.default_rng(0)
    boot = {"n": 200, "names": list(COEF), "coefficients": [
        [v * (1 + 0.01 * rng.standard_normal()) for v in COEF.values()] for _ in range(200)]}
    only_boot = hand_law(bootstrap=boot)
    samples = only_boot.bootstrap_predictions({"N": np.array([4e5]), "D": np.array([8e6]),
                                               **{k: v for k, v in _x(spec).items()}})[:, 0]
    assert margins.upper_bound(only_boot, spec, 8e6, 4e5, 0.9) == pytest.approx(np.quantile(samples, 0.9))
    assert margins.upper_bound(only_boot, spec, 8e6, 4e5, 0.9) == pytest.approx(
        only_boot.predict_interval(spec, 8e6, level=0.8, params=4e5)[1])
    # both: wider than either, and its P at the bound is the level
    both = hand_law(bootstrap=boot, prediction_error={"relative_sd": 0.01, "source": "test"})
    b = margins.upper_bound(both, spec, 8e6, 4e5, 0.9)
    assert b > margins.upper_bound(only_boot, spec, 8e6, 4e5, 0.9) and b > margins.upper_bound(law, spec, 8e6, 4e5, 0.9)
    assert margins.distribution(both, spec, 8e6, 4e5).p_below(b) == pytest.approx(0.9, abs=1e-9)
    with pytest.raises(ArchsearchError) as e:
        margins.upper_bound(hand_law(), spec, 8e6, 4e5, 0.9)
    assert e.value.field == "target.confidence"


def _x(spec):
    from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio

    return {"x1": np.array([hidden_over_sqrt_n(spec)]), "x2": np.array([mlp_to_attn_ratio(spec)]),
            "R": np.array([spec.hidden_size / spec.n_layers], dtype=float)}


# -- the fitted range -------------------------------------------------------------------------

def test_range_refuses_outside_and_narrows_the_search_box(spec):
    from archsearch.arch import mlp_to_attn_ratio

    r = mlp_to_attn_ratio(spec)
    inside = hand_law(fitted_range={"hidden_over_sqrt_n": None, "mlp_to_attn": [0.5, 5.0], "source": "test"})
    outside = hand_law(fitted_range={"hidden_over_sqrt_n": None, "mlp_to_attn": [0.5, r * 0.99], "source": "test"})
    assert margins.outside_range(inside, spec) is None
    why = margins.outside_range(outside, spec)
    assert why and "r = " in why and "outside" in why
    assert margins.search_box((0.5, 5.0), outside, "mlp_to_attn", allow=False) == (0.5, pytest.approx(r * 0.99))
    assert margins.search_box((0.5, 5.0), outside, "mlp_to_attn", allow=True) == (0.5, 5.0)
    assert margins.search_box((0.03, 0.12), outside, "hidden_over_sqrt_n", allow=False) == (0.03, 0.12)  # not stated
    with pytest.raises(ArchsearchError) as e:
        margins.search_box((6.0, 8.0), outside, "mlp_to_attn", allow=False)
    assert e.value.field == "search_space.mlp_to_attn" and "allow_extrapolation" in e.value.fix


def test_study_refuses_out_of_range_shapes_unless_extrapolation_is_allowed(tmp_path, spec):
    from archsearch.search.constraint import loss_bound, loss_margin, out_of_range
    from archsearch.search.context import SearchContext
    from archsearch.search.resolved import derive
    from archsearch.search.solution import seed_points
    from tests.test_search import LAW, load, study_config

    law = {**LAW, "fitted_range": {"hidden_over_sqrt_n": [0.1, 0.3], "mlp_to_attn": [0.7, 1.5], "source": "test"}}
    for allow in (False, True):
        raw = study_config(tmp_path, law={"allow_extrapolation": allow})
        Path(raw["law"]["file"]).write_text(json.dumps(law))
        cfg = load(raw)
        fit = load_law(cfg.law.file)
        ctx = SearchContext(study=derive(cfg), law=fit, target_loss=10.0, measurer=None, out=tmp_path)
        far = build_candidate(4e5, 2, 0.12, 2.0, gqa=1, head_dim=32).spec
        assert bool(out_of_range(ctx, far)) is not allow
        assert math.isinf(loss_bound(ctx, far)) is not allow
        assert ("extrapolated" in loss_margin(ctx, far))  # marked either way
        seeds = seed_points(ctx)
        assert all(0.7 <= s["mlp_to_attn"] <= 1.5 for s in seeds) or allow


def test_solve_keeps_the_scan_and_optimum_inside_the_range():
    from archsearch.laws.solve import solve

    law = hand_law()  # r* = b2/b1 = 2
    within = {"hidden_over_sqrt_n": None, "mlp_to_attn": [0.5, 1.5], "source": "test"}
    res = solve(law, 4e5, 8e6, 2, None, gqa=1, head_dim=32, within=within)
    from archsearch.arch import mlp_to_attn_ratio

    assert res.points and all(mlp_to_attn_ratio(p.spec) <= 1.5 for p in res.points)
    assert mlp_to_attn_ratio(res.architecture.spec) <= 1.5
    assert any("outside the law's fitted range" in n for n in res.notes)


# -- law files: error and range ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["paper-1b", "paper-3b"])
def test_published_law_files_state_error_and_range(name):
    law = load_law(REPO / "configs" / "laws" / f"{name}.json")
    assert law.prediction_error["relative_sd"] == 0.005 and law.prediction_error["source"]
    rng = law.shape_range()
    # the dissertation's span over its Table C.1 models (issue #37), which holds the paper's own
    # Table 1 models (0.058-0.082) and the baselines
    assert rng["mlp_to_attn"] == [0.5, 5.0] and rng["hidden_over_sqrt_n"] == [0.042, 0.34] and rng["source"]
    assert "Table C.1" in rng["source"]


@pytest.mark.parametrize("extra,field", [
    ({"prediction_error": {"relative_sd": 0.005}}, "prediction_error.source"),
    ({"prediction_error": {"relative_sd": -1, "source": "x"}}, "prediction_error.relative_sd"),
    ({"fitted_range": {"mlp_to_attn": [0.5, 5], "source": "x"}}, "fitted_range.hidden_over_sqrt_n"),
    ({"fitted_range": {"hidden_over_sqrt_n": None, "mlp_to_attn": [5, 0.5], "source": "x"}}, "fitted_range.mlp_to_attn"),
    ({"fitted_range": {"hidden_over_sqrt_n": None, "mlp_to_attn": [0.5, 5]}}, "fitted_range.source"),
])
def test_bad_error_or_range_fields_name_the_field(extra, field):
    with pytest.raises(ArchsearchError) as e:
        hand_law(**extra)
    assert e.value.field.endswith(field)


def test_a_law_without_error_or_range_states_its_default(tmp_path):
    law = hand_law()
    assert margins.law_error(law) is None and law.shape_range() is None
    assert "not checked" in margins.range_summary(law, allow=False)["rule"]
    # round trip keeps both fields
    full = hand_law(prediction_error={"relative_sd": 0.01, "source": "s"},
                    fitted_range={"hidden_over_sqrt_n": [0.1, 0.2], "mlp_to_attn": None, "source": "t"})
    full.save(tmp_path / "l.json")
    back = load_law(tmp_path / "l.json")
    assert back.prediction_error == full.prediction_error and back.shape_range() == full.shape_range()


def test_a_fitted_law_knows_its_range_and_its_held_out_error():
    from archsearch.laws.diagnostics import held_out_error
    from archsearch.laws.fit import fit_split
    from archsearch.laws.synthetic import synthetic_runs

    runs = synthetic_runs("conditional-multiplicative", {"a0": 1.1763, "a1": 0.05, "a2": 0.004, "b0": 0.9661,
                                                         "b1": 0.02, "b2": 0.04}, (2e7, 4e7, 8e7), tokens_per_param=(20, 100),
                          hidden_over_sqrt_n=(0.05, 0.08, 0.12), mlp_to_attn=(0.4, 1.0, 2.0, 4.0), noise=0.004, seed=3)
    opts = FitOptions(n_starts=3, reference="best-observed")
    fit = fit_law(runs, "conditional-multiplicative", opts)
    rng = fit.shape_range()
    assert rng["mlp_to_attn"] == fit.data_ranges["mlp_to_attn_ratio"] and rng["mlp_to_attn"][0] >= 0.5  # after the r filter
    err = held_out_error(runs, "conditional-multiplicative", opts)
    # exactly the RMS relative error of the largest size predicted by the law of the smaller ones
    small = [r for r in runs if r.n_params < 6e7]
    large = [r for r in runs if r.n_params >= 6e7 and 0.5 <= r.mlp_to_attn_ratio <= 5.0]
    from archsearch.laws.lawfile import run_arrays

    X, y = run_arrays(large)
    pred = fit_split(small, large, "conditional-multiplicative", opts).predict_arrays(X)
    assert err["relative_sd"] == pytest.approx(float(np.sqrt(np.mean(((pred - y) / y) ** 2))), rel=1e-9)
    assert err["n"] == len(large) and 0.0005 < err["relative_sd"] < 0.03 and "held out" in err["source"]
    # a Chinchilla reference needs 5 (N, D) groups, the two smaller sizes have 4: the held-out
    # size's L_opt is then its best run, and the source says so
    chin = held_out_error(runs, "conditional-multiplicative", FitOptions(n_starts=3))
    assert chin["relative_sd"] == pytest.approx(err["relative_sd"]) and "could not be fitted" in chin["source"]
    with pytest.raises(ArchsearchError) as e:
        held_out_error(small[:12], "conditional-multiplicative", opts)
    assert e.value.field == "data"


# -- the data each training needs ------------------------------------------------------------------

def test_3b_final_run_from_a_100b_source_is_refused_unless_repetition_is_allowed():
    from archsearch.search.checks import check_data_budgets, data_budgets
    from archsearch.search.config import load_study_config

    path = REPO / "configs" / "paper-3b.yaml"
    small = ["final_train.data={source: 'hf:HuggingFaceFW/fineweb-edu:sample-100BT', "
             "tokenizer: meta-llama/Llama-3.2-1B, seq_len: 2048}"]
    cfg = load_study_config(path, small + ["final_train.enabled=true"])
    final = next(b for b in data_budgets(cfg) if b["what"] == "the final run")
    assert final["tokens_needed"] == 3e11 and final["tokens_available"] == 1e11 and final["status"] == "refused"
    with pytest.raises(ArchsearchError) as e:
        check_data_budgets(cfg)
    assert e.value.field == "final_train.data.max_epochs" and "3.00 passes" in e.value.problem
    # repetition allowed: passes, and says it repeats
    ok = load_study_config(path, small + ["final_train.enabled=true", "final_train.data.max_epochs=3"])
    assert next(b for b in check_data_budgets(ok) if b["what"] == "the final run")["status"] == "repeats"
    # disabled: reported, not refused
    off = load_study_config(path, small)
    assert next(b for b in check_data_budgets(off) if b["what"] == "the final run")["runs"] is False
    # the shipped config names a source that holds the final run in one pass
    shipped = next(b for b in data_budgets(load_study_config(path)) if b["what"] == "the final run")
    assert shipped["status"] == "ok"


def test_proxy_budgets_are_checked_and_an_unknown_hub_source_is_stated(tmp_path):
    import yaml

    from archsearch.search.checks import check_data_budgets, data_budgets
    from archsearch.search.config import load_study_config

    path = REPO / "configs" / "paper-3b.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["proxy"]["sweeps"][0]["train"]["tokens_per_param"] = 1000  # 297M x 1000 = 3e11 from 1e11
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_study_config(tmp_path / "c.yaml")
    with pytest.raises(ArchsearchError) as e:
        check_data_budgets(cfg)
    assert e.value.field == "proxy.sweeps[0].data.max_epochs"
    unknown = load_study_config(path, ["final_train.data={source: 'hf:someone/unlisted', "
                                       "tokenizer: meta-llama/Llama-3.2-1B, seq_len: 2048}"])
    final = next(b for b in data_budgets(unknown) if b["what"] == "the final run")
    assert final["status"] == "unknown" and final["tokens_available"] is None and "unknown" in final["verdict"]


def test_dry_run_flags_the_final_run(capsys):
    from archsearch.cli import main

    rc = main(["search", "--config", str(REPO / "configs" / "paper-3b.yaml"), "--dry-run",
               "final_train.data={source: 'hf:HuggingFaceFW/fineweb-edu:sample-100BT', "
               "tokenizer: meta-llama/Llama-3.2-1B, seq_len: 2048}"])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(x for x in out.splitlines() if "data check: the final run" in x)
    assert "REFUSED" in line and "not enabled" in line and "3e+11" in line


def test_the_report_states_margins_and_the_range(tmp_path):
    import csv

    from archsearch.search import pipeline
    from tests.test_search import LAW, load, study_config

    raw = study_config(tmp_path, optuna={"n_shapes": 3, "seed": 1, "enqueue_solution": 1},
                       gqa_search={"enabled": False})
    law = {**LAW, "prediction_error": {"relative_sd": 0.5, "source": "a test law that resolves nothing"},
           "fitted_range": {"hidden_over_sqrt_n": None, "mlp_to_attn": [0.7, 2.5], "source": "test"}}
    Path(raw["law"]["file"]).write_text(json.dumps(law))
    cfg = load(raw)
    s = pipeline.run(cfg, cfg.out_dir(), progress=False)
    assert s["loss_margins"]["law_error"]["relative_sd"] == 0.5 and s["loss_margins"]["range"]["mlp_to_attn"] == [0.7, 2.5]
    assert s["chosen"]["loss_margin"]["verdict"] == margins.WITHIN  # a 50% error resolves no margin
    assert all(p["loss_margin"]["verdict"] == margins.WITHIN for p in s["pareto"])
    assert all(0.7 <= p["knobs"]["mlp_to_attn"] <= 2.5 for p in s["pareto"])  # the sampler stayed in range
    report = (cfg.out_dir() / "report.md").read_text()
    assert "within the law's error of the target" in report and "margin to target" in report
    assert "fitted range: d/sqrt(N) not stated, r [0.7, 2.5] (test); shapes outside it are refused" in report
    with open(cfg.out_dir() / "trials.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["state"] == "COMPLETE"]
    assert rows and all(r["margin_verdict"] == margins.WITHIN for r in rows)


def test_an_estimated_source_size_is_flagged_not_refused(tmp_path):
    from archsearch.search.checks import check_data_budgets
    from tests.test_search import load, study_config

    sweep = {"name": "p", "params": [4.0e5], "hidden_over_sqrt_n": [0.2], "mlp_to_attn": [1.0], "gqa": 1,
             "train": {"tokens_per_param": 20}}  # 8e6 tokens: more than Shakespeare's bytes / 4
    cfg = load(study_config(tmp_path, vocab_size=None, law={"file": None, "fit": {"reference": "best-observed"}},
                            proxy={"sweep": sweep}))
    (b,) = check_data_budgets(cfg)
    assert b["status"] == "over (estimate)" and b["epochs"] > 1 and "estimate" in b["verdict"]

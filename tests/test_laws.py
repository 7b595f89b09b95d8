"""Scaling laws: parameter recovery, Jacobians, closed-form optimum, bootstrap coverage, law
files, solve, validation, and the CLI. Synthetic runs are real buildable specs
(archsearch.laws.synthetic uses build_candidate), so N, r and hidden/sqrt(N) are derived."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from archsearch.cli import main
from archsearch.errors import ArchsearchError
from archsearch.laws import FitOptions, fit_law, load_law, optimum, progressive_validation, solve
from archsearch.laws import forms
from archsearch.laws.lawfile import run_arrays
from archsearch.laws.synthetic import TRUE_CHINCHILLA, synthetic_runs
from archsearch.rundata import RunRecord, write_runs

SIZES = (2e7, 4e7, 8e7, 1.6e8, 3.2e8)
X1_STAR, R_STAR = 0.08, 2.0
X1_GRID = (0.04, 0.06, 0.08, 0.11, 0.16)
R_GRID = (0.8, 1.4, 2.5, 4.0)


def mult_truth(a1=0.05, b1=0.02):
    """Multiplicative coefficients with min f = min g = 1 at (X1_STAR, R_STAR)."""
    return {"a0": 1 - a1 * (1 + math.log(X1_STAR)), "a1": a1, "a2": a1 * X1_STAR,
            "b0": 1 - b1 * (1 + math.log(R_STAR)), "b1": b1, "b2": b1 * R_STAR}


def add_truth(a1=0.25, b1=0.1, excess=0.02):
    return {"a0": excess - a1 * (1 + math.log(X1_STAR)) - b1 * (1 + math.log(R_STAR)), "a1": a1,
            "a2": a1 * X1_STAR, "b1": b1, "b2": b1 * R_STAR}


@pytest.fixture(scope="module")
def mult_runs():
    return synthetic_runs("conditional-multiplicative", mult_truth(), SIZES, tokens_per_param=(20, 100),
                          hidden_over_sqrt_n=X1_GRID, mlp_to_attn=R_GRID, noise=0.003, seed=1)


@pytest.fixture(scope="module")
def mult_fit(mult_runs):
    return fit_law(mult_runs, "conditional-multiplicative", FitOptions(bootstrap=40, n_starts=6))


# -- the parametrisations -------------------------------------------------------------------

@pytest.mark.parametrize("law,tied", [("chinchilla", True), ("aspect-ratio", True), ("aspect-ratio", False),
                                      ("conditional-multiplicative", True), ("conditional-additive", True)])
def test_jacobians_match_finite_differences(law, tied, mult_runs):
    X, L = run_arrays(mult_runs[:40])
    X["Lref"] = forms.predict("chinchilla", TRUE_CHINCHILLA, X)
    form = forms.get_form(law, tied)
    nm = forms.Norm.of(X)
    rng = np.random.default_rng(0)
    box = np.array(form.start_box(X, L))
    th = rng.uniform(box[:, 0], box[:, 1])
    th[1] = max(th[1], 0.05)  # keep slopes off zero so every column is exercised
    y, J = form.logpred(th, X, nm)
    for i in range(th.size):
        e = np.zeros_like(th)
        e[i] = 1e-6
        fd = (form.logpred(th + e, X, nm)[0] - form.logpred(th - e, X, nm)[0]) / 2e-6
        np.testing.assert_allclose(J[:, i], fd, rtol=1e-4, atol=1e-7, err_msg=form.names[i])


@pytest.mark.parametrize("law", ["chinchilla", "aspect-ratio", "conditional-multiplicative",
                                 "conditional-additive"])
def test_coefficients_and_theta_round_trip(law, mult_runs):
    X, L = run_arrays(mult_runs)
    X["Lref"] = forms.predict("chinchilla", TRUE_CHINCHILLA, X)
    form = forms.get_form(law)
    nm = forms.Norm.of(X)
    box = np.array(form.start_box(X, L))
    th = box.mean(axis=1) + 0.01
    c = form.to_coefficients(th, nm)
    np.testing.assert_allclose(np.exp(form.logpred(th, X, nm)[0]), forms.predict(law, c, X), rtol=1e-10)
    np.testing.assert_allclose(form.from_coefficients(c, nm), th, rtol=1e-8, atol=1e-10)


# -- parameter recovery (tolerances stated per law) ------------------------------------------

def test_n_only_rows_fit_chinchilla_and_are_refused_by_shape_laws(tmp_path):
    # published scaling tables give N, D and loss only
    runs = synthetic_runs("chinchilla", TRUE_CHINCHILLA, (1e7, 4e7, 1.6e8, 6.4e8), tokens_per_param=(10, 40, 160),
                          hidden_over_sqrt_n=(0.08,), mlp_to_attn=(2.5,), noise=0.002, seed=5)
    path = tmp_path / "n_only.csv"
    path.write_text("params,tokens,loss\n" + "".join(f"{r.n_params},{r.tokens},{r.loss}\n" for r in runs))
    from archsearch.rundata import read_runs

    rows = read_runs(path)
    assert not rows[0].has_arch and rows[0].n_params == runs[0].n_params
    a = fit_law(rows, "chinchilla").coefficients
    b = fit_law(runs, "chinchilla").coefficients
    assert all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a)  # the same fit as with the shapes
    with pytest.raises(ArchsearchError) as e:
        fit_law(rows, "conditional-multiplicative")
    assert e.value.field.endswith(".params") and "chinchilla" in e.value.fix
    with pytest.raises(ArchsearchError, match="neither"):
        RunRecord(tokens=1e9, loss=3.0)
    with pytest.raises(ArchsearchError, match="disagrees"):
        RunRecord.from_arch(runs[0].spec, 1e9, 3.0, params=2 * runs[0].n_params)


def test_recover_chinchilla():
    """18 runs, 6 sizes x 3 token budgets, 0.3% noise: exponents within 0.03, E within 10%."""
    runs = synthetic_runs("chinchilla", TRUE_CHINCHILLA, (1e7, 2e7, 4e7, 8e7, 1.6e8, 3.2e8),
                          tokens_per_param=(10, 40, 160), hidden_over_sqrt_n=(0.08,), mlp_to_attn=(2.5,),
                          noise=0.003, seed=3)
    fit = fit_law(runs, "chinchilla")
    c = fit.coefficients
    assert abs(c["alpha"] - 0.34) < 0.03 and abs(c["beta"] - 0.30) < 0.03
    assert abs(c["E"] / 1.8 - 1) < 0.10
    true = forms.predict("chinchilla", TRUE_CHINCHILLA, {"N": np.array([1e9]), "D": np.array([2e10])})[0]
    pred = forms.predict("chinchilla", c, {"N": np.array([1e9]), "D": np.array([2e10])})[0]
    assert abs(pred / true - 1) < 0.02  # 3x beyond the largest size
    assert fit.metrics["fit"]["r2"] > 0.99


def test_recover_aspect_ratio_tied_and_free():
    """Tied exponent within 0.03 and eps within 35%; the free fit predicts within 1% in range."""
    truth = dict(TRUE_CHINCHILLA, alpha=0.32, beta=0.32, gamma=0.32, eps=0.03)
    runs = synthetic_runs("aspect-ratio", truth, (1e7, 4e7, 1.6e8, 6.4e8), tokens_per_param=(10, 40, 160),
                          hidden_over_sqrt_n=(0.04, 0.08, 0.16), mlp_to_attn=(2.5,), noise=0.003, seed=4)
    fit = fit_law(runs, "aspect-ratio")
    c = fit.coefficients
    assert c["alpha"] == c["beta"] == c["gamma"]
    assert abs(c["alpha"] - 0.32) < 0.03
    assert abs(c["eps"] / 0.03 - 1) < 0.35
    free = fit_law(runs, "aspect-ratio", FitOptions(tie_exponents=False))
    assert free.metrics["fit"]["mare"] < 0.01


@pytest.mark.parametrize("reference", ["chinchilla", "best-observed"])
def test_recover_conditional_multiplicative(mult_runs, reference):
    """200 runs, 0.3% noise: x1* within 5%, r* within 10%, a1 within 20%."""
    fit = fit_law(mult_runs, "conditional-multiplicative", FitOptions(reference=reference, n_starts=6))
    o = optimum(fit, 1e9, 2e10)
    assert abs(o.hidden_over_sqrt_n / X1_STAR - 1) < 0.05
    assert abs(o.mlp_to_attn_ratio / R_STAR - 1) < 0.10
    assert abs(fit.coefficients["a1"] / 0.05 - 1) < 0.20
    assert fit.status in ("ok", "warnings") and fit.metrics["fit"]["mare"] < 0.006
    # the runs deepen with N: the fit names the depths it pooled (no law reads depth beyond N)
    assert fit.data_ranges["n_layers"] == [8.0, 12.0]


def test_recover_conditional_additive():
    runs = synthetic_runs("conditional-additive", add_truth(), SIZES, tokens_per_param=(20, 100),
                          hidden_over_sqrt_n=X1_GRID, mlp_to_attn=R_GRID, noise=0.003, seed=5)
    fit = fit_law(runs, "conditional-additive", FitOptions(reference_law=TRUE_CHINCHILLA, n_starts=6))
    o = optimum(fit, 1e9, 2e10)
    assert abs(o.hidden_over_sqrt_n / X1_STAR - 1) < 0.05
    assert abs(o.mlp_to_attn_ratio / R_STAR - 1) < 0.10
    assert abs(fit.coefficients["a1"] / 0.25 - 1) < 0.20


def test_levenberg_marquardt_matches(mult_runs):
    fit = fit_law(mult_runs, "conditional-multiplicative", FitOptions(method="lm", reference_law=TRUE_CHINCHILLA))
    assert fit.coefficients["b0"] == 1.0  # LM fixes the scale degeneracy with b0 = 1
    o = optimum(fit, 1e9, 2e10)
    assert abs(o.hidden_over_sqrt_n / X1_STAR - 1) < 0.05 and abs(o.mlp_to_attn_ratio / R_STAR - 1) < 0.10


# -- optimum and bootstrap -------------------------------------------------------------------

def test_closed_form_optimum_is_the_numeric_minimum(mult_fit):
    from scipy.optimize import minimize

    c = mult_fit.coefficients
    lref = mult_fit.reference_loss(1e9, 2e10)

    def loss(z):
        X = {"x1": np.array([math.exp(z[0])]), "x2": np.array([math.exp(z[1])]), "Lref": np.array([lref])}
        return forms.predict("conditional-multiplicative", c, X)[0]

    res = minimize(loss, [math.log(0.05), math.log(1.0)], method="Nelder-Mead",
                   options={"xatol": 1e-10, "fatol": 1e-14, "maxiter": 5000})
    o = optimum(mult_fit, 1e9, 2e10)
    assert math.exp(res.x[0]) == pytest.approx(o.hidden_over_sqrt_n, rel=1e-4)
    assert math.exp(res.x[1]) == pytest.approx(o.mlp_to_attn_ratio, rel=1e-4)
    assert res.fun == pytest.approx(o.loss, rel=1e-9)


def test_bootstrap_intervals_cover_the_truth():
    """90% intervals of x1* and r* contain the truth in at least 6 of 8 seeded repetitions."""
    hits = 0
    for seed in range(8):
        runs = synthetic_runs("conditional-multiplicative", mult_truth(), (2e7, 8e7, 3.2e8),
                              hidden_over_sqrt_n=X1_GRID, mlp_to_attn=R_GRID, noise=0.004, seed=100 + seed)
        fit = fit_law(runs, "conditional-multiplicative",
                      FitOptions(bootstrap=60, n_starts=3, seed=seed, reference_law=TRUE_CHINCHILLA))
        iv = optimum(fit, 1e9, 2e10).interval
        hits += (iv["hidden_over_sqrt_n"][0] <= X1_STAR <= iv["hidden_over_sqrt_n"][1]
                 and iv["mlp_to_attn_ratio"][0] <= R_STAR <= iv["mlp_to_attn_ratio"][1])
    assert hits >= 6


def test_prediction_interval_and_bootstrap_is_seeded(mult_runs, mult_fit):
    spec = mult_runs[7].spec
    lo, hi = mult_fit.predict_interval(spec, 2e10)
    assert lo < mult_fit.predict(spec, 2e10) < hi
    again = fit_law(mult_runs, "conditional-multiplicative", FitOptions(bootstrap=40, n_starts=6))
    assert again.bootstrap["coefficients"] == mult_fit.bootstrap["coefficients"]
    # two spawned processes give the same resamples, row for row, as one (where two CPUs are usable)
    from archsearch.laws.fit import usable_cpus

    if usable_cpus() >= 2:
        in_two = fit_law(mult_runs, "conditional-multiplicative", FitOptions(bootstrap=40, n_starts=6, n_jobs=2))
        assert in_two.bootstrap["coefficients"] == mult_fit.bootstrap["coefficients"]
    no_boot = fit_law(mult_runs[:60], "conditional-multiplicative", FitOptions(reference_law=TRUE_CHINCHILLA))
    assert no_boot.predict_interval(spec, 2e10) is None


# -- law files -------------------------------------------------------------------------------

def test_law_file_round_trip(tmp_path, mult_runs, mult_fit):
    path = mult_fit.save(tmp_path / "law.json")
    back = load_law(path)
    spec = mult_runs[3].spec
    assert back.predict(spec, 3e9) == mult_fit.predict(spec, 3e9)
    assert back.predict_interval(spec, 3e9) == mult_fit.predict_interval(spec, 3e9)
    assert back.to_dict() == json.loads(path.read_text())


def test_hand_written_law_without_reference(tmp_path):
    c = mult_truth()
    (tmp_path / "h.json").write_text(json.dumps({"law": "conditional-multiplicative", "coefficients": c}))
    fit = load_law(tmp_path / "h.json")
    o = optimum(fit, 1e9, 2e10)
    assert o.hidden_over_sqrt_n == pytest.approx(X1_STAR) and o.mlp_to_attn_ratio == pytest.approx(R_STAR)
    assert o.loss is None and "no reference" in o.note
    with pytest.raises(ArchsearchError) as e:
        fit.reference_loss(1e9, 2e10)
    assert e.value.field == "reference"
    withref = fit.with_reference({"law": "chinchilla", "coefficients": TRUE_CHINCHILLA})
    assert optimum(withref, 1e9, 2e10).loss == pytest.approx(
        forms.predict("chinchilla", TRUE_CHINCHILLA, {"N": np.array([1e9]), "D": np.array([2e10])})[0])


@pytest.mark.parametrize("data,field", [
    ({"law": "conditional-mult", "coefficients": {}}, "law"),
    ({"law": "chinchilla", "coefficients": {"E": 1, "A": 1, "alpha": 0.3, "B": 1}}, "coefficients.beta"),
    ({"law": "chinchilla", "coefficients": {"E": 1, "A": 1, "alpha": 0.3, "B": 1, "beta": "x"}}, "coefficients.beta"),
    ({"law": "chinchilla", "coefficients": {"E": 1, "A": 1, "alpha": 0.3, "B": 1, "beta": 0.3, "k": 1}},
     "coefficients.k"),
    ({"law": "chinchilla", "coeficients": {}}, "coeficients"),
    ({"law": "conditional-additive", "coefficients": add_truth(), "L_opt": -1}, "L_opt"),
])
def test_bad_law_files(tmp_path, data, field):
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ArchsearchError) as e:
        load_law(tmp_path / "bad.json")
    assert e.value.field.endswith(field)


# -- bad input -------------------------------------------------------------------------------

def test_bad_inputs(mult_runs):
    with pytest.raises(ArchsearchError) as e:
        fit_law(mult_runs[:4], "conditional-multiplicative", FitOptions(reference_law=TRUE_CHINCHILLA))
    assert e.value.field == "data" and "5 parameters" in e.value.problem
    with pytest.raises(ArchsearchError) as e:
        fit_law(mult_runs, "conditional-multiplicative", FitOptions(r_range=(10.0, 20.0)))
    assert e.value.field == "r_range"
    with pytest.raises(ArchsearchError) as e:
        fit_law(mult_runs, "kaplan")
    assert e.value.field == "law"
    with pytest.raises(ArchsearchError) as e:
        fit_law(mult_runs[:30], "conditional-multiplicative")  # one (N, D) group: no Chinchilla L_opt
    assert e.value.field == "reference"
    with pytest.raises(ArchsearchError) as e:
        FitOptions(method="adam")
    assert e.value.field == "method"


def test_best_observed_reference_only_where_observed(mult_runs):
    fit = fit_law(mult_runs, "conditional-multiplicative", FitOptions(reference="best-observed", n_starts=3))
    spec = mult_runs[0].spec
    fit.predict(spec, mult_runs[0].tokens)  # observed (N, D): fine
    with pytest.raises(ArchsearchError) as e:
        fit.predict(spec, mult_runs[0].tokens * 7)
    assert e.value.field == "reference"
    assert fit.with_reference(TRUE_CHINCHILLA).predict(spec, mult_runs[0].tokens * 7) > 0


# -- warnings --------------------------------------------------------------------------------

def test_warnings_flag_bad_fits(mult_runs):
    flat = synthetic_runs("conditional-multiplicative", mult_truth(a1=0.0), SIZES[:2],
                          hidden_over_sqrt_n=X1_GRID, mlp_to_attn=R_GRID, noise=0.002, seed=7)
    fit = fit_law(flat, "conditional-multiplicative", FitOptions(reference_law=TRUE_CHINCHILLA, n_starts=4))
    assert any("parameter at a bound" in w and "a1" in w for w in fit.warnings)
    assert fit.status == "warnings"
    # a reference with the wrong N exponent leaves a trend in log N the calibration cannot absorb
    wrong = dict(TRUE_CHINCHILLA, alpha=0.25, A=80.0)
    fit = fit_law(mult_runs, "conditional-multiplicative", FitOptions(reference_law=wrong, n_starts=3))
    assert any("residual trend" in w and "log N" in w for w in fit.warnings)
    few = synthetic_runs("chinchilla", TRUE_CHINCHILLA, (1e7, 4e7, 1.6e8, 6.4e8), hidden_over_sqrt_n=(0.08,),
                         mlp_to_attn=(2.5,), seed=2)
    few += [dataclasses.replace(r, seed=r.seed + 1) for r in few]  # a second seed of each (a copied row is refused)
    fit = fit_law(few, "chinchilla", FitOptions(n_starts=12))
    assert any("D/N constant" in w for w in fit.warnings)
    assert any("too few points" in w for w in fit.warnings)


# -- validation and solve --------------------------------------------------------------------

def test_progressive_validation_table(mult_runs):
    rows = progressive_validation(mult_runs, "conditional-multiplicative",
                                  FitOptions(reference="best-observed", n_starts=3),
                                  protocols=("progressive", "leave-one-size-out"))
    prog = [r for r in rows if r["protocol"] == "progressive"]
    loso = [r for r in rows if r["protocol"] == "leave-one-size-out"]
    assert len(prog) == 4 and len(loso) == 5
    assert [len(r["train_sizes"]) for r in prog] == [1, 2, 3, 4]
    assert all(r["error"] is None and r["mare"] < 0.02 for r in rows)
    assert all(r["reference_at_test"] == "observed" for r in rows)
    chin = progressive_validation(mult_runs, "conditional-multiplicative", FitOptions(n_starts=3),
                                  protocols=("progressive",))
    assert "reference" in chin[0]["error"]  # one size: no Chinchilla L_opt can be fitted


def test_solve_feasible_pareto_and_buildable(mult_fit):
    from archsearch.arch import kv_cache_bytes_per_token, non_embedding_params

    def throughput(spec):  # a stand-in predictor: fewer KV bytes, more tokens/s
        return 1e9 / kv_cache_bytes_per_token(spec)

    best_loss = optimum(mult_fit, 1e9, 2e10).loss
    target = best_loss * 1.01
    res = solve(mult_fit, 1e9, 2e10, 16, target, throughput)
    assert res.feasible and all(p.predicted_loss <= target for p in res.feasible)
    assert all(abs(non_embedding_params(p.spec) / 1e9 - 1) <= 0.02 for p in res.points)
    assert res.best.throughput == max(p.throughput for p in res.feasible)
    assert res.pareto  # feasible points with throughputs: the front cannot be empty
    for p in res.pareto:  # nobody beats a Pareto point on both axes
        assert not any(q.throughput > p.throughput and q.predicted_loss < p.predicted_loss for q in res.feasible)
    assert res.architecture.predicted_loss == pytest.approx(best_loss, rel=2e-3)
    with pytest.raises(ArchsearchError):
        solve(mult_fit, 1e9, 2e10, 16, -1.0)


# -- CLI -------------------------------------------------------------------------------------

def test_cli_fit_solve_round_trip(tmp_path, capsys, mult_runs):
    data = write_runs(tmp_path / "runs.csv", mult_runs)
    law = tmp_path / "law.json"
    assert main(["fit", "--data", str(data), "--law", "conditional-multiplicative", "--holdout-size", "3.2e8",
                 "--starts", "4", "--out", str(law), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "coefficients" in out and "metrics (holdout)" in out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(  # each as PNG and PDF
        f"{f}.{ext}" for f in ("loss_vs_hidden_over_sqrt_n", "loss_vs_r", "predicted_vs_actual", "residuals")
        for ext in ("png", "pdf"))
    assert main(["solve", "--law", str(law), "--params", "1e9", "--tokens", "2e10", "--layers", "16",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert abs(d["optimum"]["hidden_over_sqrt_n"] / X1_STAR - 1) < 0.05
    assert d["architecture"]["n_layers"] == 16 and "kv_cache_bytes_per_token" in d["architecture"]
    assert d["predicted_loss"] > 0
    # a hand-written file, coefficients only
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"law": "conditional-multiplicative", "coefficients": mult_truth()}))
    assert main(["solve", "--law", str(hand), "--params", "1B", "--tokens", "20B", "--layers", "16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["optimum"]["hidden_over_sqrt_n"] == pytest.approx(X1_STAR)
    assert d["optimum"]["mlp_to_attn_ratio"] == pytest.approx(R_STAR)
    assert d["predicted_loss"] is None and d["architecture"]["hidden_size"] % 64 == 0


def _bad_csv(tmp_path, loss):
    spec = synthetic_runs("chinchilla", TRUE_CHINCHILLA, (2e7,), hidden_over_sqrt_n=(0.08,), mlp_to_attn=(2.5,))[0]
    rows = [RunRecord.from_arch(spec.spec, tokens=4e8 * (i + 1), loss=3.0).to_row() for i in range(8)]
    rows[2]["loss"] = loss
    p = tmp_path / "bad.csv"
    cols = list(rows[0])
    p.write_text(",".join(cols) + "\n" + "".join(",".join("" if r[c] is None else str(r[c]) for c in cols) + "\n"
                                                 for r in rows))
    return p


@pytest.mark.parametrize("loss", ["nan", "-1.5"])
def test_cli_bad_loss_exits_2(tmp_path, capsys, loss):
    p = _bad_csv(tmp_path, loss)
    assert main(["fit", "--data", str(p), "--law", "chinchilla", "--out", str(tmp_path / "l.json")]) == 2
    err = capsys.readouterr().err.strip()
    # one line naming the field (rundata names the row too when the run has a run_id)
    assert err.count("\n") == 0 and ".loss: must be a positive finite number" in err


def test_cli_bad_input_exits_2(tmp_path, capsys, mult_runs):
    data = write_runs(tmp_path / "runs.csv", mult_runs[:3])
    assert main(["fit", "--data", str(data), "--law", "chinchilla", "--out", str(tmp_path / "l.json")]) == 2
    assert "data: 3 runs to fit but chinchilla has 5 parameters" in capsys.readouterr().err
    assert main(["fit", "--data", str(data), "--law", "chinchilla", "--r-range", "8", "9",
                 "--out", str(tmp_path / "l.json")]) == 2
    assert "r_range" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["fit", "--data", str(data), "--law", "kaplan", "--out", str(tmp_path / "l.json")])
    assert e.value.code == 2


def test_cli_validate(tmp_path, capsys, mult_runs):
    data = write_runs(tmp_path / "runs.csv", mult_runs)
    assert main(["validate", "--data", str(data), "--law", "conditional-multiplicative", "--reference",
                 "best-observed", "--starts", "2", "--protocol", "previous-size", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4 and all(r["protocol"] == "previous-size" and r["error"] is None for r in rows)

"""Extension points (docs/extending.md): a law form and a measurement backend defined here, in
this file alone, registered with one line each, and used by a law fit and by a whole study.

The toy law is conditional and multiplicative, with quadratic factors in log x:
``L = L_opt(N, D) * m (1 + k1 log^2(x1 / x1s)) (1 + k2 log^2(r / rs))`` (optimum x1s, rs).
The toy backend predicts throughput as ``1e12 / (params + 2 * kv bytes per token * batch)``:
a deterministic stand-in for an engine that the search ranks like a real one.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from archsearch.arch import ArchSpec, kv_cache_bytes_per_token, non_embedding_params
from archsearch.benchmarks.base import BACKENDS, Backend, BatchResult, BenchSettings, register_backend
from archsearch.errors import ArchsearchError
from archsearch.laws import fit_law, load_law
from archsearch.laws.forms import Form, Norm
from archsearch.laws.registry import FORMS, LawForm, law_form, register, unregister
from archsearch.laws.synthetic import synthetic_runs
from archsearch.rundata import write_runs
from archsearch.search import pipeline
from archsearch.search.config import LawConfig, load_study_config

TOY = "toy-quadratic"
TRUTH = {"m": 1.05, "k1": 0.08, "x1s": 0.11, "k2": 0.03, "rs": 2.2}


def _sq(c, key, x):
    if key == "x1":
        return c["m"] * (1.0 + c["k1"] * np.log(x / c["x1s"]) ** 2)
    return 1.0 + c["k2"] * np.log(x / c["rs"]) ** 2


def _predict(c, X):
    return X["Lref"] * _sq(c, "x1", X["x1"]) * _sq(c, "x2", X["x2"])


def _logpred(th, X, nm):
    logm, k1, u1, k2, u2 = th
    q1, q2 = np.log(X["x1"]) - u1, np.log(X["x2"]) - u2
    f, g = 1.0 + k1 * q1**2, 1.0 + k2 * q2**2
    J = np.stack([np.ones_like(q1), q1**2 / f, -2 * k1 * q1 / f, q2**2 / g, -2 * k2 * q2 / g], axis=1)
    return np.log(X["Lref"]) + logm + np.log(f) + np.log(g), J


def _box_u(X):
    l1, l2 = np.log(X["x1"]), np.log(X["x2"])
    return (float(l1.min()), float(l1.max())), (float(l2.min()), float(l2.max()))


def _bounds(X, L):
    (a, b), (c, d) = _box_u(X)
    return [(math.log(0.2), math.log(5.0)), (0.0, 5.0), (a - 2, b + 2), (0.0, 5.0), (c - 2, d + 2)]


def _box(X, L):
    (a, b), (c, d) = _box_u(X)
    k = math.log(float(np.median(L / X["Lref"])))
    return [(k - 0.05, k + 0.02), (0.0, 0.3), (a, b), (0.0, 0.3), (c, d)]


TOY_FORM = Form(TOY, ("log m", "k1", "log x1s", "k2", "log rs"), _logpred,
                lambda th, nm: {"m": math.exp(th[0]), "k1": float(th[1]), "x1s": math.exp(th[2]),
                                "k2": float(th[3]), "rs": math.exp(th[4])},
                lambda c, nm: np.array([math.log(c["m"]), c["k1"], math.log(c["x1s"]), c["k2"], math.log(c["rs"])]),
                _bounds, _box)

TOY_LAW = LawForm(TOY, ("m", "k1", "x1s", "k2", "rs"), _predict, lambda tie: TOY_FORM, ("x1", "x2", "Lref"),
                  nonnegative=("m", "x1s", "rs"),
                  optimum=lambda c: (c["x1s"] if c["k1"] > 0 else None, c["rs"] if c["k2"] > 0 else None),
                  factor=_sq, combine="multiplicative", factor_coefficients=(("k1", "x1s"), ("k2", "rs")))


class ToyBackend(Backend):
    """A deterministic prediction: in-process (not isolated), so the study takes its numbers as it
    takes the analytic backend's."""

    name = "toy"
    packages = ()
    isolated = False
    predicted = True

    def run(self, job, report):
        spec = ArchSpec.from_dict(job["arch"])
        kv = kv_cache_bytes_per_token(spec, "float32")
        per_batch = []
        for b in job["batch_sizes"]:
            tp = 1e12 / (non_embedding_params(spec) + 2.0 * kv * b)
            per_batch.append(BatchResult(batch_size=b, ok=True, output_throughput=tp, output_throughput_std=0.0,
                                         total_throughput=tp, total_throughput_std=0.0).to_dict())
        return {"device": "toy", "dtype": "float32", "engine": {"model": "toy"}, "timing": {},
                "per_batch": per_batch}


@pytest.fixture
def toys():
    register(TOY_LAW)                                        # the law form's one registration line
    register_backend("toy", f"{__name__}:ToyBackend")        # the backend's
    yield
    unregister(TOY)
    BACKENDS.pop("toy", None)


def _runs():
    return synthetic_runs(TOY, TRUTH, (2e6, 4e6, 8e6, 1.6e7, 3.2e7), tokens_per_param=(20,),
                          hidden_over_sqrt_n=(0.05, 0.08, 0.12, 0.2, 0.3), mlp_to_attn=(0.7, 1.2, 2.2, 3.5, 4.8),
                          noise=0.002, seed=3)


def test_a_toy_law_form_fits_saves_and_loads(toys, tmp_path):
    assert TOY in FORMS and law_form(TOY) is TOY_LAW
    fit = fit_law(_runs(), TOY)
    x1, r = TOY_LAW.optimum(fit.coefficients)
    assert x1 == pytest.approx(TRUTH["x1s"], rel=0.1) and r == pytest.approx(TRUTH["rs"], rel=0.15)
    path = tmp_path / "law.json"
    fit.save(path)
    again = load_law(path)
    assert again.law == TOY and again.coefficients == pytest.approx(fit.coefficients)


def test_unregistered_form_and_backend_are_refused_by_name(tmp_path):
    with pytest.raises(ArchsearchError) as e:
        LawConfig(form=TOY)
    assert e.value.field == "law.form" and "conditional-multiplicative" in e.value.fix
    with pytest.raises(ArchsearchError, match="unknown backend"):
        BenchSettings(backend="toy")


def test_a_study_fits_the_toy_law_and_measures_with_the_toy_backend(toys, tmp_path):
    runs = tmp_path / "runs.csv"
    write_runs(runs, _runs())
    cfg = {
        "name": "toy", "params": 8e6, "tokens": 1.6e8, "n_layers": 4, "vocab_size": 256,
        "baseline": {"hidden_over_sqrt_n": 0.2, "mlp_to_attn": 1.0, "gqa": 1},
        "target": {"slack": 0.0},
        "proxy": {"runs": str(runs)},
        "law": {"form": TOY, "fit": {"bootstrap": 0, "reference": "chinchilla"}},
        "search_space": {"hidden_over_sqrt_n": [0.06, 0.28], "mlp_to_attn": [0.8, 4.5], "gqa": [1, 2],
                         "head_dim": 32, "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.05,
                                                   "on_r_drift": "flag"}},
        "measure": {"bench": {"backend": "toy", "batch_sizes": [8], "input_len": 64, "output_len": 16, "repeats": 1,
                              "warmup": 0}},
        "optuna": {"n_shapes": 6, "seed": 1, "enqueue_solution": 2},
        "out": str(tmp_path / "study"),
    }
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    study = load_study_config(tmp_path / "study.yaml")
    out = study.out_dir()
    pipeline.run(study, out)
    law = json.loads((out / "law.json").read_text())
    assert law["law"] == TOY
    x1, r = TOY_LAW.optimum(law["coefficients"])
    assert x1 == pytest.approx(TRUTH["x1s"], rel=0.1) and r == pytest.approx(TRUTH["rs"], rel=0.15)
    records = [json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines()]
    assert records and all(rec["result"]["settings"]["backend"] == "toy" for rec in records)
    s = json.loads((out / "summary.json").read_text())
    assert s["law"]["form"] == TOY
    assert s["chosen"]["predicted_loss"] <= s["target_loss"] + 1e-12

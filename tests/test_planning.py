"""Planning: pure accounting against published / hand-computed numbers, limits, bad input,
and the time law's recovery of known parameters from synthetic data."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from archsearch.arch import ArchSpec, kv_cache_bytes_per_token, non_embedding_params, total_params
from archsearch.errors import ArchsearchError
from archsearch.planning import (Limits, TimeLaw, check_limits, estimate_training, fit_time_law,
                                 max_inference_batch, max_training_batch, parse_gpus,
                                 predict_inference_memory, predict_training_memory)
from archsearch.planning.time import compute_params
from archsearch.presets import load_arch
from archsearch.rundata import RunRecord, write_runs

GIB = 2**30


@pytest.fixture(scope="module")
def llama1b():
    return load_arch("llama-3.2-1b")


# -- training memory: ZeRO's accounting ------------------------------------------------------

def test_mixed_precision_adam_is_16_bytes_per_param(llama1b):
    m = predict_training_memory(llama1b, 1, 128, "bfloat16")
    p = total_params(llama1b)
    assert (m["weights"], m["gradients"], m["optimizer"]) == (2 * p, 2 * p, 12 * p)
    f = predict_training_memory(llama1b, 1, 128, "float32")
    assert f["weights"] + f["gradients"] + f["optimizer"] == 16 * p


@pytest.mark.parametrize("mode,gb", [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("fsdp", 1.9)])
def test_zero_sharding_matches_the_paper(mode, gb):
    # ZeRO (Rajbhandari et al. 2020) Figure 1: 7.5B params, 64 GPUs, K=12:
    # baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device.
    spec = ArchSpec(n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=32, head_dim=128,
                    ffn=11008, vocab_size=32000)
    m = predict_training_memory(spec, 0, 128, "bfloat16", parallelism=mode, n_devices=64)
    per_param = (m["weights"] + m["gradients"] + m["optimizer"]) / total_params(spec)
    assert per_param * 7.5e9 / 1e9 == pytest.approx(gb, abs=0.05)


def test_tp_and_pp_shard_the_weights(llama1b):
    base = predict_training_memory(llama1b, 1, 128)["weights"]
    assert predict_training_memory(llama1b, 1, 128, tp=4, n_devices=4)["weights"] == pytest.approx(base / 4)
    pp = predict_training_memory(llama1b, 1, 128, pp=4, n_devices=4)
    body = total_params(llama1b) - llama1b.vocab_size * llama1b.hidden_size  # tied: one vocab matrix
    assert pp["weights"] == pytest.approx(2 * (body / 4 + llama1b.vocab_size * llama1b.hidden_size))


def test_activations_hand_computed():
    s = ArchSpec(n_layers=2, hidden_size=128, n_heads=2, n_kv_heads=1, head_dim=64, ffn=256, vocab_size=1000)
    m = predict_training_memory(s, 3, 10, "float32")
    per_layer = (3 * 128 + 3 * 128 + 2 * 64) + (3 * 128 + 4 * 256)
    assert m["activations"] == 30 * 2 * per_layer * 4
    assert m["loss"] == 30 * 1000 * 12
    ck = predict_training_memory(s, 3, 10, "float32", activation_checkpointing=True)
    assert ck["activations"] == 30 * (2 * 128 + per_layer) * 4 < m["activations"]


# -- inference memory ------------------------------------------------------------------------

def test_inference_memory_terms(llama1b):
    m = predict_inference_memory(llama1b, 16, 4096, 1024, "bfloat16")
    assert m["weights"] == 2 * total_params(llama1b)
    # LLaMA-3.2-1B: 16 layers x 8 KV heads x 64 x K,V x 2 bytes = 32 KiB per token
    assert kv_cache_bytes_per_token(llama1b) == 32768
    assert m["kv_cache"] == 32768 * 16 * 5120
    assert m["total"] == m["weights"] + m["kv_cache"] + m["activations"]
    chunked = predict_inference_memory(llama1b, 16, 4096, 1024, prefill_chunk_tokens=8192)
    assert chunked["activations"] < m["activations"] and chunked["kv_cache"] == m["kv_cache"]


def test_max_batches_are_the_largest_that_fit(llama1b):
    mem = 80 * GIB
    b = max_inference_batch(llama1b, mem, 4096, 1024, memory_fraction=0.9)
    assert predict_inference_memory(llama1b, b, 4096, 1024)["total"] <= 0.9 * mem
    assert predict_inference_memory(llama1b, b + 1, 4096, 1024)["total"] > 0.9 * mem
    t = max_training_batch(llama1b, mem, 2048, memory_fraction=0.95)
    assert t >= 1
    assert predict_training_memory(llama1b, t, 2048)["total"] <= 0.95 * mem
    assert predict_training_memory(llama1b, t + 1, 2048)["total"] > 0.95 * mem
    assert max_training_batch(load_arch("llama-3.1-8b"), 40 * GIB, 2048) == 0  # 16 B/param > 40 GiB


# -- the analytic estimate -------------------------------------------------------------------

def test_analytic_estimate_hand_computed(llama1b):
    e = estimate_training(llama1b, 2e10, "8xH100", tp=2)
    flops = 6 * (non_embedding_params(llama1b) + 128256 * 2048) * 2e10
    hours = flops / (0.40 * 989e12 * 8) / 3600
    assert e.hours == pytest.approx(hours)
    assert e.gpu_hours == pytest.approx(8 * hours)
    assert e.cost_usd == pytest.approx(8 * hours * 2.50)
    a = e.assumptions
    assert a["mfu"] == 0.40 and "assumed" in a["mfu_source"]
    assert "datasheet" in a["peak_source"] and "table" in a["price_source"] and a["dp"] == 4
    json.dumps(e.to_dict())
    o = estimate_training(llama1b, 2e10, "8xH100", mfu=0.5, price_per_hour=1.0)
    assert o.hours == pytest.approx(hours * 0.4 / 0.5)
    assert o.cost_usd == pytest.approx(o.gpu_hours * 1.0)
    assert o.assumptions["mfu_source"] == o.assumptions["price_source"] == "given by the user"


def test_parse_gpus():
    assert parse_gpus("8xH100")[0] == 8 and parse_gpus("8xH100")[1].name == "H100-SXM"
    assert parse_gpus("H200") == (1, parse_gpus("1xH200")[1])
    assert parse_gpus("64xA100-80GB")[1].name == "A100-80GB"


@pytest.mark.parametrize("kw,field", [
    (dict(gpus="8xH99"), "gpus"), (dict(tp=3), "tp"), (dict(pp=5), "pp"), (dict(gpus="6xH100", tp=4), "gpus"),
    (dict(mfu=1.5), "mfu"), (dict(tokens=-1), "tokens"), (dict(price_per_hour=-2.0), "price_per_hour"),
])
def test_bad_input_names_the_field(llama1b, kw, field):
    tokens = kw.pop("tokens", 1e9)
    with pytest.raises(ArchsearchError) as e:
        estimate_training(llama1b, tokens, **kw)
    assert e.value.field == field
    assert field in str(e.value)


def test_tp_error_lists_valid_degrees(llama1b):
    with pytest.raises(ArchsearchError, match=r"does not divide n_heads=32 \(use one of \[1, 2, 4, 8, 16, 32\]\)"):
        estimate_training(llama1b, 1e9, "8xH100", tp=3)


# -- limits ----------------------------------------------------------------------------------

@dataclass
class _Batch:  # duck-typed like archsearch.benchmarks.base.BatchResult
    batch_size: int
    ttft_mean: float | None
    tpot_mean: float | None
    peak_memory_bytes: float | None


def test_limits_feasible_and_infeasible():
    lim = Limits(max_ttft_s=0.5, max_tpot_s=0.02, max_peak_memory_gib=10)
    ok, why = check_limits(lim, _Batch(16, 0.3, 0.01, 5 * GIB))
    assert ok and "batch size 16" in why
    ok, why = check_limits(lim, {"ttft_mean": 0.9, "tpot_mean": 0.01, "peak_memory_bytes": 12 * GIB}, 32)
    assert not ok
    assert "max_ttft_s=0.5 s exceeded: ttft_mean=0.9 s at batch size 32" in why
    assert "max_peak_memory_gib=10 GiB exceeded: peak_memory_bytes=12 GiB" in why
    assert "tpot" not in why
    assert check_limits(Limits(), {"ttft_mean": 99}, 1) == (True, "no limits set")


def test_limit_without_measurement_is_infeasible():
    ok, why = check_limits(Limits(max_tpot_s=0.1), {"ttft_mean": 0.1}, 8)
    assert not ok and "tpot_mean was not measured at batch size 8" in why


def test_limits_accept_the_real_batch_result():
    base = pytest.importorskip("archsearch.benchmarks.base")
    r = base.BatchResult(batch_size=64, ok=True, ttft_mean=2.0, tpot_mean=0.01, peak_memory_bytes=GIB)
    ok, why = check_limits(Limits(max_ttft_s=1.0), r, 64)
    assert not ok and "ttft_mean=2 s at batch size 64" in why
    assert check_limits(Limits(max_ttft_s=1.0), r.to_dict(), 64) == (ok, why)
    ok, why = check_limits(Limits(max_tpot_s=1.0), base.BatchResult.failed(128, "CUDA out of memory"))
    assert not ok and "failed at batch size 128: CUDA out of memory" in why


def test_limits_validate():
    with pytest.raises(ArchsearchError, match="limits.max_ttft_s"):
        Limits(max_ttft_s=-1)


# -- the time law: synthetic recovery --------------------------------------------------------

# both terms of the bracket matter over the runs: Nc*N^r ~ 1e5-1e7, Dc*D ~ 1e4-1e6
TRUE_AMDAHL = {"log_Nc": -3.0, "log_Dc": -9.0, "r": 0.9, "aD": 1.1, "g": 0.8, "h": 0.6}


def _synthetic_runs(form: str, params: dict, noise: float, seed: int = 0) -> list[RunRecord]:
    from archsearch.planning.time import _log_time

    rng = np.random.default_rng(seed)
    runs = []
    shapes = [(4, 256, 4, 256 * 3), (8, 512, 8, 1536), (16, 1024, 16, 2816), (24, 2048, 32, 5632)]
    for i, (L, d, h, ffn) in enumerate(shapes):
        spec = ArchSpec(n_layers=L, hidden_size=d, n_heads=h, n_kv_heads=h // 4 or 1, head_dim=64,
                        ffn=ffn, vocab_size=32000)
        for D in (1e8, 1e9, 1e10):
            for tp, pp in ((1, 1), (2, 1), (4, 2), (1, 4)):
                X = np.array([[compute_params(spec), D, tp, pp]])
                t = float(np.exp(_log_time(form, params, X)[0] + rng.normal(0, noise)))
                runs.append(RunRecord.from_arch(spec, tokens=D, loss=3.0, wall_time_s=t, tp=tp, pp=pp,
                                                n_devices=tp * pp, device="H100-SXM",
                                                run_id=f"s{i}-{D:g}-{tp}-{pp}"))
    return runs


def test_amdahl_law_recovers_known_parameters():
    runs = _synthetic_runs("amdahl", TRUE_AMDAHL, noise=0.01)
    fit = fit_time_law(runs, forms=("amdahl",), residual_options=(False,))
    p = fit.law.params
    # stated tolerances at 1% log-normal noise, 48 runs
    assert p["g"] == pytest.approx(0.8, abs=0.03)
    assert p["h"] == pytest.approx(0.6, abs=0.03)
    assert p["aD"] == pytest.approx(1.1, rel=0.05)
    assert p["r"] == pytest.approx(0.9, rel=0.05)
    assert fit.selection[0]["cv"]["mean_abs_rel_err"] < 0.02


def test_power_law_recovers_exponents_and_selection_prefers_true_form():
    true = {"log_Nc": -3.0, "log_Dc": -9.0, "r": 0.9, "aD": 1.1, "aTP": 0.7, "aPP": 0.4}
    runs = _synthetic_runs("power", true, noise=0.01, seed=1)
    fit = fit_time_law(runs, forms=("amdahl", "power"), residual_options=(False,))
    assert fit.law.form == "power"
    assert fit.law.params["aTP"] == pytest.approx(0.7, abs=0.03)
    assert fit.law.params["aPP"] == pytest.approx(0.4, abs=0.03)


@pytest.mark.parametrize("form", ["amdahl", "power"])
def test_parallelism_the_runs_cannot_split_is_named_and_fitted_the_same_from_any_start(form):
    """Every other run: TP and PP only ever (1, 1) or (4, 2), so only their joint effect is seen. The
    fit says so and takes one point of that valley whatever its starts (before, the point moved with
    the starts and with the CPU's rounding); with all runs both are identified and nothing is said."""
    from archsearch.planning.time import _fit_form, _runs_to_arrays

    true = TRUE_AMDAHL if form == "amdahl" else {"log_Nc": -3.0, "log_Dc": -9.0, "r": 0.9, "aD": 1.1,
                                                 "aTP": 0.7, "aPP": 0.4}
    runs = _synthetic_runs(form, true, noise=0.05, seed=2)
    X, T, _, _ = _runs_to_arrays(runs[::2])
    a, b = ("g", "h") if form == "amdahl" else ("aTP", "aPP")
    fits = [_fit_form(form, X, np.log(T), seed=s) for s in (0, 1, 2)]
    for params, notes in fits:
        assert params[a] == pytest.approx(fits[0][0][a], abs=1e-3)
        assert params[b] == pytest.approx(fits[0][0][b], abs=1e-3)
        said = [n for n in notes if "not separately identified" in n]
        assert len(said) == 1 and f"{a} and {b}" in said[0] and "vary TP and PP apart" in said[0], notes
    X, T, _, _ = _runs_to_arrays(runs)
    params, notes = _fit_form(form, X, np.log(T))
    assert not any("identified" in n for n in notes), notes
    assert params[a] == pytest.approx(true[a], abs=0.1) and params[b] == pytest.approx(true[b], abs=0.1)


def test_law_roundtrip_estimate_and_device_check(tmp_path, llama1b):
    runs = _synthetic_runs("amdahl", TRUE_AMDAHL, noise=0.05, seed=2)
    fit = fit_time_law(runs[::2], holdout=runs[1::2], forms=("analytic", "amdahl"))
    assert fit.holdout is not None and fit.holdout["r2"] > 0.9
    path = fit.law.save(tmp_path / "law.json")
    law = TimeLaw.load(path)
    assert law.predict(llama1b, 1e10, 2, 1) == pytest.approx(fit.law.predict(llama1b, 1e10, 2, 1))
    e = estimate_training(llama1b, 1e10, "8xH100", tp=2, time_law=path)
    assert e.law_hours == pytest.approx(law.predict(llama1b, 1e10, 2, 1) / 4 / 3600)
    assert e.hours == e.law_hours and e.assumptions["time_law_form"] == law.form
    assert "measured" in e.assumptions["mfu_source"]
    with pytest.raises(ArchsearchError, match="fit on 'H100-SXM', not 'H200'") as err:
        estimate_training(llama1b, 1e10, "8xH200", time_law=law)
    assert err.value.field == "gpus"


def test_unidentified_parallelism_is_reported():
    runs = [r for r in _synthetic_runs("amdahl", TRUE_AMDAHL, 0.01) if r.tp == 1 and r.pp == 1]
    fit = fit_time_law(runs, forms=("amdahl",), residual_options=(False,))
    assert fit.law.params["g"] == 1.0 and any("g not identified" in n for n in fit.law.notes)


def test_fit_needs_wall_times():
    runs = _synthetic_runs("amdahl", TRUE_AMDAHL, 0.01)[:4]
    with pytest.raises(ArchsearchError, match="wall_time_s"):
        fit_time_law(runs)


# -- CLI -------------------------------------------------------------------------------------

def test_cli_estimate_and_errors(tmp_path, capsys):
    """The commands in this process (a subprocess each would import the engine six times):
    exit codes, stdout and the one-line errors on stderr."""
    from archsearch.cli import main

    def cli(*args):
        rc = main(list(args))
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    r = cli("estimate", "--arch", "llama-3.2-1b", "--tokens", "20B", "--gpus", "8xH100", "--tp", "2", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["assumptions"]["mfu"] == 0.4 and d["cost_usd"] > 0
    r = cli("estimate", "--arch", "llama-3.2-1b", "--tokens", "20B", "--tp", "3")
    assert r.returncode == 2 and "tp: tensor parallel degree 3" in r.stderr and "Traceback" not in r.stderr
    r = cli("estimate", "--arch", "llama-3.2-1b", "--tokens", "20B", "--gpus", "4xV100")
    assert r.returncode == 2 and "gpus: unknown device 'V100'" in r.stderr
    data = write_runs(tmp_path / "runs.csv", _synthetic_runs("amdahl", TRUE_AMDAHL, 0.02))
    r = cli("estimate", "fit", "--data", str(data), "--out", str(tmp_path / "law.json"))
    assert r.returncode == 0, r.stderr
    assert "cross-validated" in r.stdout and (tmp_path / "law.json").is_file()
    r = cli("estimate", "--arch", "llama-3.2-1b", "--tokens", "20B", "--law", str(tmp_path / "law.json"))
    assert r.returncode == 0 and "fitted law" in r.stdout, r.stderr
    r = cli("estimate", "memory", "--arch", "llama-3.2-1b", "--gpus", "H200", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["max_inference_batch"] > 0


def test_unknown_device_says_why_there_is_no_mfu():
    import dataclasses

    runs = [dataclasses.replace(r, device="TPU-v9") for r in _synthetic_runs("amdahl", TRUE_AMDAHL, 0.01)]
    fit = fit_time_law(runs, forms=("analytic",), residual_options=(False,))
    assert fit.law.mfu is None
    assert any("no measured MFU" in n and "'TPU-v9'" in n for n in fit.law.notes), fit.law.notes


def test_full_prompt_logits_in_their_dtype():
    """fp32 logits at a 256,000 vocabulary: 31.25 MiB for the planner paper's 32-token prefill
    (its 62.5 MB is twice that: 8 B per entry, not one fp32 tensor; docs/planning.md), 62.5 MiB
    for 64 tokens, ~2 GB at batch 32 x 64; generate and serving engines keep the last position
    only (the default)."""
    from archsearch.arch import ArchSpec

    spec = ArchSpec(n_layers=2, hidden_size=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=688, vocab_size=256_000)
    one = predict_inference_memory(spec, 1, 64, 8, "bfloat16", logits_positions="prompt")
    assert one["logits"] == 64 * 256_000 * 4 == 62.5 * 2**20
    paper = predict_inference_memory(spec, 1, 32, 8, "bfloat16", logits_positions="prompt")
    assert paper["logits"] == 32 * 256_000 * 4 == 31.25 * 2**20
    assert predict_inference_memory(spec, 32, 64, 8, "bfloat16", logits_positions="prompt")["logits"] == 32 * 62.5 * 2**20
    last = predict_inference_memory(spec, 1, 64, 8, "bfloat16")
    assert last["logits"] == 256_000 * 4 and one["total"] - one["logits"] == last["total"] - last["logits"]
    assert predict_inference_memory(spec, 1, 64, 8, logits_positions="prompt", logits_dtype="bfloat16")["logits"] \
        == 64 * 256_000 * 2
    with pytest.raises(ArchsearchError) as e:
        predict_inference_memory(spec, 1, 64, 8, logits_positions="all")
    assert e.value.field == "logits_positions"


def test_quantised_serving_weights():
    from archsearch.arch import ArchSpec
    from archsearch.planning.formats import base_weight_bytes

    spec = ArchSpec(n_layers=2, hidden_size=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=688, vocab_size=1000)
    m = predict_inference_memory(spec, 1, 16, 4, "bfloat16", weight_format="nf4")
    assert m["weights"] == base_weight_bytes(spec, "nf4", "bfloat16")["total"]
    assert m["activations"] > predict_inference_memory(spec, 1, 16, 4, "bfloat16")["activations"]


def test_time_law_recovers_a_log_constant_outside_the_old_box():
    """log Nc = -70 (the fit used to box it in [-60, 60]): recovered through the reference-scale
    parametrisation; and a law built from coefficients on their natural scale predicts by hand."""
    true = {"log_Nc": -70.0, "log_Dc": -9.0, "r": 4.0, "aD": 0.5, "g": 0.8, "h": 0.6}
    fit = fit_time_law(_synthetic_runs("amdahl", true, noise=0.01), forms=("amdahl",), residual_options=(False,))
    p = fit.law.params
    assert p["r"] == pytest.approx(4.0, rel=0.05) and p["aD"] == pytest.approx(0.5, rel=0.05)
    assert p["log_Nc"] == pytest.approx(-70.0, abs=4.0) and p["log_Nc"] < -60
    assert fit.selection[0]["cv"]["mean_abs_rel_err"] < 0.02
    law = TimeLaw.from_coefficients("amdahl", Nc=math.exp(-70.0), Dc=math.exp(-9.0), aN=2.0, aD=0.5, g=0.8, h=0.6)
    spec = ArchSpec(n_layers=4, hidden_size=256, n_heads=4, n_kv_heads=1, head_dim=64, ffn=768, vocab_size=32000)
    n, d = compute_params(spec), 1e9
    hand = (math.exp(-70.0) * n ** 4.0 + math.exp(-9.0) * d) ** 0.5 * (0.8 / 2 + 0.2) * (0.6 / 1 + 0.4)
    assert law.predict(spec, d, tp=2, pp=1) == pytest.approx(hand, rel=1e-9)
    assert TimeLaw.from_dict(law.to_dict()).params == law.params
    with pytest.raises(ArchsearchError) as e:
        TimeLaw.from_coefficients("amdahl", Nc=0.0, Dc=1.0, aN=1.0, aD=1.0)
    assert e.value.field == "time_law.Nc"


def test_a_degenerate_law_is_flagged(caplog):
    """Coefficients one of whose terms is lost beside the other (wrong units, log base or form)
    predict one time for every token count (or model size): estimate says so in its assumptions
    and logs it once; a sound law is not flagged."""
    spec = ArchSpec(n_layers=4, hidden_size=256, n_heads=4, n_kv_heads=1, head_dim=64, ffn=768, vocab_size=32000)
    # both terms of the same order at N = 11.2M, D = 1e9: T ~ N^1 D^0.5 there
    sound = TimeLaw.from_coefficients("amdahl", Nc=math.exp(-53.2), Dc=math.exp(-9.0), aN=2.0, aD=0.5)
    flat = TimeLaw.from_coefficients("amdahl", Nc=1.0, Dc=math.exp(-9.0), aN=2.0, aD=0.5)
    flat_n = TimeLaw.from_coefficients("amdahl", Nc=math.exp(-90.0), Dc=1.0, aN=2.0, aD=0.5)
    assert sound.elasticities(spec, 1e9)["tokens"] == pytest.approx(0.25, abs=0.02)
    assert sound.elasticities(spec, 1e9)["params"] == pytest.approx(1.0, abs=0.02)
    assert sound.degeneracy(spec, 1e9) is None
    assert flat.elasticities(spec, 1e9)["tokens"] < 1e-3 and flat.elasticities(spec, 1e9)["params"] > 0.9
    assert flat_n.elasticities(spec, 1e9)["params"] < 1e-3 and flat_n.elasticities(spec, 1e9)["tokens"] > 0.49
    assert "time_law_warning" not in estimate_training(spec, 1e9, "H100", time_law=sound).assumptions
    with caplog.at_level("WARNING", logger="archsearch"):
        a = estimate_training(spec, 1e9, "H100", time_law=flat).assumptions
        estimate_training(spec, 2e9, "H100", time_law=flat)
    assert "flat in tokens" in a["time_law_warning"] and a["time_law_elasticities"]["tokens"] < 1e-3
    assert sum("flat in tokens" in r.getMessage() for r in caplog.records) == 1
    assert "flat in params" in estimate_training(spec, 1e9, "H100", time_law=flat_n).assumptions["time_law_warning"]

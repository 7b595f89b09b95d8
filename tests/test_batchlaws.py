"""docs/method.md section 8 max-batch and throughput laws: recovery of known constants, points from
measurements, cost, and the estimate CLI beside the analytic answer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from archsearch.errors import ArchsearchError
from archsearch.planning.batchlaws import (MaxBatchLaw, MaxBatchPoint, ThroughputLaw, ThroughputPoint,
                                           estimate_from_batch_laws, fit_max_batch_law,
                                           fit_throughput_law, load_batch_laws, max_batch_points,
                                           read_points, throughput_points)
from archsearch.planning.cost import Price


def _tp_points(c2, c4, noise, rng):
    pts = []
    for s in (1.0, 0.25):
        for b in (1, 2, 4, 8, 16, 32, 64):
            y = c2 * math.log(b / s) + c4
            pts.append(ThroughputPoint(b, s, y * (1 + noise * rng.standard_normal())))
    return pts


def test_throughput_law_recovers_constants():
    rng = np.random.default_rng(0)
    law = fit_throughput_law(_tp_points(120.0, 300.0, 0.01, rng))
    assert law.c2 == pytest.approx(120.0, rel=0.03)
    assert law.c4 == pytest.approx(300.0, rel=0.03)
    assert law.c3 == 1.0 and "not identifiable" in law.notes[0]
    assert law.loo["n"] == 14 and law.loo["mean_rel_err"] < 0.03
    held = fit_throughput_law(_tp_points(120.0, 300.0, 0.0, rng)[:8],
                              holdout=_tp_points(120.0, 300.0, 0.0, rng)[8:])
    assert held.holdout["mae"] < 1e-6  # noiseless: exact extrapolation to the other sparsity


def test_max_batch_law_recovers_constants():
    c0, c1 = 0.8, 0.6
    pts = [MaxBatchPoint(m, 2e9, seq, s, c0 * (m - 2e9) / (seq * ((1 - c1) + c1 * s)))
           for m in (4e9, 8e9, 16e9) for seq in (512, 2048) for s in (1.0, 0.3)]
    law = fit_max_batch_law(pts)
    assert law.c0 == pytest.approx(c0, rel=1e-3) and law.c1 == pytest.approx(c1, abs=1e-3)
    assert law.predict(8e9, 2e9, 2048, 1.0) == math.floor(law.predict_continuous(8e9, 2e9, 2048, 1.0))
    assert law.predict_continuous(8e9, 2e9, 2048, 1.0) == pytest.approx(c0 * 6e9 / 2048, rel=1e-3)
    assert law.loo["mean_rel_err"] < 1e-3 and not law.notes
    dense = fit_max_batch_law([p for p in pts if p.sparsity == 1.0])
    assert dense.c1 == 0.0 and "not identified" in dense.notes[0]


def test_max_batch_points_read_off_measured_peaks():
    peaks = [(1, 110.0), (2, 120.0), (4, 140.0)]
    pts = max_batch_points(peaks, [115.0, 130.0, 500.0, 50.0], 100.0, 64, 1.0)
    assert [p.max_batch for p in pts] == [1.5, 3.0]  # 500 and 50 lie outside: skipped


def test_fit_rejects_bad_input():
    with pytest.raises(ArchsearchError) as e:
        fit_throughput_law([ThroughputPoint(4, 1.0, 10.0)])
    assert e.value.field == "throughput points"
    with pytest.raises(ArchsearchError):
        fit_max_batch_law([MaxBatchPoint(1e9, 2e9, 8, 1.0, 1), MaxBatchPoint(3e9, 2e9, 8, 1.0, 1)])
    with pytest.raises(ArchsearchError) as e:
        throughput_points([{"predicted": True, "backend": "analytic", "architecture": {}, "per_batch": []}])
    assert "prediction" in str(e.value)


def test_cost_from_laws_prints_assumptions_and_saves(tmp_path):
    tl = ThroughputLaw(c2=100.0, c3=1.0, c4=200.0, quantity="training tokens/s", device="cpu", n_points=5)
    ml = MaxBatchLaw(c0=1.0, c1=0.0, device="cpu", n_points=5)
    est = estimate_from_batch_laws(tl, ml, 1e6, 10e6, 2e6, 1000, n_devices=2, price=Price(3.0, "user"))
    assert est.batch_size == 8000
    thr = 100 * math.log(8000) + 200
    assert est.throughput == pytest.approx(thr)
    assert est.hours == pytest.approx(1e6 / (2 * thr) / 3600)
    assert est.cost_usd == pytest.approx(est.hours * 2 * 3.0)
    assert est.assumptions["price_source"] == "user" and "log" in est.assumptions["throughput_law"]
    with pytest.raises(ArchsearchError) as e:
        estimate_from_batch_laws(tl, ml, 1e6, 1e6, 2e6, 1000)
    assert e.value.field == "gpus"
    path = tmp_path / "laws.json"
    path.write_text(json.dumps({"throughput": tl.to_dict(), "max_batch": ml.to_dict()}))
    assert load_batch_laws(path) == (tl, ml)


def _timing_rows(spec, device="cpu"):
    from archsearch.planning.batchlaws import model_memory_bytes

    base = model_memory_bytes(spec, "training tokens/s", "float32")
    for b in (1, 2, 4, 8):
        yield {"architecture": spec.to_dict(), "batch_size": b, "seq_len": 64, "dtype": "float32",
               "device": device, "tokens_per_s": 500 * math.log(b) + 1000,
               "peak_memory_bytes": base + b * 64 * 4000.0}


def test_read_points_and_estimate_cli_side_by_side(tmp_path, capsys):
    from archsearch.cli import main
    from archsearch.presets import get_preset

    spec = get_preset("tiny")
    data = tmp_path / "timings.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _timing_rows(spec)))
    quantity, tp, mb, device = read_points(data)
    assert quantity == "training tokens/s" and device == "cpu" and len(tp) == 4 and len(mb) == 3
    torn = tmp_path / "torn.jsonl"  # a measurement killed mid-append: its half line is skipped
    torn.write_text(data.read_text() + '{"architecture": {"n_lay')
    assert read_points(torn)[1] == tp
    laws = tmp_path / "laws.json"
    assert main(["estimate", "batch-laws", "--data", str(data), "--out", str(laws)]) == 0
    capsys.readouterr()
    assert main(["estimate", "--arch", "tiny", "--tokens", "1e6", "--gpus", "cpu", "--mfu", "0.5",
                 "--seq-len", "64", "--batch-laws", str(laws), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["analytic_hours"] > 0 and out["batch_laws"]["hours"] > 0
    assert out["batch_laws"]["throughput"] == pytest.approx(500 * math.log(out["batch_laws"]["batch_size"]) + 1000,
                                                            rel=1e-6)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(data.read_text() + "".join(json.dumps(r) + "\n" for r in _timing_rows(spec, "H100")))
    with pytest.raises(ArchsearchError) as e:
        read_points(mixed)
    assert "split the file" in str(e.value)
    other = tmp_path / "h100.jsonl"  # a holdout from another device predicts nothing about this one
    other.write_text("".join(json.dumps(r) + "\n" for r in _timing_rows(spec, "H100")))
    assert main(["estimate", "batch-laws", "--data", str(data), "--holdout", str(other), "--out",
                 str(tmp_path / "l2.json")]) == 2
    assert "--holdout" in capsys.readouterr().err and not (tmp_path / "l2.json").exists()


def test_published_mixtral_law_of_the_authors_figure_13():
    """The constants of the authors' Figure 13 script (github.com/stsxxx/finetune @ 728a01b,
    analytical_model/analytical_capacity/plot.py: C0 = 62, C1 = 0.89, model_mem = 23.35 GB,
    seq_length = 512, sparsity 0.25) give the figure's labels, bsz=28 at 100 GB and 35 at 120 GB
    (27.9 and 35.2, the figure draws the continuous line), and its measured 6 (40 GB) and 8 (48 GB)
    as floors; its measured 27 at 80 GB it does not (20.6)."""
    from archsearch.planning.batchlaws import (PUBLISHED_MAX_BATCH, XIA2024_FIG13_MODEL_MEMORY_GB,
                                               XIA2024_FIG13_SEQ_LEN, load_max_batch_law)

    law = load_max_batch_law("published:xia2024-mixtral-fig13")
    assert law is PUBLISHED_MAX_BATCH["xia2024-mixtral-fig13"] and (law.c0, law.c1) == (62.0, 0.89)
    mm, seq = XIA2024_FIG13_MODEL_MEMORY_GB * 1e9, XIA2024_FIG13_SEQ_LEN
    assert [law.predict_continuous(gb * 1e9, mm, seq, 0.25) for gb in (40, 48, 80, 100, 120)] == pytest.approx(
        [6.064, 8.977, 20.631, 27.915, 35.199], abs=1e-3)
    assert [law.predict(gb * 1e9, mm, seq, 0.25) for gb in (40, 48)] == [6, 8]


def test_published_mixtral_law_in_its_units():
    """Xia et al. 2024 Eq. 1 with C0 = 82, C1 = 0.95 (GB, routed/all experts): hand-computed."""
    from archsearch.planning.batchlaws import PUBLISHED_MAX_BATCH, load_max_batch_law, with_active_experts
    from archsearch.presets import get_preset

    law = load_max_batch_law("published:xia2024-mixtral")
    assert law is PUBLISHED_MAX_BATCH["xia2024-mixtral"]
    spec = get_preset("mixtral-8x7b")
    assert law.sparsity_of(spec) == 0.25 and law.sparsity_of(with_active_experts(spec, 8)) == 1.0
    assert law.predict(80e9, 24e9, 174, 0.25) == math.floor(82 * 56 / (174 * (0.05 + 0.95 * 0.25)))
    # the dense fine-tune (every expert routed) fits 1 / 0.2875 = 3.5x fewer sequences
    assert law.predict_continuous(80e9, 24e9, 174, 1.0) == pytest.approx(
        law.predict_continuous(80e9, 24e9, 174, 0.25) * 0.2875)
    with pytest.raises(ArchsearchError) as e:
        load_max_batch_law("published:nope")
    assert e.value.field == "--max-batch-law"
    saved = MaxBatchLaw.from_dict(json.loads(json.dumps(law.to_dict())))
    assert saved == law


def test_model_memory_follows_the_weight_format():
    from archsearch.arch import total_params
    from archsearch.planning.batchlaws import model_memory_bytes
    from archsearch.planning.formats import base_weight_bytes
    from archsearch.planning.lora import LoraSettings, lora_params
    from archsearch.presets import get_preset

    spec = get_preset("mixtral-8x7b")
    full = model_memory_bytes(spec, "training tokens/s", "bfloat16")
    assert full == 16 * total_params(spec)
    lora = LoraSettings(8)
    q = model_memory_bytes(spec, "training tokens/s", "bfloat16", method="qlora", lora=lora)
    assert q == base_weight_bytes(spec, "nf4", "bfloat16")["total"] + 16 * lora_params(spec, lora)
    assert model_memory_bytes(spec, "output tokens/s", "bfloat16", weight_format="int8") < full / 15


def test_sparse_and_dense_moe_finetune_memory_and_flops():
    """Routing every expert (the dense fine-tune) grows activations and step FLOPs, not weights."""
    from archsearch.planning.batchlaws import with_active_experts
    from archsearch.planning.lora import LoraSettings
    from archsearch.planning.finetune import predict_finetune_memory
    from archsearch.planning.lora import lora_step_flops
    from archsearch.presets import get_preset

    sparse = get_preset("mixtral-8x7b")
    dense = with_active_experts(sparse, 8)
    lora = LoraSettings(8)
    ms, md = (predict_finetune_memory(s, "qlora", 4, 174, lora=lora) for s in (sparse, dense))
    assert ms["weights"] == md["weights"] and md["activations"] > 2 * ms["activations"]
    assert lora_step_flops(dense, lora, 1000) > 3 * lora_step_flops(sparse, lora, 1000)
    with pytest.raises(ArchsearchError):
        with_active_experts(get_preset("tiny"), 2)


def test_estimate_memory_cli_formats_and_bad_inputs(capsys):
    from archsearch.cli import main

    assert main(["estimate", "memory", "--arch", "mixtral-8x7b", "--gpus", "A40", "--finetune", "qlora",
                 "--seq-len", "174", "--max-batch-law", "published:xia2024-mixtral", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finetune"] == "qlora" and 20 * 2**30 < out["training"]["weights"] < 25 * 2**30
    assert out["max_training_micro_batch"] >= 1 and out["max_batch_law"]["sparsity"] == 0.25
    assert main(["estimate", "memory", "--arch", "mixtral-8x7b", "--gpus", "A40", "--finetune", "qlora",
                 "--seq-len", "174", "--experts-per-token", "8", "--max-batch-law", "published:xia2024-mixtral",
                 "--json"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert dense["training"]["activations"] > 2 * out["training"]["activations"]
    assert dense["max_batch_law"]["sparsity"] == 1.0 and dense["max_batch_law"]["max_batch"] < out["max_batch_law"]["max_batch"]
    bad = [(["--weight-format", "int3", "--finetune", "lora"], "weight_format"),
           (["--experts-per-token", "2"], "--experts-per-token"),
           (["--finetune", "full", "--weight-format", "nf4"], "--weight-format"),
           (["--finetune", "qlora", "--weight-format", "int8"], "--weight-format"),
           (["--finetune", "lora", "--lora-targets", "experts"], "lora.targets")]
    for extra, name in bad:
        assert main(["estimate", "memory", "--arch", "tiny", *extra]) == 2
        err = capsys.readouterr().err
        assert name in err and err.count("\n") <= 3, err


def test_the_moe_papers_own_setting_plans(capsys):
    """Rank 16 on the experts and the router: through peft on transformers 5 (fused experts,
    merged adapters) no batch fits an 80 GB GPU; in the paper's per-expert layout it does."""
    from archsearch.cli import main

    base = ["estimate", "memory", "--arch", "mixtral-8x7b", "--gpus", "A100-80GB", "--finetune", "qlora",
            "--seq-len", "174", "--lora-rank", "16", "--lora-targets", "experts,router", "--json"]
    assert main(base) == 0
    fused = json.loads(capsys.readouterr().out)
    assert main([*base, "--lora-expert-layout", "per-expert"]) == 0
    per = json.loads(capsys.readouterr().out)
    assert fused["max_training_micro_batch"] == 0 and fused["training"]["total"] > 100 * 2**30
    assert per["max_training_micro_batch"] >= 10 and per["training"]["total"] < 30 * 2**30


def test_estimate_with_the_published_law_and_a_quantised_base(tmp_path, capsys):
    """The issue's case: Mixtral-8x7B with C0 = 82, C1 = 0.95 was refused beside 696 GiB of
    full-training model memory; with --finetune qlora the model term is the NF4 base + adapters."""
    from archsearch.cli import main
    from archsearch.planning.batchlaws import PUBLISHED_MAX_BATCH

    tl = ThroughputLaw(c2=100.0, c3=1.0, c4=200.0, quantity="training tokens/s", device="A100-80GB", n_points=5)
    laws = tmp_path / "laws.json"
    laws.write_text(json.dumps({"throughput": tl.to_dict(), "max_batch": PUBLISHED_MAX_BATCH["xia2024-mixtral"].to_dict()}))
    argv = ["estimate", "--arch", "mixtral-8x7b", "--tokens", "1e6", "--gpus", "A100-80GB", "--seq-len", "174",
            "--batch-laws", str(laws)]
    assert main(argv) == 2
    assert "GiB of model" in capsys.readouterr().err
    assert main(argv + ["--finetune", "qlora", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_laws"]["batch_size"] >= 1 and out["assumptions"]["finetune"].startswith("qlora")
    assert out["assumptions"]["memory_per_device_gib_at_micro_batch_1"] < 30

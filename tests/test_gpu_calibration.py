"""The GPU calibration of the analytic roofline: its form (waves past the KV capacity, per-step and
per-sequence overheads, separate KV efficiency), fitting, the shipped per device x engine files, the
table reader's errors, and calibration applied wherever a prediction is used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from archsearch.arch import ArchSpec, max_batch_by_kv
from archsearch.errors import ArchsearchError

REPO = Path(__file__).resolve().parent.parent
CAL_DIR = REPO / "configs" / "calibration"
TABLE = CAL_DIR / "published-throughput.csv"
SHIPPED = [CAL_DIR / f"{d}-{e}.json" for d in ("h200", "a100-40gb") for e in ("vllm", "sglang")]
LLAMA_1B = ArchSpec(n_layers=16, hidden_size=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, max_position_embeddings=131072,
                    vocab_size=128256, tie_embeddings=True)
LLAMA_3B = ArchSpec(n_layers=28, hidden_size=3072, n_heads=24, n_kv_heads=8, head_dim=128, ffn=8192,
                    vocab_size=128256, tie_embeddings=True)
QWEN_3B = ArchSpec(n_layers=36, hidden_size=2048, n_heads=16, n_kv_heads=2, head_dim=128, ffn=11008,
                   vocab_size=151936, tie_embeddings=True)


def _truth(**kw):
    from archsearch.benchmarks.calibration import Calibration

    base = dict(device="H200", engine="vllm", dtype="bfloat16", compute_efficiency=0.45, memory_efficiency=0.6,
                step_overhead_s=1.5e-3, seq_overhead_s=4e-5, combine="max", peak_flops=989e12,
                memory_bandwidth=4.8e12, kv_efficiency=0.9)
    return Calibration(**{**base, **kw})


def test_batch_beyond_kv_capacity_runs_in_waves_and_says_so():
    from archsearch.benchmarks.analytic import predict_batch
    from archsearch.hardware import Device, get_device

    a100 = get_device("A100-40GB")
    cap = max_batch_by_kv(LLAMA_3B, a100.memory_bytes, 5120, "bfloat16", 0.9)
    at_cap = predict_batch(LLAMA_3B, a100, "bfloat16", cap, 4096, 1024, _truth(device="A100-40GB"))
    two = predict_batch(LLAMA_3B, a100, "bfloat16", 2 * cap, 4096, 1024, _truth(device="A100-40GB"))
    assert at_cap.ok and at_cap.capped_at is None
    # two full waves of `cap` sequences: the same tokens/s as one
    assert two.ok and two.capped_at == cap and "2 waves" in two.note
    assert two.output_throughput == pytest.approx(at_cap.output_throughput, rel=1e-12)
    # a partial last wave costs its steps at a smaller batch: below the full waves' speed
    assert predict_batch(LLAMA_3B, a100, "bfloat16", cap + 1, 4096, 1024).output_throughput < at_cap.output_throughput
    tiny = Device("tiny", 1e12, 1e12, 1e9, memory_gib=1.0, price_per_hour=None, source="test")
    r = predict_batch(LLAMA_3B, tiny, "bfloat16", 1, 4096, 1024)
    assert not r.ok and "not to fit" in r.error


def test_fit_recovers_known_parameters_from_synthetic_points():
    """Points made by a known calibration (a separate KV efficiency, per-step and per-sequence
    overheads, a capped batch among them) are fitted back to its parameters."""
    from archsearch.benchmarks.analytic import predict_batch
    from archsearch.benchmarks.calibration_fit import Point, fit_points
    from archsearch.hardware import get_device

    truth, dev = _truth(), get_device("H200")
    shapes = [LLAMA_1B, LLAMA_3B, QWEN_3B, LLAMA_1B.replace(n_kv_heads=32)]
    pts = [Point(s, b, 4096, 1024, predict_batch(s, dev, "bfloat16", b, 4096, 1024, truth).output_throughput,
                 "H200", "vllm", "bfloat16", "H200", f"s{i}")
           for i, s in enumerate(shapes) for b in (16, 64, 128, 512)]
    fit = fit_points(pts, variant="max+seq+kv")["H200", "vllm", "bfloat16"]
    for f in ("compute_efficiency", "memory_efficiency", "kv_efficiency", "step_overhead_s", "seq_overhead_s"):
        assert getattr(fit, f) == pytest.approx(getattr(truth, f), rel=0.02), f
    assert fit.fit["mape_on_fitted"] < 1e-3
    assert fit.fit["leave_one_shape_out"]["mape"] < 0.01 and fit.fit["leave_one_batch_out"]["mape"] < 0.01


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_calibration_states_its_source_and_reproduces_its_fit(path):
    from archsearch.benchmarks.analytic import predict_batch
    from archsearch.benchmarks.calibration import Calibration
    from archsearch.benchmarks.calibration_fit import file_name, read_throughput_table
    from archsearch.hardware import get_device

    cal = Calibration.load(path)
    assert file_name(cal.device, cal.engine) == path.name
    assert cal.source["path"].endswith("published-throughput.csv") and cal.source["tables"]
    pts, source = read_throughput_table(TABLE)
    assert source["sha256"] == cal.source["sha256"]
    mine = [p for p in pts if (p.device, p.engine) == (cal.device, cal.engine)]
    assert len(mine) == cal.fit["n_batches"] == len(cal.fit["rows"])
    dev = get_device(cal.device)
    for p, row in zip(mine, cal.fit["rows"]):
        assert (row["model"], row["batch_size"], row["measured"]) == (p.label, p.batch, p.measured)
        q = predict_batch(p.spec, dev, p.dtype, p.batch, p.input_len, p.output_len, cal).output_throughput
        assert q == pytest.approx(row["predicted"], rel=1e-9)
    for held in ("leave_one_shape_out", "leave_one_batch_out"):
        h = cal.fit[held]
        assert h["mape"] == pytest.approx(sum(r["error"] for r in h["rows"]) / len(h["rows"]))
        assert len(h["rows"]) == len(mine)


def test_shipped_h200_vllm_held_out_errors_recomputed():
    """The stated leave-one-shape-out and leave-one-batch-out errors come back from the table, to 0.3
    points. A fit without batch 128 is ill-conditioned (its Jacobian's condition ~1e9): the smaller
    batches are memory-bound under ``max``, so they do not tell H200's compute efficiency, which batch 128
    needs; where the fit stops along that direction moves with the CPU's rounding. Seen: 2.60% stated
    (fitted on another machine), 2.66% refitted on an AMD EPYC; starts 1e-6 apart move it by up to 0.15
    points. The fits on the whole table, the shipped coefficients, agree to 1e-5 between the two."""
    from archsearch.benchmarks.calibration import Calibration
    from archsearch.benchmarks.calibration_fit import held_out_errors, model_variants, read_throughput_table, shape_key, table_devices

    cal = Calibration.load(CAL_DIR / "h200-vllm.json")
    pts, _ = read_throughput_table(TABLE)
    devices = table_devices(pts)
    v = next(v for v in model_variants(pts, devices) if v.name == cal.fit["variant"])
    for held, key in (("leave_one_shape_out", shape_key), ("leave_one_batch_out", lambda p: p.batch)):
        rows = [r for r in held_out_errors(pts, v, devices, key)["rows"] if (r["device"], r["engine"]) == ("H200", "vllm")]
        assert sum(r["error"] for r in rows) / len(rows) == pytest.approx(cal.fit[held]["mape"], abs=0.003)


def test_calibrated_kv_reduction_is_smaller_than_the_roofline_says():
    """LLaMA-3.2-3B vs Qwen2.5-3B on H200/vLLM at batch 128 (published: x1.50): the roofline's x2.09
    overstates what fewer KV heads buy; the shipped calibration comes within 10%."""
    from archsearch.benchmarks.analytic import predict_batch
    from archsearch.benchmarks.calibration import Calibration
    from archsearch.hardware import get_device

    cal, dev = Calibration.load(CAL_DIR / "h200-vllm.json"), get_device("H200")

    def ratio(c):
        return (predict_batch(QWEN_3B, dev, "bfloat16", 128, 4096, 1024, c).output_throughput
                / predict_batch(LLAMA_3B, dev, "bfloat16", 128, 4096, 1024, c).output_throughput)
    assert ratio(None) > 2.0
    assert ratio(cal) == pytest.approx(6470 / 4311.43, rel=0.10)


@pytest.mark.parametrize("edit, field", [
    (lambda rows: [{k: v for k, v in r.items() if k != "n_kv_heads"} for r in rows], "columns"),
    (lambda rows: [{**r, "device": "H300"} for r in rows], "device"),
    (lambda rows: [{**r, "output_tokens_per_s": "fast"} for r in rows], "output_tokens_per_s"),
    (lambda rows: [{**r, "batch_size": "16.5"} for r in rows], "batch_size"),
])
def test_bad_table_names_the_field(tmp_path, edit, field):
    import csv

    from archsearch.benchmarks.calibration_fit import read_throughput_table

    with open(TABLE) as fh:
        rows = edit(list(csv.DictReader(fh)))
    bad = tmp_path / "bad.csv"
    with open(bad, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(ArchsearchError) as e:
        read_throughput_table(bad)
    assert e.value.field.endswith(field) and "bad.csv" in e.value.field


def test_calibrate_command_writes_one_file_per_device_and_engine(tmp_path):
    """The command on a table (here: one setup's rows, one form) writes <device>-<engine>.json."""
    import csv

    from archsearch.benchmarks.calibration import Calibration
    from archsearch.benchmarks.calibration_fit import main

    with open(TABLE) as fh:
        rows = [r for r in csv.DictReader(fh) if r["device"] == "H200" and r["engine"] == "sglang"]
    small = tmp_path / "t.csv"
    with open(small, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main(["--table", str(small), "--variant", "max+seq", "--out-dir", str(tmp_path)]) == 0
    cal = Calibration.load(tmp_path / "h200-sglang.json")
    assert cal.fit["variant"] == "max+seq" and cal.source["path"] == str(small) and cal.fit["n_batches"] == 8


# -- calibration applied wherever a prediction is used --------------------------------------

def _analytic_measure_cfg(**kw):
    from archsearch.configio import from_dict
    from archsearch.search.config import MeasureConfig

    bench = {"backend": "analytic", "device_spec": "H200", "batch_sizes": [128], "dtype": "bfloat16"}
    own = {k: kw.pop(k) for k in list(kw) if k not in bench}  # the measure block's own settings
    return from_dict(MeasureConfig, {"bench": {**bench, **kw}, **own}, "measure")


def test_study_measurement_applies_its_calibration():
    from archsearch.benchmarks import measure

    cal = str(CAL_DIR / "h200-vllm.json")
    plain = measure(LLAMA_1B, _analytic_measure_cfg().bench_settings("analytic"))
    calibrated = measure(LLAMA_1B, _analytic_measure_cfg(calibration=cal).bench_settings("analytic"))
    assert calibrated.throughput(128) < 0.6 * plain.throughput(128)
    c = calibrated.to_dict()
    assert "h200-vllm.json" in json.dumps(c) and "fitted on" in json.dumps(c)


def test_calibration_of_another_device_or_engine_is_refused_at_config_load():
    for kw in ({"device_spec": "A100-40GB"}, {"backend": "sglang", "device_spec": None}):
        with pytest.raises(ArchsearchError) as e:
            _analytic_measure_cfg(calibration=str(CAL_DIR / "h200-vllm.json"), **kw)
        assert e.value.field == "measure.calibration"
    _analytic_measure_cfg(backend="vllm", device_spec=None, calibration=str(CAL_DIR / "h200-vllm.json"))


def _rehearsal(tmp_path, calibration: str | None):
    import yaml

    from archsearch.search.config import load_study_config

    raw = yaml.safe_load((REPO / "configs" / "paper-1b-rehearsal.yaml").read_text())
    raw["law"]["file"] = str(REPO / raw["law"]["file"])
    raw["measure"].pop("calibration", None)
    if calibration:
        raw["measure"]["calibration"] = calibration
    p = tmp_path / f"c{bool(calibration)}.yaml"
    p.write_text(yaml.safe_dump(raw))
    return load_study_config(p)


def test_seed_ranking_and_dry_run_plan_use_the_calibration(tmp_path):
    from archsearch.laws import load_law
    from archsearch.search.dryrun import measurement_cost
    from archsearch.search.context import SearchContext
    from archsearch.search.resolved import derive
    from archsearch.search.solution import analytic_throughput_fn, calibration_label

    cal = str(CAL_DIR / "h200-vllm.json")
    plain, calibrated = _rehearsal(tmp_path, None), _rehearsal(tmp_path, cal)
    speeds = []
    for cfg in (plain, calibrated):
        ctx = SearchContext(study=derive(cfg), law=load_law(cfg.law.file), target_loss=100.0, measurer=None,
                            out=tmp_path)
        assert ctx.build.vocab_size == 128256
        speeds.append(analytic_throughput_fn(ctx, "H200")(LLAMA_1B))
    assert speeds[1] < 0.6 * speeds[0]
    label = calibration_label(cal)
    assert "h200-vllm.json" in label and "fitted on 11 measured batches" in label
    # the dry run prices the batches of a real engine with the calibration
    import dataclasses

    costs = [measurement_cost(dataclasses.replace(c, measure=dataclasses.replace(c.measure, bench=dataclasses.replace(c.measure.bench, backend="vllm"))), "H200", 1)
             for c in (plain, calibrated)]
    assert costs[1]["predicted_output_tokens_per_s"] < 0.6 * costs[0]["predicted_output_tokens_per_s"]
    assert any("h200-vllm.json" in a and "fitted on" in a for a in costs[1]["assumptions"])


def test_bench_analytic_with_calibration_names_it(tmp_path, capsys):
    """The command in this process (a subprocess each would import the engine three times)."""
    from archsearch.cli import main

    out = []
    for extra in ([], ["--calibration", str(CAL_DIR / "h200-vllm.json")]):
        rc = main(["bench", "--arch", "llama-3.2-1b", "--backend", "analytic", "--device-spec", "H200",
                   "--batch-sizes", "128", "--input-len", "4096", "--output-len", "1024", "--dtype", "bfloat16",
                   "--out", str(tmp_path / f"{len(extra)}.jsonl"), *extra])
        assert rc == 0, capsys.readouterr().err
        out.append(json.loads((tmp_path / f"{len(extra)}.jsonl").read_text().splitlines()[0]))
    tput = [o["per_batch"][0]["output_throughput"] for o in out]
    assert tput[1] < 0.6 * tput[0]
    assert "fitted on" in json.dumps(out[1]) and "uncalibrated" in json.dumps(out[0])
    capsys.readouterr()
    rc = main(["bench", "--arch", "llama-3.2-1b", "--backend", "analytic", "--device-spec", "H200",
               "--batch-sizes", "128", "--calibration", str(CAL_DIR / "h200-vllm.json")])
    stdout = capsys.readouterr().out
    assert rc == 0 and "calibrated: " in stdout and "h200-vllm.json" in stdout


def test_cpu_prediction_is_deterministic_across_processes(tmp_path):
    """The CPU's peak is measured once into a machine profile and read back by the next process."""
    code = ("from archsearch.hardware import get_device; d = get_device('cpu'); "
            "print(repr((d.peak_flops_fp32, d.memory_bandwidth)))")
    env = {**os.environ, "ARCHSEARCH_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout
    (profile,) = (tmp_path / "machine").glob("cpu-*.json")
    assert str(profile) in json.loads(profile.read_text())["device"]["source"]


def test_a_refitted_calibration_re_keys_analytic_measurements(tmp_path):
    """Stored predictions follow the calibration's content: the same file name refitted is a new key."""
    import shutil

    from archsearch.search.measurements import key_settings

    path = tmp_path / "cal.json"
    shutil.copy(CAL_DIR / "h200-vllm.json", path)
    before = key_settings(_analytic_measure_cfg(calibration=str(path)), "analytic")
    d = json.loads(path.read_text())
    path.write_text(json.dumps({**d, "seq_overhead_s": d["seq_overhead_s"] * 2}))
    assert key_settings(_analytic_measure_cfg(calibration=str(path)), "analytic") != before

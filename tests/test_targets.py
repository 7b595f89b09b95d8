"""Deployment targets (archsearch.search.targets): the config and its errors, the aggregate
objective, and a two-target study end to end on analytic targets (the GQA walk and the seed
ranking included)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from archsearch.errors import ArchsearchError
from tests.test_search import load, study_config


CAL = "configs/calibration/h200-vllm.json"
TWO = [{"name": "h100-small", "backend": "analytic", "device_spec": "H100", "batch_size": 8},
       {"name": "a100-big", "backend": "analytic", "device_spec": "A100-40GB", "batch_sizes": [4, 32],
        "input_len": 128, "weight": 2.0}]


def targets_config(tmp_path, targets=TWO, **optuna):
    return study_config(tmp_path, measure={"targets": targets}, optuna={"n_shapes": 6, "seed": 1,
                                                                         "enqueue_solution": 2, **optuna})


@pytest.mark.parametrize("targets, field", [
    ([TWO[0], {**TWO[1], "name": "h100-small"}], "measure.targets[1].name"),
    ([{**TWO[0], "weight": 0}], "measure.targets[0].weight"),
    ([{**TWO[0], "backend": "tgi"}], "measure.targets[0].backend"),
    ([{**TWO[0], "device_spec": "H900"}], "measure.targets[0].device_spec"),
    ([{**TWO[0], "calibration": CAL}], "measure.targets[0].calibration"),  # an H200 calibration on an H100
    ([TWO[0], {**TWO[1], "backend": "vllm", "device_spec": None, "calibration": CAL}],
     "measure.targets[1].calibration"),  # a measured target takes no calibration
    ([{**TWO[1], "batch_size": 16}], "measure.targets[0].batch_size"),
    ([{**TWO[0], "input_len": 0}], "measure.targets[0].input_len"),
    ([{"backend": "analytic"}], "measure.targets[0].name"),
    ([], "measure.targets"),
])
def test_bad_targets_named_at_load(tmp_path, targets, field):
    with pytest.raises(ArchsearchError) as e:
        load(targets_config(tmp_path, targets))
    assert e.value.field == field, e.value


def test_bad_target_objective(tmp_path):
    with pytest.raises(ArchsearchError) as e:
        load(targets_config(tmp_path, target_objective="mean"))
    assert e.value.field == "optuna.target_objective"


def test_target_takes_the_measure_block_where_it_says_nothing(tmp_path):
    from archsearch.search.deployment import target_measure

    cfg = load(targets_config(tmp_path))
    small, big = (target_measure(cfg.measure, t) for t in cfg.measure.targets)
    assert (small.bench.device_spec, small.bench.batch_sizes, small.ref_batch, small.bench.input_len) == ("H100", [8], 8, 64)
    assert (big.bench.device_spec, big.bench.batch_sizes, big.ref_batch, big.bench.input_len) == ("A100-40GB", [4, 32], 32, 128)
    assert small.bench.output_len == big.bench.output_len == cfg.measure.bench.output_len and small.targets is None


def test_no_targets_keys_measurements_as_before(tmp_path):
    from archsearch.search.measurements import key_settings

    cfg = load(study_config(tmp_path))
    assert cfg.measure.targets is None and "targets" not in key_settings(cfg.measure, "analytic")


def test_aggregates():
    from archsearch.search.targets import aggregate, combine

    assert aggregate([1.2, 0.9, 1.5], [1, 1, 1], "worst") == pytest.approx(0.9)
    assert aggregate([1.2, 0.9, 1.5], [1, 5, 1], "worst") == pytest.approx(0.9)  # weights do not soften it
    assert aggregate([2.0, 0.5], [1, 1], "geomean") == pytest.approx(1.0)
    assert aggregate([2.0, 0.5], [3, 1], "geomean") == pytest.approx(math.exp((3 * math.log(2) + math.log(0.5)) / 4))
    assert aggregate([1.3, None], [1, 1], "geomean") == 0.0  # a target that failed cannot be averaged away
    rows = [{"target": "a", "weight": 1.0, "ratio": 1.3, "lo": 1.2, "hi": 1.4, "n": 6},
            {"target": "b", "weight": 1.0, "ratio": 1.1, "lo": 0.95, "hi": 1.25, "n": 4}]
    c = combine(rows, "worst", 0.9)
    assert (c["ratio"], c["lo"], c["hi"], c["binding"], c["n"]) == (1.1, 0.95, 1.25, "b", 4)
    assert not c["significantly_faster"] and c["per_target"] == rows


@pytest.mark.rendered_figures  # plots/targets.png, drawn by no other test
def test_two_target_study_end_to_end(tmp_path):
    from optuna.trial import TrialState

    from archsearch.search import pipeline
    from archsearch.search.context import search_context
    from archsearch.search.study import create_study
    from archsearch.search.targets import aggregate, predicted_ratio_fn

    cfg = load(targets_config(tmp_path, target_objective="geomean", n_shapes=4))
    out = cfg.out_dir()
    pipeline.run(cfg, out)
    s = json.loads((out / "summary.json").read_text())
    t = s["targets"]
    assert [x["name"] for x in t["targets"]] == ["h100-small", "a100-big"] and t["objective"] == "geomean"
    rows = t["answer"]["per_target"]
    assert [r["target"] for r in rows] == ["h100-small", "a100-big"]
    assert all(r["source"] == "predicted" and r["lo"] == r["hi"] == r["ratio"] for r in rows)
    assert [r["batch_size"] for r in rows] == [8, 32]
    assert t["answer"]["ratio"] == pytest.approx(aggregate([r["ratio"] for r in rows], [1.0, 2.0], "geomean"))
    assert t["answer"]["binding"] == min(rows, key=lambda r: r["ratio"])["target"]
    report = (out / "report.md").read_text()
    assert "## Deployment targets" in report and "| answer | x" in report and "(pred.)" in report

    # every measured trial: its objective is the aggregate of its per-target ratios, both recorded
    ctx = search_context(cfg, out)
    study, _ = create_study(ctx, load_only=True)
    measured = [x for x in study.get_trials(states=(TrialState.COMPLETE,)) if x.user_attrs.get("target_ratios")]
    assert measured
    for x in measured:
        r = x.user_attrs["target_ratios"]
        assert set(r) == {"h100-small", "a100-big"}
        assert x.value == pytest.approx(aggregate([r["h100-small"], r["a100-big"]], [1.0, 2.0], "geomean"))
    import csv

    with open(out / "trials.csv") as fh:
        rows_csv = [r for r in csv.DictReader(fh) if r.get("binding_target")]
    assert rows_csv and all(float(r["objective"]) == pytest.approx(aggregate(
        [float(r["target_h100-small_ratio"]), float(r["target_a100-big_ratio"])], [1.0, 2.0], "geomean"))
        and r["target_a100-big_source"] == "predicted" for r in rows_csv)
    # one measurement per target per compared group: the targets keep their measurements apart
    recs = [json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines()]
    batches = {tuple(rec["result"]["settings"]["batch_sizes"]) for rec in recs if rec["result"].get("settings")}
    assert batches == {(8,), (4, 32)}
    # the local GQA search walked on the same aggregate
    g = json.loads((out / "gqa.json").read_text())
    walked = [st for st in g["steps"] if st.get("ratio")]
    assert walked and all(len(st["ratio"]["per_target"]) == 2 for st in walked)
    # the seed ranking's aggregate is the same function of the targets' predicted ratios
    fn = predicted_ratio_fn(ctx)
    spec = ctx.baseline.replace(n_kv_heads=max(1, ctx.baseline.n_kv_heads // 2),
                                n_heads=ctx.baseline.n_heads) if ctx.baseline.n_kv_heads > 1 else ctx.baseline
    assert fn(ctx.baseline) == pytest.approx(1.0)
    assert fn(spec) > 0


def test_targets_rehearsal_config_validates(cli):
    r = cli("search", "--config", "configs/paper-1b-targets-rehearsal.yaml", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr


def test_two_measured_engine_targets_with_fake_engines(tmp_path, monkeypatch):
    """Two targets measured by real-engine code paths (the paired runner in its own process), the
    engines themselves the project's fakes: both targets measured, with intervals, none predicted."""
    from archsearch.benchmarks.base import BACKENDS
    from archsearch.search import measurements as measure_mod
    from archsearch.search import pipeline

    monkeypatch.setitem(BACKENDS, "vllm", "tests.fakes:SleepBackend")
    monkeypatch.setitem(BACKENDS, "hf", "tests.fakes:SleepBackend")
    monkeypatch.setattr(measure_mod, "_ENGINE_MODULE", {})  # the fakes stand in for any engine installed here
    targets = [{"name": "cpu-vllm", "backend": "vllm", "batch_size": 2},
               {"name": "cpu-hf", "backend": "hf", "batch_size": 1}]
    cfg = study_config(tmp_path, measure={"targets": targets, "bench": {"device_spec": None, "dtype": "float32"},
                                          "paired": {"min_rounds": 2, "max_rounds": 3}},
                       optuna={"n_shapes": 2, "seed": 1, "enqueue_solution": 1}, gqa_search={"enabled": False})
    cfg = load(cfg)
    out = cfg.out_dir()
    pipeline.run(cfg, out)
    s = json.loads((out / "summary.json").read_text())
    rows = s["targets"]["answer"]["per_target"] or s["targets"]["pareto"][0]["per_target"]
    assert [r["target"] for r in rows] == ["cpu-vllm", "cpu-hf"]
    assert all(r["source"] == "measured" and r["lo"] <= r["ratio"] <= r["hi"] and r["n"] >= 2 for r in rows)
    assert [r["batch_size"] for r in rows] == [2, 1]
    # the Deployment targets table's rows: shape, 2 targets, aggregate, binding target
    table = [line for line in (out / "report.md").read_text().splitlines()
             if line.startswith(("| answer ", "| trial ")) and line.count("|") == 6]
    assert table and all("(pred.)" not in line and line.count("[") == 3 for line in table)


def test_demo_cpu_targets_config_loads():
    from archsearch.search.config import load_study_config

    cfg = load_study_config("configs/demo-cpu-targets.yaml")
    assert [(t.name, t.backend) for t in cfg.measure.targets] == [("cpu-vllm", "vllm"), ("cpu-hf", "hf")]


def test_plan_prices_every_target(tmp_path, cli):
    targets = [{"name": "gpu-vllm", "backend": "vllm", "batch_size": 8},
               {"name": "gpu-sglang", "backend": "sglang", "batch_size": 4, "device_spec": "A100-40GB"},
               {"name": "predicted", "backend": "analytic", "device_spec": "H200", "batch_size": 8}]
    cfg = study_config(tmp_path, measure={"targets": targets})
    r = cli("search", "--config", cfg["_path"], "--dry-run", "--json", "--gpus", "1xH100")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["compute"]["measure"]
    per = m["targets"]
    assert set(per) == {"gpu-vllm", "gpu-sglang", "predicted"}
    assert per["gpu-sglang"]["device"] == "A100-40GB" and per["gpu-vllm"]["device"] == "H100-SXM"
    assert per["predicted"]["gpu_hours"]["high"] == 0.0 and per["gpu-vllm"]["gpu_hours"]["high"] > 0
    assert m["gpu_hours"]["high"] == pytest.approx(sum(p["gpu_hours"]["high"] for p in per.values()))


WORKLOAD_TARGETS = [
    {"name": "chat-h200", "workload": "chat", "device_spec": "H200", "calibration": CAL},
    {"name": "batch-h200", "workload": "offline-4k-1k", "device_spec": "H200", "calibration": CAL, "batch_size": 16,
     "input_len": 512, "output_len": 128},
    {"name": "one-user", "workload": "single-stream", "device_spec": "H200", "calibration": CAL, "input_len": 256,
     "output_len": 64},
]


def test_workload_targets_set_backend_batching_and_objective(tmp_path):
    """A target naming a workload takes its batching, lengths (its own override them), backend and objective,
    states that objective, and its paired comparison compares the objective's figure."""
    from archsearch.arch import ArchSpec
    from archsearch.benchmarks.analytic import predicted_job
    from archsearch.benchmarks.simulator import load_from_settings, simulate
    from archsearch.benchmarks.workloads import WORKLOADS
    from archsearch.search.deployment import target_measure
    from archsearch.search.measurements import MeasurementStore, Measurer, key_settings
    from archsearch.search.targets import describe_target

    cfg = load(targets_config(tmp_path, WORKLOAD_TARGETS))
    chat, batch, one = (target_measure(cfg.measure, t) for t in cfg.measure.targets)
    assert (chat.objective, chat.bench.backend, chat.bench.engine_args["rate"]) == ("goodput", "simulated", 48.0)
    assert chat.bench.engine_args["slo"] == {"ttft_s": 1.0, "tpot_s": 0.01} and chat.bench.input_len == 1024
    assert (batch.objective, batch.bench.backend, batch.ref_batch, batch.bench.input_len) == ("throughput", "analytic",
                                                                                              16, 512)
    assert (one.objective, one.bench.backend, one.ref_batch, one.bench.output_len) == ("latency", "analytic", 1, 64)
    assert "objective goodput" in describe_target(cfg.measure.targets[0], chat)
    assert "objective latency" in describe_target(cfg.measure.targets[2], one)
    assert key_settings(chat, "simulated")["objective"] == "goodput"
    assert "objective" not in key_settings(batch, "analytic")  # throughput keys as before
    # the chat target's paired comparison holds goodput (fewer requests, for a quick test)
    base = ArchSpec(n_layers=16, hidden_size=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, vocab_size=128256)
    other = base.replace(n_kv_heads=2)
    m = dataclasses.replace(chat, bench=dataclasses.replace(chat.bench, engine_args={**chat.bench.engine_args,
                                                                                      "n_requests": 60}))
    pr = Measurer(m, MeasurementStore(tmp_path / "m.jsonl")).compare([base, other]).result
    assert pr.ok and pr.predicted and pr.settings["objective"] == "goodput"
    s = m.bench_settings("simulated").to_dict()
    spec, device, dtype, cal, _ = predicted_job({"arch": other.to_dict(), "settings": s})
    assert pr.rounds[0][1] == pytest.approx(simulate(spec, device, dtype, load_from_settings(s, 256), cal).goodput)
    assert WORKLOADS["chat"].objective == "goodput"


@pytest.mark.parametrize("target, field", [
    ({"name": "x", "workload": "batchy", "device_spec": "H200"}, "measure.targets[0].workload"),
    ({"name": "x", "workload": "chat", "backend": "vllm"}, "measure.targets[0].backend"),
])
def test_bad_workload_targets_named_at_load(tmp_path, target, field):
    with pytest.raises(ArchsearchError) as e:
        load(targets_config(tmp_path, [target]))
    assert e.value.field == field, e.value



@pytest.mark.parametrize("device, fragment", [("cpu", "slo.tpot_s"), ("A40", "rates")])
def test_online_target_no_shape_can_meet_is_refused_before_work(tmp_path, device, fragment):
    """A workload served online whose SLO is below one decode step of the baseline alone, or whose rate is
    above the baseline's predicted saturation on the target's device, is refused naming the target's
    workload, what fails and the bound (archsearch.benchmarks.online.check_feasible); H200 holds it."""
    from archsearch.arch import ArchSpec
    from archsearch.search.checks import check_online_targets
    from archsearch.search.targets import study_views

    base = ArchSpec(n_layers=16, hidden_size=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192, vocab_size=128256)
    ok = load(targets_config(tmp_path, [{"name": "chat", "workload": "chat", "device_spec": "H200"}]))
    check_online_targets(study_views(ok), base)
    cfg = load(targets_config(tmp_path, [{"name": "chat", "workload": "chat", "device_spec": device}]))
    with pytest.raises(ArchsearchError) as e:
        check_online_targets(study_views(cfg), base)
    assert e.value.field == "measure.targets[0].workload" and e.value.problem.startswith(fragment), e.value
    assert "faster device_spec" in e.value.fix

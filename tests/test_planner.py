"""The constraint-driven planner (archsearch.planning.planner, ``archsearch plan``)."""

from __future__ import annotations

import json

import pytest

from archsearch.arch import write_hf_config
from archsearch.benchmarks.base import BatchResult, BenchResult
from archsearch.errors import ArchsearchError
from archsearch.planning import planner as pl
from archsearch.planning.limits import Limits
from archsearch.planning.lora import LoraSettings, lora_params
from archsearch.presets import get_preset


def _fake_measure(calls: list, tpot_per_param: float = 1e-8):
    """A stand-in engine: TPOT grows with parameters and batch, memory with parameters."""
    def measure(spec, settings, model_path=None):
        from archsearch.arch import total_params

        calls.append((spec.name if spec else model_path, tuple(settings.batch_sizes), settings.input_len, settings.output_len))
        n = total_params(spec)
        per = [BatchResult(batch_size=b, ok=True, ttft_mean=n * 1e-9 * settings.input_len * b,
                           tpot_mean=n * tpot_per_param * (1 + 0.1 * b), peak_memory_bytes=n * 4 * 2,
                           output_throughput=b / (n * tpot_per_param)) for b in settings.batch_sizes]
        return BenchResult("hf", "x", "cpu: test", "float32", settings.to_dict(), {}, per)
    return measure


def test_lora_step_flops_is_four_n_plus_six_adapters():
    from archsearch.planning.time import compute_params

    spec = get_preset("smollm2-135m")
    lora = LoraSettings(rank=8)
    assert pl.lora_step_flops(spec, lora, 1000) == 1000 * (4 * compute_params(spec) + 6 * lora_params(spec, lora))
    # with the sequence length: attention's score and value matmuls, 6 L S dq per token (as full training)
    assert pl.lora_step_flops(spec, lora, 1000, 128) == pytest.approx(
        pl.lora_step_flops(spec, lora, 1000) + 1000 * 6 * spec.n_layers * 128 * spec.q_dim)
    t = pl.predict_lora_step_time(spec, lora, 2, 128, device="H100", mfu=0.5)
    assert t["step_s"] == pytest.approx(t["flops_per_step"] / (0.5 * t["peak_flops"]))
    assert t["calibrated"] is False and t["method"].startswith("uncalibrated")


def test_calibrated_step_time_scales_by_flops_and_checks_the_device(tmp_path):
    spec, big = get_preset("smollm2-135m"), get_preset("smollm2-360m")
    lora, lora_all = LoraSettings(rank=8), LoraSettings(16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"))
    cal = pl.LoraCalibration.from_step(spec, lora, 2, 128, step_s=2.0, device="cpu", measured={"model": "m"},
                                       provenance={"time_utc": "2026-01-01T00:00:00+00:00"})
    assert cal.achieved_flops == pytest.approx(pl.lora_step_flops(spec, lora, 256, 128) / 2.0)
    # the calibration configuration is predicted exactly; others by their FLOPs
    assert pl.predict_lora_step_time(spec, lora, 2, 128, "cpu", calibration=cal)["step_s"] == pytest.approx(2.0)
    t = pl.predict_lora_step_time(big, lora_all, 4, 256, "cpu", calibration=cal)
    assert t["calibrated"] is True and "calibrated: " in t["method"] and "2026-01-01" in t["method"]
    assert t["step_s"] == pytest.approx(2.0 * pl.lora_step_flops(big, lora_all, 1024, 256)
                                        / pl.lora_step_flops(spec, lora, 256, 128))
    back = pl.LoraCalibration.load(cal.save(tmp_path / "cal.json"))
    assert back == cal
    with pytest.raises(ArchsearchError) as e:  # a CPU calibration does not predict a GPU
        pl.predict_lora_step_time(spec, lora, 2, 128, "H100", calibration=cal)
    assert e.value.field == "--lora-calibration"
    with pytest.raises(ArchsearchError) as e:
        pl.predict_lora_step_time(spec, lora, 2, 128, "cpu", mfu=0.3, calibration=cal)
    assert e.value.field == "--mfu"
    (tmp_path / "bad.json").write_text('{"kind": "plan"}')
    with pytest.raises(ArchsearchError) as e:
        pl.LoraCalibration.load(tmp_path / "bad.json")
    assert "not a LoRA calibration" in str(e.value)
    with pytest.raises(ArchsearchError) as e:
        pl.LoraCalibration(achieved_flops=-1.0, device="cpu", step_s=1.0, flops_per_step=1.0, measured={})
    assert e.value.field == "lora_calibration.achieved_flops"


def test_candidates_resolve_presets_folders_and_study_chosen(tmp_path):
    spec = get_preset("tiny")
    write_hf_config(spec, tmp_path / "study" / "chosen")
    (tmp_path / "study" / "config.json").write_text("{}")  # the study's own config, not a model
    write_hf_config(spec, tmp_path / "hf")
    assert pl.resolve_option("tiny").source == "preset tiny"
    assert pl.resolve_option(str(tmp_path / "study")).source.startswith("study chosen/")
    c = pl.resolve_option(str(tmp_path / "hf"))
    assert c.model_path is None  # a config without weights is measured with dummy weights
    with pytest.raises(ArchsearchError, match="--candidates"):
        pl.resolve_option(str(tmp_path / "nothing"))


def test_grid_is_measured_once_and_resumes(tmp_path):
    cands = [pl.resolve_option("tiny"), pl.resolve_option("smollm2-135m")]
    grid = pl.PlanGrid((1, 2), (16,), (4, 8))
    calls: list = []
    kw = {"backend": "hf", "repeats": 1}
    pl.measure_grid(cands, grid, kw, tmp_path, progress=lambda s: None, measure_fn=_fake_measure(calls))
    assert len(calls) == 4  # 2 candidates x 2 (prefill, decode) pairs, each over both batch sizes
    calls.clear()
    pl.measure_grid(cands, grid, kw, tmp_path, progress=lambda s: None, measure_fn=_fake_measure(calls))
    assert calls == []  # every point is already in measurements.jsonl
    bigger = pl.PlanGrid((1, 2, 4), (16,), (4, 8))
    done = pl.measure_grid(cands, bigger, kw, tmp_path, progress=lambda s: None, measure_fn=_fake_measure(calls))
    assert sorted(c[1] for c in calls) == [(4,)] * 4  # only the new batch size
    recs = [json.loads(l) for l in (tmp_path / pl.MEASUREMENTS).read_text().splitlines()]
    assert all(r["provenance"] == {} or "versions" in r["provenance"] for r in recs)
    assert set(done[pl._key(cands[0], "hf", 16, 4)]) == {1, 2, 4}


def _plans(tmp_path, limits, ft=None):
    cands = [pl.resolve_option("tiny"), pl.resolve_option("smollm2-135m")]
    grid = pl.PlanGrid((1, 4), (16,), (4,))
    done = pl.measure_grid(cands, grid, {"backend": "hf"}, tmp_path, progress=lambda s: None,
                           measure_fn=_fake_measure([]))
    ft = ft or pl.FinetunePlan(tokens=1e4, seq_len=64, device="H100")
    return [pl.plan_option(c, grid, done, "hf", limits, ft) for c in cands], ft


def test_recommends_the_largest_within_limits(tmp_path):
    plans, ft = _plans(tmp_path, Limits())
    assert pl.recommend(plans).name == "smollm2-135m"
    # a TPOT limit between the two models' TPOT leaves only the small one
    tiny_tpot = min(p.tpot_s for p in plans[0].points)
    big_tpot = min(p.tpot_s for p in plans[1].points)
    plans, ft = _plans(tmp_path, Limits(max_tpot_s=(tiny_tpot + big_tpot) / 2))
    best = pl.recommend(plans)
    assert best.name == "tiny" and not plans[1].serves
    assert plans[0].best_point.batch_size == 4  # the most tokens/s among points within limits


def test_unsatisfiable_limit_names_the_limit_and_best_value(tmp_path):
    plans, ft = _plans(tmp_path, Limits(max_tpot_s=1e-12))
    assert pl.recommend(plans) is None
    (line,) = pl.unsatisfiable(plans, Limits(max_tpot_s=1e-12), ft)
    best = min(p.tpot_s for cp in plans for p in cp.points)
    assert "max_tpot_s" in line and f"{best:.4g}" in line and "tiny" in line


def test_finetune_budget_rules_out_a_candidate(tmp_path):
    plans, _ = _plans(tmp_path, Limits())
    hours = sorted(cp.lora["hours"] for cp in plans)
    ft = pl.FinetunePlan(tokens=1e4, seq_len=64, device="H100", max_hours=(hours[0] + hours[1]) / 2)
    plans, ft = _plans(tmp_path, Limits(), ft)
    assert pl.recommend(plans).name == "tiny"
    assert any("max_finetune_hours" in r for r in plans[1].reasons)


def test_a_non_positive_tpot_is_no_point_within_limits(tmp_path):
    def measure(spec, settings, model_path=None):
        per = [BatchResult(batch_size=b, ok=True, ttft_mean=0.01, tpot_mean=-1e-4, peak_memory_bytes=1,
                           output_throughput=1.0) for b in settings.batch_sizes]
        return BenchResult("hf", "x", "cpu", "float32", settings.to_dict(), {}, per)

    c = pl.resolve_option("tiny")
    grid = pl.PlanGrid((1,), (8,), (4,))
    done = pl.measure_grid([c], grid, {"backend": "hf"}, tmp_path, progress=lambda s: None, measure_fn=measure)
    cp = pl.plan_option(c, grid, done, "hf", Limits(max_tpot_s=1.0), pl.FinetunePlan(device="H100"))
    assert not cp.serves and "<= 0" in cp.points[0].reason


def test_bad_grid_and_finetune_values():
    with pytest.raises(ArchsearchError, match="decode_lens"):
        pl.PlanGrid((1,), (16,), (1,))
    with pytest.raises(ArchsearchError, match="batch_sizes"):
        pl.PlanGrid((0,), (16,), (4,))
    with pytest.raises(ArchsearchError, match="max_finetune_hours"):
        pl.FinetunePlan(max_hours=float("nan"))


@pytest.mark.slow
def test_plan_cli_measures_with_hf_and_recommends(tmp_path, capsys):
    """A real engine (transformers) on a tiny grid; the second run measures nothing. The plan's
    figure is built (plot_tradeoff on this plan), unrendered as in every test not marked
    rendered_figures (tests/conftest.py)."""
    pytest.importorskip("transformers")
    from archsearch.cli import main

    argv = ["plan", "--candidates", "tiny", "--batch-sizes", "1,2", "--prefill-lens", "8", "--decode-lens", "16",
            "--repeats", "1", "--warmup", "0", "--torch-threads", "1", "--out", str(tmp_path / "p"),
            "--finetune-tokens", "2000", "--finetune-seq-len", "32", "--calibrate-lora", "--json",
            "--lora-variants", "lora,qlora", "--finetune-batch-sizes", "1,4", "--serve-max-memory-gib", "64",
            "--finetune-max-memory-gib", "8"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"] == "tiny"
    # the search: 2 variants x 2 batch sizes predicted; per variant the largest batch within the limits,
    # of those the fastest (the planner paper's rule: a calibrated batch 1 may be faster, and is not kept)
    search = doc["candidates"][0]["lora"]["search"]
    assert {(x["variant"], x["batch_size"]) for x in search} == {("lora", 1), ("lora", 4), ("qlora", 1), ("qlora", 4)}
    ok = [x for x in search if x["within_limits"]]
    largest = [x for x in ok if x["batch_size"] == max(y["batch_size"] for y in ok if y["variant"] == x["variant"])]
    assert doc["candidates"][0]["lora"]["hours"] == min(x["hours"] for x in largest)
    assert doc["limits"]["serving"]["max_peak_memory_gib"] == 64 and doc["limits"]["finetune"]["max_memory_gib"] == 8
    # the LoRA step time is calibrated on a real peft step measured here, and says so
    lo = doc["candidates"][0]["lora"]
    assert doc["finetune"]["step_time"].startswith("calibrated on each candidate")
    assert lo["time_calibrated"] is True and lo["time_method"].startswith("calibrated: ")
    assert lo["step_time"]["calibration"]["measured"]["model"].startswith("tiny")
    assert (tmp_path / "p" / pl.CALIBRATIONS / "tiny.json").is_file()
    assert "--lora-rank" in doc["finetune_command"]
    pts = doc["candidates"][0]["points"]
    assert len(pts) == 2 and all(p["ok"] and p["tpot_s"] is not None and p["ttft_s"] > 0 for p in pts)
    assert (tmp_path / "p" / "plan.png").is_file() and (tmp_path / "p" / "plan.pdf").is_file()
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert "versions" in plan["provenance"]
    n = len((tmp_path / "p" / pl.MEASUREMENTS).read_text().splitlines())
    assert main(argv) == 0
    assert len((tmp_path / "p" / pl.MEASUREMENTS).read_text().splitlines()) == n


def test_calibrate_lora_measures_each_candidate_once_and_resumes(tmp_path):
    calls = []

    def fake(**kw):  # both points of a candidate in one call (one subprocess), as measure_lora_points
        calls.append(kw)
        if kw["spec"].name == "smollm2-135m":
            raise RuntimeError("LoRA schedule measurement failed (-9): killed")
        return [{"weights": "random", "threads": kw["threads"], "batch": b, "step_cpu_s": [4.0] * 3,
                 "step_wall_s": [3.0, 1.0, 2.0] if b == 1 else [7.0, 5.0, 6.0]} for b in kw["batch_sizes"]]

    cands = [pl.resolve_option("smollm2-135m"), pl.resolve_option("tiny")]
    ft = pl.FinetunePlan(seq_len=512, device="cpu")
    cals = pl.calibrate_lora(cands, ft, tmp_path, threads=1, progress=lambda s: None, measure_fn=fake)
    assert [c["spec"] for c in calls] == [cands[0].spec, cands[1].spec]
    assert [(c["batch_sizes"], c["seq_len"]) for c in calls[1:]] == [((1, 4), 128)]
    assert isinstance(cals["smollm2-135m"], str) and "killed" in cals["smollm2-135m"]  # said, not hidden
    cal = cals["tiny"]
    assert cal.step_s == 2.0 and cal.measured["model"].startswith("tiny") and "time_utc" in cal.provenance
    # the line through (F, 2 s) and (4F, 6 s): 2/3 s of overhead per step, 4/3 s per F
    assert cal.overhead_s == pytest.approx(2 / 3) and len(cal.measured["points"]) == 2
    calls.clear()
    again = pl.calibrate_lora(cands, ft, tmp_path, threads=1, progress=lambda s: None, measure_fn=fake)
    assert again["tiny"] == cal and [c["spec"].name for c in calls] == ["smollm2-135m"]  # tiny read back
    # another rank is another calibration
    other = pl.calibrate_lora(cands[1:], pl.FinetunePlan(lora=LoraSettings(rank=4), device="cpu"), tmp_path,
                              threads=1, progress=lambda s: None, measure_fn=fake)
    assert other["tiny"].measured["rank"] == 4
    grid = pl.PlanGrid((1,), (8,), (4,))
    m = {1: {"ok": True, "ttft_mean": 0.1, "tpot_mean": 0.01, "peak_memory_bytes": 1, "output_throughput": 1.0}}
    plans_ft = pl.FinetunePlan(seq_len=128, batch_size=1, device="H100")
    cp = pl.plan_option(cands[1], grid, {pl._key(cands[1], "hf", 8, 4): m}, "hf", Limits(),
                           pl.FinetunePlan(seq_len=128, batch_size=1, device="cpu"), cal)
    assert cp.lora["time_calibrated"] and cp.lora["step_s"] == pytest.approx(2.0)
    cp = pl.plan_option(cands[0], grid, {pl._key(cands[0], "hf", 8, 4): m}, "hf", Limits(), plans_ft,
                           cals["smollm2-135m"])
    assert not cp.lora["time_calibrated"] and "uncalibrated" in cp.lora["time_method"] and "killed" in cp.lora["time_method"]


def test_two_point_lora_calibration_separates_per_step_overhead():
    """Steps that cost ``0.5 s + F / 1e9`` are predicted exactly from two measured sizes, where a
    one-point calibration at the smaller step over-predicts a larger one; a negative intercept
    (noise) falls back to a line through the origin; equal FLOPs cannot make a line."""
    spec, lora = get_preset("tiny"), LoraSettings(8)
    f = lambda b, s: pl.lora_step_flops(spec, lora, b * s, s)  # noqa: E731
    t = lambda b, s: 0.5 + f(b, s) / 1e9  # noqa: E731
    cal = pl.LoraCalibration.from_steps(spec, lora, [(1, 128, t(1, 128)), (4, 128, t(4, 128))], "cpu", {})
    assert cal.overhead_s == pytest.approx(0.5) and cal.achieved_flops == pytest.approx(1e9)
    big = pl.predict_lora_step_time(spec, lora, 2, 1024, "cpu", calibration=cal)
    assert big["step_s"] == pytest.approx(t(2, 1024)) and "overhead" in big["method"]
    one = pl.LoraCalibration.from_step(spec, lora, 1, 128, t(1, 128), "cpu", {})
    assert pl.predict_lora_step_time(spec, lora, 2, 1024, "cpu", calibration=one)["step_s"] > 1.1 * t(2, 1024)
    back = pl.LoraCalibration.from_steps(spec, lora, [(1, 128, 1.0), (4, 128, 5.0)], "cpu", {})
    assert back.overhead_s == 0.0 and "origin" in back.measured["fit"] and "origin" in back.describe()
    flat = pl.LoraCalibration.from_steps(spec, lora, [(1, 128, 2.0), (4, 128, 1.5)], "cpu", {})
    assert flat.overhead_s == 0.0 and "not slower" in flat.measured["fit"]
    with pytest.raises(ArchsearchError):
        pl.LoraCalibration.from_steps(spec, lora, [(1, 128, 1.0), (1, 128, 2.0)], "cpu", {})
    with pytest.raises(ArchsearchError) as e:
        pl.LoraCalibration(1e9, "cpu", 1.0, 1e9, {}, overhead_s=-1.0)
    assert e.value.field == "lora_calibration.overhead_s"


def _search_plan(**kw):
    base = dict(tokens=2e5, seq_len=128, device="H100", variants=("lora", "qlora"), ranks=(8, 64),
                batch_sizes=(1, 4, 16))
    return pl.FinetunePlan(**{**base, **kw})


def test_search_keeps_the_fastest_configuration_within_the_finetune_limits(tmp_path):
    """Serving and fine-tuning limits apart: a fine-tuning memory limit that only the NF4 base
    meets on the larger model picks QLoRA there, the fastest batch that fits, and leaves serving
    (its own limit, unset) alone."""
    big = get_preset("smollm2-135m")
    every = pl.search_finetune(big, _search_plan())
    assert len(every) == 2 * 2 * 3 and all(x["within_limits"] for x in every)
    least = {v: min(x["peak_memory_gib"] for x in every if x["variant"] == v) for v in ("lora", "qlora")}
    assert least["qlora"] < least["lora"]
    ft = _search_plan(max_memory_gib=(least["lora"] + least["qlora"]) / 2)
    plans, _ = _plans(tmp_path, Limits(), ft)
    cp = plans[1]
    assert cp.name == "smollm2-135m" and cp.finetunes and cp.serves
    lo = cp.lora
    assert lo["variant"] == "qlora" and lo["peak_memory_gib"] <= ft.max_memory_gib
    fits = [x for x in lo["search"] if x["within_limits"]]
    assert lo["hours"] == min(x["hours"] for x in fits)
    assert all(x["variant"] == "qlora" for x in fits)
    cmd, note = pl.finetune_command(cp, pl.resolve_option("smollm2-135m"), ft, tmp_path)
    assert cmd[cmd.index("--global-batch-size") + 1] == str(lo["batch_size"]) and "bitsandbytes" in note


def test_finetune_batch_is_the_largest_within_the_limits():
    """The planner paper's rule: the largest batch that fits the limits, not batch 1 by a tie.
    Uncalibrated, a LoRA fine-tune's hours do not depend on the batch (same FLOPs, fewer steps)
    but for the rounding of the last step, so the fastest alone picked batch 1; the rule picks 16, and under a memory limit that batch
    16 breaks, the largest batch below it."""
    spec = get_preset("smollm2-135m")
    every = pl.search_finetune(spec, _search_plan(variants=("lora",), ranks=(8,)))
    hours = [x["hours"] for x in every]
    assert max(hours) / min(hours) < 1.005   # equal but for the last, partial step: batch 1 won on that
    assert pl.choose_finetune(every)["batch_size"] == 16
    mem = {x["batch_size"]: x["peak_memory_gib"] for x in every}
    capped = pl.search_finetune(spec, _search_plan(variants=("lora",), ranks=(8,), max_memory_gib=(mem[4] + mem[16]) / 2))
    assert pl.choose_finetune(capped)["batch_size"] == 4
    assert "largest batch" in pl.FINETUNE_RULE


def test_unreachable_finetune_limits_name_the_limit_and_the_best_value():
    specs = {"tiny": get_preset("tiny"), "smollm2-135m": get_preset("smollm2-135m")}
    every = [x for s in specs.values() for x in pl.search_finetune(s, _search_plan())]
    best_mem = min(x["peak_memory_gib"] for x in every)
    (line,) = pl.finetune_unreachable(specs, _search_plan(max_memory_gib=best_mem / 2))
    assert line.startswith("finetune_max_memory_gib=") and f"{best_mem:.4g} GiB" in line and "tiny" in line
    # each reachable alone, not together: memory only at batch 1, time only at batch 16 (QLoRA
    # dequantises the base once per step: fewer, larger steps are faster)
    tiny = pl.search_finetune(specs["tiny"], _search_plan(variants=("qlora",)))
    mem = {b: min(x["peak_memory_gib"] for x in tiny if x["batch_size"] == b) for b in (1, 4, 16)}
    hrs = {b: min(x["hours"] for x in tiny if x["batch_size"] == b) for b in (1, 4, 16)}
    assert hrs[16] < hrs[4] < hrs[1] and mem[1] < mem[4] < mem[16]
    both = _search_plan(variants=("qlora",), max_memory_gib=(mem[1] + mem[4]) / 2, max_hours=(hrs[16] + hrs[4]) / 2)
    (line,) = pl.finetune_unreachable({"tiny": specs["tiny"]}, both)
    assert "not together" in line


def test_expert_targets_are_searched_only_where_they_exist():
    ft = _search_plan(target_sets=(("q_proj",), ("q_proj", "experts.down_proj")), variants=("qlora",))
    moe = pl.search_finetune(get_preset("mixtral-8x7b"), ft)
    dense = pl.search_finetune(get_preset("tiny"), ft)
    assert {tuple(x["targets"]) for x in moe} == {("q_proj",), ("q_proj", "experts.down_proj")}
    assert {tuple(x["targets"]) for x in dense} == {("q_proj",)}
    with pytest.raises(ArchsearchError) as e:
        pl.search_finetune(get_preset("tiny"), _search_plan(target_sets=(("experts.down_proj",),)))
    assert e.value.field == "--lora-targets"


@pytest.mark.parametrize("extra,field", [
    (["--max-peak-memory-gib", "4", "--serve-max-memory-gib", "4"], "--max-peak-memory-gib"),
    (["--lora-rank", "8", "--lora-ranks", "8,16"], "--lora-ranks"),
    (["--max-finetune-hours", "1", "--max-finetune-minutes", "20"], "--max-finetune-minutes"),
    (["--lora-variants", "qlora,dora"], "finetune.variants"),
    (["--lora-targets", "experts"], "--lora-targets"),
    (["--finetune-max-memory-gib", "0.0001"], "--finetune-max-memory-gib"),
    (["--max-peak-memory-gib", "0.0001"], "--max-peak-memory-gib"),
    (["--max-finetune-cost", "1", "--finetune-device", "cpu"], "--max-finetune-cost"),
])
def test_plan_cli_refuses_bad_or_unreachable_limits_before_measuring(tmp_path, capsys, extra, field):
    from archsearch.cli import main

    out = tmp_path / "p"
    assert main(["plan", "--candidates", "tiny", "--out", str(out), "--finetune-device", "H100", *extra]) == 2
    err = capsys.readouterr().err
    assert field in err and err.count("\n") <= 3, err
    assert not (out / pl.MEASUREMENTS).exists()

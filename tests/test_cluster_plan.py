"""The dry-run plan tells the whole cost: data needed against data available with
the repetition it implies, the tokenisation's size, disk and time, per-stage GPU-hours and wall
time on the named cluster, measurement time, one FLOP figure per run, assumptions printed."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from archsearch.search.config import load_study_config
from archsearch.cluster.startup import FIGURES
from archsearch.search.dryrun import (CHECKPOINT_BYTES_PER_PARAM, DATA_PROCESSES,
                                    TOKENIZE_TOKENS_PER_S_PER_PROCESS, dry_run, render, run_flops)

# the defaults a plan uses where nothing was measured (no profile, no study record)
JOB_START_S, WORKER_START_S = FIGURES["job_start_s"][0], FIGURES["worker_start_s"][0]
ENGINE_PROCESS_START_S, ENGINE_START_S = FIGURES["engine_process_start_s"][0], {"vllm": FIGURES["engine_start_s.vllm"][0]}

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def paper():
    cfg = load_study_config(REPO / "configs" / "paper-1b.yaml")
    return cfg, dry_run(cfg, Path("unused"), gpus="8xH100")


def test_paper_plan_checks_data_needed_against_available(paper):
    cfg, p = paper
    (d,) = p["data"]  # both sweeps share one source and tokenizer: one tokenisation
    largest = max(r["tokens"] for r in p["compute"]["proxy_runs"])
    assert d["tokens_needed"] == largest and 29e9 < largest < 30e9  # the 297M proxy at 100 N
    assert d["tokens_available"] == 100e9 and d["epochs"] == pytest.approx(largest / 100e9)
    assert d["verdict"].startswith("one pass holds it")
    # a streamed source is tokenized up to the largest budget plus the held-out head, in uint32
    # (LLaMA-3's 128,256 ids do not fit uint16)
    dc = cfg.proxy.sweeps[0].data
    assert d["tokens_to_tokenize"] == largest + dc.val_tokens and d["dtype"] == "uint32"
    assert d["disk_gb"] == pytest.approx(d["tokens_to_tokenize"] * 4 / 1e9)
    assert d["wall_hours"] == pytest.approx(d["tokens_to_tokenize"] / (TOKENIZE_TOKENS_PER_S_PER_PROCESS
                                                                        * d["processes"]) / 3600)
    slurm = replace(cfg, cluster=replace(cfg.cluster, executor="slurm"))
    assert dry_run(slurm, Path("unused"))["data"][0]["processes"] == DATA_PROCESSES


def test_paper_plan_gives_every_stage_its_cost(paper):
    cfg, p = paper
    st = {s["stage"]: s for s in p["stages"]}
    c = p["compute"]
    assert st["proxy"]["gpu_hours"] == pytest.approx(c["proxy_gpu_hours"])
    assert st["proxy"]["wall_hours"] == pytest.approx(c["proxy_wall_hours"] + st["proxy"]["data_wall_hours"])
    # one FLOP figure per run, the one its hours are priced from
    fin = c["final_train"]["assumptions"]
    assert fin["training_flops"] == pytest.approx(c["final_train_flops_per_model"])
    assert st["proxy"]["train_flops"] == pytest.approx(sum(r["train_flops"] for r in c["proxy_runs"]))
    # measurements: the 5 seeds with the baseline in one engine process (a group of 6), then
    # every other shape paired with the baseline, two engine starts; 8 workers share the count
    m = c["measure"]
    n, seeds = cfg.optuna.n_shapes, cfg.optuna.enqueue_solution
    assert st["search"]["measurements_at_most"] == m["measurements"] == n + 7 and m["workers"] == 8
    assert m["seed_group"] == seeds == 5 and m["pairs"] == {"low": n - seeds, "high": n - seeds + 7}
    w, r = cfg.measure.bench.warmup, cfg.measure.paired.min_rounds
    one = lambda k, r: ENGINE_PROCESS_START_S + k * ENGINE_START_S["vllm"] + k * (w + r) * m["batch_seconds"]
    group, per = one(seeds + 1, r), one(2, r)
    assert st["search"]["gpu_hours_low"] == pytest.approx((8 * (WORKER_START_S + group) + (n - seeds) * per) / 3600)
    assert st["search"]["wall_hours_low"] == pytest.approx(
        (WORKER_START_S + group + math.ceil((n - seeds) / 8) * per) / 3600)
    # the GQA search, in the coordinator: first comparison of 2 shapes, then of 3, one after another
    g = m["gqa"]
    assert st["gqa"]["comparisons_at_most"] == len(g["high"]) == 1 + 2 * (g["variants"] - 1) and g["variants"] > 2
    hi = cfg.measure.paired.max_rounds
    assert st["gqa"]["wall_hours"] == pytest.approx((one(2, hi) + (len(g["high"]) - 1) * one(3, hi)) / 3600)
    assert st["gqa"]["gpu_hours"] == st["gqa"]["wall_hours"] and st["gqa"]["wall_hours_low"] < st["gqa"]["wall_hours"]
    # every proxy job starts before it trains, on its GPU
    assert all(r["hours"] > JOB_START_S / 3600 for r in c["proxy_runs"])
    assert st["search"]["gpu_hours"] > st["search"]["gpu_hours_low"]
    # disk: the token shards and every run's checkpoints
    assert p["disk"]["token_shards_gb"] == pytest.approx(p["data"][0]["disk_gb"])
    assert p["disk"]["proxy_checkpoints_gb"] > 12 * 78e6 * 78 / 1e9 * 0.5
    text = "\n".join(render(p))
    for needle in ("needs 2.99e+10 tokens", "holds 1e+11", "uint32",
                   "measurements: search 40-47 shapes (a seed group of 6, then 35-42 pairs)",
                   "GQA search 3-", "GPU-h",
                   "assumption: data: tokenisation at", "engine starts", "bytes a parameter"):
        assert needle in text, needle
    assert CHECKPOINT_BYTES_PER_PARAM == 12


def test_run_flops_is_six_n_d_with_the_output_head():
    from archsearch.arch import active_non_embedding_params
    from archsearch.presets import get_preset

    spec = get_preset("llama-3.2-1b")
    n_c = active_non_embedding_params(spec) + spec.vocab_size * spec.hidden_size
    assert run_flops(spec, 1e9) == pytest.approx(6 * n_c * 1e9)


def test_plan_says_plainly_when_a_source_is_too_small(tmp_path):
    """The CI study's proxies on the offline corpus: fine at its budget; at 2,000 tokens a
    parameter they need several passes, refused unless data.max_epochs allows them."""
    from tests.test_cluster_study import _config

    cfg = load_study_config(_config(tmp_path))
    (d,) = dry_run(cfg, tmp_path / "o")["data"]
    assert d["epochs"] < 1 and d["verdict"].startswith("one pass")
    sweep = cfg.proxy.sweep
    big = replace(sweep, train=sweep.train.replace(tokens_per_param=2000.0))
    cfg2 = replace(cfg, proxy=replace(cfg.proxy, sweep=big))
    (d2,) = dry_run(cfg2, tmp_path / "o")["data"]
    assert d2["epochs"] > 1 and d2["verdict"].startswith("REFUSED before training")
    allowed = replace(big, data=replace(big.data, max_epochs=d2["epochs"] + 1))
    cfg3 = replace(cfg2, proxy=replace(cfg2.proxy, sweep=allowed))
    (d3,) = dry_run(cfg3, tmp_path / "o")["data"]
    assert "allowed by data.max_epochs" in d3["verdict"]


def test_plan_prices_measurements_at_the_measured_scale(paper):
    """measure.params: the shapes are measured rebuilt at N_m, so the batch the plan prices is the
    rebuilt baseline's (a smaller N_m: a shorter batch), and measured shapes take no disk."""
    cfg, p = paper
    small = replace(cfg, measure=replace(cfg.measure, params=2e8))
    q = dry_run(small, Path("unused"), gpus="8xH100")
    m, m0 = q["compute"]["measure"], p["compute"]["measure"]
    assert m["measured_params"] == 2e8 and m["batch_seconds"] < m0["batch_seconds"] / 2
    assert any("rebuilt at measure.params = 2e+08" in a for a in m["assumptions"])
    assert p["disk"]["engine_models_gb"] == 0.0
    # a measured scale the baseline cannot be rebuilt at is refused before any work, naming the field
    from archsearch.errors import ArchsearchError

    with pytest.raises(ArchsearchError) as e:
        dry_run(replace(cfg, measure=replace(cfg.measure, params=1e8)), Path("unused"), gpus="8xH100")
    assert e.value.field == "measure.params" and "baseline cannot be rebuilt" in e.value.problem

    # without seeds_together every shape is a pair
    apart = dry_run(replace(cfg, optuna=replace(cfg.optuna, seeds_together=False)), Path("unused"), gpus="8xH100")
    ma = apart["compute"]["measure"]
    assert ma["seed_group"] == 0 and ma["pairs"] == {"low": 40, "high": 47}


# -- start-ups: measured per machine, read from a profile or the study's own record ----------------

def _study_record(folder: Path, job_start: list[float], proc: list[float]) -> Path:
    """A study folder's startups.json as the proxy and search jobs write it (trainers/jobs.py, search/workers.py) (two coordinator runs)."""
    from archsearch.fileio import write_json

    folder.mkdir(parents=True, exist_ok=True)
    where = {"time_utc": "2026-11-23T16:00:00+00:00", "host": "node7", "git": "x", "device": "H100", "command": "c"}
    write_json(folder / "startups.json", {"kind": "archsearch study start-ups", "runs": [
        {"stage": "proxy", "executor": "slurm", **where,
         "samples": {"job_start_s": job_start, "job_end_s": [2.0] * len(job_start), "proxy_lead_s": [4.0]}},
        {"stage": "search", "executor": "slurm", **where,
         "samples": {"worker_start_s": [9.0], "engine_process_start_s": proc, "engine_start_s.vllm": [40.0, 44.0],
                     "engine_first_start_s.vllm": [50.0]}}]})
    return folder


def test_a_machine_profile_prices_the_start_ups_and_says_where_they_were_measured(tmp_path, paper):
    from archsearch.cli import main
    from archsearch.cluster.startup import load_profile

    cfg, p0 = paper
    _study_record(tmp_path / "a", [10.0, 12.0, 14.0], [6.0])
    _study_record(tmp_path / "b", [20.0], [8.0, 10.0])
    prof = tmp_path / "prof" / "h100.json"
    assert main(["profile", "--study", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(prof)]) == 0
    figs = load_profile(prof)
    assert figs["job_start_s"].value == 13.0 and figs["job_start_s"].n == 4  # pooled median
    assert (figs["job_start_s"].low, figs["job_start_s"].high) == (10.0, 20.0)
    assert figs["engine_process_start_s"].value == 8.0 and figs["engine_start_s.vllm"].value == 42.0

    p = dry_run(cfg, tmp_path / "fresh", gpus="8xH100", profile=prof)
    c, c0 = p["compute"], p0["compute"]
    # each proxy job pays the measured start and end instead of the default 30 s
    for r, r0 in zip(c["proxy_runs"], c0["proxy_runs"]):
        assert r["hours"] - r0["hours"] == pytest.approx((13.0 + 2.0 - JOB_START_S) / 3600)
    m, m0 = c["measure"], c0["measure"]
    assert m["engine_process_start_s"] == 8.0 and m["engine_start_s"] == 42.0 and m["engine_first_start_s"] == 50.0
    assert m["comparison_s"]["low"] - m0["comparison_s"]["low"] == pytest.approx(
        (8.0 - ENGINE_PROCESS_START_S) + (50.0 - ENGINE_START_S["vllm"]) + (42.0 - ENGINE_START_S["vllm"]))
    text = "\n".join(render(p))
    assert f"machine profile {prof}" in text and "measured: median of 4, 10-20, on node7 (slurm executor, H100)" in text
    assert "worker_end_s" not in p["startups"]["figures"] or \
        p["startups"]["figures"]["worker_end_s"]["source"] == "default"
    assert "(default: not measured)" in text  # worker_end_s, search_lead_s were not measured
    # cluster.profile names the same profile
    q = dry_run(replace(cfg, cluster=replace(cfg.cluster, profile=str(prof))), tmp_path / "fresh", gpus="8xH100")
    assert q["compute"]["proxy_wall_hours"] == pytest.approx(c["proxy_wall_hours"])


def test_a_study_s_own_record_wins_over_the_profile(tmp_path, paper):
    from archsearch.cluster.startup import build_profile
    from archsearch.fileio import write_json

    cfg, _ = paper
    write_json(tmp_path / "prof.json", build_profile([_study_record(tmp_path / "a", [10.0], [6.0])]))
    own = _study_record(tmp_path / "study", [50.0], [6.0])  # the study folder the plan is for
    p = dry_run(cfg, own, gpus="8xH100", profile=tmp_path / "prof.json")
    f = p["startups"]["figures"]["job_start_s"]
    assert f["value"] == 50.0 and f["origin"] == str(own / "startups.json")
    assert p["startups"]["study_record"] == str(own / "startups.json")


@pytest.mark.parametrize("content, needle", [
    ("not json", "not JSON"),
    ('{"figures": {}}', "not a machine profile"),
    ('{"kind": "archsearch machine profile", "figures": {"job_start": {"value": 1, "n": 1}}}', "unknown figure 'job_start'"),
    ('{"kind": "archsearch machine profile", "figures": {"job_start_s": {"value": -3, "n": 1}}}', "finite number of seconds >= 0"),
    ('{"kind": "archsearch machine profile", "figures": {"job_start_s": {"value": 3, "n": 0}}}', "n must be a count"),
])
def test_a_bad_profile_is_a_clear_error(tmp_path, paper, content, needle, capsys):
    from archsearch.cli import main
    from archsearch.errors import ArchsearchError

    cfg, _ = paper
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ArchsearchError) as e:
        dry_run(cfg, tmp_path / "o", gpus="8xH100", profile=bad)
    assert e.value.field == "profile" and needle in e.value.problem
    rc = main(["search", "--config", str(REPO / "configs" / "paper-1b.yaml"), "--out", str(tmp_path / "o"),
               "--dry-run", "--gpus", "8xH100", "--profile", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_plan_prices_only_the_proxy_runs_not_yet_trained(tmp_path):
    """A run another study trained into the shared store (or this study folder, resumed) costs
    nothing: the plan lists it as already trained and prices the rest."""
    from archsearch.trainers.jobs import content_key
    from archsearch.search.derived import proxy_sweeps
    from archsearch.trainers import sweep_specs, token_budget
    from archsearch.trainers.loop import run_id_for

    cfg = load_study_config(REPO / "configs" / "ci-cluster.yaml")
    cfg = replace(cfg, proxy=replace(cfg.proxy, store=str(tmp_path / "store")))
    before = dry_run(cfg, tmp_path / "study", gpus="2xcpu")
    (sweep,) = proxy_sweeps(cfg)
    point, spec, _ = next(x for x in sweep_specs(sweep, 512) if x[1] is not None)
    tc = sweep.train_for(point["level"]).replace(seed=point["seed"])
    run = run_id_for(spec, token_budget(spec, tc), point["seed"])
    done = tmp_path / "store" / content_key(run, tc, sweep.data)
    done.mkdir(parents=True)
    (done / "run.json").write_text('{"status": "ok"}')
    after = dry_run(cfg, tmp_path / "study", gpus="2xcpu")
    st = after["stages"][0]
    assert st["runs"] == before["stages"][0]["runs"] and st["runs_already_trained"] == 1
    assert "1 in the store" in st["action"]
    r = next(r for r in after["compute"]["proxy_runs"] if r["run"] == run)
    assert r["already_trained"] == "store" and r["gpu_hours"] == 0.0
    assert after["compute"]["proxy_gpu_hours"] < before["compute"]["proxy_gpu_hours"]
    assert "already trained (in the shared store)" in "\n".join(render(after))


def _profile(tmp_path: Path, stage: str, samples: dict, executor: str = "slurm", host: str = "node7",
             device: str = "H100") -> Path:
    """A machine profile (``archsearch profile``) pooled from one study's recorded figures."""
    from archsearch.cluster.startup import build_profile
    from archsearch.fileio import write_json

    folder = tmp_path / f"study-{stage}"
    folder.mkdir()
    write_json(folder / "startups.json", {"kind": "archsearch study start-ups", "runs": [
        {"stage": stage, "executor": executor, "time_utc": "2026-11-23T16:00:00+00:00", "host": host, "git": "x",
         "device": device, "command": "c", "samples": samples}]})
    write_json(tmp_path / "prof.json", build_profile([folder]))
    return tmp_path / "prof.json"


def test_the_search_stage_s_trials_and_coordinator_tail_are_priced_from_the_profile(tmp_path, paper):
    """The search stage's seconds outside its comparisons (a trial's own, the gaps between a
    worker's trials, a seed's trial reading its group's pair, the coordinator after the workers)
    are measured figures like the start-ups: priced from a profile, printed with where."""
    cfg, p0 = paper
    prof = _profile(tmp_path, "search", {"trial_overhead_s": [0.5, 0.9, 0.7], "trial_gap_s": [0.1, 0.3],
                                         "trial_read_s": [0.2], "search_tail_s": [4.0]})
    p = dry_run(cfg, tmp_path / "fresh", gpus="8xH100", profile=prof)
    m, m0 = p["compute"]["measure"], p0["compute"]["measure"]
    ov, gap, read, tail = 0.7, 0.2, 0.2, 4.0
    k0, w = m0["seed_group"], m0["workers"]
    for k in ("low", "high"):
        assert m["comparison_s"][k] - m0["comparison_s"][k] == pytest.approx(ov + gap)
        busiest = -(-m0["pairs"][k] // w)
        group = ov + k0 * (read + gap) if k0 else 0.0
        assert (m["wall_hours"][k] - m0["wall_hours"][k]) * 3600 == pytest.approx(tail + group + busiest * (ov + gap))
    text = "\n".join(render(p))
    assert "0.7 s (measured: median of 3, 0.5-0.9, on node7 (slurm executor, H100)" in text
    assert "4 s (measured: median of 1" in text and "the best shape chosen" in text
    # without a calibration the timed rounds are said to be a lower bound
    assert "UNCALIBRATED roofline" in text and "lower bound" in text


def test_search_samples_measure_trials_outside_their_comparisons(tmp_path):
    """startup.search_samples on a study as the workers leave it: a trial that measured its own
    pair gives its seconds outside the engine process, a seed's trial whose worker measured the
    group gives its seconds, each worker the gaps between its trials; a trial that read another
    worker's pair (it may have waited on its lock) is no sample."""
    import datetime as dt
    import json
    from types import SimpleNamespace

    from archsearch.cluster.startup import search_samples
    from archsearch.search.measurements import MeasurementStore
    from archsearch.search.trials import trial_times

    t0 = 1_800_000_000.0
    at = lambda s: dt.datetime.fromtimestamp(t0 + s)
    iso = lambda s: dt.datetime.fromtimestamp(t0 + s, dt.timezone.utc).isoformat(timespec="seconds")
    rec = lambda key, end, wall, group=None: {"key": key, "result": {
        "ok": True, "provenance": {"time_utc": iso(end)},
        "timing": {"engine_start_s": [2.0, 0.01] + ([0.01] if group else []), "rounds_s": 0.4, "wall_s": wall,
                   **({"group_size": group} if group else {})}}}
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in [
        rec("pair", 9.0, 5.0), rec("seed1", 10.0, 5.0, 3), rec("seed2", 10.0, 5.0, 3)]) + "\n")
    trial = lambda s, e, pid, key, cached: SimpleNamespace(
        datetime_start=at(s), datetime_complete=at(e),
        user_attrs={"worker": {"host": "h", "pid": pid}, "measurement_key": key, "measurement_cached": cached})
    study = SimpleNamespace(get_trials=lambda deepcopy=False: [
        trial(3.0, 9.5, 1, "pair", False),     # worker 1 measured its pair: 6.5 s, 5 s of it the process
        trial(9.7, 10.5, 1, "seed1", True),    # worker 1 read worker 2's group: no sample
        trial(10.2, 10.3, 2, "seed2", False),  # worker 2 measured the group before this trial
    ])
    results = {"w1": SimpleNamespace(submitted=t0 + 1.0, ended=t0 + 11.5),
               "w2": SimpleNamespace(submitted=t0 + 1.2, ended=t0 + 11.0)}
    # the search layer hands the cluster layer typed records of its trials and its store's timings
    trials, comparisons = trial_times(study), MeasurementStore(tmp_path / "m.jsonl").comparison_times()
    assert [t.measured_key for t in trials] == ["pair", None, "seed2"] and len(comparisons) == 3
    s = search_samples(results, trials, comparisons, "hf", 0.5, since=t0)
    assert s["trial_overhead_s"] == [pytest.approx(1.5)]
    assert s["trial_read_s"] == [pytest.approx(0.1)]
    assert s["trial_gap_s"] == [pytest.approx(0.2)]
    assert s["worker_start_s"] == [pytest.approx(2.0)] and s["worker_end_s"] == [pytest.approx(1.0)]
    assert len(s["engine_process_start_s"]) == 2  # the pair and the group, each once


@pytest.mark.slow
def test_plan_prices_data_already_in_the_shared_cache_as_read_not_tokenized(tmp_path, monkeypatch):
    """The CI study's data: before anything is cached the plan tokenizes it all; once the shards
    are in the shared cache it says so and prices reading them (data_cached_s: a stated
    default, or measured from a profile), tokenizing nothing."""
    from archsearch.cluster.startup import FIGURES
    from archsearch.search.derived import proxy_sweeps
    from archsearch.trainers.data import prepare_data

    shared = os.environ.get("ARCHSEARCH_CACHE")
    monkeypatch.setenv("ARCHSEARCH_CACHE", str(tmp_path / "cache"))  # an empty cache
    cfg = load_study_config(REPO / "configs" / "ci-cluster.yaml")
    cold = dry_run(cfg, tmp_path / "a", gpus="2xcpu")
    (d,) = cold["data"]
    assert d["cache"]["status"] == "missing" and d["tokens_to_tokenize"] > 0
    assert d["wall_hours"] == pytest.approx(d["cpu_hours"] / d["processes"])
    # this machine's own cache, which the suite's other tests of this corpus fill too: prepared
    # there once (nothing to do where they already did), not tokenized again in every run
    if shared is None:
        monkeypatch.delenv("ARCHSEARCH_CACHE")
    else:
        monkeypatch.setenv("ARCHSEARCH_CACHE", shared)
    sweep = proxy_sweeps(cfg)[0]
    prepare_data(sweep.data, min_train_tokens=int(d["tokens_needed"]) + 1, workers=1)
    warm = dry_run(cfg, tmp_path / "a", gpus="2xcpu")
    (w,) = warm["data"]
    assert w["cache"]["status"] == "complete" and w["tokens_to_tokenize"] == 0 and w["tokens_in_cache"] > 0
    assert w["wall_hours"] * 3600 == pytest.approx(FIGURES["data_cached_s"][0])
    assert w["disk_gb"] == pytest.approx(d["disk_gb"])  # the shards still take their disk
    text = "\n".join(render(warm))
    assert "cache complete (every shard the runs read is in the cache, read in 5 s (default: not measured))" in text
    # measured: a study that found its shards cached recorded data_cached_s
    prof = _profile(tmp_path, "proxy", {"data_cached_s": [3.0, 3.4, 3.2]}, executor="local", host="vm", device="cpu")
    m = dry_run(cfg, tmp_path / "a", gpus="2xcpu", profile=prof)
    assert m["data"][0]["wall_hours"] * 3600 == pytest.approx(3.2)
    st = m["stages"][0]
    assert st["data_wall_hours"] * 3600 == pytest.approx(3.2) and st["data_tokens"] == 0


def test_dry_run_prices_training_with_a_given_mfu(tmp_path, paper, capsys):
    """`search --dry-run --mfu X` prices every run's training at X (a measured one, e.g. from a
    calibration study's runs) instead of the assumed 0.40, and says so; without --dry-run the
    flag is refused before any work."""
    from archsearch.cli import main

    cfg, p0 = paper
    p = dry_run(cfg, tmp_path / "o", gpus="8xH100", mfu=0.2)
    r, r0 = p["compute"]["proxy_runs"][0], p0["compute"]["proxy_runs"][0]
    start_h = (JOB_START_S + FIGURES["job_end_s"][0]) / 3600
    assert r["hours"] - start_h == pytest.approx(2 * (r0["hours"] - start_h))
    assert any("(MFU 0.2: given with --mfu)" in a for a in p["compute"]["assumptions"])
    assert any("pass --dry-run --mfu or --time-law" in a for a in p0["compute"]["assumptions"])
    rc = main(["search", "--config", str(REPO / "configs" / "paper-1b.yaml"), "--out", str(tmp_path / "x"),
               "--mfu", "0.3"])
    err = capsys.readouterr().err
    assert rc == 2 and "--mfu" in err and "--dry-run" in err and not (tmp_path / "x").exists()


def test_the_proxy_stage_s_job_gaps_and_tail_are_priced_from_the_profile(tmp_path, paper):
    """The coordinator's seconds between a proxy job's end and the next submission in its place
    (each job after a slot's first) and after a sweep's last job (per sweep) are measured figures."""
    from archsearch.search.dryrun import makespan

    cfg, p0 = paper
    prof = _profile(tmp_path, "proxy", {"job_gap_s": [400.0, 500.0, 600.0], "proxy_tail_s": [900.0]})
    p = dry_run(cfg, tmp_path / "fresh", gpus="8xH100", profile=prof)
    c, c0 = p["compute"], p0["compute"]
    from archsearch.search.derived import proxy_sweeps

    hours = [r["hours"] for r in c0["proxy_runs"] if r["hours"]]
    gap = 500.0 / 3600
    sweeps = len(proxy_sweeps(cfg))
    expect = makespan([h + gap for h in hours], 8) - gap + (FIGURES["proxy_lead_s"][0] + sweeps * 900.0) / 3600
    assert c["proxy_wall_hours"] == pytest.approx(expect)
    assert c["proxy_wall_hours"] > c0["proxy_wall_hours"] + 900.0 / 3600
    assert c["proxy_gpu_hours"] == pytest.approx(c0["proxy_gpu_hours"])  # the coordinator's seconds hold no GPU
    assert any("500 s (measured: median of 3, 400-600" in a for a in c["assumptions"])

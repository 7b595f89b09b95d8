"""A study's reference batch must fit its measuring device: every paired comparison
runs the baseline at that batch, and an engine whose KV cache cannot hold it queues or preempts
sequences, so the figure would not be the batch's. Refused before any work, with the numbers
and the largest batch that fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from archsearch.errors import ArchsearchError
from archsearch.search.checks import check_reference_batch, measuring_device, reference_batch_fit
from archsearch.search.resolved import resolve
from archsearch.search.config import load_study_config

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
# LLaMA-3.2-3B: 28 layers x 8 KV heads x 128 x (K, V) x 2 bytes (its config.json)
KV_BYTES_PER_TOKEN_3B = 28 * 8 * 128 * 2 * 2


def _paper3b(*overrides: str):
    return load_study_config(REPO / "configs" / "paper-3b.yaml", list(overrides))


def test_kv_capacity_of_llama_3b_on_an_h100_is_hand_computed():
    cfg = _paper3b()
    f = reference_batch_fit(cfg, "H100")
    seq = 4096 + 1024
    assert f["kv_gib_per_sequence"] == pytest.approx(KV_BYTES_PER_TOKEN_3B * seq / GIB)  # 0.547 GiB
    # 90% of 79.6 GiB, less the bf16 weights (3.21e9 parameters, tied), in whole sequences
    weights = 3_212_749_824 * 2
    assert f["weights_gib"] * GIB == pytest.approx(weights)
    assert f["capacity"] == int((0.9 * 79.6 * GIB - weights) // (KV_BYTES_PER_TOKEN_3B * seq)) == 120
    assert reference_batch_fit(cfg, "H200")["capacity"] >= 128


def test_a_reference_batch_that_does_not_fit_is_refused_with_the_numbers():
    cfg = _paper3b("measure.reference_batch_size=128")
    with pytest.raises(ArchsearchError) as e:
        check_reference_batch(cfg, "H100")
    assert e.value.field == "measure.reference_batch_size"
    msg = str(e.value)
    for needle in ("128 sequences of 4096 + 1024 tokens", "H100-SXM", "70.0 GiB", "holds 120 sequences",
                   "measure.reference_batch_size: 64", "up to 120"):
        assert needle in msg, needle
    # the default reference (the largest of batch_sizes) names batch_sizes as the field
    cfg = load_study_config(REPO / "configs" / "paper-1b.yaml", ["measure.bench.batch_sizes=[16,512]",
                                                                  "measure.reference_batch_size=null"])
    with pytest.raises(ArchsearchError) as e:
        check_reference_batch(cfg, "H100")
    assert e.value.field == "measure.bench.batch_sizes" and "reference_batch_size: 16" in str(e.value)
    # nothing in batch_sizes fits: the fix says how large one may be
    cfg = _paper3b("measure.bench.batch_sizes=[256]", "measure.reference_batch_size=256")
    with pytest.raises(ArchsearchError, match="a batch size of at most 120"):
        check_reference_batch(cfg, "H100")


def test_the_shipped_paper_configs_fit_the_gpus_they_name():
    from archsearch.search.dryrun import dry_run

    for name in ("paper-1b", "paper-3b"):
        cfg = load_study_config(REPO / "configs" / f"{name}.yaml")
        p = dry_run(cfg, Path("unused"), gpus="8xH100")
        assert p["reference_batch"]["reference_batch"] <= p["reference_batch"]["capacity"]
        assert "gpu_hours" in p["compute"]["measure"]  # the measurements are priced, not skipped


def test_the_plan_and_the_study_refuse_before_any_work(tmp_path, capfd, monkeypatch):
    # the command in this process (a subprocess would import the engine again); capfd sees all it writes
    from archsearch.cli import main

    monkeypatch.chdir(REPO)
    rc = main(["search", "--config", "configs/paper-3b.yaml", "--dry-run", "--gpus", "8xH100",
               "--out", str(tmp_path / "o"), "measure.reference_batch_size=128"])
    err = capfd.readouterr().err
    assert rc == 2, err
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert "measure.reference_batch_size" in line and "holds 120 sequences" in line
    assert not (tmp_path / "o").exists()
    # a named measuring device is checked by the plan without --gpus, and by the study itself (the
    # config's H200 calibration would be refused for an H100 first)
    cfg = _paper3b("measure.reference_batch_size=128", "measure.bench.device_spec=H100", "measure.calibration=null",
                   "cluster.executor=inline",
                   "cluster.jobs_at_once=1", "cluster.measure_workers=1")
    with pytest.raises(ArchsearchError, match="holds 120"):
        resolve(cfg, for_plan=True)
    from archsearch.search import pipeline

    with pytest.raises(ArchsearchError, match="holds 120"):
        pipeline.run(cfg, tmp_path / "study")
    assert not (tmp_path / "study").exists()


def test_the_check_is_general_measured_scale_engine_share_and_kv_dtype():
    base = _paper3b()
    cap = reference_batch_fit(base, "H100")["capacity"]
    # vLLM's gpu_memory_utilization and an fp8 KV cache change what fits
    low = _paper3b("measure.bench.engine_args.gpu_memory_utilization=0.5")
    assert reference_batch_fit(low, "H100")["capacity"] < cap / 1.5
    fp8 = _paper3b("measure.bench.engine_args.kv_cache_dtype=fp8")
    assert reference_batch_fit(fp8, "H100")["capacity"] == pytest.approx(2 * cap, abs=12)
    # measure.params: the baseline is measured rebuilt at that N, and that is what must fit
    small = load_study_config(REPO / "configs" / "paper-1b.yaml", ["measure.params=2e8"])
    assert reference_batch_fit(small, "H100")["capacity"] > 2 * reference_batch_fit(
        load_study_config(REPO / "configs" / "paper-1b.yaml"), "H100")["capacity"]


def test_measuring_device_is_known_only_where_it_can_be():
    cfg = _paper3b("measure.bench.device_spec=H200")
    assert measuring_device(cfg) == "H200"
    slurm = _paper3b("cluster.executor=slurm")
    assert measuring_device(slurm) is None and check_reference_batch(slurm, None) is None
    inline = _paper3b("cluster.executor=inline", "cluster.jobs_at_once=1", "cluster.measure_workers=1")
    if measuring_device(inline) == "cpu":  # no GPU here: this machine's memory is what must hold it
        from archsearch.hardware import host_memory_bytes

        f = reference_batch_fit(inline, "cpu")
        assert f["memory_gib"] == pytest.approx(host_memory_bytes() / GIB)
        if f["capacity"] < 64:
            with pytest.raises(ArchsearchError, match="does not fit on cpu"):
                check_reference_batch(inline, "cpu")


def test_a_slurm_measurement_job_checks_its_own_gpu_before_measuring(tmp_path, monkeypatch):
    import archsearch.search.workers
    from archsearch.search.workers import search_worker

    cfg = _paper3b("measure.reference_batch_size=128", "cluster.executor=slurm")
    assert check_reference_batch(cfg, measuring_device(cfg)) is None  # the coordinator cannot know
    monkeypatch.setattr(archsearch.search.workers, "local_device_name", lambda: "H100")  # the job's GPU
    with pytest.raises(ArchsearchError, match="does not fit on H100-SXM"):
        search_worker(cfg, str(tmp_path / "study"), str(tmp_path / "done"))
    assert not (tmp_path / "done").exists()

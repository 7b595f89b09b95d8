"""Proxy health: ordering checks, retuning bounds, every attempt recorded, non-compliant runs
kept out of the law fit; one real tiny two-level sweep."""

from __future__ import annotations

import json

import pytest

from archsearch.trainers.config import HealthConfig, TrainConfig
from archsearch.trainers.health import (HealthMonitor, curve_violation, loss_at_tokens, retune,
                             size_violation)


def _rec(losses, tokens=1000, n=1e5, run_id="r", status="ok"):
    steps = len(losses) * 10
    return {"run_id": run_id, "status": status, "tokens": tokens, "steps": steps,
            "n_params_non_embedding": n, "final_eval_loss": losses[-1],
            "eval_history": [{"step": 10 * (i + 1), "eval_loss": v} for i, v in enumerate(losses)]}


def test_curve_and_size_checks():
    assert curve_violation(_rec([5.0, 4.0, 3.5]), 0.01) is None
    why = curve_violation(_rec([5.0, 4.0, 4.5]), 0.01)
    assert why.startswith("curve:") and "4.5000" in why
    assert curve_violation(_rec([5.0, 4.0, 4.005]), 0.01) is None  # within the tolerance
    # matched tokens: larger run read at the smaller run's final 500 tokens (log-linear)
    small = _rec([5.0, 4.0], tokens=500, n=1e5)
    big = _rec([5.0, 4.4, 3.0, 2.9], tokens=1000, n=2e5)  # checkpoints at 250, 500, 750, 1000
    assert loss_at_tokens(big, 500) == pytest.approx(4.4)
    assert size_violation(small, big, 0.01).startswith("size:")
    assert size_violation(small, _rec([5.0, 3.9, 3.0, 2.9], tokens=1000, n=2e5), 0.01) is None


def test_retune_halves_batch_to_floor_then_doubles_lr_to_ceiling():
    cfg = HealthConfig(min_batch=[4, 8], max_lr=[4e-3, 1e-3], retries=5)
    tc = TrainConfig(tokens=1000, global_batch_size=16, lr=1e-3)
    steps = []
    while (nxt := retune(tc, cfg, 0)) is not None:
        tc, why = nxt
        steps.append((tc.global_batch_size, tc.lr))
    assert steps == [(8, 1e-3), (4, 1e-3), (4, 2e-3), (4, 4e-3)]
    assert retune(TrainConfig(tokens=1000, global_batch_size=8, lr=1e-3), cfg, 1) is None


def test_monitor_retrains_records_attempts_and_marks_noncompliant():
    cfg = HealthConfig(min_batch=2, max_lr=1.0, retries=2, tolerance=0.0)
    tc = TrainConfig(tokens=1000, global_batch_size=8, lr=1e-3)
    mon = HealthMonitor(cfg)
    p0 = {"hidden_over_sqrt_n": 0.1, "mlp_to_attn": 1.0, "seed": 0, "level": 0}
    p1 = {**p0, "level": 1}
    small = mon.check(p0, tc, _rec([5.0, 4.0], run_id="small"), lambda *a: pytest.fail("healthy"))
    assert small["compliant"] and small["retune_attempts"] == 0
    calls = []

    def retrain_fixed(tc2, suffix):  # the second attempt beats the smaller model
        calls.append((tc2.global_batch_size, tc2.lr, suffix))
        return _rec([5.0, 4.2] if len(calls) == 1 else [5.0, 3.5], n=2e5, run_id=f"big.{suffix}")

    big = mon.check(p1, tc, _rec([5.0, 4.5], n=2e5, run_id="big"), retrain_fixed)
    assert calls == [(4, 1e-3, "retune1"), (2, 1e-3, "retune2")]
    assert big["compliant"] and big["retune_attempts"] == 2 and big["run_id"] == "big.retune2"
    assert [a["attempt"] for a in mon.attempts] == [0, 1] and all(a["reason"].startswith("size:") for a in mon.attempts)

    mon2 = HealthMonitor(HealthConfig(min_batch=8, max_lr=1e-3, retries=3))
    bad = mon2.check(p0, tc, _rec([5.0, 6.0], run_id="bad"), lambda *a: pytest.fail("no room to retune"))
    assert bad["status"] == "failed" and not bad["compliant"] and "non-compliant after 0" in bad["reason"]
    assert "batch floor and LR ceiling" in mon2.attempts[-1]["action"]
    s = mon.summary([small, big]) | {}
    assert s == {"compliant": 2, "retuned": 1, "compliant_after_retune": 1, "non_compliant": 0,
                 "retrain_attempts": 2}


def test_health_config_names_bad_fields():
    from archsearch.errors import ArchsearchError
    from archsearch.trainers.config import SweepConfig

    with pytest.raises(ArchsearchError) as e:
        HealthConfig(min_batch=0)
    assert e.value.field == "sweep.health.min_batch"
    with pytest.raises(ArchsearchError) as e:
        SweepConfig(name="s", params=[1e5, 2e5], hidden_over_sqrt_n=[0.1], mlp_to_attn=[1.0],
                    train=TrainConfig(tokens=1000), health=HealthConfig(max_lr=[1e-3]))
    assert e.value.field == "sweep.health.max_lr"


def test_proxies_health_sums_the_sweeps_counts(tmp_path):
    from archsearch.trainers.health import proxies_health

    assert proxies_health(tmp_path) is None
    h = {"compliant": 3, "retuned": 1, "compliant_after_retune": 1, "non_compliant": 1, "retrain_attempts": 2}
    for name, health in (("a", h), ("b", {**h, "retuned": 2}), ("c", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sweep.json").write_text(json.dumps({"name": name, "health": health}))
    s = proxies_health(tmp_path)
    assert s["sweeps"] == ["a", "b"] and s["retuned"] == 3 and s["non_compliant"] == 2 and s["compliant"] == 6


def test_per_level_start_is_config_within_the_bounds(tmp_path):
    """health.start_batch / start_lr: one value or one per N level, read from YAML, applied by
    train_for, checked against the level's bounds before anything trains."""
    import yaml

    from archsearch.configio import load_config
    from archsearch.errors import ArchsearchError
    from archsearch.trainers.config import SweepConfig

    base = {"name": "s", "params": [3e4, 6e4], "n_layers": 2, "hidden_over_sqrt_n": [0.25], "mlp_to_attn": [1.0],
            "gqa": 2, "head_dim": 32, "train": {"tokens": 4096, "global_batch_size": 8, "lr": 3e-4, "micro_batch_size": 8},
            "health": {"min_batch": [4, 2], "max_lr": [4.8e-3, 4.8e-3], "start_batch": [4, 8],
                       "start_lr": [4.8e-3, 3e-4]}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(base))
    cfg = load_config(SweepConfig, tmp_path / "s.yaml")
    t0, t1 = cfg.train_for(0), cfg.train_for(1)
    assert (t0.global_batch_size, t0.lr, t0.micro_batch_size) == (4, 4.8e-3, None)  # 8 no longer divides 4
    assert (t1.global_batch_size, t1.lr, t1.micro_batch_size) == (8, 3e-4, 8)
    # one value for every level; no start: the sweep's train as before
    one = SweepConfig(**{**cfg.__dict__, "health": HealthConfig(start_lr=1e-3)})
    assert one.train_for(1).lr == 1e-3 and one.train_for(1).global_batch_size == 8
    assert SweepConfig(**{**cfg.__dict__, "health": HealthConfig()}).train_for(0) == cfg.train
    # retuning starts from the configured start: level 1 halves 8 -> 4 first
    assert retune(t1, cfg.health, 1)[1] == "global batch 8 -> 4"
    for health, field in ((HealthConfig(min_batch=[4, 16], start_batch=[4, 8]), "sweep.health.start_batch"),
                          (HealthConfig(max_lr=[1e-2, 1e-4], start_lr=3e-4), "sweep.health.start_lr"),
                          (HealthConfig(start_lr=[1e-3]), "sweep.health.start_lr")):
        with pytest.raises(ArchsearchError) as e:
            SweepConfig(**{**cfg.__dict__, "health": health})
        assert e.value.field == field, health
    with pytest.raises(ArchsearchError) as e:
        HealthConfig(start_batch=[4, 0])
    assert e.value.field == "sweep.health.start_batch"
    with pytest.raises(ArchsearchError) as e:  # two places for one thing
        SweepConfig(**{**cfg.__dict__, "hparams_per_level": ["80m", "145m"]})
    assert e.value.field == "sweep.health.start_lr"


@pytest.mark.slow
def test_real_sweep_retrains_a_flagged_run_and_fits_only_compliant_runs(tmp_path, monkeypatch):
    import archsearch.trainers.health as health
    from archsearch.rundata import read_runs
    from archsearch.trainers import run_sweep
    from archsearch.candidates import BuildSettings
    from archsearch.trainers.config import DataConfig, SweepConfig

    # Real runs on the real corpus; the first check of the original run is forced to fail so
    # that the retraining path (halved batch, own folder, table row) runs for real, then the
    # real checks decide the retrained run.
    real = health.curve_violation
    monkeypatch.setattr(health, "curve_violation", lambda rec, tol: (
        "curve: forced by the test" if ".retune" not in rec["run_id"] else real(rec, tol)))
    cfg = SweepConfig(
        name="h", params=[3e4], n_layers=2, hidden_over_sqrt_n=[0.25], mlp_to_attn=[1.0],
        gqa=2, head_dim=32, build=BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.15),
        train=TrainConfig(tokens=24 * 8 * 64, global_batch_size=8, lr=3e-3, eval_batches=2, eval_interval=6),
        data=DataConfig(source="shakespeare", tokenizer="bpe:2048", seq_len=64),
        health=HealthConfig(min_batch=4, max_lr=4e-3, retries=1, tolerance=0.05))
    rows = run_sweep(cfg, tmp_path, progress=False)
    attempts = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert attempts[0]["reason"] == "curve: forced by the test"
    assert attempts[0]["action"] == "retrain: global batch 8 -> 4"
    (row,) = rows
    retuned = json.loads((tmp_path / "runs" / row.run_id / "run.json").read_text())
    assert row.run_id == attempts[0]["run_id"] + ".retune1" and retuned["global_batch_size"] == 4
    healthy = real(retuned, 0.05) is None
    summary = json.loads((tmp_path / "sweep.json").read_text())["health"]
    assert summary["retuned"] == 1 and summary["compliant"] == int(healthy)
    assert read_runs(tmp_path / "runs.csv")[0].status == ("ok" if healthy else "failed")

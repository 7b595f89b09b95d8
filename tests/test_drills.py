"""Failure drills: kill -9 a tiny study at stage boundaries, resume, and compare with a clean run.

The study reuses a synthetic run table and measures with the analytic backend (deterministic,
fast), so the drill exercises the resume logic, not the engines. One process is killed during
the fit, again during the Optuna search (after at least one measurement is stored) and again
during the GQA search, each time detected from the study's own files; a last run finishes.
The final ``summary.json`` must equal an uninterrupted run's except for timing and provenance,
and every measurement must be stored exactly once (none repeated, none lost).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
# fields that legitimately differ between two runs of the same study: timing, the per-invocation
# counter, and Optuna trial numbers (a trial killed mid-run stays in the storage as failed, its
# shape re-enqueued, so later trial numbers shift by one per such kill)
TIMING = {"seconds", "provenance", "elapsed_s", "wall_s", "timing", "datetime_start",
          "datetime_complete", "duration_s", "stages", "created", "measurements_taken_this_run",
          "trial", "source", "total"}

STUDY = {"name": "drill", "params": 2e6, "tokens": 4e7, "n_layers": 4, "vocab_size": 2048,
         "baseline": {"hidden_over_sqrt_n": 0.08, "mlp_to_attn": 3.0, "gqa": 2},
         "search_space": {"hidden_over_sqrt_n": [0.05, 0.15], "mlp_to_attn": [0.5, 5.0], "gqa": [1, 2, 4],
                          "head_dim": 64,
                          "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.05, "on_r_drift": "flag"}},
         "proxy": {"runs": "runs.csv"},
         "law": {"reference": "chinchilla", "bootstrap": 20},
         "measure": {"backend": "analytic", "batch_sizes": [16], "input_len": 64, "output_len": 64,
                     "device_spec": "H100"},
         "optuna": {"n_trials": 4, "enqueue_solution": 1, "seed": 0},
         "gqa_search": {"enabled": True, "baseline_gqa": 2}}


def _state(out: Path) -> dict:
    try:
        return json.loads((out / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _measured(out: Path) -> int:
    p = out / "measurements.jsonl"
    return p.read_text().count("\n") if p.is_file() else 0


# stage -> (a condition on the study folder that means "that stage is under way")
KILL_POINTS = {
    "fit": lambda out: (out / "config.json").is_file() and "fit" not in _state(out),
    "search": lambda out: _measured(out) >= 1 and "search" not in _state(out),
    "gqa": lambda out: "search" in _state(out) and "gqa" not in _state(out),
}


def _cli(cwd: Path, *args: str, quiet: bool = False) -> subprocess.Popen:
    """``archsearch ARGS``; ``quiet`` for a process we poll (a full stderr pipe would stall it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "archsearch", *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL if quiet else subprocess.PIPE, text=True)


def _kill_on(p: subprocess.Popen, cond, timeout: float = 600) -> bool:
    t0 = time.time()
    try:
        while p.poll() is None and time.time() - t0 < timeout:
            if cond():
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
                return True
            time.sleep(0.005)
        assert p.poll() is not None, f"still running after {timeout} s"
        return False
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _finish(p: subprocess.Popen, timeout: float = 600) -> None:
    _, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]


def _start(cwd: Path, out: str, quiet: bool = False) -> subprocess.Popen:
    return _cli(cwd, "search", "--config", "study.yaml", "--out", out, "--json", quiet=quiet)


def _run_to_end(cwd: Path, out: str) -> None:
    _finish(_start(cwd, out))


def _kill_when(cwd: Path, out: str, stage: str) -> bool:
    """Start the study and kill -9 it as soon as ``stage`` is under way; False if it finished
    (or passed the stage) before the condition was seen."""
    cond, folder = KILL_POINTS[stage], cwd / out
    return _kill_on(_start(cwd, out, quiet=True), lambda: cond(folder))


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _keys(out: Path) -> list[str]:
    return [json.loads(line)["key"] for line in (out / "measurements.jsonl").read_text().splitlines()
            if line.strip()]


@pytest.mark.slow
def test_study_survives_kill_9_at_every_stage(tmp_path):
    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs

    coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
    write_runs(tmp_path / "runs.csv", synthetic_runs("conditional-multiplicative", coef,
                                                     sizes=(5e5, 1e6, 2e6, 4e6), tokens_per_param=(10, 20)))
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(STUDY))

    _run_to_end(tmp_path, "clean")
    landed = {stage: _kill_when(tmp_path, "drilled", stage) for stage in KILL_POINTS}
    _run_to_end(tmp_path, "drilled")

    # the long stages must have been hit; a kill that missed a short stage is reported, not hidden
    assert landed["fit"] and landed["search"], landed
    clean = json.loads((tmp_path / "clean" / "summary.json").read_text())
    drilled = json.loads((tmp_path / "drilled" / "summary.json").read_text().replace("drilled/", "clean/"))
    assert _strip(drilled) == _strip(clean)
    # at most one dead trial per kill during the search, and nothing else added
    assert 0 <= drilled["trials"]["total"] - clean["trials"]["total"] <= landed["search"] + landed["gqa"]
    keys, ref = _keys(tmp_path / "drilled"), _keys(tmp_path / "clean")
    assert len(keys) == len(set(keys)), "a measurement was repeated"
    assert set(keys) == set(ref), "a measurement was lost or added"
    print(json.dumps({"kills": landed, "measurements": len(keys)}))


TRAIN_CFG = {"train": {"tokens": 12800, "global_batch_size": 8, "lr": 3.0e-3, "checkpoint_interval": 5,
                       "eval_batches": 2, "seed": 0},
             "data": {"source": "shakespeare", "tokenizer": "bpe:2048", "seq_len": 64}}
TINY = ["--layers", "2", "--hidden-size", "64", "--heads", "2", "--kv-heads", "1", "--ffn", "128",
        "--vocab-size", "2048"]


@pytest.mark.slow
def test_training_run_survives_kill_9(tmp_path):
    """Killed after its first checkpoint, a run resumes from it and ends where a clean run ends."""
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(TRAIN_CFG))
    args = ["train", *TINY, "--config", "train.yaml", "--no-progress", "--out"]
    _finish(_cli(tmp_path, *args, "clean"))
    ckpts = tmp_path / "drilled" / "checkpoints"
    landed = _kill_on(_cli(tmp_path, *args, "drilled", quiet=True),
                      lambda: ckpts.is_dir() and any(not c.name.startswith(".") for c in ckpts.iterdir()))
    assert landed, "the run finished before its first checkpoint"
    _finish(_cli(tmp_path, *args, "drilled"))
    clean = json.loads((tmp_path / "clean" / "run.json").read_text())
    drilled = json.loads((tmp_path / "drilled" / "run.json").read_text())
    assert drilled["status"] == clean["status"] == "ok"
    assert drilled["steps"] == clean["steps"] and drilled["tokens"] == clean["tokens"]
    assert drilled["final_eval_loss"] == pytest.approx(clean["final_eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_study_where_every_candidate_fails_ends_with_a_message(tmp_path):
    """Every measurement fails (a batch no device holds): failed trials with reasons, a report
    that says so first, no traceback."""
    import copy

    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs

    coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
    write_runs(tmp_path / "runs.csv", synthetic_runs("conditional-multiplicative", coef,
                                                     sizes=(5e5, 1e6, 2e6, 4e6), tokens_per_param=(10, 20)))
    cfg = copy.deepcopy(STUDY)
    cfg["measure"].update(batch_sizes=[10**8], device_spec="A100-40GB")
    cfg["optuna"].update(n_trials=2, max_trials=4)
    cfg["law"]["bootstrap"] = 0
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(cfg))
    p = subprocess.run([sys.executable, "-m", "archsearch", "search", "--config", "study.yaml", "--out", "s"],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                       text=True, timeout=600)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 0 and "No feasible shape was measured" in p.stdout
    assert "predicted not to fit" in (tmp_path / "s" / "trials.csv").read_text()

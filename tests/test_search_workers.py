"""The search's durability with real processes and a real engine (transformers, tiny shapes):
a study's search killed and resumed, two workers on one study, a worker killed while its engine
measures and its trial taken over by the other. Apart from test_search.py (whose study settings and
law they use) so that the run's workers can take them side by side: each starts processes that
import torch and transformers, ~60-100 s a test on 2 cores."""

from __future__ import annotations

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

from tests.test_search import REPO, load, study_config, unrendered_figures


@pytest.fixture(autouse=True)
def _figures_unrendered(monkeypatch):
    unrendered_figures(monkeypatch)

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
        def victims_trial() -> int | None:  # the victim's running trial, once its engine measures
            assert survivor.poll() is None and victim.poll() is None, (logs[0].read_text(), logs[1].read_text())
            mine = [n for n, t in _trials(db).items()
                    if t["state"] == "RUNNING" and t.get("worker", {}).get("pid") == victim.pid]
            engines = [k for k in psutil.Process(victim.pid).children()
                       if "archsearch.benchmarks.isolate" in " ".join(k.cmdline())]
            return mine[0] if mine and engines else None

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

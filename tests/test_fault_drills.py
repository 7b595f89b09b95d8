"""Fault drills: processes killed for real (``kill -9``), engines that hang in one batch size,
measurements that fail once, a peer worker that dies, measurement records cut mid-write.

Each drill uses the fake engines of tests/fakes.py (isolated children like vLLM's) or the
analytic studies of test_search.py, so they take seconds, not an engine's start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent


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


def test_kill_9_of_the_measuring_process_leaves_no_engine_process_or_scratch_folder(tmp_path):
    """The process that waits for an isolated engine is killed with SIGKILL (no cleanup of its
    own runs): the engine process and the worker it started die within seconds, and the next
    measurement removes the scratch folder the dead process left."""
    from archsearch.benchmarks.scratch import reap_stale

    scratch, pids = tmp_path / "tmp", tmp_path / "pids"
    scratch.mkdir()
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
    live = scratch / f"archsearch-bench-{os.getpid()}-x"  # a live process's folder is kept
    live.mkdir()
    assert reap_stale(scratch) == [scratch / left[0]]
    assert [p.name for p in scratch.iterdir()] == [live.name]


def test_one_hung_batch_size_keeps_the_others(monkeypatch):
    """An engine that hangs in batch size 2 of [1, 2, 3]: 2 fails with the timeout, 1 is kept and
    3 is measured in a fresh engine process."""
    from archsearch.benchmarks import BenchSettings, measure
    from archsearch.benchmarks.base import BACKENDS
    from tests.test_bench import TINY

    monkeypatch.setitem(BACKENDS, "fake-hang-at", "tests.fakes:HangAtBackend")
    r = measure(TINY, BenchSettings(backend="fake-hang-at", batch_sizes=[1, 2, 3], input_len=4, output_len=2,
                                    repeats=1, warmup=0, timeout_s=6))
    assert [b.batch_size for b in r.per_batch] == [1, 2, 3]
    assert r.batch(1).ok and r.batch(3).ok and r.throughput(3) > 0
    assert not r.batch(2).ok and "timeout after 6 s" in r.batch(2).error
    assert [run["batch_sizes"] for run in r.timing["runs"]] == [[1, 2, 3], [3]]

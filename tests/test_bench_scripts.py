"""Every benchmark script answers --help (argparse formats every help string only then), run both
ways a user runs it from the checkout's root, with no import hook: as a module
(``python -m archsearch.benchmarks.scripts.bench_x``) and as a plain script
(``python benchmarks/scripts/bench_x.py``: no package, its own folder first on ``sys.path``)."""

from __future__ import annotations

import importlib
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "benchmarks" / "scripts"
SCRIPTS = sorted(p.stem for p in FOLDER.glob("bench_*.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_help(name, monkeypatch, capsys):
    mod = importlib.import_module(f"archsearch.benchmarks.scripts.{name}")
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_help_as_a_plain_script(name, monkeypatch, capsys):
    """As ``python benchmarks/scripts/bench_x.py --help`` runs it: ``__main__`` with no parent package
    (a relative import fails) and the script's folder first on ``sys.path``; in this process, as
    the subprocess below costs a second a script."""
    path = FOLDER / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.setattr(sys, "path", [str(FOLDER), *sys.path])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(path), run_name="__main__")
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_a_plain_script_runs_in_its_own_interpreter():
    """One script end to end as a user types it, with this checkout's ``archsearch`` on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "benchmarks/scripts/bench_law_fit.py", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")


def test_calibration_grid_over_a_study_box_is_measured_as_the_study_measures():
    """``bench_engines_cpu --grid calibration --config``: the 4 x 3 grid over the demo's box, each
    shape built as the study builds it and rebuilt at ``measure.params`` (the same realised ratios)."""
    from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio, non_embedding_params
    from archsearch.benchmarks.scripts.bench_engines_cpu import study_shapes
    from archsearch.search.checks import vocab_size
    from archsearch.search.config import load_study_config
    from archsearch.search.derived import build_settings, expand

    cfg = load_study_config(Path(__file__).resolve().parents[1] / "configs" / "demo-cpu.yaml")
    shapes = study_shapes(cfg)
    assert len(shapes) == 12 and len({s.name for s in shapes}) == 12
    assert {s.n_heads // s.n_kv_heads for s in shapes} == set(cfg.search_space.gqa)
    for s in shapes:
        assert non_embedding_params(s) == pytest.approx(cfg.measure.params, rel=0.05)
        assert s.n_layers == cfg.n_layers and s.head_dim == cfg.search_space.head_dim
        assert s.max_position_embeddings >= cfg.measure.bench.input_len + cfg.measure.bench.output_len
    # the first point is the box's corner (smallest d/sqrt(N) and r, GQA 1), as the study builds it
    built = expand(cfg, build_settings(cfg, vocab_size(cfg)), cfg.search_space.hidden_over_sqrt_n[0],
                   cfg.search_space.mlp_to_attn[0], 1)
    first = shapes[0]
    assert mlp_to_attn_ratio(first) == pytest.approx(mlp_to_attn_ratio(built), rel=0.25)
    assert hidden_over_sqrt_n(first) == pytest.approx(hidden_over_sqrt_n(built), rel=0.3)

"""A clean install puts only ``archsearch`` into site-packages: the repository's ``trainers/`` and
``benchmarks/`` folders are imported as ``archsearch.trainers`` and ``archsearch.benchmarks``
(symlinks inside ``archsearch/``), never as generic top-level names that could clash with a user's."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERIC = {"trainers", "benchmarks"}


def _sources():
    for folder in ("archsearch", "trainers", "benchmarks", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if "archsearch/trainers" in path.as_posix() or "archsearch/benchmarks" in path.as_posix():
                continue  # the symlinked folders are scanned under their real names
            yield path


def test_no_source_imports_a_generic_top_level_name():
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                    if n.split(".")[0] in GENERIC]
    assert not bad, "import these as archsearch.trainers / archsearch.benchmarks: " + ", ".join(bad)


def test_namespace_links_point_at_the_repository_folders():
    for name in GENERIC:
        link = ROOT / "archsearch" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()


def test_wheel_installs_only_the_archsearch_namespace(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"pip wheel failed: {r.stderr[-2000:]}")
    (wheel,) = tmp_path.glob("archsearch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"archsearch", wheel.name.split("-")[0] + "-"
                                                 + wheel.name.split("-")[1] + ".dist-info"}
    # the trainer and the measurement backends travel inside the namespace, as real files
    assert "archsearch/trainers/loop.py" in names and "archsearch/benchmarks/base.py" in names


def test_installed_copy_runs_outside_a_repository_with_clean_output(tmp_path):
    """A non-editable install used from a folder that is no git repository: every ``--json`` prints
    one document on stdout and nothing on stderr (no git chatter), and provenance says git is unknown."""
    target, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"pip install failed: {r.stderr[-2000:]}")
    env = {**os.environ, "PYTHONPATH": str(target)}
    commands = [["arch", "describe", "--preset", "llama-3.2-1b", "--json"],
                ["bench", "--backend", "analytic", "--preset", "llama-3.2-1b", "--batch-sizes", "1", "--json"],
                ["estimate", "--arch", "llama-3.2-1b", "--tokens", "1B", "--json"]]
    for cmd in commands:
        p = subprocess.run([sys.executable, "-m", "archsearch", *cmd], cwd=work, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (cmd, p.stderr)
        assert p.stderr == "", (cmd, p.stderr)
        doc = json.loads(p.stdout)
        assert isinstance(doc, dict)
    # the measurement came from the installed copy, and its provenance does not invent a revision
    import_check = subprocess.run([sys.executable, "-c", "import archsearch.benchmarks.base as b; print(b.__file__)"],
                                  cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert import_check.stdout.strip().startswith(str(target))
    bench_doc = json.loads(subprocess.run([sys.executable, "-m", "archsearch", *commands[1]], cwd=work, env=env,
                                          capture_output=True, text=True, timeout=120).stdout)
    assert _find_key(bench_doc, "git") == [None]


def _find_key(doc, key):
    found = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            found += [v] if k == key else _find_key(v, key)
    elif isinstance(doc, list):
        for v in doc:
            found += _find_key(v, key)
    return found

"""A clean install puts only ``archsearch`` into site-packages: the repository's ``trainers/`` and
``benchmarks/`` folders are ``archsearch.trainers`` and ``archsearch.benchmarks`` through two committed
relative links inside the package (``archsearch/trainers -> ../trainers``,
``archsearch/benchmarks -> ../benchmarks``), never generic top-level names that could clash with a
user's, and no import hook; the one-off benchmark scripts (``benchmarks/scripts``) stay in the
repository, and the library never imports them."""
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
        yield from (ROOT / folder).rglob("*.py")


def _library_files():
    """The repository's files an install carries, by their path inside the package."""
    for folder, inside in (("archsearch", "archsearch"), ("trainers", "archsearch/trainers"),
                           ("benchmarks", "archsearch/benchmarks")):
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT / folder)
            if path.is_file() and "__pycache__" not in rel.parts and rel.parts[0] != "scripts" \
                    and (path.suffix == ".py" or rel.parts[0] == "evaltasks"):
                yield f"{inside}/{rel.as_posix()}", path


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


LINKS = {"trainers": "../trainers", "benchmarks": "../benchmarks"}


def test_the_package_links_its_two_folders_and_nothing_else():
    """The links are relative (a clone anywhere resolves them) and the only ones in the package."""
    links = {p.name: os.readlink(p) for p in (ROOT / "archsearch").rglob("*") if p.is_symlink()}
    assert links == LINKS, f"archsearch/ links trainers/ and benchmarks/ as {LINKS}, no other: {links}"


def test_a_checkout_imports_its_folders_through_the_links_with_no_hook():
    """Run from a checkout (the tests, ``python -m archsearch``), the sub-packages come from its folders,
    found by Python's own path finder: no finder of the project's sits on ``sys.meta_path``."""
    code = ("import json, sys, archsearch, archsearch.trainers as t, archsearch.benchmarks.base as b\n"
            "print(t.__file__); print(b.__file__)\n"
            "print(json.dumps(sorted({getattr(f, '__module__', '') for f in sys.meta_path})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    trainers, base, finders = out.stdout.splitlines()
    assert [trainers, base] == [str(ROOT / "archsearch" / "trainers" / "__init__.py"),
                                str(ROOT / "archsearch" / "benchmarks" / "base.py")]
    assert Path(base).resolve() == ROOT / "benchmarks" / "base.py"
    assert not [f for f in json.loads(finders) if f.startswith("archsearch")], finders


def test_library_never_imports_the_benchmark_scripts():
    """The scripts are not installed: no module of the package may import them, even inside a function."""
    bad = []
    for name, path in _library_files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = name.rsplit("/", 1)[0].replace("/", ".").split(".")
                mods = [".".join(base[: len(base) - node.level + 1] + [node.module]) if node.level else node.module]
            bad += [f"{name}:{node.lineno} {m}" for m in mods if m.startswith("archsearch.benchmarks.scripts")]
    assert not bad, "the library imports the repository's benchmark scripts: " + ", ".join(bad)


def test_wheel_holds_the_library_and_not_the_scripts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"pip wheel failed: {r.stderr[-2000:]}")
    (wheel,) = tmp_path.glob("archsearch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"archsearch", wheel.name.split("-")[0] + "-"
                                                 + wheel.name.split("-")[1] + ".dist-info"}
    # every library file travels inside the namespace (a new sub-package missing from pyproject's list
    # shows here), and nothing else: no benchmark script
    source = {name for name, _ in _library_files()}
    assert source - set(names) == set(), "add the sub-package to [tool.setuptools] packages in pyproject.toml"
    assert [n for n in names if not n.startswith("archsearch-") and n not in source] == []
    assert "archsearch/trainers/loop.py" in names and "archsearch/benchmarks/base.py" in names


def test_installed_copy_runs_outside_a_repository_with_clean_output(tmp_path, dev_shm_alone):
    """A non-editable install used from a folder that is no git repository: every ``--json`` prints
    one document on stdout and nothing on stderr (no git chatter), and provenance says git is unknown.
    The bench command's measurement reaps unused shared-memory segments of any process and says so:
    ``dev_shm_alone`` (tests/conftest.py) keeps other tests' engines and their debris out of /dev/shm
    meanwhile, as its own TMPDIR keeps their scratch folders away."""
    target, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"pip install failed: {r.stderr[-2000:]}")
    # the links' folders arrive as real folders of real files
    assert not [p for p in (target / "archsearch").rglob("*") if p.is_symlink()]
    assert (target / "archsearch" / "benchmarks" / "base.py").is_file()
    (tmp_path / "tmp").mkdir()  # its own scratch: debris another test's killed run left in /tmp is not its
    env = {**os.environ, "PYTHONPATH": str(target), "TMPDIR": str(tmp_path / "tmp")}
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

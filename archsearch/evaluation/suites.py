"""Named task suites and task-name resolution (no lm-eval import here).

A suite is a name for a list of lm-eval tasks. ``offline`` is built into the repo from the
held-out plays (``archsearch/evaltasks/``) and runs without a network; the others are the
method's zero-shot tasks (docs/method.md section 7), whose datasets come from the Hugging Face Hub.
Any other lm-eval task name is passed through and checked against lm-eval's task index.
"""

from __future__ import annotations

from pathlib import Path

from archsearch.errors import ArchsearchError

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


def check_task_names(tasks: str | list[str] | tuple[str, ...], field: str = "tasks") -> list[str]:
    """The task names of ``tasks``, checked before any work: suites and the tasks of this table
    at no cost, any other name against lm-eval's task index (built only then: seconds)."""
    names = expand_tasks(tasks)
    ours = {*OFFLINE_TASKS, *METHOD_TASKS, "wikitext"}
    other = [t for t in names if t not in ours]
    if other:
        try:
            from lm_eval.tasks import TaskManager
        except ImportError:
            raise ArchsearchError(field, f"cannot check the task {other[0]!r}: lm-evaluation-harness is "
                                  "not installed", f"pip install -e .[eval], or use a suite: {', '.join(SUITES)}") from None
        known = set(TaskManager(include_path=str(TASKS_DIR)).all_tasks)
        try:
            check_known(other, known)
        except ArchsearchError as e:
            raise ArchsearchError(field, e.problem, e.fix) from None
    return names


def list_tasks() -> dict[str, dict]:
    """``{"suites": {name: {"tasks": [...], "help": str, "network": bool}},
    "tasks": {name: help}}`` for the suites above (lm-eval's thousands of others not listed)."""
    return {
        "suites": {name: {"tasks": list(ts), "help": SUITE_HELP[name],
                          "network": any(needs_hub(t) for t in ts)}
                   for name, ts in SUITES.items()},
        "tasks": {t: TASK_HELP[t] for ts in SUITES.values() for t in ts},
    }

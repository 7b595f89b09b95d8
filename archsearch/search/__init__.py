"""The search (docs/method.md section 4): study config, Optuna study, local GQA search, pipeline, report."""

from __future__ import annotations

__all__ = ["StudyConfig", "load_study_config", "run", "local_gqa_search", "log"]


def log(msg: str) -> None:
    """A progress line of the study, on stderr."""
    import sys

    print(f"[search] {msg}", file=sys.stderr, flush=True)


def __getattr__(name: str):
    if name in ("StudyConfig", "load_study_config"):
        from archsearch.search import config
        return getattr(config, name)
    if name == "run":
        from archsearch.search.pipeline import run
        return run
    if name == "local_gqa_search":
        from archsearch.search.gqa import local_gqa_search
        return local_gqa_search
    raise AttributeError(name)

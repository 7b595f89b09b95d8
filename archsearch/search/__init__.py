"""The search (docs/method.md section 4): study config, Optuna study, local GQA search, pipeline, report."""

from __future__ import annotations

__all__ = ["StudyConfig", "load_study_config", "run", "plan", "local_gqa_search"]


def __getattr__(name: str):
    if name in ("StudyConfig", "load_study_config"):
        from archsearch.search import config
        return getattr(config, name)
    if name in ("run", "plan"):
        from archsearch.search import pipeline
        return getattr(pipeline, name)
    if name == "local_gqa_search":
        from archsearch.search.gqa import local_gqa_search
        return local_gqa_search
    raise AttributeError(name)

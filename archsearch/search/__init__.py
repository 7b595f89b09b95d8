"""The search (docs/method.md section 4): study config, Optuna study, local GQA search, pipeline, report."""

from __future__ import annotations

from archsearch._lazy import lazy_getattr
from archsearch.logs import get_logger

_LAZY = {"StudyConfig": "archsearch.search.config", "load_study_config": "archsearch.search.config",
         "run": "archsearch.search.pipeline", "local_gqa_search": "archsearch.search.gqa"}
__all__ = [*_LAZY, "log"]
__getattr__ = lazy_getattr(__name__, _LAZY)


def log(msg: str) -> None:
    """A progress line of the study (stderr, and the study's ``study.log``; archsearch.logs)."""
    get_logger("search").info(f"[search] {msg}")

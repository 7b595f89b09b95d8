"""Evaluation with lm-evaluation-harness (docs/method.md section 7).

``evaluate(model, tasks)`` runs ``lm_eval.simple_evaluate`` on a local HF folder, a trainers
run, or a named reference model (``smollm2-135m``), over named suites (``offline``, the
method's nine tasks, wikitext) or any lm-eval task. Importing this package imports neither
torch nor lm-eval; the names below load on first use.
"""

from __future__ import annotations

from archsearch._lazy import lazy_getattr

_LAZY = {
    "evaluate": "archsearch.evaluation.runner",
    "list_tasks": "archsearch.evaluation.suites",
    "expand_tasks": "archsearch.evaluation.suites",
    "SUITES": "archsearch.evaluation.suites",
    "OFFLINE_TASKS": "archsearch.evaluation.suites",
    "resolve_model": "archsearch.evaluation.models",
    "load_model": "archsearch.evaluation.models",
    "ResolvedModel": "archsearch.evaluation.models",
    "REFERENCE_MODELS": "archsearch.evaluation.models",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)

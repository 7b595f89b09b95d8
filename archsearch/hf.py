"""What archsearch does before it loads a Hugging Face transformers model in a process.

transformers' generation code, imported with every model class, imports ``sklearn.metrics``
whenever scikit-learn is installed (lm-eval requires it) for one optional feature: the
confidence-threshold calibration of assisted decoding (``roc_curve``). archsearch never decodes
with an assistant model, and that import (scikit-learn, then much of scipy) is ~3 s of CPU on 2
cores in every process that loads a model: a fifth of a proxy training run's start, paid again by
every measurement, evaluation and planner process (measured in docs/results.md, "Where the suite's
CPU goes"). :func:`without_sklearn` has transformers see scikit-learn as absent, through its own
switch (``transformers.utils.is_sklearn_available``), replaced before the generation code is first
imported. Assisted decoding itself still works, without that calibration; nothing else changes.
It does nothing where scikit-learn or that code is loaded already (nothing left to save), or where
transformers has no such switch (another version: the import is then paid, not broken).
"""

from __future__ import annotations

import sys

GENERATION = "transformers.generation.candidate_generator"  # the module that imports sklearn.metrics


def without_sklearn() -> bool:
    """Before a model class is imported: transformers' generation code loads without scikit-learn.
    Returns whether the switch was set in this call."""
    if "sklearn" in sys.modules or GENERATION in sys.modules:
        return False
    try:
        import transformers.utils as hf_utils
    except ImportError:
        return False
    if not callable(getattr(hf_utils, "is_sklearn_available", None)):
        return False
    hf_utils.is_sklearn_available = _absent
    return True


def _absent() -> bool:
    return False

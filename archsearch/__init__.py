"""archsearch: search for inference-efficient decoder shapes under a parameter budget.

Importing this package is cheap: it imports no torch, vLLM, SGLang or lm-eval. The public
names below are loaded on first use.
"""

from __future__ import annotations

from archsearch._lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "ArchSpec": "archsearch.arch",
    "describe": "archsearch.arch",
    "load_arch": "archsearch.presets",
    "to_hf_config": "archsearch.arch",
    "build_candidate": "archsearch.candidates",
    "BuildSettings": "archsearch.candidates",
    "get_preset": "archsearch.presets",
    "PRESETS": "archsearch.presets",
    "ArchsearchError": "archsearch.errors",
    "RunRecord": "archsearch.rundata",
    "read_runs": "archsearch.rundata",
    "write_runs": "archsearch.rundata",
}

__all__ = ["__version__", *_LAZY]


__getattr__ = lazy_getattr('archsearch', _LAZY)


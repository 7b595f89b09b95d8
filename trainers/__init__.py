"""Training: data and tokenizers, the accelerate loop, proxy sweeps, multi-GPU launch.

Importing this package imports no torch; the names below load their module on first use.
"""

from __future__ import annotations

from archsearch._lazy import lazy_getattr

_LAZY = {
    "DataConfig": "archsearch.trainers.config",
    "TrainConfig": "archsearch.trainers.config",
    "SweepConfig": "archsearch.trainers.config",
    "HPARAMS": "archsearch.trainers.config",
    "prepare_data": "archsearch.trainers.data",
    "PreparedData": "archsearch.trainers.data",
    "load_tokenizer": "archsearch.trainers.tokenizer",
    "train": "archsearch.trainers.loop",
    "build_model": "archsearch.trainers.loop",
    "match_vocab": "archsearch.trainers.loop",
    "token_budget": "archsearch.trainers.loop",
    "run_sweep": "archsearch.trainers.sweep",
    "sweep_specs": "archsearch.trainers.sweep",
    "to_run_record": "archsearch.trainers.sweep",
    "run_active": "archsearch.trainers.active_proxies",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)

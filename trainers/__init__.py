"""Training: data and tokenizers, the accelerate loop, proxy sweeps, multi-GPU launch.

Importing this package imports no torch; the names below load their module on first use.
"""

from __future__ import annotations

from archsearch._lazy import lazy_getattr

_LAZY = {
    "DataConfig": "trainers.config",
    "TrainConfig": "trainers.config",
    "SweepConfig": "trainers.config",
    "RunConfig": "trainers.config",
    "HPARAMS": "trainers.config",
    "prepare_data": "trainers.data",
    "PreparedData": "trainers.data",
    "load_tokenizer": "trainers.tokenizer",
    "train": "trainers.loop",
    "build_model": "trainers.loop",
    "match_vocab": "trainers.loop",
    "token_budget": "trainers.loop",
    "run_sweep": "trainers.sweep",
    "sweep_specs": "trainers.sweep",
    "to_run_record": "trainers.sweep",
    "run_active": "trainers.active",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr('trainers', _LAZY)

"""Peak memory of one fine-tuning step by method (full, LoRA, QLoRA) and the largest micro-batch
that fits: the dispatch over :mod:`archsearch.planning.memory` (full training) and
:mod:`archsearch.planning.lora` (adapters on a frozen, possibly quantised, base)."""

from __future__ import annotations

from typing import Any

from archsearch.arch import ArchSpec
from archsearch.errors import ArchsearchError
from archsearch.planning.lora import LoraSettings, predict_lora_memory
from archsearch.planning.memory import GIB, max_affine, max_training_batch, predict_training_memory

FINETUNE_METHODS = ("full", "lora", "qlora")


def predict_finetune_memory(spec: ArchSpec, method: str, batch_size: int, seq_len: int, dtype: str = "bfloat16",
                            *, lora: Any = None, weight_format: Any = None, adapter_dtype: str = "float32",
                            activation_checkpointing: bool = False, **kw: Any) -> dict[str, Any]:
    """Peak bytes of one fine-tuning step, counted from what is trained: ``full`` (every weight
    trained: :func:`predict_training_memory`), ``lora`` / ``qlora`` (a frozen base in
    ``weight_format``, ``nf4`` for ``qlora``, and trained adapters:
    :func:`archsearch.planning.lora.predict_lora_memory`); ``activation_checkpointing``: each
    layer keeps only its input and is recomputed in backward. ``kw`` goes to full training's
    sharding options."""
    if method == "full":
        if weight_format not in (None, dtype):
            raise ArchsearchError("weight_format", f"{weight_format!r} with full fine-tuning",
                                  "a quantised base is frozen: use --finetune lora or qlora")
        return predict_training_memory(spec, batch_size, seq_len, dtype,
                                       activation_checkpointing=activation_checkpointing, **kw)
    if method not in FINETUNE_METHODS:
        raise ArchsearchError("finetune", f"unknown method {method!r}", f"use one of {list(FINETUNE_METHODS)}")
    if kw:
        raise ArchsearchError(next(iter(kw)), "sharding options apply to full fine-tuning only",
                              "leave them out with lora or qlora (one device)")
    if method == "qlora" and weight_format is None:
        weight_format = "nf4"
    m = predict_lora_memory(spec, lora or LoraSettings(), batch_size, seq_len, dtype,
                            weight_format=weight_format, adapter_dtype=adapter_dtype,
                            activation_checkpointing=activation_checkpointing)
    m["total_gib"] = m["total"] / GIB
    return m


def max_finetune_batch(spec: ArchSpec, method: str, device_memory_bytes: float, seq_len: int,
                       dtype: str = "bfloat16", memory_fraction: float = 0.95, **kw: Any) -> int:
    """Largest micro-batch whose :func:`predict_finetune_memory` fits ``memory_fraction`` of
    the device (LoRA terms are affine in the batch: a closed form)."""
    if method == "full":
        return max_training_batch(spec, device_memory_bytes, seq_len, dtype, memory_fraction, **kw)
    if not 0 < memory_fraction <= 1:
        raise ArchsearchError("memory_fraction", f"must be in (0, 1], got {memory_fraction}")
    return max_affine(lambda b: predict_finetune_memory(spec, method, b, seq_len, dtype, **kw)["total"],
                       device_memory_bytes * memory_fraction, "batch_size")

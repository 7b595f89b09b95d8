"""LoRA fine-tuning accounting: trainable adapter parameters by rank and target modules, and
the memory of a LoRA step (frozen weights, adapters, their gradients and AdamW states only).

A LoRA adapter on a linear ``in -> out`` adds ``A: r x in`` and ``B: out x r`` (Hu et al. 2021),
``r * (in + out)`` parameters; the frozen weight gets no gradient and no optimizer state.
Module names are transformers' (``q_proj`` ... ``down_proj``), as peft's ``target_modules``.
"""

from __future__ import annotations

from dataclasses import dataclass

from archsearch.arch import ArchSpec, active_ffn_width
from archsearch.errors import ArchsearchError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSettings:
    """Rank and target modules of the adapters (peft's ``r`` and ``target_modules``)."""

    rank: int = 8
    targets: tuple[str, ...] = ATTENTION

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ArchsearchError("lora.rank", f"must be an integer >= 1, got {self.rank!r}")
        bad = [t for t in self.targets if t not in ATTENTION + MLP]
        if bad or not self.targets:
            raise ArchsearchError("lora.targets", f"{bad or 'empty'}", f"use some of {list(ATTENTION + MLP)}")


def _shapes(spec: ArchSpec) -> dict[str, tuple[int, int]]:
    d, dq, dkv, f = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.ffn
    return {"q_proj": (d, dq), "k_proj": (d, dkv), "v_proj": (d, dkv), "o_proj": (dq, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def lora_params(spec: ArchSpec, lora: LoraSettings) -> int:
    """Trainable adapter parameters: ``rank * (in + out)`` per targeted linear per layer
    (every expert's MLP projections for a mixture-of-experts spec)."""
    if spec.is_moe and any(t in MLP for t in lora.targets):
        raise ArchsearchError("lora.targets", "MLP targets on a mixture-of-experts spec",
                              "target the attention projections (expert adapters are not accounted)")
    return spec.n_layers * sum(lora.rank * sum(_shapes(spec)[t]) for t in lora.targets)


def predict_lora_memory(spec: ArchSpec, lora: LoraSettings, batch_size: int, seq_len: int,
                        dtype: str = "float32") -> dict[str, float]:
    """Bytes of one LoRA training step: frozen weights at ``dtype``; adapters, their gradients
    and two AdamW states in fp32; saved activations as in full training (the backward pass
    through frozen layers still needs them) plus the adapters' rank-wide intermediates; the
    cross-entropy around the logits."""
    from archsearch.planning.memory import predict_training_memory

    full = predict_training_memory(spec, batch_size, seq_len, dtype)
    n = lora_params(spec, lora)
    tokens = batch_size * seq_len
    adapters_acts = spec.n_layers * len(lora.targets) * tokens * lora.rank * 4
    out = {"weights": float(full["weights"]), "adapters": 4.0 * n, "adapter_gradients": 4.0 * n, "optimizer": 8.0 * n,
           "activations": float(full["activations"]) + adapters_acts, "loss": float(full["loss"])}
    out["total"] = sum(out.values())
    out["trainable_params"] = n
    out["ffn_width_for_activations"] = active_ffn_width(spec)
    return out

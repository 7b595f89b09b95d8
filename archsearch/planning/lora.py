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


# The framework's own memory in a LoRA step, beyond every tensor accounted below: peft's
# wrappers, the allocator's retained heap, kernel and autograd workspaces. Measured 24-47 MiB
# above the tensor accounting on CPU, fp32, 128-1024 tokens (peak RSS, results/lora); the allowance is rounded up
# so that the prediction stays an upper bound: the planner uses it as a limit
# (``limits.max_peak_memory_gib``). On a GPU the CUDA context lies outside
# ``torch.cuda.max_memory_allocated`` and is not counted either.
RUNTIME_ALLOWANCE_BYTES = 64 * 2**20


def lora_activation_bytes(spec: ArchSpec, lora: LoraSettings, dtype: str = "float32") -> dict[str, float]:
    """Bytes autograd saves for backward per token per layer in a LoRA step (``rope``: per
    position, all layers), by part. Only what backward needs through *frozen* weights is kept:
    a frozen linear saves nothing (its input-gradient needs only its weight), a frozen norm
    weight saves not its normalised input. What remains (transformers' LLaMA-style layers with
    SDPA / flash attention, peft adapters, as torch saves them):

    * ``norms``: every RMSNorm's input in fp32 (transformers' norms upcast first) and its
      ``rsqrt``: the two pre-norms (OLMo-2: the two post-norms), and the q/k norms of qwen3
      (per head) / OLMo-2 (full width);
    * ``attention``: SDPA's saved query, key, value (RoPE applied, K/V not repeated for GQA),
      output and log-sum-exp;
    * ``mlp``: SwiGLU's ``gate``, ``act(gate)`` and ``up`` (the product, ``down_proj``'s input,
      is not saved unless ``down_proj`` has an adapter); mixture-of-experts: those of each
      routed expert plus its output and weight (the weighted sum), the router's softmax, and
      a shared expert's;
    * ``adapter_inputs``: each adapter's ``lora_A`` saves its input in the adapters' dtype
      (fp32: peft upcasts). In fp32 every adapter on one tensor shares it (q/k/v: the normed
      input once; o_proj: SDPA's output, already saved); in a lower precision each adapter
      casts its own copy;
    * ``adapter_intermediates``: ``lora_B``'s input, ``rank`` fp32 values per target;
    * ``final_norm_per_token`` (once, not per layer): OLMo-2's final norm input; for pre-norm
      families it cancels the first layer's attention norm, whose input needs no gradient.

    Targets that leave the first layer's attention without a gradient (``o_proj`` or MLP
    adapters only) save less there than counted: an over-estimate of up to one layer's share.

    Checked against the tensors autograd actually saves (tests/test_lora.py walks the graph)."""
    from archsearch.arch import FAMILIES, dtype_bytes

    cb = dtype_bytes(dtype)
    d, dq, dkv, nh = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.n_heads
    qk_norm = FAMILIES[spec.family][3]
    post_norm = spec.family == "olmo2"
    t = set(lora.targets)
    norms = 4.0 * (2 * d + 2)
    if qk_norm == "head":
        norms += 4.0 * (dq + dkv + nh + spec.n_kv_heads)
    elif qk_norm == "full":
        norms += 4.0 * (dq + dkv + 2)
    attention = cb * (2 * dq + 2 * dkv) + 4.0 * nh
    if spec.is_moe:
        k = spec.experts_per_token
        mlp = cb * (3 * k * spec.ffn + k * d) + 4.0 * (spec.n_experts + k)
        if spec.shared_expert_ffn:
            mlp += cb * (3 * spec.shared_expert_ffn + d + 1)
    else:
        mlp = cb * 3.0 * spec.ffn
    # (input width, targets reading it, already saved elsewhere in fp32)
    groups = [(d, t & {"q_proj", "k_proj", "v_proj"}, False), (dq, t & {"o_proj"}, True),
              (d, t & {"gate_proj", "up_proj"}, False), (spec.ffn, t & {"down_proj"}, False)]
    inputs = 0.0
    for width, readers, shared in groups:
        if readers:
            inputs += 4.0 * width * (len(readers) if cb != 4 else (0 if shared else 1))
    intermediates = 4.0 * lora.rank * len(t)
    rope = cb * 2.0 * spec.head_dim
    # per token, once: the final norm's input; pre-norm families do not save the first layer's
    # attention norm input (the frozen embedding's output needs no gradient), the same size
    final = 4.0 * (d + 1) if post_norm else 0.0
    return {"norms": norms, "attention": attention, "mlp": mlp, "adapter_inputs": inputs,
            "adapter_intermediates": intermediates, "rope_per_position": rope, "final_norm_per_token": final}


def predict_lora_memory(spec: ArchSpec, lora: LoraSettings, batch_size: int, seq_len: int,
                        dtype: str = "float32") -> dict[str, float]:
    """Bytes of one LoRA training step: frozen weights at ``dtype``; adapters, their gradients
    and two AdamW states in fp32; the activations autograd saves in a LoRA step
    (:func:`lora_activation_bytes`: far fewer than full training's, as frozen linears keep no
    inputs); the cross-entropy around the logits (as full training); the framework's
    ``runtime`` allowance (:data:`RUNTIME_ALLOWANCE_BYTES`). The total is meant as an upper
    bound of the peak (the planner's memory limit)."""
    from archsearch.planning.memory import predict_training_memory

    full = predict_training_memory(spec, batch_size, seq_len, dtype)
    n = lora_params(spec, lora)
    tokens = batch_size * seq_len
    per = lora_activation_bytes(spec, lora, dtype)
    acts = tokens * spec.n_layers * sum(v for k, v in per.items() if not k.endswith(("_position", "_token"))) \
        + tokens * per["final_norm_per_token"] + seq_len * per["rope_per_position"]
    out = {"weights": float(full["weights"]), "adapters": 4.0 * n, "adapter_gradients": 4.0 * n, "optimizer": 8.0 * n,
           "activations": float(acts), "loss": float(full["loss"]), "runtime": float(RUNTIME_ALLOWANCE_BYTES)}
    out["total"] = sum(out.values())
    out["trainable_params"] = n
    out["ffn_width_for_activations"] = active_ffn_width(spec)
    return out

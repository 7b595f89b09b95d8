"""The decoder architecture and its exact accounting (docs/method.md section 2).

:class:`ArchSpec` is a small frozen dataclass; everything derived from it (parameter counts,
ratios, KV-cache bytes, FLOPs) is a pure function of it, so the same numbers are used by the
laws, the benchmarks, the trainers and the search.

Conventions (stated once, used everywhere):

* ``n_params_non_embedding`` is the method's N: the attention and MLP weight matrices only,
  ``n_layers * (2*d*dq + 2*d*dkv + 3*d*ffn)``. Norm weights and biases are counted separately
  (``norm_params``, ``bias_params``) and only the total mixes them in.
* ``n_params_embedding`` is the input embedding plus the output head when it is not tied.
* FLOPs follow Kaplan et al. (2020): a multiply-add is 2 FLOPs and the attention term per
  token is ``2 * n_layers * T * dq`` for T attended keys. Embedding lookups cost nothing; the
  output head (``2 * d * vocab`` per token) is added only when asked for.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archsearch.configio import from_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import write_json

# Head sizes that the fused attention kernels of vLLM (FlashAttention / FlashInfer / the CPU
# backend) and SGLang accept. A candidate outside this set would build in transformers but
# could not be served, so it is rejected up front.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)
# Beyond these a shape is a typo, not a model: a million wide or 10k layers deep has never been built.
MAX_LAYERS = 10_000
MAX_HIDDEN = 1_000_000

# Model families we can export. The family only changes which small extra tensors exist
# (biases, QK-norms) and the HF architecture name; the matrix accounting is shared.
FAMILIES = {
    # family: (HF architecture, model_type, qkv bias, qk-norm width: None | "head" | "full")
    "llama": ("LlamaForCausalLM", "llama", False, None),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", True, None),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False, "head"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False, "full"),
    # Mistral without a sliding window is LLaMA's math (vLLM serves it with its Llama layers),
    # and its transformers config, unlike LlamaConfig, accepts n_heads*head_dim != hidden_size
    # with heads that do not divide the width: llama shapes of that kind are exported as it.
    "mistral": ("MistralForCausalLM", "mistral", False, None),
    # Mixture-of-experts families (need n_experts > 0): every MLP is a routed set of SwiGLU
    # experts with a bias-free linear router; qwen2_moe adds one gated shared expert.
    "mixtral": ("MixtralForCausalLM", "mixtral", False, None),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False, "head"),
    "olmoe": ("OlmoeForCausalLM", "olmoe", False, "full"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe", True, None),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "fp8": 1, "float8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``bfloat16``, ``fp16``, ``float32``, ``fp8``...)."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ArchsearchError("dtype", f"unknown dtype {dtype!r}",
                              f"use one of {sorted(set(DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class ArchSpec:
    """A LLaMA-style decoder. Defaults are LLaMA's (RMSNorm 1e-5, RoPE theta 1e4).

    Dense unless ``n_experts > 0``: then every layer's MLP is ``n_experts`` SwiGLU experts of
    width ``ffn`` each (the expert intermediate size), of which ``experts_per_token`` run per
    token, plus a linear router (and, for ``qwen2_moe``, one shared expert of width
    ``shared_expert_ffn`` with a scalar gate).
    """

    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int = 32000
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    family: str = "llama"
    name: str | None = field(default=None, compare=False)
    n_experts: int = 0
    experts_per_token: int = 0
    shared_expert_ffn: int = 0

    def __post_init__(self) -> None:
        for f in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn",
                  "vocab_size", "max_position_embeddings"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ArchsearchError(f, f"must be an integer, got {v!r}")
            if v <= 0:
                raise ArchsearchError(f, f"must be positive, got {v}")
        for f, top in (("n_layers", MAX_LAYERS), ("hidden_size", MAX_HIDDEN), ("ffn", 64 * MAX_HIDDEN)):
            if getattr(self, f) > top:
                raise ArchsearchError(f, f"{getattr(self, f):,} is beyond any buildable model", f"give at most {top:,}")
        if self.n_heads % self.n_kv_heads:
            divisors = [k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]
            raise ArchsearchError(
                "n_kv_heads", f"{self.n_kv_heads} does not divide n_heads={self.n_heads}",
                f"valid KV head counts: {divisors}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ArchsearchError(
                "head_dim", f"{self.head_dim} is not supported by the attention kernels",
                f"use one of {list(SUPPORTED_HEAD_DIMS)}")
        if self.family not in FAMILIES:
            raise ArchsearchError("family", f"unknown family {self.family!r}",
                                  f"use one of {sorted(FAMILIES)}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ArchsearchError("rms_norm_eps/rope_theta", "must be positive")
        self._check_moe()

    def _check_moe(self) -> None:
        for f in ("n_experts", "experts_per_token", "shared_expert_ffn"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ArchsearchError(f, f"must be a non-negative integer, got {v!r}")
        moe_family = self.family in MOE_FAMILIES
        if not self.n_experts:
            if moe_family:
                raise ArchsearchError("n_experts", f"family {self.family!r} is mixture-of-experts",
                                      "set n_experts and experts_per_token, or use a dense family")
            if self.experts_per_token or self.shared_expert_ffn:
                raise ArchsearchError("experts_per_token", "set on a dense spec (n_experts=0)",
                                      "set n_experts > 0 or leave the expert fields at 0")
            return
        if not moe_family:
            raise ArchsearchError("family", f"{self.family!r} is dense but n_experts={self.n_experts}",
                                  f"use one of {list(MOE_FAMILIES)}")
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ArchsearchError("experts_per_token",
                                  f"{self.experts_per_token} is not in 1..n_experts={self.n_experts}")
        if self.shared_expert_ffn and self.family != "qwen2_moe":
            raise ArchsearchError("shared_expert_ffn", f"family {self.family!r} has no shared expert",
                                  "use family qwen2_moe or set shared_expert_ffn=0")
        if self.family == "olmoe" and self.q_dim != self.hidden_size:
            # transformers' OLMoE derives head_dim = hidden_size / n_heads and ignores head_dim
            raise ArchsearchError("head_dim", f"olmoe needs n_heads*head_dim == hidden_size, got "
                                  f"{self.q_dim} != {self.hidden_size}",
                                  f"use head_dim={self.hidden_size // self.n_heads}")
        if self.family == "qwen2_moe" and not self.shared_expert_ffn:
            raise ArchsearchError("shared_expert_ffn", "qwen2_moe always has a shared expert",
                                  "set its intermediate size (> 0)")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    # -- derived sizes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def gqa(self) -> int:
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes: Any) -> "ArchSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["name"] is None:
            del d["name"]
        if not self.is_moe:  # dense specs keep their pre-MoE form
            for f in ("n_experts", "experts_per_token", "shared_expert_ffn"):
                del d[f]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ArchSpec":
        return from_dict(cls, data, where="architecture")

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> "ArchSpec":
        """From a stored architecture (:func:`describe`'s dict): its derived keys are skipped."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls.from_dict({k: v for k, v in data.items() if k in names})


# -- parameter accounting (pure functions) ---------------------------------------------------

def attention_params_per_layer(spec: ArchSpec) -> int:
    """Q and O are d x dq, K and V are d x dkv (docs/method.md section 2)."""
    return 2 * spec.hidden_size * spec.q_dim + 2 * spec.hidden_size * spec.kv_dim


def _swiglu(spec: ArchSpec, width: int) -> int:
    return 3 * spec.hidden_size * width


def _shared_expert_params(spec: ArchSpec) -> int:
    """qwen2_moe's shared expert and its d x 1 sigmoid gate; zero elsewhere."""
    return _swiglu(spec, spec.shared_expert_ffn) + spec.hidden_size if spec.shared_expert_ffn else 0


def mlp_params_per_layer(spec: ArchSpec) -> int:
    """SwiGLU gate, up and down projections; for MoE every expert, the d x E router and the
    shared expert (all stored weights)."""
    if not spec.is_moe:
        return _swiglu(spec, spec.ffn)
    return (spec.n_experts * _swiglu(spec, spec.ffn) + spec.hidden_size * spec.n_experts
            + _shared_expert_params(spec))


def active_mlp_params_per_layer(spec: ArchSpec) -> int:
    """MLP weights one token multiplies: the router, ``experts_per_token`` experts and the
    shared expert. Equals :func:`mlp_params_per_layer` for a dense spec."""
    if not spec.is_moe:
        return mlp_params_per_layer(spec)
    return (spec.experts_per_token * _swiglu(spec, spec.ffn) + spec.hidden_size * spec.n_experts
            + _shared_expert_params(spec))


def non_embedding_params(spec: ArchSpec) -> int:
    """the method's N: weight matrices of attention and MLP, no norms, no biases."""
    return spec.n_layers * (attention_params_per_layer(spec) + mlp_params_per_layer(spec))


def active_ffn_width(spec: ArchSpec) -> int:
    """MLP intermediate width one token's activations span: ``ffn`` dense; for MoE its
    ``experts_per_token`` experts plus the shared expert (memory planning uses it)."""
    return spec.experts_per_token * spec.ffn + spec.shared_expert_ffn if spec.is_moe else spec.ffn


def active_non_embedding_params(spec: ArchSpec) -> int:
    """N_active: the non-embedding weights one token uses (= N for a dense spec)."""
    return spec.n_layers * (attention_params_per_layer(spec) + active_mlp_params_per_layer(spec))


def active_params(spec: ArchSpec) -> int:
    """Every parameter one token touches (total minus the experts it is not routed to)."""
    return total_params(spec) - non_embedding_params(spec) + active_non_embedding_params(spec)


def sparsity(spec: ArchSpec) -> float:
    """Active / total non-embedding parameters: 1.0 dense, e.g. ~0.27 for Mixtral-8x7B
    (the ``sparsity`` of the batch and throughput laws, docs/method.md section 8)."""
    return active_non_embedding_params(spec) / non_embedding_params(spec)


def embedding_params(spec: ArchSpec) -> int:
    """Input embedding, plus the output head when it is not tied to it."""
    one = spec.vocab_size * spec.hidden_size
    return one if spec.tie_embeddings else 2 * one


def norm_params(spec: ArchSpec) -> int:
    """RMSNorm weights: two per layer plus the final norm, plus QK-norms where the family has them."""
    _, _, _, qk_norm = FAMILIES[spec.family]
    per_layer = 2 * spec.hidden_size
    if qk_norm == "head":
        per_layer += 2 * spec.head_dim
    elif qk_norm == "full":
        per_layer += spec.q_dim + spec.kv_dim
    return spec.n_layers * per_layer + spec.hidden_size


def bias_params(spec: ArchSpec) -> int:
    """Q/K/V projection biases (Qwen2 family); zero for LLaMA."""
    _, _, qkv_bias, _ = FAMILIES[spec.family]
    return spec.n_layers * (spec.q_dim + 2 * spec.kv_dim) if qkv_bias else 0


def total_params(spec: ArchSpec) -> int:
    """Every parameter of the instantiated model; equals ``sum(p.numel())`` in transformers."""
    return (non_embedding_params(spec) + embedding_params(spec) + norm_params(spec)
            + bias_params(spec))


def mlp_to_attn_ratio(spec: ArchSpec) -> float:
    """r = MLP params / attention params."""
    return mlp_params_per_layer(spec) / attention_params_per_layer(spec)


def hidden_over_sqrt_n(spec: ArchSpec) -> float:
    """d / sqrt(N_non_embedding)."""
    return spec.hidden_size / math.sqrt(non_embedding_params(spec))


# -- memory and compute ---------------------------------------------------------------------

def kv_cache_bytes_per_token(spec: ArchSpec, dtype: str = "bfloat16") -> int:
    """K and V for every layer: 2 * n_layers * n_kv_heads * head_dim * bytes."""
    return 2 * spec.n_layers * spec.kv_dim * dtype_bytes(dtype)


def weight_bytes(spec: ArchSpec, dtype: str = "bfloat16") -> int:
    """Bytes of all weights at ``dtype``."""
    return total_params(spec) * dtype_bytes(dtype)


def inference_flops_per_token(spec: ArchSpec, kv_len: int, include_head: bool = False) -> int:
    """Forward FLOPs for one token attending ``kv_len`` keys: 2N + 2*L*T*dq (+ 2*d*V head),
    N the active parameters for MoE (a token runs only its routed experts)."""
    if kv_len < 0:
        raise ArchsearchError("kv_len", f"must be >= 0, got {kv_len}")
    flops = 2 * active_non_embedding_params(spec) + 2 * spec.n_layers * kv_len * spec.q_dim
    if include_head:
        flops += 2 * spec.hidden_size * spec.vocab_size
    return flops


def prefill_flops(spec: ArchSpec, seq_len: int, include_head: bool = False) -> int:
    """Forward FLOPs of a causal prefill of ``seq_len`` tokens (token t attends t keys, t=1..S).

    Sum over t of (2N + 2*L*t*dq) = 2*N*S + L*dq*S*(S+1). The head is counted for every
    position when ``include_head`` (a prefill that returns all logits).
    """
    if seq_len <= 0:
        raise ArchsearchError("seq_len", f"must be positive, got {seq_len}")
    flops = 2 * active_non_embedding_params(spec) * seq_len + spec.n_layers * spec.q_dim * seq_len * (seq_len + 1)
    if include_head:
        flops += 2 * spec.hidden_size * spec.vocab_size * seq_len
    return flops


def training_flops(spec: ArchSpec, tokens: float, include_embedding: bool = False) -> float:
    """6 * N * D, N active for MoE. With ``include_embedding``, N also counts the output head
    (the matmul that costs compute); the input lookup is free either way."""
    n = active_non_embedding_params(spec)
    if include_embedding:
        n += spec.vocab_size * spec.hidden_size
    return 6.0 * n * float(tokens)


def max_batch_by_kv(spec: ArchSpec, device_memory_bytes: float, seq_len: int,
                    dtype: str = "bfloat16", memory_fraction: float = 0.9,
                    kv_dtype: str | None = None) -> int:
    """Sequences of ``seq_len`` tokens whose KV cache fits beside the weights.

    ``memory_fraction`` is the share of device memory the engine may use (vLLM's
    ``gpu_memory_utilization``). Activations are ignored here: see the planning module for
    a fuller prediction. Returns 0 when even the weights do not fit.
    """
    free = device_memory_bytes * memory_fraction - weight_bytes(spec, dtype)
    if free <= 0:
        return 0
    per_seq = kv_cache_bytes_per_token(spec, kv_dtype or dtype) * seq_len
    return int(free // per_seq)


def describe(spec: ArchSpec, dtype: str = "bfloat16") -> dict[str, Any]:
    """The describe keys: the spec plus every derived number, as one flat JSON-able dict."""
    out: dict[str, Any] = {"name": spec.name} if spec.name else {}
    out.update({k: v for k, v in spec.to_dict().items() if k != "name"})
    out.update({
        "n_params_non_embedding": non_embedding_params(spec),
        "n_params_embedding": embedding_params(spec),
        "n_params_norm": norm_params(spec),
        "n_params_bias": bias_params(spec),
        "n_params_total": total_params(spec),
        "attn_params_per_layer": attention_params_per_layer(spec),
        "mlp_params_per_layer": mlp_params_per_layer(spec),
        "mlp_to_attn_ratio": mlp_to_attn_ratio(spec),
        "hidden_over_sqrt_n": hidden_over_sqrt_n(spec),
        "gqa": spec.gqa,
        "kv_cache_dtype": dtype,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(spec, dtype),
        "inference_flops_per_token_at_0": inference_flops_per_token(spec, 0),
    })
    if spec.is_moe:
        out.update({"n_params_active_non_embedding": active_non_embedding_params(spec),
                    "n_params_active": active_params(spec), "sparsity": sparsity(spec)})
    return out


# -- Hugging Face export / import -----------------------------------------------------------

def hf_family(spec: ArchSpec) -> str:
    """The family a spec is exported as: its own, except a llama shape whose heads do not divide
    the width (transformers' LlamaConfig refuses it), which goes out as the same math under
    Mistral's config."""
    if spec.family == "llama" and spec.hidden_size % spec.n_heads:
        return "mistral"
    return spec.family


def to_hf_config(spec: ArchSpec, dtype: str = "bfloat16") -> dict[str, Any]:
    """A ``config.json`` dict that transformers and vLLM load as is."""
    arch, model_type, qkv_bias, _ = FAMILIES[hf_family(spec)]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_embeddings,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "use_cache": True,
    }
    if model_type == "llama":
        cfg.update({"attention_bias": False, "mlp_bias": False})
    elif model_type == "qwen3":
        cfg.update({"attention_bias": False, "use_sliding_window": False,
                    "max_window_layers": spec.n_layers})
    elif model_type == "qwen2":
        cfg.update({"use_sliding_window": False, "max_window_layers": spec.n_layers})
    elif model_type == "olmo2":
        cfg.update({"attention_bias": False})
    elif model_type == "mistral":
        cfg.update({"sliding_window": None})
    if spec.is_moe:
        cfg.update(_moe_hf_fields(spec))
    if qkv_bias and model_type != "qwen2":  # qwen2 always has the biases
        cfg["attention_bias"] = True
    return cfg


def _moe_hf_fields(spec: ArchSpec) -> dict[str, Any]:
    """Each MoE family's own names for the expert settings (every layer sparse)."""
    e, k = spec.n_experts, spec.experts_per_token
    if spec.family == "mixtral":
        return {"num_local_experts": e, "num_experts_per_tok": k, "sliding_window": None,
                "output_router_logits": False, "router_aux_loss_coef": 0.02}
    cfg: dict[str, Any] = {"num_experts": e, "num_experts_per_tok": k,
                           "output_router_logits": False, "router_aux_loss_coef": 0.01}
    if spec.family == "olmoe":
        return {**cfg, "norm_topk_prob": False, "clip_qkv": None}
    # qwen MoE: intermediate_size would size the dense layers of mlp_only_layers; there are none
    cfg.update({"moe_intermediate_size": spec.ffn, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "norm_topk_prob": spec.family == "qwen3_moe"})
    if spec.family == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = spec.shared_expert_ffn
    return cfg


class _HFFields:
    """The typed reader of an HF ``config.json`` mapping: every field read through it is checked
    for its type (a whole number, a finite number, a flag, a name), so a value of the wrong kind
    (``"eight"``, ``null``, ``NaN``, a list) is one error naming the file and key, not a traceback.
    An optional key given as ``null`` keeps its default, as transformers reads it."""

    def __init__(self, cfg: dict[str, Any], where: str):
        self.cfg, self.where = cfg, where

    def _fail(self, key: str, value: Any, kind: str) -> ArchsearchError:
        return ArchsearchError(f"{self.where}:{key}", f"{value!r} is not {kind}",
                               f"set {key} to {kind} (as transformers writes it)")

    def _get(self, key: str, default: Any) -> Any:
        if key not in self.cfg:
            if default is dataclasses.MISSING:
                raise ArchsearchError(f"{self.where}:{key}", "missing key",
                                      "a decoder config needs the standard transformers keys")
            return default
        value = self.cfg[key]
        if value is None and default is not dataclasses.MISSING:
            return default
        return value

    def int(self, key: str, default: Any = dataclasses.MISSING, minimum: int = 0) -> int:
        value = self._get(key, default)
        ok = (isinstance(value, int) and not isinstance(value, bool)
              or isinstance(value, float) and math.isfinite(value) and value.is_integer())
        if not ok or value < minimum:
            raise self._fail(key, value, f"a whole number >= {minimum}")
        return int(value)

    def float(self, key: str, default: Any = dataclasses.MISSING) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._fail(key, value, "a finite number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, value, "true or false")
        return value

    def name(self, key: str) -> Any:
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, str):
            raise self._fail(key, value, "a name (text)")
        return value


def _moe_from_hf(f: _HFFields, mt: str) -> dict[str, int]:
    if mt not in MOE_FAMILIES:
        return {}
    return {"n_experts": f.int("num_local_experts" if mt == "mixtral" else "num_experts"),
            "experts_per_token": f.int("num_experts_per_tok"),
            "ffn": f.int("intermediate_size" if mt in ("mixtral", "olmoe") else "moe_intermediate_size"),
            "shared_expert_ffn": f.int("shared_expert_intermediate_size", 0)}


_MODEL_TYPE_TO_FAMILY = {v[1]: k for k, v in FAMILIES.items()}


def from_hf_config(cfg: dict[str, Any], name: str | None = None, where: str = "config.json") -> ArchSpec:
    """Read an HF ``config.json`` dict of a supported family back into a spec; every field is
    read by type (:class:`_HFFields`), and an error names ``where`` (the file) and the key."""
    f = _HFFields(cfg, where)
    mt = f.name("model_type")
    if mt not in _MODEL_TYPE_TO_FAMILY:
        raise ArchsearchError(f"{where}:model_type", f"{mt!r} is not a supported decoder family",
                              f"supported: {sorted(_MODEL_TYPE_TO_FAMILY)}")
    if mt == "mistral" and cfg.get("sliding_window") is not None:
        raise ArchsearchError(f"{where}:sliding_window", f"{cfg['sliding_window']} (sliding-window "
                              "attention is not the dense decoder archsearch accounts for)",
                              "set sliding_window to null")
    heads = f.int("num_attention_heads")
    hidden = f.int("hidden_size")
    if heads == 0:
        raise f._fail("num_attention_heads", heads, "a whole number >= 1")
    rope = cfg.get("rope_parameters")
    rope_theta = (f.float("rope_theta") if cfg.get("rope_theta") is not None
                  else _HFFields(rope, f"{where}:rope_parameters").float("rope_theta", 10000.0)
                  if isinstance(rope, dict) else 10000.0)
    fields = {"ffn": f.int("intermediate_size"), **_moe_from_hf(f, mt)}
    kw = dict(n_layers=f.int("num_hidden_layers"), hidden_size=hidden, n_heads=heads,
              n_kv_heads=f.int("num_key_value_heads", heads, minimum=1),  # null: as many as heads (transformers)
              head_dim=f.int("head_dim", hidden // heads, minimum=1),
              vocab_size=f.int("vocab_size"),
              tie_embeddings=f.flag("tie_word_embeddings", False),
              max_position_embeddings=f.int("max_position_embeddings", 4096),
              rms_norm_eps=f.float("rms_norm_eps", 1e-5),
              rope_theta=rope_theta, family=_MODEL_TYPE_TO_FAMILY[mt], name=name, **fields)
    try:
        return ArchSpec(**kw)
    except ArchsearchError as e:  # values of the right type that make no model: named by the file's key
        raise ArchsearchError(f"{where}:{_HF_KEYS.get(e.field, e.field)}", e.problem, e.fix) from None


# the spec's fields as an HF config.json names them (an error about one names the file's key)
_HF_KEYS = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
            "ffn": "intermediate_size"}


def write_hf_config(spec: ArchSpec, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write ``out_dir/config.json``; returns its path."""
    return write_json(Path(out_dir) / "config.json", to_hf_config(spec, dtype))

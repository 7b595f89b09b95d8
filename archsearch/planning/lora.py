"""LoRA and QLoRA fine-tuning accounting: trainable adapter parameters by rank and target modules,
and the memory of a LoRA step (frozen base weights in their format, adapters, their gradients
and AdamW states only).

A LoRA adapter on a linear ``in -> out`` adds ``A: r x in`` and ``B: out x r`` (Hu et al. 2021),
``r * (in + out)`` parameters; the frozen weight gets no gradient and no optimizer state.
Module names are transformers' (``q_proj`` ... ``down_proj``), as peft's ``target_modules``.
Mixture-of-experts blocks hold their experts as 3-D parameters (``experts.gate_up_proj``:
E x 2 ffn x d, ``experts.down_proj``: E x d x ffn); peft adapts them through
``target_parameters`` with one ``r x E``-wide adapter pair per tensor, ``r * E * (in + out)``
parameters (peft ``lora.ParamWrapper``). QLoRA (Dettmers et al. 2023) is LoRA on a base held
in 4-bit NF4 (:mod:`archsearch.planning.formats`).
"""

from __future__ import annotations

from dataclasses import dataclass

from archsearch.arch import FAMILIES, ArchSpec, active_ffn_width, dtype_bytes
from archsearch.bounds import check_at_most
from archsearch.errors import ArchsearchError
from archsearch.planning.formats import base_weight_bytes, largest_matrix, parse_format
from archsearch.planning.memory import predict_training_memory
from archsearch.planning.time import compute_params

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
# the router of a mixture-of-experts block: a 2-D parameter (E x d) in transformers >= 5
# (``mlp.gate.weight``), adapted through peft's target_parameters with ``r * (d + E)`` parameters;
# the MoE cost paper fine-tunes it beside the experts (rank 16 on experts and router)
ROUTER = ("mlp.gate.weight",)
TARGET_GROUPS = {"attention": ATTENTION, "mlp": MLP, "experts": EXPERTS, "router": ROUTER,
                 "all-dense": ATTENTION + MLP, "all-moe": ATTENTION + EXPERTS}
PARAMETER_TARGETS = EXPERTS + ROUTER  # adapted as parameters (peft target_parameters), not modules
EXPERT_LAYOUTS = ("fused", "per-expert")
# LoRA variants the planner searches: the base weights' format (adapters stay in floating point)
VARIANTS = {"lora": None, "qlora": "nf4", "lora-int8": "int8"}


def parse_targets(text: str) -> tuple[str, ...]:
    """``q_proj,v_proj`` or group names (``attention``, ``mlp``, ``experts``, ``router``,
    ``all-dense``, ``all-moe``) joined by commas -> module names, in order, without repeats."""
    out: list[str] = []
    for t in (x.strip() for x in str(text).split(",")):
        if not t:
            continue
        for name in TARGET_GROUPS.get(t, (t,)):
            if name not in out:
                out.append(name)
    return tuple(out)


@dataclass(frozen=True)
class LoraSettings:
    """Rank and target modules of the adapters (peft's ``r`` and ``target_modules``)."""

    rank: int = 8
    targets: tuple[str, ...] = ATTENTION
    # how the experts are held: "fused" 3-D tensors (transformers >= 5, installed here; peft's
    # ParamWrapper merges W + B A per forward) or "per-expert" nn.Linear w1/w3/w2 per expert
    # (transformers 4.x, the MoE cost paper's): one adapter per expert linear, nothing merged.
    # The per-expert layout is accounted by the same rules but not checked against peft here.
    expert_layout: str = "fused"

    def __post_init__(self) -> None:
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ArchsearchError("lora.expert_layout", f"{self.expert_layout!r}", f"use one of {list(EXPERT_LAYOUTS)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ArchsearchError("lora.rank", f"must be an integer >= 1, got {self.rank!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        bad = [t for t in self.targets if t not in ATTENTION + MLP + PARAMETER_TARGETS]
        if bad or not self.targets:
            raise ArchsearchError("lora.targets", f"unknown target(s) {bad}" if bad else "empty",
                                  f"use some of {list(ATTENTION + MLP + PARAMETER_TARGETS)} or a group "
                                  f"{sorted(TARGET_GROUPS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ArchsearchError("lora.targets", f"a target is named twice in {list(self.targets)}")

    def describe(self) -> str:
        layout = "" if self.expert_layout == "fused" else f" ({self.expert_layout} experts)"
        return f"rank {self.rank} on {','.join(self.targets)}{layout}"


def check_lora_targets(spec: ArchSpec, lora: LoraSettings) -> None:
    """Targets must exist in the model: expert tensors only in a mixture-of-experts spec; the
    dense MLP names in one only where it has a shared expert (qwen2_moe's, which they adapt).
    The rank is at most the hidden size: an adapter's update d x r x k has rank <= min(d, k)."""
    check_at_most("lora.rank", lora.rank, spec.hidden_size,
                  f"an adapter's rank is at most the hidden size {spec.hidden_size:,}; beyond it adds weights, not rank")
    experts = [t for t in lora.targets if t in PARAMETER_TARGETS]
    if experts and not spec.is_moe:
        raise ArchsearchError("lora.targets", f"expert / router targets {experts} on a dense model "
                              f"({spec.name or spec.family})", f"use the MLP projections {list(MLP)}")
    dense = [t for t in lora.targets if t in MLP]
    if dense and spec.is_moe and not spec.shared_expert_ffn:
        raise ArchsearchError("lora.targets", f"MLP targets {dense} on a mixture-of-experts model without "
                              f"a shared expert ({spec.name or spec.family})",
                              f"target the experts: {list(EXPERTS)} (or the group 'experts')")


def _shapes(spec: ArchSpec, expert_layout: str = "fused") -> dict[str, tuple[int, int, int]]:
    """(in, out, adapters per layer) of every target: one adapter per linear; for the 3-D expert
    tensors one adapter pair ``r*E`` wide (peft ParamWrapper); in the per-expert layout
    ``experts.gate_up_proj`` stands for each expert's w1 and w3 (2 E adapters d -> ffn) and
    ``experts.down_proj`` for its w2 (E adapters); on a MoE spec the dense MLP names are its
    shared expert's."""
    d, dq, dkv = spec.hidden_size, spec.q_dim, spec.kv_dim
    f = spec.shared_expert_ffn if spec.is_moe else spec.ffn
    out = {"q_proj": (d, dq, 1), "k_proj": (d, dkv, 1), "v_proj": (d, dkv, 1), "o_proj": (dq, d, 1),
           "gate_proj": (d, f, 1), "up_proj": (d, f, 1), "down_proj": (f, d, 1)}
    if spec.is_moe:
        e = spec.n_experts
        out.update({"experts.gate_up_proj": (d, 2 * spec.ffn, e), "experts.down_proj": (spec.ffn, d, e),
                    "mlp.gate.weight": (d, e, 1)})
        if expert_layout == "per-expert":
            out["experts.gate_up_proj"] = (d, spec.ffn, 2 * e)
    return out


def lora_params(spec: ArchSpec, lora: LoraSettings) -> int:
    """Trainable adapter parameters: ``rank * (in + out)`` per targeted linear per layer;
    ``rank * E * (in + out)`` per targeted expert tensor (equal to peft's trainable count)."""
    check_lora_targets(spec, lora)
    shapes = _shapes(spec, lora.expert_layout)
    return spec.n_layers * sum(lora.rank * (shapes[t][0] + shapes[t][1]) * shapes[t][2] for t in lora.targets)


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
    intermediates = 4.0 * lora.rank * len(t - set(PARAMETER_TARGETS))
    rope = cb * 2.0 * spec.head_dim
    # per token, once: the final norm's input; pre-norm families do not save the first layer's
    # attention norm input (the frozen embedding's output needs no gradient), the same size
    final = 4.0 * (d + 1) if post_norm else 0.0
    # expert adapters (peft ParamWrapper): the adapted 3-D tensor is merged, W + B A, for all E
    # experts each forward, and the grouped matmul saves that merged tensor and its routed input
    # (its weight now needs a gradient): a per-layer block independent of the tokens
    shapes = _shapes(spec, lora.expert_layout) if spec.is_moe else {}
    expert_inputs = sum(cb * spec.experts_per_token * shapes[x][0] for x in t & set(EXPERTS))
    merged = sum(cb * shapes[x][0] * shapes[x][1] * shapes[x][2] for x in t & set(PARAMETER_TARGETS))
    if lora.expert_layout == "per-expert":
        # nothing merged and the frozen expert linears save nothing: each routed expert's
        # adapters keep their input in fp32 (peft's upcast: w1 and w3 share it in fp32, each
        # casts its own in a lower precision) and their rank-wide intermediate, per routed token
        k, per = spec.experts_per_token, {"experts.gate_up_proj": 2, "experts.down_proj": 1}
        merged = sum(cb * shapes[x][0] * shapes[x][1] for x in t & set(ROUTER))
        expert_inputs = sum(cb * shapes[x][0] for x in t & set(ROUTER)) + sum(
            4.0 * k * shapes[x][0] * (1 if cb == 4 else per[x]) for x in t & set(EXPERTS))
        intermediates += sum(4.0 * lora.rank * k * per[x] for x in t & set(EXPERTS))
    # a router adapter (ParamWrapper): the router's matmul now saves its input, every token's
    expert_inputs += sum(cb * shapes[x][0] for x in t & set(ROUTER))
    return {"norms": norms, "attention": attention, "mlp": mlp, "adapter_inputs": inputs,
            "adapter_intermediates": intermediates, "expert_adapter_inputs": expert_inputs,
            "rope_per_position": rope, "final_norm_per_token": final, "expert_merged_weights_per_layer": merged}


def lora_saved_bytes(spec: ArchSpec, lora: LoraSettings, batch_size: int, seq_len: int,
                     dtype: str = "float32", activation_checkpointing: bool = False) -> float:
    """Total bytes autograd saves in one LoRA step (:func:`lora_activation_bytes` summed over
    tokens, layers, positions). With ``activation_checkpointing`` (transformers'
    ``gradient_checkpointing_enable``, per decoder layer, as LLaMA-Factory turns it on by
    default): each layer keeps only its input hidden state (``hidden_size`` values per token in
    the compute dtype) and backward recomputes one layer at a time, so the peak holds every
    layer's input plus one layer's saved set (and one layer's merged expert block)."""
    per = lora_activation_bytes(spec, lora, dtype)
    tokens = batch_size * seq_len
    per_token_layer = sum(v for k, v in per.items() if not k.endswith(("_position", "_token", "_per_layer")))
    outside = tokens * per["final_norm_per_token"] + seq_len * per["rope_per_position"]
    if activation_checkpointing:
        return (tokens * (spec.n_layers * spec.hidden_size * dtype_bytes(dtype) + per_token_layer) + outside
                + per["expert_merged_weights_per_layer"])
    return tokens * spec.n_layers * per_token_layer + outside + spec.n_layers * per["expert_merged_weights_per_layer"]


def predict_lora_memory(spec: ArchSpec, lora: LoraSettings, batch_size: int, seq_len: int,
                        dtype: str = "float32", *, weight_format=None,
                        adapter_dtype: str = "float32", activation_checkpointing: bool = False) -> dict[str, float]:
    """Bytes of one LoRA (QLoRA) training step at compute dtype ``dtype``:

    * ``weights``: the frozen base, its linear weights in ``weight_format`` (default ``dtype``;
      ``nf4``: QLoRA, ``int8``: LLM.int8()) and the rest in ``dtype``
      (:func:`archsearch.planning.formats.base_weight_bytes`);
    * ``adapters``, ``adapter_gradients``, ``optimizer``: what is trained, in ``adapter_dtype``
      (peft's default ``autocast_adapter_dtype`` keeps adapters in fp32 over a bf16/fp16 base;
      pass the compute dtype for adapters cast down), two AdamW states of the same dtype
      (``torch.optim.AdamW`` keeps them ``zeros_like`` the parameter);
    * ``activations``: what autograd saves in a LoRA step (:func:`lora_activation_bytes`: far
      fewer than full training's, as frozen linears keep no inputs; with
      ``activation_checkpointing`` each layer's input and one layer's set, :func:`lora_saved_bytes`);
    * ``dequant_workspace``: a quantised base is dequantised one weight at a time to ``dtype``
      for its matmul: the largest such weight;
    * ``loss``: the cross-entropy around the full-sequence logits (as full training);
    * ``runtime``: the framework's allowance (:data:`RUNTIME_ALLOWANCE_BYTES`).

    The total is meant as an upper bound of the peak (the planner's memory limit)."""
    fmt = parse_format(weight_format, dtype)
    full = predict_training_memory(spec, batch_size, seq_len, dtype)
    n = lora_params(spec, lora)
    ab = dtype_bytes(adapter_dtype)
    base = base_weight_bytes(spec, fmt, dtype)
    out = {"weights": base["total"], "adapters": float(ab * n), "adapter_gradients": float(ab * n),
           "optimizer": float(2 * ab * n), "activations": float(lora_saved_bytes(spec, lora, batch_size, seq_len, dtype, activation_checkpointing)),
           "dequant_workspace": float(largest_matrix(spec) * dtype_bytes(dtype)) if fmt.quantised else 0.0,
           "loss": float(full["loss"]), "runtime": float(RUNTIME_ALLOWANCE_BYTES)}
    out["total"] = sum(out.values())
    out["trainable_params"] = n
    out["ffn_width_for_activations"] = active_ffn_width(spec)
    return out


def lora_step_flops(spec: ArchSpec, lora: LoraSettings, tokens: int, seq_len: int | None = None) -> float:
    """FLOPs of one LoRA step on ``tokens`` tokens: the forward (2 N) and the backward to the
    activations only (2 N, the frozen weights get no gradient) through the compute parameters,
    plus full training (6 per parameter) of the adapters; with ``seq_len``, attention's
    score and value matmuls too (``6 L S dq`` per token, forward + backward, as
    :func:`archsearch.trainers.loop.train_flops_per_token` counts them: attention has no
    weights, so LoRA does not shorten its backward)."""
    attention = 0.0 if seq_len is None else 6.0 * spec.n_layers * seq_len * spec.q_dim
    return float(tokens) * (4.0 * compute_params(spec) + 6.0 * lora_params(spec, lora) + attention)


LORA_STEP_FORMULA = "tokens x (4 N_compute + 6 N_adapters + 6 L S dq)"

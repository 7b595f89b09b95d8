"""Predicted peak memory for inference and training, and the largest batch that fits.

Every prediction is a sum of named terms in bytes (``weights``, ``kv_cache``, ...), with the
assumptions that produced them, so a gap to a measurement can be traced to a term. All terms
are affine in the batch size, which makes the largest batch that fits a closed form.

Inference (one forward at a time, HF/vLLM style):

* ``weights``: every parameter (:func:`archsearch.arch.total_params`) at the weight dtype.
* ``kv_cache``: ``kv_cache_bytes_per_token * batch * (input_len + output_len)`` (docs/method.md section 2).
* ``activations``: the transient working set of the largest step, the prefill of
  ``batch * input_len`` tokens. Layers run one after another and free their temporaries, so
  it is one layer's peak: attention phase ``2d + 4*dq`` elements per token (residual, normed
  input, Q, Q after RoPE, K/V repeated to the query heads for GQA, attention output), MLP phase
  ``2d + 3*ffn`` (residual, normed input, act(gate), up, their product; for MoE ffn is the
  routed experts' summed width, ``arch.active_ffn_width``); plus the logits: the last
  position's, ``batch * vocab`` in fp32, by default (what generate and serving engines compute),
  or every prompt position's, ``batch * input_len * vocab`` in their dtype, for a plain
  forward (``logits_positions="prompt"``: fp32 at a 256,000 vocabulary is 31.25 MiB per
  sequence of 32 tokens, 62.5 MiB of 64, 2 GB at batch 32 x 64). A quantised base (``weight_format``) adds one
  dequantised weight. Attention scores (``S x S``) are assumed not
  materialised (SDPA / flash kernels); pass ``materialised_scores=True`` for eager attention.
  Paged engines (vLLM) reserve a fixed share of device memory up front and add CUDA graphs and
  allocator slack: this prediction is what the model needs, not what such an engine takes.

Training (per device, per micro-batch of ``batch`` sequences of ``seq_len``):

* ``weights``, ``gradients``, ``optimizer``: mixed-precision AdamW keeps 2 + 2 + 12 bytes per
  parameter (bf16 weights and gradients; fp32 master copy, first and second moments), 16 in
  all (Rajbhandari et al. 2020, ZeRO, section 3.1: 2Ψ + 2Ψ + KΨ with K = 12). Plain fp32
  AdamW: 4 + 4 + 8, also 16. Gradients are counted as persistent (DDP gradient buckets; loops
  that zero rather than free them).
* sharding: TP divides every weight matrix (vocabulary-parallel embeddings included); PP
  gives each stage ``1/PP`` of the layers, the busiest stage holding one vocabulary matrix as
  well; with ``dp = devices / (TP*PP)`` data-parallel replicas, ZeRO-1 shards the optimizer
  states, ZeRO-2 also the gradients, FSDP (ZeRO-3) also the weights, each by ``dp``.
* ``activations`` saved for backward, per layer and token, in elements: attention
  ``3d + 3*dq + 2*dkv`` (norm input, normalised, norm output; Q, K, V; attention output and
  its copy that feeds the output projection), MLP ``3d + 4*ffn`` (norm tensors; gate,
  act(gate), up, their product) — the SwiGLU/GQA analogue of Korthikanti et al. 2022's
  ``34*s*b*h`` bytes with flash attention and no dropout. TP divides them by TP (with
  sequence parallelism), PP keeps ``L/PP`` layers, each with up to PP micro-batches in
  flight for 1F1B (Korthikanti et al. section 4.2.3: the first stage stores PP micro-batches
  of L/PP layers, i.e. one full model's worth). Activation checkpointing keeps only each
  layer's input plus one layer's full set.
* ``loss``: the cross-entropy over ``batch*seq*vocab`` logits at the start of backward: the
  fp32 log-softmax output (saved), its gradient and the logits' gradient, 3 x 4 bytes, plus
  the logits' gradient cast back to the compute dtype when that is not fp32. The logits
  themselves are freed after the loss (log-softmax saves its output, not its input) when the
  loop keeps only the loss, as HF's Trainer does.
* ``optimizer_step``: the foreach AdamW step's temporary (one fp32 tensor per parameter for
  sqrt(v)); it happens after backward has freed the activations, so the peak is
  ``weights + gradients + optimizer + max(activations + loss, optimizer_step)``.
"""

from __future__ import annotations

from typing import Any

from archsearch.arch import (ArchSpec, active_ffn_width, bias_params, dtype_bytes, kv_cache_bytes_per_token,
                             non_embedding_params, norm_params, total_params)
from archsearch.errors import ArchsearchError
from archsearch.planning.formats import base_weight_bytes, largest_matrix, parse_format

GIB = 2**30
PARALLELISMS = ("ddp", "zero1", "zero2", "fsdp")
OPTIMIZERS = ("adamw", "sgd")


def _positive_int(name: str, v: Any, allow_zero: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
        raise ArchsearchError(name, f"must be an integer >= {0 if allow_zero else 1}, got {v!r}")
    return v


def check_parallelism(spec: ArchSpec, tp: int = 1, pp: int = 1, n_devices: int | None = None) -> int:
    """Validate TP/PP against the shape (and the device count); returns the data-parallel size.

    TP splits heads, KV heads (when it does not exceed them; Megatron replicates KV heads
    beyond that) and the SwiGLU width; PP splits whole layers.
    """
    _positive_int("tp", tp)
    _positive_int("pp", pp)
    if spec.n_heads % tp:
        ok = [t for t in range(1, spec.n_heads + 1) if spec.n_heads % t == 0]
        raise ArchsearchError("tp", f"tensor parallel degree {tp} does not divide n_heads={spec.n_heads}",
                              f"use one of {ok}")
    if tp <= spec.n_kv_heads and spec.n_kv_heads % tp:
        raise ArchsearchError("tp", f"tensor parallel degree {tp} does not divide n_kv_heads={spec.n_kv_heads}",
                              "use a divisor of both head counts")
    if tp > spec.n_kv_heads and tp % spec.n_kv_heads:
        raise ArchsearchError("tp", f"tensor parallel degree {tp} is not a multiple of n_kv_heads={spec.n_kv_heads}",
                              "KV heads can only be replicated evenly")
    if spec.ffn % tp:
        raise ArchsearchError("tp", f"tensor parallel degree {tp} does not divide ffn={spec.ffn}",
                              "use a divisor of the SwiGLU width")
    if spec.n_layers % pp:
        ok = [p for p in range(1, spec.n_layers + 1) if spec.n_layers % p == 0]
        raise ArchsearchError("pp", f"pipeline parallel degree {pp} does not divide n_layers={spec.n_layers}",
                              f"use one of {ok}")
    if n_devices is None:
        return 1
    _positive_int("n_devices", n_devices)
    if n_devices % (tp * pp):
        raise ArchsearchError("gpus", f"{n_devices} devices are not a multiple of tp*pp={tp * pp}",
                              "use a device count divisible by tp*pp")
    return n_devices // (tp * pp)


LOGITS_POSITIONS = ("last", "prompt")


def predict_inference_memory(spec: ArchSpec, batch_size: int, input_len: int, output_len: int,
                             dtype: str = "bfloat16", *, kv_dtype: str | None = None,
                             materialised_scores: bool = False,
                             prefill_chunk_tokens: int | None = None, weight_format: Any = None,
                             logits_positions: str = "last", logits_dtype: str = "float32") -> dict[str, Any]:
    """Peak bytes to generate ``output_len`` tokens after ``input_len`` for ``batch_size`` sequences.

    Returns ``weights``, ``kv_cache``, ``activations`` (with the logits), ``logits``, ``total``
    (bytes), ``total_gib`` and ``assumptions``; see the module docstring for each term.
    ``prefill_chunk_tokens`` caps the tokens of one prefill step (vLLM's
    ``max_num_batched_tokens`` with chunked prefill). ``weight_format`` stores the linear
    weights (``int8``, ``nf4``: :mod:`archsearch.planning.formats`), default ``dtype``.
    ``logits_positions``: ``last`` (what generate and serving engines compute: one position
    per sequence) or ``prompt`` (a forward that returns every prompt position's logits, as a
    profiler's plain forward does), each ``vocab`` values of ``logits_dtype``.
    """
    _positive_int("batch_size", batch_size, allow_zero=True)
    _positive_int("input_len", input_len)
    _positive_int("output_len", output_len, allow_zero=True)
    if logits_positions not in LOGITS_POSITIONS:
        raise ArchsearchError("logits_positions", f"{logits_positions!r}", f"use one of {list(LOGITS_POSITIONS)}")
    wb = dtype_bytes(dtype)
    fmt = parse_format(weight_format, dtype)
    weights = base_weight_bytes(spec, fmt, dtype)["total"]
    kv = kv_cache_bytes_per_token(spec, kv_dtype or dtype) * batch_size * (input_len + output_len)
    tokens = batch_size * input_len
    if prefill_chunk_tokens is not None:
        tokens = min(tokens, _positive_int("prefill_chunk_tokens", prefill_chunk_tokens))
    d, dq, ffn = spec.hidden_size, spec.q_dim, active_ffn_width(spec)
    attn = 2 * d + 4 * dq
    mlp = 2 * d + 3 * ffn
    acts = tokens * max(attn, mlp) * wb
    if materialised_scores:
        acts += batch_size * spec.n_heads * input_len * input_len * wb
    if fmt.quantised:  # one weight dequantised at a time for its matmul
        acts += largest_matrix(spec) * wb
    positions = input_len if logits_positions == "prompt" else 1
    logits = batch_size * positions * spec.vocab_size * dtype_bytes(logits_dtype)
    total = weights + kv + acts + logits
    return {
        "weights": weights, "kv_cache": kv, "activations": acts + logits, "logits": logits, "total": total,
        "total_gib": total / GIB,
        "assumptions": {
            "dtype": dtype, "weight_format": fmt.describe(), "logits": f"{positions} position(s) x "
            f"{spec.vocab_size} x {logits_dtype} per sequence ({logits_positions})",
            "kv_dtype": kv_dtype or dtype, "batch_size": batch_size,
            "input_len": input_len, "output_len": output_len, "prefill_tokens_per_step": tokens,
            "activation_elements_per_token": max(attn, mlp),
            "activation_phase": "attention" if attn >= mlp else "mlp",
            "logits_bytes": logits,
            "attention_scores_materialised": materialised_scores,
            "note": "model needs only; paged engines (vLLM) reserve gpu_memory_utilization of "
                    "the device up front plus CUDA graphs and allocator slack",
        },
    }


def _bytes_per_param(dtype: str, optimizer: str) -> tuple[int, int, int, str]:
    """(weights, gradients, optimizer) bytes per parameter and the source of the split."""
    if optimizer not in OPTIMIZERS:
        raise ArchsearchError("optimizer", f"unknown optimizer {optimizer!r}", f"use one of {list(OPTIMIZERS)}")
    b = dtype_bytes(dtype)
    if b == 4:
        opt = 8 if optimizer == "adamw" else 0
        return 4, 4, opt, "fp32: 4 weights + 4 gradients + (8 AdamW moments)"
    opt = 12 if optimizer == "adamw" else 4
    return b, b, opt, (f"mixed precision: {b} weights + {b} gradients + {opt} fp32 master"
                       f"{' + moments' if optimizer == 'adamw' else ''} (ZeRO, Rajbhandari et al. 2020)")


def predict_training_memory(spec: ArchSpec, batch_size: int, seq_len: int, dtype: str = "bfloat16",
                            *, optimizer: str = "adamw", parallelism: str = "ddp",
                            n_devices: int = 1, tp: int = 1, pp: int = 1,
                            activation_checkpointing: bool = False) -> dict[str, Any]:
    """Peak bytes per device of one training step with micro-batches of ``batch_size`` x ``seq_len``.

    Returns ``weights``, ``gradients``, ``optimizer``, ``activations``, ``loss``,
    ``optimizer_step``, ``total`` (bytes), ``total_gib`` and ``assumptions``.
    """
    _positive_int("batch_size", batch_size, allow_zero=True)
    _positive_int("seq_len", seq_len)
    if parallelism not in PARALLELISMS:
        raise ArchsearchError("parallelism", f"unknown parallelism {parallelism!r}",
                              f"use one of {list(PARALLELISMS)}")
    dp = check_parallelism(spec, tp, pp, n_devices)
    wb, gb, ob, split = _bytes_per_param(dtype, optimizer)
    vocab_matrix = spec.vocab_size * spec.hidden_size
    body = non_embedding_params(spec) + norm_params(spec) + bias_params(spec)
    if pp == 1:
        params = total_params(spec) / tp
    else:  # the busiest stage: its share of the layers plus one vocabulary matrix
        params = (body / pp + vocab_matrix) / tp
    shard_opt = dp if parallelism in ("zero1", "zero2", "fsdp") else 1
    shard_grad = dp if parallelism in ("zero2", "fsdp") else 1
    shard_w = dp if parallelism == "fsdp" else 1
    weights = params * wb / shard_w
    grads = params * gb / shard_grad
    opt = params * ob / shard_opt

    cb = dtype_bytes(dtype)
    d, dq, dkv, ffn = spec.hidden_size, spec.q_dim, spec.kv_dim, active_ffn_width(spec)
    per_token_layer = (3 * d + 3 * dq + 2 * dkv) + (3 * d + 4 * ffn)
    tokens = batch_size * seq_len
    layers = spec.n_layers // pp
    in_flight = pp  # 1F1B: the first stage holds PP micro-batches
    if activation_checkpointing:
        acts = tokens * (layers * in_flight * d + per_token_layer / tp) * cb
    else:
        acts = tokens * layers * in_flight * per_token_layer * cb / tp
    loss = tokens * spec.vocab_size * (12 + (0 if cb == 4 else cb)) / tp
    step = params / shard_opt * 4 if optimizer == "adamw" else 0
    total = weights + grads + opt + max(acts + loss, step)
    return {
        "weights": weights, "gradients": grads, "optimizer": opt, "activations": acts,
        "loss": loss, "optimizer_step": step, "total": total, "total_gib": total / GIB,
        "assumptions": {
            "dtype": dtype, "optimizer": optimizer, "bytes_per_param": f"{wb + gb + ob} ({split})",
            "parallelism": parallelism, "n_devices": n_devices, "tp": tp, "pp": pp, "dp": dp,
            "params_per_device": params, "batch_size": batch_size, "seq_len": seq_len,
            "activation_elements_per_token_per_layer": per_token_layer,
            "activation_checkpointing": activation_checkpointing,
            "gradients": "persistent (DDP buckets / zeroed, not freed)",
            "peak": "weights + gradients + optimizer + max(activations + loss, optimizer_step)",
        },
    }


def max_affine(f, limit: float, field: str) -> int:
    """Largest batch b >= 0 with f(b) <= limit for f affine in b (0 when even b=1 does not fit)."""
    fixed = f(0)
    per = f(1) - fixed
    if per <= 0:
        raise ArchsearchError(field, "per-sequence memory is not positive")
    return max(0, int((limit - fixed) // per))


def max_inference_batch(spec: ArchSpec, device_memory_bytes: float, input_len: int, output_len: int,
                        dtype: str = "bfloat16", memory_fraction: float = 0.9, **kw: Any) -> int:
    """Largest batch whose predicted inference peak fits in ``memory_fraction`` of the device."""
    if not 0 < memory_fraction <= 1:
        raise ArchsearchError("memory_fraction", f"must be in (0, 1], got {memory_fraction}")
    return max_affine(lambda b: predict_inference_memory(spec, b, input_len, output_len, dtype, **kw)["total"],
                       device_memory_bytes * memory_fraction, "batch_size")


def max_training_batch(spec: ArchSpec, device_memory_bytes: float, seq_len: int,
                       dtype: str = "bfloat16", memory_fraction: float = 0.95, **kw: Any) -> int:
    """Largest micro-batch per device whose predicted training peak fits (``memory_fraction``
    leaves room for the CUDA context and allocator fragmentation)."""
    if not 0 < memory_fraction <= 1:
        raise ArchsearchError("memory_fraction", f"must be in (0, 1], got {memory_fraction}")
    def f(b: int) -> float:
        m = predict_training_memory(spec, b, seq_len, dtype, **kw)
        # only the first branch of max() grows with b; b=0 compares activations to the step
        return m["weights"] + m["gradients"] + m["optimizer"] + m["activations"] + m["loss"]
    static = predict_training_memory(spec, 0, seq_len, dtype, **kw)["total"]
    if static > device_memory_bytes * memory_fraction:
        return 0
    return max_affine(f, device_memory_bytes * memory_fraction, "batch_size")

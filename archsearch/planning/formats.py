"""Weight formats of frozen base weights (bf16/fp16/fp32, 8-bit, 4-bit NF4) and their bytes,
as the libraries that hold them store them.

Which tensors a format applies to: every linear weight matrix of the decoder layers (attention
projections, dense MLP, each expert's projections, the router, a shared expert and its gate);
bitsandbytes replaces ``nn.Linear`` layers and transformers leaves the output head out of the
conversion (``llm_int8_skip_modules`` defaults to the head). Embeddings, the head, norms and
biases stay in the compute dtype.

* ``bfloat16`` / ``float16`` / ``float32``: ``n * bytes``.
* ``int8`` (LLM.int8(), bitsandbytes ``Linear8bitLt``; Dettmers et al. 2022): an int8 copy of
  the weight (``CB``, one byte per element) and one fp32 scale per output row (``SCB``).
* ``nf4`` (4-bit NormalFloat, bitsandbytes ``Linear4bit`` / ``quantize_4bit``; Dettmers et al.
  2023, QLoRA, section 3): two 4-bit codes per byte, ``ceil(n/2)`` bytes; one absmax per block
  of 64 elements. With double quantisation (``bnb_4bit_use_double_quant``, ``compress_statistics``)
  the absmax values are themselves quantised to 8 bits in blocks of 256 (``quantize_blockwise``),
  which keeps one fp32 absmax per 256 blocks and one fp32 offset (their mean); without it the
  absmax values are fp32. Each tensor also keeps its 16-entry fp32 NF4 code. Per element:
  ``4 + 8/64 + 32/(64*256) = 4.127`` bits with double quantisation, ``4 + 32/64 = 4.5`` without
  (QLoRA section 3: "from 32/64 = 0.5 bits to 8/64 + 32/(64*256) = 0.127 bits"). The 256-entry
  fp32 map of the second quantisation is one cached tensor shared by every weight, counted once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from archsearch.arch import ArchSpec, bias_params, dtype_bytes, embedding_params, norm_params
from archsearch.errors import ArchsearchError

_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "8bit": "int8", "4bit": "nf4"}
NF4_BLOCK = 64           # bitsandbytes quantize_4bit blocksize (its default, and QLoRA's)
NF4_STATS_BLOCK = 256    # quantize_blockwise blocksize of the double quantisation
NF4_CODE_BYTES = 16 * 4  # the 16 NF4 levels, fp32, per tensor
DQ_MAP_BYTES = 256 * 4   # the dynamic 8-bit map of the second quantisation, one shared tensor


@dataclass(frozen=True)
class StorageFormat:
    """One registered weight format: the bytes of one linear weight matrix of ``rows x cols`` (out
    x in) held in it (``double_quant``: the format's double-quantisation switch, where it has one),
    the bytes it keeps once for the whole model, and how a report names it. A new format is one of
    these plus its line in :data:`FORMATS` (docs/extending.md)."""

    name: str
    matrix_bytes: Callable[[int, int, bool], int]
    quantised: bool = True
    shared_bytes: Callable[[bool], int] = lambda double_quant: 0
    describe: Callable[[bool], str] | None = None


def _float(name: str) -> StorageFormat:
    return StorageFormat(name, lambda rows, cols, dq: rows * cols * dtype_bytes(name), quantised=False)


def _nf4_bytes(rows: int, cols: int, double_quant: bool) -> int:
    n = rows * cols
    blocks = math.ceil(n / NF4_BLOCK)
    stats = blocks + 4 * math.ceil(blocks / NF4_STATS_BLOCK) + 4 if double_quant else 4 * blocks
    return (n + 1) // 2 + stats + NF4_CODE_BYTES


# name -> format: the one list of the formats a base model's frozen weights can be held in
FORMATS: dict[str, StorageFormat] = {
    "float32": _float("float32"),
    "bfloat16": _float("bfloat16"),
    "float16": _float("float16"),
    "int8": StorageFormat("int8", lambda rows, cols, dq: rows * cols + 4 * rows,
                          describe=lambda dq: "int8 (LLM.int8(), fp32 scale per row)"),
    "nf4": StorageFormat("nf4", _nf4_bytes, shared_bytes=lambda dq: DQ_MAP_BYTES if dq else 0,
                         describe=lambda dq: "nf4 (4-bit NormalFloat, blocks of 64" +
                         (", double-quantised absmax)" if dq else ", fp32 absmax)")),
}
FLOAT_FORMATS = tuple(n for n, f in FORMATS.items() if not f.quantised)


@dataclass(frozen=True)
class WeightFormat:
    """The storage format of frozen base weights (a name of :data:`FORMATS`); ``double_quant``
    applies to a format that has the switch (``nf4``)."""

    name: str = "bfloat16"
    double_quant: bool = True

    def __post_init__(self) -> None:
        name = _ALIASES.get(str(self.name).lower(), str(self.name).lower())
        if name not in FORMATS:
            raise ArchsearchError("weight_format", f"unknown format {self.name!r}",
                                  f"use one of {list(FORMATS)} (aliases {sorted(_ALIASES)})")
        object.__setattr__(self, "name", name)

    @property
    def storage(self) -> StorageFormat:
        return FORMATS[self.name]

    @property
    def quantised(self) -> bool:
        return self.storage.quantised

    def describe(self) -> str:
        return self.storage.describe(self.double_quant) if self.storage.describe else self.name


def parse_format(text: str | WeightFormat | None, default: str = "bfloat16") -> WeightFormat:
    """``nf4``, ``nf4-nodq`` (no double quantisation), ``int8``, ``bf16``... -> WeightFormat."""
    if isinstance(text, WeightFormat):
        return text
    if text is None:
        return WeightFormat(default)
    t = str(text).strip().lower()
    if t in ("nf4-nodq", "nf4-no-dq"):
        return WeightFormat("nf4", double_quant=False)
    return WeightFormat(t)


def matrix_bytes(rows: int, cols: int, fmt: WeightFormat, count: int = 1) -> int:
    """Bytes of ``count`` weight matrices of ``rows x cols`` (out x in) in ``fmt`` (module doc)."""
    return count * fmt.storage.matrix_bytes(rows, cols, fmt.double_quant)


def linear_matrices(spec: ArchSpec) -> list[tuple[str, int, int, int]]:
    """(name, rows, cols, count over all layers) of every linear weight a quantiser converts."""
    d, dq, dkv, f, L = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.ffn, spec.n_layers
    out = [("q_proj", dq, d, L), ("k_proj", dkv, d, L), ("v_proj", dkv, d, L), ("o_proj", d, dq, L)]
    if not spec.is_moe:
        return out + [("gate_proj", f, d, L), ("up_proj", f, d, L), ("down_proj", d, f, L)]
    e = spec.n_experts
    out += [("experts.gate_proj", f, d, L * e), ("experts.up_proj", f, d, L * e),
            ("experts.down_proj", d, f, L * e), ("router", e, d, L)]
    if spec.shared_expert_ffn:
        s = spec.shared_expert_ffn
        out += [("shared_expert.gate_proj", s, d, L), ("shared_expert.up_proj", s, d, L),
                ("shared_expert.down_proj", d, s, L), ("shared_expert_gate", 1, d, L)]
    return out


def base_weight_bytes(spec: ArchSpec, fmt: WeightFormat | str | None = None,
                      compute_dtype: str = "bfloat16") -> dict[str, float]:
    """Bytes of the frozen base model: ``quantised`` (the linear weights in ``fmt``, default the
    compute dtype), ``unquantised`` (embeddings, head, norms, biases in ``compute_dtype``),
    ``shared_constants`` (the double quantisation's map, once) and ``total``; with
    ``linear_params`` and ``other_params`` (their sum is :func:`archsearch.arch.total_params`)
    and ``bits_per_linear_param``."""
    fmt = parse_format(fmt, compute_dtype)
    mats = linear_matrices(spec)
    lin_params = sum(r * c * n for _, r, c, n in mats)
    quant = sum(matrix_bytes(r, c, fmt, n) for _, r, c, n in mats)
    other = embedding_params(spec) + norm_params(spec) + bias_params(spec)
    unquant = other * dtype_bytes(compute_dtype)
    shared = fmt.storage.shared_bytes(fmt.double_quant)
    return {"quantised": float(quant), "unquantised": float(unquant), "shared_constants": float(shared),
            "total": float(quant + unquant + shared), "linear_params": lin_params, "other_params": other,
            "bits_per_linear_param": 8.0 * quant / lin_params, "format": fmt.describe()}


def largest_matrix(spec: ArchSpec) -> int:
    """Elements of the largest single linear weight (a quantised layer dequantises one at a time)."""
    return max(r * c for _, r, c, _ in linear_matrices(spec))

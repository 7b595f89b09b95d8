"""Named reference architectures, each with its source (litgpt-style table).

``published_params`` is the total parameter count as published: exact where the source gives
an exact count (the safetensors metadata of the Hugging Face repository, or the model card),
otherwise the model card's rounded figure with ``published_precision`` giving the rounding.
Qwen3 cards also give a rounded non-embedding count. Tests check every entry against them.

:func:`load_arch` resolves what a user names as an architecture: a preset or a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from archsearch.arch import ArchSpec, from_hf_config
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_text


@dataclass(frozen=True)
class Preset:
    spec: ArchSpec
    source: str
    published_params: int
    published_precision: int = 1  # the published total is exact to this many parameters
    published_non_embedding: int | None = None
    published_active: int | None = None  # MoE: parameters one token uses
    published_active_precision: int = 1
    # figures a paper's table prints for the shape, as printed ("0.082"): each is checked against
    # the spec to half a unit of its last digit (tests/test_arch.py); for models published as a
    # table row, not a checkpoint, these are the count's source (d/sqrt(N) fixes N to ~1%)
    published_table: tuple[tuple[str, str], ...] = ()


def _p(name, source, published, precision=1, non_embed=None, active=None, active_precision=1,
       table=(), **fields) -> Preset:
    return Preset(ArchSpec(name=name, **fields), source, published, precision, non_embed,
                  active, active_precision, tuple(table))


# The inference-efficient models of arXiv 2510.18245 (Bian, Yu, Venkataraman, Park; the method's
# source, chapter of the author's dissertation). Its Table 1 (Table 2 for Panda-3B°) prints d_model,
# f_size (ffn), n_layers, GQA, d_model/sqrt(N) and r; section 3.1 fixes head_dim at 64 for N <= 1B
# and 128 for N >= 3B. The head count is not printed: it follows from r and GQA, as attention is
# 2 d head_dim (n_heads + n_kv_heads) and the MLP 3 d f, so n_heads = 3 f GQA / (2 head_dim r (GQA + 1)),
# rounded; the test checks that the rounded pair gives back the printed r and d/sqrt(N). They are
# "LLaMA-3.2-style" models: the vocabulary and tied embeddings are LLaMA-3.2's (the paper states no
# other tokenizer; N is non-embedding, so neither enters the check).
_PAPER = ("arXiv 2510.18245, {table} (d_model, f_size, n_layers, GQA, d_model/sqrt(N), r), "
          "https://arxiv.org/html/2510.18245v2; head_dim from its section 3.1; heads derived from r and GQA")
_LLAMA32_STYLE = dict(family="llama", rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
                      tie_embeddings=True, max_position_embeddings=131072)


def _table(d, f, layers, gqa, x1, r):
    return (("hidden_size", d), ("ffn", f), ("n_layers", layers), ("gqa", gqa),
            ("hidden_over_sqrt_n", x1), ("mlp_to_attn", r))


_LLAMA3 = dict(family="llama", rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
               max_position_embeddings=131072)
_QWEN25 = dict(family="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=151936,
               max_position_embeddings=32768)
_QWEN3 = dict(family="qwen3", rms_norm_eps=1e-6, rope_theta=1000000.0, vocab_size=151936,
              max_position_embeddings=40960, head_dim=128)
_SMOL = dict(family="llama", rms_norm_eps=1e-5, vocab_size=49152, tie_embeddings=True,
             head_dim=64, max_position_embeddings=8192)
_HF = "https://huggingface.co/{}/blob/main/config.json (params: the repository's safetensors metadata)"

PRESETS: dict[str, Preset] = {p.spec.name: p for p in [
    _p("llama-3.2-1b", _HF.format("meta-llama/Llama-3.2-1B"), 1_235_814_400,
       n_layers=16, hidden_size=2048, n_heads=32, n_kv_heads=8, head_dim=64, ffn=8192,
       tie_embeddings=True, **_LLAMA3),
    _p("llama-3.2-3b", _HF.format("meta-llama/Llama-3.2-3B"), 3_212_749_824,
       n_layers=28, hidden_size=3072, n_heads=24, n_kv_heads=8, head_dim=128, ffn=8192,
       tie_embeddings=True, **_LLAMA3),
    _p("llama-3.1-8b", _HF.format("meta-llama/Llama-3.1-8B"), 8_030_261_248,
       n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336,
       tie_embeddings=False, **_LLAMA3),
    _p("qwen2.5-0.5b", _HF.format("Qwen/Qwen2.5-0.5B"), 494_032_768,
       n_layers=24, hidden_size=896, n_heads=14, n_kv_heads=2, head_dim=64, ffn=4864,
       tie_embeddings=True, **_QWEN25),
    _p("qwen2.5-1.5b", _HF.format("Qwen/Qwen2.5-1.5B"), 1_543_714_304,
       n_layers=28, hidden_size=1536, n_heads=12, n_kv_heads=2, head_dim=128, ffn=8960,
       tie_embeddings=True, **_QWEN25),
    _p("qwen2.5-3b", _HF.format("Qwen/Qwen2.5-3B"), 3_085_938_688,
       n_layers=36, hidden_size=2048, n_heads=16, n_kv_heads=2, head_dim=128, ffn=11008,
       tie_embeddings=True, **_QWEN25),
    _p("qwen2.5-7b", _HF.format("Qwen/Qwen2.5-7B"), 7_615_616_512,
       n_layers=28, hidden_size=3584, n_heads=28, n_kv_heads=4, head_dim=128, ffn=18944,
       tie_embeddings=False, **{**_QWEN25, "vocab_size": 152064, "max_position_embeddings": 131072}),
    # Qwen3 model cards give rounded totals and non-embedding counts ("0.6B", "0.44B").
    _p("qwen3-0.6b", "https://huggingface.co/Qwen/Qwen3-0.6B (model card: 0.6B, non-embedding 0.44B)",
       600_000_000, 100_000_000, 440_000_000,
       n_layers=28, hidden_size=1024, n_heads=16, n_kv_heads=8, ffn=3072,
       tie_embeddings=True, **_QWEN3),
    _p("qwen3-1.7b", "https://huggingface.co/Qwen/Qwen3-1.7B (model card: 1.7B, non-embedding 1.4B)",
       1_700_000_000, 100_000_000, 1_400_000_000,
       n_layers=28, hidden_size=2048, n_heads=16, n_kv_heads=8, ffn=6144,
       tie_embeddings=True, **_QWEN3),
    _p("qwen3-4b", "https://huggingface.co/Qwen/Qwen3-4B (model card: 4.0B, non-embedding 3.6B)",
       4_000_000_000, 100_000_000, 3_600_000_000,
       n_layers=36, hidden_size=2560, n_heads=32, n_kv_heads=8, ffn=9728,
       tie_embeddings=True, **_QWEN3),
    _p("qwen3-8b", "https://huggingface.co/Qwen/Qwen3-8B (model card: 8.2B, non-embedding 6.95B)",
       8_200_000_000, 100_000_000, 6_950_000_000,
       n_layers=36, hidden_size=4096, n_heads=32, n_kv_heads=8, ffn=12288,
       tie_embeddings=False, **_QWEN3),
    _p("smollm2-135m", _HF.format("HuggingFaceTB/SmolLM2-135M"), 134_515_008,
       n_layers=30, hidden_size=576, n_heads=9, n_kv_heads=3, ffn=1536, rope_theta=100000.0,
       **_SMOL),
    _p("smollm2-360m", _HF.format("HuggingFaceTB/SmolLM2-360M"), 361_821_120,
       n_layers=32, hidden_size=960, n_heads=15, n_kv_heads=5, ffn=2560, rope_theta=100000.0,
       **_SMOL),
    _p("smollm2-1.7b", _HF.format("HuggingFaceTB/SmolLM2-1.7B"), 1_711_376_384,
       n_layers=24, hidden_size=2048, n_heads=32, n_kv_heads=32, ffn=8192, rope_theta=130000.0,
       **_SMOL),
    _p("olmo-2-1b", _HF.format("allenai/OLMo-2-0425-1B"), 1_484_916_736,
       n_layers=16, hidden_size=2048, n_heads=16, n_kv_heads=16, head_dim=128, ffn=8192,
       vocab_size=100352, tie_embeddings=False, family="olmo2", rms_norm_eps=1e-6,
       rope_theta=500000.0, max_position_embeddings=4096),
    # Mixture-of-experts. published_active: the active count the card/paper gives (rounded).
    _p("mixtral-8x7b", _HF.format("mistralai/Mixtral-8x7B-v0.1") + "; active 12.9B: mistral.ai/news/mixtral-of-experts",
       46_702_792_704, active=12_900_000_000, active_precision=100_000_000,
       n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336,
       n_experts=8, experts_per_token=2, vocab_size=32000, tie_embeddings=False, family="mixtral",
       rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768),
    _p("qwen3-30b-a3b", "https://huggingface.co/Qwen/Qwen3-30B-A3B (model card: 30.5B, 3.3B activated, "
       "non-embedding 29.9B)", 30_500_000_000, 100_000_000, 29_900_000_000,
       # the card's "3.3B activated" is 1.6% under the exact 3.353B (attention, router, 8 experts,
       # embedding and head); it does not say how it rounds, so the check allows +-0.1B
       active=3_300_000_000, active_precision=200_000_000,
       n_layers=48, hidden_size=2048, n_heads=32, n_kv_heads=4, ffn=768, n_experts=128,
       experts_per_token=8, tie_embeddings=False, **{**_QWEN3, "family": "qwen3_moe"}),
    _p("olmoe-1b-7b", "https://huggingface.co/allenai/OLMoE-1B-7B-0924 (paper arXiv:2409.02060: "
       "6.9B total, 1.3B active)", 6_900_000_000, 100_000_000,
       active=1_300_000_000, active_precision=100_000_000,
       n_layers=16, hidden_size=2048, n_heads=16, n_kv_heads=16, head_dim=128, ffn=1024,
       n_experts=64, experts_per_token=8, vocab_size=50304, tie_embeddings=False, family="olmoe",
       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096),
    # The method's own models (see _PAPER above): no checkpoint is published, so published_params is
    # 0 and the count is checked through the table's d/sqrt(N) (N to about 1%) and r.
    _p("panda-1b", _PAPER.format(table="Table 1"), 0, table=_table("2560", "4096", "16", "4", "0.082", "1.07"),
       n_layers=16, hidden_size=2560, n_heads=72, n_kv_heads=18, head_dim=64, ffn=4096, **_LLAMA32_STYLE),
    _p("surefire-1b", _PAPER.format(table="Table 1"), 0, table=_table("2560", "6144", "16", "9", "0.082", "3.6"),
       n_layers=16, hidden_size=2560, n_heads=36, n_kv_heads=4, head_dim=64, ffn=6144, **_LLAMA32_STYLE),
    _p("panda-3b", _PAPER.format(table="Table 1"), 0, table=_table("4096", "4096", "28", "3", "0.077", "1"),
       n_layers=28, hidden_size=4096, n_heads=36, n_kv_heads=12, head_dim=128, ffn=4096, **_LLAMA32_STYLE),
    _p("surefire-3b", _PAPER.format(table="Table 1"), 0, table=_table("4096", "4096", "28", "7", "0.077", "1"),
       n_layers=28, hidden_size=4096, n_heads=42, n_kv_heads=6, head_dim=128, ffn=4096, **_LLAMA32_STYLE),
    # Morph-1B (arXiv 2501.18107, Bian, Yan, Venkataraman): the model card gives d_model 3072 and
    # 12 layers; the repository's config with that shape gives 16 heads (head_dim 192), GPT-NeoX's
    # padded vocabulary 50432 and untied embeddings; open_lm's SwiGLU width rule,
    # 256 * ceil(8 d / 3 / 256), gives ffn 8192. The card's "1 billion parameter" is nominal: the
    # shape holds 1.36B non-embedding and 1.67B parameters in all (this project's count), so no
    # count is checked, only the shape against its sources.
    _p("morph-1b", "https://huggingface.co/NaiveUser/morph-1b (model card: d_model 3072, n_layers 12); "
       "github.com/Waterpine/open-lm-morph open_lm/model_configs/scale_open_lm_1b_v8.json (hidden_dim 3072, "
       "n_layers 12, n_heads 16, vocab_size 50432, weight_tying false); ffn: open_lm's SwiGLU rule", 0,
       table=(("hidden_size", "3072"), ("n_layers", "12"), ("n_heads", "16")),
       n_layers=12, hidden_size=3072, n_heads=16, n_kv_heads=16, head_dim=192, ffn=8192, vocab_size=50432,
       tie_embeddings=False, family="llama", max_position_embeddings=2048),
    # Tiny shapes for tests and CPU demos (not published models: count is our own).
    _p("tiny", "archsearch debug shape", 0, n_layers=2, hidden_size=64, n_heads=2,
       n_kv_heads=1, head_dim=32, ffn=128, vocab_size=256, max_position_embeddings=512),
]}


def get_preset(name: str) -> ArchSpec:
    """The spec of a named preset (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise ArchsearchError("preset", f"unknown preset {name!r}",
                              f"known presets: {', '.join(PRESETS)}")
    return PRESETS[key].spec


def load_arch(source: str | Path) -> ArchSpec:
    """An architecture from a preset name, a folder with ``config.json``, an HF
    ``config.json`` file, or an archsearch architecture JSON (``describe`` output or spec)."""
    src = str(source)
    if src in PRESETS or src.lower() in {k.lower() for k in PRESETS}:
        return get_preset(src)
    p = Path(src)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ArchsearchError("architecture", f"{src!r} is neither a preset nor a file",
                              "give a preset name (archsearch arch list), a folder with "
                              "config.json, or an architecture JSON")
    try:
        data = json.loads(read_text(p))
    except json.JSONDecodeError as e:
        raise ArchsearchError(str(p), f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ArchsearchError(str(p), f"holds a {type(data).__name__}, not a JSON object",
                              "give an HF config.json or an architecture JSON object")
    if "architecture" in data and isinstance(data["architecture"], dict):
        data = data["architecture"]
    if "model_type" in data:
        name = data.get("_name_or_path")
        return from_hf_config(data, name=name if isinstance(name, str) and name else None, where=str(p))
    return ArchSpec.from_record(data)

"""Architecture accounting: exact counts vs transformers and published models, FLOPs, KV bytes."""

from __future__ import annotations

import json
import math

import pytest

from archsearch.arch import (ArchSpec, active_non_embedding_params, active_params, describe, embedding_params, from_hf_config,
                             hidden_over_sqrt_n,
                             inference_flops_per_token, kv_cache_bytes_per_token,
                             max_batch_by_kv, mlp_to_attn_ratio, non_embedding_params,
                             norm_params, prefill_flops, to_hf_config, total_params,
                             sparsity, training_flops, weight_bytes)
from archsearch.errors import ArchsearchError
from archsearch.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.published_params])
def test_preset_matches_published_count(name):
    p = PRESETS[name]
    total = total_params(p.spec)
    assert abs(total - p.published_params) <= p.published_precision / 2, (total, p.published_params)
    if p.published_non_embedding:
        assert abs(non_embedding_params(p.spec) - p.published_non_embedding) <= p.published_precision / 2
    assert p.source


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.published_table])
def test_preset_matches_its_source_table(name):
    """A model published as a table row (arXiv 2510.18245 Table 1, Morph-1B's card and config):
    every printed figure agrees with the spec to half a unit of its last printed digit; d/sqrt(N)
    at 3 decimals pins the non-embedding count to about 1%."""
    p = PRESETS[name]
    s = p.spec
    have = {"hidden_size": s.hidden_size, "ffn": s.ffn, "n_layers": s.n_layers, "n_heads": s.n_heads,
            "gqa": s.gqa, "hidden_over_sqrt_n": hidden_over_sqrt_n(s), "mlp_to_attn": mlp_to_attn_ratio(s)}
    for key, printed in p.published_table:
        decimals = len(printed.split(".")[1]) if "." in printed else 0
        assert abs(have[key] - float(printed)) <= 0.5 * 10 ** -decimals + 1e-12, (name, key, have[key], printed)
    assert p.source


@pytest.mark.parametrize("name", ["panda-1b", "surefire-1b", "panda-3b", "surefire-3b"])
def test_paper_heads_follow_from_r_and_gqa(name):
    """The paper prints r and GQA, not heads: n_heads = 3 f GQA / (2 head_dim r (GQA + 1)), and
    the table's r is printed to 2-3 figures, so the pair is the integer nearest the formula."""
    s = get_preset(name)
    table = dict(PRESETS[name].published_table)
    r, g = float(table["mlp_to_attn"]), int(table["gqa"])
    assert s.n_heads == round(3 * s.ffn * g / (2 * s.head_dim * r * (g + 1)) / g) * g
    assert s.head_dim == (64 if s.n_layers == 16 else 128)  # the paper's section 3.1


def test_surefire_1b_count_by_hand():
    """Issue #37's figure: Surefire-1B holds 965M non-embedding parameters, 3.5% under 1B."""
    s = get_preset("surefire-1b")
    attn = 2 * 2560 * 64 * (36 + 4)
    mlp = 3 * 2560 * 6144
    assert non_embedding_params(s) == 16 * (attn + mlp) == 964_689_920
    assert s.n_heads == 36 and s.n_kv_heads == 4 and s.gqa == 9


def test_morph_1b_ffn_is_open_lm_rule():
    s = get_preset("morph-1b")
    assert s.ffn == 256 * math.ceil(8 * s.hidden_size / 3 / 256) == 8192
    assert s.head_dim * s.n_heads == s.hidden_size  # open_lm: head_dim = dim // n_heads


def test_llama_3_2_1b_by_hand():
    s = get_preset("llama-3.2-1b")
    # docs/method.md section 2: attention 2*d*dq + 2*d*dkv, MLP 3*d*ffn, per layer, 16 layers
    attn = 2 * 2048 * 2048 + 2 * 2048 * 512
    mlp = 3 * 2048 * 8192
    assert non_embedding_params(s) == 16 * (attn + mlp) == 973_078_528
    assert embedding_params(s) == 128256 * 2048
    assert norm_params(s) == 16 * 2 * 2048 + 2048
    assert mlp_to_attn_ratio(s) == pytest.approx(mlp / attn)
    assert kv_cache_bytes_per_token(s, "bfloat16") == 2 * 16 * 8 * 64 * 2 == 32768
    assert kv_cache_bytes_per_token(s, "float32") == 65536
    assert s.gqa == 4


def test_flops_formulas():
    s = get_preset("llama-3.2-1b")
    n = non_embedding_params(s)
    assert inference_flops_per_token(s, 0) == 2 * n
    # docs/method.md section 2: n_layers*(2d dq + 2d dkv + 2d dkv + 2d dq + 2 T dq + 6 d ffn)
    T = 100
    d, dq, dkv = 2048, 2048, 512
    per_layer = 2*d*dq + 2*d*dkv + 2*d*dkv + 2*d*dq + 2*T*dq + 6*d*8192
    assert inference_flops_per_token(s, T) == 16 * per_layer
    assert prefill_flops(s, 3) == sum(inference_flops_per_token(s, t) for t in (1, 2, 3))
    assert inference_flops_per_token(s, 0, include_head=True) == 2 * n + 2 * d * 128256
    assert training_flops(s, 1e9) == 6 * n * 1e9
    with pytest.raises(ArchsearchError):
        prefill_flops(s, 0)


def test_chinchilla_rule_of_thumb():
    # Chinchilla 70B at 1.4T tokens is about 5.8e23 FLOPs (Hoffmann et al. 2022, Table 3 rounding:
    # 6*N*D with N=70e9 -> 5.88e23). Our 6ND with a 70B-ish non-embedding N must agree.
    s = ArchSpec(n_layers=80, hidden_size=8192, n_heads=64, n_kv_heads=64, head_dim=128, ffn=28672 * 2 // 3 * 0 + 22016)
    assert training_flops(s, 1.4e12) == pytest.approx(6 * non_embedding_params(s) * 1.4e12)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "olmo2"])
@pytest.mark.parametrize("tie", [False, True])
def test_count_equals_transformers_numel(family, tie):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = ArchSpec(n_layers=2, hidden_size=96, n_heads=4, n_kv_heads=2, head_dim=32, ffn=160,
                    vocab_size=211, tie_embeddings=tie, family=family)
    cfg = AutoConfig.for_model(**to_hf_config(spec, "float32"))
    model = AutoModelForCausalLM.from_config(cfg)
    numel = sum(p.numel() for p in model.parameters())
    assert numel == total_params(spec)
    assert type(model).__name__ == to_hf_config(spec)["architectures"][0]
    # round trip through config.json
    assert from_hf_config(to_hf_config(spec)) == spec
    assert weight_bytes(spec, "float32") == 4 * numel
    assert torch.is_tensor(next(model.parameters()))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "olmo2"])
def test_heads_not_dividing_width_build_and_count(family, tmp_path):
    # the method's shapes: n_heads*head_dim != hidden and n_heads does not divide it (2560 with
    # 72 heads of 64, here scaled down). LlamaConfig refuses them, so llama goes out as Mistral.
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from archsearch.arch import hf_family, write_hf_config
    from archsearch.presets import load_arch

    spec = ArchSpec(n_layers=2, hidden_size=80, n_heads=6, n_kv_heads=2, head_dim=32, ffn=160,
                    vocab_size=211, family=family)
    write_hf_config(spec, tmp_path, "float32")
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.model_type == ("mistral" if family == "llama" else family)
    assert cfg.head_dim == 32 and cfg.num_attention_heads == 6
    assert getattr(cfg, "sliding_window", None) is None
    model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == total_params(spec)
    back = load_arch(tmp_path)
    assert back == spec.replace(family=hf_family(spec))
    assert non_embedding_params(back) == non_embedding_params(spec)
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 211) and torch.isfinite(out).all()


def test_hf_export_loads_with_autoconfig(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from archsearch.arch import write_hf_config

    spec = get_preset("tiny")
    write_hf_config(spec, tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.model_type == "llama" and cfg.num_key_value_heads == 1 and cfg.head_dim == 32
    m = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in m.parameters()) == total_params(spec)


@pytest.mark.parametrize("bad, field", [
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(head_dim=48), "head_dim"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(ffn=-5), "ffn"),
    (dict(n_layers=2.5), "n_layers"),
    (dict(family="gpt2"), "family"),
])
def test_bad_spec_names_field(bad, field):
    base = dict(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128)
    with pytest.raises(ArchsearchError) as e:
        ArchSpec(**{**base, **bad})
    assert e.value.field == field


def test_describe_keys_and_max_batch():
    s = get_preset("llama-3.2-1b")
    d = describe(s)
    for k in ("n_params_non_embedding", "n_params_embedding", "n_params_total", "mlp_to_attn_ratio",
              "hidden_over_sqrt_n", "gqa", "kv_cache_bytes_per_token"):
        assert k in d
    assert d["hidden_over_sqrt_n"] == pytest.approx(2048 / math.sqrt(973_078_528))
    json.dumps(d)
    # 80 GiB, 90%: (0.9*80GiB - weights) / (32 KiB * 5120 tokens)
    mem = 80 * 2**30
    expected = int((0.9 * mem - total_params(s) * 2) // (32768 * 5120))
    assert max_batch_by_kv(s, mem, 5120) == expected
    assert max_batch_by_kv(s, 1e9, 5120) == 0


# -- mixture of experts -------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.published_active])
def test_moe_preset_active_count(name):
    p = PRESETS[name]
    assert p.spec.is_moe
    assert abs(active_params(p.spec) - p.published_active) <= p.published_active_precision / 2


def test_mixtral_by_hand():
    s = get_preset("mixtral-8x7b")
    attn = 2 * 4096 * 4096 + 2 * 4096 * 1024
    expert = 3 * 4096 * 14336
    assert non_embedding_params(s) == 32 * (attn + 8 * expert + 4096 * 8)
    assert active_non_embedding_params(s) == 32 * (attn + 2 * expert + 4096 * 8)
    assert sparsity(s) == pytest.approx(active_non_embedding_params(s) / non_embedding_params(s))
    # FLOPs follow the active weights, memory the stored ones; KV is the dense formula
    assert inference_flops_per_token(s, 0) == 2 * active_non_embedding_params(s)
    assert training_flops(s, 1e9) == 6 * active_non_embedding_params(s) * 1e9
    assert weight_bytes(s, "bfloat16") == 2 * total_params(s)
    assert kv_cache_bytes_per_token(s, "bfloat16") == 2 * 32 * 8 * 128 * 2
    d = describe(s)
    assert d["n_params_active"] == active_params(s) and d["n_experts"] == 8


def test_dense_spec_has_no_moe_fields():
    s = get_preset("llama-3.2-1b")
    assert not s.is_moe and sparsity(s) == 1.0 and active_params(s) == total_params(s)
    assert "n_experts" not in s.to_dict() and "n_experts" not in to_hf_config(s)


@pytest.mark.parametrize("fields, bad", [
    (dict(family="mixtral"), "n_experts"),
    (dict(n_experts=4, experts_per_token=2), "family"),
    (dict(family="mixtral", n_experts=4, experts_per_token=5), "experts_per_token"),
    (dict(family="mixtral", n_experts=4, experts_per_token=0), "experts_per_token"),
    (dict(family="olmoe", n_experts=4, experts_per_token=2, shared_expert_ffn=64), "shared_expert_ffn"),
    (dict(family="qwen2_moe", n_experts=4, experts_per_token=2), "shared_expert_ffn"),
    (dict(experts_per_token=2), "experts_per_token"),
    (dict(family="olmoe", n_experts=4, experts_per_token=2, head_dim=64, n_heads=2), "head_dim"),
    (dict(family="mixtral", n_experts=-1, experts_per_token=1), "n_experts"),
])
def test_moe_validation_names_field(fields, bad):
    base = dict(n_layers=2, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=32)
    with pytest.raises(ArchsearchError) as e:
        ArchSpec(**{**base, **fields})
    assert e.value.field == bad


@pytest.mark.parametrize("family, shared", [("mixtral", 0), ("qwen3_moe", 0), ("olmoe", 0),
                                            ("qwen2_moe", 48)])
def test_moe_count_equals_transformers_numel(family, shared):
    pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = ArchSpec(n_layers=2, hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=40,
                    vocab_size=97, family=family, n_experts=4, experts_per_token=2,
                    shared_expert_ffn=shared)
    cfg = AutoConfig.for_model(**to_hf_config(spec, "float32"))
    model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == total_params(spec)
    assert type(model).__name__ == to_hf_config(spec)["architectures"][0]
    assert from_hf_config(to_hf_config(spec)) == spec

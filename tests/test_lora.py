"""LoRA accounting: adapter parameters equal peft's trainable count; memory terms."""

from __future__ import annotations

import pytest

from archsearch.arch import ArchSpec
from archsearch.errors import ArchsearchError
from archsearch.planning.lora import ATTENTION, MLP, LoraSettings, lora_params, predict_lora_memory


@pytest.mark.parametrize("targets", [ATTENTION, ("q_proj", "v_proj"), ATTENTION + MLP])
@pytest.mark.parametrize("rank", [1, 8])
def test_adapter_count_equals_peft(targets, rank):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from archsearch.arch import to_hf_config

    spec = ArchSpec(n_layers=2, hidden_size=96, n_heads=4, n_kv_heads=2, head_dim=32, ffn=160, vocab_size=211)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec, "float32")))
    peft_model = get_peft_model(model, LoraConfig(r=rank, target_modules=list(targets)))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert trainable == lora_params(spec, LoraSettings(rank, targets))


def test_lora_memory_terms_and_bad_settings():
    spec = ArchSpec(n_layers=2, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=128, vocab_size=256)
    m = predict_lora_memory(spec, LoraSettings(4), 2, 32)
    n = m["trainable_params"]
    assert m["adapters"] == m["adapter_gradients"] == 4 * n and m["optimizer"] == 8 * n
    assert m["total"] == pytest.approx(sum(m[k] for k in ("weights", "adapters", "adapter_gradients",
                                                          "optimizer", "activations", "loss", "runtime")))
    with pytest.raises(ArchsearchError) as e:
        LoraSettings(rank=0)
    assert e.value.field == "lora.rank"
    with pytest.raises(ArchsearchError) as e:
        LoraSettings(targets=("qkv",))
    assert e.value.field == "lora.targets"


def test_measured_lora_step_runs_peft_and_reports_time_and_peak():
    """A real (tiny, random-weight) LoRA step in a fresh process: peft's adapters, timed steps, a
    loss and a peak; a spec and a model together are refused before anything runs."""
    pytest.importorskip("peft")
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("peak RSS via Linux /proc")
    from archsearch.planning.measured import measure_lora_step

    spec = ArchSpec(n_layers=2, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=128, vocab_size=256)
    r = measure_lora_step(spec=spec, rank=4, targets=("q_proj", "v_proj"), batch_size=2, seq_len=32, steps=2)
    assert r["trainable_params"] == lora_params(spec, LoraSettings(4, ("q_proj", "v_proj")))
    assert len(r["step_wall_s"]) == len(r["step_cpu_s"]) == 2 and min(r["step_wall_s"]) > 0
    assert len(r["losses"]) == 3 and r["peak_above_model_bytes"] > 0
    with pytest.raises(ArchsearchError):
        measure_lora_step(model="smollm2-135m", spec=spec, rank=4, targets=("q_proj",), batch_size=1, seq_len=8)


def _saved_activation_bytes(spec, targets, batch, seq, dtype):
    """Bytes of the distinct tensors autograd saved for backward in one peft LoRA forward
    (walking the graph from the loss; parameters and the loss's log-softmax excluded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from archsearch.arch import to_hf_config
    from archsearch.trainers.loop import apply_lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec, "float32"))).to(dtype)
    model.config.use_cache = False
    model, _ = apply_lora(model.train(), spec, 4, targets)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ids = torch.randint(0, spec.vocab_size, (batch, seq))
    loss = model(input_ids=ids, labels=ids).loss
    seen: dict[int, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                v = getattr(node, name)
            except RuntimeError:
                continue
            for t in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 1:
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in params:
                        seen.setdefault(ptr, t.untyped_storage().nbytes())
        stack += [f for f, _ in node.next_functions]
    return sum(seen.values()) - batch * seq * spec.vocab_size * 4  # the log-softmax: the loss term


@pytest.mark.parametrize("family,dtype,exact", [("llama", "float32", True), ("llama", "bfloat16", True),
                                                ("qwen3", "float32", True), ("qwen3", "bfloat16", True),
                                                ("olmo2", "float32", True), ("olmo2", "bfloat16", False),
                                                ("mixtral", "float32", False), ("qwen2_moe", "bfloat16", False)])
def test_lora_activations_equal_what_autograd_saves(family, dtype, exact):
    """The LoRA activation accounting against the tensors a real peft LoRA forward saves: equal
    for attention (and, dense, all-projection) adapters; within 1% where a few small tensors
    are not modelled; an over-estimate (never under) for targets that leave the first layer's
    attention without a gradient."""
    pytest.importorskip("peft")
    import torch

    from archsearch.planning.lora import lora_activation_bytes

    moe = {"n_experts": 4, "experts_per_token": 2, **({"shared_expert_ffn": 96} if family == "qwen2_moe" else {})}
    spec = ArchSpec(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=80, vocab_size=128,
                    family=family, **(moe if family in ("mixtral", "qwen2_moe") else {}))
    batch, seq = 2, 16
    cases = [(ATTENTION, "equal")] + ([(ATTENTION + MLP, "equal")] if not spec.is_moe else []) + [(("o_proj",), "over")]
    for targets, how in cases:
        saved = _saved_activation_bytes(spec, targets, batch, seq, getattr(torch, dtype))
        per = lora_activation_bytes(spec, LoraSettings(4, targets), dtype)
        layer = sum(v for k, v in per.items() if not k.endswith(("_position", "_token")))
        pred = batch * seq * (spec.n_layers * layer + per["final_norm_per_token"]) + seq * per["rope_per_position"]
        if how == "over":
            assert saved < pred < 1.5 * saved, (targets, saved, pred)
        elif exact:
            assert pred == saved, (targets, saved, pred)
        else:
            assert pred == pytest.approx(saved, rel=0.01), (targets, saved, pred)


def test_bench_two_point_check_recovers_an_affine_step_time():
    """bench_lora_step's two-point check: steps costing ``0.3 s + F / 1e9`` are predicted exactly
    from a block's calibration entries and its batch-4 entry; the one-point prediction is slower."""
    from archsearch.benchmarks.scripts.bench_lora_step import two_point_check

    f = {(1, 128): 1e9, (1, 512): 4.3e9, (4, 128): 4e9}
    t = {k: 0.3 + v / 1e9 for k, v in f.items()}
    order = [("calibration", 1, 128), ("held-out", 1, 512), ("calibration again", 1, 128),
             ("held-out", 4, 128), ("calibration again", 1, 128)]
    rows = [{"role": role, "position": i, "block": 0, "config": f"m b{b}x{s}", "batch": b, "seq_len": s,
             "flops_per_step": f[(b, s)], "step_wall_s_measured": t[(b, s)], "step_cpu_s_measured": 2 * t[(b, s)]}
            for i, (role, b, s) in enumerate(order)]
    out = two_point_check(rows)
    assert [(x["config"], x["clock"]) for x in out] == [("m b1x512", "wall"), ("m b1x512", "cpu")]
    wall = out[0]
    assert wall["ratio_measured_over_two_point"] == pytest.approx(1.0) and wall["overhead_s"] == pytest.approx(0.3)
    assert wall["ratio_measured_over_one_point"] < 0.85


# -- weight formats, expert adapters, what is trained ------------------------------------------

def test_nf4_int8_bytes_as_bitsandbytes_stores_them():
    """A 4096 x 4096 weight, hand-derived from bitsandbytes' quantize_4bit (blocks of 64, absmax
    quantised to 8 bits in blocks of 256, one fp32 absmax per 256 blocks and an fp32 offset; the
    16-entry fp32 NF4 code) and Int8Params (int8 copy, fp32 scale per row)."""
    from archsearch.planning.formats import WeightFormat, matrix_bytes, parse_format

    n = 4096 * 4096
    assert matrix_bytes(4096, 4096, parse_format("nf4")) == n // 2 + n // 64 + 4 * (n // 64 // 256) + 4 + 64
    assert matrix_bytes(4096, 4096, parse_format("nf4-nodq")) == n // 2 + 4 * (n // 64) + 64
    assert matrix_bytes(4096, 4096, parse_format("int8")) == n + 4 * 4096
    assert matrix_bytes(4096, 4096, parse_format("bf16"), count=3) == 3 * 2 * n
    # QLoRA section 3: double quantisation costs 8/64 + 32/(64*256) = 0.127 bits per parameter
    bits = 8 * matrix_bytes(4096, 4096, WeightFormat("nf4")) / n - 4
    assert bits == pytest.approx(8 / 64 + 32 / (64 * 256), abs=1e-4) and round(bits, 3) == 0.127
    with pytest.raises(ArchsearchError) as e:
        parse_format("int3")
    assert e.value.field == "weight_format"


@pytest.mark.parametrize("name", ["llama-3.2-1b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_base_weights_partition_every_parameter(name):
    from archsearch.arch import non_embedding_params, total_params
    from archsearch.planning.formats import base_weight_bytes
    from archsearch.presets import get_preset

    spec = get_preset(name)
    bf16 = base_weight_bytes(spec, "bf16", "bfloat16")
    assert bf16["linear_params"] == non_embedding_params(spec)
    assert bf16["linear_params"] + bf16["other_params"] == total_params(spec)
    assert bf16["total"] == 2 * total_params(spec)
    nf4 = base_weight_bytes(spec, "nf4", "bfloat16")
    assert nf4["bits_per_linear_param"] == pytest.approx(4.127, abs=2e-3)
    assert nf4["unquantised"] == 2 * nf4["other_params"]


MOE_SPEC = dict(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=80, vocab_size=128,
                family="mixtral", n_experts=4, experts_per_token=2)


@pytest.mark.parametrize("targets", [("q_proj",), ("q_proj", "experts.gate_up_proj", "experts.down_proj"),
                                     ("experts.down_proj",), ("mlp.gate.weight",),
                                     ("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")])
def test_expert_adapter_count_equals_peft(targets):
    """Expert projections of a real (tiny) Mixtral through peft's target_parameters."""
    pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from archsearch.arch import to_hf_config
    from archsearch.trainers.loop import apply_lora

    spec = ArchSpec(**MOE_SPEC)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec, "float32")))
    _, info = apply_lora(model, spec, 4, targets)  # raises when peft's count differs
    assert info["trainable_params"] == lora_params(spec, LoraSettings(4, targets))


def test_adapters_stay_fp32_over_a_bf16_base_in_peft():
    """peft's default (autocast_adapter_dtype) upcasts adapters: predict_lora_memory's default."""
    pytest.importorskip("peft")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from archsearch.arch import to_hf_config

    spec = ArchSpec(n_layers=1, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=96, vocab_size=64)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec, "float32"))).to(torch.bfloat16)
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    assert {p.dtype for p in pm.parameters() if p.requires_grad} == {torch.float32}


def test_expert_adapter_activations_match_autograd():
    """Adapters on the 3-D expert tensors: peft merges W + B A for every expert and the grouped
    matmul saves it with its routed input; the accounting follows within 1% (fp32)."""
    pytest.importorskip("peft")
    import torch

    from archsearch.planning.lora import EXPERTS, lora_saved_bytes

    spec = ArchSpec(**MOE_SPEC)
    targets = ATTENTION + EXPERTS
    saved = _saved_activation_bytes(spec, targets, 2, 16, torch.float32)
    assert lora_saved_bytes(spec, LoraSettings(4, targets), 2, 16, "float32") == pytest.approx(saved, rel=0.01)
    saved = _saved_activation_bytes(spec, targets, 2, 16, torch.bfloat16)
    assert lora_saved_bytes(spec, LoraSettings(4, targets), 2, 16, "bfloat16") == pytest.approx(saved, rel=0.05)


def test_router_adapter_activations_match_autograd():
    """The MoE cost paper's setting: adapters on the experts and the router. The router's
    ParamWrapper saves its merged E x d weight and its input per token; fp32 within 1%."""
    pytest.importorskip("peft")
    import torch

    from archsearch.planning.lora import EXPERTS, ROUTER, lora_saved_bytes

    spec = ArchSpec(**MOE_SPEC)
    # with attention adapters, so that the first layer's attention needs a gradient (targets
    # after it alone save less there: the accounting's stated one-layer over-estimate)
    for targets in (ATTENTION + ROUTER, ATTENTION + EXPERTS + ROUTER):
        saved = _saved_activation_bytes(spec, targets, 2, 16, torch.float32)
        assert lora_saved_bytes(spec, LoraSettings(4, targets), 2, 16, "float32") == pytest.approx(saved, rel=0.01)


def test_per_expert_layout_counts_each_expert_linear_and_merges_nothing():
    """transformers 4.x (the MoE cost paper's) holds w1/w3/w2 per expert: rank x (in + out) per
    expert linear, and no merged E x in x out block in the activations."""
    from archsearch.planning.lora import EXPERTS, ROUTER, lora_activation_bytes

    spec = ArchSpec(**MOE_SPEC)
    d, f, e, r = spec.hidden_size, spec.ffn, spec.n_experts, 4
    per = LoraSettings(r, EXPERTS + ROUTER, expert_layout="per-expert")
    assert lora_params(spec, per) == spec.n_layers * (r * e * (2 * (d + f) + (f + d)) + r * (d + e))
    acts = lora_activation_bytes(spec, per, "bfloat16")
    assert acts["expert_merged_weights_per_layer"] == 2 * d * e   # the router's only
    assert lora_activation_bytes(spec, LoraSettings(r, EXPERTS + ROUTER), "bfloat16")[
        "expert_merged_weights_per_layer"] > 100 * acts["expert_merged_weights_per_layer"]
    with pytest.raises(ArchsearchError) as err:
        LoraSettings(r, EXPERTS, expert_layout="grouped")
    assert err.value.field == "lora.expert_layout"


def test_targets_are_checked_against_the_model():
    from archsearch.planning.lora import EXPERTS, parse_targets

    dense = ArchSpec(n_layers=1, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=96, vocab_size=64)
    with pytest.raises(ArchsearchError) as e:
        lora_params(dense, LoraSettings(4, ("q_proj", "experts.down_proj")))
    assert e.value.field == "lora.targets" and "dense" in e.value.problem
    with pytest.raises(ArchsearchError) as e:
        lora_params(ArchSpec(**MOE_SPEC), LoraSettings(4, ("gate_proj",)))
    assert "experts" in e.value.fix
    assert parse_targets("attention,experts") == ATTENTION + EXPERTS
    assert parse_targets("q_proj,attention") == ATTENTION
    with pytest.raises(ArchsearchError):
        LoraSettings(4, ("q_proj", "q_proj"))


def test_finetune_memory_counts_what_is_trained():
    """Mixtral-8x7B at micro-batch 1 x 174: full bf16 AdamW (16 B/param) against QLoRA (NF4 base,
    fp32 adapters and AdamW states on the attention)."""
    from archsearch.arch import total_params
    from archsearch.planning.formats import base_weight_bytes
    from archsearch.planning.finetune import predict_finetune_memory
    from archsearch.presets import get_preset

    spec = get_preset("mixtral-8x7b")
    full = predict_finetune_memory(spec, "full", 1, 174, "bfloat16")
    assert full["weights"] + full["gradients"] + full["optimizer"] == 16 * total_params(spec)
    lora = LoraSettings(8)
    q = predict_finetune_memory(spec, "qlora", 1, 174, "bfloat16", lora=lora)
    n = lora_params(spec, lora)
    assert q["weights"] == base_weight_bytes(spec, "nf4", "bfloat16")["total"]
    assert (q["adapters"], q["adapter_gradients"], q["optimizer"]) == (4.0 * n, 4.0 * n, 8.0 * n)
    assert q["dequant_workspace"] == 2 * 14336 * 4096  # one expert projection at a time, bf16
    assert 20 < q["total_gib"] < 30 < full["total_gib"] / 25
    half = predict_finetune_memory(spec, "lora", 1, 174, "bfloat16", lora=lora, adapter_dtype="bfloat16")
    assert half["optimizer"] == 4.0 * n and half["weights"] == 2 * total_params(spec)
    with pytest.raises(ArchsearchError) as e:
        predict_finetune_memory(spec, "full", 1, 174, weight_format="nf4")
    assert e.value.field == "weight_format"
    with pytest.raises(ArchsearchError) as e:
        predict_finetune_memory(spec, "prefix", 1, 174)
    assert e.value.field == "finetune"


def test_checkpointed_lora_step_keeps_each_layer_input_and_one_layer():
    """With activation checkpointing (per decoder layer, as LLaMA-Factory turns it on) the step
    keeps every layer's input in the compute dtype plus one layer's saved set, hand-computed;
    the non-checkpointed step keeps every layer's set; the rest of the step is unchanged."""
    from archsearch.planning.finetune import predict_finetune_memory
    from archsearch.planning.lora import lora_activation_bytes, lora_saved_bytes

    spec = ArchSpec(n_layers=6, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=80, vocab_size=128,
                    family="mixtral", n_experts=4, experts_per_token=2)
    lora = LoraSettings(4, ("q_proj", "v_proj", "experts.gate_up_proj", "mlp.gate.weight"), expert_layout="per-expert")
    per = lora_activation_bytes(spec, lora, "bfloat16")
    layer = sum(v for k, v in per.items() if not k.endswith(("_position", "_token", "_per_layer")))
    tokens, seq = 3 * 16, 16
    outside = tokens * per["final_norm_per_token"] + seq * per["rope_per_position"]
    assert lora_saved_bytes(spec, lora, 3, seq, "bfloat16", activation_checkpointing=True) == pytest.approx(
        tokens * (6 * 64 * 2 + layer) + outside + per["expert_merged_weights_per_layer"])
    assert lora_saved_bytes(spec, lora, 3, seq, "bfloat16") == pytest.approx(
        tokens * 6 * layer + outside + 6 * per["expert_merged_weights_per_layer"])
    on = predict_finetune_memory(spec, "qlora", 3, seq, lora=lora, activation_checkpointing=True)
    off = predict_finetune_memory(spec, "qlora", 3, seq, lora=lora)
    assert on["activations"] < off["activations"]
    assert {k: v for k, v in on.items() if k not in ("activations", "total", "total_gib")} == \
        {k: v for k, v in off.items() if k not in ("activations", "total", "total_gib")}

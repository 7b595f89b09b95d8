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
                                                          "optimizer", "activations", "loss")))
    with pytest.raises(ArchsearchError) as e:
        LoraSettings(rank=0)
    assert e.value.field == "lora.rank"
    with pytest.raises(ArchsearchError) as e:
        LoraSettings(targets=("qkv",))
    assert e.value.field == "lora.targets"

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


def test_measured_lora_step_runs_peft_and_reports_time_and_peak():
    """A real (tiny, random-weight) LoRA step in a fresh process: peft's adapters, timed steps, a
    loss and a peak; a spec and a model together are refused before anything runs."""
    pytest.importorskip("peft")
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("peak RSS via Linux /proc")
    from archsearch.planning.measure import measure_lora_step

    spec = ArchSpec(n_layers=2, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=128, vocab_size=256)
    r = measure_lora_step(spec=spec, rank=4, targets=("q_proj", "v_proj"), batch_size=2, seq_len=32, steps=2)
    assert r["trainable_params"] == lora_params(spec, LoraSettings(4, ("q_proj", "v_proj")))
    assert len(r["step_wall_s"]) == len(r["step_cpu_s"]) == 2 and min(r["step_wall_s"]) > 0
    assert len(r["losses"]) == 3 and r["peak_above_model_bytes"] > 0
    with pytest.raises(ArchsearchError):
        measure_lora_step(model="smollm2-135m", spec=spec, rank=4, targets=("q_proj",), batch_size=1, seq_len=8)

"""The hf backend's opt-in compiled decode (``engine_args.compile``): a static KV cache and a
compiled decode step through transformers' own ``generate``, the same path on this CPU as on a GPU.

Inductor's first compile costs ~15-20 s of CPU here, so each slow test compiles once."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from archsearch.benchmarks import BenchSettings, measure
from archsearch.benchmarks.hf_backend import EAGER_DECODE, HFBackend, StaticCaches, check_compiled
from archsearch.errors import ArchsearchError
from tests.test_bench import ENGINE_ARGS, TINY, _job, _settings

COMPILE = {**ENGINE_ARGS["hf"], "compile": True}


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """This process's dynamo as a compile finds it on first use, and left so: its compiled graphs
    dropped and the recompile limit the backend raises restored."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tiny_llama():
    """A LLaMA-shaped model with random weights: 2 layers, hidden 64, float32, seeded."""
    import torch

    from archsearch.hf import without_sklearn

    without_sklearn()  # ~3 s of imports transformers' generation code does not need here
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_static_cache_decodes_the_tokens_eager_does():
    """Greedy decoding of a few prompts: the same tokens eager with a dynamic cache and compiled
    with a static cache (the backend's own keywords), where the compile really happened: one graph,
    the compiled call running every decode step, and neither a second generate at that batch nor
    a one-token generate (the TTFT probe: prefill only) compiling again or decoding compiled."""
    import torch
    from torch._dynamo.utils import counters

    from archsearch.benchmarks.hf_backend import compile_events, compiled_decode

    model = _tiny_llama()
    ids = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(1))
    n_new = 6
    graphs0, events0 = counters["stats"]["unique_graphs"], compile_events()["DYNAMO"]

    def compiles() -> int:
        """Graphs dynamo compiled since the start, which the backend's own count agrees with."""
        graphs = counters["stats"]["unique_graphs"] - graphs0
        assert compile_events()["DYNAMO"] - events0 == graphs
        return graphs

    def gen(prompts, n=n_new, **kw):
        with torch.inference_mode():
            out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), pad_token_id=0,
                                 do_sample=False, min_new_tokens=n, max_new_tokens=n, **kw)
        return out[:, prompts.shape[1]:]

    eager = gen(ids)
    assert compiles() == 0 and not hasattr(model, "_compiled_call")
    kwargs, record, decode = compiled_decode(on_gpu=False)
    assert record["compile_config"]["mode"] == "default" and record["compile_config"]["fullgraph"]
    assert "mode default" in decode
    caches = StaticCaches(model, ids.shape[1] + n_new)  # the backend's: one a batch size, zeroed between calls
    compiled = gen(ids, past_key_values=caches(3), **kwargs)
    assert torch.equal(compiled, eager), f"eager {eager.tolist()} != compiled {compiled.tolist()}"
    assert compiles() == 1 and hasattr(model, "_compiled_call")

    # generate picks its forward for decode steps from get_compiled_call, which returns the cached
    # _compiled_call while the config is unchanged: count the decode steps that go through it
    steps = []
    real = model._compiled_call

    def counted(*a, **k):
        steps.append(1)
        return real(*a, **k)

    model._compiled_call = counted
    cache = caches(3)
    again = gen(ids.flip(0), past_key_values=cache, **kwargs)
    assert caches(3) is cache  # the same tensors at every call: what CUDA graphs replay on
    assert torch.equal(again, eager.flip(0)) and len(steps) == n_new - 1 and compiles() == 1
    steps.clear()
    gen(ids, n=1, past_key_values=caches(3), **kwargs)
    assert steps == [] and compiles() == 1


@pytest.mark.gpu
def test_backend_compiles_end_to_end_on_a_gpu_with_cuda_graphs():
    """Two batch sizes, so the engine process compiles twice (each in its warm-up), then each
    repeat's one-token TTFT probe and timed generate, which must neither compile nor re-record a
    CUDA graph (check_compiled fails the batch if one does: the static cache is kept per batch
    size for that). The CPU runs this path end to end in tests/test_gpu_checks.py."""
    r = measure(TINY, _settings("hf", batch_sizes=[1, 4], engine_args=COMPILE))
    assert r.ok, r.error
    assert "cpu" not in r.device.lower() and r.dtype == "bfloat16"
    assert r.throughput(4) > 0 and r.ttft(4) > 0 and r.batch(4).tpot_mean > 0
    eng = r.settings["engine"]
    assert eng["decode"] == "static KV cache + torch.compile (mode reduce-overhead, fullgraph)"
    assert eng["kwargs"]["cache"].startswith("static, one a batch size") and "compile" not in eng["kwargs"]
    assert eng["kwargs"]["compile_config"] == {"fullgraph": True, "dynamic": False, "backend": "inductor",
                                               "mode": "reduce-overhead", "options": None}


@pytest.mark.slow
def test_compile_on_a_cpu_without_transformers_switch_is_refused(monkeypatch):
    """Where transformers has no _compile_all_devices, generate would quietly decode eagerly on a
    CPU: compiled_decode refuses instead, naming the argument."""
    from archsearch.benchmarks.hf_backend import compiled_decode
    from archsearch.hf import without_sklearn

    without_sklearn()
    import transformers

    monkeypatch.delattr(transformers.CompileConfig, "_compile_all_devices")
    with pytest.raises(ArchsearchError, match=r"engine_args.compile: transformers .* has no "
                                              r"CompileConfig._compile_all_devices"):
        compiled_decode(on_gpu=False)


@pytest.mark.slow
def test_eager_decode_is_the_default_and_recorded(tmp_path):
    sess = HFBackend().open(_job(tmp_path, "hf", batch_sizes=[1], engine_args={}), lambda _partial: None)
    assert sess.engine["decode"] == EAGER_DECODE
    assert not {"cache", "cache_implementation", "compile_config"} & set(sess.engine["kwargs"])
    assert sess.generate([[1, 2, 3, 4]])[0].n_output == 8


@pytest.mark.parametrize("settings,field", [
    ({"warmup": 0, "engine_args": {"compile": True}}, "warmup"),
    ({"engine_args": {"Compile": "yes"}}, "engine_args.compile"),
    ({"engine_args": {"compile": True, "cache_implementation": "dynamic"}},
     "engine_args.cache_implementation"),
])
def test_compile_refuses_what_it_cannot_measure_naming_the_field(settings, field):
    with pytest.raises(ArchsearchError) as e:
        BenchSettings(backend="hf", **settings)
    assert e.value.field == field and field in str(e.value)


def test_warmup_zero_is_still_fine_without_compile():
    assert BenchSettings(backend="hf", warmup=0, engine_args={"compile": False}).warmup == 0
    assert BenchSettings(backend="hf", warmup=0).warmup == 0


def test_cli_refuses_compile_without_warmup(cli):
    res = cli("bench", "--backend", "hf", "--preset", "tiny", "--engine-arg", "compile=true", "--warmup", "0")
    assert res.returncode == 2 and "warmup: must be at least 1 with engine_args.compile" in res.stderr
    assert "Traceback" not in res.stderr


def test_check_compiled_fails_a_call_that_compiled_where_it_may_be_timed():
    model, warmed, none = SimpleNamespace(_compiled_call=object()), set(), Counter()
    graph, record = Counter(DYNAMO=1), Counter(CUDAGRAPH_RECORDING=1)
    check_compiled(model, 2, 8, graph + record, warmed)  # batch 2's first generate (a warm-up) compiles
    check_compiled(model, 2, 8, none, warmed)  # its timed repeat does not
    check_compiled(model, 2, 1, Counter(DYNAMO=0), warmed)  # nor its TTFT probe
    check_compiled(model, 4, 8, graph, warmed)  # a new batch size compiles once more
    assert warmed == {2, 4}
    with pytest.raises(RuntimeError, match=r"later generate at batch 2 compiled \(CUDAGRAPH_RECORDING x1"):
        check_compiled(model, 2, 8, record, warmed)
    with pytest.raises(RuntimeError, match=r"one-token generate compiled \(DYNAMO x1\)"):
        check_compiled(model, 8, 1, graph, warmed)
    with pytest.raises(RuntimeError, match="did not compile the decode step"):
        check_compiled(SimpleNamespace(), 2, 8, none, set())

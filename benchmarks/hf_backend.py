"""transformers ``generate`` on a static batch: the method's earlier measurement, CPU or GPU.

Random weights from the config (``from_config``, seeded), or real weights with
``model_path``. All B prompts (fresh random ids, no padding) go through one ``generate``
call, greedy, with ``min_new_tokens = max_new_tokens = output_len`` so EOS cannot stop it.
``dtype="auto"`` is float32 on CPU and bfloat16 on a GPU. No engine server: the batch is
fixed for its whole life, which is what distinguishes it from continuous batching.
``engine_args`` go to ``generate``, except ``torch_threads`` which sets torch's thread count
(on a shared CPU, oversubscribed OpenMP threads can slow a small model down 100x) and
``compile`` (below).

Decode: eager with transformers' dynamic cache by default. On a GPU that is Python-bound (~60 ms
a step at every batch size for a 1B model on an H100), so it cannot rank shapes; ``compile: true``
gives ``generate`` a static KV cache (one a batch size, kept: :class:`StaticCaches`) and a
``CompileConfig`` (fullgraph, static shapes; CUDA graphs on a GPU), so transformers compiles the
decode step (its prefill stays eager). The same
path runs on a CPU (``_compile_all_devices``). Each batch size compiles once, at its first
``generate``, so ``warmup`` must be at least 1 (:meth:`HFBackend.check_settings`); a compile in
any later call (a dynamo recompile, or on a GPU a CUDA graph re-record) fails the batch
(:func:`check_compiled`). ``engine.decode`` records which.

TTFT: a timed one-token ``generate`` of another fresh batch of the same shape before each
repeat (every request of a static batch gets its first token at the same time); TPOT is
``(e2e - ttft) / (n - 1)`` with e2e the generate wall time.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.benchmarks.base import Backend, BenchSettings, Report, Session, resolve_dtype
from archsearch.benchmarks.engine_loop import RequestTiming, process_tree_rss, run_batches
from archsearch.errors import ArchsearchError
from archsearch.hardware import cpu_name
from archsearch.hf import without_sklearn

EAGER_DECODE = "dynamic cache, eager"
# dynamo compiles the forward once per batch size (and per model of a paired group) in one engine
# process; past its default limit of 8 a fullgraph compile fails instead of compiling again
RECOMPILE_LIMIT = 64
# every compile this process started, by trigger: DYNAMO (a graph traced; a recompile is one more)
# and, on a GPU, CUDAGRAPH_RECORDING (CUDA graph trees capturing one, a re-record too)
_COMPILES: Counter[str] = Counter()


class HFBackend(Backend):
    name = "hf"
    packages = ("transformers",)

    @classmethod
    def check_settings(cls, settings: BenchSettings) -> None:
        compile_decode = settings.engine_args.get("compile", False)
        if not isinstance(compile_decode, bool):
            raise ArchsearchError("engine_args.compile", f"must be true or false, got {compile_decode!r}",
                                  "e.g. --engine-arg compile=true")
        if not compile_decode:
            return
        if settings.warmup < 1:
            raise ArchsearchError("warmup", "must be at least 1 with engine_args.compile: the decode "
                                  "step compiles at the first generate of each batch size, which must not "
                                  "be timed",
                                  "set warmup to 1 or more (--warmup 1), or drop compile")
        if "cache_implementation" in settings.engine_args:
            raise ArchsearchError("engine_args.cache_implementation", "is set by engine_args.compile "
                                  "(a static cache)", "give one of the two")

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        sess = self.open(job, report)
        per_batch = run_batches(sess.generate, job["batch_sizes"], job["settings"], sess.vocab_size,
                                report=report, memory_probe=sess.memory_probe, ttft_probe=sess.ttft_probe)
        return {**sess.summary(), "per_batch": per_batch}

    def open(self, job: dict[str, Any], report: Report) -> Session:
        """Load the model for ``job`` and return its :class:`Session`."""
        import torch

        without_sklearn()
        import transformers

        s = job["settings"]
        spec = ArchSpec.from_dict(job["arch"])
        on_gpu = torch.cuda.is_available()
        dev = torch.device("cuda" if on_gpu else "cpu")
        dtype = resolve_dtype(s["dtype"], on_gpu)
        torch_dtype = getattr(torch, dtype)
        extra = dict(s.get("engine_args") or {})
        threads = extra.pop("torch_threads", None)
        if threads is not None:  # e.g. 1 to match vLLM-CPU's single worker thread
            torch.set_num_threads(int(threads))
        compile_decode = bool(extra.pop("compile", False))  # a bool: check_settings
        decode_kwargs, decode_record, decode = ({}, {}, EAGER_DECODE)
        if compile_decode:
            decode_kwargs, decode_record, decode = compiled_decode(on_gpu)
        torch.manual_seed(s["seed"])
        t0 = time.perf_counter()
        if job.get("real_weights"):
            model = transformers.AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch_dtype)
        else:
            config = transformers.AutoConfig.from_pretrained(job["model_dir"])
            with dev:  # random weights made where they run: LLaMA-3.2-1B's init on 2 host cores took 26 s
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model = model.to(dev).eval()
        timing = {"engine_start_s": time.perf_counter() - t0}
        engine = {"kwargs": {"do_sample": False, "min_new_tokens": s["output_len"],
                             "max_new_tokens": s["output_len"], "use_cache": True,
                             "attn_implementation": getattr(model.config, "_attn_implementation", None),
                             "torch_threads": torch.get_num_threads(),
                             **decode_record, **extra},
                  "decode": decode,
                  "ttft_method": "one-token generate of a fresh batch of the same shape, timed",
                  "weights": "real" if job.get("real_weights") else "random (from_config, seeded)"}
        if on_gpu:
            device = torch.cuda.get_device_name(0)
            probe = torch.cuda.max_memory_allocated
            engine["peak_memory_method"] = "torch.cuda.max_memory_allocated since model load"
        else:
            device = f"cpu: {cpu_name()}"
            probe = process_tree_rss
            engine["peak_memory_method"] = "resident memory of the process, sampled after each repeat"
        report({"device": device, "dtype": dtype, "engine": engine, "timing": timing})
        # generate's keywords: the recorded ones, less those that are not generate's, with the
        # CompileConfig object in place of its record
        call = {k: v for k, v in engine["kwargs"].items()
                if k not in ("attn_implementation", "torch_threads", *decode_record)}
        call.update(decode_kwargs)
        warmed: set[int] = set()  # the batch sizes whose decode step has compiled
        caches = StaticCaches(model, s["input_len"] + s["output_len"]) if compile_decode else None

        def _gen(prompts: list[list[int]], n_new: int) -> int:
            ids = torch.tensor(prompts, dtype=torch.long, device=dev)
            before = compile_events() if compile_decode else Counter()
            cache = {"past_key_values": caches(len(prompts))} if caches else {}
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                                     **{**call, **cache, "min_new_tokens": n_new, "max_new_tokens": n_new})
            if on_gpu:
                torch.cuda.synchronize()
            if compile_decode:
                check_compiled(model, len(prompts), n_new, compile_events() - before, warmed)
            return out.shape[1] - ids.shape[1]

        def generate(prompts: list[list[int]]) -> list[RequestTiming]:
            n = _gen(prompts, s["output_len"])
            return [RequestTiming(n_output=n, ttft=None, e2e=None, tpot=None) for _ in prompts]

        def ttft_probe(prompts: list[list[int]]) -> float:
            t = time.perf_counter()
            _gen(prompts, 1)
            return time.perf_counter() - t

        return Session(generate, spec.vocab_size, probe, device, dtype, engine, timing, ttft_probe)


class StaticCaches:
    """One static KV cache a batch size, of ``max_cache_len`` tokens, kept and zeroed between calls.
    generate's own static cache (``cache_implementation="static"``) is new at every call, and CUDA
    graphs replay only on the memory they were recorded on: a new cache's tensors elsewhere would
    re-record them inside a timed call."""

    def __init__(self, model: Any, max_cache_len: int):
        self.model, self.max_cache_len = model, max_cache_len
        self.by_batch: dict[int, Any] = {}

    def __call__(self, batch: int) -> Any:
        cache = self.by_batch.get(batch)
        if cache is None:
            import transformers

            cache = self.by_batch[batch] = transformers.StaticCache(config=self.model.config,
                                                                    max_cache_len=self.max_cache_len)
        else:
            import torch

            with torch.inference_mode():  # its tensors were made in generate's inference mode
                cache.reset()
        return cache


def compiled_decode(on_gpu: bool) -> tuple[dict[str, Any], dict[str, Any], str]:
    """``generate``'s keywords for a static KV cache and a compiled decode step, the same as
    recorded (JSON), and the line ``engine.decode`` holds. CUDA graphs (``reduce-overhead``) on a
    GPU, where launch overhead is what the eager path measures; plain inductor on a CPU."""
    import torch._dynamo

    without_sklearn()
    import transformers

    mode = "reduce-overhead" if on_gpu else "default"
    config = transformers.CompileConfig(fullgraph=True, dynamic=False, mode=mode)
    record = config.to_dict()
    if not on_gpu:
        # generate compiles on cuda/xpu only unless this is set (_valid_auto_compile_criteria);
        # without it the CPU would silently run eager under a "compiled" label
        if not hasattr(transformers.CompileConfig, "_compile_all_devices"):
            raise ArchsearchError("engine_args.compile", f"transformers {transformers.__version__} has "
                                  "no CompileConfig._compile_all_devices, so its generate would not compile "
                                  "on a CPU",
                                  "measure compile on a GPU, or install a transformers that has it (5.x)")
        config._compile_all_devices = True
        record["compile_all_devices"] = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    kwargs = {"compile_config": config}  # the static cache: one a batch size, passed at each call (open)
    return kwargs, {"cache": "static, one a batch size of input_len + output_len, zeroed between calls",
                    "compile_config": record}, \
        f"static KV cache + torch.compile (mode {mode}, fullgraph)"


def compile_events() -> Counter[str]:
    """The compiles this process has started so far, by trigger (:data:`_COMPILES`), counted from
    the first call (dynamo's start callbacks; ``torch._dynamo.reset`` drops them, so this
    registers again wherever it is missing)."""
    from torch._dynamo.callback import callback_handler

    if _count_compile not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_count_compile)
    return Counter(_COMPILES)


def _count_compile(args: Any = None) -> None:
    # a torch whose callbacks say no trigger (older ones call them without arguments): a compile all the same
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "COMPILE")
    _COMPILES[trigger] += 1


def check_compiled(model: Any, batch: int, n_new: int, new: Counter[str], warmed: set[int]) -> None:
    """After a ``generate`` asked to compile, with ``new`` the compiles it started: fail unless
    transformers picked its compiled forward, and fail if the call compiled where a timed call may
    run (a one-token TTFT probe, which only prefills, or a batch size already warmed), so compile
    time is never in a measurement. ``warmed`` gains ``batch`` once its decode has run."""
    if getattr(model, "_compiled_call", None) is None:  # set by get_compiled_call when generate compiles
        raise RuntimeError("engine_args.compile: generate did not compile the decode step (transformers' "
                           "auto-compile criteria failed; its warning says why)")
    if +new and (n_new < 2 or batch in warmed):
        what = "a one-token generate" if n_new < 2 else f"a later generate at batch {batch}"
        events = ", ".join(f"{k} x{v}" for k, v in sorted((+new).items()))
        raise RuntimeError(f"engine_args.compile: {what} compiled ({events}); "
                           "a timed call would include compile time")
    if n_new > 1:
        warmed.add(batch)

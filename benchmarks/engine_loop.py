"""The measurement loop every engine backend shares (runs inside the engine's process).

A backend supplies ``generate(prompts) -> list[RequestTiming]`` for one static batch of
prompt token-id lists; this module does the rest the same way for every engine: fresh random
prompts each call (so no prefix cache can hit), warm-up calls, timed repeats, a check that
every request produced exactly ``output_len`` tokens, statistics, memory sampling, and
turning an exception into a failed batch while the next batch size still runs.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from archsearch.benchmarks.base import BatchResult, Report, mean, percentile, std


@dataclass
class RequestTiming:
    """What one request of a batch took. ``ttft`` is None when the engine cannot say."""

    n_output: int
    ttft: float | None
    e2e: float | None
    tpot: float | None
    preemptions: int = 0


Generate = Callable[[list[list[int]]], list[RequestTiming]]


class PromptSource:
    """Fresh random prompt token ids for every call, reproducible from ``seed``."""

    def __init__(self, vocab_size: int, input_len: int, seed: int):
        import numpy as np

        self._rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.input_len = input_len

    def batch(self, batch_size: int) -> list[list[int]]:
        ids = self._rng.integers(0, self.vocab_size, size=(batch_size, self.input_len))
        return ids.tolist()


def describe_error(e: BaseException) -> str:
    """One line naming the failure; out-of-memory is labelled as such."""
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else type(e).__name__
    low = text.lower()
    if "out of memory" in low or "outofmemory" in low or isinstance(e, MemoryError):
        return "OOM: " + first[:500]
    return first[:500]


def process_tree_rss() -> int:
    """Resident memory of this process and all its descendants (engine workers), bytes."""
    import psutil

    me = psutil.Process(os.getpid())
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a worker that just exited
            continue
    return total


def cuda_memory_in_use() -> int:
    """Bytes in use on the current CUDA device, by every process (``torch.cuda.mem_get_info``)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def run_batches(generate: Generate, batch_sizes: list[int], settings: dict, vocab_size: int,
                report: Report | None = None, memory_probe: Callable[[], int] | None = None,
                ttft_probe: Callable[[list[list[int]]], float] | None = None) -> list[dict]:
    """Measure each batch size; returns BatchResult dicts. ``report`` gets every finished
    batch as it completes (so a later timeout keeps them).

    ``ttft_probe`` is for engines without per-request timestamps: before each timed repeat it
    runs a one-token generation of another fresh batch of the same shape (not timed as part
    of the repeat) and its wall time is every request's TTFT; a request's TPOT is then
    ``(e2e - ttft) / (n - 1)``, with e2e the generate wall time unless the engine gave one."""
    input_len, output_len = settings["input_len"], settings["output_len"]
    prompts = PromptSource(vocab_size, input_len, settings["seed"])
    out: list[dict] = []
    event = (lambda text: report({"event": text})) if report is not None else (lambda text: None)
    for b in batch_sizes:
        try:
            for i in range(settings["warmup"]):
                event(f"batch {b}: warm-up {i + 1} of {settings['warmup']}")
                generate(prompts.batch(b))
            reps, ttfts, peak = [], [], 0
            for k in range(settings["repeats"]):
                event(f"batch {b}: repeat {k + 1} of {settings['repeats']}")
                first = ttft_probe(prompts.batch(b)) if ttft_probe is not None else None
                batch = prompts.batch(b)
                t0 = time.perf_counter()
                timings = generate(batch)
                wall = time.perf_counter() - t0
                if len(timings) != b:
                    raise RuntimeError(f"engine returned {len(timings)} results for {b} prompts")
                if first is not None:
                    for t in timings:
                        t.ttft = first
                        t.e2e = wall if t.e2e is None else t.e2e
                        t.tpot = (t.e2e - first) / (t.n_output - 1) if t.n_output > 1 else None
                wrong = sorted({t.n_output for t in timings if t.n_output != output_len})
                if wrong:
                    raise RuntimeError(f"engine produced {wrong} output tokens, expected exactly "
                                       f"{output_len} (ignore_eos not honoured)")
                rep_ttft = [t.ttft for t in timings]
                ttfts.extend(x for x in rep_ttft if x is not None)
                reps.append({
                    "wall_s": wall,
                    "output_throughput": b * output_len / wall,
                    "total_throughput": b * (input_len + output_len) / wall,
                    "ttft_mean": mean(rep_ttft),
                    "tpot_mean": mean([t.tpot for t in timings]),
                    "e2e_latency_mean": mean([t.e2e for t in timings]),
                    "preemptions": sum(t.preemptions for t in timings),
                })
                if memory_probe is not None:
                    peak = max(peak, int(memory_probe()))
            res = BatchResult(
                batch_size=b, ok=True,
                output_throughput=mean([r["output_throughput"] for r in reps]),
                output_throughput_std=std([r["output_throughput"] for r in reps]),
                total_throughput=mean([r["total_throughput"] for r in reps]),
                total_throughput_std=std([r["total_throughput"] for r in reps]),
                ttft_mean=mean(ttfts), ttft_p50=percentile(ttfts, 50),
                ttft_p99=percentile(ttfts, 99),
                tpot_mean=mean([r["tpot_mean"] for r in reps]),
                e2e_latency_mean=mean([r["e2e_latency_mean"] for r in reps]),
                peak_memory_bytes=peak or None,
                preemptions=sum(r["preemptions"] for r in reps),
                repeats=reps)
        except Exception as e:  # noqa: BLE001 - a failed batch is data, the next one still runs
            traceback.print_exc()
            res = BatchResult.failed(b, describe_error(e))
        out.append(res.to_dict())
        if report is not None:
            report({"per_batch": out})
    return out

"""A serving simulator: online metrics predicted from the calibrated step-time model (never a measurement).

Requests arrive (all at t=0, or as a Poisson process at ``rate`` requests/s), and an engine batches
them continuously as vLLM (v1) and SGLang do: at every step the running sequences each decode one
token, then prompts are prefilled (whole, or in chunks with ``chunked_prefill``) within the token budget
``max_num_batched_tokens``, new requests joining while fewer than ``max_num_seqs`` run and their
prompt's KV cache fits. The KV capacity is what fits beside the weights in the calibration's share of
device memory (``archsearch.arch.max_batch_by_kv``'s rule, in tokens); when a decode step needs more,
the latest admitted sequence is preempted and later recomputed (vLLM's default), and counted. Each step
lasts what :class:`archsearch.benchmarks.analytic.StepModel` says for its mix of decode tokens and
prefill chunks, the same model (and calibration) the analytic backend's offline prediction uses. A
request reaches the scheduler ``Calibration.request_overhead_s`` after it arrives (the serving front end's
per-request latency: HTTP, validation, the hand-off to the engine process, the answer's way back; 0 unless
fitted on online runs, as the vLLM-CPU validation does on probes of the same session).

The record, :class:`ServingMetrics`, holds what an online measurement (an engine's server under the
same arrivals) reports: request and token throughput, TTFT, TPOT and end-to-end latency percentiles,
and goodput under an SLO (requests/s whose TTFT and TPOT both meet it). The offline limit (all requests
at t=0, ``max_num_seqs`` = their number, a token budget that holds every prompt) reproduces
``analytic.predict_batch`` (tests/test_simulator.py). No GPU online measurement validates the online
regime: the GPU calibrations are fitted on offline static batches only. On this CPU it is checked against
vLLM-CPU servers (``benchmarks/scripts/bench_simulator_validation.py``, docs/benchmarks.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from archsearch.arch import ArchSpec, kv_cache_bytes_per_token, weight_bytes
from archsearch.configio import PlainData
from archsearch.errors import ArchsearchError
from archsearch.hardware import Device
from archsearch.benchmarks.analytic import MEMORY_FRACTION, StepModel, predicted_job
from archsearch.benchmarks.base import Backend, BatchResult, Report
from archsearch.benchmarks.calibration import Calibration, decode_on_cuda_cores


@dataclass(frozen=True)
class SLO:
    """A serving objective: every request's time to first token and time per output token at most these."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ArchsearchError(f"slo.{name}", f"must be a positive number of seconds, got {v!r}",
                                      "e.g. slo: {ttft_s: 2.0, tpot_s: 0.05}")


@dataclass(frozen=True)
class ServingLoad:
    """What arrives and the engine's scheduler limits: one simulated (or measured) online run."""

    n_requests: int
    input_len: int
    output_len: int
    rate: float | None = None  # requests/s, Poisson arrivals; None: all at t=0 (offline)
    max_num_seqs: int = 256  # vLLM's max_num_seqs / SGLang's max_running_requests
    max_num_batched_tokens: int = 8192  # tokens per step (vLLM v1's default for online serving)
    chunked_prefill: bool = True
    slo: SLO | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("n_requests", "input_len", "output_len", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ArchsearchError(name, f"must be a positive integer, got {v!r}", "fix the workload")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ArchsearchError("rate", f"must be a positive number of requests/s, got {self.rate!r}",
                                  "give a rate, or none for all requests at t=0")
        if not self.chunked_prefill and self.input_len > self.max_num_batched_tokens:
            raise ArchsearchError("max_num_batched_tokens",
                                  f"{self.max_num_batched_tokens} cannot hold a {self.input_len}-token prompt "
                                  "without chunked prefill", "raise it, or enable chunked_prefill")


@dataclass
class ServingMetrics(PlainData):
    """Online serving metrics of one run, simulated or measured (``predicted`` says which); times in
    seconds, throughputs per second of the run's duration (first arrival to last completion)."""

    n_requests: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_throughput: float
    ttft_mean: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_mean: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    tpot_p99: float | None
    e2e_mean: float
    e2e_p50: float
    e2e_p90: float
    e2e_p99: float
    goodput: float | None = None  # requests/s meeting the SLO (None: no SLO given)
    slo_attainment: float | None = None  # share of requests meeting it
    slo: dict[str, float] | None = None
    preemptions: int = 0
    max_running: int = 0  # most sequences in one step
    kv_capacity_tokens: int = 0
    predicted: bool = True
    rate: float | None = None  # the offered load, requests/s (None: all at t=0)
    failed: int = 0  # requests that got no complete answer (measured only; the metrics cover the others)
    # every request's seconds, in arrival order (measured runs: goodput under another SLO is read from them)
    per_request: dict[str, list[float]] | None = None


class _Request:
    __slots__ = ("arrival", "target", "prefilled", "generated", "first", "done", "tokens")

    def __init__(self, arrival: float, input_len: int):
        self.arrival = arrival
        self.target = input_len  # positions to prefill (a preempted one recomputes its output so far too)
        self.prefilled = 0
        self.generated = 0
        self.first: float | None = None
        self.done: float | None = None
        self.tokens: list[float] = []  # when each output token came out


def arrivals(load: ServingLoad) -> list[float]:
    """Arrival times: all 0 without a rate, else a seeded Poisson process."""
    if load.rate is None:
        return [0.0] * load.n_requests
    import numpy as np

    gaps = np.random.default_rng(load.seed).exponential(1.0 / load.rate, load.n_requests)
    return list(np.cumsum(gaps) - gaps[0])  # the first request arrives at t=0


def kv_capacity_tokens(spec: ArchSpec, device: Device, dtype: str, memory_fraction: float) -> int:
    """KV-cache tokens that fit beside the weights in ``memory_fraction`` of the device's memory."""
    free = device.memory_bytes * memory_fraction - weight_bytes(spec, dtype)
    return max(0, int(free // kv_cache_bytes_per_token(spec, dtype)))


def simulate(spec: ArchSpec, device: Device, dtype: str, load: ServingLoad,
             calibration: Calibration | None = None) -> ServingMetrics:
    """Run ``load`` through the continuous-batching scheduler (module docstring) with the step times of
    ``StepModel(spec, device, dtype, calibration)``. Refuses, before any step, a load one sequence of
    which cannot fit in the KV cache."""
    import numpy as np

    model = StepModel(spec, device, dtype, calibration)
    fraction = calibration.memory_fraction if calibration is not None else MEMORY_FRACTION
    capacity = kv_capacity_tokens(spec, device, dtype, fraction)
    seq = load.input_len + load.output_len
    if capacity < seq:
        raise ArchsearchError("input_len/output_len",
                              f"one sequence of {seq} tokens needs more KV cache than fits beside the weights on "
                              f"{device.name} ({capacity} tokens in {fraction:.0%} of its memory, {dtype})",
                              "shorten the sequences or choose a larger device")
    reqs = [_Request(a, load.input_len) for a in arrivals(load)]
    # the front end's per-request latency: a request reaches the scheduler this long after it arrives
    lag = calibration.request_overhead_s if calibration is not None else 0.0
    pending = list(range(len(reqs)))[::-1]  # not yet arrived, next last
    waiting: list[int] = []  # arrived, not running (FCFS; a preempted one goes first)
    running: list[int] = []  # admission order
    clock, preemptions, max_running, finished = 0.0, 0, 0, 0

    def kv_of(r: _Request) -> int:  # KV tokens held before this step
        return r.prefilled if r.prefilled < r.target else load.input_len + r.generated - 1
    while finished < len(reqs):
        while pending and reqs[pending[-1]].arrival + lag <= clock:
            waiting.append(pending.pop())
        if not running and not waiting:
            clock = reqs[pending[-1]].arrival + lag
            continue
        # decodes first: every running sequence past its prefill makes one token; free KV for them
        decoding = [i for i in running if reqs[i].prefilled >= reqs[i].target]
        used = sum(kv_of(reqs[i]) for i in running)
        while decoding and used + len(decoding) > capacity:
            victim = running.pop()  # the latest admitted: recomputed later, with its output so far
            r = reqs[victim]
            used -= kv_of(r)
            r.target, r.prefilled = load.input_len + r.generated, 0
            waiting.insert(0, victim)
            if victim in decoding:
                decoding.remove(victim)
            preemptions += 1
        budget = load.max_num_batched_tokens - len(decoding)
        used += len(decoding)
        chunks: list[tuple[int, int, bool, int]] = []
        for i in [i for i in running if reqs[i].prefilled < reqs[i].target]:  # prefills under way
            r = reqs[i]
            n = min(r.target - r.prefilled, budget)
            if n <= 0:
                break
            chunks.append((r.prefilled, r.prefilled + n, r.prefilled + n == r.target, i))
            budget -= n
        while waiting and budget > 0 and len(running) < load.max_num_seqs:
            r = reqs[waiting[0]]
            n = min(r.target, budget) if load.chunked_prefill else r.target
            if n > budget or used + r.target > capacity:
                break
            i = waiting.pop(0)
            running.append(i)
            chunks.append((0, n, n == r.target, i))
            budget -= n
            used += r.target
        if not decoding and not chunks:
            raise RuntimeError("the scheduler made no progress")  # a bug, never a workload's fault
        kv_lens = np.array([load.input_len + reqs[i].generated for i in decoding], dtype=float)
        clock += model.step(kv_lens, [(a, b, last) for a, b, last, _ in chunks])
        max_running = max(max_running, len(decoding) + len(chunks))
        for i in decoding:
            reqs[i].generated += 1
            reqs[i].tokens.append(clock)
        for a, b, last, i in chunks:
            r = reqs[i]
            r.prefilled = b
            if last:
                r.generated += 1
                r.tokens.append(clock)
                if r.first is None:
                    r.first = clock
        for i in [i for i in running if reqs[i].generated >= load.output_len]:
            reqs[i].done = clock
            running.remove(i)
            finished += 1
    return _metrics(reqs, load, preemptions, max_running, capacity)


def _metrics(reqs: list[_Request], load: ServingLoad, preemptions: int, max_running: int,
             capacity: int) -> ServingMetrics:
    return serving_metrics([r.arrival for r in reqs], [r.first for r in reqs], [r.done for r in reqs], load,
                           predicted=True, preemptions=preemptions, max_running=max_running,
                           kv_capacity_tokens=capacity)


def serving_metrics(arrival, first, done, load: ServingLoad, predicted: bool, keep_requests: bool = False,
                    **extra: Any) -> ServingMetrics:
    """The :class:`ServingMetrics` of requests that arrived, gave their first token and finished at these
    times (seconds on one clock), each generating ``load.output_len`` tokens: the one computation of
    the record for a simulated run and a measured one (:mod:`archsearch.benchmarks.online`);
    ``keep_requests``: every request's times too (``per_request``)."""
    import numpy as np

    arrival, first, done = (np.asarray(x, dtype=float) for x in (arrival, first, done))
    ttft = first - arrival
    e2e = done - arrival
    tpot = (e2e - ttft) / (load.output_len - 1) if load.output_len > 1 else None
    duration = float(done.max() - arrival.min())
    n = len(arrival)

    def pct(x, q):
        return float(np.percentile(x, q)) if x is not None else None
    good = attain = None
    if load.slo is not None:
        ok = (ttft <= load.slo.ttft_s) & ((tpot <= load.slo.tpot_s) if tpot is not None else True)
        attain = float(np.mean(ok))
        good = float(ok.sum() / duration)
    return ServingMetrics(
        n_requests=n, duration_s=duration, request_throughput=float(n / duration),
        output_throughput=float(n * load.output_len / duration),
        total_throughput=float(n * (load.input_len + load.output_len) / duration),
        ttft_mean=float(ttft.mean()), ttft_p50=pct(ttft, 50), ttft_p90=pct(ttft, 90), ttft_p99=pct(ttft, 99),
        tpot_mean=float(tpot.mean()) if tpot is not None else None, tpot_p50=pct(tpot, 50), tpot_p90=pct(tpot, 90),
        tpot_p99=pct(tpot, 99),
        e2e_mean=float(e2e.mean()), e2e_p50=pct(e2e, 50), e2e_p90=pct(e2e, 90), e2e_p99=pct(e2e, 99),
        goodput=good, slo_attainment=attain,
        slo={"ttft_s": load.slo.ttft_s, "tpot_s": load.slo.tpot_s} if load.slo else None,
        predicted=predicted, rate=load.rate,
        per_request={"arrival": arrival.tolist(), "ttft": ttft.tolist(), "tpot": tpot.tolist() if tpot is not None
                     else [0.0] * n, "e2e": e2e.tolist()} if keep_requests else None, **extra)


def load_from_settings(settings: dict[str, Any], batch_size: int) -> ServingLoad:
    """The load a ``bench`` job asks for at one batch size: ``batch_size`` is the engine's
    ``max_num_seqs``; ``engine_args`` may set ``rate``, ``n_requests`` (default: the batch size),
    ``max_num_batched_tokens`` (default: every prompt of the batch at once, the offline limit),
    ``chunked_prefill`` and ``slo: {ttft_s, tpot_s}``."""
    ea = settings.get("engine_args") or {}
    slo = ea.get("slo")
    if slo is not None and not (isinstance(slo, dict) and set(slo) == {"ttft_s", "tpot_s"}):
        raise ArchsearchError("engine_args.slo", f"{slo!r} is not {{ttft_s, tpot_s}}",
                              "e.g. slo: {ttft_s: 2.0, tpot_s: 0.05}")
    return ServingLoad(
        n_requests=int(ea.get("n_requests", batch_size)), input_len=settings["input_len"],
        output_len=settings["output_len"], rate=ea.get("rate"), max_num_seqs=batch_size,
        max_num_batched_tokens=int(ea.get("max_num_batched_tokens", batch_size * settings["input_len"])),
        chunked_prefill=bool(ea.get("chunked_prefill", True)), slo=SLO(**slo) if slo else None,
        seed=int(settings.get("seed", 0)))


class SimulatedBackend(Backend):
    """``backend: simulated``: each batch size's online metrics from :func:`simulate` (a prediction)."""

    name = "simulated"
    packages = ("archsearch",)
    isolated = False
    predicted = True

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        s = job["settings"]
        spec, device, dtype, cal, cal_path = predicted_job(job)
        loads = {b: load_from_settings(s, b) for b in job["batch_sizes"]}  # every bad setting before any run
        per_batch = []
        for b, load in loads.items():
            m = simulate(spec, device, dtype, load, cal)
            per_batch.append(BatchResult(
                batch_size=b, ok=True, output_throughput=m.output_throughput, total_throughput=m.total_throughput,
                ttft_mean=m.ttft_mean, ttft_p50=m.ttft_p50, ttft_p99=m.ttft_p99, tpot_mean=m.tpot_mean,
                e2e_latency_mean=m.e2e_mean, preemptions=m.preemptions, online=m.to_dict()).to_dict())
            report({"batch_size": b, "simulated": True})
        engine = {"model": "continuous batching over the calibrated step-time model (archsearch.benchmarks.simulator)",
                  "device_entry": device.to_dict(),
                  "calibration": ({"file": str(cal_path), "fitted_on": cal.describe(cal_path),
                                   "decode_attention_on_cuda_cores": decode_on_cuda_cores(cal, spec)}
                                  if cal else "uncalibrated: peak device figures, an optimistic bound"),
                  "validation": "offline limit equals the analytic prediction; no GPU online measurement "
                                "validates the online regime (vLLM-CPU: results/bench/simulator_validation.jsonl)"}
        return {"device": device.name, "dtype": dtype, "engine": engine, "timing": {}, "per_batch": per_batch}

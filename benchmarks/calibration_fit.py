"""Calibrating the analytic roofline on measured throughput of one (device, engine, dtype): fitting a
:class:`archsearch.benchmarks.calibration.Calibration` on measured batches.

The roofline (``archsearch.benchmarks.analytic``) uses the device's peak FLOP/s and bandwidth, which no
engine reaches, and it has no term for what an engine pays besides its kernels. Calibration fits a few
physically meant parameters on measured batches, by least squares on the log throughput ratio:

* the achieved fraction of the device entry's peak compute, and of its memory bandwidth when reading
  weights (above 1 where the entry understates the device, as the CPU entry, measured by a matmul
  under load, can); with ``+kv`` a separate fraction for reading the KV cache (attention kernels stream
  it at another rate than GEMMs read weights, so what a KV reduction buys is not what the bytes say);
* a fixed overhead per engine step (scheduling, launches) and, with two or more batch sizes, one per
  sequence and step (sampling, input preparation, block tables: a cost that grows with the batch and
  does not shrink with the KV cache; with it the throughput curve bends at small batch), and for CPU
  engines one per sequence, layer and query head or KV head (kernels that work head by head);
* with ``+attn``, on the rows whose engine decodes on CUDA cores for the shape's GQA group
  (``calibration.TENSOR_CORE_MIN_GROUP``: SGLang's FlashInfer below a group of 5), the rate of that
  kernel's attention FLOPs (a cost per query head and KV token that the KV bytes do not show);
* ``max`` (compute and memory overlap, the roofline's assumption, right on GPUs) or ``sum``.

A batch whose KV cache does not fit is predicted as the engine runs it: at most as many sequences as
fit at once, in waves (``analytic.predict_batch``), so saturation past the KV capacity is predicted.

Measurements come from ``bench --out`` JSONL records or from a table of published figures (CSV, one
row per model x device x engine x batch, the columns of :data:`TABLE_COLUMNS`). A table with several
devices and engines is fitted at once: the efficiencies may be per device (one GPU's kernels, whatever
engine schedules them: ``pooled`` sharing) or per device x engine (``group``), the overheads are always
per device x engine. The variant kept (sharing, combine, terms) is the one with the smallest
leave-one-shape-out error (each shape predicted by a fit on the others, held out of every device and
engine), so the choice never sees held-out data; every variant's error is kept in the file, with the
chosen one's leave-one-batch-out error. One file is written per device x engine.

    python -m archsearch calibrate --table published-throughput.csv --out-dir configs/calibration
    python -m archsearch calibrate --results bench.jsonl --device-spec H200 --out h200-vllm.json
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.benchmarks import read_jsonl
from archsearch.benchmarks.analytic import predict_batch
from archsearch.benchmarks.calibration import TENSOR_CORE_MIN_GROUP, Calibration
from archsearch.errors import ArchsearchError
from archsearch.fileio import check_output
from archsearch.hardware import detect_gpu_name, device_key, get_device
from archsearch.logs import get_logger
from archsearch.provenance import provenance


@dataclass(frozen=True)
class Point:
    """One measured batch: the shape, the setting, the tokens/s measured, and where."""

    spec: Any  # ArchSpec
    batch: int
    input_len: int
    output_len: int
    measured: float
    device: str  # as recorded (a table entry, or cpu)
    engine: str
    dtype: str
    device_spec: str  # the device table entry the roofline starts from
    label: str = ""
    source: str = ""  # where the figure was published or measured (a table's ``source`` column)

    @property
    def group(self) -> tuple[str, str, str]:
        return (self.device, self.engine, self.dtype)

    def row(self) -> dict[str, Any]:
        return {"model": self.label, "device": self.device, "engine": self.engine, "input_len": self.input_len,
                "output_len": self.output_len, "batch_size": self.batch, "measured": self.measured}


def points_from_results(results, device_spec: str | None = None) -> list[Point]:
    """Every successful measured batch of ``bench --out`` records (predictions are skipped).
    ``device_spec``: the table entry their roofline starts from (default: the recorded device)."""
    pts = []
    for r in results:
        if r.predicted:
            continue
        spec = ArchSpec.from_record(r.architecture)
        recorded = detect_gpu_name(r.device or "") or r.device  # a GPU by its table name
        dev = device_spec or recorded
        for b in r.per_batch:
            if b.ok and b.output_throughput:
                pts.append(Point(spec, b.batch_size, r.settings["input_len"], r.settings["output_len"],
                                 float(b.output_throughput), recorded, r.backend, r.dtype, dev,
                                 spec.name or f"d{spec.hidden_size}-L{spec.n_layers}-kv{spec.n_kv_heads}"))
    return pts


# a table of published or measured throughput: one row per model x device x engine x batch
TABLE_COLUMNS = ("model", "n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab_size",
                 "tie_embeddings", "device", "engine", "input_len", "output_len", "batch_size", "output_tokens_per_s")
_INT_COLUMNS = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab_size", "input_len",
                "output_len", "batch_size")


def read_throughput_table(path: str | Path) -> tuple[list[Point], dict[str, Any]]:
    """The rows of a throughput table (CSV with :data:`TABLE_COLUMNS`; optional ``family``, ``dtype``
    (default bfloat16) and ``source``) as points, and a description of the file (path, checksum,
    rows). Every problem names its row and column."""
    p = Path(path)
    if not p.is_file():
        raise ArchsearchError("--table", f"{str(p)!r} does not exist", "give a CSV file of measured throughput")
    text = p.read_text()
    rows = list(csv.DictReader(text.splitlines()))
    header = set(rows[0]) if rows else set()
    missing = [c for c in TABLE_COLUMNS if c not in header]
    if not rows or missing:
        raise ArchsearchError(f"{p.name}: columns", f"missing {missing or list(TABLE_COLUMNS)}",
                              f"a throughput table has the columns {', '.join(TABLE_COLUMNS)}")
    pts: list[Point] = []
    seen: dict[tuple, tuple[int, float]] = {}
    for i, r in enumerate(rows, start=2):  # line 1 is the header
        where = f"{p.name} line {i}"

        def num(col: str, kind=float):
            v = (r.get(col) or "").strip()
            try:
                x = kind(v) if kind is float else int(v)
            except ValueError:
                raise ArchsearchError(f"{where}: {col}", f"{v!r} is not {'an integer' if kind is int else 'a number'}",
                                      "fix the value in the table") from None
            if not (math.isfinite(x) and x > 0):
                raise ArchsearchError(f"{where}: {col}", f"must be positive, got {v!r}", "fix the value in the table")
            return x
        tie = (r.get("tie_embeddings") or "").strip().lower()
        if tie not in ("true", "false", "1", "0"):
            raise ArchsearchError(f"{where}: tie_embeddings", f"{tie!r} is not true or false", "fix the value")
        device = (r.get("device") or "").strip()
        try:
            get_device(device) if device.lower() != "cpu" else None
        except ArchsearchError as e:
            raise ArchsearchError(f"{where}: device", e.problem, e.fix) from None
        ints = {c: num(c, int) for c in _INT_COLUMNS}
        try:
            spec = ArchSpec(n_layers=ints["n_layers"], hidden_size=ints["hidden_size"], n_heads=ints["n_heads"],
                            n_kv_heads=ints["n_kv_heads"], head_dim=ints["head_dim"], ffn=ints["ffn"],
                            vocab_size=ints["vocab_size"], tie_embeddings=tie in ("true", "1"),
                            family=(r.get("family") or "llama").strip() or "llama", name=r["model"].strip() or None)
        except ArchsearchError as e:
            raise ArchsearchError(f"{where}: {e.field}", e.problem, e.fix) from None
        engine = (r.get("engine") or "").strip().lower()
        if not engine:
            raise ArchsearchError(f"{where}: engine", "is empty", "name the serving engine, e.g. vllm or sglang")
        pts.append(Point(spec, ints["batch_size"], ints["input_len"], ints["output_len"],
                         num("output_tokens_per_s"), device, engine, (r.get("dtype") or "bfloat16").strip(),
                         device, r["model"].strip(), (r.get("source") or "").strip()))
        point = (replace(spec, name=None), pts[-1].batch, pts[-1].input_len, pts[-1].output_len, *pts[-1].group)
        if point in seen:  # one figure per point: two would be fitted as if measured twice, or contradict
            first = seen[point]
            raise ArchsearchError(f"{where}", f"gives the point of line {first[0]} again (same shape, device, "
                                  f"engine, dtype, batch and lengths: {first[1]:g} and {pts[-1].measured:g} "
                                  "tokens/s)", "keep one row per point (a mean of repeats, said in source)")
        seen[point] = (i, pts[-1].measured)
    return pts, {"path": str(path), "sha256": hashlib.sha256(text.encode()).hexdigest(), "table_rows": len(pts)}


# overhead terms of each variant: per sequence, per sequence x layer x (query | KV) head; "kv" a
# separate efficiency for KV-cache reads. The head terms are for CPU engines (kernels that loop over
# heads) and are tried on a measured CPU only; the KV efficiency on GPUs (attention kernels).
# "attn" the rate of decode attention on CUDA cores, for the rows whose engine runs it there
# (calibration.TENSOR_CORE_MIN_GROUP: a GQA group below the engine's tensor-core threshold).
TERMS = {"": (), "+seq": ("seq",), "+seq+head": ("seq", "head"), "+seq+kvhead": ("seq", "kvhead"),
         "+seq+kv": ("seq", "kv"), "+seq+attn": ("seq", "attn"), "+seq+kv+attn": ("seq", "kv", "attn")}
CPU_TERMS = ("", "+seq", "+seq+head", "+seq+kvhead")
GPU_TERMS = ("", "+seq", "+seq+kv", "+seq+attn", "+seq+kv+attn")
# a variant within this much leave-one-shape-out error of the best counts as tied; the one with the
# fewest parameters among the tied is kept
TIE = 0.002


@dataclass(frozen=True)
class Variant:
    combine: str
    terms: tuple[str, ...]
    sharing: str = "group"  # efficiencies per device x engine ("group") or per device ("pooled")

    @property
    def name(self) -> str:
        t = next(k for k, v in TERMS.items() if v == self.terms)
        return f"{self.combine}{t}" + ("/pooled" if self.sharing == "pooled" else "")


def _slots(pts: list[Point], v: Variant, devices: dict) -> tuple[dict, list]:
    """The parameters of ``v`` on ``pts``: {(name, owner): index}, and per index (start, lo, hi) in log.
    A table GPU's efficiencies stay at or below 1 (its datasheet peaks are upper bounds); a measured
    entry's (the CPU's matmul under load) may exceed it."""
    slots: dict = {}
    init = {"ec": (0.3, 1e-4, 100.0), "ew": (0.3, 1e-4, 100.0), "kv": (0.3, 1e-4, 100.0),
            "step": (1e-3, 1e-7, 1.0), "seq": (1e-5, 1e-10, 0.1), "head": (1e-5, 1e-10, 0.1),
            "kvhead": (1e-5, 1e-10, 0.1), "attn": (3e13, 1e11, 1e16)}
    bounds = []
    for p in pts:
        for name in ("ec", "ew", "step", *v.terms):
            if name == "attn" and not _on_cuda_cores(p):
                continue  # this row's decode attention runs on tensor cores: the term does not apply
            owner = p.device_spec if (v.sharing == "pooled" and name in ("ec", "ew", "kv")) else p.group
            if (name, owner) not in slots:
                slots[(name, owner)] = len(slots)
                x0, lo, hi = init[name]
                if name in ("ec", "ew", "kv") and not devices[p.device_spec].measured:
                    hi = 1.0
                bounds.append((math.log(x0), math.log(lo), math.log(hi)))
    return slots, bounds


def _calibrations(theta, slots, v: Variant, pts: list[Point], devices: dict) -> dict:
    """Per group, the ``Calibration`` that ``theta`` gives."""
    out = {}
    for p in pts:
        if p.group in out:
            continue
        # a group's own slots (keyed by the group) and, pooled, its device's (keyed by the device)
        val = {name: math.exp(theta[i]) for (name, owner), i in slots.items() if owner in (p.group, p.device_spec)}
        dev = devices[p.device_spec]
        out[p.group] = Calibration(p.device, p.engine, p.dtype, val["ec"], val["ew"], val["step"],
                                   val.get("seq", 0.0), val.get("head", 0.0), val.get("kvhead", 0.0), v.combine,
                                   dev.peak_flops(p.dtype), dev.memory_bandwidth, kv_efficiency=val.get("kv"),
                                   attn_core_flops=val.get("attn"))
    return out


def _on_cuda_cores(p: Point) -> bool:
    return p.spec.n_heads // p.spec.n_kv_heads < TENSOR_CORE_MIN_GROUP.get(p.engine, 1)


def _predict(pts: list[Point], cals: dict, devices: dict):
    import numpy as np

    out = []
    for p in pts:
        b = predict_batch(p.spec, devices[p.device_spec], p.dtype, p.batch, p.input_len, p.output_len, cals[p.group])
        out.append(b.output_throughput if b.ok else float("nan"))
    return np.array(out)


def fit_variant(pts: list[Point], v: Variant, devices: dict) -> dict:
    """Least squares on log throughput for one variant: per group, its ``Calibration``."""
    import numpy as np
    from scipy.optimize import least_squares

    slots, bounds = _slots(pts, v, devices)
    measured = np.array([p.measured for p in pts])

    def resid(theta):
        r = np.log(_predict(pts, _calibrations(theta, slots, v, pts, devices), devices) / measured)
        return np.nan_to_num(r, nan=10.0)
    res = least_squares(resid, x0=[b[0] for b in bounds], bounds=([b[1] for b in bounds], [b[2] for b in bounds]))
    return _calibrations(res.x, slots, v, pts, devices)


def held_out_errors(pts: list[Point], v: Variant, devices: dict, key) -> dict[str, Any] | None:
    """Each value of ``key`` (a shape, a batch size) predicted by a fit on the points without it:
    mean and worst absolute relative error, and every row's prediction. None with fewer than 2 values."""
    import numpy as np

    values = list(dict.fromkeys(key(p) for p in pts))
    if len(values) < 2:
        return None
    rows = []
    for k in values:
        train = [p for p in pts if key(p) != k]
        test = [p for p in pts if key(p) == k]
        if not {p.group for p in test} <= {p.group for p in train}:
            return None  # a group seen only in the held-out value has no fitted overheads
        cals = fit_variant(train, v, devices)
        for p, q in zip(test, _predict(test, cals, devices)):
            rows.append({**p.row(), "predicted": float(q), "error": float(abs(q / p.measured - 1))})
    errs = np.array([r["error"] for r in rows])
    return {"mape": float(errs.mean()), "worst": float(errs.max()), "rows": rows}


def shape_key(p: Point):
    return p.spec  # equal shapes (names aside) are one shape, whatever their lengths or batch


def model_variants(pts: list[Point], devices: dict, terms=None) -> list[Variant]:
    """The variants tried: ``terms`` (default: the CPU forms on a measured CPU, else the GPU
    forms), each with max and sum, per group and, where a device has several engines, pooled."""
    terms = terms or (CPU_TERMS if any(d.measured for d in devices.values()) else GPU_TERMS)
    names = list(terms) if len({p.batch for p in pts}) >= 2 else [""]
    if not any(_on_cuda_cores(p) for p in pts):  # no row for the CUDA-core attention term to fit on
        names = [t for t in names if "attn" not in TERMS[t]]
    per_device: dict[str, set] = {}
    for p in pts:
        per_device.setdefault(p.device_spec, set()).add(p.group)
    sharings = ["group"] + (["pooled"] if any(len(g) > 1 for g in per_device.values()) else [])
    return [Variant(c, TERMS[t], s) for s in sharings for c in ("max", "sum") for t in names]


def table_devices(pts: list[Point]) -> dict:
    return {name: get_device(name) for name in {p.device_spec for p in pts}}


def fit_points(pts: list[Point], variant: str | None = None, terms=None) -> dict[tuple[str, str, str], Calibration]:
    """Fit every (device, engine, dtype) of ``pts`` at once (module docstring): per group its
    ``Calibration``, whose ``fit`` holds the chosen variant, every variant's leave-one-shape-out
    error, the chosen one's leave-one-shape-out and leave-one-batch-out errors per row, and the rows
    it was fitted on with their in-sample predictions. ``variant`` (a name) skips the choice; ``terms``
    (names of :data:`TERMS`) are the overhead forms tried."""
    import numpy as np

    if len(pts) < 3:
        raise ArchsearchError("results", f"{len(pts)} measured batches; calibration needs at least 3",
                              "measure a few shapes with bench --out FILE first")
    devices = table_devices(pts)
    variants = {v.name: v for v in model_variants(pts, devices, terms)}
    groups = list(dict.fromkeys(p.group for p in pts))

    def part(h, g):  # a held-out evaluation's rows of group g
        rows = [r for r in (h or {}).get("rows", ()) if (r["device"], r["engine"]) == g[:2]]
        errs = np.array([r["error"] for r in rows])
        return {"mape": float(errs.mean()), "worst": float(errs.max()), "rows": rows} if rows else None

    if variant is not None:
        if variant not in variants:
            raise ArchsearchError("variant", f"{variant!r} is not a variant for these points",
                                  f"use one of {sorted(variants)}")
        scores = {g: {} for g in groups}
        chosen = {g: variant for g in groups}
    else:  # per group, the variant that predicts its held-out rows best (the fewest parameters among ties)
        held = {}
        t0 = time.monotonic()
        log = get_logger("calibrate").info
        log(f"[calibrate] {len(pts)} rows, {len(groups)} device/engine group(s): scoring {len(variants)} model "
            "variants by refitting without each shape and each batch size (minutes on a CPU)")
        for i, (name, v) in enumerate(variants.items(), 1):  # the long part: a line per variant
            held[name] = (held_out_errors(pts, v, devices, shape_key),
                          held_out_errors(pts, v, devices, lambda p: p.batch))
            log(f"[calibrate] variant {i}/{len(variants)} ({name}) scored, {time.monotonic() - t0:.0f} s")
        scores = {g: {name: _score(part(s, g), part(b, g)) for name, (s, b) in held.items()} for g in groups}
        chosen = {}
        for g in groups:
            sc = scores[g]
            if all(s is not None for s in sc.values()):
                best = min(sc.values())
                tied = [n for n, s in sc.items() if s <= best + TIE]
                chosen[g] = min(tied, key=lambda n: (len(_slots(pts, variants[n], devices)[1]), sc[n]))
            else:  # too few shapes to cross-validate: the roofline's own form
                chosen[g] = "max"
    prov = provenance(device=False)
    out = {}
    for name in dict.fromkeys(chosen.values()):
        v = variants[name]
        cals = fit_variant(pts, v, devices)
        loso = held_out_errors(pts, v, devices, shape_key)
        lobo = held_out_errors(pts, v, devices, lambda p: p.batch)
        for g in (g for g in groups if chosen[g] == name):
            cal = cals[g]
            mine = [p for p in pts if p.group == g]
            pred = _predict(mine, cals, devices)
            out[g] = _finish(cal, v, mine, pred, cals, part(loso, g), part(lobo, g), scores[g], prov)
    return out


def _score(loso, lobo) -> float | None:
    """A variant's held-out error on a group: the mean of its leave-one-shape-out and (where there
    are two batch sizes) leave-one-batch-out MAPE; None when no shape can be held out."""
    if loso is None:
        return None
    return (loso["mape"] + lobo["mape"]) / 2 if lobo else loso["mape"]


def _finish(cal, v, mine, pred, cals, loso, lobo, scores, prov):
    import numpy as np

    g = mine[0].group
    return replace(cal, fit={
            "variant": v.name, "n_batches": len(mine), "device_spec": mine[0].device_spec,
            "fitted_with": sorted(f"{d}/{e}" for d, e, _ in cals if (d, e) != g[:2]),
            "mape_on_fitted": float(np.mean(np.abs(pred / [p.measured for p in mine] - 1))),
            "leave_one_shape_out": loso, "leave_one_batch_out": lobo,
            "held_out_mape_by_variant": scores,
            "shapes": sorted({p.label for p in mine}),
            "rows": [{**p.row(), "predicted": float(q)} for p, q in zip(mine, pred)]},
            provenance=prov)


def fit_calibration(results, device_spec: str = "cpu", terms=None) -> Calibration:
    """Fit the parameters on measured ``BenchResult``s of one device/engine/dtype, choosing the
    model variant by leave-one-shape-out error on these results (module docstring)."""
    pts = points_from_results(results, device_spec)
    keys = {p.group for p in pts}
    if len(pts) >= 3 and len(keys) != 1:
        raise ArchsearchError("results", f"mixes {sorted(map(str, keys))}",
                              "calibrate on one (device, engine, dtype) at a time")
    return next(iter(fit_points(pts, terms=terms).values()))


def file_name(device: str, engine: str) -> str:
    """``h200-vllm.json``: a calibration file's name by its device and engine."""
    return "-".join("".join(c if c.isalnum() else "-" for c in x.lower()) for x in (device, engine)) + ".json"


def calibrate(table: str | None = None, results: list[str] | None = None, device_spec: str | None = None,
              device: str | None = None, engine: str | None = None, variant: str | None = None) -> dict:
    """Fit calibrations from a table or ``bench`` JSONL files; only ``device``/``engine`` when given
    (the fit still pools every row). Returns {(device, engine, dtype): Calibration}."""
    if bool(table) == bool(results):
        raise ArchsearchError("--table/--results", "give exactly one of them",
                              "--table FILE.csv (published figures) or --results FILE.jsonl (bench --out)")
    if table:
        pts, source = read_throughput_table(table)
    else:
        pts = points_from_results([r for f in results for r in read_jsonl(f)], device_spec)
        source = {"path": list(results), "table_rows": len(pts)}
    fitted = fit_points(pts, variant)
    want = {k: v for k, v in fitted.items()
            if (device is None or device_key(k[0]) == device_key(device)) and (engine is None or k[1] == engine.lower())}
    if not want:
        raise ArchsearchError("--device/--engine", f"no rows of {device or 'any device'} with {engine or 'any engine'}",
                              f"the data hold {sorted(f'{d}/{e}' for d, e, _ in fitted)}")
    # each file names the tables of its own rows (a table's ``source`` column)
    return {k: replace(c, source={**source, "tables": sorted({p.source for p in pts if p.group == k and p.source})})
            for k, c in want.items()}


def summary(cal: Calibration) -> str:
    f = cal.fit
    loso, lobo = f.get("leave_one_shape_out"), f.get("leave_one_batch_out")
    held = (f"leave-one-shape-out MAPE {loso['mape']:.1%} (worst {loso['worst']:.1%})" if loso else
            "leave-one-shape-out: too few shapes") + (
        f", leave-one-batch-out {lobo['mape']:.1%} (worst {lobo['worst']:.1%})" if lobo else "")
    return f"{cal.device}/{cal.engine}: {f['variant']}, {f['n_batches']} rows, in-sample {f['mape_on_fitted']:.1%}, {held}"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--table", metavar="CSV", help=f"throughput table (columns: {', '.join(TABLE_COLUMNS)}; "
                                                    "optional family, dtype, source)")
    src.add_argument("--results", action="append", metavar="JSONL", help="bench --out records (repeatable)")
    ap.add_argument("--device-spec", help="--results: device table entry the roofline starts from "
                                          "(default: the recorded device)")
    ap.add_argument("--device", help="write only this device's calibration (the fit pools all rows)")
    ap.add_argument("--engine", help="write only this engine's calibration")
    ap.add_argument("--variant", help="fit this variant instead of choosing by leave-one-shape-out error")
    out = ap.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="the calibration file (one device x engine)")
    out.add_argument("--out-dir", help="one file per device x engine, named <device>-<engine>.json")


def calibrate_cli(args: argparse.Namespace) -> int:
    """``archsearch calibrate``: fit and write the calibration files the arguments ask for."""
    check_output("--out", args.out, "file")
    check_output("--out-dir", args.out_dir, "dir")
    cals = calibrate(args.table, args.results, args.device_spec, args.device, args.engine, args.variant)
    if args.out and len(cals) > 1:
        raise ArchsearchError("--out", f"the data hold {len(cals)} device x engine groups "
                                       f"({', '.join(f'{d}/{e}' for d, e, _ in cals)})",
                              "name one with --device and --engine, or write them all with --out-dir")
    for (d, e, _), cal in sorted(cals.items()):
        path = Path(args.out) if args.out else Path(args.out_dir) / file_name(d, e)
        cal.save(path)
        print(f"{summary(cal)} -> {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    try:
        return calibrate_cli(ap.parse_args(argv))
    except ArchsearchError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

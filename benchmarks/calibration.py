"""Calibrating the analytic roofline on measured results of one (device, engine, dtype).

The roofline (``archsearch.benchmarks.analytic``) uses the device's peak FLOP/s and bandwidth, which no
engine reaches. Calibration fits a few efficiency parameters on a few measured shapes
(``bench --out`` JSONL files): the achieved fraction of the device entry's peak compute and
memory bandwidth (above 1 where the entry understates the device, as the CPU entry, measured
by a matmul under load, can), a fixed overhead per engine step (scheduling, Python) and, when
the results hold two or more batch sizes, an overhead per sequence and step (sampling, input
preparation: what makes a CPU engine's step grow with the batch beyond its FLOPs) and one per
sequence, layer and query head, or KV head (a CPU engine's attention kernel works head by head,
or KV head by KV head, so a shape with many narrow heads is slower than its FLOPs say), by
least squares on the log throughput ratio. Two ways of combining compute and memory time are fitted: ``max`` (they overlap, the
roofline's assumption, right on GPUs) and ``sum`` (they do not, as in eager CPU kernels); each
without the overhead terms, with the per-sequence one, and with it and one of the per-head ones. The variant kept is the one
with the smallest leave-one-shape-out error on the fitted shapes (each shape predicted by a
fit on the others), so the choice never sees held-out data; every variant's error is kept in
the file. The file keeps the parameters, what they were fitted on, the fit's error and
provenance; ``bench --backend analytic --calibration FILE`` and ``measure.calibration`` in a
study use it. A prediction without one is labelled uncalibrated.

    python -m archsearch.benchmarks.calibration --results results/bench/x.jsonl --out calib.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from archsearch.configio import PlainData
from archsearch.errors import ArchsearchError


@dataclass(frozen=True)
class Calibration(PlainData):
    """Efficiency of one (device, engine, dtype) relative to the roofline's peaks."""

    device: str
    engine: str
    dtype: str
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float = 0.0  # per sequence of the batch, per engine step
    head_overhead_s: float = 0.0  # per sequence x layer x query head, per engine step
    kv_head_overhead_s: float = 0.0  # per sequence x layer x KV head, per engine step
    combine: str = "max"         # compute and memory time: "max" (overlap) or "sum"
    # the device figures the efficiencies multiply, fixed at fit time (the CPU entry is
    # measured afresh each run and moves with the load; a calibration must not)
    peak_flops: float | None = None
    memory_bandwidth: float | None = None
    fit: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.combine not in ("max", "sum"):
            raise ArchsearchError("calibration.combine", f"{self.combine!r} is unknown", "use max or sum (or refit)")

    def save(self, path: str | Path) -> None:
        from archsearch.fileio import write_json

        write_json(path, asdict(self), default=str)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        if not p.is_file():
            raise ArchsearchError("calibration", f"{str(p)!r} does not exist",
                                  "fit one with python -m archsearch.benchmarks.calibration --results FILE.jsonl --out FILE")
        from archsearch.fileio import read_text

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


def _points(results) -> list[tuple[Any, int, int, int, float]]:
    """(spec, batch, input_len, output_len, measured tokens/s) of every successful batch."""
    from archsearch.arch import ArchSpec

    pts = []
    for r in results:
        if r.predicted:
            continue
        spec = ArchSpec.from_record(r.architecture)
        for b in r.per_batch:
            if b.ok and b.output_throughput:
                pts.append((spec, b.batch_size, r.settings["input_len"], r.settings["output_len"],
                            float(b.output_throughput)))
    return pts


TERMS = {"": (), "+seq": ("seq",), "+seq+head": ("seq", "head"), "+seq+kvhead": ("seq", "kvhead")}  # overhead terms of each variant


def _fit_variant(pts, dev, dtype: str, combine: str, terms: tuple[str, ...]):
    """Least squares on log throughput for one model variant: (parameters, predict(pts))."""
    import numpy as np
    from scipy.optimize import least_squares

    from archsearch.benchmarks.analytic import predict_batch

    peak, bw = dev.peak_flops(dtype), dev.memory_bandwidth

    def cal(theta) -> Calibration:
        extra = dict(zip(terms, (math.exp(v) for v in theta[3:])))
        return Calibration("", "", dtype, math.exp(theta[0]), math.exp(theta[1]), math.exp(theta[2]),
                           extra.get("seq", 0.0), extra.get("head", 0.0), extra.get("kvhead", 0.0), combine, peak, bw)

    def predict(theta, on) -> np.ndarray:
        c = cal(theta)
        return np.array([predict_batch(s, dev, dtype, b, i, o, c).output_throughput for s, b, i, o, _ in on])

    measured = np.array([p[-1] for p in pts])
    x0 = [math.log(0.3), math.log(0.3), math.log(1e-3)] + [math.log(1e-5)] * len(terms)
    lo = [math.log(1e-4)] * 2 + [math.log(1e-7)] + [math.log(1e-10)] * len(terms)
    hi = [math.log(100.0)] * 2 + [0.0] + [math.log(0.1)] * len(terms)
    res = least_squares(lambda th: np.log(predict(th, pts) / measured), x0=x0, bounds=(lo, hi))
    return cal(res.x), lambda on: predict(res.x, on)


def _loso_error(pts, dev, dtype: str, combine: str, terms: tuple[str, ...]) -> float | None:
    """Mean absolute relative error of each fitted shape predicted by a fit on the other shapes."""
    keys = sorted({id(p[0]) for p in pts})
    if len(keys) < 3:
        return None
    errs = []
    for k in keys:
        train = [p for p in pts if id(p[0]) != k]
        test = [p for p in pts if id(p[0]) == k]
        _, predict = _fit_variant(train, dev, dtype, combine, terms)
        errs += [abs(q / p[-1] - 1) for q, p in zip(predict(test), test)]
    return sum(errs) / len(errs)


def fit_calibration(results, device_spec: str = "cpu") -> Calibration:
    """Fit the parameters on measured ``BenchResult``s of one device/engine/dtype, choosing the
    model variant by leave-one-shape-out error on these results (module docstring)."""
    import numpy as np

    from archsearch.hardware import get_device
    from archsearch.provenance import provenance

    pts = _points(results)
    keys = {(r.device, r.backend, r.dtype) for r in results if not r.predicted}
    if len(pts) < 3:
        raise ArchsearchError("results", f"{len(pts)} measured batches; calibration needs at least 3",
                              "measure a few shapes with bench --out FILE first")
    if len(keys) != 1:
        raise ArchsearchError("results", f"mixes {sorted(map(str, keys))}",
                              "calibrate on one (device, engine, dtype) at a time")
    device, engine, dtype = next(iter(keys))
    dev = get_device(device_spec)
    # the per-sequence terms need two batch sizes to be told from the fixed overhead
    names = list(TERMS) if len({p[1] for p in pts}) >= 2 else [""]
    variants = {f"{c}{t}": (c, TERMS[t]) for c in ("max", "sum") for t in names}
    scores = {name: _loso_error(pts, dev, dtype, *v) for name, v in variants.items()}
    if all(v is not None for v in scores.values()):
        variant = min(scores, key=lambda k: scores[k])
    else:  # too few shapes to cross-validate: the roofline's own form
        variant = "max"
    combine, terms = variants[variant]
    cal, predict = _fit_variant(pts, dev, dtype, combine, terms)
    measured = np.array([p[-1] for p in pts])
    return Calibration(device, engine, dtype, cal.compute_efficiency, cal.memory_efficiency, cal.step_overhead_s,
                       cal.seq_overhead_s, cal.head_overhead_s, cal.kv_head_overhead_s, combine, cal.peak_flops,
                       cal.memory_bandwidth,
                       fit={"n_batches": len(pts), "device_spec": device_spec,
                            "mape_on_fitted": float(np.mean(np.abs(predict(pts) / measured - 1))),
                            "leave_one_shape_out_mape": scores,
                            "variant": variant,
                            "shapes": sorted({s.name or str(s.hidden_size) for s, *_ in pts})},
                       provenance=provenance(device=False))


def main(argv: list[str] | None = None) -> int:
    from archsearch.benchmarks import read_jsonl

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", action="append", required=True, help="bench --out JSONL (repeatable)")
    ap.add_argument("--device-spec", default="cpu", help="device table entry the roofline starts from")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    results = [r for f in args.results for r in read_jsonl(f)]
    cal = fit_calibration(results, args.device_spec)
    cal = Calibration(**{**asdict(cal), "fit": {**cal.fit, "sources": args.results}})
    cal.save(args.out)
    print(json.dumps({k: v for k, v in asdict(cal).items() if k != "provenance"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

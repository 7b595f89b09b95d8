"""The fitted max-batch and throughput-vs-batch laws of docs/method.md section 8, and the cost they give.

* max batch: ``floor(C0 * (M_gpu - M_model) / (seq_len * ((1 - C1) + C1 * sparsity)))``
* throughput: ``C2 * log(batch / (sparsity * C3)) + C4`` (tokens/s)

``sparsity`` is active / total non-embedding parameters (:func:`archsearch.arch.sparsity`,
1.0 for a dense model). Both laws are fitted to measurements: ``bench --out`` results
(output tokens/s and peak memory per batch size) or training-step timings (training
tokens/s per batch, :mod:`archsearch.benchmarks.scripts.bench_batch_laws`). Every fit reports its
leave-one-out error and, when given, the error on held-out points.

Identifiability, stated rather than hidden: in the throughput law ``C4 - C2*log(C3)`` is one
constant, so C3 is fixed at 1 and C4 carries it; in the max-batch law C1 is only identified
when the points span more than one sparsity, otherwise it is fixed at 0 and C0 absorbs the
constant denominator.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from archsearch.arch import ArchSpec, sparsity
from archsearch.errors import ArchsearchError
from archsearch.fileio import check_input_file, read_jsonl_lines, read_text
from archsearch.planning.finetune import predict_finetune_memory
from archsearch.planning.formats import base_weight_bytes

QUANTITIES = ("output tokens/s", "training tokens/s")


@dataclass(frozen=True)
class ThroughputPoint:
    """One measured throughput at one batch size."""

    batch_size: int
    sparsity: float
    throughput: float
    source: str = ""


@dataclass(frozen=True)
class MaxBatchPoint:
    """The largest batch of ``seq_len``-token sequences that fit ``device_memory_bytes``."""

    device_memory_bytes: float
    model_memory_bytes: float
    seq_len: int
    sparsity: float
    max_batch: float
    source: str = ""


def _errors(y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
    return {"n": int(len(y)), "mae": float(np.mean(np.abs(pred - y))),
            "mean_rel_err": float(np.mean(np.abs(pred - y) / np.abs(y)))}


def _loo(fit, predict, points: Sequence[Any], y: np.ndarray) -> dict[str, float] | None:
    """Leave-one-out error; None below three points (a two-point fit has nothing left over)."""
    if len(points) < 3:
        return None
    pred = [predict(fit([p for j, p in enumerate(points) if j != i]), points[i]) for i in range(len(points))]
    return _errors(y, np.array(pred, dtype=float))


class _Saved:
    """Dict round trip for the frozen law dataclasses (both laws share one file)."""

    def to_dict(self) -> dict[str, Any]:
        return {"law": type(self).__name__, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return cls(**{k: (tuple(v) if k == "notes" else v) for k, v in d.items() if k != "law"})


@dataclass(frozen=True)
class ThroughputLaw(_Saved):
    """``throughput = c2 * log(batch / (sparsity * c3)) + c4`` in ``quantity`` units."""

    c2: float
    c3: float
    c4: float
    quantity: str
    device: str | None
    n_points: int
    loo: dict[str, float] | None = None
    holdout: dict[str, float] | None = None
    notes: tuple[str, ...] = ()

    def predict(self, batch_size: float, sparsity: float = 1.0) -> float:
        return self.c2 * math.log(batch_size / (sparsity * self.c3)) + self.c4


@dataclass(frozen=True)
class MaxBatchLaw(_Saved):
    """``max_batch = floor(c0 * (M_gpu - M_model) / (seq_len * ((1 - c1) + c1 * sparsity)))``.

    Memories are in units of ``memory_unit_bytes`` (1: bytes, as laws fitted here; 1e9: GB, as
    published); ``sparsity_from`` says which sparsity the law was fit with: ``params`` (active /
    total non-embedding parameters, :func:`archsearch.arch.sparsity`) or ``experts`` (routed /
    all experts, k/E)."""

    c0: float
    c1: float
    device: str | None
    n_points: int
    loo: dict[str, float] | None = None
    holdout: dict[str, float] | None = None
    notes: tuple[str, ...] = ()
    memory_unit_bytes: float = 1.0
    sparsity_from: str = "params"

    def sparsity_of(self, spec) -> float:
        """The law's sparsity of ``spec`` (its definition: ``sparsity_from``)."""
        if self.sparsity_from == "experts":
            return spec.experts_per_token / spec.n_experts if spec.is_moe else 1.0
        return sparsity(spec)

    def predict_continuous(self, device_memory_bytes: float, model_memory_bytes: float,
                           seq_len: int, sparsity: float = 1.0) -> float:
        free = max(device_memory_bytes - model_memory_bytes, 0.0) / self.memory_unit_bytes
        return self.c0 * free / (seq_len * ((1 - self.c1) + self.c1 * sparsity))

    def predict(self, device_memory_bytes: float, model_memory_bytes: float, seq_len: int,
                sparsity: float = 1.0) -> int:
        return math.floor(self.predict_continuous(device_memory_bytes, model_memory_bytes, seq_len, sparsity))


# Published coefficients, loadable by name (``published:NAME`` wherever a max-batch law is read):
# Xia et al. 2024, "Understanding the Performance and Estimating the Cost of LLM Fine-Tuning"
# (IISWC 2024, arXiv:2408.04693), Eq. 1 for Mixtral-8x7B QLoRA fine-tuning on one GPU, memories
# in GB, sparsity as routed / all experts (top-2 of 8: 0.25).
# * ``xia2024-mixtral-fig13``: the constants of the authors' own Figure 13 script
#   (github.com/stsxxx/finetune @ 728a01b, analytical_model/analytical_capacity/plot.py: C0 = 62,
#   C1 = 0.89, evaluated with model_mem = 23.35 GB and seq_length = 512), which gives its
#   projections of 28 and 35 at 100 and 120 GB (tests);
# * ``xia2024-mixtral``: C0 = 82, C1 = 0.95 as issue #32 quoted them; neither the authors'
#   artifact nor any text reachable here holds them (kept: configurations name it).
# The paper's BlackMamba has no Eq. 1 constants in the artifact (its capacity script's second
# block reuses Mixtral's); benchmarks/scripts/bench_moe_finetune.py sets both beside the paper.
XIA2024_FIG13_MODEL_MEMORY_GB = 23.35
XIA2024_FIG13_SEQ_LEN = 512
PUBLISHED_MAX_BATCH = {
    "xia2024-mixtral-fig13": MaxBatchLaw(
        c0=62.0, c1=0.89, device=None, n_points=0, memory_unit_bytes=1e9, sparsity_from="experts",
        notes=("published: Xia et al. 2024 (arXiv:2408.04693) Eq. 1 as the authors' Figure 13 script evaluates "
               "it (github.com/stsxxx/finetune @ 728a01b, analytical_model/analytical_capacity/plot.py): "
               "C0 = 62, C1 = 0.89 with model_mem = 23.35 GB, seq_length = 512; memory in GB, sparsity = "
               "routed/all experts",)),
    "xia2024-mixtral": MaxBatchLaw(
        c0=82.0, c1=0.95, device=None, n_points=0, memory_unit_bytes=1e9, sparsity_from="experts",
        notes=("Xia et al. 2024 (arXiv:2408.04693) Eq. 1, Mixtral-8x7B QLoRA, C0 = 82, C1 = 0.95 as issue #32 "
               "quoted them (not in the authors' artifact, whose Figure 13 uses C0 = 62, C1 = 0.89: "
               "published:xia2024-mixtral-fig13); memory in GB, sparsity = routed/all experts",)),
}


def load_max_batch_law(text: str) -> MaxBatchLaw:
    """``published:NAME`` (:data:`PUBLISHED_MAX_BATCH`) or a batch-laws JSON's max-batch law."""
    if str(text).startswith("published:"):
        name = str(text).split(":", 1)[1]
        if name not in PUBLISHED_MAX_BATCH:
            raise ArchsearchError("--max-batch-law", f"no published law {name!r}",
                                  f"use one of {['published:' + k for k in PUBLISHED_MAX_BATCH]} or a LAWS.json")
        return PUBLISHED_MAX_BATCH[name]
    return load_batch_laws(text, "--max-batch-law")[1]


def with_active_experts(spec, k: int):
    """``spec`` with ``k`` experts routed per token: ``k = n_experts`` is the dense fine-tune of
    an MoE (every expert runs), which the memory, FLOP and law accounting then follow."""
    if not spec.is_moe:
        raise ArchsearchError("experts_per_token", f"{spec.name or spec.family} is dense", "give an MoE model")
    return spec.replace(experts_per_token=k)


# -- fitting ------------------------------------------------------------------------------------

def _check_points(points: Sequence[Any], need: int, what: str) -> None:
    if len(points) < need:
        raise ArchsearchError(what, f"{len(points)} points, need at least {need}",
                              "measure more batch sizes (bench --batch-sizes 1,2,4,8,...)")


def _fit_tp(points: Sequence[ThroughputPoint]) -> tuple[float, float]:
    x = np.log([p.batch_size / p.sparsity for p in points])
    y = np.array([p.throughput for p in points], dtype=float)
    c2, c4 = np.polyfit(x, y, 1)
    return float(c2), float(c4)


def fit_throughput_law(points: Sequence[ThroughputPoint], quantity: str = "output tokens/s",
                       device: str | None = None, holdout: Sequence[ThroughputPoint] = ()) -> ThroughputLaw:
    """Least squares of throughput on ``log(batch / sparsity)`` (C3 fixed at 1, see module doc)."""
    if quantity not in QUANTITIES:
        raise ArchsearchError("quantity", f"{quantity!r}", f"use one of {list(QUANTITIES)}")
    _check_points(points, 2, "throughput points")
    if len({p.batch_size / p.sparsity for p in points}) < 2:
        raise ArchsearchError("throughput points", "all at one batch/sparsity",
                              "measure at least two batch sizes")
    c2, c4 = _fit_tp(points)
    y = np.array([p.throughput for p in points], dtype=float)
    loo = _loo(_fit_tp, lambda c, p: c[0] * math.log(p.batch_size / p.sparsity) + c[1], list(points), y)
    law = ThroughputLaw(c2=c2, c3=1.0, c4=c4, quantity=quantity, device=device, n_points=len(points),
                        loo=loo, notes=("C3 fixed at 1: C4 - C2*log(C3) is one constant (not identifiable)",))
    if holdout:
        yh = np.array([p.throughput for p in holdout], dtype=float)
        law = _with(law, holdout=_errors(yh, np.array([law.predict(p.batch_size, p.sparsity) for p in holdout])))
    return law


def _with(law, **changes):
    return dataclasses.replace(law, **changes)


def _fit_mb(points: Sequence[MaxBatchPoint]) -> tuple[float, float]:
    """log-space least squares; for fixed C1, log C0 is the mean residual, so only C1 is searched."""
    from scipy.optimize import minimize_scalar

    free = np.array([(p.device_memory_bytes - p.model_memory_bytes) / p.seq_len for p in points])
    s = np.array([p.sparsity for p in points])
    logb = np.log([p.max_batch for p in points])

    def c0_and_sse(c1: float) -> tuple[float, float]:
        r = logb - np.log(free / ((1 - c1) + c1 * s))
        return float(np.mean(r)), float(np.sum((r - r.mean()) ** 2))

    if np.ptp(s) < 1e-9:
        return math.exp(c0_and_sse(0.0)[0]), 0.0
    c1 = float(minimize_scalar(lambda c: c0_and_sse(c)[1], bounds=(0.0, 1.0), method="bounded").x)
    return math.exp(c0_and_sse(c1)[0]), c1


def fit_max_batch_law(points: Sequence[MaxBatchPoint], device: str | None = None,
                      holdout: Sequence[MaxBatchPoint] = ()) -> MaxBatchLaw:
    """Fit C0, C1 to observed maximum batches (log space; C1 in [0, 1])."""
    _check_points(points, 2, "max-batch points")
    for p in list(points) + list(holdout):
        if p.device_memory_bytes <= p.model_memory_bytes or p.max_batch <= 0:
            raise ArchsearchError("max-batch points", f"{p.source or p}: no room beside the model "
                                  "or max batch <= 0", "drop points where the model does not fit")
    c0, c1 = _fit_mb(points)
    pred = lambda c, p: c[0] * (p.device_memory_bytes - p.model_memory_bytes) / (  # noqa: E731
        p.seq_len * ((1 - c[1]) + c[1] * p.sparsity))
    y = np.array([p.max_batch for p in points], dtype=float)
    notes = () if np.ptp([p.sparsity for p in points]) >= 1e-9 else (
        "C1 fixed at 0: every point has the same sparsity, so C1 is not identified",)
    law = MaxBatchLaw(c0=c0, c1=c1, device=device, n_points=len(points),
                      loo=_loo(_fit_mb, pred, list(points), y), notes=notes)
    if holdout:
        yh = np.array([p.max_batch for p in holdout], dtype=float)
        law = _with(law, holdout=_errors(yh, np.array([pred((c0, c1), p) for p in holdout])))
    return law


# -- points from measurements --------------------------------------------------------------------

def _spec_of(architecture: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(ArchSpec)}
    return ArchSpec.from_dict({k: v for k, v in architecture.items() if k in names})


def throughput_points(results: Iterable[Any]) -> list[ThroughputPoint]:
    """Output tokens/s per successful batch of measured ``bench`` results (BenchResult or its
    dict). Analytic predictions are refused: a law fitted to them would fit the roofline."""
    out = []
    for r in results:
        d = r if isinstance(r, dict) else r.to_dict()
        if d.get("predicted"):
            raise ArchsearchError("bench results", f"{d.get('backend')} result is a prediction",
                                  "fit the laws to measured results (vllm, sglang, hf)")
        s = sparsity(_spec_of(d["architecture"]))
        for b in d["per_batch"]:
            if b.get("ok") and b.get("output_throughput"):
                out.append(ThroughputPoint(int(b["batch_size"]), s, float(b["output_throughput"]),
                                           f"{d.get('backend')}:{d['architecture'].get('name')}:b{b['batch_size']}"))
    return out


def max_batch_points(peaks: Sequence[tuple[int, float]], budgets: Sequence[float], model_memory_bytes: float,
                     seq_len: int, sparsity: float, source: str = "") -> list[MaxBatchPoint]:
    """Max batches read off measured ``(batch, peak bytes)`` pairs: for each memory budget
    bracketed by two measured batches, the batch where the (linear between them) peak meets
    the budget. Budgets outside the measured range are skipped, not extrapolated."""
    pts = sorted(peaks)
    out = []
    for m in budgets:
        for (b0, p0), (b1, p1) in zip(pts, pts[1:]):
            if p0 <= m < p1:
                out.append(MaxBatchPoint(m, model_memory_bytes, seq_len, sparsity,
                                         b0 + (b1 - b0) * (m - p0) / (p1 - p0), source))
                break
    return out


def model_memory_bytes(spec, quantity: str, dtype: str, *, method: str = "full", weight_format=None,
                       lora=None) -> float:
    """M_model of the max-batch law, one definition for fit and use: the weights (in
    ``weight_format``, default ``dtype``) for serving; for training what does not grow with the
    batch: every weight, gradient and mixed-precision AdamW state (``full``), or the frozen base
    in its format plus the adapters, their gradients and AdamW states (``lora``, ``qlora``: NF4)."""
    if quantity == "output tokens/s":
        return base_weight_bytes(spec, weight_format, dtype)["total"]

    m = predict_finetune_memory(spec, method, 1, 1, dtype, lora=lora, weight_format=weight_format)
    if method == "full":
        return float(m["weights"] + m["gradients"] + m["optimizer"])
    return float(m["weights"] + m["adapters"] + m["adapter_gradients"] + m["optimizer"])


def read_points(path: str | Path) -> tuple[str, list[ThroughputPoint], list[MaxBatchPoint], str | None]:
    """(quantity, throughput points, max-batch points, device) from a JSONL file of ``bench
    --out`` results, or of training-step timings (rows with ``batch_size``, ``seq_len``,
    ``tokens_per_s``, ``peak_memory_bytes``, ``device_memory_bytes``, ``architecture``,
    ``dtype``, ``device``; benchmarks/scripts/bench_batch_laws.py writes them).

    Max-batch points come from the measured peak memory per batch: for every memory budget
    halfway between two measured peaks, the batch where that budget is met (see
    :func:`max_batch_points`)."""

    p = check_input_file(str(path), path)
    try:  # bench --out appends: a line torn by a killed bench is skipped, with a message
        rows = read_jsonl_lines(p, what=str(path))
    except OSError as e:
        raise ArchsearchError(str(path), f"cannot read measurements: {e}") from None
    if not rows:
        raise ArchsearchError(str(path), "no measurements in the file")
    tp: list[ThroughputPoint] = []
    mb: list[MaxBatchPoint] = []
    quantities, devices = set(), set()
    by_model: dict[str, tuple[Any, str, int, list[tuple[int, float]]]] = {}
    for i, r in enumerate(rows):
        if "per_batch" in r:  # a bench result
            tp += throughput_points([r])
            quantities.add("output tokens/s")
            devices.add(r.get("device"))
            st = r.get("settings", {})
            spec = _spec_of(r["architecture"])
            peaks = [(b["batch_size"], b["peak_memory_bytes"]) for b in r["per_batch"]
                     if b.get("ok") and b.get("peak_memory_bytes")]
            by_model[f"{i}"] = (spec, r.get("dtype") or "float32",
                                int(st.get("input_len", 0)) + int(st.get("output_len", 0)), peaks)
        else:
            try:
                spec = _spec_of(r["architecture"])
                tp.append(ThroughputPoint(int(r["batch_size"]), sparsity(spec), float(r["tokens_per_s"]),
                                          f"{spec.name}:b{r['batch_size']}"))
                key = json.dumps(r["architecture"], sort_keys=True) + str(r["seq_len"])
                entry = by_model.setdefault(key, (spec, r["dtype"], int(r["seq_len"]), []))
                if r.get("peak_memory_bytes"):
                    entry[3].append((int(r["batch_size"]), float(r["peak_memory_bytes"])))
            except (KeyError, TypeError, ValueError) as e:
                raise ArchsearchError(f"{path}:{i + 1}", f"not a timing row ({e!r})",
                                      "need architecture, batch_size, seq_len, tokens_per_s, dtype") from None
            quantities.add("training tokens/s")
            devices.add(r.get("device"))
    if len(quantities) > 1 or len(devices) > 1:
        raise ArchsearchError(str(path), f"mixes {sorted(quantities)} on devices {sorted(map(str, devices))}",
                              "fit one law per quantity and device: split the file")
    quantity = quantities.pop()
    for spec, dtype, seq, peaks in by_model.values():
        pk = sorted(peaks)
        budgets = [(a[1] + b[1]) / 2 for a, b in zip(pk, pk[1:])]
        mb += max_batch_points(pk, budgets, model_memory_bytes(spec, quantity, dtype), seq,
                               sparsity(spec), spec.name or "")
    return quantity, tp, mb, devices.pop()


# -- cost -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchLawEstimate:
    """Time and cost of pushing ``tokens`` through at the largest batch that fits."""

    hours: float
    device_hours: float
    cost_usd: float | None
    batch_size: int
    throughput: float
    assumptions: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_from_batch_laws(throughput: ThroughputLaw, max_batch: MaxBatchLaw, tokens: float,
                             device_memory_bytes: float, model_memory_bytes: float, seq_len: int,
                             sparsity: float = 1.0, n_devices: int = 1, price=None,
                             batch_cap: int | None = None,
                             max_batch_sparsity: float | None = None) -> BatchLawEstimate:
    """Run time = tokens / throughput(b*), b* = the law's max batch (capped by ``batch_cap``);
    data parallel over ``n_devices`` at ideal scaling; cost = hours x devices x price.
    ``max_batch_sparsity``: the max-batch law's own sparsity when it is defined otherwise
    (:meth:`MaxBatchLaw.sparsity_of`), default ``sparsity``."""
    mbs = sparsity if max_batch_sparsity is None else max_batch_sparsity
    b = max_batch.predict(device_memory_bytes, model_memory_bytes, seq_len, mbs)
    if b < 1:
        raise ArchsearchError("gpus", f"the max-batch law gives {b} sequences of {seq_len} tokens "
                              f"beside {model_memory_bytes / 2**30:.3g} GiB of model",
                              "use a device with more memory, a shorter sequence or more devices")
    if batch_cap is not None:
        b = min(b, batch_cap)
    thr = throughput.predict(b, sparsity)
    if thr <= 0:
        raise ArchsearchError("throughput law", f"predicts {thr:.4g} {throughput.quantity} at batch {b}",
                              "the law is outside its fitted range here; measure nearer this batch")
    hours = tokens / (thr * n_devices) / 3600
    cost = None if price is None or price.usd_per_hour is None else hours * n_devices * price.usd_per_hour
    return BatchLawEstimate(hours=hours, device_hours=hours * n_devices, cost_usd=cost, batch_size=b,
                            throughput=thr, assumptions={
        "throughput_law": f"{throughput.c2:.4g} * log(b / (s * {throughput.c3:g})) + {throughput.c4:.4g} "
                          f"[{throughput.quantity}], fit on {throughput.n_points} points "
                          f"(device {throughput.device}); LOO {throughput.loo}",
        "max_batch_law": f"floor({max_batch.c0:.4g} * (M - M_model) / (seq * ((1 - {max_batch.c1:.3g}) + "
                         f"{max_batch.c1:.3g} * s))), fit on {max_batch.n_points} points; LOO {max_batch.loo}",
        "sparsity": sparsity, "max_batch_sparsity": mbs, "seq_len": seq_len, "device_memory_bytes": device_memory_bytes,
        "model_memory_bytes": model_memory_bytes, "batch_cap": batch_cap, "n_devices": n_devices,
        "data_parallel": "ideal scaling over devices",
        "price_per_device_hour": None if price is None else price.usd_per_hour,
        "price_source": None if price is None else price.source,
        "law_notes": list(throughput.notes) + list(max_batch.notes)})


def load_batch_laws(path: str | Path, field_name: str = "--batch-laws") -> tuple[ThroughputLaw, MaxBatchLaw]:
    """Both laws from the JSON ``archsearch estimate batch-laws --out`` writes."""
    p = Path(path)
    try:
        d = json.loads(read_text(p, "--batch-laws"))
        return ThroughputLaw.from_dict(d["throughput"]), MaxBatchLaw.from_dict(d["max_batch"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ArchsearchError(field_name, f"{p}: not a batch-laws file ({e})",
                              "write one with archsearch estimate batch-laws --out FILE") from None

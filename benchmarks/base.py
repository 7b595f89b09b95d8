"""Settings, results and the backend interface of inference measurement (docs/method.md section 5).

Backends are registered lazily as ``"module:Class"`` strings (as lm-evaluation-harness does), so
importing :mod:`benchmarks` imports no engine. A backend's lifecycle:

1. :meth:`Backend.check_available` runs in the caller's process and raises
   :class:`~archsearch.errors.MissingDependencyError` when the engine cannot run here.
2. :meth:`Backend.run` does the measurement. For engines (``isolated = True``) it runs in a
   child process started by :mod:`archsearch.benchmarks.isolate`, one per candidate, so a crash, an
   out-of-memory or a hang ends that process only; it calls ``report(partial)`` after each
   batch size so that work done before a timeout is kept. Predictions (``analytic``) run
   in-process.
3. :func:`archsearch.benchmarks.measure.measure` turns what ``run`` returned (or how the child failed)
   into a :class:`BenchResult`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import statistics
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, ClassVar

from archsearch.bounds import check_count
from archsearch.configio import KEY, PlainData, normalised_engine_args
from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.fileio import append_line, read_jsonl_lines, read_text
from archsearch.hardware import host_memory_bytes

# The one list of measurement backends: name -> "module:Class" (imported when used). A new backend
# is a file holding a Backend subclass plus one line here (or register_backend at run time);
# everything else (config checks, deployment targets, provenance, whether a result is predicted)
# asks the class (docs/extending.md).
BACKENDS: dict[str, str] = {
    "vllm": "archsearch.benchmarks.vllm_backend:VLLMBackend",
    "sglang": "archsearch.benchmarks.sglang_backend:SGLangBackend",
    "hf": "archsearch.benchmarks.hf_backend:HFBackend",
    "analytic": "archsearch.benchmarks.analytic:AnalyticBackend",
    "simulated": "archsearch.benchmarks.simulator:SimulatedBackend",
}

DTYPES = ("auto", "float32", "bfloat16", "float16")
# the engines with an OpenAI-compatible server, measured online (archsearch.benchmarks.online)
SERVED_ENGINES = ("vllm", "sglang")

Report = Callable[[dict], None]


@dataclass
class BenchSettings(PlainData):
    """What to measure. ``dtype="auto"`` is float32 on CPU (no native bf16 here) and bfloat16
    on a GPU. ``timeout_s`` bounds one engine process (start plus every batch size it runs).
    ``device_spec`` names the device table entry the analytic backend predicts for (default:
    the local device); measured backends measure the device they run on and only record it.
    ``engine_args`` are passed to the engine last and override our defaults (recorded).
    ``engine_per_batch`` starts one engine process per batch size (``max_num_seqs`` equal to
    it) instead of one per candidate."""

    # every field keys a study's stored measurement (configio.key_values): each changes what is measured
    backend: str = field(metadata=KEY)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8], metadata=KEY)
    input_len: int = field(default=128, metadata=KEY)
    output_len: int = field(default=64, metadata=KEY)
    warmup: int = field(default=1, metadata=KEY)
    repeats: int = field(default=3, metadata=KEY)
    dtype: str = field(default="auto", metadata=KEY)
    timeout_s: float = field(default=900.0, metadata=KEY)
    device_spec: str | None = field(default=None, metadata=KEY)
    engine_args: dict[str, Any] = field(default_factory=dict, metadata=KEY)
    seed: int = field(default=0, metadata=KEY)
    engine_per_batch: bool = field(default=False, metadata=KEY)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ArchsearchError("backend", f"unknown backend {self.backend!r}",
                                  f"use one of {sorted(BACKENDS)}")
        self.batch_sizes = list(self.batch_sizes)
        if not self.batch_sizes:
            raise ArchsearchError("batch_sizes", "empty", "give at least one batch size, e.g. [1, 8]")
        for b in self.batch_sizes:
            if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
                raise ArchsearchError("batch_sizes", f"batch size must be a positive integer, got {b!r}")
        check_count("batch_sizes", len(self.batch_sizes), "batch_sizes")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ArchsearchError("batch_sizes", f"repeated batch size in {self.batch_sizes}")
        for f, lo in (("input_len", 1), ("output_len", 1), ("repeats", 1), ("warmup", 0),
                      ("seed", 0)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ArchsearchError(f, f"must be an integer >= {lo}, got {v!r}")
        check_count("repeats", self.repeats, "repeats")
        check_count("warmup", self.warmup, "warmup")
        # cheap arithmetic before any engine starts: the prompt and output token ids alone (8
        # bytes each) of the largest batch must fit in this machine's memory
        # (the analytic backend builds no prompts: it records a batch that cannot fit as failed)
        need, have = max(self.batch_sizes) * (self.input_len + self.output_len) * 8, host_memory_bytes()
        if not backend_class(self.backend).predicted and have and need > have:
            raise ArchsearchError("batch_sizes/input_len", f"{max(self.batch_sizes)} sequences of "
                                  f"{self.input_len}+{self.output_len} tokens need {need / 2**30:,.0f} GiB for "
                                  f"the token ids alone; this machine has {have / 2**30:,.0f} GiB",
                                  "use smaller batch sizes or lengths")
        if self.dtype not in DTYPES:
            raise ArchsearchError("dtype", f"unknown dtype {self.dtype!r}", f"use one of {list(DTYPES)}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ArchsearchError("timeout_s", f"must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.engine_args, dict):
            raise ArchsearchError("engine_args", "must be a dict of engine keyword arguments")
        # keys in one spelling before the check (as lm-eval's model_args: archsearch eval)
        self.engine_args = normalised_engine_args("engine_args", self.engine_args)
        backend_class(self.backend).check_settings(self)


def resolve_dtype(dtype: str, on_gpu: bool) -> str:
    """``auto`` is bfloat16 on a GPU and float32 on CPU (bf16 has no native support there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_gpu else "float32"


@dataclass
class BatchResult(PlainData):
    """One batch size. Throughputs are tokens/s (mean and sample std over repeats); times in
    seconds; ``repeats`` holds the raw per-repeat numbers."""

    batch_size: int
    ok: bool
    error: str | None = None
    output_throughput: float | None = None
    output_throughput_std: float | None = None
    total_throughput: float | None = None
    total_throughput_std: float | None = None
    ttft_mean: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_mean: float | None = None
    e2e_latency_mean: float | None = None
    peak_memory_bytes: int | None = None
    preemptions: int | None = None
    repeats: list[dict[str, Any]] = field(default_factory=list)
    # a prediction whose KV cache does not fit: the sequences run at once (the rest queue), and why
    capped_at: int | None = None
    note: str | None = None
    online: dict[str, Any] | None = None  # online serving metrics (simulator.ServingMetrics), where served online

    @classmethod
    def failed(cls, batch_size: int, error: str) -> "BatchResult":
        return cls(batch_size=batch_size, ok=False, error=error)


@dataclass
class BenchResult:
    """One candidate on one backend. ``ok`` is True when every batch size succeeded; a failed
    batch keeps its reason in ``per_batch`` and the first reason is in ``error``.
    ``predicted`` is True only for the analytic roofline, which is never a measurement."""

    backend: str
    backend_version: str | None
    device: str | None
    dtype: str | None
    settings: dict[str, Any]
    architecture: dict[str, Any]
    per_batch: list[BatchResult]
    predicted: bool = False
    timing: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.per_batch) and all(b.ok for b in self.per_batch)

    @property
    def error(self) -> str | None:
        for b in self.per_batch:
            if not b.ok:
                return f"batch {b.batch_size}: {b.error}"
        return None

    def batch(self, batch_size: int) -> BatchResult | None:
        return next((b for b in self.per_batch if b.batch_size == batch_size), None)

    def throughput(self, batch_size: int) -> float | None:
        """Mean output tokens/s at ``batch_size`` (None when that batch failed or was not run)."""
        b = self.batch(batch_size)
        return b.output_throughput if b is not None and b.ok else None

    def ttft(self, batch_size: int) -> float | None:
        """Mean time to first token in seconds at ``batch_size`` (None when failed)."""
        b = self.batch(batch_size)
        return b.ttft_mean if b is not None and b.ok else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "prediction" if self.predicted else "measurement",
            "predicted": self.predicted,
            "backend": self.backend,
            "backend_version": self.backend_version,
            "device": self.device,
            "dtype": self.dtype,
            "ok": self.ok,
            "error": self.error,
            "settings": self.settings,
            "architecture": self.architecture,
            "per_batch": [b.to_dict() for b in self.per_batch],
            "timing": self.timing,
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchResult":
        return cls(backend=d["backend"], backend_version=d.get("backend_version"),
                   device=d.get("device"), dtype=d.get("dtype"), settings=d.get("settings", {}),
                   architecture=d.get("architecture", {}),
                   per_batch=[BatchResult.from_dict(b) for b in d.get("per_batch", [])],
                   predicted=bool(d.get("predicted", False)), timing=d.get("timing", {}),
                   provenance=d.get("provenance", {}))


def append_jsonl(path: str | Path, result: BenchResult | dict) -> Path:
    """Append one result as a JSON line (creating the folder); returns the path."""
    obj = result.to_dict() if isinstance(result, BenchResult) else result
    append_line(path, json.dumps(obj, default=str))
    return Path(path)


# the typed fields of a bench record line: what :func:`read_jsonl` checks before reading one
_RECORD_FIELDS = {"backend": str, "settings": dict, "architecture": dict, "per_batch": list}


def _record(d: Any, where: str) -> BenchResult:
    """One line of a bench JSONL file, its fields checked by type (:data:`_RECORD_FIELDS`, and
    each batch an object with an integer ``batch_size``), or an error naming the line."""
    fix = "give the JSONL that bench --out writes: one record object per line"
    if not isinstance(d, dict):
        raise ArchsearchError(where, f"holds a {type(d).__name__}, not a bench record object", fix)
    for key, kind in _RECORD_FIELDS.items():
        if not isinstance(d.get(key), kind):
            problem = "is missing" if key not in d else f"is {type(d[key]).__name__}, not {kind.__name__}"
            raise ArchsearchError(f"{where}:{key}", problem, fix)
    for b in d["per_batch"]:
        if not isinstance(b, dict) or type(b.get("batch_size")) is not int:
            raise ArchsearchError(f"{where}:per_batch", f"{str(b)[:80]} is not a batch record with an integer "
                                  "batch_size", fix)
    try:
        return BenchResult.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise ArchsearchError(where, f"is not a bench record ({type(e).__name__}: {e})", fix) from None


def read_jsonl(path: str | Path) -> list[BenchResult]:
    """Every result of a JSONL file written by :func:`append_jsonl`, each line's fields checked
    by type (:func:`_record`), so a list, a number or an object without them names its line."""
    records = read_jsonl_lines(path, str(path))  # a torn last line is skipped: zip stops before it
    numbers = [i for i, ln in enumerate(read_text(path).splitlines(), 1) if ln.strip()] if records else []
    return [_record(d, f"{path} line {i}") for i, d in zip(numbers, records)]


# -- backends --------------------------------------------------------------------------------

def _find_spec(module: str):
    """``importlib.util.find_spec`` without importing the module (tests replace this)."""
    return importlib.util.find_spec(module)


def require_module(module: str, what: str, fix: str) -> None:
    """Raise :class:`MissingDependencyError` naming the extra to install when absent."""
    if _find_spec(module) is None:
        raise MissingDependencyError(what, f"the Python package {module!r} is not installed", fix)


def installed_version(packages: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(distribution, version) of the first installed of ``packages`` (None, None if none)."""
    for p in packages:
        try:
            return p, metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return None, None


@dataclass
class Session:
    """A started engine for one shape: ``generate(prompts)`` runs one static batch and returns
    the requests' ``archsearch.benchmarks.engine_loop.RequestTiming``. Kept resident by paired measurement."""

    generate: Callable[[list[list[int]]], list[Any]]
    vocab_size: int
    memory_probe: Callable[[], int] | None
    device: str
    dtype: str
    engine: dict[str, Any]
    timing: dict[str, Any]
    ttft_probe: Callable[[list[list[int]]], float] | None = None

    def summary(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "engine": self.engine, "timing": self.timing}


class Backend(ABC):
    """One way of getting inference speed for a shape. Subclasses set ``name``, ``packages``
    (distributions whose version is the backend's version), ``isolated`` and ``predicted``."""

    name: ClassVar[str]
    packages: ClassVar[tuple[str, ...]] = ()
    isolated: ClassVar[bool] = True
    predicted: ClassVar[bool] = False

    def version(self) -> str | None:
        return installed_version(self.packages)[1]

    def check_available(self) -> None:
        """Raise MissingDependencyError if this backend cannot run here."""

    @classmethod
    def check_settings(cls, settings: BenchSettings) -> None:
        """Raise ArchsearchError naming the field where ``settings`` (its ``engine_args`` in
        their one spelling) cannot be measured by this backend; called by :class:`BenchSettings`,
        so bad input fails before any engine starts. Imports no engine."""

    @abstractmethod
    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        """Measure (or predict) every batch size of ``job``; return the run summary.

        ``job`` holds ``arch`` (ArchSpec dict), ``model_dir`` (folder with config.json),
        ``real_weights``, ``settings`` (BenchSettings dict) and ``batch_sizes`` (this run's
        share). The summary has ``device``, ``dtype``, ``engine`` (every speed-relevant engine
        setting), ``per_batch`` (BatchResult dicts) and ``timing``.
        """


def register_backend(name: str, target: str) -> None:
    """Add backend ``name`` at run time as its ``"module:Class"`` string (a test's or a plugin's;
    a backend of the package is a line in :data:`BACKENDS`). The class must be importable by that
    string in a child process too when it is ``isolated``."""
    BACKENDS[name] = target


def backend_class(name: str, field: str = "backend") -> type[Backend]:
    """The class of registered backend ``name`` (imports its module, which imports no engine)."""
    if name not in BACKENDS:
        raise ArchsearchError(field, f"unknown backend {name!r}", f"use one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def backend_packages() -> tuple[str, ...]:
    """The distributions whose versions every registered engine backend records (a study's
    provenance names them all, whichever backend it used)."""
    out: list[str] = []
    for name in BACKENDS:
        out += [p for p in backend_class(name).packages if p != "archsearch" and p not in out]
    return tuple(out)


def get_backend(name: str) -> Backend:
    """Instantiate a registered backend by name (imports its module only now)."""
    return backend_class(name)()


def load_backend(target: str) -> Backend:
    """Instantiate a backend from its ``"module:Class"`` string."""
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()


# -- statistics --------------------------------------------------------------------------------

def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def std(xs: list[float]) -> float | None:
    """Sample standard deviation; 0.0 for a single value (no spread observed)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

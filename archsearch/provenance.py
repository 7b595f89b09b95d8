"""What produced a number: versions, device, host, time, code revision.

Every record written under ``results/`` embeds :func:`provenance` so that a number can be
traced to the code, the engine versions and the hardware that produced it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from archsearch.errors import redact
from archsearch.hardware import cpu_name, detect_gpu_name, torch_may_see_a_gpu

CORE_PACKAGES = ("archsearch", "torch", "transformers", "numpy", "scipy", "optuna",
                 "accelerate", "datasets")


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed versions (None when a package is absent), without importing the packages."""
    out: dict[str, str | None] = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def device_info() -> dict[str, Any]:
    """The accelerator in use (CUDA name, count, memory) or the CPU, with torch's thread count.

    On a machine with no GPU device node, a process that has not loaded torch is described without
    loading it (:func:`archsearch.hardware.torch_may_see_a_gpu`; every study coordinator's stage
    records ask): nothing it computed ran on torch's threads, which are then ``None``."""
    info: dict[str, Any] = {"cpu": cpu_name()}
    if not torch_may_see_a_gpu():
        return {**info, "type": "cpu", "name": info["cpu"], "threads": None}
    try:
        import torch
    except ImportError:
        return {**info, "type": "cpu"}
    info["threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)

        info.update({"type": "cuda", "name": props.name, "count": torch.cuda.device_count(),
                     "memory_gib": round(props.total_memory / 2**30, 2),
                     "table_entry": detect_gpu_name(props.name),
                     "cuda": torch.version.cuda})
    else:
        info.update({"type": "cpu", "name": info["cpu"]})
    return info


@functools.cache
def git_revision() -> str | None:
    """The checkout's revision (``-dirty`` with uncommitted changes to tracked files) as this
    process first asks: its modules were loaded from that code, so it is read once a process (two
    ``git`` processes; every measurement and stage record asks). A copy of the tree without its git
    folder (one sent to a GPU machine) has no revision of its own: there it is the one its sender
    named in ``ARCHSEARCH_GIT_REVISION``, or None."""
    root = Path(__file__).resolve().parent.parent
    named = os.environ.get("ARCHSEARCH_GIT_REVISION") or None
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return named
    if rev.returncode != 0:
        return named
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


# environment variables that change how fast an engine runs on the same code and hardware
# (threads, allocator, vLLM-CPU's cache and binding, visible GPUs): recorded where set
SPEED_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
SPEED_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "MALLOC_", "VLLM_CPU_")


def speed_env() -> dict[str, str]:
    """The set variables of :data:`SPEED_ENV` and :data:`SPEED_ENV_PREFIXES`."""
    return {k: v for k, v in sorted(os.environ.items())
            if k in SPEED_ENV or k.startswith(SPEED_ENV_PREFIXES)}


def provenance(extra_packages: Iterable[str] = (), device: bool = True) -> dict[str, Any]:
    """Versions of the core and the named extra packages, device, host, UTC time, how busy the
    host was (load average over 1, 5, 15 min: relative speeds on a shared machine move with it), git rev,
    the command, and the environment variables that change engine speed (:func:`speed_env`)."""
    return {
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "host": platform.node(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git": git_revision(),
        "versions": package_versions([*CORE_PACKAGES, *extra_packages]),
        "device": device_info() if device else None,
        "command": redact(" ".join(sys.argv)),
        "speed_env": speed_env(),
    }


def stage_provenance() -> dict[str, Any]:
    """Where and when a stage ran (the full versions are in config.json's summary and in each
    measurement's own record)."""
    p = provenance()
    return {"time_utc": p["time_utc"], "host": p["host"], "git": p["git"],
            "device": (p.get("device") or {}).get("name"), "command": p["command"]}

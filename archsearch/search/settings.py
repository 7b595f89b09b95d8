"""A stage's settings as it records them: picked from the config by dotted name (``pick``), with
the content hash of a file it reads (``file_hash``). The stages' records
(:mod:`archsearch.search.stages`) say which settings each stage reads; :mod:`archsearch.search.inputs`
fingerprints them."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any


def flat(obj: Any, prefix: str) -> dict[str, Any]:
    """A nested mapping as {dotted name: leaf}."""
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):  # e.g. proxy.sweeps.0.name
        obj = {str(i): v for i, v in enumerate(obj)}
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def file_hash(path: str | Path) -> str | None:
    """The first 16 hex digits of a file's SHA-256 (None: no such file)."""
    p = Path(path)
    if not p.is_file():
        return None
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16]


def named_file(name: str, path: str | Path) -> dict[str, Any]:
    """A setting that names a file, as a stage's settings hold it: the name, and the file's content
    (``file_hash``), so that an edited file redoes the stage as a changed name does."""
    return {name: path, f"{name} (content)": file_hash(path)}


# settings that change how a stage's work is executed, never what it computes: left out of every
# stage's fingerprint, so that turning one on or off keeps the stages done (train.compile: a compiled
# step computes the step the eager one does; docs/training.md, "Compiled steps")
EXECUTION_ONLY = re.compile(r"(^|\.)train\.compile$")


def without_execution_only(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (flat, dotted) less those :data:`EXECUTION_ONLY` names."""
    return {k: v for k, v in settings.items() if not EXECUTION_ONLY.search(k)}


def pick(d: dict[str, Any], *names: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings under ``names`` of the config dict ``d``, flat, less those under ``drop``."""
    found = flat({n: d.get(n) for n in names}, "")
    return {k: v for k, v in found.items() if not any(k == x or k.startswith(x + ".") for x in drop)}

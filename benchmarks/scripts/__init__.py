"""Benchmarks of this project (speed, accuracy and search-efficiency targets): each script prints
its figures and appends them with provenance under ``results/``. The measurement library they
use is the package above (``archsearch.benchmarks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], out: str | Path | None) -> int:
    """A benchmark's figures: written to ``out/result.json`` where an output folder is named,
    and printed as one JSON line; returns the exit status."""
    if out is not None:
        from archsearch.fileio import write_json

        write_json(Path(out) / "result.json", result, default=str)
    print(json.dumps(result, default=str))
    return 0

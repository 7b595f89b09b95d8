"""Benchmarks of this project (speed, accuracy and search-efficiency targets): each script prints
its figures and appends them with provenance under ``results/``. The measurement library they
use is the package above (``archsearch.benchmarks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archsearch.fileio import write_json


def emit(result: dict[str, Any], out: str | Path | None) -> int:
    """A benchmark's figures, printed as one JSON line and (with an output folder) in ``out/result.json``."""
    if out is not None:
        write_json(Path(out) / "result.json", result, default=str)
    print(json.dumps(result, default=str))
    return 0

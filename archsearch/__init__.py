"""archsearch: search for inference-efficient decoder shapes under a parameter budget.

Importing this package is cheap: it imports no torch, vLLM, SGLang or lm-eval. The public
names below are loaded on first use.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from archsearch._lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "ArchSpec": "archsearch.arch",
    "describe": "archsearch.arch",
    "load_arch": "archsearch.presets",
    "to_hf_config": "archsearch.arch",
    "build_candidate": "archsearch.candidates",
    "BuildSettings": "archsearch.candidates",
    "get_preset": "archsearch.presets",
    "PRESETS": "archsearch.presets",
    "ArchsearchError": "archsearch.errors",
    "RunRecord": "archsearch.rundata",
    "read_runs": "archsearch.rundata",
    "write_runs": "archsearch.rundata",
}

__all__ = ["__version__", *_LAZY]


__getattr__ = lazy_getattr('archsearch', _LAZY)


class _CheckoutFolders:
    """Import ``archsearch.trainers`` and ``archsearch.benchmarks`` from a repository checkout's
    ``trainers/`` and ``benchmarks/`` folders, as pyproject's ``package-dir`` maps them in an install.

    Active only when this package runs from a checkout (the folders sit beside it, not inside it):
    run from the repository root without an install, or with another checkout's editable install
    on the path, the sub-packages still come from the checkout whose ``archsearch`` was imported.
    """

    def __init__(self, folders: dict[str, Path]):
        self.folders = folders

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def _checkout_folders() -> dict[str, Path]:
    here = Path(__file__).resolve().parent
    return {f"{__name__}.{name}": here.parent / name for name in ("trainers", "benchmarks")
            if not (here / name).is_dir() and (here.parent / name / "__init__.py").is_file()}


if _folders := _checkout_folders():
    sys.meta_path.insert(0, _CheckoutFolders(_folders))

"""Lazy public names for packages whose modules import heavy engines (PEP 562)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``names[attr]`` (a module path) on first use."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

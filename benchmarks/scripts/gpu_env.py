"""The machine a GPU check ran on, as one JSON file: the GPU and its driver (nvidia-smi), CUDA and
cuDNN as torch sees them, the versions of every package the checks use, the wheels carried to it
(benchmarks/scripts/device_wheels.sh) and the provenance archsearch writes beside every result.
Written by benchmarks/scripts/gpu_checks.sh's first step; runs on a machine without a GPU too
(its GPU fields are then null), which is how the CPU rehearsal checks it.

    python -m archsearch.benchmarks.scripts.gpu_env OUT/versions.json
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = ("torch", "transformers", "accelerate", "peft", "optuna", "numpy", "scipy", "triton", "pydantic",
            "omegaconf", "datasets", "vllm", "sglang", "lm_eval", "flash_attn")


def nvidia_smi() -> list[dict[str, str]] | None:
    """One row per GPU: name, driver, memory, max SM clock; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = "name,driver_version,memory.total,clocks.max.sm"
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return [{"error": out.stderr.strip()[:500]}]
    return [dict(zip(fields.split(","), (v.strip() for v in line.split(",")))) for line in out.stdout.splitlines()]


def main() -> None:
    import torch

    from archsearch.provenance import provenance

    cuda = torch.cuda.is_available()
    info = {  # the GPU's name, CUDA and every package's version are in the provenance (device, versions)
        "nvidia_smi": nvidia_smi(), "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "carried_wheels": sorted(p.name for p in Path(".whl").glob("*.whl")),
        "provenance": provenance(extra_packages=PACKAGES),
    }
    text = json.dumps(info, indent=1, default=str)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

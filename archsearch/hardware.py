"""Devices: a table of GPUs (peak compute, memory, bandwidth, price) and a measured CPU entry.

One place for hardware numbers: the analytic roofline (benchmarks), MFU (trainers) and the
cost planner all read them from here. Peaks are dense (no 2:4 sparsity) tensor-core figures
from the vendor datasheets named in ``source``; ``memory_gib`` is what the device reports
(``nvidia-smi``). Prices are assumed on-demand list prices in USD per GPU-hour, late 2026:
they vary by provider, so every cost printed names the price used and the user can override
it.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from archsearch.errors import ArchsearchError
from archsearch.fileio import write_json


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops_bf16: float  # FLOP/s, dense
    peak_flops_fp32: float  # FLOP/s, non-tensor-core (or measured matmul on CPU)
    memory_bandwidth: float  # bytes/s
    memory_gib: float
    price_per_hour: float | None  # USD per device-hour, assumed
    source: str
    measured: bool = False

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype."""
        return self.peak_flops_fp32 if dtype.lower() in ("float32", "fp32") else self.peak_flops_bf16

    def to_dict(self) -> dict:
        return dict(self.__dict__)


_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM)"

GPUS: dict[str, Device] = {d.name: d for d in [
    Device("A100-40GB", 312e12, 19.5e12, 1.555e12, 40.0, 1.40, _A100),
    Device("A100-80GB", 312e12, 19.5e12, 2.039e12, 80.0, 1.80, _A100),
    Device("H100-SXM", 989e12, 67e12, 3.35e12, 79.6, 2.50, _H100 + " (SXM)"),
    Device("H100-PCIe", 756e12, 51e12, 2.0e12, 79.6, 2.20, _H100 + " (PCIe)"),
    Device("H200", 989e12, 67e12, 4.8e12, 140.4, 3.50, _H200),
    Device("L40S", 362e12, 91.6e12, 0.864e12, 45.0, 1.00, "NVIDIA L40S datasheet"),
    # 48 GB GDDR6 (46,068 MiB reported); the 48 GB GPU of the MoE fine-tuning cost study
    Device("A40", 149.7e12, 37.4e12, 0.696e12, 44.99, 0.80, "NVIDIA A40 datasheet"),
    Device("B200", 2250e12, 75e12, 8.0e12, 179.0, 5.00, "NVIDIA DGX B200 datasheet (per GPU)"),
]}
_ALIASES = {"A100": "A100-80GB", "A100-40G": "A100-40GB", "A100-80G": "A100-80GB",
            "H100": "H100-SXM", "H100-80GB": "H100-SXM", "H200-141GB": "H200"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def get_device(name: str) -> Device:
    """A GPU from the table by name or alias (case-insensitive), or ``cpu`` (this CPU's machine
    profile: measured once, then read back, :func:`cpu_device`)."""
    if name.lower() == "cpu":
        return cpu_device()
    key = {k.lower(): k for k in GPUS}.get(name.lower()) or {
        k.lower(): v for k, v in _ALIASES.items()}.get(name.lower())
    if key is None:
        raise ArchsearchError("device", f"unknown device {name!r}",
                              f"known: {', '.join(list(GPUS) + ['cpu'])}")
    return GPUS[key]


def device_key(name: str) -> str:
    """The device table's name for ``name`` (``cpu`` as is: no peak measurement just to compare names)."""
    return "cpu" if name.lower() == "cpu" else get_device(name).name


def detect_gpu_name(cuda_name: str) -> str | None:
    """Map ``torch.cuda.get_device_name()`` (e.g. 'NVIDIA H100 80GB HBM3') to a table entry."""
    n = cuda_name.upper()
    if "H200" in n:
        return "H200"
    if "H100" in n:
        return "H100-PCIe" if "PCIE" in n else "H100-SXM"
    if "A100" in n:
        return "A100-40GB" if "40G" in n else "A100-80GB"
    if "L40S" in n:
        return "L40S"
    if "B200" in n:
        return "B200"
    return None


# a GPU driver's device nodes (NVIDIA's, AMD's ROCm, WSL's): torch sees a CUDA device only where one exists
GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def torch_may_see_a_gpu() -> bool:
    """Whether only torch can tell if a CUDA GPU is here: it is loaded already (asking is free), or a
    GPU driver's device node exists. Where neither, there is none, and asking would load torch for
    it (~3 s of CPU on 2 cores, in processes that need torch for nothing else)."""
    return "torch" in sys.modules or any(os.path.exists(p) for p in GPU_NODES)


def local_device_name() -> str | None:
    """The device this process would measure on: the first CUDA GPU's table name (None when
    it is not in the table), or ``cpu`` where there is no CUDA GPU."""
    if not torch_may_see_a_gpu():
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return detect_gpu_name(torch.cuda.get_device_name(0))
    return "cpu"


@functools.lru_cache(maxsize=1)
def host_memory_bytes() -> float:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def measure_gpu(n: int = 8192, repeats: int = 10) -> Device:
    """This GPU's bf16 and fp32 matmul FLOP/s and device copy bandwidth, measured with torch.

    The mean of ``repeats`` timed ``n``x``n``x``n`` products on random data after three warm-ups,
    so GPU MFU is measured against what a dense matmul reaches on this card.
    """
    import torch

    if not torch.cuda.is_available():
        raise ArchsearchError("device", "measure_gpu needs a CUDA GPU and none is visible",
                              "run on a machine with a GPU, or measure the CPU (measure_cpu)")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def matmul_flops(dtype) -> float:
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(3):
            torch.mm(a, b)
        start.record()
        for _ in range(repeats):
            torch.mm(a, b)
        end.record()
        torch.cuda.synchronize()
        return 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3)

    bf16 = matmul_flops(torch.bfloat16)
    fp32 = matmul_flops(torch.float32)  # as torch runs it by default (TF32 off unless asked)
    x = torch.empty(2**30, device="cuda", dtype=torch.uint8)  # 1 GiB, far beyond L2
    y = torch.empty_like(x)
    y.copy_(x)
    start.record()
    for _ in range(repeats):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    bandwidth = 2 * x.numel() * repeats / (start.elapsed_time(end) / 1e3)  # read + write
    props = torch.cuda.get_device_properties(0)
    return Device(name=torch.cuda.get_device_name(0), peak_flops_bf16=bf16, peak_flops_fp32=fp32,
                  memory_bandwidth=bandwidth, memory_gib=props.total_memory / 2**30, price_per_hour=None,
                  source=f"measured here: torch bf16 and fp32 {n}x{n}x{n} matmuls, mean of {repeats} after "
                         f"3 warm-ups (CUDA events), and a 1 GiB device copy",
                  measured=True)


def cpu_profile_path() -> Path:
    """This machine's CPU profile: ``$ARCHSEARCH_CACHE`` (or ``~/.cache/archsearch``)
    ``/machine/cpu-<host>-<threads>t.json`` (the peak depends on torch's thread count)."""
    import torch

    root = Path(os.environ["ARCHSEARCH_CACHE"]) if os.environ.get("ARCHSEARCH_CACHE") else \
        Path.home() / ".cache" / "archsearch"
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in platform.node() or "host")
    return root / "machine" / f"cpu-{host}-{torch.get_num_threads()}t.json"


def cpu_device() -> Device:
    """This CPU's entry, measured once (:func:`measure_cpu`) into a machine profile
    (:func:`cpu_profile_path`) and read back from it: a prediction for ``cpu`` is then a
    deterministic function of its inputs instead of moving with the load of the moment. The entry's
    ``source`` names the file and when it was measured; delete the file to measure again."""

    path = cpu_profile_path()

    def stored() -> Device | None:
        try:
            d = json.loads(path.read_text())
            return Device(**d["device"]) if d.get("cpu") == cpu_name() else None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, or from another CPU or version: measured afresh
    dev = stored()
    if dev is not None:
        return dev
    dev = measure_cpu()
    again = stored()  # another process measured meanwhile: one profile for all
    if again is not None:
        return again
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    dev = Device(**{**dev.__dict__, "source": f"{dev.source}; measured {when} into the machine profile {path} "
                                              "(read back since; delete it to measure again)"})

    write_json(path, {"cpu": cpu_name(), "measured_utc": when, "device": dev.to_dict()})
    return dev


def measure_cpu(n: int = 1024, repeats: int = 5) -> Device:
    """This CPU's fp32 matmul FLOP/s and copy bandwidth, measured with torch (best of runs).

    The matmul peak is what a model can reach here, so MFU on CPU is measured against it.
    """
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    flops = 2 * n**3 / best
    x = torch.empty(32 * 2**20)  # 128 MiB of fp32, well beyond the caches
    y = torch.empty_like(x)
    y.copy_(x)
    best_bw = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        y.copy_(x)
        best_bw = min(best_bw, time.perf_counter() - t)
    bandwidth = 2 * x.numel() * 4 / best_bw  # read + write
    mem_gib = host_memory_bytes() / 2**30
    return Device(name="cpu", peak_flops_bf16=flops, peak_flops_fp32=flops,
                  memory_bandwidth=bandwidth, memory_gib=mem_gib, price_per_hour=None,
                  source=f"measured here: torch fp32 {n}x{n} matmul and a 128 MiB copy, "
                         f"best of {repeats}, {torch.get_num_threads()} threads",
                  measured=True)

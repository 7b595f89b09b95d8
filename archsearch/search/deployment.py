"""A deployment target (``measure.targets``): one place the model will serve, and the ``measure``
block it is measured with (the study's, with the target's device, engine, lengths and batches)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from archsearch.benchmarks.base import backend_class
from archsearch.benchmarks.workloads import ObjectiveWords, get_workload, objective_words
from archsearch.errors import ArchsearchError
from archsearch.fileio import check_name
from archsearch.hardware import device_key

AGGREGATES = ("worst", "geomean")


@dataclass(frozen=True)
class DeploymentTarget:
    """One place the model will serve. Unset fields take the ``measure`` block's value (dtype,
    repeats, the paired settings and the rest always do); ``batch_size`` is the target's
    objective batch (default: the largest of ``batch_sizes``; alone, the only one measured). With
    ``workload`` the preset sets the batching, lengths, backend and objective (:attr:`objective`)."""

    name: str
    backend: str | None = None
    device_spec: str | None = None
    calibration: str | None = None  # a roofline calibration of this device (and engine), analytic targets
    batch_sizes: list[int] | None = None
    batch_size: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    weight: float = 1.0
    # a deployment workload preset (archsearch.benchmarks.workloads: offline-4k-1k, chat, long-context,
    # single-stream): its batching, lengths (the target's input_len/output_len/batch_size override them),
    # backend (simulated online, the analytic roofline offline: predictions) and objective
    workload: str | None = None

    def __post_init__(self) -> None:
        check_name("name", self.name)
        if self.workload is not None:
            try:
                w = get_workload(self.workload)
            except ArchsearchError as e:
                raise ArchsearchError("workload", e.problem, e.fix) from None
            if self.backend is not None and self.backend != w.backend:
                raise ArchsearchError("backend", f"workload {w.name} is predicted by the {w.backend} backend; "
                                      f"a target's workload is not served with {self.backend}",
                                      f"drop backend (or write backend: {w.backend}) to predict it; to measure "
                                      f"{self.backend} online, drop workload and set measure.mode: online with "
                                      "measure.rate and measure.slo (docs/search.md, \"Online measurement\")")
        if self.backend is not None:
            backend_class(self.backend)  # a registered backend, or an error naming the field
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not (math.isfinite(self.weight) and self.weight > 0):
            raise ArchsearchError("weight", f"must be a positive number, got {self.weight!r}", "e.g. 1.0")
        if self.batch_size is not None and (isinstance(self.batch_size, bool) or self.batch_size <= 0):
            raise ArchsearchError("batch_size", f"must be a positive integer, got {self.batch_size!r}")
        if self.batch_sizes is not None and self.batch_size is not None and self.batch_size not in self.batch_sizes:
            raise ArchsearchError("batch_size", f"{self.batch_size} is not among batch_sizes {self.batch_sizes}",
                                  "add it to batch_sizes, or give only one of the two")
        if self.device_spec is not None:
            try:
                device_key(self.device_spec)
            except ArchsearchError as e:
                raise ArchsearchError("device_spec", e.problem, e.fix) from None
        if self.calibration is not None and self.backend not in (None, "analytic", "simulated"):
            raise ArchsearchError("calibration", f"a {self.backend} target is measured, not predicted",
                                  "drop calibration, or set backend: analytic to predict this target")


def target_objective(t: DeploymentTarget) -> str:
    """What the target's ratio to the baseline compares: its workload's objective, else output tokens/s."""
    if t.workload is None:
        return "throughput"
    return get_workload(t.workload).objective


def study_objective(cfg) -> ObjectiveWords:
    """What a study's ratios compare, in the words its figures and report use: its targets' objective
    (one shared by all; ``mixed`` where they differ), else an online study's ``measure.objective``, else
    output tokens/s."""
    m = cfg.measure
    if m.targets:
        objectives = {target_objective(t) for t in m.targets}
        if len(objectives) > 1:
            return objective_words("mixed")
        (objective,) = objectives
        slo = next((get_workload(t.workload).slo for t in m.targets if t.workload is not None), None)
        return objective_words(objective, slo)
    return objective_words(m.objective, m.slo if m.online else None)


def check_deployment_targets(measure) -> None:
    """The ``measure.targets`` list as a whole (each target checked itself at load): unique names,
    and every target valid as a ``measure`` block of its own (its calibration fitted on its device
    and engine, its lengths and batch sizes measurable). Errors name ``targets[i].field``."""
    targets = measure.targets
    if targets is None:
        return
    if not targets:
        raise ArchsearchError("targets", "is empty", "name at least one target, or leave measure.targets out")
    seen: dict[str, int] = {}
    for i, t in enumerate(targets):
        if t.name in seen:
            raise ArchsearchError(f"targets[{i}].name", f"{t.name!r} is also the name of targets[{seen[t.name]}]",
                                  "give every target its own name")
        seen[t.name] = i
        try:
            target_measure(measure, t)
        except ArchsearchError as e:
            name = e.field.removeprefix("measure.")
            name = {"reference_batch_size": "batch_size"}.get(name, name)
            raise ArchsearchError(f"targets[{i}].{name}", e.problem, e.fix) from None


def target_measure(measure, t: DeploymentTarget):
    """The ``measure`` block this target measures with: the study's, with the target's device,
    engine, calibration, batch sizes and lengths (a calibration is never inherited: the study's
    belongs to another device or engine)."""
    b = measure.bench
    if t.workload is not None:
        base = dataclasses.replace(b, device_spec=t.device_spec if t.device_spec is not None else b.device_spec,
                                   batch_sizes=[t.batch_size] if t.batch_size is not None else list(b.batch_sizes))
        bench = get_workload(t.workload).apply(base, t.calibration, t.batch_size, t.input_len, t.output_len)
        return dataclasses.replace(measure, bench=bench, targets=None, calibration=t.calibration,
                                   reference_batch_size=bench.batch_sizes[0], objective=target_objective(t))
    batch_sizes = list(t.batch_sizes) if t.batch_sizes is not None else (
        [t.batch_size] if t.batch_size is not None else list(b.batch_sizes))
    ref = t.batch_size if t.batch_size is not None else (
        measure.reference_batch_size if t.batch_sizes is None and measure.reference_batch_size in batch_sizes
        else None)
    bench = dataclasses.replace(
        b, backend=t.backend or b.backend, device_spec=t.device_spec if t.device_spec is not None else b.device_spec,
        batch_sizes=batch_sizes, input_len=b.input_len if t.input_len is None else t.input_len,
        output_len=b.output_len if t.output_len is None else t.output_len)
    return dataclasses.replace(measure, bench=bench, targets=None, calibration=t.calibration, reference_batch_size=ref)

"""Deployment workloads: named presets of how a model is served, each with its objective.

A workload fixes the lengths, the batching (an offline static batch, or requests arriving at a rate and
batched continuously by the serving simulator) and what a target optimises: ``throughput`` (output
tokens/s of the static batch, higher is better), ``goodput`` (requests/s whose TTFT and TPOT both meet
the SLO, higher is better) or ``latency`` (end-to-end seconds of one request, lower is better).
:meth:`Workload.score` turns every objective into a higher-is-better figure, so a ratio to the
baseline reads the same way for all of them.

    w = get_workload("chat")
    settings = w.bench_settings(device_spec="H200", calibration="configs/calibration/h200-sglang.json")
    score = w.score(measure(spec, settings).per_batch[0])

The figures a target gets from an ``analytic`` or ``simulated`` backend are predictions (labelled so in
their records); the presets' rates and SLOs are starting points for a ~1B model on one H200, meant to be
overridden (``Workload.with_overrides``) for another model, device or service level.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from archsearch.errors import ArchsearchError
from archsearch.benchmarks.base import BatchResult, BenchSettings
from archsearch.benchmarks.simulator import SLO

OBJECTIVES = ("throughput", "goodput", "latency")


@dataclass(frozen=True)
class Workload:
    """One way of serving: lengths, batching and the objective a target optimises."""

    name: str
    description: str
    objective: str
    input_len: int
    output_len: int
    batch_size: int | None = None  # a static batch (None: the target's own batch size)
    rate: float | None = None  # requests/s, Poisson arrivals, simulated online (None: offline static batch)
    n_requests: int | None = None  # requests simulated at ``rate``
    max_num_seqs: int = 256  # the engine's scheduler limits, online
    max_num_batched_tokens: int = 8192
    slo: SLO | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ArchsearchError(f"workload {self.name}: objective", f"{self.objective!r} is unknown",
                                  f"use one of {list(OBJECTIVES)}")
        online = self.rate is not None
        if self.objective == "goodput" and not (online and self.slo is not None):
            raise ArchsearchError(f"workload {self.name}: slo", "goodput needs a rate and an slo: {ttft_s, tpot_s}",
                                  "give both, or use objective: throughput")
        if online and not (isinstance(self.rate, (int, float)) and math.isfinite(self.rate) and self.rate > 0):
            raise ArchsearchError(f"workload {self.name}: rate", f"must be a positive number, got {self.rate!r}",
                                  "requests per second, e.g. 32")
        if online and not self.n_requests:
            raise ArchsearchError(f"workload {self.name}: n_requests", "an online workload needs a request count",
                                  "e.g. n_requests: 500")

    @property
    def online(self) -> bool:
        return self.rate is not None

    @property
    def backend(self) -> str:
        """``simulated`` for an online workload, ``analytic`` (the calibrated static batch) otherwise."""
        return "simulated" if self.online else "analytic"

    def with_overrides(self, **changes: Any) -> "Workload":
        """This preset with some fields changed (``slo`` may be a ``{ttft_s, tpot_s}`` dict)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ArchsearchError(f"workload {self.name}", f"unknown fields {sorted(unknown)}",
                                  f"use {[f.name for f in dataclasses.fields(self)]}")
        if isinstance(changes.get("slo"), dict):
            changes["slo"] = SLO(**changes["slo"])
        return dataclasses.replace(self, **changes)

    def bench_settings(self, device_spec: str, calibration: str | None = None, batch_size: int | None = None,
                       dtype: str = "bfloat16") -> BenchSettings:
        """The ``bench`` settings that predict this workload on one device (and engine, by its
        calibration); ``batch_size`` is the static batch where the workload leaves it to the target."""
        batch = self.batch_size or batch_size
        if not self.online and batch is None:
            raise ArchsearchError(f"workload {self.name}: batch_size", "an offline workload needs a batch size",
                                  "give the target's batch_size")
        engine_args: dict[str, Any] = {"calibration": calibration} if calibration else {}
        if self.online:
            engine_args.update(rate=self.rate, n_requests=self.n_requests,
                               max_num_batched_tokens=self.max_num_batched_tokens)
            if self.slo is not None:
                engine_args["slo"] = dataclasses.asdict(self.slo)
            batch = self.max_num_seqs  # the simulated backend's batch size is the engine's max_num_seqs
        return BenchSettings(backend=self.backend, batch_sizes=[batch], input_len=self.input_len,
                             output_len=self.output_len, dtype=dtype, device_spec=device_spec,
                             engine_args=engine_args, warmup=0, repeats=1)

    def score(self, batch: BatchResult) -> float:
        """The objective as a higher-is-better figure (:func:`objective_score`)."""
        return objective_score(self.objective, batch, f"workload {self.name}")

    def apply(self, bench: BenchSettings, calibration: str | None = None, batch_size: int | None = None,
              input_len: int | None = None, output_len: int | None = None) -> BenchSettings:
        """``bench`` (a target's settings: its device, dtype, timeout) serving this workload: the workload's
        backend, batching and lengths (``input_len``/``output_len``/``batch_size`` given: the target's own,
        overriding the preset's)."""
        w = self.with_overrides(**{k: v for k, v in (("input_len", input_len), ("output_len", output_len))
                                   if v is not None})
        if batch_size is not None and not w.online:
            w = w.with_overrides(batch_size=batch_size)
        s = w.bench_settings(bench.device_spec or "cpu", calibration, batch_size=max(bench.batch_sizes),
                             dtype=bench.dtype)
        return dataclasses.replace(bench, backend=s.backend, batch_sizes=s.batch_sizes, input_len=s.input_len,
                                   output_len=s.output_len, engine_args={**bench.engine_args, **s.engine_args},
                                   warmup=0, repeats=1)


def objective_score(objective: str, batch: BatchResult, where: str = "objective") -> float:
    """An objective as a higher-is-better figure of one batch's record: output tokens/s (``throughput``),
    requests/s meeting the SLO (``goodput``), or 1 / end-to-end seconds (``latency``)."""
    if not batch.ok:
        raise ArchsearchError(where, f"the batch failed: {batch.error}", "see the record")
    if objective == "throughput":
        return float(batch.output_throughput)
    if objective == "goodput":
        if not batch.online or batch.online.get("goodput") is None:
            raise ArchsearchError(where, "the record holds no goodput",
                                  "serve it online (backend: simulated) with an slo")
        return float(batch.online["goodput"])
    if objective == "latency":
        return 1.0 / float(batch.e2e_latency_mean)
    raise ArchsearchError(where, f"objective {objective!r} is unknown", f"use one of {list(OBJECTIVES)}")


@dataclass(frozen=True)
class ObjectiveWords:
    """How every figure, report line and table column names what a study's ratios compare (read from
    the study's own objective once, :func:`objective_words`; ``search.deployment.study_objective``):
    no axis or column of a goodput or latency study says throughput."""

    objective: str  # throughput | goodput | latency | mixed (targets of several objectives)
    name: str  # the noun of titles: "<name> vs predicted loss"
    meaning: str  # what the figure is, in words (the SLO written out)
    column: str  # a table column of one shape's figure, with its unit
    ratio: str  # an axis of a ratio to the baseline (higher is better for every objective)
    better: str  # a ratio above 1 reads "significantly <better>"
    worse: str

    def shown(self, score: float | None) -> float | None:
        """A shape's figure as its column states it: latency in seconds (the score is 1 / seconds)."""
        if score is None or self.objective != "latency":
            return score
        return 1.0 / score if score else None

    def unit(self) -> str:
        """The unit of one shape's figure (``text``), in words."""
        return {"goodput": "requests/s meeting the SLO", "latency": "s of end-to-end latency",
                "mixed": "(each target's own objective)"}.get(self.objective, "output tokens/s")

    def text(self, score: float | None) -> str:
        """One shape's figure as its column states it (``shown``), formatted; ``-`` where there is none."""
        v = self.shown(score)
        if not isinstance(v, (int, float)):
            return "-"
        return f"{v:.1f}" if self.objective == "throughput" else f"{v:.3g}"


def objective_words(objective: str, slo: Any = None) -> ObjectiveWords:
    """The words of one objective (``slo``: an :class:`SLO` or its dict, written into goodput's);
    ``mixed`` for targets whose objectives differ, each ratio its own target's objective."""
    if objective == "throughput":
        return ObjectiveWords("throughput", "throughput", "output tokens/s", "tokens/s", "throughput / baseline's",
                              "faster", "slower")
    if objective == "goodput":
        s = dataclasses.asdict(slo) if isinstance(slo, SLO) else (slo or {})
        within = (f"TTFT <= {s['ttft_s']:g} s and TPOT <= {s['tpot_s'] * 1e3:g} ms" if s.get("ttft_s") is not None
                  else "the SLO")
        return ObjectiveWords("goodput", "goodput", f"goodput (requests/s with {within})", "goodput req/s",
                              "goodput / baseline's (requests/s within the SLO)", "better", "worse")
    if objective == "latency":
        return ObjectiveWords("latency", "latency", "1 / mean end-to-end latency", "latency s (lower is better)",
                              "baseline's latency / shape's (speed-up of one request)", "faster", "slower")
    if objective == "mixed":
        return ObjectiveWords("mixed", "score", "each target's own objective", "score",
                              "ratio to the baseline (each target's objective)", "better", "worse")
    raise ArchsearchError("objective", f"{objective!r} is unknown", f"use one of {list(OBJECTIVES)}")


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("offline-4k-1k", "the paper's reference: a static batch of 4096-token prompts generating 1024 tokens "
             "(docs/method.md section 5)", "throughput", 4096, 1024),
    Workload("chat", "online chat: 1024-token prompts, 256-token answers, Poisson arrivals at 48 requests/s, "
             "continuous batching; goodput under TTFT <= 1 s and TPOT <= 10 ms (100 tokens/s per user)",
             "goodput", 1024, 256, rate=48.0, n_requests=500, slo=SLO(ttft_s=1.0, tpot_s=0.010)),
    Workload("long-context", "a static batch of 32K-token prompts generating 1024 tokens: KV-cache bytes per "
             "token set decode speed and how many sequences fit", "throughput", 32768, 1024),
    Workload("single-stream", "one request at a time (on-device, agents): 4096-token prompt, 1024 tokens out; "
             "end-to-end latency", "latency", 4096, 1024, batch_size=1),
)}


def get_workload(name: str) -> Workload:
    """A preset by name, or an error naming the known ones."""
    if name not in WORKLOADS:
        raise ArchsearchError("workload", f"unknown workload {name!r}", f"use one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]

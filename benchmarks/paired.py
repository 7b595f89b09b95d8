"""Paired, interleaved measurement: shapes compared in the same time window.

On a shared machine the load drifts by 2x within minutes, so two throughputs measured minutes
apart compare the load, not the shapes. Here every shape of a group (the reference first)
gets its engine started once in ONE child process and kept resident; then rounds run: in each
round every engine generates one timed static batch of fresh prompts, in an order that
reverses every round (A B, B A, ...) so a linear drift cancels within two rounds. Each
round gives one paired ratio per shape (its throughput over the reference's in that round);
the estimate is the geometric mean of the per-round ratios with a Student-t interval on their
logs. Rounds go on until every ratio's interval half-width (relative) is under
``rel_halfwidth`` or ``max_rounds`` is spent (sequential stopping; the stopping rule makes
the nominal level slightly optimistic, which the test-retest benchmark checks).

Rounds average out what changes from round to round, not what belongs to an engine instance:
two engines of the same model in one process differ by a few percent for as long as they
live (memory placement, thread affinity), so every ratio also carries its two engines'
instance effects. With ``twin`` a second engine of the reference joins every group (the last
shape): ratios are then taken over the two reference engines' geometric mean, and the twin's
ratio to the reference measures the instance spread. Pooled over groups
(:func:`instance_variance`), it widens every interval by the variance no number of rounds
removes (method section 5).

Only engines that run isolated (vLLM, SGLang, transformers) are measured this way; the
analytic roofline is deterministic and its ratio has a zero-width interval.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe, write_hf_config
from archsearch.bounds import check_count
from archsearch.configio import KEY, PlainData
from archsearch.errors import ArchsearchError
from archsearch.provenance import provenance
from archsearch.benchmarks.base import (BACKENDS, BatchResult, BenchSettings, Report, get_backend,
                                        load_backend, mean, std)
from archsearch.benchmarks.isolate import run_isolated
from archsearch.benchmarks.engine_loop import PromptSource
from archsearch.benchmarks.measure import check_lengths, measure
from archsearch.benchmarks.scratch import scratch_dir
from archsearch.benchmarks.workloads import objective_score


@dataclass(frozen=True)
class PairedSettings:
    """How long to compare: at least ``min_rounds`` rounds, at most ``max_rounds``, stopping
    once every ratio's ``level`` interval is within ``rel_halfwidth`` of it."""

    # marked KEY: these key a study's stored paired measurement (configio.key_values)
    level: float = field(default=0.9, metadata=KEY)
    rel_halfwidth: float = field(default=0.03, metadata=KEY)
    min_rounds: int = field(default=4, metadata=KEY)
    max_rounds: int = field(default=16, metadata=KEY)
    # a second engine of the reference in every group (module docstring)
    twin: bool = field(default=False, metadata=KEY)
    # sd of one engine instance's log-throughput effect, known from an earlier measurement on this
    # machine (``bench_test_retest`` prints it as ``instance_sd_between_passes``): added to every
    # interval where no twin measures it (with ``twin``, the twins' pooled estimate replaces it);
    # not keyed: it widens intervals computed when a result is read, and changes no measurement
    instance_sd: float = 0.0

    def __post_init__(self) -> None:
        if not 0.5 <= self.level < 1:
            raise ArchsearchError("level", f"must be in [0.5, 1), got {self.level}", "e.g. 0.9")
        if not 0 < self.rel_halfwidth < 1:
            raise ArchsearchError("rel_halfwidth", f"must be in (0, 1), got {self.rel_halfwidth}",
                                  "e.g. 0.03 (stop at a +-3% interval)")
        if not 0 <= self.instance_sd < 1:
            raise ArchsearchError("instance_sd", f"must be in [0, 1), got {self.instance_sd}",
                                  "e.g. 0.015 (engines of one shape differ by ~1.5% for their life)")
        if not 2 <= self.min_rounds <= self.max_rounds:
            raise ArchsearchError("min_rounds", f"need 2 <= min_rounds <= max_rounds, got "
                                  f"{self.min_rounds} and {self.max_rounds}")
        check_count("max_rounds", self.max_rounds, "rounds")


@dataclass(frozen=True)
class RatioEstimate:
    """Throughput of a shape over the reference's: geometric mean of paired per-round ratios
    and its two-sided ``level`` interval."""

    ratio: float
    lo: float
    hi: float
    level: float
    n: int
    # a deterministic prediction (the analytic backend): no noise, so its "interval" is a point and
    # carries no significance; reports label it a prediction and state neither
    predicted: bool = False

    @property
    def rel_halfwidth(self) -> float:
        return (self.hi - self.lo) / 2 / self.ratio

    @property
    def faster(self) -> bool:
        """Significantly faster than the reference (interval above 1)."""
        return self.lo > 1.0

    @property
    def slower(self) -> bool:
        """Significantly slower than the reference (interval below 1)."""
        return self.hi < 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "significantly_faster": self.faster, "significantly_slower": self.slower}


def ratio_estimate(ref: list[float], other: list[float], level: float = 0.9,
                   extra_var: float = 0.0) -> RatioEstimate:
    """Paired ratio of ``other`` over ``ref`` (same-round throughputs) with a t interval on
    the per-round log ratios, widened by ``extra_var`` (a variance of the log ratio that the
    rounds do not see: the engines' instance effects). Identical pairs give a zero-width
    interval."""
    from scipy.special import stdtrit

    if len(ref) != len(other) or not ref:
        raise ValueError("paired series must be non-empty and of equal length")
    logs = [math.log(o / r) for r, o in zip(ref, other)]
    m = sum(logs) / len(logs)
    if len(logs) < 2:
        return RatioEstimate(math.exp(m), 0.0, math.inf, level, len(logs))
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / (len(logs) - 1))
    h = float(stdtrit(len(logs) - 1, 0.5 + level / 2)) * math.sqrt(sd ** 2 / len(logs) + extra_var)
    return RatioEstimate(math.exp(m), math.exp(m - h), math.exp(m + h), level, len(logs))


def _log_mean_and_var(ref: list[float], other: list[float]) -> tuple[float, float]:
    """Mean of the per-round log ratios and its squared standard error."""
    logs = [math.log(o / r) for r, o in zip(ref, other)]
    m = sum(logs) / len(logs)
    return m, sum((x - m) ** 2 for x in logs) / (len(logs) - 1) / len(logs)


def instance_variance(results: list[PairedResult]) -> tuple[float, int]:
    """(variance of one engine instance's log-throughput effect, groups it rests on), pooled
    over the twin groups among ``results``: each twin's mean log ratio to its reference ``d``
    has variance ``2 s2 + se2``, so ``s2 = mean(d^2 - se2) / 2`` (moments, floored at 0)."""
    parts = []
    for r in results:
        if r.ok and r.twin and len(r.rounds) >= 2:
            d, se2 = _log_mean_and_var(r.series(0), r.series(len(r.specs) - 1))
            parts.append(d * d - se2)
    if not parts:
        return 0.0, 0
    return max(0.0, sum(parts) / len(parts) / 2), len(parts)


def instance_var_or_prior(results: list[PairedResult], p: PairedSettings) -> float:
    """The engine-instance variance to add to intervals: the twins' pooled estimate where any
    twin group is among ``results``, else the configured ``p.instance_sd`` squared."""
    pooled, n = instance_variance(results)
    return pooled if n else p.instance_sd ** 2


def _score(r, batch_size: int, objective: str) -> float | None:
    """A predicted result's figure of ``objective`` at ``batch_size`` (None: the batch failed)."""
    b = next((b for b in r.per_batch if b.batch_size == batch_size and b.ok), None)
    if b is None:
        return None
    return objective_score(objective, b) if objective != "throughput" else r.throughput(batch_size)


@dataclass
class PairedResult(PlainData):
    """Per-round output throughputs (rounds x shapes, shape 0 the reference) and what the
    child recorded. ``ok`` is False when fewer than two rounds finished. Stored as JSON with
    the derived ``ratios`` beside it (recomputed on load, not read)."""

    specs: list[dict[str, Any]]
    rounds: list[list[float]]
    settings: dict[str, Any]
    paired: dict[str, Any]
    batch_size: int
    ok: bool = True
    error: str | None = None
    stop_reason: str | None = None
    ttft: list[float | None] = field(default_factory=list)
    device: str | None = None
    dtype: str | None = None
    engines: list[dict[str, Any]] = field(default_factory=list)
    timing: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    predicted: bool = False
    # measured online (archsearch.benchmarks.online.measure_paired_online): the load, SLO and objective,
    # and every round's serving metrics per shape (``rounds[k][i]``); empty for a static-batch comparison
    online: dict[str, Any] = field(default_factory=dict)

    @property
    def twin(self) -> bool:
        """The group's last shape is a second engine of the reference (``PairedSettings.twin``)."""
        return bool(self.paired.get("twin")) and len(self.specs) >= 3

    def series(self, i: int) -> list[float]:
        return [r[i] for r in self.rounds]

    def ref_series(self) -> list[float]:
        """The reference's throughput per round: with a twin, the two reference engines'
        geometric mean."""
        if not self.twin:
            return self.series(0)
        return [math.sqrt(r[0] * r[-1]) for r in self.rounds]

    def estimate(self, i: int, ref: int = 0, instance_var: float = 0.0) -> RatioEstimate:
        """Shape ``i`` over shape ``ref`` (any two shapes of the group are paired; ``ref`` 0 is
        the reference, over both its engines with a twin). ``instance_var``
        (:func:`instance_variance`) widens the interval by both sides' engine-instance effects."""
        if ref == 0:
            est = ratio_estimate(self.ref_series(), self.series(i), self.paired["level"],
                                 instance_var * (1 + (0.5 if self.twin else 1.0)))
        else:
            est = ratio_estimate(self.series(ref), self.series(i), self.paired["level"], 2 * instance_var)
        return replace(est, predicted=self.settings.get("backend") == "analytic")

    def pair(self, i: int, fixed: int = 0) -> PairedResult:
        """The reference and shape ``i`` alone (and the twin), or with the ``fixed`` shapes that
        follow the reference (columns 1 to ``fixed``): their columns of every round (paired
        data, as if compared by themselves, with the group's stopping rule)."""
        cols = [0, *range(1, fixed + 1), i] + ([len(self.specs) - 1] if self.twin else [])
        pick = lambda xs: [xs[c] for c in cols] if len(xs) == len(self.specs) else xs  # noqa: E731
        return replace(self, specs=pick(self.specs), rounds=[pick(r) for r in self.rounds], ttft=pick(self.ttft),
                       engines=pick(self.engines),
                       timing={**self.timing, "engine_start_s": pick(self.timing.get("engine_start_s") or []),
                               "group_size": len(self.specs)},
                       provenance={**self.provenance,
                                   "architectures": pick(self.provenance.get("architectures") or [])},
                       online={**self.online, "rounds": [pick(r) for r in self.online["rounds"]]}
                       if self.online.get("rounds") else self.online)

    def throughput(self, i: int) -> float | None:
        return mean(self.series(i)) if self.rounds else None

    def batch_result(self, i: int):
        """Shape ``i``'s rounds as a ``BatchResult`` at the paired batch size (what limits read)."""
        xs = self.series(i)
        return BatchResult(batch_size=self.batch_size, ok=self.ok and bool(xs), error=self.error,
                           output_throughput=mean(xs), output_throughput_std=std(xs),
                           ttft_mean=self.ttft[i] if i < len(self.ttft) else None,
                           repeats=[{"output_throughput": x} for x in xs])

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if self.ok:
            d["ratios"] = [self.estimate(i).to_dict() for i in range(len(self.specs))]
        return d


def paired_stop(rounds: list[list[float]], p: PairedSettings) -> str | None:
    n = len(rounds)
    if n >= p.min_rounds:
        shapes = len(rounds[0]) - (1 if p.twin else 0)
        ref = [math.sqrt(r[0] * r[-1]) if p.twin else r[0] for r in rounds]
        worst = max(ratio_estimate(ref, [r[i] for r in rounds], p.level).rel_halfwidth
                    for i in range(1, shapes))
        if worst <= p.rel_halfwidth:
            return f"every {p.level:.0%} interval within +-{p.rel_halfwidth:.1%} after {n} rounds"
    if n >= p.max_rounds:
        return f"round budget spent ({p.max_rounds} rounds)"
    return None


class PairedRunner:
    """Runs in the isolated child: opens every shape's engine session, then interleaved rounds."""

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        s, p = job["settings"], PairedSettings(**job["paired"])
        b = job["batch_size"]
        backend = load_backend(job["inner_backend_class"])
        def quiet(_partial: dict) -> None:  # the group reports once per round instead
            pass
        sessions = []
        for arch, model_dir in zip(job["archs"], job["model_dirs"]):
            sub = {**job, "arch": arch, "model_dir": model_dir, "batch_sizes": [b]}
            sessions.append(backend.open(sub, quiet))
        vocab = min(x.vocab_size for x in sessions)
        prompts = PromptSource(vocab, s["input_len"], s["seed"])
        head = {"device": sessions[0].device, "dtype": sessions[0].dtype,
                "engines": [x.engine for x in sessions], "timing": {"engine_start_s": [
                    x.timing.get("engine_start_s") for x in sessions]}}
        for x in sessions:
            for _ in range(s["warmup"]):
                x.generate(prompts.batch(b))
        rounds: list[list[float]] = []
        ttfts: list[list[float]] = [[] for _ in sessions]
        t0 = time.perf_counter()
        while True:
            order = list(range(len(sessions)))
            if len(rounds) % 2:
                order.reverse()
            row = [0.0] * len(sessions)
            for i in order:
                batch = prompts.batch(b)
                t = time.perf_counter()
                timings = sessions[i].generate(batch)
                wall = time.perf_counter() - t
                n_out = sum(x.n_output for x in timings)
                if len(timings) != b or n_out != b * s["output_len"]:
                    raise RuntimeError(f"engine produced {n_out} tokens for {len(timings)} requests, "
                                       f"expected {b} x {s['output_len']}")
                row[i] = n_out / wall
                ttfts[i] += [x.ttft for x in timings if x.ttft is not None]
            rounds.append(row)
            why = paired_stop(rounds, p)
            report({**head, "rounds": rounds, "ttft": [mean(t) for t in ttfts]})
            if why:
                break
        head["timing"]["rounds_s"] = time.perf_counter() - t0
        return {**head, "rounds": rounds, "ttft": [mean(t) for t in ttfts], "stop_reason": why}


def measure_paired(specs: list[ArchSpec], settings: BenchSettings, paired: PairedSettings,
                   batch_size: int, log_path: str | Path | None = None,
                   backend_class: str | None = None, objective: str = "throughput") -> PairedResult:
    """Compare ``specs`` (the first is the reference) at ``batch_size`` with paired,
    interleaved rounds in one engine process. Failures come back as ``ok=False``. ``objective``
    (:data:`archsearch.benchmarks.workloads.OBJECTIVES`, predictions only): what a round holds, output
    tokens/s or, for a deployment workload, goodput or 1 / latency (``settings['objective']`` records it)."""
    if len(specs) < 2:
        raise ArchsearchError("specs", "paired measurement needs a reference and at least one shape")
    if paired.twin:
        specs = [*specs, specs[0]]
    for sp in specs:
        check_lengths(sp, settings)
    backend = get_backend(settings.backend)
    backend.check_available()
    res = PairedResult(specs=[sp.to_dict() for sp in specs], rounds=[], settings=settings.to_dict(),
                       paired=asdict(paired), batch_size=batch_size)
    if objective != "throughput":
        if backend.isolated:
            raise ArchsearchError("objective", f"{objective} is compared on predictions only",
                                  "use backend simulated or analytic, or objective throughput")
        res.settings["objective"] = objective
    if not backend.isolated:  # a prediction: deterministic, one "round" repeated
        results = [measure(sp, BenchSettings.from_dict({**settings.to_dict(), "batch_sizes": [batch_size]}))
                   for sp in specs]
        tp = [_score(r, batch_size, objective) for r in results]
        if any(t is None for t in tp):
            bad = next(r for r, t in zip(results, tp) if t is None)
            why = bad.error or next((b.error for b in bad.per_batch if b.error), None) or "no throughput"
            res.ok, res.error = False, f"the prediction failed for a shape of the group: {why}"
        else:
            res.rounds, res.predicted = [tp, tp], True
            res.ttft = [r.ttft(batch_size) for r in results]  # predicted too: a TTFT limit reads it
            res.stop_reason = "analytic prediction (deterministic)"
        res.provenance = provenance(extra_packages=backend.packages)
        return res


    with scratch_dir("paired") as tmp:
        dirs = []
        for i, sp in enumerate(specs):
            d = Path(tmp) / f"m{i}"
            write_hf_config(sp, d, "float32" if settings.dtype == "auto" else settings.dtype)
            dirs.append(str(d))
        job = {"backend": settings.backend, "backend_class": "archsearch.benchmarks.paired:PairedRunner",
               "inner_backend_class": backend_class or BACKENDS[settings.backend],
               "archs": [sp.to_dict() for sp in specs], "model_dirs": dirs, "real_weights": False,
               "settings": settings.to_dict(), "paired": asdict(paired), "batch_size": batch_size}
        out = run_isolated(job, settings.timeout_s * len(specs), log_path=log_path)
    r = out.result
    res.rounds = r.get("rounds") or []
    res.ttft = r.get("ttft") or []
    res.device, res.dtype = r.get("device"), r.get("dtype")
    res.engines, res.timing = r.get("engines") or [], {**(r.get("timing") or {}), "wall_s": out.wall_s}
    res.stop_reason = r.get("stop_reason")
    if not out.ok:
        res.error = out.error
        res.stop_reason = f"stopped early: {out.error}"
    res.ok = len(res.rounds) >= 2
    res.provenance = provenance(extra_packages=backend.packages)
    res.provenance["architectures"] = [describe(sp, res.dtype or "float32") for sp in specs]
    return res

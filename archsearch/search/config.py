"""The study config: one YAML file -> one typed, validated :class:`StudyConfig`.

Everything a study needs is here (docs/method.md section 4): the target (N, D, layers), the baseline
whose predicted loss sets the target loss, the search space, the proxy plan, the law, the
measurement plan, the Optuna settings, the local GQA search, optional limits, and the
optional full training and evaluation. Validation happens before any work starts, and errors
name the dotted field (``search_space.gqa[1]``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Literal

from archsearch.arch import SUPPORTED_HEAD_DIMS
from archsearch.benchmarks.base import BACKENDS, SERVED_ENGINES, BenchSettings, backend_class
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks.paired import PairedSettings
from archsearch.benchmarks.simulator import SLO, ServingLoad
from archsearch.benchmarks.workloads import OBJECTIVES
from archsearch.bounds import check_count
from archsearch.candidates import BuildSettings, check_size
from archsearch.cluster.config import ClusterConfig
from archsearch.configio import KEY, component, from_dict, load_yaml
from archsearch.errors import ArchsearchError
from archsearch.fileio import check_name, check_output, check_path
from archsearch.laws.acquisition import INITIAL_DESIGNS
from archsearch.laws.fit import MAX_BOOTSTRAP, FitOptions
from archsearch.laws.registry import law_form, law_names
from archsearch.planning.limits import Limits
from archsearch.search.deployment import AGGREGATES, DeploymentTarget, check_deployment_targets
from archsearch.trainers.config import TRACKERS, DataConfig, SweepConfig, TrainConfig

SAMPLERS = ("tpe", "random", "nsga2", "gp")
MEASURE_MODES = ("offline", "online")


@dataclass(frozen=True)
class BaselineConfig:
    """The reference shape: a preset, explicit fields, or knobs built at the study's budget."""

    preset: str | None = None
    arch: dict[str, Any] | None = None
    hidden_over_sqrt_n: float | None = None
    mlp_to_attn: float | None = None
    gqa: int | None = None

    def __post_init__(self) -> None:
        ways = [self.preset is not None, self.arch is not None,
                self.hidden_over_sqrt_n is not None or self.mlp_to_attn is not None]
        if sum(ways) != 1:
            raise ArchsearchError("baseline", "give exactly one of preset, arch, or "
                                  "hidden_over_sqrt_n + mlp_to_attn (+ gqa)")
        if ways[2] and (self.hidden_over_sqrt_n is None or self.mlp_to_attn is None):
            raise ArchsearchError("baseline", "knobs need both hidden_over_sqrt_n and mlp_to_attn")
        for k in ("hidden_over_sqrt_n", "mlp_to_attn", "gqa"):
            v = getattr(self, k)
            if v is not None and not v > 0:
                raise ArchsearchError(f"baseline.{k}", f"must be positive, got {v}")


@dataclass(frozen=True)
class TargetConfig:
    """L_t: explicit ``loss``, or the baseline's predicted loss times (1 + slack)."""

    loss: float | None = None
    slack: float = 0.0
    # chance constraint: feasible only if the predicted loss's bootstrap `confidence` quantile
    # (one-sided) is under the target; None: the point prediction is compared
    confidence: float | None = None

    def __post_init__(self) -> None:
        if self.confidence is not None and not 0.5 <= self.confidence < 1:
            raise ArchsearchError("target.confidence", f"must be in [0.5, 1), got {self.confidence}",
                                  "e.g. 0.9, or leave it out to compare the point prediction")
        if self.loss is not None and not self.loss > 0:
            raise ArchsearchError("target.loss", f"must be positive, got {self.loss}")
        if not -0.5 < self.slack < 1.0:
            raise ArchsearchError("target.slack", f"{self.slack} is out of range",
                                  "a relative slack such as 0.01 (1% above the baseline's loss)")


@dataclass(frozen=True)
class SearchSpace:
    """The box the search samples, and how a sample becomes a shape (``build``: snapping and
    tolerances of :func:`archsearch.candidates.build_candidate`; its vocabulary and tied
    embeddings are the study's)."""

    hidden_over_sqrt_n: tuple[float, float] = (0.03, 0.12)
    mlp_to_attn: tuple[float, float] = (0.5, 5.0)
    # the GQA values trials sample: a list, or "divisors": every head pair whose KV-head count
    # divides its head count at head_dim, i.e. every integer GQA from 1 to the largest any shape of
    # the box holds (its head total less one; StudyConfig.gqa_values), sampled as an ordered integer
    gqa: list[int] | Literal["divisors"] = field(default_factory=lambda: [1, 2, 4, 8])
    head_dim: int = 64
    build: BuildSettings = field(default_factory=BuildSettings)
    # Knob grid steps: shapes snap to multiples anyway, so a step keeps Optuna from proposing
    # near-identical shapes. 0 means continuous.
    hidden_over_sqrt_n_step: float = 0.0
    mlp_to_attn_step: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hidden_over_sqrt_n", "mlp_to_attn"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ArchsearchError(f"search_space.{name}", f"range [{lo}, {hi}] is empty or "
                                      "not positive", "give [low, high] with 0 < low <= high")
        if not self.gqa:
            raise ArchsearchError("search_space.gqa", "is empty", "list at least one GQA value, e.g. [4], "
                                  "or write divisors (every head pair whose KV heads divide its heads)")
        for i, g in enumerate([] if self.gqa == "divisors" else self.gqa):
            if g <= 0:
                raise ArchsearchError(f"search_space.gqa[{i}]", f"must be positive, got {g}")
        for name in ("hidden_over_sqrt_n_step", "mlp_to_attn_step"):
            if getattr(self, name) < 0:
                raise ArchsearchError(f"search_space.{name}", f"must be >= 0, got {getattr(self, name)}",
                                      "0 means continuous")

        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ArchsearchError("search_space.head_dim", f"{self.head_dim} is not supported by the "
                                  "attention kernels", f"use one of {list(SUPPORTED_HEAD_DIMS)}")


@dataclass(frozen=True)
class ActiveProxyConfig:
    """``proxy.plan: active``: the sweeps' grid is the pool of candidate runs; the plan
    trains an initial design, then one batch at a time the runs that most shrink the interval of
    the optimum (d/sqrt(N)*, r*) per FLOP, until the interval is within ``tolerance`` or the
    FLOPs reach ``budget_flops`` (see ``archsearch.laws.acquisition``)."""

    initial: str = "grid3"              # corners-centre | grid3, at the smallest size
    tolerance: float = 0.05             # relative half-width of the optimum's interval (both coordinates)
    budget_flops: float | None = None   # proxy training FLOPs (6ND); None: the pool is the limit
    batch_size: int = 1                 # runs proposed at once (one per worker)
    bootstrap: int = 200                # replicates of the parametric bootstrap inside the loop (the final fit uses law.fit.bootstrap)
    level: float = 0.9                  # joint level of the optimum's interval (both coordinates together)
    noise_floor: float = 0.002          # smallest log-noise of one run the acquisition assumes

    def __post_init__(self) -> None:
        if self.initial not in INITIAL_DESIGNS:
            raise ArchsearchError("proxy.active.initial", f"{self.initial!r} is unknown",
                                  f"use one of {list(INITIAL_DESIGNS)}")
        if not 0 < self.tolerance < 1:
            raise ArchsearchError("proxy.active.tolerance", f"must be in (0, 1), got {self.tolerance}",
                                  "a relative half-width such as 0.05")
        if self.budget_flops is not None and not self.budget_flops > 0:
            raise ArchsearchError("proxy.active.budget_flops", f"must be positive, got {self.budget_flops}",
                                  "training FLOPs (6 N D) for all proxies, e.g. 1e20, or leave it out")
        if self.batch_size < 1:
            raise ArchsearchError("proxy.active.batch_size", f"must be >= 1, got {self.batch_size}")

        if not 10 <= self.bootstrap <= MAX_BOOTSTRAP:
            raise ArchsearchError("proxy.active.bootstrap", f"must be in 10..{MAX_BOOTSTRAP}, got {self.bootstrap}",
                                  "the acquisition needs an ensemble; 32 is enough")
        if not 0 < self.level < 1:
            raise ArchsearchError("proxy.active.level", f"must be in (0, 1), got {self.level}")
        if not self.noise_floor > 0:
            raise ArchsearchError("proxy.active.noise_floor", f"must be positive, got {self.noise_floor}")


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy runs: reuse a run table, or train one sweep or several (``archsearch.trainers.SweepConfig``
    fields each; e.g. the shape grid plus a reference sweep at other token budgets, which a
    Chinchilla reference needs). ``plan: grid`` trains every point; ``plan: active`` trains
    the points the active plan chooses (settings in ``active``)."""

    runs: str | None = None
    sweep: SweepConfig | None = None
    sweeps: list[SweepConfig] | None = None
    plan: str = "grid"
    active: ActiveProxyConfig = field(default_factory=ActiveProxyConfig)
    # a folder shared by studies: proxy runs live there keyed by what determines them, so a
    # run another study trained is reused and only missing runs are trained
    store: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.runs, self.sweep, self.sweeps)) != 1:
            raise ArchsearchError("proxy", "needs exactly one of runs (a run table to reuse), sweep "
                                  "(a sweep to train) or sweeps (a list of them)")
        if self.sweeps is not None and not self.sweeps:
            raise ArchsearchError("proxy.sweeps", "is empty")
        names = [s.name for s in self.sweep_list()]
        if len(set(names)) != len(names):
            raise ArchsearchError("proxy.sweeps", f"sweep names repeat: {names}", "give each sweep its own name")
        if self.plan not in ("grid", "active"):
            raise ArchsearchError("proxy.plan", f"{self.plan!r} is unknown", "use grid or active")
        if self.plan == "active" and self.runs is not None:
            raise ArchsearchError("proxy.plan", "active chooses runs to train, but proxy.runs reuses a table",
                                  "give proxy.sweep (the pool of candidate runs) or use plan: grid")
        if self.store is not None:
            check_output("proxy.store", self.store, kind="dir")

    def sweep_list(self) -> list[SweepConfig]:
        """Every sweep to train (none when ``runs`` reuses a table)."""
        return [self.sweep] if self.sweep is not None else list(self.sweeps or [])


@dataclass(frozen=True)
class LawConfig:
    """The study's ``law`` block: the :class:`~archsearch.laws.FitOptions` of the study's fit
    (``law.fit``, a :func:`archsearch.configio.component`), the law's ``form``, a law ``file`` that
    skips the fit, and whether shapes outside the law's fitted range may be used
    (``allow_extrapolation``). The fit's seed and size tolerance are the study's (``law.seed``,
    ``law.size_tolerance``, derived where left out), so ``law.fit.seed`` and
    ``law.fit.size_tolerance`` are refused: one place for each."""

    fit: FitOptions = component(lambda: FitOptions(bootstrap=200))
    # the fit's seed and size tolerance, derived from the study where left out (fit_options): the
    # seed is optuna.seed; runs within this relative distance in N (and D) are one size, by default
    # the search space's build tolerance (snapped shapes land anywhere within it of their budget),
    # at least 5%
    seed: int | None = None
    size_tolerance: float | None = None
    form: str = "conditional-multiplicative"
    file: str | None = None  # a fitted or hand-written law JSON: skips the fit
    # shapes outside the (d/sqrt(N), r) box the law was fitted on are refused unless this is true
    # (the law's fitted_range, or its runs' ranges after the r filter; archsearch.search.margins)
    allow_extrapolation: bool = False

    def __post_init__(self) -> None:
        for name in ("seed", "size_tolerance"):  # the study's, never shadowed by a value here that is ignored
            if getattr(self.fit, name) != getattr(FitOptions(), name):
                raise ArchsearchError(f"law.fit.{name}", "is the study's, not the fit block's",
                                      f"write it as law.{name} (default: derived from the study)")
        if not law_form(self.form, "law.form").searchable:
            raise ArchsearchError("law.form", f"{self.form!r} is not a conditional law",
                                  f"use one of {[n for n in law_names() if law_form(n).searchable]}")
        self.fit_options(seed=0, size_tolerance=0.05)  # the fit's own checks of the two study-level fields

    def fit_options(self, seed: int, size_tolerance: float) -> FitOptions:
        """The :class:`FitOptions` of this block; ``seed`` and ``size_tolerance`` are the
        study's defaults, used where the block leaves them out."""
        try:
            return replace(self.fit, seed=seed if self.seed is None else self.seed,
                           size_tolerance=size_tolerance if self.size_tolerance is None else self.size_tolerance)
        except ArchsearchError as e:
            where = "law" if e.field in ("seed", "size_tolerance") else "law.fit"  # the two the study sets
            raise ArchsearchError(e.field if e.field.startswith("law.") else f"{where}.{e.field}", e.problem,
                                  e.fix) from None


@dataclass
class MeasureConfig:
    """The study's ``measure`` block: the :class:`BenchSettings` every measurement of the study
    runs with (``measure.bench``, a :func:`archsearch.configio.component`; its defaults are those of a
    study at scale), the paired
    comparison's :class:`PairedSettings` under ``paired``, and what only a study needs: a fallback
    engine, the objective's batch size and a roofline calibration.

    Fields marked ``metadata=KEY`` (here and in the components) key a stored measurement
    (:func:`archsearch.search.measurements.key_settings`); the others choose among engines or batch
    sizes, or retry, and change no measurement."""

    bench: BenchSettings = component(lambda: BenchSettings(backend="vllm", batch_sizes=[16, 32, 64, 128], input_len=4096,
                                                        output_len=1024, repeats=5, timeout_s=1800.0), key=True)
    # Used only where ``bench.backend`` is not installed, and then said in the report's first line.
    fallback_backend: str | None = None
    reference_batch_size: int | None = None  # the objective's batch size; default: the largest
    # a roofline calibration file (archsearch.benchmarks.calibration) for the seed ranking's predictions
    # (and the analytic backend); without one they are labelled uncalibrated
    calibration: str | None = field(default=None, metadata=KEY)
    # Paired comparison with the baseline (archsearch.benchmarks.paired): engines resident in one
    # process, interleaved rounds at the reference batch size until every ratio's `level` interval
    # is within +-rel_halfwidth, or max_rounds is spent.
    paired: PairedSettings = field(default_factory=PairedSettings, metadata=KEY)
    # N of the measured shapes, when not the study's: every shape is measured rebuilt at this N with
    # its realised d/sqrt(N), r and GQA (the law and the loss constraint stay at the study's N). Valid
    # only where feasibility does not depend on N (multiplicative law, target relative to the
    # baseline; StudyConfig checks it): a larger N lifts the shapes' speed differences above the noise.
    params: float | None = field(default=None, metadata=KEY)
    # a failed measurement (an engine error may be transient) is measured again by a later run of
    # the study, up to this many attempts in all; the store records each one's attempts
    max_attempts: int = 3
    # deployment targets (archsearch.search.targets): every candidate compared with the baseline on
    # each, the objective an aggregate of the ratios (optuna.target_objective); None: this block is
    # the one target
    targets: list[DeploymentTarget] | None = None
    # what a ratio to the baseline compares (archsearch.benchmarks.workloads.OBJECTIVES): output tokens/s,
    # or, set by a target's workload, goodput under its SLO or 1 / end-to-end latency (keys a measurement
    # only when not throughput: measurements.key_settings)
    objective: str = "throughput"
    # How a measured engine is measured (archsearch.benchmarks.online, docs/search.md "Online
    # measurement"): "offline", static batches in one engine process; "online", every shape of a
    # comparison served by the engine's OpenAI-compatible server (vllm or sglang) and sent `n_requests`
    # requests at `rate` requests/s (Poisson arrivals) in alternating rounds, with `reference_batch_size`
    # the server's max_num_seqs; the objective is then goodput under `slo` (requests/s meeting both its
    # TTFT and TPOT), or 1 / end-to-end latency with objective: latency. `port`: the baseline's server's
    # (refused before any work when in use; default a free one). Key a measurement when online only
    # (measurements.key_settings).
    mode: str = "offline"
    rate: float | None = None
    n_requests: int | None = None  # online, per shape and round; default 32
    slo: SLO | None = None
    port: int | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ArchsearchError("measure.objective", f"{self.objective!r} is unknown", f"use one of {list(OBJECTIVES)}")
        self._check_online()
        if self.objective != "throughput" and not self.online and not backend_class(self.bench.backend).predicted:
            raise ArchsearchError("measure.objective", f"{self.objective} is compared on predictions only here "
                                  f"(the {self.bench.backend} backend measures static batches)",
                                  "predict it (a target's workload: backend simulated/analytic), or use throughput")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) \
                or not 1 <= self.max_attempts <= 100:
            raise ArchsearchError("measure.max_attempts", f"must be an integer in [1, 100], got {self.max_attempts!r}",
                                  "e.g. 3 (1: a failed measurement is never taken again)")
        if self.params is not None:
            if isinstance(self.params, bool) or not isinstance(self.params, (int, float)) or not self.params > 0:
                raise ArchsearchError("measure.params", f"must be a positive number, got {self.params!r}",
                                      "e.g. 4e6, or leave it out to measure at the study's params")
            try:
                check_size(self.params)
            except ArchsearchError as e:
                raise ArchsearchError("measure.params", e.problem, e.fix) from None
        if self.fallback_backend is not None and self.fallback_backend not in BACKENDS:
            raise ArchsearchError("fallback_backend", f"unknown backend {self.fallback_backend!r}",
                                  f"use one of {list(BACKENDS)}")
        if self.calibration is not None:
            try:
                # fitted on the device and engine it predicts for (the analytic backend, which
                # predicts for any engine, excepted)
                Calibration.load(self.calibration).check_matches(self.bench.device_spec, self.bench.backend,
                                                                  "measure.calibration")
            except ArchsearchError as e:
                raise ArchsearchError("measure.calibration", e.problem, e.fix) from None
        if self.reference_batch_size is not None and self.reference_batch_size not in self.bench.batch_sizes:
            raise ArchsearchError("reference_batch_size",
                                  f"{self.reference_batch_size} is not among batch_sizes {self.bench.batch_sizes}")

        check_deployment_targets(self)

    def bench_settings(self, backend: str) -> BenchSettings:
        """The plain :class:`BenchSettings` of this block on ``backend`` (the engine a study
        measures with may be the fallback)."""
        engine_args = dict(self.bench.engine_args)
        if backend_class(backend).predicted and self.calibration:  # where a predicting backend reads it (as bench passes it)
            engine_args["calibration"] = self.calibration
        try:
            return replace(self.bench, backend=backend, batch_sizes=list(self.bench.batch_sizes), engine_args=engine_args)
        except ArchsearchError as e:
            raise ArchsearchError(f"measure.bench.{e.field}", e.problem, e.fix) from None

    @property
    def ref_batch(self) -> int:
        return self.reference_batch_size or max(self.bench.batch_sizes)

    @property
    def online(self) -> bool:
        """Measured online (``mode: online``): served, requests at a rate, paired rounds of goodput."""
        return self.mode == "online"

    def serving_load(self) -> ServingLoad:
        """The load every shape gets in one online round: ``n_requests`` at ``rate`` (Poisson), the
        study's lengths, ``reference_batch_size`` as the server's max_num_seqs, and the SLO."""
        if not self.online:
            raise ArchsearchError("measure.mode", "is offline: there is no serving load", "set measure.mode: online")
        return ServingLoad(n_requests=self.n_requests or 32, input_len=self.bench.input_len,
                           output_len=self.bench.output_len, rate=self.rate, max_num_seqs=self.ref_batch,
                           max_num_batched_tokens=max(2048, self.bench.input_len), slo=self.slo,
                           seed=self.bench.seed)

    def _check_online(self) -> None:
        """``mode`` and its settings, before any work: each error names the field and the fix."""
        if self.mode not in MEASURE_MODES:
            raise ArchsearchError("measure.mode", f"{self.mode!r} is unknown",
                                  f"use one of {list(MEASURE_MODES)} (offline: static batches)")
        if not self.online:
            given = [k for k in ("rate", "n_requests", "slo", "port") if getattr(self, k) is not None]
            if given:
                raise ArchsearchError(f"measure.{given[0]}", "applies to online measurement only",
                                      "set measure.mode: online (a served engine, vllm or sglang), or drop it")
            return
        if self.bench.backend not in SERVED_ENGINES:
            raise ArchsearchError("measure.bench.backend", f"{self.bench.backend!r} has no server to measure online "
                                  "(measure.mode: online)", f"use one of {list(SERVED_ENGINES)}, or measure.mode: "
                                  "offline (a workload target predicts online serving with backend simulated)")
        if self.fallback_backend is not None and self.fallback_backend not in SERVED_ENGINES:
            raise ArchsearchError("measure.fallback_backend", f"{self.fallback_backend!r} has no server to measure "
                                  "online (measure.mode: online)",
                                  f"drop it, or name one of {list(SERVED_ENGINES)}")
        r = self.rate
        if r is None or isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
            raise ArchsearchError("measure.rate", f"online measurement needs a positive rate in requests/s, got {r!r}",
                                  "e.g. rate: 1.0 (Poisson arrivals), below what the engine can hold")
        n = self.n_requests
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 100_000):
            raise ArchsearchError("measure.n_requests", f"must be an integer in [2, 100000], got {n!r}",
                                  "requests per shape and round, e.g. 32")
        if self.objective == "throughput":
            # at a rate below saturation every shape's output tokens/s is the offered rate's: the online
            # objective is goodput under the SLO (or latency, written out)
            self.objective = "goodput"
        if self.objective == "goodput" and self.slo is None:
            raise ArchsearchError("measure.slo", "online measurement compares goodput under an SLO, and none is given",
                                  "e.g. slo: {ttft_s: 2.0, tpot_s: 0.2} (seconds), or objective: latency")
        if self.port is not None and (isinstance(self.port, bool) or not 1 <= self.port <= 65535):
            raise ArchsearchError("measure.port", f"must be an integer in [1, 65535], got {self.port!r}",
                                  "give a free port, or leave it out for a free one")
        try:
            self.serving_load()
        except ArchsearchError as e:
            raise ArchsearchError(f"measure.{e.field}", e.problem, e.fix) from None


@dataclass(frozen=True)
class OptunaConfig:
    storage: str | None = None  # default: sqlite:///<study dir>/optuna.db
    sampler: str = "tpe"
    seed: int = 0
    # Optuna's trial budget, as in study.optimize(n_trials=...): every trial counts (one that
    # proposes an already-measured shape, a pruned or a failed one), across workers and resumes;
    # default 10 x n_shapes, a cap that only a box with few shapes reaches
    n_trials: int | None = None
    # distinct shapes to measure: the search stops once it has them (default: n_trials when that
    # is given, else 12); versions before 0.9 called this n_trials (docs/search.md)
    n_shapes: int | None = None
    objective: str = "throughput"  # or "pareto": throughput vs predicted loss, two objectives
    # seed the study with this many shapes from the law's solution (the loss optimum first, then
    # the feasible shapes a roofline ranks fastest); 0: the sampler starts on its own
    enqueue_solution: int = 3
    # paired studies: compare the feasible seeds with the baseline in one engine process first
    seeds_together: bool = True
    # published shapes (presets, e.g. surefire-1b, or architecture files) enqueued beside the law's
    # seeds and measured as published, not rebuilt: a trial like any other (the loss constraint, the
    # law's range and the GQA bounds apply), reported beside the answer with its realised N
    seed_shapes: list[str] = field(default_factory=list)
    # how far a seeded shape's N may be from the budget: the builder snaps within
    # search_space.build.tolerance, a published shape is as its authors built it (Surefire-1B holds
    # 965M for its 1B budget, -3.5%); its realised N and error are reported, never hidden
    seed_tolerance: float = 0.05
    measure_infeasible: bool = False  # measure candidates that break the loss constraint too
    # report each trial to accelerate's trackers, as train.log_with: tensorboard, wandb, mlflow
    log_with: str | list[str] | None = None
    # with measure.targets: the objective over the targets' throughput ratios to the baseline, the
    # worst one (every target must hold) or their weighted geometric mean
    target_objective: str = "worst"
    # keys of earlier versions: what to write instead (read by configio.from_dict)
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "max_trials": "write optuna.n_trials (every Optuna trial counts, as in Optuna); what earlier versions "
                      "called n_trials, the distinct shapes to measure, is now optuna.n_shapes"}

    def __post_init__(self) -> None:
        trackers = [self.log_with] if isinstance(self.log_with, str) else list(self.log_with or [])
        for t in trackers:
            if t not in TRACKERS:
                raise ArchsearchError("optuna.log_with", f"{t!r} is not a supported tracker",
                                      f"use one of {sorted(TRACKERS)}")
        object.__setattr__(self, "log_with", tuple(trackers))
        if self.sampler not in SAMPLERS:
            raise ArchsearchError("optuna.sampler", f"unknown sampler {self.sampler!r}", f"use one of {list(SAMPLERS)}")
        if self.objective not in ("throughput", "pareto"):
            raise ArchsearchError("optuna.objective", f"{self.objective!r} is unknown", "use throughput or pareto")
        if self.target_objective not in AGGREGATES:
            raise ArchsearchError("optuna.target_objective", f"{self.target_objective!r} is unknown",
                                  f"use one of {list(AGGREGATES)}")
        if self.n_trials is not None and self.n_trials <= 0:
            raise ArchsearchError("optuna.n_trials", "must be positive", "give a number of Optuna trials, or leave "
                                  "it out (10 x optuna.n_shapes)")
        if self.n_shapes is not None and self.n_shapes <= 0:
            raise ArchsearchError("optuna.n_shapes", "must be positive", "give the number of distinct shapes to measure")
        if self.n_shapes is not None and self.n_trials is not None and self.n_shapes > self.n_trials:
            raise ArchsearchError("optuna.n_shapes", f"{self.n_shapes} distinct shapes cannot be measured in "
                                  f"optuna.n_trials={self.n_trials} trials (each trial measures at most one)",
                                  f"give optuna.n_trials >= {self.n_shapes}, or leave it out (10 x n_shapes)")
        # resolved once: the stored config carries both numbers
        n_shapes = self.n_shapes or self.n_trials or 12
        object.__setattr__(self, "n_shapes", n_shapes)
        object.__setattr__(self, "n_trials", self.n_trials or 10 * n_shapes)
        check_count("optuna.n_trials", self.n_trials, "attempts_per_trial", scale=n_shapes)
        if self.storage is not None:
            _check_storage_url(self.storage)
        if self.enqueue_solution < 0:
            raise ArchsearchError("optuna.enqueue_solution", "must be >= 0")
        if not 0 < self.seed_tolerance < 1:
            raise ArchsearchError("optuna.seed_tolerance", f"must be in (0, 1), got {self.seed_tolerance}",
                                  "e.g. 0.05: a seeded shape's N within 5% of the budget")
        if len(set(self.seed_shapes)) != len(self.seed_shapes):
            raise ArchsearchError("optuna.seed_shapes", f"{self.seed_shapes} names a shape twice", "name each once")
        if self.enqueue_solution > self.n_trials:  # each seed is a trial: those beyond the budget never run
            raise ArchsearchError("optuna.enqueue_solution", f"{self.enqueue_solution:,} seed shapes cannot run in "
                                  f"optuna.n_trials={self.n_trials} trials (each seed is a trial)",
                                  f"give optuna.enqueue_solution <= {self.n_trials}")


def _check_storage_url(url: str) -> None:
    """A journal file (``*.log`` / ``journal:PATH``), or a database URL SQLAlchemy can parse
    with an installed dialect."""
    if url.startswith("journal:") or url.endswith(".log"):
        check_output("optuna.storage", url.removeprefix("journal:"))
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError) as e:
        raise ArchsearchError("optuna.storage", f"{url!r} is not a usable database URL ({e})",
                              "e.g. sqlite:///study.db, postgresql://user@host/db or a journal "
                              "file.log; leave it out for the study folder's SQLite file") from None


def gqa_bound_violation(gqa: int, n_kv_heads: int, max_gqa: int | None, min_kv_heads: int | None) -> str | None:
    """Why a head pair lies beyond the GQA search's bounds (None: within them)."""
    if max_gqa is not None and gqa > max_gqa:
        return f"GQA {gqa} > {max_gqa}"
    if min_kv_heads is not None and n_kv_heads < min_kv_heads:
        return f"{n_kv_heads} KV heads < {min_kv_heads}"
    return None


@dataclass(frozen=True)
class GQASearchConfig:
    """The local GQA search (``archsearch.search.gqa``): from the ``baseline_gqa`` variant of the chosen
    shape, walk toward more and fewer KV heads. A study that trains proxies trains each variant at
    the proxy sizes beside the baseline GQA variant and stops at the first whose loss is worse
    by more than ``loss_slack`` plus the paired noise margin at ``loss_level``; a study that cannot train (a law
    file, no proxy sweep) cannot check loss, so its walk stays within ``max_gqa`` / ``min_kv_heads``
    and, where neither is set, does not go past ``baseline_gqa`` toward fewer KV heads."""

    enabled: bool = True
    baseline_gqa: int = 4
    # relative: a variant whose mean proxy loss is within this of the baseline GQA variant's is not worse
    loss_slack: float = 0.0
    # sd of one paired relative loss difference (two variants, same seed and data order); None:
    # estimated from the spread of the paired differences over proxy sizes and seeds
    loss_noise: float | None = None
    loss_level: float = 0.9  # one-sided confidence that a variant's loss is worse before it stops the walk
    max_gqa: int | None = None       # bound on GQA (n_heads / n_kv_heads) in any study
    min_kv_heads: int | None = None  # bound on the KV heads in any study

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ArchsearchError(f"gqa_search.{name}", f"must be a positive integer, got {v!r}",
                                      "e.g. 8" if name == "max_gqa" else "e.g. 4 (the method's picks kept 4-6 KV heads)")

        for name in ("baseline_gqa", "max_gqa", "min_kv_heads"):
            positive_int(name)
            if getattr(self, name) is not None:
                check_count(f"gqa_search.{name}", getattr(self, name), "heads")
        if self.max_gqa is not None and self.max_gqa < self.baseline_gqa:
            raise ArchsearchError("gqa_search.max_gqa", f"{self.max_gqa} is below baseline_gqa {self.baseline_gqa}, "
                                  "where the walk starts", f"give max_gqa >= {self.baseline_gqa}, or lower baseline_gqa")
        if not 0 <= self.loss_slack < 0.5:
            raise ArchsearchError("gqa_search.loss_slack", f"must be in [0, 0.5), got {self.loss_slack}",
                                  "a relative loss difference such as 0.002 (0.2%), or 0 (any loss beyond the noise)")
        if self.loss_noise is not None and not self.loss_noise > 0:
            raise ArchsearchError("gqa_search.loss_noise", f"must be positive, got {self.loss_noise}",
                                  "the sd of a paired relative loss difference, e.g. 0.003, or leave it out "
                                  "to estimate it from the proxy sizes and seeds")
        if not 0.5 <= self.loss_level < 1:
            raise ArchsearchError("gqa_search.loss_level", f"must be in [0.5, 1), got {self.loss_level}", "e.g. 0.9")

    def bounds(self, can_train: bool) -> tuple[int | None, int | None, str]:
        """(max GQA, min KV heads, why): the configured bounds; where loss cannot be checked and
        none is set, GQA at most ``baseline_gqa``."""
        if can_train or self.max_gqa is not None or self.min_kv_heads is not None:
            return self.max_gqa, self.min_kv_heads, "gqa_search.max_gqa / min_kv_heads"
        return self.baseline_gqa, None, ("baseline_gqa: the study trains no proxies and sets neither "
                                         "gqa_search.max_gqa nor min_kv_heads")


@dataclass(frozen=True)
class FinalTrainConfig:
    enabled: bool = False
    tokens: float | None = None  # the budget D; default: the study's tokens
    train: TrainConfig = field(default_factory=TrainConfig)  # the optimisation (its budget: tokens above)
    data: DataConfig | None = None  # default: the first proxy sweep's

    def __post_init__(self) -> None:
        if self.tokens is not None and not self.tokens > 0:
            raise ArchsearchError("final_train.tokens", f"must be positive, got {self.tokens}")
        if self.train.tokens is not None or self.train.tokens_per_param is not None:
            raise ArchsearchError("final_train.train", "sets a token budget", "give it once, as final_train.tokens")


@dataclass(frozen=True)
class EvalConfig:
    enabled: bool = False
    tasks: str = "offline"
    limit: int | None = None
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit <= 0:
            raise ArchsearchError("evaluation.limit", f"must be positive, got {self.limit}")
        if self.batch_size <= 0:
            raise ArchsearchError("evaluation.batch_size", f"must be positive, got {self.batch_size}")


@dataclass(frozen=True)
class VerifyConfig:
    """The verify stage (``archsearch.search.verify``, docs/method.md section 4, step 5): train the
    answer and the baseline on the same tokens (``final_train``'s budget, optimisation and data;
    same data order and schedule) once per seed, evaluate both with lm-eval on ``evaluation``'s
    tasks, measure both paired on the study's engine, and report the head-to-head and a verdict."""

    enabled: bool = False
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # each model trained once per seed
    lm_eval: bool = True  # evaluate both with lm-eval (evaluation.tasks / limit / batch_size)
    level: float = 0.9  # two-sided level of the loss and ratio intervals

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ArchsearchError("verify.seeds", "is empty", "give at least one seed, e.g. [0, 1] (two give an interval)")
        for i, sd in enumerate(self.seeds):
            if isinstance(sd, bool) or not isinstance(sd, int) or sd < 0:
                raise ArchsearchError(f"verify.seeds[{i}]", f"must be a non-negative integer, got {sd!r}", "e.g. 0")
        if len(set(self.seeds)) != len(self.seeds):
            raise ArchsearchError("verify.seeds", f"{self.seeds} repeats a seed", "give distinct seeds")
        if not 0.5 <= self.level < 1:
            raise ArchsearchError("verify.level", f"must be in [0.5, 1), got {self.level}", "e.g. 0.9")


MODES = ("constrained", "predict-rank-select")
# setting values renamed since a study folder may have recorded them: {dotted setting: {old: new}};
# a run refuses a folder that recorded an old one and archsearch migrate rewrites it
RENAMED_VALUES: dict[str, dict[str, str]] = {"mode": {"algorithm5": "constrained"}}


def renamed_optuna_keys(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A stored config (nested blocks) of a version before ``optuna.n_shapes`` rewritten to this
    one's keys: its ``n_trials`` counted distinct shapes (now ``n_shapes``) and its ``max_trials``
    counted Optuna trials (now ``n_trials``); with what was renamed. ``data`` is left as it is."""
    block = data.get("optuna")
    if not isinstance(block, dict) or "max_trials" not in block:
        return data, []
    out = json.loads(json.dumps(data, default=str))
    o = out["optuna"]
    shapes, trials = o.pop("n_trials", None), o.pop("max_trials")
    o["n_shapes"] = shapes
    o["n_trials"] = trials
    return out, [f"optuna.n_trials: {shapes} -> optuna.n_shapes (distinct shapes); optuna.max_trials: "
                 f"{trials} -> optuna.n_trials (Optuna trials{'' if trials else ', default 10 x n_shapes'})"]


def renamed_values(data: dict[str, Any], back: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``data`` (a stage's {dotted setting: value}, or a config's nested blocks) with each old value
    of :data:`RENAMED_VALUES` given its new name (``back``: new names given the old ones), and the
    settings renamed; ``data`` itself is left as it is."""
    out, renamed = json.loads(json.dumps(data, default=str)), []
    for dotted, names in RENAMED_VALUES.items():
        names = {v: k for k, v in names.items()} if back else names
        *parents, leaf = [dotted] if dotted in out else dotted.split(".")
        block = out
        for p in parents:
            block = block.get(p) if isinstance(block, dict) else None
        if isinstance(block, dict) and isinstance(block.get(leaf), str) and block[leaf] in names:
            renamed.append(f"{dotted}: {block[leaf]} -> {names[block[leaf]]}")
            block[leaf] = names[block[leaf]]
    return out, renamed


@dataclass(frozen=True)
class StudyConfig:
    name: str
    params: float
    tokens: float
    n_layers: int
    baseline: BaselineConfig
    proxy: ProxyConfig | None = None  # not needed when law.file gives the law
    target: TargetConfig = field(default_factory=TargetConfig)
    search_space: SearchSpace = field(default_factory=SearchSpace)
    law: LawConfig = field(default_factory=LawConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    optuna: OptunaConfig = field(default_factory=OptunaConfig)
    gqa_search: GQASearchConfig = field(default_factory=GQASearchConfig)
    limits: Limits = field(default_factory=Limits)  # TTFT / TPOT / peak memory a candidate must meet
    # constrained: max throughput s.t. predicted loss <= target, then the local GQA walk (docs/method.md
    # section 4); predict-rank-select: the earlier variant (train the top k, release the best)
    mode: str = "constrained"
    top_k: int = 3  # predict-rank-select: distinct feasible shapes trained and evaluated
    # predict-rank-select: candidates within this (absolute) mean accuracy of the best are tied;
    # the fastest of them is released
    release_accuracy_tolerance: float = 0.01
    final_train: FinalTrainConfig = field(default_factory=FinalTrainConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)  # the answer trained beside the baseline
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # where proxy/measurement jobs run
    vocab_size: int | None = None  # default: the proxies' tokenizer's (bpe:N, smollm2); else required
    tie_embeddings: bool = False
    out: str | None = None  # default: runs/<name> (git-ignored; results/ holds curated records)

    def __post_init__(self) -> None:
        check_name("name", self.name)
        if " " in self.name:
            raise ArchsearchError("name", f"{self.name!r} holds a space", "give a name without spaces")

        check_size(self.params, self.n_layers if self.n_layers > 0 else None)
        if not self.tokens > 0:
            raise ArchsearchError("tokens", f"must be positive, got {self.tokens}")
        if self.n_layers <= 0:
            raise ArchsearchError("n_layers", f"must be positive, got {self.n_layers}")
        if self.mode in RENAMED_VALUES["mode"]:
            raise ArchsearchError("mode", f"{self.mode!r} is now called {RENAMED_VALUES['mode'][self.mode]!r}",
                                  f"write mode: {RENAMED_VALUES['mode'][self.mode]} (a study folder run with the "
                                  "old name: archsearch migrate STUDY_DIR, once)")
        if self.mode not in MODES:
            raise ArchsearchError("mode", f"{self.mode!r} is unknown", f"use one of {', '.join(MODES)}")
        if self.top_k <= 0:
            raise ArchsearchError("top_k", "must be positive")
        if self.out is not None:
            check_path("out", self.out)
        if self.out is not None and ".." in Path(self.out).parts:
            raise ArchsearchError("out", f"{self.out!r} climbs out with '..'",
                                  "give an absolute path or one below the current folder")
        if self.law.file is not None and not Path(self.law.file).is_file():
            raise ArchsearchError("law.file", f"no such file {self.law.file!r}")
        if not 0 <= self.release_accuracy_tolerance < 1:
            raise ArchsearchError("release_accuracy_tolerance", f"must be in [0, 1), got "
                                  f"{self.release_accuracy_tolerance}", "e.g. 0.01: one accuracy point")
        if self.measure.params is not None:
            check_measured_scale(self)
        if self.proxy is None and self.law.file is None:
            raise ArchsearchError("proxy", "is required unless law.file gives a fitted law",
                                  "add proxy.sweep (train proxies) or proxy.runs (reuse a run table)")

    def out_dir(self, override: str | Path | None = None) -> Path:
        return Path(override or self.out or Path("runs") / self.name)

    @cached_property
    def gqa_values(self) -> list[int]:
        """The GQA values trials may sample: ``search_space.gqa`` as listed, or for ``divisors``
        every integer from 1 to the largest GQA a shape of the box can hold. The most heads a layer
        holds are at the box's narrowest width and smallest r: attention is then
        ``N / n_layers / (1 + r_low)`` parameters of ``2 * d * head_dim`` per head, and GQA is at
        most that head total less one (one KV head). Every head pair (n_kv * g, n_kv) of the box
        has such an integer g, so the pairs reachable are all those whose KV count divides the
        head count (GQA 9 as in Surefire-1B's 36/4, not only powers of two)."""
        s = self.search_space
        if s.gqa != "divisors":
            return list(s.gqa)
        m = s.build.hidden_multiple
        narrowest = max(m, round(s.hidden_over_sqrt_n[0] * math.sqrt(self.params) / m) * m)
        heads = math.ceil(self.params / self.n_layers / (1 + s.mlp_to_attn[0]) / (2 * narrowest * s.head_dim))
        return list(range(1, max(1, heads - 1) + 1))

    def fit_options(self) -> FitOptions:
        """The study's law-fit options (the final fit, and the active plan's loop with fewer
        resamples): the ``law`` block, its seed defaulting to ``optuna.seed`` and its size tolerance
        (how far apart in N and D runs may be and still be one size) to the build tolerance the
        shapes were snapped within (at least 5%)."""
        return self.law.fit_options(seed=self.optuna.seed,
                                    size_tolerance=max(0.05, self.search_space.build.tolerance))


def check_measured_scale(cfg: StudyConfig) -> None:
    """``measure.params`` (N_m != N) is valid only where the feasible set of (d/sqrt(N), r, GQA) does
    not depend on N: with the multiplicative law L = L_opt(N, D) * f(d/sqrt(N)) * g(r), a target
    relative to the baseline's predicted loss, L <= (1 + slack) L_baseline, reduces to
    f g <= (1 + slack) f_b g_b at every N, so the shapes feasible at N are the ones feasible at N_m
    and their throughputs can be compared there. An absolute ``target.loss`` (or an additive law,
    whose terms do not cancel L_opt) makes feasibility depend on N, so it is refused."""
    if law_form(cfg.law.form).combine != "multiplicative":
        raise ArchsearchError("measure.params", f"needs law.form conditional-multiplicative, not {cfg.law.form!r}: "
                              "only the multiplicative law's loss constraint is the same at every N",
                              "drop measure.params (measure at the study's params) or use the multiplicative law")
    if cfg.target.loss is not None:
        raise ArchsearchError("measure.params", "cannot be used with an absolute target.loss: which shapes meet "
                              "it depends on N, so shapes measured at another N answer a different question",
                              "drop measure.params, or give the target as target.slack over the baseline's loss")


def load_study_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> StudyConfig:
    """Read and validate a study YAML (+ ``key.sub=value`` overrides)."""
    return from_dict(StudyConfig, inherit_study_settings(load_yaml(path, overrides)))


def inherit_study_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """A proxy sweep trains shapes like the study's unless it says otherwise: where a sweep does
    not set ``n_layers``, ``head_dim`` or ``build``, it takes the study's ``n_layers``,
    ``search_space.head_dim`` and ``search_space.build``, so a config states each value once."""
    proxy, space = raw.get("proxy"), raw.get("search_space")
    if not isinstance(proxy, dict):
        return raw
    space = space if isinstance(space, dict) else {}
    study = {"n_layers": raw.get("n_layers"), "head_dim": space.get("head_dim"), "build": space.get("build")}
    sweeps = [proxy.get("sweep")] + list(proxy.get("sweeps") or []) if isinstance(proxy.get("sweeps"), list) \
        else [proxy.get("sweep")]
    for sweep in sweeps:
        if isinstance(sweep, dict):
            for key, value in study.items():
                if value is not None and key not in sweep:
                    sweep[key] = value
    return raw

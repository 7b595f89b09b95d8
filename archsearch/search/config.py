"""The study config: one YAML file -> one typed, validated :class:`StudyConfig`.

Everything a study needs is here (SPEC section 4): the target (N, D, layers), the baseline
whose predicted loss sets the target loss, the search space, the proxy plan, the law, the
measurement plan, the Optuna settings, the local GQA search, optional limits, and the
optional full training and evaluation. Validation happens before any work starts, and errors
name the dotted field (``search_space.gqa[1]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archsearch.candidates import BuildSettings
from archsearch.cluster.config import ClusterConfig
from archsearch.errors import ArchsearchError

BACKENDS = ("vllm", "sglang", "hf", "analytic")
LAW_FORMS = ("conditional-multiplicative", "conditional-additive")
SAMPLERS = ("tpe", "random", "nsga2", "gp")


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


@dataclass(frozen=True)
class TargetConfig:
    """L_t: explicit ``loss``, or the baseline's predicted loss times (1 + slack)."""

    loss: float | None = None
    slack: float = 0.0

    def __post_init__(self) -> None:
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
    gqa: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
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
            raise ArchsearchError("search_space.gqa", "is empty", "list at least one GQA value, e.g. [4]")
        for i, g in enumerate(self.gqa):
            if g <= 0:
                raise ArchsearchError(f"search_space.gqa[{i}]", f"must be positive, got {g}")


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy runs: reuse a run table, or train one sweep or several (``trainers.SweepConfig``
    fields each; e.g. the shape grid plus a reference sweep at other token budgets, which a
    Chinchilla reference needs)."""

    runs: str | None = None
    sweep: dict[str, Any] | None = None
    sweeps: list[dict[str, Any]] | None = None
    # a folder shared by studies: proxy runs live there keyed by what determines them, so a
    # run another study trained is reused and only missing runs are trained
    store: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.runs, self.sweep, self.sweeps)) != 1:
            raise ArchsearchError("proxy", "needs exactly one of runs (a run table to reuse), sweep "
                                  "(a sweep to train) or sweeps (a list of them)")
        if self.sweeps is not None and not self.sweeps:
            raise ArchsearchError("proxy.sweeps", "is empty")

    def sweep_dicts(self) -> list[tuple[str, dict[str, Any]]]:
        """(config path for errors, sweep mapping) of every sweep to train."""
        if self.sweep is not None:
            return [("proxy.sweep", self.sweep)]
        return [(f"proxy.sweeps[{i}]", d) for i, d in enumerate(self.sweeps or [])]


@dataclass(frozen=True)
class LawConfig:
    form: str = "conditional-multiplicative"
    reference: str = "chinchilla"
    bootstrap: int = 200
    r_range: tuple[float, float] | None = (0.5, 5.0)
    # runs within this relative distance in N (and D) are one size; match it to the build
    # tolerance, since snapped shapes land anywhere within it of their budget
    size_tolerance: float = 0.05
    file: str | None = None  # a fitted or hand-written law JSON: skips the fit

    def __post_init__(self) -> None:
        if self.form not in LAW_FORMS:
            raise ArchsearchError("law.form", f"{self.form!r} is not a conditional law",
                                  f"use one of {list(LAW_FORMS)}")
        if self.reference not in ("chinchilla", "best-observed"):
            raise ArchsearchError("law.reference", f"{self.reference!r} is unknown",
                                  "use chinchilla or best-observed")
        if self.bootstrap < 0:
            raise ArchsearchError("law.bootstrap", "must be >= 0")
        if not 0 < self.size_tolerance < 1:
            raise ArchsearchError("law.size_tolerance", f"must be in (0, 1), got {self.size_tolerance}")


@dataclass(frozen=True)
class MeasureConfig:
    backend: str = "vllm"
    # Used only where ``backend`` is not installed, and then said in the report's first line.
    fallback_backend: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    reference_batch_size: int | None = None  # the objective's batch size; default: the largest
    input_len: int = 4096
    output_len: int = 1024
    warmup: int = 1
    repeats: int = 5
    dtype: str = "auto"
    timeout_s: float = 1800.0
    device_spec: str | None = None  # analytic backend: which GPU to predict for
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in ("backend", "fallback_backend"):
            v = getattr(self, f)
            if v is not None and v not in BACKENDS:
                raise ArchsearchError(f"measure.{f}", f"unknown backend {v!r}", f"use one of {list(BACKENDS)}")
        self.bench_settings(self.backend)  # the measurement's own checks, named under measure.
        if self.reference_batch_size is not None and self.reference_batch_size not in self.batch_sizes:
            raise ArchsearchError("measure.reference_batch_size",
                                  f"{self.reference_batch_size} is not among batch_sizes {self.batch_sizes}")

    def bench_settings(self, backend: str):
        """The ``benchmarks.BenchSettings`` this plan measures with on ``backend``."""
        from benchmarks.base import BenchSettings

        try:
            return BenchSettings(backend=backend, batch_sizes=list(self.batch_sizes), input_len=self.input_len,
                                 output_len=self.output_len, warmup=self.warmup, repeats=self.repeats,
                                 dtype=self.dtype, timeout_s=self.timeout_s, device_spec=self.device_spec,
                                 engine_args=dict(self.engine_args))
        except ArchsearchError as e:
            raise ArchsearchError(f"measure.{e.field}", e.problem, e.fix) from None

    @property
    def ref_batch(self) -> int:
        return self.reference_batch_size or max(self.batch_sizes)


@dataclass(frozen=True)
class OptunaConfig:
    storage: str | None = None  # default: sqlite:///<study dir>/optuna.db
    sampler: str = "tpe"
    seed: int = 0
    n_trials: int = 12  # distinct shapes to measure in total, across workers and resumes
    max_trials: int | None = None  # cap incl. pruned/failed ones; default 10 x n_trials
    objective: str = "throughput"  # or "pareto": throughput vs predicted loss, two objectives
    # seed the study with this many shapes from the law's solution (the loss optimum first, then
    # the feasible shapes a roofline ranks fastest); 0: the sampler starts on its own
    enqueue_solution: int = 3
    measure_infeasible: bool = False  # measure candidates that break the loss constraint too

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ArchsearchError("optuna.sampler", f"unknown sampler {self.sampler!r}", f"use one of {list(SAMPLERS)}")
        if self.objective not in ("throughput", "pareto"):
            raise ArchsearchError("optuna.objective", f"{self.objective!r} is unknown", "use throughput or pareto")
        if self.n_trials <= 0:
            raise ArchsearchError("optuna.n_trials", "must be positive")
        if self.enqueue_solution < 0:
            raise ArchsearchError("optuna.enqueue_solution", "must be >= 0")


@dataclass(frozen=True)
class GQASearchConfig:
    enabled: bool = True
    baseline_gqa: int = 4


@dataclass(frozen=True)
class LimitsConfig:
    max_ttft_s: float | None = None
    max_tpot_s: float | None = None
    max_peak_memory_gib: float | None = None


@dataclass(frozen=True)
class FinalTrainConfig:
    enabled: bool = False
    tokens: float | None = None  # default: the study's tokens
    train: dict[str, Any] = field(default_factory=dict)  # trainers.TrainConfig fields
    data: dict[str, Any] | None = None  # trainers.DataConfig fields; default: the proxy sweep's


@dataclass(frozen=True)
class EvalConfig:
    enabled: bool = False
    tasks: str = "offline"
    limit: int | None = None
    batch_size: int = 8


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
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    mode: str = "algorithm5"  # or "predict-rank-select"
    top_k: int = 3  # predict-rank-select: distinct feasible shapes trained and evaluated
    # predict-rank-select: candidates within this (absolute) mean accuracy of the best are tied;
    # the fastest of them is released
    release_accuracy_tolerance: float = 0.01
    final_train: FinalTrainConfig = field(default_factory=FinalTrainConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # where proxy/measurement jobs run
    vocab_size: int | None = None  # default: the proxies' tokenizer's (bpe:N, smollm2); else required
    tie_embeddings: bool = False
    out: str | None = None  # default: results/<name>

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in "/\\ "):
            raise ArchsearchError("name", f"{self.name!r} must be a non-empty name without slashes or spaces")
        if not self.params > 0:
            raise ArchsearchError("params", f"must be positive, got {self.params}")
        if not self.tokens > 0:
            raise ArchsearchError("tokens", f"must be positive, got {self.tokens}")
        if self.n_layers <= 0:
            raise ArchsearchError("n_layers", f"must be positive, got {self.n_layers}")
        if self.mode not in ("algorithm5", "predict-rank-select"):
            raise ArchsearchError("mode", f"{self.mode!r} is unknown", "use algorithm5 or predict-rank-select")
        if self.top_k <= 0:
            raise ArchsearchError("top_k", "must be positive")
        if not 0 <= self.release_accuracy_tolerance < 1:
            raise ArchsearchError("release_accuracy_tolerance", f"must be in [0, 1), got "
                                  f"{self.release_accuracy_tolerance}", "e.g. 0.01: one accuracy point")
        if self.proxy is None and self.law.file is None:
            raise ArchsearchError("proxy", "is required unless law.file gives a fitted law",
                                  "add proxy.sweep (train proxies) or proxy.runs (reuse a run table)")

    def out_dir(self, override: str | Path | None = None) -> Path:
        return Path(override or self.out or Path("results") / self.name)


def load_study_config(path: str | Path) -> StudyConfig:
    """Read and validate a study YAML."""
    from archsearch.configio import load_config

    return load_config(StudyConfig, path)

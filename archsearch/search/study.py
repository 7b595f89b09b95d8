"""The Optuna study: trials sample the primary knobs, the law predicts, the engine measures.

Each trial samples (d/sqrt(N), r, GQA); :func:`archsearch.candidates.build_candidate` expands
them into a buildable shape at the study's budget; the fitted law predicts its loss (with a
bootstrap interval); the constraint ``predicted_loss - L_t <= 0`` goes to the sampler as a
trial constraint (a shape that breaks it, or lies outside the law's fitted range, completes as
an infeasible trial, unmeasured; :mod:`archsearch.search.margins`); the
objective is the measured output throughput at the reference batch size (or, with ``objective: pareto``, throughput and predicted loss).

Durability: the study lives in an Optuna storage (SQLite in the study folder by default, any
SQLAlchemy URL, or a journal file ``*.log`` for several workers on a shared disk). A trial
that was running when its process died is failed on the next start and its parameters are
enqueued again; its measurement, if it had finished, is read back from the measurement
store, so nothing is lost or measured twice.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import sqlite3
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from archsearch.arch import ArchSpec, describe
from archsearch.benchmarks import BenchSettings, measure
from archsearch.benchmarks.calibration import Calibration
from archsearch.candidates import BuildSettings
from archsearch.configio import redact
from archsearch.errors import ArchsearchError
from archsearch.hardware import local_device_name
from archsearch.laws import solve
from archsearch.logs import get_logger
from archsearch.search import log, margins
from archsearch.search.config import StudyConfig, gqa_bound_violation
from archsearch.search.derived import expand, measure_scale, proxy_sweeps
from archsearch.search.measurements import Measurer, check_result_limits, file_lock, spec_key
from archsearch.search.targets import multi_target_objective, predicted_ratio_fn, ranking_label
from archsearch.search.trials import MeasurementFailed, record_measurement, set_constraint
from archsearch.trainers.config import check_trackers

# Constraint value of a trial whose shape could not be built (never feasible).
UNBUILDABLE = 1e6


def _no_traceback_for_failed_measurements(record) -> bool:
    """A logging filter: Optuna logs a caught trial error with its traceback; a failed
    measurement is expected (its reason is in the line and in the trial), so drop the trace."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, MeasurementFailed):
        record.exc_info = None
    return True


@dataclass
class SearchContext:
    cfg: StudyConfig
    law: Any  # archsearch.laws.FitResult
    target_loss: float
    measurer: Measurer
    out: Path
    build: BuildSettings = field(default_factory=BuildSettings)
    # the shape every candidate is compared with, paired (archsearch.benchmarks.paired); None: each
    # candidate is measured alone and the objective is its absolute throughput
    baseline: ArchSpec | None = None
    # measure.targets (archsearch.search.targets): each with its Measurer; None: the measure block
    targets: list[Any] | None = None

    @property
    def ref_batch(self) -> int:
        return self.cfg.measure.ref_batch


def predict_loss(ctx: SearchContext, spec: ArchSpec) -> tuple[float, tuple[float, float] | None]:
    """Predicted loss (and bootstrap interval) of a shape's ratios at the study's N and D: every
    shape, candidate or baseline, is compared at one budget (snapping moves each one's own N)."""
    loss = float(ctx.law.predict(spec, ctx.cfg.tokens, params=ctx.cfg.params))
    interval = ctx.law.predict_interval(spec, ctx.cfg.tokens, params=ctx.cfg.params)
    return loss, (tuple(float(v) for v in interval) if interval is not None else None)


def loss_bound(ctx: SearchContext, spec: ArchSpec) -> float:
    """What the target is compared with: the predicted loss, or with ``target.confidence`` c
    the loss the shape stays under with probability c, the law's bootstrap and its own error
    against trained models together (a chance constraint, :mod:`archsearch.search.margins`).
    Infinite for a shape outside the law's fitted range unless ``law.allow_extrapolation``."""
    if out_of_range(ctx, spec):
        return math.inf
    c = ctx.cfg.target.confidence
    if c is None:
        return float(ctx.law.predict(spec, ctx.cfg.tokens, params=ctx.cfg.params))
    return margins.upper_bound(ctx.law, spec, ctx.cfg.tokens, ctx.cfg.params, c)


def out_of_range(ctx: SearchContext, spec: ArchSpec) -> str | None:
    """Why ``spec`` is refused as outside the law's fitted range (None: inside, or allowed)."""
    return None if ctx.cfg.law.allow_extrapolation else margins.outside_range(ctx.law, spec)


def outside_gqa_bounds(cfg: StudyConfig, spec: ArchSpec) -> str | None:
    """Why ``spec``'s head pair is refused by the GQA bounds (None: within them). The bounds are
    the local GQA search's (``gqa_search.bounds``): where no proxy checks what GQA does to loss,
    the search samples no shape the walk could not admit, so its best trial is one the walk
    starts from rather than one it must discard."""
    max_gqa, min_kv, why = cfg.gqa_search.bounds(bool(proxy_sweeps(cfg)))
    beyond = gqa_bound_violation(spec.n_heads // spec.n_kv_heads, spec.n_kv_heads, max_gqa, min_kv)
    return f"{beyond} ({why})" if beyond else None


def loss_margin(ctx: SearchContext, spec: ArchSpec) -> dict[str, Any]:
    """The shape's margin to the target and its verdict (``margins.margin``), marked
    ``extrapolated`` where it lies outside the law's fitted range."""
    m = margins.margin(ctx.law, spec, ctx.cfg.tokens, ctx.cfg.params, ctx.target_loss,
                       ctx.cfg.target.confidence).to_dict()
    outside = margins.outside_range(ctx.law, spec)
    if outside:
        m["extrapolated"] = outside
    return m


# -- storage and sampler ---------------------------------------------------------------------

def storage_url(cfg: StudyConfig, out: Path) -> str:
    # relative like the study folder itself (sqlite:///runs/x/optuna.db), so the URL in a
    # committed report opens from the repository root on any machine
    return cfg.optuna.storage or f"sqlite:///{out / 'optuna.db'}"


def journal_path(url: str) -> Path | None:
    """The file of a journal storage URL (``journal:PATH`` or ``*.log``); None for a database."""
    if url.startswith("journal:"):
        return Path(url[len("journal:"):])
    return Path(url) if url.endswith(".log") else None


def check_storage(url: str, field: str = "optuna.storage") -> None:
    """Open a storage URL now, before any work, and create nothing: a journal or SQLite file's
    folder exists and is writable and an existing file is what it should be; a database's driver
    is installed and a connection is made. Errors show the URL with its password masked."""
    shown = redact(url)
    path = journal_path(url)
    if path is None and url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        db = make_url(url).database
        if not db or db == ":memory:" or db.startswith("file:"):
            raise ArchsearchError(field, f"{shown!r} names no SQLite file", "e.g. sqlite:///results/x/optuna.db")
        path = Path(db)
    if path is not None:
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ArchsearchError(field, f"{shown!r}: the folder {str(parent)!r} does not exist",
                                  "create it first, or give a file in an existing folder")
        if path.is_dir():
            raise ArchsearchError(field, f"{shown!r}: {str(path)!r} is a folder", "give a file path")
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.R_OK | os.W_OK)):
            raise ArchsearchError(field, f"{shown!r}: cannot write {str(path)!r} (permission denied)",
                                  "give a writable path")
        if path.exists() and path.stat().st_size and url.startswith("sqlite:"):
            _check_sqlite_file(path, shown, field)
        return
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(url, connect_args=_connect_timeout(url))
    except Exception as e:  # noqa: BLE001 - a missing driver (ImportError), a bad URL: said below
        raise ArchsearchError(field, f"{shown!r} cannot be used: no installed driver for it "
                              f"({redact(str(e)).splitlines()[0]})",
                              "install the database's driver (postgresql+psycopg://, mysql+pymysql://), or use "
                              "sqlite:///PATH or a journal file.log") from None
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:  # noqa: BLE001 - any failure to connect is the user's URL or server
        first = redact(str(getattr(e, "orig", None) or e)).strip().splitlines() or [type(e).__name__]
        raise ArchsearchError(field, f"cannot connect to {shown!r} ({first[0]})",
                              "check the host, port, user and that the server is running") from None
    finally:
        engine.dispose()


def _connect_timeout(url: str) -> dict[str, Any]:
    """A short connect timeout for the drivers that take one, so a wrong host fails in seconds."""
    return {"connect_timeout": 10} if url.startswith(("postgresql", "mysql", "mariadb")) else {}


def _check_sqlite_file(path: Path, shown: str, field: str) -> None:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as e:
        raise ArchsearchError(field, f"{shown!r}: {str(path)!r} is not a usable SQLite database ({e})",
                              "give a new file, or the optuna.db of a study") from None


def make_storage(url: str):
    """An Optuna storage from a URL: ``*.log`` / ``journal:PATH`` -> journal file, else RDB."""
    import optuna

    if url.startswith("journal:") or url.endswith(".log"):
        from optuna.storages.journal import JournalFileBackend

        path = journal_path(url)
        if not path.parent.is_dir():  # checked at load too: a typo must not create folders
            raise ArchsearchError("optuna.storage", f"the folder {str(path.parent)!r} does not exist",
                                  "create it first, or give a file in an existing folder")
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:"):
        # one host: stale trials are recovered by process id (see recover_stale_trials)
        return _sqlite_storage(url)
    # a cluster database: workers on other hosts are watched by Optuna's heartbeat
    return optuna.storages.RDBStorage(
        url, heartbeat_interval=30, grace_period=120,
        failed_trial_callback=optuna.storages.RetryFailedTrialCallback(max_retry=2))


def _sqlite_storage(url: str):
    """An RDB storage on SQLite whose every transaction begins ``BEGIN IMMEDIATE``.

    Optuna hands a waiting (enqueued) trial to a worker by reading it as WAITING and then
    writing RUNNING, relying on ``SELECT ... FOR UPDATE``; SQLite ignores ``FOR UPDATE`` and
    Python's sqlite3 driver opens its transaction only at the write, so two workers can both read
    WAITING and both run the same trial: the second to finish fails with "Cannot tell a COMPLETE
    trial" (optuna/optuna#4002; a seeded study with two workers hit it in CI). Taking SQLite's
    write lock when each transaction begins makes the read and the write one step; the busy
    timeout (60 s) makes a second worker wait its turn instead of failing."""
    import optuna
    from sqlalchemy import event

    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    # SQLAlchemy's recipe for pysqlite: the driver emits no BEGIN of its own, the engine emits
    # ours; the connections Optuna opened while creating the tables are dropped. Each process
    # opens its own storage (make_storage); a storage pickled to another process would get a
    # new engine without these listeners.
    event.listen(storage.engine, "connect", _driver_emits_no_begin)
    event.listen(storage.engine, "begin", _begin_immediate)
    storage.engine.dispose()
    return storage


def _driver_emits_no_begin(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None


def _begin_immediate(conn) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_sampler(cfg: StudyConfig):
    import optuna

    o = cfg.optuna
    if o.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=o.seed, n_startup_trials=min(5, o.n_trials), multivariate=True)
    if o.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=o.seed)
    if o.sampler == "gp":
        return optuna.samplers.GPSampler(seed=o.seed)
    return optuna.samplers.RandomSampler(seed=o.seed)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# a running trial's worker writes a heartbeat this often; one on another host silent for
# HEARTBEAT_GRACE_S is taken for dead (on this host the worker's process id says at once)
HEARTBEAT_S = 10.0
HEARTBEAT_GRACE_S = 60.0


@contextlib.contextmanager
def heartbeat(trial, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Write the time into the trial's system attribute ``heartbeat`` every ``every_s`` seconds
    while the trial runs, so a worker on another host can tell this one died."""
    storage, tid, stop = trial.storage, trial._trial_id, threading.Event()

    def beat() -> None:
        while True:
            try:
                storage.set_trial_system_attr(tid, "heartbeat", time.time())
            except Exception:  # noqa: BLE001 - the trial just finished (or its storage closed): nothing to beat for
                return
            if stop.wait(every_s):
                return

    th = threading.Thread(target=beat, name="archsearch-heartbeat", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def recover_stale_trials(study, storage, grace_s: float = 10.0,
                         heartbeat_grace_s: float = HEARTBEAT_GRACE_S) -> list[int]:
    """Fail trials left RUNNING by a dead worker and enqueue their parameters: on this host a
    worker whose process is gone, on another host one whose heartbeat has been silent for
    ``heartbeat_grace_s`` seconds.

    A worker names itself on a trial in the objective's first line; a trial with no worker is a
    live worker's only for the instant between Optuna creating it and that line, so one still
    without a worker ``grace_s`` after it started belongs to a process killed in that instant."""
    from optuna.trial import TrialState

    def running():
        return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def age(t) -> float:
        return time.time() - t.datetime_start.timestamp() if t.datetime_start else grace_s

    youngest = min((age(t) for t in running() if not t.user_attrs.get("worker")), default=grace_s)
    if youngest < grace_s:
        time.sleep(grace_s - youngest)
    recovered = []
    for t in running():
        w = t.user_attrs.get("worker") or {}
        dead = w.get("host") == platform.node() and w.get("pid") and not _pid_alive(int(w["pid"]))
        beat = t.system_attrs.get("heartbeat")
        if w and w.get("host") != platform.node() and beat is not None and time.time() - float(beat) > heartbeat_grace_s:
            dead = True
        if dead or (not w and age(t) >= grace_s):
            storage.set_trial_user_attr(t._trial_id, "failure_reason",
                                        "its worker process died; parameters enqueued again")
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            if t.params:
                study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            recovered.append(t.number)
    return recovered


# -- the objective -----------------------------------------------------------------------------

def _distribution_ranges(cfg: StudyConfig, law=None) -> dict[str, Any]:
    """The knobs' sampling ranges: the search box, within the law's fitted range unless
    ``law.allow_extrapolation`` (a trial outside it would only be refused)."""
    s = cfg.search_space
    allow = cfg.law.allow_extrapolation or law is None
    return {"hidden_over_sqrt_n": (margins.search_box(s.hidden_over_sqrt_n, law, "hidden_over_sqrt_n", allow),
                                   s.hidden_over_sqrt_n_step or None),
            "mlp_to_attn": (margins.search_box(s.mlp_to_attn, law, "mlp_to_attn", allow), s.mlp_to_attn_step or None)}


def _suggest(trial, cfg: StudyConfig, law=None) -> tuple[float, float, int]:
    rng = _distribution_ranges(cfg, law)
    (lo1, hi1), step1 = rng["hidden_over_sqrt_n"]
    (lo2, hi2), step2 = rng["mlp_to_attn"]
    x1 = trial.suggest_float("hidden_over_sqrt_n", lo1, hi1, step=step1)
    r = trial.suggest_float("mlp_to_attn", lo2, hi2, step=step2, log=step2 is None)
    g = trial.suggest_categorical("gqa", list(cfg.search_space.gqa))
    return x1, r, int(g)


def objective(trial, ctx: SearchContext):
    """One trial: the worker names itself on it, and beats while it runs (recover_stale_trials)."""
    trial.set_user_attr("worker", {"host": platform.node(), "pid": os.getpid()})
    with heartbeat(trial):
        return _objective(trial, ctx)


def _objective(trial, ctx: SearchContext):
    import optuna

    cfg = ctx.cfg
    trial.set_user_attr("worker", {"host": platform.node(), "pid": os.getpid()})
    x1, r, g = _suggest(trial, cfg, ctx.law)
    try:
        spec = expand(cfg, ctx.build, x1, r, g)
    except ArchsearchError as e:
        set_constraint(trial, "predicted_loss_minus_target", UNBUILDABLE)
        set_constraint(trial, "limits_violated", 0.0)
        trial.set_user_attr("pruned_reason", f"unbuildable: {e}")
        raise optuna.TrialPruned(f"unbuildable: {e}") from None
    trial.set_user_attr("spec", spec.to_dict())
    trial.set_user_attr("spec_key", spec_key(spec))
    for k, v in realised_attrs(spec).items():
        trial.set_user_attr(k, v)
    loss, interval = predict_loss(ctx, spec)
    trial.set_user_attr("predicted_loss", loss)
    trial.set_user_attr("predicted_loss_interval", interval)
    trial.set_user_attr("loss_margin", loss_margin(ctx, spec))
    # refused, unmeasured: outside the law's fitted range the law says nothing it was fitted to
    # say; beyond the GQA bound nothing checks what GQA does to loss
    refusal = None
    if why := out_of_range(ctx, spec):
        refusal = f"{why}; not measured (law.allow_extrapolation: false)"
    elif why := outside_gqa_bounds(cfg, spec):
        refusal = f"{why}; not measured"
    if refusal:
        set_constraint(trial, "predicted_loss_minus_target", UNBUILDABLE)
        set_constraint(trial, "limits_violated", 0.0)
        trial.set_user_attr("feasible_loss", False)
        trial.set_user_attr("measured", False)
        trial.set_user_attr("infeasible_reason", refusal)
        return (0.0, loss) if cfg.optuna.objective == "pareto" else 0.0
    bound = loss_bound(ctx, spec)
    if cfg.target.confidence is not None:
        trial.set_user_attr("loss_upper_bound", {"level": cfg.target.confidence, "value": bound})
    violation = bound - ctx.target_loss
    set_constraint(trial, "predicted_loss_minus_target", violation)
    feasible = violation <= 0
    trial.set_user_attr("feasible_loss", feasible)
    if not feasible and not cfg.optuna.measure_infeasible and cfg.optuna.objective == "throughput":
        # An infeasible trial, as Optuna's samplers and dashboard read one: complete, with its
        # constraint value > 0. Optuna needs a value; 0 marks "not measured", and every reader of
        # measurements skips it (was_measured).
        what = (f"predicted loss {loss:.4f}" if cfg.target.confidence is None else
                f"predicted loss {loss:.4f} ({cfg.target.confidence:.0%} upper bound {bound:.4f}, the law's "
                "bootstrap and its own error)")
        trial.set_user_attr("measured", False)
        trial.set_user_attr("infeasible_reason", f"{what} > target {ctx.target_loss:.4f}; not measured")
        set_constraint(trial, "limits_violated", 0.0)  # not measured, so no limit was broken
        return 0.0

    if ctx.targets:
        return multi_target_objective(trial, ctx, spec, loss)
    if ctx.baseline is not None:
        return _paired_objective(trial, ctx, spec, loss)
    m = ctx.measurer.measure(spec)
    result = m.result
    trial.set_user_attr("throughput", {str(b.batch_size): b.output_throughput for b in result.per_batch})
    trial.set_user_attr("ttft", {str(b.batch_size): b.ttft_mean for b in result.per_batch})
    tput = result.throughput(ctx.ref_batch)
    failed = {str(b.batch_size): b.error for b in result.per_batch if not b.ok}
    if failed:  # the other batch sizes are kept; only the objective's own batch size decides
        trial.set_user_attr("failed_batches", failed)
    record_measurement(trial, m, result.backend, None if tput is not None else
            failed.get(str(ctx.ref_batch)) or result.error or f"no throughput at batch size {ctx.ref_batch}")
    return _measured(trial, ctx, result.batch(ctx.ref_batch), tput, loss)


def _measured(trial, ctx: SearchContext, batch, value: float, loss: float):
    """A measured trial's limits (on its reference batch, a constraint) and objective value(s)."""
    trial.set_user_attr("measured", True)
    ok, why = check_result_limits(ctx.cfg.limits, batch, ctx.ref_batch)
    if not ok:
        trial.set_user_attr("limits_reason", why)
    set_constraint(trial, "limits_violated", 0.0 if ok else 1.0)
    return (value, loss) if ctx.cfg.optuna.objective == "pareto" else value


# Objective names, as Optuna's dashboard and ``study.trials_dataframe()`` show them.
# (paired studies: the objective is the throughput ratio to the baseline)
METRIC_NAMES = {"throughput": ["output_throughput_tok_per_s"],
                "pareto": ["output_throughput_tok_per_s", "predicted_loss"]}
PAIRED_METRIC_NAMES = {"throughput": ["throughput_ratio_vs_baseline"],
                       "pareto": ["throughput_ratio_vs_baseline", "predicted_loss"]}


def realised_attrs(spec: ArchSpec) -> dict[str, Any]:
    """The shape a trial's knobs realised, as flat user attributes beside the requested knobs."""
    d = describe(spec)
    return {"realised_hidden_size": spec.hidden_size, "realised_n_heads": spec.n_heads,
            "realised_n_kv_heads": spec.n_kv_heads, "realised_ffn": spec.ffn,
            "realised_n_params_non_embedding": d["n_params_non_embedding"],
            "realised_hidden_over_sqrt_n": d["hidden_over_sqrt_n"],
            "realised_mlp_to_attn": d["mlp_to_attn_ratio"], "realised_gqa": d["gqa"]}


def was_measured(t) -> bool:
    """A completed trial whose shape was measured (not one completed as loss-infeasible
    without a measurement; studies from before that attribute were all measured)."""
    from optuna.trial import TrialState

    return t.state == TrialState.COMPLETE and t.user_attrs.get("measured", True) is not False


def _paired_objective(trial, ctx: SearchContext, spec: ArchSpec, loss: float):
    """Measure ``spec`` paired with the baseline; the objective is the throughput ratio's
    estimate (the geometric mean of per-round ratios), its interval kept in the user attrs."""
    cfg = ctx.cfg
    if spec == ctx.baseline:  # its ratio to itself is 1 by definition: measuring it would measure noise
        trial.set_user_attr("measured", False)
        trial.set_user_attr("is_baseline", True)
        set_constraint(trial, "limits_violated", 0.0)
        return (1.0, loss) if cfg.optuna.objective == "pareto" else 1.0
    m = ctx.measurer.compare([ctx.baseline, spec])
    pr = m.result
    record_measurement(trial, m, pr.settings.get("backend"),
            None if pr.ok else pr.error or "the paired measurement gave fewer than two rounds")
    iv = ctx.measurer.instance_var()
    est = pr.estimate(1, instance_var=iv)
    batch = pr.batch_result(1)
    trial.set_user_attr("throughput", {str(ctx.ref_batch): batch.output_throughput})
    trial.set_user_attr("baseline_throughput", pr.throughput(0))
    trial.set_user_attr("ttft", {str(ctx.ref_batch): batch.ttft_mean})
    trial.set_user_attr("ratio", est.to_dict())
    trial.set_user_attr("rounds", len(pr.rounds))
    if iv > 0 or pr.twin:
        trial.set_user_attr("instance_sd", iv ** 0.5)
    if pr.timing.get("group_size"):
        trial.set_user_attr("group_size", pr.timing["group_size"])
    return _measured(trial, ctx, batch, est.ratio, loss)


def trial_is_feasible(t) -> bool:
    cons = t.user_attrs.get("constraints")
    return bool(cons) and all(c <= 0 for c in cons.values())


def open_storage(url: str, lock_dir: Path):
    """``make_storage`` under a file lock: two workers opening a new SQLite file at once
    otherwise race on Optuna's schema creation (UNIQUE constraint on alembic_version).
    Workers on other hosts share no lock: create the study once before starting them."""
    with file_lock(Path(lock_dir) / ".storage.lock"):
        return make_storage(url)


def create_study(ctx: SearchContext, load_only: bool = False):
    import optuna

    cfg = ctx.cfg
    storage = open_storage(storage_url(cfg, ctx.out), ctx.out)
    directions = ["maximize", "minimize"] if cfg.optuna.objective == "pareto" else ["maximize"]
    if load_only:
        return optuna.load_study(study_name=cfg.name, storage=storage), storage
    with file_lock(ctx.out / ".storage.lock"):
        study = optuna.create_study(study_name=cfg.name, storage=storage, sampler=make_sampler(cfg),
                                    directions=directions, load_if_exists=True)
        if study.metric_names is None:
            with warnings.catch_warnings():  # experimental since Optuna 3.2, stable in use
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                names = PAIRED_METRIC_NAMES if ctx.baseline is not None else METRIC_NAMES
                study.set_metric_names(names[cfg.optuna.objective])
    return study, storage


def box_grid(cfg: StudyConfig, n: int = 9, law=None):
    """A log-spaced grid over the search box (within the law's fitted range, as trials sample
    it), for scans of the law."""
    import numpy as np

    rng = _distribution_ranges(cfg, law)
    return np.geomspace(*rng["hidden_over_sqrt_n"][0], n), np.geomspace(*rng["mlp_to_attn"][0], n)


def scan_law(ctx: SearchContext, throughput_fn=None):
    """The law's constrained solution over the search box (laws.solve on the box grid)."""
    cfg = ctx.cfg
    s = cfg.search_space
    g0 = cfg.gqa_search.baseline_gqa if cfg.gqa_search.baseline_gqa in s.gqa else s.gqa[0]
    return solve(ctx.law, cfg.params, cfg.tokens, cfg.n_layers, ctx.target_loss, throughput_fn,
                 gqa=g0, head_dim=s.head_dim, build=ctx.build, grid=box_grid(cfg, law=ctx.law),
                 within=None if cfg.law.allow_extrapolation else ctx.law.shape_range()), g0


def seed_points(ctx: SearchContext) -> list[dict[str, Any]]:
    """The law's solution as starting points: the loss-optimal shape (closed form when the law
    has an interior optimum, else the scan's lowest loss), then the feasible shapes the law and
    an analytic throughput predictor rank highest (docs/method.md section 4, stage 3: search)."""
    cfg = ctx.cfg
    if cfg.optuna.enqueue_solution <= 0:  # the sampler starts on its own
        return []
    ranges = _distribution_ranges(cfg, ctx.law)  # the box within the law's fitted range
    box1, box2 = ranges["hidden_over_sqrt_n"][0], ranges["mlp_to_attn"][0]
    clip = lambda v, lo_hi: min(max(v, lo_hi[0]), lo_hi[1])  # noqa: E731
    if ctx.targets and cfg.optuna.enqueue_solution > 1:  # the targets' aggregate predicted ratio
        tf = predicted_ratio_fn(ctx)
    else:
        device = ranking_device(cfg) if cfg.optuna.enqueue_solution > 1 else None
        tf = analytic_throughput_fn(ctx, device) if device else None
    res, g0 = scan_law(ctx, tf)
    if res.optimum is not None:
        best = (res.optimum.hidden_over_sqrt_n, res.optimum.mlp_to_attn_ratio)
    else:
        p = min((p for p in res.points if p.predicted_loss is not None), key=lambda p: p.predicted_loss)
        best = (p.hidden_over_sqrt_n, p.mlp_to_attn_ratio)
    points = [{"hidden_over_sqrt_n": clip(best[0], box1), "mlp_to_attn": clip(best[1], box2), "gqa": g0}]
    ranked = sorted((p for p in res.feasible if p.throughput is not None), key=lambda p: -p.throughput)
    for p in ranked[: max(0, cfg.optuna.enqueue_solution - 1)]:
        points.append({"hidden_over_sqrt_n": clip(p.hidden_over_sqrt_n, box1),
                       "mlp_to_attn": clip(p.mlp_to_attn_ratio, box2), "gqa": g0})
    for pt in points:  # onto the sampling grid, so enqueued values are valid choices
        for name, ((lo, hi), step) in ranges.items():
            if step:
                k = min(max(round((pt[name] - lo) / step), 0), math.floor((hi - lo) / step + 1e-9))
                pt[name] = lo + k * step
    return points


def ranking_device(cfg: StudyConfig) -> str | None:
    """The device whose roofline ranks the seed shapes: the one the study names
    (``measure.bench.device_spec``), else the one its measurements run on (the local GPU, or this CPU
    where there is none). None, with a message, for a GPU the table does not know: then only the
    law's optimum seeds the study."""
    if cfg.measure.bench.device_spec:
        return cfg.measure.bench.device_spec
    name = local_device_name()
    if name is None:
        get_logger("search").warning("[search] this GPU is not in the device table: seeds are not ranked by a "
                                     "roofline (set measure.bench.device_spec to rank them)")
    return name


def calibration_label(path: str) -> str:
    """A calibration file as reports name it: the file, its device and engine, what it was fitted on."""
    return Calibration.load(path).describe(path)


def analytic_throughput_fn(ctx: SearchContext, device: str):
    """Predicted throughput at the reference batch size from ``device``'s roofline (ranking only)."""
    m = ctx.cfg.measure
    settings = BenchSettings(backend="analytic", batch_sizes=[ctx.ref_batch], input_len=m.bench.input_len,
                             output_len=m.bench.output_len, warmup=0, repeats=1, device_spec=device,
                             engine_args={"calibration": m.calibration} if m.calibration else {})

    scale = measure_scale(ctx.cfg, ctx.build) or (lambda spec: spec)

    def fn(spec: ArchSpec) -> float | None:  # at the measured scale, as the shapes are measured
        return measure(scale(spec), settings).throughput(ctx.ref_batch)
    return fn


def _progress_callback(n_trials: int):
    """One line per finished trial: the shape, its prediction and its measurement or reason."""
    def cb(study, t) -> None:
        from optuna.trial import TrialState

        ua = t.user_attrs
        spec = ua.get("spec") or {}
        shape = (f"d={spec.get('hidden_size')} heads={spec.get('n_heads')}/{spec.get('n_kv_heads')} "
                 f"ffn={spec.get('ffn')}" if spec else f"knobs {t.params}")
        pl = ua.get("predicted_loss")
        pred = f" pred.loss {pl:.4f}" if pl is not None else ""
        if t.state == TrialState.COMPLETE and ua.get("is_baseline"):
            what = "the baseline itself: x1 by definition, not measured"
        elif t.state == TrialState.COMPLETE and not was_measured(t):
            what = f"infeasible: {ua.get('infeasible_reason')}"
        elif t.state == TrialState.COMPLETE and ua.get("ratio"):
            q = ua["ratio"]
            what = (f"x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}] vs baseline "
                    f"({ua['rounds']} paired rounds{', with the seed group' if ua.get('group_size') else ''})"
                    f"{' (cached)' if ua.get('measurement_cached') else ''}")
            if ua.get("limits_reason"):
                what += f"; infeasible: {ua['limits_reason']}"
        elif t.state == TrialState.COMPLETE:
            what = f"{t.values[0]:.1f} tok/s{' (cached)' if ua.get('measurement_cached') else ''}"
            if ua.get("limits_reason"):
                what += f"; infeasible: {ua['limits_reason']}"
        else:
            what = f"{t.state.name.lower()}: {ua.get('failure_reason') or ua.get('pruned_reason') or ''}"
        get_logger("search").info(f"[search] trial {t.number} ({distinct_measured(study)}/{n_trials} shapes "
                                  f"measured): {shape}{pred} -> {what}")
    return cb


class TrackerCallback:
    """Reports each finished trial to accelerate's trackers (the ones ``train.log_with``
    takes): measured throughput, predicted loss, feasibility and constraint values, at step =
    trial number, under ``logging_dir/run_name`` for the trackers that write local files."""

    def __init__(self, names: tuple[str, ...], logging_dir: Path, run_name: str):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        check_trackers(names, "optuna.log_with")
        self.trackers = []
        for name in names:
            cls = LOGGER_TYPE_TO_CLASS[name]
            tracker = cls(run_name, logging_dir=str(logging_dir)) if cls.requires_logging_directory else cls(run_name)
            tracker.start()
            self.trackers.append(tracker)

    def __call__(self, study, t) -> None:
        ua = t.user_attrs
        values = {"predicted_loss": ua.get("predicted_loss"), "feasible": float(trial_is_feasible(t)),
                  **{f"constraint/{k}": v for k, v in (ua.get("constraints") or {}).items()}}
        if was_measured(t) and t.values:  # under the study's objective name
            values[(study.metric_names or ["objective"])[0]] = t.values[0]
        values = {k: v for k, v in values.items() if v is not None}
        for tracker in self.trackers:
            tracker.log(values, step=t.number)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()


def distinct_measured(study) -> int:
    """Distinct shapes among completed trials: the study's budget counts these (a trial that
    proposes an already-measured shape completes with its stored value at no cost)."""
    from optuna.trial import TrialState

    return len({t.user_attrs.get("spec_key") for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if was_measured(t)})


class DistinctShapesCallback:
    """Stops the study once ``n`` distinct shapes have been measured (across workers/resumes)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, study, trial) -> None:
        if distinct_measured(study) >= self.n:
            study.stop()


class ExhaustedSpaceCallback:
    """Stops the study when the box has no new shape to give: shapes snap to multiples, so a box
    holds finitely many, and once every one has been proposed the sampler only repeats them (each
    repeat completes at no cost, but a budget larger than the box would spin to ``max_trials``).
    Exhausted means ``patience`` trials in a row proposed no shape the study had not seen
    (at least 100, and 5 per shape seen: a rare shape at the box's edge still gets its chance)."""

    def __init__(self, study, n_trials: int):
        self.seen = {t.user_attrs.get("spec_key") for t in study.get_trials(deepcopy=False)} - {None}
        self.n_trials = n_trials
        self.since_new = 0

    @property
    def patience(self) -> int:
        return max(100, 5 * len(self.seen))

    def __call__(self, study, trial) -> None:
        key = trial.user_attrs.get("spec_key")
        if key is not None and key not in self.seen:
            self.seen.add(key)
            self.since_new = 0
            return
        self.since_new += 1
        if self.since_new >= self.patience:
            study.set_user_attr("space_exhausted", {"distinct_shapes": len(self.seen),
                                                    "measured": distinct_measured(study)})
            log(f"the search space is exhausted: {self.since_new} trials in a row proposed none of its shapes "
                f"that was not proposed before ({len(self.seen)} distinct shapes, {distinct_measured(study)} of "
                f"optuna.n_trials={self.n_trials} measured); stopping. Lower optuna.n_trials or widen the "
                "search space")
            study.stop()


def measure_seeds_together(ctx: SearchContext, study, progress: bool = True) -> int:
    """The enqueued seed shapes (waiting trials) that the loss constraint admits, compared with
    the baseline in one engine process before their trials run (``Measurer.compare_together``):
    each trial then reads its pair, measured in the same time window as the other seeds', at the
    cost of one engine library import and one baseline engine start for all of them."""
    from optuna.trial import TrialState

    specs: list[ArchSpec] = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        p = t.system_attrs.get("fixed_params", t.params)  # what enqueue_trial fixed
        try:
            spec = expand(ctx.cfg, ctx.build, float(p["hidden_over_sqrt_n"]), float(p["mlp_to_attn"]), int(p["gqa"]))
        except (ArchsearchError, KeyError):
            continue  # its trial reports why
        if spec not in specs and spec != ctx.baseline and loss_bound(ctx, spec) <= ctx.target_loss:
            specs.append(spec)
    if len(specs) < 2:
        return 0
    if progress:
        log(f"comparing the {len(specs)} feasible seed shapes with the baseline in one engine process")
    return sum(m.compare_together(ctx.baseline, specs) for m in
               ([t.measurer for t in ctx.targets] if ctx.targets else [ctx.measurer]))


def seed_study(ctx: SearchContext, study) -> None:
    """Record the study's target and enqueue its seed shapes, once, before any worker samples: a
    worker that found the target recorded but the seeds not yet enqueued would sample and measure
    shapes of its own meanwhile, beyond the trials the dry-run plan counts. Workers sharing the
    study folder take turns here (a file lock), so each finds either nothing or the seeds."""
    cfg = ctx.cfg
    with file_lock(ctx.out / ".seeding.lock"):
        if "target_loss" in study.user_attrs:
            if not math.isclose(study.user_attrs["target_loss"], ctx.target_loss, rel_tol=1e-9):
                raise ArchsearchError("target", f"the stored study was run with target loss "
                                      f"{study.user_attrs['target_loss']:.6g}, this config gives "
                                      f"{ctx.target_loss:.6g}", "use a new study name or folder")
            return
        points = seed_points(ctx)
        if ctx.targets:
            ranking = ranking_label(cfg)
        else:
            ranking = (f"{ranking_device(cfg)} roofline calibrated by {calibration_label(cfg.measure.calibration)}"
                       if cfg.measure.calibration else f"uncalibrated {ranking_device(cfg)} roofline (peak figures)")
        how = "law solution" + (f", ranked by the {ranking}" if len(points) > 1 else "")
        for pt in points:
            study.enqueue_trial(pt, user_attrs={"seeded_by": how}, skip_if_exists=True)
        study.set_user_attr("seeded_by", how)
        study.set_user_attr("params", cfg.params)
        study.set_user_attr("tokens", cfg.tokens)
        study.set_user_attr("n_layers", cfg.n_layers)
        study.set_user_attr("target_loss", ctx.target_loss)  # last: the mark that seeding is done


def retry_failed_measurements(study, ctx: SearchContext) -> list[int]:
    """Enqueue again the parameters of trials whose measurement failed (an engine error that may
    be transient) and has been tried fewer than ``measure.max_attempts`` times; the measurer then
    measures the shape anew instead of reading the failure back. Each failed trial is retried
    once (its retry, if it fails too, is the next one's to retry)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    stored = ctx.measurer.store.all()
    out = []
    for t in trials:
        key = t.user_attrs.get("measurement_key")
        rec = stored.get(key) if key else None
        if t.state != TrialState.FAIL or t.number in retried or not t.params or rec is None or rec.get("ok", True):
            continue
        if int(rec.get("attempts", 1)) < ctx.cfg.measure.max_attempts:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            out.append(t.number)
    return out


def restore_lost_measurements(study, ctx: SearchContext) -> list[int]:
    """Measure again the shapes of completed trials whose record is missing from the store (a
    line cut by a killed write is skipped when the store is read), so every trial's measurement
    is on record; returns those trials' numbers."""
    from optuna.trial import TrialState

    stored = ctx.measurer.store.all()
    lost = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if was_measured(t) and t.user_attrs.get("measurement_key") and t.user_attrs["measurement_key"] not in stored]
    for t in lost:
        spec = ArchSpec.from_dict(t.user_attrs["spec"])
        key = t.user_attrs["measurement_key"]
        log(f"trial {t.number}'s measurement record was lost (a torn write): measuring it again")
        if ctx.baseline is not None and key == ctx.measurer.pair_key([ctx.baseline, spec]):
            ctx.measurer.compare([ctx.baseline, spec])
        elif key == ctx.measurer.key(spec):
            ctx.measurer.measure(spec)
        else:
            log(f"trial {t.number}: its measurement was taken with other settings; not measured again")
    return [t.number for t in lost]


def run_study(ctx: SearchContext, progress: bool = True):
    """Create or resume the study and run it until ``n_trials`` trials have completed."""
    import optuna
    cfg = ctx.cfg
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study, storage = create_study(ctx)
    recovered = recover_stale_trials(study, storage)
    seed_study(ctx, study)
    restore_lost_measurements(study, ctx)
    # failed measurements are retried even by a study that has its shapes: a failed shape may be
    # the law's solution; the retries are trials beyond max_trials' count of new proposals
    retried = retry_failed_measurements(study, ctx)
    if retried:
        log(f"measuring again the failed measurements of trials {retried} "
            f"(at most {cfg.measure.max_attempts} attempts each: measure.max_attempts)")
    if ctx.baseline is not None and cfg.optuna.seeds_together:
        measure_seeds_together(ctx, study, progress)
    max_trials = cfg.optuna.max_trials or 10 * cfg.optuna.n_trials
    left = max_trials - len(study.get_trials(deepcopy=False)) + len(retried)
    short = distinct_measured(study) < cfg.optuna.n_trials
    if retried and not short:  # only the retries: no new proposals
        left = len(retried)
    if (short or retried) and left > 0:
        optuna_log = logging.getLogger("optuna.study._optimize")  # where Optuna logs a failed trial
        if _no_traceback_for_failed_measurements not in optuna_log.filters:
            optuna_log.addFilter(_no_traceback_for_failed_measurements)
        tracking = TrackerCallback(cfg.optuna.log_with, ctx.out / "tracking", f"study-{cfg.name}") \
            if cfg.optuna.log_with else None
        try:
            study.optimize(lambda t: objective(t, ctx), n_trials=left,
                           callbacks=([DistinctShapesCallback(cfg.optuna.n_trials),
                                        ExhaustedSpaceCallback(study, cfg.optuna.n_trials)] if short else [])
                           + ([_progress_callback(cfg.optuna.n_trials)] if progress else [])
                           + ([tracking] if tracking else []),
                           catch=(MeasurementFailed,), gc_after_trial=False,
                           show_progress_bar=False)
        finally:
            if tracking:
                tracking.close()
    return study, recovered

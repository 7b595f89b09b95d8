"""The Optuna study of the search stage: created or resumed in its storage
(:mod:`archsearch.search.storage`), seeded once with the law's constrained solution
(:mod:`archsearch.search.solution`), then run trial by trial (:mod:`archsearch.search.objective`,
with :mod:`archsearch.search.callbacks`) until ``optuna.n_shapes`` distinct shapes are measured.

Durability: a trial that was running when its process died is failed on the next start and its
parameters are enqueued again; its measurement, if it had finished, is read back from the
measurement store, so nothing is lost or measured twice; a failed measurement with attempts left
is measured again.
"""

from __future__ import annotations

import logging
import math
import warnings

from archsearch.arch import ArchSpec
from archsearch.errors import ArchsearchError
from archsearch.search import log
from archsearch.search.callbacks import (DistinctShapesCallback, ExhaustedSpaceCallback, TrackerCallback,
                                         distinct_measured, progress_callback, stop_reason)
from archsearch.search.constraint import loss_bound
from archsearch.search.context import SearchContext
from archsearch.search.derived import expand
from archsearch.search.measurements import file_lock
from archsearch.search.objective import (METRIC_NAMES, PAIRED_METRIC_NAMES, make_sampler, objective, trial_spec,
                                         was_measured)
from archsearch.search.solution import calibration_label, ranking_device, seed_points, seed_shape_points
from archsearch.search.storage import (HEARTBEAT_GRACE_S, open_storage, pending_retries, recover_stale_trials,
                                       storage_url, watch_peers)
from archsearch.search.targets import ranking_label
from archsearch.search.trials import MeasurementFailed


def _no_traceback_for_failed_measurements(record) -> bool:
    """A logging filter: Optuna logs a caught trial error with its traceback; a failed
    measurement is expected (its reason is in the line and in the trial), so drop the trace."""
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, MeasurementFailed):
        record.exc_info = None
    return True


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
            spec = trial_spec(ctx, t.user_attrs, float(p["hidden_over_sqrt_n"]), float(p["mlp_to_attn"]), int(p["gqa"]))
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
        for name, pt in seed_shape_points(ctx):  # published shapes, measured as published
            study.enqueue_trial(pt, user_attrs={"seeded_by": f"published shape {name} (optuna.seed_shapes)",
                                                "seed_shape": name})
        study.set_user_attr("seeded_by", how)
        study.set_user_attr("params", cfg.params)
        study.set_user_attr("tokens", cfg.tokens)
        study.set_user_attr("n_layers", cfg.n_layers)
        study.set_user_attr("target_loss", ctx.target_loss)  # last: the mark that seeding is done


def retry_failed_measurements(study, ctx: SearchContext) -> list[int]:
    """Enqueue again, once per shape, the parameters of failed trials whose measurement failed (an
    engine error may be transient) and has been tried fewer than ``measure.max_attempts`` times
    (the store counts the attempts per shape, across runs); the measurer then measures the shape
    anew instead of reading the failure back. A shape whose retry already waits is not enqueued
    twice. Returns the trials retried."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    by_number = {t.number: t for t in trials}
    waiting = {by_number[r.user_attrs["retry_of"]].user_attrs.get("measurement_key")
               for r in pending_retries(study) if r.user_attrs["retry_of"] in by_number}
    stored = ctx.measurer.store.all()
    latest: dict[str, object] = {}  # measurement key -> its newest failed trial
    for t in trials:
        key = t.user_attrs.get("measurement_key")
        rec = stored.get(key) if key else None
        if t.state == TrialState.FAIL and t.params and rec is not None and rec.get("ok", True) is False:
            latest[key] = t
    out = []
    for key, t in latest.items():
        if key not in waiting and int(stored[key].get("attempts", 1)) < ctx.cfg.measure.max_attempts:
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
    """Create or resume the study and run it until it has ``optuna.n_shapes`` distinct shapes
    measured or has spent ``optuna.n_trials`` trials, and no retry waits; logs why it stopped.
    While it runs it watches the other workers (``watch_peers``): a dead peer's trial is failed
    and enqueued within seconds and measured here at this worker's next trial."""
    import optuna
    cfg = ctx.cfg
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study, storage = create_study(ctx)
    recovered = recover_stale_trials(study, storage)
    seed_study(ctx, study)
    restore_lost_measurements(study, ctx)
    # failed measurements are retried even by a study that has its shapes: a failed shape may be
    # the law's solution; the retries are trials beyond optuna.n_trials' count of new proposals
    retried = retry_failed_measurements(study, ctx)
    if retried:
        log(f"measuring again the failed measurements of trials {retried} "
            f"(at most {cfg.measure.max_attempts} attempts each: measure.max_attempts)")
    if ctx.baseline is not None and cfg.optuna.seeds_together:
        measure_seeds_together(ctx, study, progress)
    taken: list[int] = []

    def took_over(numbers: list[int]) -> None:
        taken.extend(numbers)
        log(f"trials {numbers} were left running by a worker that died (its process gone, or its heartbeat "
            f"silent for {HEARTBEAT_GRACE_S:g} s): failed, their shapes enqueued again for this worker's next trial")

    optuna_log = logging.getLogger("optuna.study._optimize")  # where Optuna logs a failed trial
    if _no_traceback_for_failed_measurements not in optuna_log.filters:
        optuna_log.addFilter(_no_traceback_for_failed_measurements)
    tracking = TrackerCallback(cfg.optuna.log_with, ctx.out / "tracking", f"study-{cfg.name}") \
        if cfg.optuna.log_with else None
    try:
        with watch_peers(study, storage, took_over):
            # a retry enqueued while the trials ran (a peer died) is run by one more round
            while True:
                pending = len(pending_retries(study))
                short = distinct_measured(study) < cfg.optuna.n_shapes
                # optuna.n_trials counts the study's own trials run so far (an enqueued seed still
                # waits: it is one of the trials to run); retries come on top
                spent = sum(1 for t in study.get_trials(deepcopy=False)
                            if "retry_of" not in t.user_attrs and t.state.name != "WAITING")
                left = pending + (max(0, cfg.optuna.n_trials - spent) if short else 0)
                if left <= 0 or not (short or pending):
                    break
                study.optimize(lambda t: objective(t, ctx), n_trials=left,
                               callbacks=[DistinctShapesCallback(cfg.optuna.n_shapes),
                                          ExhaustedSpaceCallback(study, cfg.optuna.n_shapes)]
                               + ([progress_callback(cfg.optuna.n_shapes)] if progress else [])
                               + ([tracking] if tracking else []),
                               catch=(MeasurementFailed,), gc_after_trial=False,
                               show_progress_bar=False)
                if not pending_retries(study):
                    break
    finally:
        if tracking:
            tracking.close()
    if taken:
        log(took_over_outcome(study, taken))
    if progress:
        log(stop_reason(study, cfg.optuna.n_shapes, cfg.optuna.n_trials))
    return study, recovered + taken


def took_over_outcome(study, numbers: list[int]) -> str:
    """What became of dead workers' trials ``numbers``: the trial that retried each and its state
    (measured, failed, or still waiting for a worker), as one line."""
    retries = {t.user_attrs.get("retry_of"): t for t in study.get_trials(deepcopy=False) if "retry_of" in t.user_attrs}
    parts = []
    for n in numbers:
        r = retries.get(n)
        if r is None:
            parts.append(f"trial {n}: no retry (it had no parameters yet)")
        elif r.state.name == "COMPLETE":
            parts.append(f"trial {n}: measured again as trial {r.number}" + (" (its measurement read back)"
                                                                             if r.user_attrs.get("measurement_cached") else ""))
        else:
            parts.append(f"trial {n}: its retry, trial {r.number}, is {r.state.name.lower()}"
                         + (f" ({r.user_attrs['failure_reason']})" if r.user_attrs.get("failure_reason") else ""))
    return "dead workers' trials: " + "; ".join(parts)


def load_study(ctx: SearchContext):
    """The stored study, or None when the search stage has not created it yet."""
    try:
        study, _ = create_study(ctx, load_only=True)
    except KeyError:  # optuna: no study of that name in the storage
        return None
    return study

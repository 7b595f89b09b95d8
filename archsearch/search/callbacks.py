"""What runs after each Optuna trial: a progress line, the trackers' records, and the stops (the
study has its distinct shapes; the box has no new shape to give)."""

from __future__ import annotations

from pathlib import Path

from archsearch.logs import get_logger
from archsearch.search import log
from archsearch.search.objective import trial_is_feasible, was_measured
from archsearch.search.storage import pending_retries
from archsearch.trainers.config import check_trackers


def progress_callback(n_shapes: int):
    """One line per finished trial: the shape, its prediction and its measurement or reason; a
    trial that repeats a shape already shown is not shown again (the stop line counts trials)."""
    shown: set[str] = set()

    def cb(study, t) -> None:
        from optuna.trial import TrialState

        ua = t.user_attrs
        key = ua.get("spec_key")
        if key is not None and t.state == TrialState.COMPLETE:
            if key in shown:
                return
            shown.add(key)
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
            what = (f"x{q['ratio']:.3f} vs baseline, predicted (no interval)" if q.get("predicted") else
                    f"x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}] vs baseline "
                    f"({ua['rounds']} paired rounds{', with the seed group' if ua.get('group_size') else ''})")
            what += " (cached)" if ua.get("measurement_cached") else ""
            if ua.get("limits_reason"):
                what += f"; infeasible: {ua['limits_reason']}"
        elif t.state == TrialState.COMPLETE:
            what = f"{t.values[0]:.1f} tok/s{' (cached)' if ua.get('measurement_cached') else ''}"
            if ua.get("limits_reason"):
                what += f"; infeasible: {ua['limits_reason']}"
        else:
            what = f"{t.state.name.lower()}: {ua.get('failure_reason') or ua.get('pruned_reason') or ''}"
        get_logger("search").info(f"[search] trial {t.number} ({distinct_measured(study)}/{n_shapes} shapes "
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
    """Stops the study once ``n`` distinct shapes have been measured (across workers/resumes) and
    no retry waits (a dead worker's trial, a failed measurement's: each is measured)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, study, trial) -> None:
        if distinct_measured(study) >= self.n and not pending_retries(study):
            study.stop()


class ExhaustedSpaceCallback:
    """Stops the study when the box has no new shape to give: shapes snap to multiples, so a box
    holds finitely many, and once every one has been proposed the sampler only repeats them (each
    repeat completes at no cost, but a budget larger than the box would spin to ``optuna.n_trials``).
    Exhausted means ``patience`` trials in a row proposed no shape the study had not seen
    (at least 100, and 5 per shape seen: a rare shape at the box's edge still gets its chance)."""

    def __init__(self, study, n_shapes: int):
        self.seen = {t.user_attrs.get("spec_key") for t in study.get_trials(deepcopy=False)} - {None}
        self.n_shapes = n_shapes
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
                f"optuna.n_shapes={self.n_shapes} measured); stopping. Lower optuna.n_shapes or widen the "
                "search space")
            study.stop()


def stop_reason(study, n_shapes: int, n_trials: int) -> str:
    """Why the search stopped, in one line: it has its ``optuna.n_shapes`` distinct shapes, the
    box had no new shape to give, or it spent ``optuna.n_trials`` trials first."""
    trials = len(study.get_trials(deepcopy=False))
    measured = distinct_measured(study)
    if measured >= n_shapes:
        return (f"search stopped: {measured} distinct shapes measured (optuna.n_shapes={n_shapes}) "
                f"in {trials} Optuna trials")
    if "space_exhausted" in study.user_attrs:
        return (f"search stopped early: the search space has no shape left to propose ({measured} of "
                f"optuna.n_shapes={n_shapes} measured in {trials} trials); widen search_space or lower optuna.n_shapes")
    return (f"search stopped early: optuna.n_trials={n_trials} trials spent with {measured} of "
            f"optuna.n_shapes={n_shapes} distinct shapes measured (the other trials repeated a measured shape, "
            "were infeasible or failed); raise optuna.n_trials")

"""What a search trial records in its Optuna attributes: its constraint values (feasible iff every
value <= 0) and where its measurement is stored; a failed measurement fails the trial."""

from __future__ import annotations

from archsearch.cluster.startup import TrialTimes


class MeasurementFailed(Exception):
    """A candidate's measurement failed: its trial fails, the study goes on."""


# The constraints of every trial, in this order (feasible iff every value <= 0).
CONSTRAINT_KEYS = ("predicted_loss_minus_target", "limits_violated")


def set_constraint(trial, key: str, value: float) -> None:
    """Record one constraint value, named in ``user_attrs['constraints']``. The samplers and
    optuna-dashboard read the values from the system attribute ``constraints`` as a list, the
    form Optuna's own ``constraints_func`` writes (the dashboard does not read the keyed form
    of ``Trial.set_constraint``), so the list is written here, in CONSTRAINT_KEYS order."""
    cons = {**trial.user_attrs.get("constraints", {}), key: float(value)}
    trial.set_user_attr("constraints", cons)
    trial.storage.set_trial_system_attr(trial._trial_id, "constraints",
                                        [cons[k] for k in CONSTRAINT_KEYS if k in cons])


def record_measurement(trial, m, backend: str | None, failure: str | None) -> None:
    """Record where a trial's measurement is stored; a failed one fails the trial."""
    trial.set_user_attr("measurement_key", m.key)
    trial.set_user_attr("measurement_cached", m.cached)
    trial.set_user_attr("backend", backend)
    if failure is not None:
        trial.set_user_attr("failure_reason", failure)
        set_constraint(trial, "limits_violated", 0.0)
        raise MeasurementFailed(failure)


def trial_times(study) -> list[TrialTimes]:
    """The study's started trials as the start-up figures read them (``cluster.startup``): the
    worker each names on itself, and the measurement it took itself (not one read from the store)."""
    out = []
    for t in study.get_trials(deepcopy=False) if study is not None else []:
        if not t.datetime_start:
            continue
        w, ua = t.user_attrs.get("worker") or {}, t.user_attrs
        out.append(TrialTimes(started=t.datetime_start.timestamp(),
                              completed=t.datetime_complete.timestamp() if t.datetime_complete else None,
                              worker=(w.get("host"), w.get("pid")),
                              measured_key=ua.get("measurement_key") if ua.get("measurement_cached") is False else None))
    return out

"""The Optuna trial: the sampler, and the objective that samples the primary knobs, expands them
into a shape (:func:`archsearch.search.derived.expand`), predicts its loss and judges it against
the target (:mod:`archsearch.search.constraint`: a shape that breaks the constraint, or lies
outside the law's fitted range, completes as an infeasible trial, unmeasured), then measures it:
alone (output throughput at the reference batch size), paired with the baseline (the throughput
ratio), or on every deployment target. With ``objective: pareto`` the predicted loss is a second
objective."""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING, Any

from archsearch.arch import ArchSpec, describe
from archsearch.errors import ArchsearchError
from archsearch.search.config import StudyConfig
from archsearch.search.constraint import (loss_bound, loss_margin, out_of_range, outside_gqa_bounds, predict_loss,
                                          search_ranges)
from archsearch.search.derived import expand
from archsearch.search.measurements import check_result_limits, spec_key
from archsearch.search.storage import heartbeat
from archsearch.search.targets import multi_target_objective
from archsearch.search.trials import record_measurement, set_constraint

if TYPE_CHECKING:
    from archsearch.search.context import SearchContext

# Constraint value of a trial whose shape could not be built (never feasible).
UNBUILDABLE = 1e6


def make_sampler(cfg: StudyConfig):
    import optuna

    o = cfg.optuna
    if o.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=o.seed, n_startup_trials=min(5, o.n_shapes), multivariate=True)
    if o.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=o.seed)
    if o.sampler == "gp":
        return optuna.samplers.GPSampler(seed=o.seed)
    return optuna.samplers.RandomSampler(seed=o.seed)


def _suggest(trial, cfg: StudyConfig, law=None) -> tuple[float, float, int]:
    rng = search_ranges(cfg, law)
    (lo1, hi1), step1 = rng["hidden_over_sqrt_n"]
    (lo2, hi2), step2 = rng["mlp_to_attn"]
    x1 = trial.suggest_float("hidden_over_sqrt_n", lo1, hi1, step=step1)
    r = trial.suggest_float("mlp_to_attn", lo2, hi2, step=step2, log=step2 is None)
    if cfg.search_space.gqa == "divisors":  # an ordered integer: neighbouring GQAs behave alike
        g = trial.suggest_int("gqa", 1, cfg.gqa_values[-1], log=True)
    else:
        g = trial.suggest_categorical("gqa", list(cfg.search_space.gqa))
    return x1, r, int(g)


def trial_spec(ctx: SearchContext, user_attrs: dict[str, Any], x1: float, r: float, g: int) -> ArchSpec:
    """The shape a trial measures: a seeded published shape as published (``seed_shape``, enqueued
    by :func:`archsearch.search.study.seed_study`; its knobs are its realised ones on the sampling
    grid, for the sampler), else the knobs built at the budget."""
    name = user_attrs.get("seed_shape")
    return ctx.study.seed_shape(name) if name else expand(ctx.cfg, ctx.build, x1, r, g)


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
        spec = trial_spec(ctx, trial.user_attrs, x1, r, g)
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
    elif why := outside_gqa_bounds(ctx.study, spec):
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

"""Benchmark: the active proxy plan against the fixed grid, on proxy FLOPs.

Synthetic arm (``--mode synthetic``, default): ground truth is a known conditional law, the
method's published multiplicative coefficients (a0 2.697, a1 0.0974, a2 0.0078, b0 0.3870,
b1 0.0063, b2 0.0065; optimum d/sqrt(N)* = a2/a1 = 0.0801, r* = b2/b1 = 1.032) on top of the
Chinchilla law of Hoffmann et al. (E 1.69, A 406.4, alpha 0.34, B 410.7, beta 0.28). Paper-like
proxies: N = 80M, 145M, 297M at D = 100N, a 5 x 5 box of d/sqrt(N) in [0.04, 0.16] and r in
[0.5, 5] (log-spaced; shapes snapped as a study builds them, duplicates once). Each run's loss is
the true law times exp(noise z); grid and plan see the same draw for the same run.

* grid: every run of the box, fitted once (the method's plan); also its size-by-size prefixes,
  and a coarse 3 x 3 grid at the three sizes (about a third of the FLOPs: the grid at equal
  compute). Each grid is fitted twice: with the method's best-observed L_opt and with every
  size's L_opt fitted (``archsearch.laws.acquisition.fit_profiled``, what the plan fits), so that a
  difference between the designs is not a difference between estimators.
* active: ``archsearch.laws.acquisition.propose`` over a finer box of candidates at the same sizes
  (``--active-resolution`` 9 x 9; the plan is not bound to the grid's points), grid3 initial
  design at the smallest size, then the acquisition, batches of ``--batch``, up to
  ``--budget-fraction`` (a third) of the grid's FLOPs. Inside the loop the law is fitted with
  ``--bootstrap`` (200) replicates of its parametric bootstrap and 3 starts instead of 10.

Two criteria (docs/method.md section 3, "What the proxies must deliver"), both reported:
* coordinates (the issue's wording): max(|x1^/x1* - 1|, |r^/r* - 1|) <= 5%, on the fit's
  closed-form optimum;
* loss: the true loss of the fitted law's optimum within the box (what the search enqueues)
  over the true minimum, minus 1, at most the loss of the worst corner of the +-5% box around
  the true optimum (7.3e-5 of the loss with these coefficients).
Per noise level: FLOPs until the criterion holds and keeps holding (the grid: after each size),
and errors and regrets at equal compute; medians over seeds with a 90% bootstrap interval of the
median and the quartiles.

Real arm (``--mode replay``): the same comparison on proxies trained for real, read from a run
table (default ``results/bench/active_proxies_demo/runs.csv``: the demo study's box, 17 shapes at
N = 100K and 200K on Shakespeare, 3 seeds, trained by ``archsearch sweep --config
configs/sweep-demo-active-bench.yaml``); each seed is one world. There is no ground truth: the
reference is the law fitted on every run of every seed, and estimates are judged by the loss
that law gives their optimum within the box (see :func:`replay`).

    python -m archsearch.benchmarks.scripts.bench_active_proxies [--seeds 5] [--noise 0.003 0.01]
    python -m archsearch.benchmarks.scripts.bench_active_proxies --mode replay [--runs results/bench/active_proxies_demo/runs.csv]

Appends one JSON line per arm to ``results/bench/active_proxies.jsonl`` with provenance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

import numpy as np

from archsearch.arch import non_embedding_params
from archsearch.candidates import BuildSettings, build_candidate
from archsearch.errors import ArchsearchError
from archsearch.fileio import append_line
from archsearch.laws import FitOptions, fit_law, forms
from archsearch.laws.acquisition import WEIGHTS, Pool, bootstrap_optima, ensemble, fit_profiled, optimum_interval, propose
from archsearch.laws.metrics import cluster
from archsearch.laws.synthetic import default_layers
from archsearch.provenance import provenance
from archsearch.rundata import RunRecord, read_runs

TRUE = {"a0": 2.697, "a1": 0.0974, "a2": 0.0078, "b0": 0.3870, "b1": 0.0063, "b2": 0.0065}
CHINCHILLA = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}  # Hoffmann et al. 2022
LAW = "conditional-multiplicative"
LEVEL = 0.9   # the plan's interval level (archsearch.laws.acquisition.propose's default): both coordinates together


BOX_X1, BOX_R = (0.04, 0.16), (0.5, 5.0)


def paper_pool(sizes=(80e6, 145e6, 297e6), tokens_per_param=100.0, box_x1=BOX_X1, box_r=BOX_R, k=5):
    """The paper-like candidate grid as an active-plan Pool (distinct shapes only)."""
    st = BuildSettings(hidden_multiple=64, ffn_multiple=64)
    specs, toks, lev, seen = [], [], [], set()
    for li, n in enumerate(sizes):
        for x1 in np.geomspace(*box_x1, k):
            for r in np.geomspace(*box_r, k):
                try:
                    spec = build_candidate(n, default_layers(n), x1, r, gqa=4, head_dim=64, settings=st).spec
                except ArchsearchError:
                    continue
                if spec in seen:
                    continue
                seen.add(spec)
                specs.append(spec)
                toks.append(tokens_per_param * non_embedding_params(spec))
                lev.append(li)
    return Pool.of(specs, toks, lev)


def observe(pool, mean, noise, seed):
    """Noisy losses; a run's noise depends only on its shape, budget and the seed, so the grid and
    the plan (whose pools overlap) see the same draw for the same run."""
    import hashlib

    z = [np.random.default_rng([seed, int(hashlib.sha256(
        json.dumps([s.to_dict(), float(t)], sort_keys=True).encode()).hexdigest()[:12], 16)]).standard_normal()
         for s, t in zip(pool.specs, pool.tokens)]
    return mean * np.exp(noise * np.array(z))


def error(est, truth, which=(0, 1)) -> float:
    """Largest relative error of the estimated optimum over the coordinates ``which``
    (0: d/sqrt(N)*, 1: r*); inf when there is no estimate."""
    if est is None or None in est:
        return math.inf
    return max(abs(est[i] / truth[i] - 1.0) for i in which)


def regret(est, coefs=TRUE) -> float:
    """Loss consequence of an estimated optimum: the true loss of the shape (x1^, r^) over the
    true minimum, minus 1 (the same at every N and D: the law is separable and multiplicative);
    inf when there is no estimate."""
    if est is None or None in est:
        return math.inf

    def f(c0, c1, c2, x):
        return c0 + c1 * math.log(x) + c2 / x

    o1, o2 = forms.factor_optimum(coefs["a1"], coefs["a2"]), forms.factor_optimum(coefs["b1"], coefs["b2"])
    return (f(coefs["a0"], coefs["a1"], coefs["a2"], est[0]) * f(coefs["b0"], coefs["b1"], coefs["b2"], est[1])
            / (f(coefs["a0"], coefs["a1"], coefs["a2"], o1) * f(coefs["b0"], coefs["b1"], coefs["b2"], o2))) - 1.0


def box_optimum(coefs, box_x1=BOX_X1, box_r=BOX_R):
    """The loss-optimal shape of a fitted law within the box, as the study's search takes it (it
    enqueues the law's optimum clipped to its search space): per factor (the law is separable),
    the closed-form optimum clipped to the box when the factor is U-shaped, else the better edge."""
    if coefs is None:
        return None

    out = []
    for (c0, c1, c2), (lo, hi) in (((coefs["a0"], coefs["a1"], coefs["a2"]), box_x1),
                                   ((coefs["b0"], coefs["b1"], coefs["b2"]), box_r)):
        o = forms.factor_optimum(c1, c2)
        if o is not None:
            out.append(min(max(o, lo), hi))
        else:
            f = [c0 + c1 * math.log(x) + c2 / x for x in (lo, hi)]
            out.append(lo if f[0] <= f[1] else hi)
    return tuple(out)


def regret_tolerance(bound=0.05, coefs=TRUE) -> float:
    """The loss-equivalent of the 5% criterion: the largest regret of the four corners of the box
    +-``bound`` around the true optimum. A point passes the loss criterion when it costs no more
    loss than the worst point the coordinate criterion accepts."""
    t = (coefs["a2"] / coefs["a1"], coefs["b2"] / coefs["b1"])
    return max(regret((t[0] * (1 + s1 * bound), t[1] * (1 + s2 * bound)), coefs) for s1 in (-1, 1) for s2 in (-1, 1))


def cramer_rao_sd(pool, idx, noise, coefs=TRUE) -> tuple[float, float]:
    """The information limit of a design: the standard deviations of log d/sqrt(N)* and log r*
    that an efficient unbiased estimator reaches (Cramer-Rao, to first order) from runs ``idx``
    with log-noise ``noise``, every size's L_opt a free offset (as :func:`fit_profiled` fits it).
    The law ``log L = c_size + log(1 + a h(x1 / x1*)) + log(1 + b h(r / r*))``, ``h(t) = log t +
    1/t - 1``, is the multiplicative law re-parametrised; its Jacobian at the truth gives the
    Fisher information. No design, plan or fit does better than this on average."""
    fa = coefs["a0"] + coefs["a1"] * (1 + math.log(coefs["a2"] / coefs["a1"]))
    fb = coefs["b0"] + coefs["b1"] * (1 + math.log(coefs["b2"] / coefs["b1"]))
    a, u1 = coefs["a1"] / fa, math.log(coefs["a2"] / coefs["a1"])
    b, u2 = coefs["b1"] / fb, math.log(coefs["b2"] / coefs["b1"])
    idx = np.asarray(idx, int)
    h1, dh1 = forms.h_and_slope(np.log(pool.X["x1"][idx]), u1)
    h2, dh2 = forms.h_and_slope(np.log(pool.X["x2"][idx]), u2)
    F, G = 1 + a * h1, 1 + b * h2
    lev = pool.level[idx]
    J = np.stack([h1 / F, a * dh1 / F, h2 / G, b * dh2 / G] + [(lev == g).astype(float) for g in np.unique(lev)],
                 axis=1)
    C = noise ** 2 * np.linalg.pinv(J.T @ J)
    return math.sqrt(C[1, 1]), math.sqrt(C[3, 3])


def point_optimum(pool, idx, losses, options, profiled=False, box=None, coefficients=False, scale_huber=True):
    """(closed-form optimum, optimum within the box) of the law fitted to runs ``idx`` (None
    when there is none);
    ``profiled``: every size's L_opt fitted (:func:`archsearch.laws.acquisition.fit_profiled`)."""
    runs = [RunRecord.from_arch(pool.specs[i], tokens=float(pool.tokens[i]), loss=float(losses[i]))
            for i in idx]
    try:
        c = (fit_profiled(runs, LAW, options, scale_huber=scale_huber) if profiled else fit_law(runs, LAW, options)).coefficients
    except ArchsearchError:
        return (None, None, None) if coefficients else (None, None)
    o = (forms.factor_optimum(c["a1"], c["a2"]), forms.factor_optimum(c["b1"], c["b2"]))
    out = (None if None in o else o), box_optimum(c, *(box or (BOX_X1, BOX_R)))
    return (*out, c) if coefficients else out


def run_plan(pool, losses, options, budget, batch, initial="grid3", estimate_options=None, box=(BOX_X1, BOX_R),
             weights="log"):
    """Trajectory of the active plan: after each batch, the runs, the FLOPs spent and the plan's
    interval half-width (None before a fit has one), and the estimate the study would take from
    those runs: the law refitted on them with ``estimate_options`` (the fit stage's settings, as
    for the grid; every size's L_opt fitted), its closed-form optimum and its optimum in ``box``."""
    observed, traj, spent = {}, [], 0.0
    while spent < budget:
        p = propose(pool, observed, [], LAW, options, k=batch, initial=initial, max_cost=budget - spent,
                    weights=weights)
        if traj and p.interval is not None:
            traj[-1]["width"] = p.interval.width  # the interval after the previous batch
            traj[-1]["interval"] = [list(p.interval.hidden_over_sqrt_n), list(p.interval.mlp_to_attn_ratio)]
        if not p.picks:
            break
        for pk in p.picks:
            if spent + float(pool.flops[pk["index"]]) > budget:
                break   # as the driver does: the batch together would overrun the budget
            observed[pk["index"]] = losses[pk["index"]]
            spent += float(pool.flops[pk["index"]])
        if traj and traj[-1]["runs"] == len(observed):
            break
        traj.append({"runs": len(observed), "flops": spent, "width": None, "observed": sorted(observed),
                     "levels": np.bincount(pool.level[list(observed)], minlength=int(pool.level.max()) + 1).tolist()})
    if traj and traj[-1]["width"] is None:   # the budget is spent: the interval of the last design
        p = propose(pool, observed, [], LAW, options, k=batch, initial=initial, max_cost=0.0, weights=weights)
        if p.interval is not None:
            traj[-1]["width"] = p.interval.width
            traj[-1]["interval"] = [list(p.interval.hidden_over_sqrt_n), list(p.interval.mlp_to_attn_ratio)]
    eopts = estimate_options or options
    for t in traj:
        t["estimate"], t["box_estimate"], t["coefficients"] = (
            point_optimum(pool, t["observed"], losses, eopts, profiled=True, box=box, coefficients=True)
            if t["runs"] >= 5 else (None, None, None))
    return traj


def _passes(t, truth, criterion, tol_regret, bound=0.05):
    """The coordinate criterion judges the closed-form optimum; the loss criterion the optimum in
    the box (what the study's search uses)."""
    if criterion == "coordinates":
        return error(t["estimate"], truth) <= bound
    return regret(t["box_estimate"]) <= tol_regret


def flops_to(traj, truth, criterion="coordinates", tol_regret=math.nan, bound=0.05):
    """FLOPs after which the plan's estimate passes ``criterion`` and keeps passing to the end
    (None: never)."""
    ok = [_passes(t, truth, criterion, tol_regret, bound) for t in traj]
    return next((traj[i]["flops"] for i in range(len(traj)) if all(ok[i:])), None)


def at_flops(traj, flops):
    """The plan's last trajectory point with at most ``flops`` spent (empty before the first fit)."""
    before = [t for t in traj if t["flops"] <= flops * (1 + 1e-9)]
    return before[-1] if before else {"estimate": None, "box_estimate": None}


def _stats(vals):
    """Median over seeds with its 90% bootstrap interval and the quartiles; None (never reached)
    counts as infinitely late, and a statistic that is infinite is written as None."""
    v = np.array([math.inf if x is None else float(x) for x in vals])
    rng = np.random.default_rng(0)
    meds = np.median(v[rng.integers(0, v.size, (2000, v.size))], axis=1)

    def fin(x):
        x = float(x)
        return x if math.isfinite(x) else None

    with np.errstate(invalid="ignore"):   # quantiles between infinities
        q = [np.quantile(meds, 0.05), np.quantile(meds, 0.95), np.quantile(v, 0.25), np.quantile(v, 0.75)]
    return {"median": fin(np.median(v)), "median_ci90": [fin(q[0]), fin(q[1])], "quartiles": [fin(q[2]), fin(q[3])],
            "n": int(v.size),
            "finite": int(np.isfinite(v).sum())}


def covered(interval, truth) -> dict[str, bool] | None:
    """Whether the interval ([lo, hi] of d/sqrt(N)*, [lo, hi] of r*) holds the true optimum: in
    each coordinate and in both together (None: no interval)."""
    if interval is None:
        return None
    c = [bool(lo <= t <= hi) for (lo, hi), t in zip(interval, truth)]
    return {"hidden_over_sqrt_n": c[0], "mlp_to_attn_ratio": c[1], "both": c[0] and c[1]}


def coverage(flags, level) -> dict:
    """Share of seeds whose interval held the truth, with its Wilson 95% interval, per
    coordinate and jointly; ``level`` is the nominal joint level (each coordinate's is its square
    root for a simultaneous interval)."""
    from scipy.stats import binomtest

    flags = [f for f in flags if f is not None]
    out = {"nominal_joint": level, "nominal_each": math.sqrt(level), "with_interval": len(flags)}
    for k in ("both", "hidden_over_sqrt_n", "mlp_to_attn_ratio"):
        hit = sum(f[k] for f in flags)
        ci = binomtest(hit, len(flags)).proportion_ci(0.95, "wilson") if flags else None
        out[k] = {"covered": hit, "share": hit / len(flags) if flags else None,
                  "wilson95": [float(ci.low), float(ci.high)] if ci else None}
    out["nominal_inside_wilson"] = bool(flags) and out["both"]["wilson95"][0] <= level <= out["both"]["wilson95"][1]
    return out


def other_weights(w):
    return next(x for x in WEIGHTS if x != w)


def plan_record(apool, losses, loop_opts, budget, args, grid_opts, weights, truth, tol_regret, tol_regrets,
                level_flops, noise) -> dict:
    """The plan's trajectory in one synthetic world and what it reached (see the module docstring)."""
    bounds = tuple(tol_regrets)
    traj = run_plan(apool, losses, loop_opts, budget, args.batch, estimate_options=grid_opts, weights=weights)
    stop = next((t for t in traj if t["width"] is not None and t["width"] <= args.tolerance), None)
    return {
        "weights": weights,
        "trajectory": traj,
        "flops_to": {c: flops_to(traj, truth, c, tol_regret) for c in ("coordinates", "loss")},
        "flops_to_by_bound": {f"{c}@{b:g}": flops_to(traj, truth, c, tol_regrets[b], b)
                              for c in ("coordinates", "loss") for b in bounds},
        "cramer_rao_sd_end": cramer_rao_sd(apool, traj[-1]["observed"], noise),
        "interval_end": traj[-1].get("interval"),
        "covered_end": covered(traj[-1].get("interval"), truth),
        "covered_at_stop": None if stop is None else covered(stop.get("interval"), truth),
        "at_grid_level_flops": [{"estimate": (t := at_flops(traj, f))["estimate"],
                                 "error": error(t["estimate"], truth), "regret": regret(t["box_estimate"])}
                                for f in level_flops[:-1]],
        "end": {"flops": traj[-1]["flops"], "runs": traj[-1]["runs"], "levels": traj[-1]["levels"],
                "estimate": traj[-1]["estimate"], "box_estimate": traj[-1]["box_estimate"],
                "error": error(traj[-1]["estimate"], truth),
                "error_x1": error(traj[-1]["estimate"], truth, (0,)),
                "error_r": error(traj[-1]["estimate"], truth, (1,)),
                "regret": regret(traj[-1]["box_estimate"])},
        "stop": None if stop is None else {"flops": stop["flops"], "runs": stop["runs"],
                                           "error": error(stop["estimate"], truth),
                                           "regret": regret(stop["box_estimate"])}}


def synthetic(args) -> dict:
    def with_truth(pool):
        X = dict(pool.X)
        X["Lref"] = forms.predict("chinchilla", CHINCHILLA, X)
        return pool, forms.predict(LAW, TRUE, X)

    pool, mean = with_truth(paper_pool())
    coarse, cmean = with_truth(paper_pool(k=3))
    apool, amean = with_truth(paper_pool(k=args.active_resolution))
    truth = (TRUE["a2"] / TRUE["a1"], TRUE["b2"] / TRUE["b1"])
    tol_regret = regret_tolerance()
    rr = None if args.r_range is None else tuple(args.r_range)
    grid_opts = FitOptions(reference="best-observed", r_range=rr)
    loop_opts = FitOptions(reference="best-observed", bootstrap=args.bootstrap, n_starts=3, r_range=rr)
    bounds = (0.05, 0.10, 0.20)
    tol_regrets = {b: regret_tolerance(b) for b in bounds}
    grid_flops = float(pool.flops.sum())
    levels = sorted(set(pool.level))
    level_flops = np.cumsum([pool.flops[pool.level == lv].sum() for lv in levels])
    budget = grid_flops * args.budget_fraction
    out = {"pool_runs": len(pool), "coarse_grid_runs": len(coarse), "active_pool_runs": len(apool),
           "grid_flops": grid_flops, "grid_level_flops": level_flops.tolist(),
           "coarse_grid_flops": float(coarse.flops.sum()), "active_budget_flops": budget,
           "truth": {"hidden_over_sqrt_n": truth[0], "mlp_to_attn_ratio": truth[1]},
           "criteria": {"coordinates": "max(|x1^/x1* - 1|, |r^/r* - 1|) <= 0.05",
                        "loss": f"true loss of (x1^, r^) / true minimum - 1 <= {tol_regret:.3g} "
                                "(the worst corner of the +-5% box around the optimum), (x1^, r^) the fitted "
                                "law's optimum within the proxy box, as the search enqueues it"},
           "regret_tolerance": tol_regret, "regret_tolerance_by_bound": {f"{b:g}": v for b, v in tol_regrets.items()},
           "r_range": rr, "noise": {}}
    for noise in args.noise:
        keep_all = np.ones(len(pool), bool) if rr is None else (pool.X["x2"] >= rr[0]) & (pool.X["x2"] <= rr[1])
        ckeep = np.ones(len(coarse), bool) if rr is None else (coarse.X["x2"] >= rr[0]) & (coarse.X["x2"] <= rr[1])
        info = {"full_grid": cramer_rao_sd(pool, np.flatnonzero(keep_all), noise),
                "full_grid_levels_0-0": cramer_rao_sd(pool, np.flatnonzero(keep_all & (pool.level == 0)), noise),
                "coarse_grid_3x3": cramer_rao_sd(coarse, np.flatnonzero(ckeep), noise)}
        rows = []
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            losses = observe(pool, mean, noise, seed)
            row = {"seed": seed}
            for name, prof in (("grid", False), ("grid_profiled", True)):
                est = [point_optimum(pool, np.flatnonzero(pool.level <= lv), losses, grid_opts, prof) for lv in levels]
                row[name] = {"estimate_by_level": [e[0] for e in est], "box_estimate_by_level": [e[1] for e in est],
                             "error_by_level": [error(e[0], truth) for e in est],
                             "regret_by_level": [regret(e[1]) for e in est]}
            # the full grid under other estimators, to separate the estimator from the design: the
            # plan's fit with the fixed delta, and least squares (a delta far above the noise)
            full = np.arange(len(pool))
            for name, o, sc in (("grid_profiled_fixed_delta", grid_opts, False),
                                ("grid_least_squares", dataclasses.replace(grid_opts, huber_delta=1.0), False)):
                e = point_optimum(pool, full, losses, o, True, scale_huber=sc)
                row[name] = {"estimate": e[0], "error": error(e[0], truth), "regret": regret(e[1])}
            closs = observe(coarse, cmean, noise, seed)
            for name, prof in (("coarse_grid", False), ("coarse_grid_profiled", True)):
                e, eb = point_optimum(coarse, np.arange(len(coarse)), closs, grid_opts, prof)
                row[name] = {"estimate": e, "box_estimate": eb, "error": error(e, truth), "regret": regret(eb)}
            for name, weights in (("active", args.weights),) + (
                    (("active_other_weights", other_weights(args.weights)),) if args.compare_weights else ()):
                row[name] = plan_record(apool, observe(apool, amean, noise, seed), loop_opts, budget, args,
                                        grid_opts, weights, truth, tol_regret, tol_regrets, level_flops, noise)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            a = row["active"]
            print(json.dumps({"noise": noise, "seed": seed, "grid_error": row["grid"]["error_by_level"][-1],
                              "grid_regret": row["grid"]["regret_by_level"][-1],
                              "grid_profiled_error": row["grid_profiled"]["error_by_level"][-1],
                              "active_error": a["end"]["error"], "active_regret": a["end"]["regret"],
                              **({"active_other_weights_error": row["active_other_weights"]["end"]["error"]}
                                 if args.compare_weights else {}),
                              "active_levels": a["end"]["levels"], "active_flops_to": a["flops_to"],
                              "seconds": row["seconds"]}), flush=True)


        def grid_to(r, name, c, bound=0.05):
            ok = [(e <= bound) if c == "coordinates" else (g <= tol_regrets[bound])
                  for e, g in zip(r[name]["error_by_level"], r[name]["regret_by_level"])]
            return next((float(level_flops[i]) for i in range(len(ok)) if ok[i]), None)

        summ = {"flops_to": {}, "error_at_equal_compute": {},
                "information_limit": {
                    "what": "Cramer-Rao standard deviation of (log d/sqrt(N)*, log r*) at this noise: no "
                            "estimator from these runs does better on average (every size's L_opt free)",
                    **{k: list(v) for k, v in info.items()},
                    "active_end_design_median": np.median([r["active"]["cramer_rao_sd_end"] for r in rows],
                                                          axis=0).tolist()},
                "active_interval_coverage": {
                    "what": "whether the plan's interval of the optimum holds the truth: at the end of the budget "
                            "(every seed) and where the tolerance stop would have fired (seeds that reach it; "
                            "chosen for being narrow, so optional stopping may lower it)",
                    "method": "parametric bootstrap of the plan's law, every size's L_opt refitted per replicate "
                              "(archsearch.laws.acquisition.offset_bootstrap); simultaneous percentile interval (Sidak)",
                    "end": coverage([r["active"]["covered_end"] for r in rows], LEVEL),
                    "at_stop": coverage([r["active"]["covered_at_stop"] for r in rows], LEVEL)},
                "flops_to_by_bound": {}}
        for c in ("coordinates", "loss"):
            for b in bounds:
                summ["flops_to_by_bound"][f"{c}@{b:g}"] = {
                    "grid_by_level": _stats([grid_to(r, "grid", c, b) for r in rows]),
                    "grid_profiled_by_level": _stats([grid_to(r, "grid_profiled", c, b) for r in rows]),
                    "active": _stats([r["active"]["flops_to_by_bound"][f"{c}@{b:g}"] for r in rows])}
        for c in ("coordinates", "loss"):
            summ["flops_to"][c] = {
                "grid_by_level": _stats([grid_to(r, "grid", c) for r in rows]),
                "grid_profiled_by_level": _stats([grid_to(r, "grid_profiled", c) for r in rows]),
                "active": _stats([r["active"]["flops_to"][c] for r in rows]),
                "active_seeds_reaching": sum(r["active"]["flops_to"][c] is not None for r in rows),
                "grid_seeds_reaching": sum(grid_to(r, "grid", c) is not None for r in rows)}
        eq = summ["error_at_equal_compute"]
        for key, metric in (("error", "error"), ("regret", "regret")):
            eq[key] = {"grid_full": _stats([r["grid"][f"{metric}_by_level"][-1] for r in rows]),
                       "grid_profiled_full": _stats([r["grid_profiled"][f"{metric}_by_level"][-1] for r in rows]),
                       "grid_profiled_fixed_delta_full": _stats([r["grid_profiled_fixed_delta"][metric] for r in rows]),
                       "grid_least_squares_full": _stats([r["grid_least_squares"][metric] for r in rows]),
                       "coarse_grid_3x3": _stats([r["coarse_grid"][metric] for r in rows]),
                       "coarse_grid_3x3_profiled": _stats([r["coarse_grid_profiled"][metric] for r in rows]),
                       "active_at_budget": _stats([r["active"]["end"][metric] for r in rows])}
            for i, f in enumerate(level_flops[:-1]):
                eq[key][f"grid_levels_0-{i}"] = _stats([r["grid"][f"{metric}_by_level"][i] for r in rows])
                eq[key][f"active_at_grid_levels_0-{i}_flops"] = _stats(
                    [r["active"]["at_grid_level_flops"][i][metric] for r in rows])
        eq["error_x1"] = {"active_at_budget": _stats([r["active"]["end"]["error_x1"] for r in rows])}
        eq["error_r"] = {"active_at_budget": _stats([r["active"]["end"]["error_r"] for r in rows])}
        if args.compare_weights:
            o = [r["active_other_weights"] for r in rows]
            a = [r["active"] for r in rows]
            summ["other_weights"] = {
                "weights": o[0]["weights"],
                "error_at_budget": _stats([x["end"]["error"] for x in o]),
                "regret_at_budget": _stats([x["end"]["regret"] for x in o]),
                "paired_error_difference": _stats([x["end"]["error"] - y["end"]["error"] for x, y in zip(a, o)]),
                "paired_log_cramer_rao_ratio": _stats([math.log(max(x["cramer_rao_sd_end"]) / max(y["cramer_rao_sd_end"]))
                                                       for x, y in zip(a, o)]),
                "what": "paired over seeds (same draws): this arm's weights minus the other's; the Cramer-Rao ratio "
                        "compares the designs' information (larger sd of the two coordinates), free of the fit's luck",
                "cramer_rao_sd_end_median": np.median([x["cramer_rao_sd_end"] for x in o], axis=0).tolist(),
                "flops_to_by_bound": {k: _stats([x["flops_to_by_bound"][k] for x in o])
                                      for k in o[0]["flops_to_by_bound"]}}
        summ["active_stop"] = {"flops": _stats([(r["active"]["stop"] or {}).get("flops") for r in rows]),
                               "error": _stats([(r["active"]["stop"] or {}).get("error") for r in rows]),
                               "seeds_stopping": sum(r["active"]["stop"] is not None for r in rows)}
        out["noise"][str(noise)] = {"seeds": rows, "summary": summ}
    return out


def replay(args) -> dict:
    """The plan on real trained proxies, pool-based: the candidates are the grid's runs, and when
    the plan picks one it reads that run's real loss (``--runs``: one or more run tables, each
    one box; a table with several seeds of every shape gives one world per seed).

    There is no ground truth. The reference answer of a world is the full grid's fit (every run
    of that seed, every size's L_opt fitted: what the plan fits), and its optimum *within the
    box* (what the search enqueues; the closed-form optimum is reported too, with whether it
    lies outside the box). Reported per world: the FLOPs after which the plan's box optimum stays
    within 5% / 10% of the reference's in both coordinates; at a third, half and two thirds of
    the grid's FLOPs the plan's error against it, and the same for the grid's own design at equal
    compute (the smallest size's full grid, the method's first step); the regret of each under
    the law fitted on every run of every seed of the table (the most data there is). Where the
    optimum sits at a corner of the box every fit agrees on that corner, so the optimum cannot
    tell designs apart; ``shape_rms_vs_grid`` compares the laws themselves: the RMS over the
    grid's shapes of the difference in log relative loss (each law's shape factor over its
    minimum), the quantity the search's feasibility test reads."""
    def closed(c):
        o = (forms.factor_optimum(c["a1"], c["a2"]), forms.factor_optimum(c["b1"], c["b2"]))
        return None if None in o else o

    def outside(o, box):
        return None if o is None else [not (lo <= v <= hi) for v, (lo, hi) in zip(o, box)]

    def reg(c, est):
        """Loss of ``est`` over the loss of ``c``'s own box optimum, both under the law ``c``."""
        if est is None:
            return None
        f = lambda c0, c1, c2, x: c0 + c1 * math.log(x) + c2 / x  # noqa: E731
        val = lambda e: f(c["a0"], c["a1"], c["a2"], e[0]) * f(c["b0"], c["b1"], c["b2"], e[1])  # noqa: E731
        return val(est) / val(box_optimum(c, *box)) - 1.0

    def shape_rms(c, ref, X):
        """RMS over the shapes ``X`` (x1, x2) of the difference in log relative loss (each law's shape
        factor over its own minimum on those shapes) between the laws ``c`` and ``ref``: how far
        apart the two rank and space the box's shapes, which is what the search reads (its
        feasibility test compares a shape's predicted loss with the baseline's); None without c."""
        if c is None:
            return None

        def rel(k):
            v = np.log(forms.u_factor(k["a0"], k["a1"], k["a2"], X["x1"]) * forms.u_factor(k["b0"], k["b1"], k["b2"], X["x2"]))
            return v - v.min()

        return float(np.sqrt(np.mean((rel(c) - rel(ref)) ** 2)))

    opts = FitOptions(reference="best-observed", size_tolerance=args.size_tolerance, r_range=None)
    loop_opts = FitOptions(reference="best-observed", size_tolerance=args.size_tolerance, r_range=None,
                           bootstrap=args.bootstrap, n_starts=3)
    tables = []
    for path in args.runs:
        runs = [r for r in read_runs(path) if r.status == "ok"]
        x1s, rs = [r.hidden_over_sqrt_n for r in runs], [r.mlp_to_attn_ratio for r in runs]
        box = ((min(x1s), max(x1s)), (min(rs), max(rs)))
        all_fit = fit_profiled(runs, LAW, opts)
        ac = all_fit.coefficients
        table = {"runs_file": path, "runs": len(runs), "seeds": sorted({r.seed for r in runs}), "box": box,
                 "all_seeds_fit": {"coefficients": ac, "closed_form_optimum": closed(ac),
                                   "closed_form_outside_box": outside(closed(ac), box),
                                   "box_optimum": box_optimum(ac, *box), "warnings": all_fit.warnings},
                 "worlds": []}
        for seed in table["seeds"]:
            rr = [r for r in runs if r.seed == seed]
            lev = cluster(np.array([r.n_params for r in rr]), args.size_tolerance).tolist()   # as the fit groups sizes
            pool = Pool.of([r.spec for r in rr], [r.tokens for r in rr], lev)
            losses = np.array([r.loss for r in rr])
            grid_flops = float(pool.flops.sum())
            gfit = fit_profiled(rr, LAW, opts)
            gc = gfit.coefficients
            ref = box_optimum(gc, *box)
            small = [r for r, lv in zip(rr, lev) if lv == 0]
            sc = fit_profiled(small, LAW, opts).coefficients
            grid_small = {"runs": len(small), "flops_share": float(pool.flops[np.array(lev) == 0].sum()) / grid_flops,
                          "box_optimum": box_optimum(sc, *box), "error": error(box_optimum(sc, *box), ref),
                          "shape_rms_vs_grid": shape_rms(sc, gc, pool.X),
                          "regret_all_seeds_law": reg(ac, box_optimum(sc, *box))}
            plain = fit_law(rr, LAW, opts).coefficients
            traj = run_plan(pool, losses, loop_opts, grid_flops, args.batch, estimate_options=opts, box=box)
            for t in traj:
                t["error_vs_grid"] = error(t["box_estimate"], ref)
                t["shape_rms_vs_grid"] = shape_rms(t.get("coefficients"), gc, pool.X)
                t["regret_all_seeds_law"] = reg(ac, t["box_estimate"])
                t["flops_share"] = t["flops"] / grid_flops
                t["closed_form_outside_box"] = outside(t["estimate"], box)

            def to(bound):
                ok = [t["error_vs_grid"] <= bound for t in traj]
                hit = next((i for i in range(len(traj)) if all(ok[i:])), None)
                return None if hit is None else {"flops_share": traj[hit]["flops_share"], "runs": traj[hit]["runs"]}

            at = {}
            for frac in REPLAY_FRACTIONS:
                t = at_flops(traj, frac * grid_flops)
                at[f"{frac:.3g}"] = {"runs": t.get("runs", 0), "flops_share": t.get("flops", 0.0) / grid_flops,
                                     "box_optimum": t.get("box_estimate"), "error_vs_grid": t.get("error_vs_grid"),
                                     "shape_rms_vs_grid": t.get("shape_rms_vs_grid"),
                                     "regret_all_seeds_law": t.get("regret_all_seeds_law"),
                                     "interval": t.get("interval"), "width": t.get("width"),
                                     "note": None if t.get("box_estimate") else "no law fitted yet (initial design)"}
            w = {"seed": seed, "pool_runs": len(pool), "grid_flops": grid_flops,
                 "grid": {"box_optimum": ref, "closed_form_optimum": closed(gc),
                          "closed_form_outside_box": outside(closed(gc), box),
                          "fit_bound_warnings": [x for x in gfit.warnings if "bound" in x],
                          "regret_all_seeds_law": reg(ac, ref),
                          "best_observed_fit_box_optimum": box_optimum(plain, *box)},
                 "grid_smallest_size": grid_small,
                 "active_flops_to_within": {"0.05": to(0.05), "0.1": to(0.10)},
                 "active_at_grid_share": at, "active_trajectory": traj}
            table["worlds"].append(w)
            print(json.dumps({"runs_file": path, "seed": seed, "grid_box_optimum": ref,
                              "grid_closed_form": closed(gc), "flops_to": w["active_flops_to_within"],
                              "grid_smallest_size": grid_small,
                              "active_at": {k: (v["runs"], v["box_optimum"], v["error_vs_grid"]) for k, v in at.items()}},
                             default=str), flush=True)
        ws = table["worlds"]
        table["summary"] = {
            "what": "medians over worlds [min, max]; error = larger relative error of the box optimum against the "
                    "world's full grid's box optimum; flops shares of the full grid",
            **{f"active_flops_share_to_within_{b}": _range([(w["active_flops_to_within"][b] or {}).get("flops_share")
                                                            for w in ws]) for b in ("0.05", "0.1")},
            **{f"active_error_at_{k}": _range([w["active_at_grid_share"][k]["error_vs_grid"] for w in ws])
               for k in ws[0]["active_at_grid_share"]},
            **{f"active_shape_rms_at_{k}": _range([w["active_at_grid_share"][k]["shape_rms_vs_grid"] for w in ws])
               for k in ws[0]["active_at_grid_share"]},
            "grid_smallest_size_shape_rms": _range([w["grid_smallest_size"]["shape_rms_vs_grid"] for w in ws]),
            "grid_smallest_size_error": _range([w["grid_smallest_size"]["error"] for w in ws]),
            "grid_smallest_size_flops_share": _range([w["grid_smallest_size"]["flops_share"] for w in ws]),
            "grid_closed_form_outside_box": [w["grid"]["closed_form_outside_box"] for w in ws]}
        tables.append(table)
    return {"tables": tables}


def _range(vals):
    """Median and range of a few seeds' values (inf: no estimate)."""
    if all(x is None for x in vals):
        return None
    v = [math.inf if x is None else float(x) for x in vals]
    fin = lambda x: x if math.isfinite(x) else None
    return {"median": fin(float(np.median(v))), "range": [fin(min(v)), fin(max(v))], "values": [fin(x) for x in v]}


REPLAY_FRACTIONS = (1 / 3, 1 / 2, 2 / 3, 1.0)


def box_optimum_from(t, box):
    """A trajectory point's optimum within ``box`` (the plan's fit's coefficients)."""
    return box_optimum(t.get("coefficients"), *box) if t.get("coefficients") else None


def coverage_mode(args) -> dict:
    """Coverage of the optimum's interval on the designs the plan chose (``--mode coverage``).

    A full synthetic run re-plays the whole plan per seed (minutes each here); this mode takes the
    plan's last design of every seed of an earlier synthetic record (``--designs-from``, line
    numbers of ``--designs-file``, one per noise level), draws fresh noise ``--draws`` times on each (the
    same known law), fits, and asks whether the interval holds the true optimum. The designs were
    chosen adaptively on other draws, so this measures the interval on realistic designs, not
    the plan's optional stopping. Each draw is judged with the plan's interval
    (:func:`archsearch.laws.acquisition.ensemble`: parametric bootstrap, offsets refitted, simultaneous)
    and, on the same draw, the earlier one (the fit's bootstrap over runs, ``--old-bootstrap``
    resamples, every size's L_opt held, percentile at the level per coordinate) for comparison."""
    apool = paper_pool(k=args.active_resolution)
    X = dict(apool.X)
    X["Lref"] = forms.predict("chinchilla", CHINCHILLA, X)
    amean = forms.predict(LAW, TRUE, X)
    truth = (TRUE["a2"] / TRUE["a1"], TRUE["b2"] / TRUE["b1"])
    rr = None if args.r_range is None else tuple(args.r_range)
    opts = FitOptions(reference="best-observed", bootstrap=args.bootstrap, n_starts=3, r_range=rr)
    lines = open(args.designs_file).read().splitlines()
    out = {"designs_file": args.designs_file, "truth": truth, "draws_per_design": args.draws, "noise": {}}
    for ln in args.designs_from:
        rec = json.loads(lines[ln])
        for noise, d in rec["noise"].items():
            designs = [r["active"]["trajectory"][-1]["observed"] for r in d["seeds"]]
            rows = []
            for k, idx in enumerate(designs):
                for j in range(args.draws):
                    rng = np.random.default_rng([977, k, j, int(float(noise) * 1e6)])
                    losses = amean * np.exp(float(noise) * rng.standard_normal(len(amean)))
                    t0 = time.perf_counter()
                    ens = ensemble(apool, {int(i): float(losses[i]) for i in idx}, LAW, opts, level=LEVEL)
                    new = None if isinstance(ens, str) else [list(ens.interval.hidden_over_sqrt_n),
                                                             list(ens.interval.mlp_to_attn_ratio)]
                    runs = [RunRecord.from_arch(apool.specs[i], tokens=float(apool.tokens[i]), loss=float(losses[i]))
                            for i in idx]
                    f = fit_profiled(runs, LAW, dataclasses.replace(opts, bootstrap=args.old_bootstrap))
                    lo, _ = bootstrap_optima([dict(zip(f.bootstrap["names"], c)) for c in f.bootstrap["coefficients"]])
                    old = None
                    if lo.shape[0] >= 2:
                        oi = optimum_interval(lo, LEVEL, method="percentile")
                        old = [list(oi.hidden_over_sqrt_n), list(oi.mlp_to_attn_ratio)]
                    rows.append({"design": k, "draw": j, "runs": len(idx), "interval": new, "old_interval": old,
                                 "width": None if isinstance(ens, str) else ens.interval.width,
                                 "optimum": None if isinstance(ens, str) else ens.optimum,
                                 "covered": covered(new, truth), "old_covered": covered(old, truth),
                                 "seconds": round(time.perf_counter() - t0, 2)})
                    print(json.dumps({"noise": noise, **{k2: rows[-1][k2] for k2 in ("design", "draw", "covered",
                                                                                      "old_covered", "seconds")}}),
                          flush=True)
            out["noise"][noise] = {
                "designs_from_line": ln, "designs": len(designs), "rows": rows,
                "coverage": coverage([r["covered"] for r in rows], LEVEL),
                "old_coverage": coverage([r["old_covered"] for r in rows], LEVEL),
                "median_width": float(np.median([r["width"] for r in rows if r["width"] is not None]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("synthetic", "replay", "coverage"), default="synthetic")
    ap.add_argument("--designs-file", default="results/bench/active_proxies.jsonl")
    ap.add_argument("--designs-from", type=int, nargs="+", default=[8, 9],
                    help="coverage mode: lines (0-based) of --designs-file whose synthetic records give the plan's "
                         "designs (8, 9: the 12-seed runs at 1%% and 0.3%% noise of the previous session)")
    ap.add_argument("--draws", type=int, default=5, help="coverage mode: fresh noise draws per design")
    ap.add_argument("--old-bootstrap", type=int, default=32,
                    help="coverage mode: resamples of the earlier interval (the fit's bootstrap over runs)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--noise", type=float, nargs="+", default=[0.003, 0.01])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--active-resolution", type=int, default=9,
                    help="the plan's candidates: this many d/sqrt(N) x r values per size (the grid has 5 x 5)")
    ap.add_argument("--bootstrap", type=int, default=200,
                    help="replicates of the plan's parametric bootstrap inside the loop")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--budget-fraction", type=float, default=1.0 / 3.0,
                    help="the plan's budget as a fraction of the full grid's FLOPs")
    ap.add_argument("--runs", nargs="+", default=["results/bench/active_proxies_demo/runs.csv",
                                                  "results/bench/active_proxies_interior/runs.csv"])
    ap.add_argument("--size-tolerance", type=float, default=0.15)
    ap.add_argument("--r-range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                    help="synthetic arm: keep only runs with r in [LO, HI] in every fit (the method's "
                         "filter, 0.5 5); default none: the generated law holds at every r, and the box's "
                         "snapped edge shapes (r 0.47-0.49 and 5.1-5.5, 12 of the grid's 59 runs) would be "
                         "paid for and then dropped")
    ap.add_argument("--weights", default="log", help="the plan's acquisition weights (archsearch.laws.acquisition.acquire)")
    ap.add_argument("--compare-weights", action="store_true",
                    help="synthetic arm: also run the plan with the other weights on the same draws")
    ap.add_argument("--label", default="", help="a free note stored with the record (e.g. what changed)")
    ap.add_argument("--out", default="results/bench/active_proxies.jsonl")
    args = ap.parse_args()

    load = os.getloadavg()
    prov = provenance(device=False)   # at the start: the code that runs, not the code at the end
    t0 = time.perf_counter()
    res = {"synthetic": synthetic, "replay": replay, "coverage": coverage_mode}[args.mode](args)
    rec = {"benchmark": "active_proxies", "mode": args.mode, "settings": vars(args), **res,
           "seconds": round(time.perf_counter() - t0, 1), "loadavg_start": load, "loadavg_end": os.getloadavg(),
           "provenance": prov}
    summary = {k: v for k, v in rec.items() if k not in ("noise", "trajectory", "provenance")}
    if "noise" in res:
        summary["summary"] = {n: d.get("summary") or {k: v for k, v in d.items() if k != "rows"} for n, d in res["noise"].items()}
    print(json.dumps(summary, default=str))
    append_line(args.out, json.dumps(rec, default=str))


if __name__ == "__main__":
    main()

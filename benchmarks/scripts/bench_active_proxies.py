"""Benchmark (issue 16): the active proxy plan against the fixed grid, on proxy FLOPs.

Synthetic arm (``--mode synthetic``, default): ground truth is a known conditional law, the
method's published multiplicative coefficients (a0 2.697, a1 0.0974, a2 0.0078, b0 0.3870,
b1 0.0063, b2 0.0065; optimum d/sqrt(N)* = a2/a1 = 0.0801, r* = b2/b1 = 1.032) on top of the
Chinchilla law of Hoffmann et al. (E 1.69, A 406.4, alpha 0.34, B 410.7, beta 0.28). Paper-like
proxies: N = 80M, 145M, 297M at D = 100N, a 5 x 5 box of d/sqrt(N) in [0.04, 0.16] and r in
[0.5, 5] (log-spaced; shapes snapped as a study builds them, duplicates once). Each run's loss is
the true law times exp(noise z); grid and plan see the same draw for the same run.

* grid: every run of the box, fitted once (the method's plan); also its size-by-size prefixes.
* active: ``archsearch.laws.active.propose`` over a finer box of candidates at the same sizes
  (``--active-resolution`` 9 x 9; the plan is not bound to the grid's points), grid3 initial
  design at the smallest size, then the acquisition, batches of ``--batch``, run up to a third of the grid's FLOPs. Inside the
  loop the law is fitted with ``--bootstrap`` (32) resamples and 3 starts instead of 200 / 10,
  to keep the benchmark cheap; the plan's estimate is the full fit's closed-form optimum.

Error of an estimate: max(|x1^/x1* - 1|, |r^/r* - 1|). Reported per noise level, medians over
seeds: the grid's FLOPs and error; the plan's FLOPs until its error is within 5% and stays there
(``flops_to_5pct``), the FLOPs and error where its own stopping rule (interval half-width below
``--tolerance``) would stop, and its error at the FLOPs of the grid's first size level.

Real arm (``--mode replay``): the same comparison on real trained proxies, the runs of a study
(default ``results/demo-cpu/proxies/runs.csv``: 13 shapes at N = 100K and 200K trained on
Shakespeare). There is no ground truth: the reference optimum is the fit on every run.

    python -m archsearch.benchmarks.scripts.bench_active_proxies [--seeds 5] [--noise 0.003 0.01]
    python -m archsearch.benchmarks.scripts.bench_active_proxies --mode replay [--runs results/demo-cpu/proxies/runs.csv]

Appends one JSON line per arm to ``results/bench/active_proxies.jsonl`` with provenance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np

from archsearch.fileio import append_line

TRUE = {"a0": 2.697, "a1": 0.0974, "a2": 0.0078, "b0": 0.3870, "b1": 0.0063, "b2": 0.0065}
CHINCHILLA = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}  # Hoffmann et al. 2022
LAW = "conditional-multiplicative"


def paper_pool(sizes=(80e6, 145e6, 297e6), tokens_per_param=100.0, box_x1=(0.04, 0.16),
               box_r=(0.5, 5.0), k=5):
    """The paper-like candidate grid as an active-plan Pool (distinct shapes only)."""
    from archsearch.arch import non_embedding_params
    from archsearch.candidates import BuildSettings, build_candidate
    from archsearch.errors import ArchsearchError
    from archsearch.laws.active import Pool
    from archsearch.laws.synthetic import default_layers

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


def point_optimum(pool, idx, losses, options):
    """Closed-form optimum of the law fitted to runs ``idx`` (None when it has none)."""
    from archsearch.errors import ArchsearchError
    from archsearch.laws import fit_law, forms
    from archsearch.rundata import RunRecord

    runs = [RunRecord.from_arch(pool.specs[i], tokens=float(pool.tokens[i]), loss=float(losses[i]))
            for i in idx]
    try:
        c = fit_law(runs, LAW, options).coefficients
    except ArchsearchError:
        return None
    o = (forms.factor_optimum(c["a1"], c["a2"]), forms.factor_optimum(c["b1"], c["b2"]))
    return None if None in o else o


def run_plan(pool, losses, options, budget, batch, initial="grid3"):
    """Trajectory of the active plan: after each batch, the FLOPs spent, the fit's optimum and
    the interval half-width (None before a fit has one)."""
    from archsearch.laws.active import propose

    observed, traj, spent = {}, [], 0.0
    while spent < budget:
        p = propose(pool, observed, [], LAW, options, k=batch, initial=initial)
        if traj and p.interval is not None:
            traj[-1]["width"] = p.interval.width  # the interval after the previous batch
            traj[-1]["estimate"] = p.optimum
        if not p.picks:
            break
        for pk in p.picks:
            observed[pk["index"]] = losses[pk["index"]]
            spent += float(pool.flops[pk["index"]])
        traj.append({"runs": len(observed), "flops": spent, "width": None, "estimate": None})
    if traj and traj[-1]["estimate"] is None:
        p = propose(pool, observed, [], LAW, options, k=0, initial=initial)
        traj[-1]["width"] = p.interval.width if p.interval else None
        traj[-1]["estimate"] = p.optimum
    return traj


def flops_to(traj, truth, which=(0, 1), bound=0.05):
    """FLOPs after which the plan's error stays within ``bound`` to the end (None: never)."""
    errs = [error(t["estimate"], truth, which) for t in traj]
    return next((traj[i]["flops"] for i in range(len(traj)) if all(e <= bound for e in errs[i:])), None)


def summarise_plan(traj, truth, tol, at_flops):
    errs = [error(t["estimate"], truth) for t in traj]
    to5 = flops_to(traj, truth)
    stop = next((i for i, t in enumerate(traj) if t["width"] is not None and t["width"] <= tol), None)
    before = [i for i, t in enumerate(traj) if t["flops"] <= at_flops]
    return {"flops_to_5pct": to5, "flops_to_5pct_x1": flops_to(traj, truth, (0,)),
            "flops_to_5pct_r": flops_to(traj, truth, (1,)),
            "error_end_x1": error(traj[-1]["estimate"], truth, (0,)),
            "error_end_r": error(traj[-1]["estimate"], truth, (1,)), "runs": traj[-1]["runs"], "flops_end": traj[-1]["flops"],
            "error_end": errs[-1],
            "stop_flops": traj[stop]["flops"] if stop is not None else None,
            "stop_error": errs[stop] if stop is not None else None,
            "stop_runs": traj[stop]["runs"] if stop is not None else None,
            "error_at_grid_level1_flops": errs[before[-1]] if before else None}


def _med(vals):
    """Median over seeds; None (never reached) counts as infinitely late; an infinite median is None."""
    m = float(np.median([math.inf if x is None else x for x in vals]))
    return m if math.isfinite(m) else None


def synthetic(args) -> dict:
    from archsearch.laws import FitOptions, forms

    def with_truth(pool):
        X = dict(pool.X)
        X["Lref"] = forms.predict("chinchilla", CHINCHILLA, X)
        return pool, forms.predict(LAW, TRUE, X)

    pool, mean = with_truth(paper_pool())
    apool, amean = with_truth(paper_pool(k=args.active_resolution))
    truth = (TRUE["a2"] / TRUE["a1"], TRUE["b2"] / TRUE["b1"])
    grid_opts = FitOptions(reference="best-observed")
    loop_opts = FitOptions(reference="best-observed", bootstrap=args.bootstrap, n_starts=3)
    grid_flops = float(pool.flops.sum())
    level_flops = np.cumsum([pool.flops[pool.level == lv].sum() for lv in sorted(set(pool.level))])
    out = {"pool_runs": len(pool), "active_pool_runs": len(apool), "grid_flops": grid_flops, "grid_level_flops": level_flops.tolist(),
           "truth": {"hidden_over_sqrt_n": truth[0], "mlp_to_attn_ratio": truth[1]}, "noise": {}}
    for noise in args.noise:
        rows = []
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            losses = observe(pool, mean, noise, seed)
            grid_est = [point_optimum(pool, np.flatnonzero(pool.level <= lv), losses, grid_opts)
                        for lv in sorted(set(pool.level))]
            grid_levels = [error(e, truth) for e in grid_est]
            traj = run_plan(apool, observe(apool, amean, noise, seed), loop_opts, grid_flops / 3.0, args.batch)
            row = {"seed": seed, "grid_error": grid_levels[-1], "grid_error_by_level": grid_levels,
                   "grid_error_x1": error(grid_est[-1], truth, (0,)), "grid_error_r": error(grid_est[-1], truth, (1,)),
                   "grid_error_x1_by_level": [error(e, truth, (0,)) for e in grid_est],
                   **summarise_plan(traj, truth, args.tolerance, float(level_flops[0])),
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(json.dumps({"noise": noise, **row}), flush=True)
        grid_to5 = [next((float(level_flops[i]) for i, e in enumerate(r["grid_error_by_level"]) if e <= 0.05), None)
                    for r in rows]
        out["noise"][str(noise)] = {
            "seeds": rows,
            "median": {
                "grid_error": _med([r["grid_error"] for r in rows]),
                "grid_by_level_flops_to_5pct": _med(grid_to5),
                "active_flops_to_5pct": _med([r["flops_to_5pct"] for r in rows]),
                "grid_error_x1": _med([r["grid_error_x1"] for r in rows]),
                "grid_error_r": _med([r["grid_error_r"] for r in rows]),
                "grid_by_level_flops_to_5pct_x1": _med([next((float(level_flops[i]) for i, e in
                                                             enumerate(r["grid_error_x1_by_level"]) if e <= 0.05), None)
                                                        for r in rows]),
                "active_flops_to_5pct_x1": _med([r["flops_to_5pct_x1"] for r in rows]),
                "active_seeds_reaching_5pct_x1": sum(r["flops_to_5pct_x1"] is not None for r in rows),
                "active_flops_to_5pct_r": _med([r["flops_to_5pct_r"] for r in rows]),
                "active_error_end_x1": _med([r["error_end_x1"] for r in rows]),
                "active_error_end_r": _med([r["error_end_r"] for r in rows]),
                "active_seeds_reaching_5pct": sum(r["flops_to_5pct"] is not None for r in rows),
                "active_to_grid_flops_ratio": (_med([r["flops_to_5pct"] for r in rows]) or math.nan) / grid_flops,
                "active_stop_flops": _med([r["stop_flops"] for r in rows]),
                "active_stop_error": _med([r["stop_error"] for r in rows]),
                "active_error_at_third_of_grid": _med([r["error_end"] for r in rows]),
                "active_error_at_grid_level1_flops": _med([r["error_at_grid_level1_flops"] for r in rows]),
                "grid_error_level1": _med([r["grid_error_by_level"][0] for r in rows])}}
    return out


def replay(args) -> dict:
    """The plan on real trained proxies: each proposal reads the run's real loss."""
    from archsearch.laws import FitOptions
    from archsearch.laws.active import Pool
    from archsearch.rundata import read_runs

    runs = [r for r in read_runs(args.runs) if r.status == "ok"]
    sizes = sorted({round(r.n_params, -3) for r in runs})
    lev = [min(range(len(sizes)), key=lambda i: abs(math.log(r.n_params / sizes[i]))) for r in runs]
    pool = Pool.of([r.spec for r in runs], [r.tokens for r in runs], lev)
    losses = np.array([r.loss for r in runs])
    opts = FitOptions(reference="best-observed", size_tolerance=args.size_tolerance, r_range=None)
    loop_opts = FitOptions(reference="best-observed", size_tolerance=args.size_tolerance, r_range=None,
                           bootstrap=args.bootstrap, n_starts=3)
    ref = point_optimum(pool, np.arange(len(pool)), losses, opts)
    grid_flops = float(pool.flops.sum())
    traj = run_plan(pool, losses, loop_opts, grid_flops, args.batch)
    for t in traj:
        t["error_vs_all_runs"] = error(t["estimate"], ref) if ref else None
    return {"runs_file": args.runs, "pool_runs": len(pool), "grid_flops": grid_flops,
            "reference_optimum_all_runs": ref, "trajectory": traj,
            **({"flops_to_5pct_of_all_runs_fit": summarise_plan(traj, ref, args.tolerance, 0.0)["flops_to_5pct"]}
               if ref else {"note": "the fit on all runs has no interior optimum: no reference"})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("synthetic", "replay"), default="synthetic")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--noise", type=float, nargs="+", default=[0.003, 0.01])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--active-resolution", type=int, default=9,
                    help="the plan's candidates: this many d/sqrt(N) x r values per size (the grid has 5 x 5)")
    ap.add_argument("--bootstrap", type=int, default=32)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--runs", default="results/demo-cpu/proxies/runs.csv")
    ap.add_argument("--size-tolerance", type=float, default=0.15)
    ap.add_argument("--out", default="results/bench/active_proxies.jsonl")
    args = ap.parse_args()
    from archsearch.provenance import provenance

    load = os.getloadavg()
    t0 = time.perf_counter()
    res = synthetic(args) if args.mode == "synthetic" else replay(args)
    rec = {"benchmark": "active_proxies", "mode": args.mode, "settings": vars(args), **res,
           "seconds": round(time.perf_counter() - t0, 1), "loadavg_start": load, "loadavg_end": os.getloadavg(),
           "provenance": provenance(device=False)}
    summary = {k: v for k, v in rec.items() if k not in ("noise", "trajectory", "provenance")}
    if "noise" in res:
        summary["median"] = {n: d["median"] for n, d in res["noise"].items()}
    print(json.dumps(summary, default=str))
    append_line(args.out, json.dumps(rec, default=str))


if __name__ == "__main__":
    main()

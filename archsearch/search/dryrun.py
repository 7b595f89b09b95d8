"""``archsearch search --dry-run``: what a study would do and what it would cost, without doing
any of it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from archsearch.arch import describe, hidden_over_sqrt_n, mlp_to_attn_ratio, total_params, training_flops
from archsearch.benchmarks.analytic import predict_batch
from archsearch.benchmarks.base import backend_class, resolve_dtype
from archsearch.benchmarks.calibration import Calibration
from archsearch.cluster import startup
from archsearch.cluster.startup import DEFAULTS_NOTE, StartupProfile
from archsearch.errors import ArchsearchError
from archsearch.hardware import get_device
from archsearch.laws import load_law
from archsearch.planning import estimate_training
from archsearch.planning.time import parse_gpus, split_gpus
from archsearch.search.checks import check_reference_batch, data_budgets, planned_groups, source_tokens
from archsearch.search.config import StudyConfig
from archsearch.search.derived import expand
from archsearch.search.gqa import bounded_pairs, gqa_pairs, proxy_runs, proxy_variants
from archsearch.search.margins import range_summary
from archsearch.search.measurements import resolve_backend
from archsearch.search.resolved import ResolvedStudy, as_resolved
from archsearch.search.stages import PlanInputs, table
from archsearch.search.targets import price_targets
from archsearch.trainers import token_budget
from archsearch.trainers.data import cache_state, default_workers, token_dtype
from archsearch.trainers.jobs import content_key, has_record
from archsearch.trainers.loop import run_id_for

# -- assumptions, each printed with the plan ------------------------------------------------------

# Tokenisation: tokens/s of ONE process with one tokenizer thread (byte-level BPE, 8192 entries,
# English text) on a shared 2-core machine, from `python -m archsearch.benchmarks.scripts.bench_tokenize`
# (results/bench/tokenize.jsonl): median 2.08e5 (1.56e5-2.60e5 over 3 runs) under load, median
# 4.6e5 (1.9e5-8.1e5 over 5 rounds) as the load fell. The loaded figure is kept: on a quiet core
# the data preparation may take 2-4x less. A cluster node's core is assumed as fast.
TOKENIZE_TOKENS_PER_S_PER_PROCESS = 2.0e5
TOKENIZE_SOURCE = ("measured here by bench_tokenize (results/bench/tokenize.jsonl): one process, "
                   "byte-level BPE 8192 on English text, on the loaded shared machine (up to 8e5 when "
                   "it was quieter); assumed the same per core on the cluster, for the tokenizer the study names")
# processes the coordinator tokenizes with (archsearch.trainers.data.default_workers: its CPUs,
# at most 32): on Slurm the coordinator's node is assumed to have 32 cores; otherwise this machine's
DATA_PROCESSES = 32


def data_processes(cfg: StudyConfig) -> int:
    return DATA_PROCESSES if cfg.cluster.executor == "slurm" else default_workers()
# start-ups (a job's, an engine process's, an engine's, the coordinator's): measured per machine or
# cluster and read from the study folder's startups.json or a machine profile, else defaults; see
# archsearch/cluster/startup.py
# a checkpoint holds fp32 weights and AdamW's two fp32 moments; the released model bf16/fp32 weights
CHECKPOINT_BYTES_PER_PARAM = 12
MODEL_BYTES_PER_PARAM = 4


def run_flops(spec, tokens: float) -> float:
    """The one FLOP figure of a training run: 6 N_c D, N_c = non-embedding parameters plus the
    output head (what estimate_training prices)."""
    return training_flops(spec, tokens, include_embedding=True)


def data_needs(study: ResolvedStudy, proxy_specs: list[dict[str, Any]],
               startups=None) -> list[dict[str, Any]]:
    """Per distinct (source, tokenizer) of the proxy sweeps: the tokens the largest run needs
    against what the source holds, the repetition that implies and whether ``data.max_epochs``
    allows it, and the tokenisation's size, disk and time (shared by every run that uses it).
    Shards already in the shared cache (``archsearch.trainers.data.cache_state``) are not
    tokenized again: a complete cache costs the coordinator ``data_cached_s`` (measured or a
    default), a partial one that and the tokens still missing."""
    cfg = study.cfg
    su = startups or StartupProfile()

    groups: dict[tuple, dict[str, Any]] = {}
    for item in proxy_specs:
        dc = item["sweep"].data
        key = (tuple(dc.sources), dc.tokenizer)
        g = groups.setdefault(key, {"cfg": dc, "need": 0.0, "sweeps": set(), "max_epochs": dc.max_epochs})
        g["need"] = max(g["need"], item["tokens"])
        g["sweeps"].add(item["sweep"].name)
        g["max_epochs"] = min(g["max_epochs"], dc.max_epochs)
    out = []
    for (srcs, tokenizer), g in groups.items():
        dc = g["cfg"]
        available, how = source_tokens(dc)
        vocab = int(tokenizer[4:]) if tokenizer.startswith("bpe:") else study.vocab_size
        dtype = token_dtype(vocab)
        hub = srcs[0].startswith("hf:")
        # a streamed source is tokenized up to the largest budget (plus the held-out head);
        # files are tokenized whole
        to_tok = (g["need"] + dc.val_tokens) if hub else (available or 0.0)
        if hub and available is not None:
            to_tok = min(to_tok, available)
        epochs = g["need"] / available if available else None
        rate, procs = TOKENIZE_TOKENS_PER_S_PER_PROCESS, data_processes(cfg)
        cache = cache_state(dc, g["need"] + 1)  # as the sweep's coordinator asks for it
        whole = to_tok
        to_tok = to_tok * cache.missing_fraction
        read_s = su.s("data_cached_s") if cache.status in ("complete", "partial") else 0.0
        out.append({
            "source": ",".join(srcs), "tokenizer": tokenizer, "sweeps": sorted(g["sweeps"]),
            "tokens_needed": g["need"], "tokens_available": available, "available_from": how,
            "epochs": epochs, "max_epochs": g["max_epochs"],
            "verdict": ("unknown: the source's size is not known to the plan (checked when the data "
                        "is prepared)" if epochs is None else
                        f"one pass holds it ({epochs:.2f} of the source)" if epochs <= 1 else
                        f"repeats the source {epochs:.2f} times: allowed by data.max_epochs={g['max_epochs']:g}"
                        if epochs <= g["max_epochs"] else
                        f"REFUSED before training: needs {epochs:.2f} passes > data.max_epochs={g['max_epochs']:g}"),
            "tokens_to_tokenize": to_tok, "tokens_in_cache": cache.tokens_present, "dtype": dtype.name,
            "cache": {"status": cache.status, "folder": cache.folder, "note": cache.note,
                      "missing_fraction": cache.missing_fraction,
                      **({"read": su.get("data_cached_s").label()} if read_s or cache.status != "missing" else {})},
            "disk_gb": whole * dtype.itemsize / 1e9,
            "cpu_hours": to_tok / rate / 3600, "wall_hours": (to_tok / (rate * procs) + read_s) / 3600,
            "processes": procs,
        })
    return out


def search_comparisons(cfg: StudyConfig) -> dict[str, int]:
    """The search stage's comparisons, as the study takes them. With ``optuna.seeds_together``
    (a paired study's default) the seed shapes (``enqueue_solution`` of them, when at least two)
    are first compared with the baseline in one group, in one engine process; the other workers
    wait for it. Then pairs (the baseline and one shape) up to ``optuna.n_shapes`` distinct shapes, and up
    to one more per extra worker (the workers share the count, so a trial a worker started before
    the count was reached still finishes). Seeds the law finds infeasible are not measured, and a
    failed measurement costs another trial, up to ``optuna.n_trials``: neither is counted."""
    workers = cfg.cluster.measure_workers if cfg.cluster.parallel else 1
    seeds = min(cfg.optuna.enqueue_solution, cfg.optuna.n_shapes) if cfg.optuna.seeds_together else 0
    seeds = seeds if seeds >= 2 else 0
    pairs = cfg.optuna.n_shapes - seeds
    return {"seed_group": seeds, "low": pairs, "high": pairs + max(0, workers - 1),
            "shapes_low": cfg.optuna.n_shapes, "shapes_high": cfg.optuna.n_shapes + max(0, workers - 1)}


def gqa_comparisons(study: ResolvedStudy) -> dict[str, Any] | None:
    """The local GQA search's paired comparisons (archsearch.search.gqa.local_gqa_search), counted
    on a stand-in for the chosen shape (not known before the search): the baseline's d/sqrt(N)
    and r built at the study's N as the search builds shapes. The variant at ``baseline_gqa`` is
    measured with the baseline (2 engines), then every other variant with the baseline and that
    variant (3 engines), walking up and down from it and stopping in each direction at the first
    significantly slower one; a variant slower but not significantly so is measured once more.
    Low: one step each way; high: every reachable variant, each measured twice (variants the law
    finds infeasible are skipped, unmeasured)."""
    cfg = study.cfg
    if not cfg.gqa_search.enabled:
        return None

    build, base = study.build, study.baseline
    box = cfg.search_space
    clip = lambda v, lo_hi: min(max(v, lo_hi[0]), lo_hi[1])
    g0 = cfg.gqa_search.baseline_gqa
    try:
        shape = expand(cfg, build, clip(hidden_over_sqrt_n(base), box.hidden_over_sqrt_n),
                       clip(mlp_to_attn_ratio(base), box.mlp_to_attn), g0)
    except ArchsearchError:
        shape = base
    can_train = bool(study.sweeps)
    max_gqa, min_kv, why = cfg.gqa_search.bounds(can_train)
    pairs = bounded_pairs(gqa_pairs(shape, cfg.params, build), max_gqa, min_kv)
    if not pairs:
        return {"variants": 0, "gqa_values": [], "low": [], "high": []}
    g0 = g0 if g0 in pairs else min(pairs, key=lambda g: (abs(g - g0), g))
    up, down = sum(g > g0 for g in pairs), sum(g < g0 for g in pairs)
    out = {"variants": len(pairs), "gqa_values": sorted(pairs), "start": g0,
           "bounds": {"max_gqa": max_gqa, "min_kv_heads": min_kv, "from": why},
           "stand_in": {"n_heads": shape.n_heads, "n_kv_heads": shape.n_kv_heads, "hidden_size": shape.hidden_size},
           "low": [2] + [3] * (int(up > 0) + int(down > 0)), "high": [2] + [3] * (2 * (up + down))}
    out["loss_check"] = gqa_proxy_runs(study, shape, g0, pairs) if can_train else \
        {"unverified": True, "runs_low": 0, "runs_high": 0, "runs": []}
    return out


def gqa_proxy_runs(study: ResolvedStudy, shape, g0: int, pairs: dict) -> dict[str, Any]:
    """The local GQA search's loss check at proxy scale (archsearch.search.gqa.ProxyLossCheck), counted
    on the same stand-in: each GQA value walked to trains one run per proxy size where it builds
    and per seed, at the GQA ``g0`` variant's token budget. Low: ``g0`` and one step each way;
    high: every reachable variant (none is trained where only ``g0`` is reachable). Runs already
    trained (in the store or the study folder) are not told apart here."""
    sweep = study.sweeps[0]
    seeds = list(sweep.seeds) if sweep.seeds is not None else [sweep.train.seed]
    sizes = proxy_variants(study, shape, g0)
    up, down = sorted(g for g in pairs if g > g0), sorted((g for g in pairs if g < g0), reverse=True)
    low = [g0] + up[:1] + down[:1] if len(pairs) > 1 else []
    high = sorted(pairs) if len(pairs) > 1 else []
    runs: dict[str, dict[str, Any]] = {}  # by run id: GQA values sharing a stand-in share its runs
    for g in high:
        for _, _, rid, v, tc in proxy_runs(sizes, seeds, g):
            r = runs.setdefault(rid, {"gqa": g, "run": rid, "spec": v, "tokens": tc.tokens,
                                      "flops": run_flops(v, tc.tokens), "low": False})
            r["low"] = r["low"] or g in low
    runs = list(runs.values())
    return {"sweep": sweep.name, "sizes": [item["params"] for item in sizes], "seeds": seeds,
            "not_built": [item["note"] for item in sizes if item["base"] is None],
            "runs_low": sum(r["low"] for r in runs), "runs_high": len(runs),
            "tokens_high": sum(r["tokens"] for r in runs), "flops_low": sum(r["flops"] for r in runs if r["low"]),
            "flops_high": sum(r["flops"] for r in runs), "runs": runs}


def measurement_cost(cfg: StudyConfig, device: str, n_gpus: int, startups=None,
                     study: ResolvedStudy | None = None) -> dict[str, Any]:
    """GPU time of the measurements, as the study takes them (archsearch.benchmarks.paired): each
    comparison of k shapes starts one isolated engine process, k engines in it, ``warmup``
    batches each, then ``min_rounds`` to ``max_rounds`` rounds of k batches at the reference batch
    size. A batch's time is the roofline's prediction for the baseline as measured (rebuilt at
    ``measure.params`` where set; all shapes have about its size) on ``device``. The search
    stage's comparisons run on ``measure_workers`` GPUs at once; the GQA search's in the
    coordinator, one after another. ``cfg``: the study's config, or a deployment target's view of
    it; ``study``: the resolved study (its shapes; derived from ``cfg`` where not given)."""
    study = as_resolved(cfg) if study is None else study
    m = cfg.measure
    n = search_comparisons(cfg)
    gqa = gqa_comparisons(study)
    if backend_class(m.bench.backend).predicted:  # a prediction takes no GPU time
        zero = {"low": 0.0, "high": 0.0}
        return {"device": device, "measurements": n, "workers": 1, "gpu_hours": zero, "wall_hours": zero,
                **({"gqa": {**{k: v for k, v in gqa.items() if k != "loss_check"}, "gpu_hours": zero,
                            "wall_hours": zero}} if gqa else {}),
                "assumptions": ["measure.bench.backend analytic: roofline predictions, no GPU and no engine"]}
    dev = get_device(device)
    dtype = resolve_dtype(m.bench.dtype, on_gpu=dev.name != "cpu")
    cal, other = None, None
    if m.calibration:
        cal = Calibration.load(m.calibration)
        try:
            cal.check_matches(dev.name, m.bench.backend, "measure.calibration")
        except ArchsearchError as e:  # priced on another device than it was fitted on: not applied, and said
            cal, other = None, e.problem
    spec = study.measured_baseline
    b = predict_batch(spec, dev, dtype, m.ref_batch, m.bench.input_len, m.bench.output_len, cal)
    if startups is None:
        startups = StartupProfile()
    su = startups
    start = su.s(f"engine_start_s.{m.bench.backend}")
    first = su.s(f"engine_first_start_s.{m.bench.backend}")
    proc_s = su.s("engine_process_start_s")
    if not b.ok:
        return {"error": b.error or "the reference batch does not fit", "batch_size": m.ref_batch}
    t = b.e2e_latency_mean
    lo_r, hi_r = m.paired.min_rounds, m.paired.max_rounds

    def comparison_s(k: int, rounds: int) -> float:
        return proc_s + first + (k - 1) * start + k * m.bench.warmup * t + rounds * k * t

    # a trial's seconds outside its comparison's engine process, and the worker's gap to its next trial
    trial_s = su.s("trial_overhead_s") + su.s("trial_gap_s")
    per = {"low": comparison_s(2, lo_r) + trial_s, "high": comparison_s(2, hi_r) + trial_s}
    k0 = n["seed_group"]
    # the seed group is measured before the seeds' trials (priced as one trial's overhead); each
    # seed's trial then reads its pair
    read_s = k0 * (su.s("trial_read_s") + su.s("trial_gap_s"))
    group = {"low": comparison_s(k0 + 1, lo_r) + su.s("trial_overhead_s") + read_s,
             "high": comparison_s(k0 + 1, hi_r) + su.s("trial_overhead_s") + read_s} if k0 else {"low": 0.0, "high": 0.0}
    workers = max(1, min(cfg.cluster.measure_workers, n_gpus))
    job_s = su.s("worker_start_s") if cfg.cluster.parallel else 0.0
    # the coordinator before the workers' submission, after the last trial until it sees them end,
    # and after that until the stage ends
    around_s = su.s("search_lead_s") + su.s("worker_end_s") + su.s("search_tail_s") if cfg.cluster.parallel else 0.0
    nw = {k: -(-n[k] // workers) for k in ("low", "high")}  # pairs of the busiest worker
    out: dict[str, Any] = {
        "device": dev.name, "batch_size": m.ref_batch, "batch_seconds": t,
        "batch_tokens": m.ref_batch * (m.bench.input_len + m.bench.output_len), "measured_params": m.params,
        "predicted_output_tokens_per_s": b.output_throughput, "engine_start_s": start, "engine_first_start_s": first,
        "engine_process_start_s": proc_s, "comparison_s": per, "seed_group_s": group,
        "seed_group": k0, "pairs": {"low": n["low"], "high": n["high"]},
        "measurements": n["shapes_high"], "measurements_low": n["shapes_low"], "workers": workers,
        # every worker's GPU is held from its job's start, also while it waits for the seed group
        "gpu_hours": {k: (workers * (job_s + group[k]) + n[k] * per[k]) / 3600 for k in per},
        "wall_hours": {k: (around_s + job_s + group[k] + nw[k] * per[k]) / 3600 for k in per},
        "assumptions": [
            (f"search: the {k0} seed shapes compared with the baseline in one group of {k0 + 1} "
             f"(optuna.seeds_together{'; priced before every other comparison: the other workers may meanwhile measure pairs of their own, counted below, so this is a high end' if workers > 1 else ''}), then " if k0 else "search: ")
            + f"{n['low']}" + (f"-{n['high']}" if n["high"] > n["low"] else "") + " paired comparisons of the "
            f"baseline and one shape ({cfg.optuna.n_shapes} measured shapes in all"
            + (f", and up to {n['high'] - n['low']} more started by the other workers before the count was reached"
               if n["high"] > n["low"] else "")
            + "; seeds the law finds infeasible and failed measurements are not counted); the busiest worker "
            f"takes {nw['low']}" + (f"-{nw['high']}" if nw["high"] > nw["low"] else "") + " pair(s)",
            f"a comparison of k shapes: one isolated engine process (Python, torch and the engine imported: "
            f"{su.get('engine_process_start_s').label()}), k engine starts ({m.bench.backend}: the first in the process "
            f"{su.get('engine_first_start_s.' + m.bench.backend).label()}, each next "
            f"{su.get('engine_start_s.' + m.bench.backend).label()}), {m.bench.warmup} warm-up batch(es) each, {lo_r}-{hi_r} rounds of k batches of {m.ref_batch} x "
            f"({m.bench.input_len} in + {m.bench.output_len} out) tokens",
            f"a batch takes {t:.3g} s: the "
            + (f"roofline calibrated by {cal.describe(m.calibration)}" if cal else
               "UNCALIBRATED roofline (peak figures: optimistic, so the timed rounds' seconds are a lower bound; "
               + (f"measure.calibration {m.calibration} is not applied: {other})" if other else
                  "measure.calibration prices them with a calibration of this device and engine)"))
            + " of the baseline" + (f" rebuilt at measure.params = {m.params:.3g}" if m.params else "")
            + f" on {dev.name} ({b.output_throughput:,.0f} output tokens/s)",
            f"a trial that measures its comparison spends {su.get('trial_overhead_s').label()} outside its engine "
            f"process (the shape sampled and built, the law, the measurement store; the seed group priced the same), "
            f"a seed's trial reading its group's pair {su.get('trial_read_s').label()}, and a worker "
            f"{su.get('trial_gap_s').label()} between its trials",
            f"{workers} Optuna worker(s) measure at once, one GPU each"
            + (f", each a job whose first trial starts {su.get('worker_start_s').label()} after its submission; "
               f"the coordinator's {su.get('search_lead_s').label()} from the stage's start to submitting them, "
               f"{su.get('worker_end_s').label()} after the last trial until it sees them end, and "
               f"{su.get('search_tail_s').label()} after that (the study read back, the best shape chosen)"
               if cfg.cluster.parallel else "")]}
    if gqa:
        secs = {k: sum(comparison_s(g, r) for g in gqa[k]) for k, r in (("low", lo_r), ("high", hi_r))}
        out["gqa"] = {**{k: v for k, v in gqa.items() if k != "loss_check"},  # its proxy runs: in the plan's compute
                      "comparisons": {"low": len(gqa["low"]), "high": len(gqa["high"])},
                      "gpu_hours": {k: v / 3600 for k, v in secs.items()},
                      "wall_hours": {k: v / 3600 for k, v in secs.items()}}
        out["assumptions"].append(
            f"GQA search in the coordinator on one GPU: {gqa['variants']} GQA values reachable from the "
            f"head total of a stand-in for the chosen shape (the baseline's d/sqrt(N) and r built at the study's N; "
            f"the chosen shape is not known before the search); "
            f"{len(gqa['low'])}-{len(gqa['high'])} comparisons (one step each way, up to every variant "
            f"measured twice), the first of 2 shapes, the others of 3")
    return out


def planned_proxy_runs(study: ResolvedStudy, out: Path) -> list[dict[str, Any]]:
    """The proxy runs the proxy stage would train (none where the law is given or the runs
    reused), each marked ``done`` where already trained: in the shared store (another study
    trained it) or in this study folder (a resumed study)."""
    cfg = study.cfg
    if cfg.proxy is None or cfg.proxy.runs:
        return []
    specs = []
    for sweep, shapes in zip(study.sweeps, study.sweep_shapes):
        seen = set()
        for point, spec, _err in shapes:
            tc = sweep.train_for(point["level"]).replace(seed=point["seed"])
            if spec is None or (spec, point["seed"]) in seen:  # unbuildable, or a duplicate after snapping
                continue
            seen.add((spec, point["seed"]))
            tokens = token_budget(spec, tc)
            specs.append({"spec": spec, "tokens": tokens, "flops": run_flops(spec, tokens),
                          "run": run_id_for(spec, tokens, point["seed"]), "sweep": sweep, "train": tc})
    for item in specs:
        own = out / "proxies" / item["sweep"].name / "runs" / item["run"]
        shared = (Path(cfg.proxy.store).expanduser() / content_key(item["run"], item["train"], item["sweep"].data)
                  if cfg.proxy.store else None)
        item["done"] = ("store" if shared is not None and has_record(shared) else
                        "study" if has_record(own) else None)
    return specs


def dry_run(study: ResolvedStudy | StudyConfig, out: Path, gpus: str | None = None,
         profile: str | Path | None = None, mfu: float | None = None,
         time_law: str | Path | None = None) -> dict[str, Any]:
    """What the study would do, with its compute, without doing any of it. ``study``: the study
    resolved (and checked) by :func:`archsearch.search.resolved.resolve`, or a config, resolved
    here unchecked (:func:`~archsearch.search.resolved.derive`). ``profile``: a machine
    profile of start-ups (default ``cluster.profile``); the study folder's own record wins.
    ``mfu`` / ``time_law``: what training is priced with (``estimate_training``; default the
    planner's assumed MFU)."""
    study = as_resolved(study)
    cfg = study.cfg
    p: dict[str, Any] = {"study": cfg.name, "out": str(out), "stages": []}
    profile = profile or cfg.cluster.profile
    su = startup.startup_profile(out, profile)
    p["startups"] = {"profile": str(profile) if profile else None,
                     "study_record": str(out / startup.STARTUPS_FILE) if (out / startup.STARTUPS_FILE).is_file() else None,
                     "figures": {k: asdict(su.get(k)) for k in startup.FIGURES}}
    proxy_specs = planned_proxy_runs(study, out)
    try:
        backend, engine_note = resolve_backend(cfg.measure)
    except ArchsearchError as e:
        backend, engine_note = None, f"cannot measure here: {e}"
    n_meas = search_comparisons(cfg)
    gqa_n = gqa_comparisons(study)
    base = study.baseline
    final_tokens = cfg.final_train.tokens or cfg.tokens
    final_flops = run_flops(base, final_tokens)
    inputs = PlanInputs(study, out, proxy_specs, backend, engine_note, n_meas, gqa_n, final_tokens, final_flops,
                        nd_groups=len(planned_groups(cfg)) if cfg.proxy is not None and not cfg.proxy.runs else 0)
    p["stages"] = [entry for st in table() if (entry := st.plan(inputs)) is not None]
    proxy_flops = sum((i["flops"] for i in proxy_specs), 0.0)
    p["baseline"] = describe(base)
    p["compute"] = {"proxy_train_flops": proxy_flops, "final_train_flops_per_model": final_flops}
    p["data"] = data_needs(study, proxy_specs, su)
    # what the study refuses before training (checks.check_data_budgets)
    p["data_budgets"] = data_budgets(cfg, list(study.sweep_shapes))
    p["law"] = law_trust(cfg)
    data_wall = sum(d["wall_hours"] for d in p["data"])
    if p["data"]:  # the proxy stage prepares its data (in the coordinator) before any run trains
        next(st for st in p["stages"] if st["stage"] == "proxy").update({"data_tokens": sum(d["tokens_to_tokenize"] for d in p["data"]),
                               "data_disk_gb": sum(d["disk_gb"] for d in p["data"]),
                               "data_cpu_hours": sum(d["cpu_hours"] for d in p["data"]),
                               "data_wall_hours": data_wall})
    # disk: every proxy run's checkpoints (keep_checkpoints of them) and its released model
    ckpt = sum(total_params(i["spec"]) * (CHECKPOINT_BYTES_PER_PARAM * i["train"].keep_checkpoints
                                           + MODEL_BYTES_PER_PARAM) for i in proxy_specs)
    p["disk"] = {"token_shards_gb": sum(d["disk_gb"] for d in p["data"]), "proxy_checkpoints_gb": ckpt / 1e9,
                 "engine_models_gb": 0.0,
                 "assumptions": [f"a checkpoint holds {CHECKPOINT_BYTES_PER_PARAM} bytes a parameter (fp32 weights "
                                 f"and AdamW moments), keep_checkpoints of them per run, plus the released "
                                 f"model at {MODEL_BYTES_PER_PARAM} bytes a parameter; runs in a shared "
                                 "proxy.store are counted once for every study that links them",
                                 "measured shapes take no disk: their model folders hold config.json only, in a "
                                 "temporary folder, the engine filling random weights (vLLM/SGLang load_format "
                                 "dummy, transformers from_config); engine compile caches (vLLM's torch.compile) "
                                 "are not counted"]}
    if gpus:
        n_total, _ = parse_gpus(gpus)
        device = split_gpus(gpus)[1]
        per_job = max(1, cfg.cluster.gpus_per_job)
        slots = max(1, min(cfg.cluster.jobs_at_once, n_total // per_job)) if cfg.cluster.parallel else 1
        runs = []
        for item in proxy_specs:
            e = estimate_training(item["spec"], item["tokens"], f"{per_job}x{device}", mfu=mfu, time_law=time_law)
            start_h = (su.s("job_start_s") + su.s("job_end_s")) / 3600 if cfg.cluster.parallel else 0.0
            if item["done"]:  # already trained: listed, not priced
                runs.append({"run": item["run"], "tokens": item["tokens"], "train_flops": item["flops"],
                             "hours": 0.0, "gpu_hours": 0.0, "cost_usd": 0.0, "already_trained": item["done"]})
                continue
            runs.append({"run": item["run"], "tokens": item["tokens"], "train_flops": item["flops"],
                         "hours": e.hours + start_h, "gpu_hours": e.gpu_hours + start_h * per_job,
                         "cost_usd": e.cost_usd or 0.0})
        sweeps_trained = {i["sweep"].name for i in proxy_specs if not i["done"]}
        # the GQA search's loss check: its proxy runs, priced like the proxies' (not told apart when done)
        gqa_runs = []
        for item in ((gqa_n or {}).get("loss_check") or {}).get("runs", []):
            e = estimate_training(item["spec"], item["tokens"], f"{per_job}x{device}", mfu=mfu, time_law=time_law)
            start_h = (su.s("job_start_s") + su.s("job_end_s")) / 3600 if cfg.cluster.parallel else 0.0
            gqa_runs.append({"gqa": item["gqa"], "run": item["run"], "low": item["low"], "hours": e.hours + start_h,
                             "gpu_hours": e.gpu_hours + start_h * per_job, "cost_usd": e.cost_usd or 0.0})
        fin = estimate_training(base, final_tokens, gpus, mfu=mfu, time_law=time_law)

        for view in study.views:  # each deployment target's, or the measure block's
            if view.cfg.measure.bench.backend != "analytic":  # refused, with the numbers, where the baseline cannot hold it
                with view.named():
                    fit = check_reference_batch(view.cfg, view.cfg.measure.bench.device_spec or device,
                                                study.measured_baseline)
                p.setdefault("reference_batch", fit)
        try:
            if cfg.measure.targets:  # each target priced on its device and engine, summed
                meas = price_targets(cfg, device, lambda c, d: measurement_cost(c, d, n_total, su, study))
            else:
                meas = measurement_cost(cfg, device, n_total, su, study)
        except ArchsearchError as e:
            meas = {"error": f"{e.field}: {e.problem}"}
        p["compute"].update({
            "gpus": gpus, "proxy_runs": runs, "proxy_gpu_hours": sum(r["gpu_hours"] for r in runs),
            "proxy_wall_hours": proxy_wall_hours([r["hours"] for r in runs], slots, cfg, su, len(sweeps_trained)),
            "proxy_jobs_at_once": slots,
            "proxy_cost_usd": sum(r["cost_usd"] for r in runs), "final_train": fin.to_dict(),
            "measure": meas,
            "assumptions": [
                f"executor {cfg.cluster.executor}: {slots} proxy job(s) at once, {per_job} {device} each "
                f"(of the {n_total} named); runs are placed longest first on the first free slot",
                "a run's time is archsearch.planning.estimate_training on its job's GPUs "
                + (f"by the time law {time_law}" if time_law else
                   f"(MFU {fin.assumptions['mfu']:g}: "
                   + ("given with --mfu" if mfu is not None else
                      fin.assumptions["mfu_source"])
                   + ")"),
                "one FLOP figure per run: 6 N_c D, N_c = non-embedding parameters + output head",
                (f"every proxy job reaches its first step {su.get('job_start_s').label()} after its submission "
                 f"(Python with torch, transformers and accelerate, the data read, the model built) and "
                 f"spends {su.get('job_end_s').label()} outside its steps after that (evaluations, saving, exit, "
                 f"polling), the GPU held meanwhile; the coordinator spends {su.get('proxy_lead_s').label()} "
                 f"before its first submission, {su.get('job_gap_s').label()} from seeing a job end to "
                 f"submitting the next in its place, and {su.get('proxy_tail_s').label()} per sweep after its "
                 "last job until its runs are collected"
                 if cfg.cluster.parallel else "inline: runs train in this process, no job start-up")
                + "; queueing on a busy cluster is not included"]})
        by_stage = {"proxy": {"gpu_hours": p["compute"]["proxy_gpu_hours"],
                              "wall_hours": p["compute"]["proxy_wall_hours"] + data_wall,
                              "disk_gb": ckpt / 1e9}}
        if "gpu_hours" in meas:
            by_stage["search"] = {"gpu_hours": meas["gpu_hours"]["high"], "gpu_hours_low": meas["gpu_hours"]["low"],
                                  "wall_hours": meas["wall_hours"]["high"], "wall_hours_low": meas["wall_hours"]["low"],
                                  "disk_gb": p["disk"]["engine_models_gb"]}
        if "gqa" in meas:
            g = meas["gqa"]
            by_stage["gqa"] = {"gpu_hours": g["gpu_hours"]["high"], "gpu_hours_low": g["gpu_hours"]["low"],
                               "wall_hours": g["wall_hours"]["high"], "wall_hours_low": g["wall_hours"]["low"]}
        if gqa_runs:
            # the walk trains each variant's runs when it reaches it: one variant's runs at once
            by_variant = {k: {} for k in ("low", "high")}
            for r in gqa_runs:
                for k in ("low", "high") if r["low"] else ("high",):
                    by_variant[k].setdefault(r["gqa"], []).append(r["hours"])
            gp = {"runs": {"low": sum(r["low"] for r in gqa_runs), "high": len(gqa_runs)},
                  "gpu_hours": {"low": sum(r["gpu_hours"] for r in gqa_runs if r["low"]),
                                "high": sum(r["gpu_hours"] for r in gqa_runs)},
                  "wall_hours": {k: sum(makespan(h, slots) for h in by_variant[k].values()) for k in by_variant},
                  "cost_usd": {"low": sum(r["cost_usd"] for r in gqa_runs if r["low"]),
                               "high": sum(r["cost_usd"] for r in gqa_runs)}}
            p["compute"]["gqa_proxy"] = gp
            g = by_stage.setdefault("gqa", {})
            g.update({"proxy_gpu_hours": gp["gpu_hours"]["high"], "proxy_gpu_hours_low": gp["gpu_hours"]["low"],
                      "proxy_wall_hours": gp["wall_hours"]["high"], "proxy_wall_hours_low": gp["wall_hours"]["low"]})
        if any(st["stage"] == "train" for st in p["stages"]):
            k = cfg.top_k if cfg.mode == "predict-rank-select" else 1
            by_stage["train"] = {"gpu_hours": k * fin.gpu_hours, "wall_hours": k * fin.hours,
                                 "tokens": k * final_tokens}
        for st in p["stages"]:  # a stage's plan that names its full-budget trainings: priced as that many
            if st.get("final_trainings") and st["stage"] not in by_stage:
                k = st["final_trainings"]
                by_stage[st["stage"]] = {"gpu_hours": k * fin.gpu_hours, "wall_hours": k * fin.hours,
                                         "cost_usd": k * (fin.cost_usd or 0.0)}
            st.update({f"{k}": v for k, v in by_stage.get(st["stage"], {}).items() if k not in st})
    p["assumptions"] = [f"data: tokenisation at {TOKENIZE_TOKENS_PER_S_PER_PROCESS:,.0f} tokens/s per process "
                        f"({TOKENIZE_SOURCE}), {data_processes(cfg)} processes (executor {cfg.cluster.executor}: "
                        f"{'a 32-core coordinator node, assumed' if cfg.cluster.executor == 'slurm' else 'this machine'}"
                        "); a streamed source is tokenized up to the largest run's budget plus its held-out "
                        "head, files whole; shards already in the shared cache (found as the study finds "
                        "them, nothing tokenized) are not tokenized again: reading a complete cache costs "
                        f"{su.get('data_cached_s').label()}, a partial one that plus the tokens still missing; "
                        "download time and BPE training are not counted",
                        "data: a source's size comes from its dataset card or its file bytes; every run of "
                        "the same source and tokenizer shares one tokenisation"]
    p["total"] = bottom_line(p)
    return p


def bottom_line(p: dict[str, Any]) -> dict[str, Any] | None:
    """The study's whole cost in one place, low and high: GPU-hours, dollars and days of wall
    time, summed over its stages (which run one after another), from the stages' own figures;
    with the final training of the chosen shape added where it is not a stage of the study.
    None without a GPU count (``--gpus``: nothing is priced)."""
    c = p["compute"]
    ft = c.get("final_train")
    if ft is None:
        return None
    gpu = {"low": 0.0, "high": 0.0}
    wall = {"low": 0.0, "high": 0.0}
    for st in p["stages"]:
        for k in ("low", "high"):
            for what, acc in (("gpu_hours", gpu), ("wall_hours", wall)):
                for pre in ("", "proxy_"):  # the GQA stage's own proxy runs beside its comparisons
                    v = st.get(f"{pre}{what}_low" if k == "low" else f"{pre}{what}", st.get(f"{pre}{what}"))
                    acc[k] += float(v or 0.0)
    rate = (ft.get("cost_usd") or 0.0) / ft["gpu_hours"] if ft.get("gpu_hours") else None  # $ per GPU-hour
    train_stage = any(st["stage"] == "train" for st in p["stages"])
    out = {"gpus": c.get("gpus"), "gpu_hours": gpu, "wall_hours": wall,
           "days": {k: v / 24 for k, v in wall.items()},
           "cost_usd": {k: v * rate for k, v in gpu.items()} if rate is not None else None,
           "usd_per_gpu_hour": rate, "stages": [st["stage"] for st in p["stages"]],
           "final_training_included": train_stage}
    if not train_stage:
        out["with_final_training"] = {"gpu_hours": {k: v + ft["gpu_hours"] for k, v in gpu.items()},
                                      "days": {k: (v + ft["hours"]) / 24 for k, v in wall.items()},
                                      "cost_usd": ({k: v * rate + (ft.get("cost_usd") or 0.0) for k, v in gpu.items()}
                                                   if rate is not None else None)}
    return out


def render_bottom_line(t: dict[str, Any] | None) -> str:
    """The dry run's last line: the whole study's GPU-hours, cost and days."""
    if t is None:
        return "total: not priced (give --gpus, e.g. --gpus 8xH100, for GPU-hours, cost and days)"

    def rng(d: dict[str, float] | None, fmt: str, unit: str = "") -> str:
        if d is None:
            return "n/a"
        lo, hi = format(d["low"], fmt), format(d["high"], fmt)
        return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"

    line = (f"total on {t['gpus']}: {rng(t['gpu_hours'], ',.0f')} GPU-h, ${rng(t['cost_usd'], ',.0f')}, "
            f"{rng(t['days'], '.1f')} days ({' + '.join(t['stages'])}, one after another)")
    w = t.get("with_final_training")
    if w:
        line += (f"; with the final training of the chosen shape: {rng(w['gpu_hours'], ',.0f')} GPU-h, "
                 f"${rng(w['cost_usd'], ',.0f')}, {rng(w['days'], '.1f')} days")
    return line


def law_trust(cfg: StudyConfig) -> str:
    """What the loss constraint will trust the law with: its error against trained models and its
    fitted range (archsearch.search.margins), as far as known before the fit."""
    rule = ("shapes outside it allowed (law.allow_extrapolation: true)" if cfg.law.allow_extrapolation
            else "shapes outside it refused")
    if not cfg.law.file:
        return ("error: measured after the fit, on the largest proxy size held out (progressive protocol); "
                f"fitted range: the runs' d/sqrt(N) and r after the r filter, {rule}")

    law = load_law(cfg.law.file)
    e = law.prediction_error
    rng = range_summary(law, cfg.law.allow_extrapolation)
    box = rng["range"]
    where = "not stated" if box is None else ", ".join(
        f"{name} [{b[0]:.4g}, {b[1]:.4g}]" if b else f"{name} not stated"
        for name, b in (("d/sqrt(N)", box.get("hidden_over_sqrt_n")), ("r", box.get("mlp_to_attn"))))
    return (f"error: {e['relative_sd']:.2%} of the loss (sd, stated by {cfg.law.file})" if e else
            f"error: not stated by {cfg.law.file} (margins rest on the bootstrap alone)") + \
        f"; fitted range: {where}; {rng['rule']}"


def _g(x: Any) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def render(p: dict[str, Any]) -> list[str]:
    """The plan as lines for a person: stages with their cost, data, disk, every assumption."""
    lines = [f"plan for study {p['study']} -> {p['out']}"]
    su = p.get("startups")
    if su:
        measured = sorted(k for k, f in su["figures"].items() if f["source"] == "measured")
        lines.append("  start-ups: " + "; ".join(
            [f"machine profile {su['profile']}" if su["profile"] else "no machine profile (cluster.profile / --profile)"]
            + ([f"this study's own record {su['study_record']}"] if su["study_record"] else [])
            + [f"measured: {', '.join(measured)}" if measured else "none measured: every start-up is a default"]
            + ([f"defaults: {DEFAULTS_NOTE}"] if len(measured) < len(su["figures"]) else [])))
    for i, st in enumerate(p["stages"], 1):
        extra = ", ".join(f"{k}={_g(v)}" for k, v in st.items() if k not in ("stage", "action"))
        lines.append(f"  {i}. {st['stage']:<7} {st['action']}" + (f"  [{extra}]" if extra else ""))
    for d in p.get("data", []):
        avail = "unknown" if d["tokens_available"] is None else f"{d['tokens_available']:.3g}"
        lines.append(f"  data {d['source']} ({d['tokenizer']}): needs {d['tokens_needed']:.3g} tokens "
                     f"(largest run of {', '.join(d['sweeps'])}), holds {avail} ({d['available_from']}): "
                     f"{d['verdict']}; cache {d['cache']['status']} ({d['cache']['note']}"
                     + (f", read in {d['cache']['read']}" if d["cache"].get("read") else "") + "); "
                     f"tokenize {d['tokens_to_tokenize']:.3g} tokens as {d['dtype']}, "
                     f"{d['disk_gb']:.3g} GB, {d['cpu_hours']:.3g} CPU-h, {d['wall_hours']:.3g} h wall")
    if p.get("law"):
        lines.append(f"  law: {p['law']}")
    for b in p.get("data_budgets", []):
        avail = "an unknown number of" if b["tokens_available"] is None else f"{b['tokens_available']:.3g}"
        lines.append(f"  data check: {b['what']}{'' if b['runs'] else ' (not enabled)'} needs {b['tokens_needed']:.3g} "
                     f"tokens; {b['source']} holds {avail} ({b['available_from']}): {b['verdict']}"
                     + ("" if b["runs"] or b["status"] != "refused" else "; refused if enabled"))
    c = p["compute"]
    lines.append(f"  compute: proxies {c['proxy_train_flops']:.3g} FLOPs; final training "
                 f"{c['final_train_flops_per_model']:.3g} FLOPs per model")
    dk = p.get("disk")
    if dk:
        lines.append(f"  disk: token shards {dk['token_shards_gb']:.3g} GB, proxy checkpoints and models "
                     f"{dk['proxy_checkpoints_gb']:.3g} GB, measured models {dk['engine_models_gb']:.3g} GB")
    if "final_train" in c:
        ft = c["final_train"]
        for r in c["proxy_runs"]:
            lines.append(f"    proxy {r['run']}: {r['tokens']:.3g} tokens, {r['train_flops']:.3g} FLOPs, "
                         + (f"already trained ({'in the shared store' if r['already_trained'] == 'store' else 'in this study folder'})"
                            if r.get("already_trained") else f"{r['hours']:.2f} h, {r['gpu_hours']:.1f} GPU-h"))
        lines.append(f"  on {c['gpus']}: proxies {c['proxy_gpu_hours']:.1f} GPU-h, {c['proxy_wall_hours']:.2f} h wall "
                     f"with {c['proxy_jobs_at_once']} job(s) at once (${c['proxy_cost_usd']:,.0f}); final training "
                     f"{ft.get('hours', float('nan')):.1f} h, {ft.get('gpu_hours', float('nan')):.0f} GPU-h, "
                     f"${ft.get('cost_usd') or 0:,.0f}")
        gp = c.get("gqa_proxy")
        if gp:
            lines.append(f"  GQA loss check: {gp['runs']['low']}-{gp['runs']['high']} proxy runs of GQA variants, "
                         f"{gp['gpu_hours']['low']:.3g}-{gp['gpu_hours']['high']:.3g} GPU-h, "
                         f"{gp['wall_hours']['low']:.3g}-{gp['wall_hours']['high']:.3g} h wall "
                         f"(${gp['cost_usd']['low']:,.0f}-${gp['cost_usd']['high']:,.0f})")
        m = c.get("measure", {})
        if "gpu_hours" in m and "pairs" not in m:  # predicted by the analytic backend: no GPU time
            lines.append("  measurements: no GPU time (measure.bench.backend analytic)")
        elif "gpu_hours" in m:
            lines.append(f"  measurements: search {m['measurements_low']}-{m['measurements']} shapes ("
                         + (f"a seed group of {m['seed_group'] + 1}, then " if m["seed_group"] else "")
                         + f"{m['pairs']['low']}-{m['pairs']['high']} pairs), {m['gpu_hours']['low']:.3g}-"
                         f"{m['gpu_hours']['high']:.3g} GPU-h, {m['wall_hours']['low']:.3g}-{m['wall_hours']['high']:.3g} "
                         f"h wall on {m['workers']} worker(s)")
            if "gqa" in m:
                g = m["gqa"]
                lines.append(f"  measurements: GQA search {g['comparisons']['low']}-{g['comparisons']['high']} paired "
                             f"comparisons, {g['wall_hours']['low']:.3g}-{g['wall_hours']['high']:.3g} h on one GPU")
        elif m:
            lines.append(f"  measurements: not priced ({m.get('error')})")
        for a in c["assumptions"] + m.get("assumptions", []):
            lines.append(f"  assumption: {a}")
    for a in p.get("assumptions", []) + (dk or {}).get("assumptions", []):
        lines.append(f"  assumption: {a}")
    lines.append(render_bottom_line(p.get("total")))
    return lines


def proxy_wall_hours(hours: list[float], slots: int, cfg: StudyConfig, su, sweeps: int) -> float:
    """The proxy stage's jobs on ``slots`` (``makespan``), each job after a slot's first one
    submitted ``job_gap_s`` after the one before it was seen ended, plus the coordinator's lead and,
    per sweep with runs to train, its tail (data preparation is added apart)."""
    hours = [h for h in hours if h]
    if not hours or not cfg.cluster.parallel:
        return makespan(hours, slots)
    gap = su.s("job_gap_s") / 3600
    return (makespan([h + gap for h in hours], slots) - gap + su.s("proxy_lead_s") / 3600
            + sweeps * su.s("proxy_tail_s") / 3600)


def makespan(hours: list[float], slots: int) -> float:
    """Wall time of independent jobs on ``slots`` parallel slots, longest first on the first
    free slot (what a scheduler with that many jobs at once does)."""
    free = [0.0] * max(1, slots)
    for h in sorted(hours, reverse=True):
        i = free.index(min(free))
        free[i] += h
    return max(free)

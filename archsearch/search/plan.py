"""``archsearch search --dry-run``: what a study would do and what it would cost, without doing
any of it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from archsearch.arch import describe
from archsearch.errors import ArchsearchError
from archsearch.search.checks import _planned_groups, baseline_spec, proxy_sweeps, vocab_size
from archsearch.search.config import StudyConfig

def plan(cfg: StudyConfig, out: Path, gpus: str | None = None) -> dict[str, Any]:
    """What the study would do, with its compute, without doing any of it."""
    from archsearch.arch import training_flops

    p: dict[str, Any] = {"study": cfg.name, "out": str(out), "stages": []}
    runs_n, proxy_tokens, proxy_flops = 0, 0.0, 0.0
    proxy_specs = []
    if cfg.proxy is None:
        p["stages"].append({"stage": "proxy", "action": f"none: the law comes from {cfg.law.file}"})
    elif cfg.proxy.runs:
        p["stages"].append({"stage": "proxy", "action": f"reuse runs from {cfg.proxy.runs}"})
    else:
        from archsearch.trainers import sweep_specs, token_budget
        from archsearch.trainers.loop import run_id_for

        sweeps = proxy_sweeps(cfg)
        for sweep in sweeps:
            seen = set()
            for point, spec, _err in sweep_specs(sweep, vocab_size(cfg)):
                tc = sweep.train_for(point["level"]).replace(seed=point["seed"])
                if spec is None or (spec, point["seed"]) in seen:  # unbuildable, or a duplicate after snapping
                    continue
                seen.add((spec, point["seed"]))
                tokens = token_budget(spec, tc)
                runs_n += 1
                proxy_tokens += tokens
                proxy_flops += training_flops(spec, tokens)
                proxy_specs.append({"spec": spec, "tokens": tokens, "flops": training_flops(spec, tokens),
                                    "run": run_id_for(spec, tokens, point["seed"])})
        active = cfg.proxy.plan == "active"
        a = cfg.proxy.active
        p["stages"].append({"stage": "proxy", "action": (
                            f"active plan over the grid of {len(sweeps)} sweep(s) (at most the runs and FLOPs "
                            f"below; stops at interval half-width {a.tolerance} or budget {a.budget_flops}): "
                            if active else f"train {len(sweeps)} proxy sweep(s): ")
                            + ", ".join(s.name for s in sweeps), "runs": runs_n,
                            "tokens": proxy_tokens, "train_flops": proxy_flops,
                            "nd_groups": len(_planned_groups(cfg))})
    p["stages"].append({"stage": "fit", "action": f"fit {cfg.law.form} (reference {cfg.law.reference}, "
                        f"{cfg.law.bootstrap} bootstrap resamples)" if not cfg.law.file
                        else f"load {cfg.law.file}"})
    from archsearch.search.measure import resolve_backend

    try:
        backend, engine_note = resolve_backend(cfg.measure)
    except ArchsearchError as e:
        backend, engine_note = None, f"cannot measure here: {e}"
    n_meas = cfg.optuna.n_trials + 1 + (len(cfg.search_space.gqa) if cfg.gqa_search.enabled else 0)
    p["stages"].append({"stage": "search", "action": f"Optuna {cfg.optuna.sampler} study, "
                        f"{cfg.optuna.n_trials} measured trials (objective {cfg.optuna.objective})",
                        "backend": cfg.measure.backend, "engine_here": backend or "missing",
                        **({"engine_note": engine_note} if engine_note else {}),
                        "batch_sizes": cfg.measure.batch_sizes,
                        "input_len": cfg.measure.input_len, "output_len": cfg.measure.output_len,
                        "measurements_at_most": n_meas})
    if cfg.gqa_search.enabled:
        p["stages"].append({"stage": "gqa", "action": f"local GQA search from GQA={cfg.gqa_search.baseline_gqa}"})
    base = baseline_spec(cfg)
    final_tokens = cfg.final_train.tokens or cfg.tokens
    final_flops = training_flops(base, final_tokens)
    if cfg.final_train.enabled or cfg.mode == "predict-rank-select":
        k = cfg.top_k if cfg.mode == "predict-rank-select" else 1
        p["stages"].append({"stage": "train", "action": f"train {k} chosen shape(s) on {final_tokens:.3g} tokens",
                            "train_flops": k * final_flops})
    if cfg.evaluation.enabled:
        p["stages"].append({"stage": "eval", "action": f"lm-eval tasks {cfg.evaluation.tasks}"})
    p["stages"].append({"stage": "report", "action": "summary.json, report.md, trials.csv, plots"})
    p["baseline"] = describe(base)
    p["compute"] = {"proxy_train_flops": proxy_flops, "final_train_flops_per_model": final_flops}
    if gpus:
        from archsearch.planning import estimate_training
        from archsearch.planning.time import parse_gpus

        n_total, _ = parse_gpus(gpus)
        device = re.sub(r"^\s*\d+\s*[xX*]\s*", "", gpus)
        per_job = max(1, cfg.cluster.gpus_per_job)
        slots = max(1, min(cfg.cluster.jobs_at_once, n_total // per_job)) if cfg.cluster.parallel else 1
        runs = []
        for item in proxy_specs:
            e = estimate_training(item["spec"], item["tokens"], f"{per_job}x{device}")
            runs.append({"run": item["run"], "tokens": item["tokens"], "train_flops": item["flops"],
                         "hours": e.hours, "gpu_hours": e.gpu_hours, "cost_usd": e.cost_usd or 0.0})
        fin = estimate_training(base, final_tokens, gpus)
        p["compute"].update({
            "gpus": gpus, "proxy_runs": runs, "proxy_gpu_hours": sum(r["gpu_hours"] for r in runs),
            "proxy_wall_hours": makespan([r["hours"] for r in runs], slots), "proxy_jobs_at_once": slots,
            "proxy_cost_usd": sum(r["cost_usd"] for r in runs), "final_train": fin.to_dict(),
            "assumptions": [
                f"executor {cfg.cluster.executor}: {slots} proxy job(s) at once, {per_job} {device} each "
                f"(of the {n_total} named); runs are placed longest first on the first free slot",
                "a run's time is archsearch.planning.estimate_training on its job's GPUs",
                "queueing, data preparation and job start-up are not included"]})
    return p


def makespan(hours: list[float], slots: int) -> float:
    """Wall time of independent jobs on ``slots`` parallel slots, longest first on the first
    free slot (what a scheduler with that many jobs at once does)."""
    free = [0.0] * max(1, slots)
    for h in sorted(hours, reverse=True):
        i = free.index(min(free))
        free[i] += h
    return max(free)

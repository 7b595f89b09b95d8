"""``archsearch search``: proxy sweep -> law fit -> Optuna search -> GQA search -> chosen
architecture -> (full training -> evaluation) -> report.

The study is a table of stages (:data:`STAGES`) driven by one loop (:func:`run`). Each stage
writes its outputs into the study folder and marks itself done in ``state.json``, and passes its
result to the next on a :class:`StudyRun`; a rerun skips done stages and resumes the unfinished
one (the sweep skips finished runs, the Optuna study resumes from its storage, measurements are
read back from the store). The stages' work lives in their own modules (proxy training in
:mod:`~archsearch.search.proxies`, the Optuna study in :mod:`~archsearch.search.study`, ...).
Stages can be skipped or run alone. Several workers may run the same config at once: the stages around
the Optuna study run under a lock (one worker does them, the others find them done), and the
study itself is shared through its storage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.cluster.startup import record_tail
from archsearch.configio import to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_json_tolerant, write_json
from archsearch.laws import fit_law, load_law
from archsearch.laws.acquisition import fit_profiled
from archsearch.laws.diagnostics import held_out_error
from archsearch.laws.plots import write_plots
from archsearch.logs import study_log
from archsearch.provenance import stage_provenance
from archsearch.rundata import read_runs
from archsearch.search import log
from archsearch.search.answer import Answer, decide, write_chosen
from archsearch.search.config import StudyConfig
from archsearch.search.context import load_study, search_context
from archsearch.search.final import evaluate_final, train_final
from archsearch.search.gqa import local_gqa_search
from archsearch.search.inputs import (ResumePlan, StageInputs, fingerprints, plan_resume,
                                      stage_inputs, supersede)
from archsearch.search.measurements import MeasurementStore, file_lock, spec_key
from archsearch.search.proxies import train_active_proxies, train_proxy_grid
from archsearch.search.resolved import ResolvedStudy, resolve
from archsearch.search.report import chosen_from_study, write_report
from archsearch.search.study import recover_stale_trials, run_study
from archsearch.search.workers import run_search_workers


class StudyState:
    """``state.json``: which stages are done, and for each run of a stage that did work, its
    seconds and where and when it ran (a resumed study adds a run; it never relabels one)."""

    def __init__(self, out: Path):
        self.path = out / "state.json"
        self.reload()

    def reload(self) -> None:
        """Read ``state.json``; one cut short by a killed write (or unreadable) is treated as
        absent, with a line saying so: the stages it marked done are redone, each from what it
        left (finished proxy runs, the Optuna storage, the measurement store)."""
        self.data = read_json_tolerant(self.path, "every stage it marked done") or {}

    def save(self) -> None:
        write_json(self.path, self.data, default=str)

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


# -- the pipeline: a table of stages -----------------------------------------------------------

@dataclass
class StudyRun:
    """What one run of a study passes from stage to stage: each value is computed once, by the
    stage that owns it (or read back from the study folder when that stage is done or skipped);
    what the config alone gives is on ``resolved``, resolved before the first stage."""
    resolved: ResolvedStudy
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

    @property
    def cfg(self) -> StudyConfig:
        return self.resolved.cfg


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


def _in_study_log(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn(cfg, out, ...)`` with its progress lines and libraries' warnings also appended to
    ``out/study.log`` (created with the folder, never for a config refused before any work)."""
    @functools.wraps(fn)
    def logged(cfg: StudyConfig, out: Path, *args: Any, **kwargs: Any) -> Any:
        with study_log(out):
            return fn(cfg, out, *args, **kwargs)
    return logged


@_in_study_log
def run(cfg: StudyConfig, out: Path, *, only: set[str] | None = None, skip: set[str] = frozenset(),
        progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the study, stage by stage; returns the summary."""
    resolved = resolve(cfg)  # checked before anything is written
    MeasurementStore(out / "measurements.jsonl").check_layout()  # an older store: migrate it first
    selected = select_stages(cfg, out, only, skip)
    out.mkdir(parents=True, exist_ok=True)
    applies = {st.name: st.applies(cfg) for st in STAGES}
    lock = out / ".stage.lock"
    with file_lock(lock):
        state = StudyState(out)
        _resume(cfg, out, state, selected, applies)  # refuses a change it cannot honour, before any write
        write_json(out / "config.json", to_dict(cfg), default=str)  # the change is accepted
    inputs, fps, record = stage_inputs(cfg), fingerprints(cfg, applies), StageInputs(out)
    r = StudyRun(resolved, out, state, progress)
    for stage in STAGES:
        locked = stage.locked(cfg)
        with file_lock(lock) if locked else contextlib.nullcontext():
            state.reload()
            fresh = stage.name in selected and stage.applies(cfg) and \
                (stage.resumes_itself or not state.done(stage.name))
            if fresh and stage.name in fps:  # what its outputs are computed with, before it writes any
                record.record(stage.name, fps[stage.name], inputs[stage.name])
            t = time.time()
            info = stage.run(r, fresh)
        if fresh and info is not None:
            with file_lock(lock) if not locked else contextlib.nullcontext():
                state.mark(stage.name, time.time() - t, **info)
        if stage.name == "search" and r.study is None:
            log("no Optuna study yet: run the search stage to measure candidates")
            return {"study": cfg.name, "stages": state.data, "target_loss": r.ctx.target_loss}
    return r.summary if r.summary is not None else \
        {"study": cfg.name, "stages": state.data, "target_loss": r.ctx.target_loss}


def _resume(cfg: StudyConfig, out: Path, state: StudyState, selected: set[str], applies: dict[str, bool]) -> None:
    """Compare the folder's stages with ``cfg`` (archsearch.search.inputs): keep what is valid,
    move aside and redo what a changed setting touches, refuse what cannot be honoured."""
    torn = [stage for stage, name in (("fit", "law.json"), ("gqa", "gqa.json"), ("train", "predict_rank_select.json"))
            if state.done(stage) and applies[stage] and (stage != "train" or cfg.mode == "predict-rank-select")
            and _read_json(out / name) is None]
    for stage in torn:  # its result was cut by a killed write: the stage is redone
        state.data.pop(stage)
    if state.done("gqa") and "train" not in state.data and _gqa_retries(cfg, out):
        log("the GQA search has failed measurements with attempts left (measure.max_attempts): it is run again")
        state.data.pop("gqa")
        torn.append("gqa")
    plan = plan_resume(cfg, out, state.data, selected, applies, default_storage=cfg.optuna.storage is None)
    done = [st.name for st in STAGES if state.done(st.name) and st.name not in plan.stale]
    if done or plan.stale:
        first = (state.data[done[0]].get("runs") or [{}])[0] if done else {}
        log(f"resuming the study in {out}: stages done {', '.join(done) or 'none'}"
            + (f" (first run {first['time_utc']} on {first['host']})" if first else "")
            + "; earlier stages and measurements keep their own provenance. For a fresh study, "
              "give another folder: --out DIR")
    moved = supersede(out, plan, state.data)
    if moved is not None:
        for stage, why in plan.stale.items():
            log(f"stage {stage} is redone: {'; '.join(why)}")
        log(f"the outputs it replaces are kept in {moved}")
    if moved is not None or torn:
        state.save()
    # a folder from before stages recorded their settings: its valid stages adopt this config's
    record, inputs, fps = StageInputs(out), stage_inputs(cfg), fingerprints(cfg, applies)
    for stage in fps:
        if stage in state.data and stage not in record.data:
            record.record(stage, fps[stage], inputs[stage])


def _gqa_retries(cfg: StudyConfig, out: Path) -> bool:
    """Whether the GQA search's result has a failed measurement that may be taken again: run
    again, it reads every other measurement back and retries those (Measurer)."""
    g = _read_json(out / "gqa.json") or {}
    keys = [st.get("measurement_key") for st in g.get("steps") or [] if "measurement failed" in (st.get("note") or "")]
    if not any(keys):
        return False
    stored = MeasurementStore(out / "measurements.jsonl").all()
    return any(k in stored and stored[k].get("ok") is False and int(stored[k].get("attempts", 1)) < cfg.measure.max_attempts
               for k in keys)


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
    train = train_active_proxies if cfg.proxy.plan == "active" else train_proxy_grid
    return train(cfg, r.out, r.runs_path)


def _fit(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Fit the law on the proxies' runs (or read ``law.file`` / the study's ``law.json``), then
    build the search context once: the target loss and the measurer every later stage uses."""
    cfg, law_path, info = r.cfg, r.out / "law.json", None
    if cfg.law.file or not fresh:
        r.law = load_law(cfg.law.file or law_path)
    else:
        runs = [x for x in read_runs(r.runs_path) if x.status == "ok"]
        log(f"fitting {cfg.law.form} on {len(runs)} proxy runs")
        if cfg.proxy is not None and cfg.proxy.plan == "active":
            # the plan trains few runs at some sizes: fit every size's L_opt, as the plan did
            # (a best-observed L_opt biases the shape there; archsearch.laws.acquisition.fit_profiled)
            r.law = fit_profiled(runs, cfg.law.form, r.resolved.fit)
        else:
            r.law = fit_law(runs, cfg.law.form, r.resolved.fit)
        r.law = with_held_out_error(r.law, runs, r.resolved)
        r.law.save(law_path)
        write_plots(r.law, runs, [], r.out / "plots")
        info = {"law_status": r.law.status, "warnings": list(r.law.warnings)}
    r.ctx = search_context(r.resolved, r.out, r.law)
    if r.ctx.measurer.note:
        log(r.ctx.measurer.note)
    return info


def with_held_out_error(law, runs, study: ResolvedStudy):
    """The fitted law with its error against trained models it was not fitted on (the loss
    constraint's margins carry it, archsearch.search.margins): the held-out size's error where
    ``law.fit.holdout_size`` held one out, else the progressive protocol's last step
    (``archsearch.laws.diagnostics.held_out_error``); with one proxy size none can be measured,
    and the law says so (its margins then rest on the bootstrap alone)."""
    cfg = study.cfg
    held = (law.metrics or {}).get("holdout")
    if held and held.get("n"):
        err = {"relative_sd": held["rmsre"], "n": held["n"], "mare": held["mare"],
               "source": f"held out: the size nearest law.fit.holdout_size={cfg.law.fit.holdout_size:.3g} ({held['n']} runs), "
                         "not fitted"}
    else:
        try:
            err = held_out_error(runs, cfg.law.form, study.fit)
        except ArchsearchError as e:
            log(f"the law's error against held-out runs is not measured: {e.problem}")
            return dataclasses.replace(law, warnings=list(law.warnings) + [
                f"prediction error not measured ({e.problem}): margins to the target rest on the bootstrap alone"])
        if cfg.proxy is not None and cfg.proxy.plan == "active":
            err["source"] += " (validated with the grid's fit, not the active plan's profiled fit)"
    log(f"the law's error on held-out runs: {err['relative_sd']:.2%} relative (sd) ({err['source']})")
    return dataclasses.replace(law, prediction_error=err)


def _search(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """The Optuna study (it resumes from its storage; several workers may share it), then the
    best feasible measured shape."""
    cfg, ctx, info = r.cfg, r.ctx, None
    if fresh:
        t = time.time()
        log(f"target loss {ctx.target_loss:.4f}; Optuna study {cfg.name} ({cfg.optuna.n_trials} trials) "
            f"measuring with {ctx.measurer.backend}")
        if cfg.cluster.parallel:
            workers = run_search_workers(r.resolved, r.out, stage_start=t)
            study = load_study(ctx)
        else:
            study, recovered = run_study(ctx, progress=r.progress)
            if recovered:
                log(f"recovered trials {recovered} left running by a dead process")
        while taken := _wait_for_running(study):
            log(f"trials {taken} were left running by a worker that died; their shapes are enqueued again"
                + ("" if cfg.cluster.parallel else " and measured here"))
            if cfg.cluster.parallel:  # the executor's workers are done: the next run of the stage measures them
                break

            study, _ = run_study(ctx, progress=r.progress)
        new = sum(1 for tr in study.get_trials(deepcopy=False)
                  if tr.datetime_start and tr.datetime_start.timestamp() >= t)
        if new or not r.state.done("search"):  # a no-op rerun adds no time and no run
            info = {"extend": True}
        else:
            log("search: the study has its trials already; nothing measured")
    r.study = load_study(ctx)
    r.best = chosen_from_study(r.study) if r.study is not None else None
    _redo_after_new_best(r)
    if fresh and cfg.cluster.parallel:  # the coordinator's seconds after its workers ended (startups.json)
        record_tail(r.out, "search", "search_tail_s", workers, since=t)
    return info


def _best_key(best: dict[str, Any] | None) -> str | None:
    return spec_key(ArchSpec.from_dict(best["spec"])) if best and best.get("spec") else None


def _redo_after_new_best(r: StudyRun) -> None:
    """A resumed search (more trials, a retried measurement) may find another best shape: the
    GQA search around the old one, and the stages after it, are then redone (outputs kept in
    ``superseded/``)."""
    with file_lock(r.out / ".stage.lock"):
        r.state.reload()
        g = _read_json(r.out / "gqa.json") if r.state.done("gqa") else None
        around = ((g or {}).get("around") or {}).get("spec_key")
        if around is None or around == _best_key(r.best):
            return
        stale = {st: [f"the search's best shape is now trial {r.best['trial'] if r.best else None}"]
                 for st in ("gqa", "train", "eval") if st in r.state.data}
        moved = supersede(r.out, ResumePlan(stale=stale), r.state.data)
        r.state.save()
        log(f"the search's best shape changed: stages {', '.join(stale)} are redone (earlier outputs in {moved})")


def _gqa(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """The local GQA search around the best shape (``gqa.json``; its variants' proxy runs, where the
    study trains proxies, in ``gqa/proxies/``), then the answer: the GQA pick when it measured
    faster, kept only if significantly faster than the baseline."""
    info = None
    if fresh and r.best is not None:
        log(f"local GQA search around trial {r.best['trial']}")
        g = local_gqa_search(ArchSpec.from_dict(r.best["spec"]), r.ctx, r.cfg.gqa_search.baseline_gqa,
                             progress=r.progress)
        write_json(r.out / "gqa.json", {**g.to_dict(), "around": {"trial": r.best["trial"],
                                                                  "spec_key": _best_key(r.best)}}, default=str)
        info = {}
    r.gqa = _read_json(r.out / "gqa.json")  # this run's, or an earlier run's when resuming
    _decide(r)
    return info


def _train(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Train the answer (predict-rank-select: the top k, and release one)."""
    if not fresh or r.answer is None:
        r.prs = _read_json(r.out / "predict_rank_select.json")  # an earlier run's, when resuming
        if r.prs is not None:
            _decide(r)
        return None
    r.prs = train_final(r.cfg, r.out, r.ctx, r.study, r.answer)
    if r.prs is not None:  # predict-rank-select released one of the trained candidates
        _decide(r)
    return {}


def _decide(r: StudyRun) -> None:
    """The answer from what the stages so far found, and its ``chosen/`` folder."""
    r.answer = decide(r.best, r.gqa, r.prs, r.ctx)
    if r.answer is not None:
        write_chosen(r.ctx, r.out, r.answer)


def _eval(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    if not fresh:
        return None
    evaluate_final(r.cfg, r.out, r.prs)
    return {}


def _report(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """``report.md``, ``summary.json``, ``trials.csv`` and the plots, rewritten on every run."""
    if not fresh:
        return None
    log("writing the report, trials.csv and plots")
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


def _runs_path(cfg: StudyConfig, out: Path) -> Path:
    return Path(cfg.proxy.runs) if cfg.proxy.runs else out / "proxies" / "runs.csv"


def _read_json(path: Path) -> dict[str, Any] | None:
    """A stage's JSON output; None where it is missing or cut short by a killed write."""
    return read_json_tolerant(path, "that stage's result")


def _wait_for_running(study, timeout_s: float = 3600, poll_s: float = 2.0) -> list[int]:
    """Another worker may still be measuring: the next stages need its result. A trial whose
    worker died meanwhile (its process gone on this host, its heartbeat silent elsewhere:
    ``recover_stale_trials``) is failed and its parameters enqueued at once; returns those
    trials, for this worker to take over."""
    from optuna.trial import TrialState

    t, recovered = time.time(), []
    while study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) and time.time() - t < timeout_s:
        recovered += recover_stale_trials(study, study._storage)
        if recovered or not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            break
        time.sleep(poll_s)
    return recovered

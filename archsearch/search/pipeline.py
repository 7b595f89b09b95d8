"""``archsearch search``: proxy sweep -> law fit -> Optuna search -> GQA search -> chosen
architecture -> (full training -> evaluation) -> report.

The study is a table of stages (:data:`archsearch.search.stages.STAGES`, one record per stage)
driven by one loop (:func:`run`). Each stage writes its outputs into the study folder and marks
itself done in ``state.json``, and passes its result to the next on a :class:`StudyRun`; a rerun
skips done stages and resumes the unfinished one (the sweep skips finished runs, the Optuna study
resumes from its storage, measurements are read back from the store). Stages can be skipped or
run alone. Several workers may run the same config at once: the stages around the Optuna study
run under a lock (one worker does them, the others find them done), and the study itself is
shared through its storage.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archsearch.configio import to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import write_json
from archsearch.logs import study_log
from archsearch.search import log
from archsearch.search.config import StudyConfig
from archsearch.laws import load_law
from archsearch.search.checks import check_loss_target
from archsearch.search.inputs import ResumePlan, StageInputs, fingerprints, plan_resume, stage_inputs, supersede
from archsearch.search.measurements import MeasurementStore, check_study_locks, file_lock
from archsearch.search.resolved import ResolvedStudy, resolve
from archsearch.search.stages import (STAGE_NAMES, STAGES, StopStudy, StudyRun, StudyState,  # noqa: F401 (the
                                      fingerprinted, read_result, stage_applies, table)  # table's names, as callers know them)


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
    check_study_locks(out)  # a lock path of the wrong kind, before the first write
    out.mkdir(parents=True, exist_ok=True)
    applies = stage_applies(cfg)
    lock = out / ".stage.lock"
    with file_lock(lock):
        state = StudyState(out)
        _resume(cfg, out, state, selected, applies, resolved)  # refuses a change it cannot honour, before any write
        write_json(out / "config.json", to_dict(cfg), default=str)  # the change is accepted
    inputs, fps, record = stage_inputs(cfg), fingerprints(cfg, applies), StageInputs(out)
    r = StudyRun(resolved, out, state, progress)
    for stage in table():
        if _nothing_to_read(stage.name, selected, state):
            continue
        locked = stage.locked(cfg)
        with file_lock(lock) if locked else contextlib.nullcontext():
            state.reload()
            _redo_if_outdated(r, stage.name, stage.outdated(r))
            fresh = stage.name in selected and stage.applies(cfg) and \
                (stage.resumes_itself or not state.done(stage.name))
            if fresh and stage.name in fps:  # what its outputs are computed with, before it writes any
                record.record(stage.name, fps[stage.name], inputs[stage.name])
            t = time.time()
            try:
                info = stage.run(r, fresh)
            except StopStudy as stop:
                log(str(stop))
                return {"study": cfg.name, "stages": state.data, "target_loss": r.ctx.target_loss}
        if fresh and info is not None:
            with file_lock(lock) if not locked else contextlib.nullcontext():
                state.mark(stage.name, time.time() - t, **info)
    return r.summary if r.summary is not None else \
        {"study": cfg.name, "stages": state.data, "target_loss": r.ctx.target_loss if r.ctx else None}


def _redo_if_outdated(r: StudyRun, name: str, why: str | None) -> None:
    """A done stage whose resume rule finds it outdated by what an earlier stage did in this run
    (``Stage.outdated``) is redone, with the fingerprinted stages after it (outputs kept in
    ``superseded/``). Called under the stage lock."""
    if why is None:
        return
    order = [st.name for st in fingerprinted()]
    stale = {st: [why] for st in order[order.index(name):] if st in r.state.data}
    moved = supersede(r.out, ResumePlan(stale=stale), r.state.data)
    r.state.save()
    log(f"{why}: stages {', '.join(stale)} are redone (earlier outputs in {moved})")


def _nothing_to_read(name: str, selected: set[str], state: StudyState) -> bool:
    """Whether stage ``name`` is skipped: after the last selected stage and not done. A stage that
    is not selected otherwise runs unfresh, to read what it made (the law, the study, the report);
    after the last selected one, a stage never done has nothing to read (``--only proxy`` on a new
    folder must not then ask for the law it was told not to fit)."""
    names = [st.name for st in table()]
    last = max((names.index(n) for n in selected), default=-1)
    return names.index(name) > last and not state.done(name)


def _resume(cfg: StudyConfig, out: Path, state: StudyState, selected: set[str], applies: dict[str, bool],
            resolved: ResolvedStudy) -> None:
    """Compare the folder's stages with ``cfg`` (archsearch.search.inputs): keep what is valid,
    move aside and redo what a changed setting touches or a stage's own resume rule
    (``Stage.redo``) refuses, refuse what cannot be honoured."""
    redone = []
    for st in reversed(table()):  # latest first: a later stage's redo may free an earlier one's rule
        if state.done(st.name) and applies[st.name] and st.redo(cfg, out, state.data):
            state.data.pop(st.name)
            redone.append(st.name)
    plan = plan_resume(cfg, out, state.data, selected, applies, default_storage=cfg.optuna.storage is None)
    _check_target_on_kept_law(resolved, out, state, plan)  # a refusal logs nothing and moves nothing aside
    done = [st.name for st in table() if state.done(st.name) and st.name not in plan.stale]
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
    if moved is not None or redone:
        state.save()
    # a folder from before stages recorded their settings: its valid stages adopt this config's
    record, inputs, fps = StageInputs(out), stage_inputs(cfg), fingerprints(cfg, applies)
    for stage in fps:
        if stage in state.data and stage not in record.data:
            record.record(stage, fps[stage], inputs[stage])


def _check_target_on_kept_law(resolved: ResolvedStudy, out: Path, state: StudyState, plan: ResumePlan) -> None:
    """The target checked against the law the study fitted into its folder, where that law is kept
    (its fit done and not redone), before anything is moved aside or rewritten: the search stage
    would refuse an unreachable target only after the resume had superseded the outputs it
    replaces (``resolve`` checks a ``law.file`` law itself)."""
    cfg = resolved.cfg
    if cfg.law.file or not state.done("fit") or "fit" in plan.stale or read_result(out / "law.json") is None:
        return
    law = load_law(out / "law.json")
    check_loss_target(cfg, law, resolved.target_loss(law), resolved.build)


def select_stages(cfg: StudyConfig, out: Path, only: set[str] | None, skip: set[str]) -> set[str]:
    """The stages ``--only``/``--skip`` select, refused before any work when a selected stage
    needs the result of a deselected one (``Stage.needs``) and the study folder does not have it."""
    stages = table()
    names = [st.name for st in stages]
    unknown = sorted((set(only or ()) | set(skip)) - set(names))
    if unknown:
        raise ArchsearchError("--only/--skip", f"unknown stage(s) {unknown}", f"stages: {','.join(names)}")
    selected = {n for n in names if (only is None or n in only) and n not in skip}
    how = (f"--only {','.join(sorted(only))}" if only is not None else "") + \
        (f" --skip {','.join(sorted(skip))}" if skip else "")
    for st in stages:
        path = st.result(cfg, out)
        if st.name in selected or path is None or path.is_file():
            continue
        # a stage that does not apply, or whose own result is there already, needs nothing more
        users = [u.name for u in stages if u.name in selected and st.name in u.needs and u.applies(cfg)
                 and not ((own := u.result(cfg, out)) is not None and own.is_file())]
        if users:
            raise ArchsearchError(how.strip(), f"stage(s) {','.join(sorted(users))} need {st.product}, but "
                                  f"{st.name} is not selected and {path} does not exist",
                                  f"run the {st.name} stage too, or give {st.given_by}")
    return selected

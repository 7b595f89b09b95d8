"""What each stage of a study was computed with, so that a resumed study with a changed config
reuses what is still valid, redoes what is not, or refuses before it writes anything.

Every stage reads a known part of the config (its record's ``settings`` in
:data:`archsearch.search.stages.STAGES`, gathered by :func:`stage_inputs`: exactly the settings it
reads, by dotted name, plus the content of a file it reads such as ``proxy.runs`` or
``law.file``). A stage's fingerprint is a hash of its own inputs and of the fingerprint of the
stage before it, so a change redoes the stage that reads it and every stage after. The inputs
of a stage are recorded in ``stage_inputs.json`` when the stage starts its work (a stage killed
half-way is known too); on the next start :func:`plan_resume` compares them with the config's:

- a stage whose inputs changed (or that no longer applies) is *stale*: its outputs (its record's
  ``outputs``) are moved into ``superseded/<time>/`` (nothing is deleted) and it is redone, with
  every stage after;
- a change the folder cannot honour (the Optuna study in a storage outside the folder, or a
  stale stage deselected by ``--only``/``--skip`` while a later selected stage needs it) is
  refused with one error before anything is written.

Measurements need no such step: the store keys each one by the settings that change it
(:func:`archsearch.search.measurements.key_settings`), so changed settings are measured anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archsearch.configio import from_dict, nest_components, to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_json_tolerant, write_json
from archsearch.search.config import StudyConfig, renamed_values
from archsearch.search.measurements import key_settings, resolve_backend
from archsearch.search.settings import flat, without_execution_only
from archsearch.search.stages import fingerprinted

INPUTS_FILE = "stage_inputs.json"
SUPERSEDED_DIR = "superseded"


def stage_inputs(cfg: StudyConfig, measure_key=key_settings, backend: str | None = None) -> dict[str, dict[str, Any]]:
    """Each fingerprinted stage's inputs: {dotted setting: value} of exactly what it reads (its
    record's ``settings``). ``measure_key`` and ``backend`` (default: the engine that measures
    here) name the search's measurement settings; ``archsearch migrate`` passes an earlier key layout's."""
    try:
        backend = backend or resolve_backend(cfg.measure)[0]
    except ArchsearchError:  # the engine is not installed here: the search stage says so when it runs
        backend = cfg.measure.bench.backend
    keyed = flat(to_dict(measure_key(cfg.measure, backend)), "")
    return {st.name: without_execution_only(st.settings(cfg, keyed)) for st in fingerprinted()}


def fingerprints(cfg: StudyConfig, applies: dict[str, bool], inputs: dict[str, dict[str, Any]] | None = None) \
        -> dict[str, str]:
    """Each stage's fingerprint: its own inputs (default: :func:`stage_inputs`) and the previous
    applicable stage's fingerprint."""
    inputs, prev, out = inputs or stage_inputs(cfg), "", {}
    for stage in (st.name for st in fingerprinted()):
        blob = json.dumps({"inputs": inputs[stage], "after": prev}, sort_keys=True, default=str)
        out[stage] = hashlib.sha256(blob.encode()).hexdigest()[:16]
        if applies.get(stage, False):  # a stage a caller leaves out (added since it was written) does not apply
            prev = out[stage]
    return out


class StageInputs:
    """``stage_inputs.json``: {stage: {"fingerprint", "inputs"}} of the stages that started work."""

    def __init__(self, out: Path):
        self.path = out / INPUTS_FILE
        self.data: dict[str, Any] = read_json_tolerant(self.path, "the record of the stages' settings") or {}

    def record(self, stage: str, fingerprint: str, inputs: dict[str, Any]) -> None:
        current = read_json_tolerant(self.path, "the record of the stages' settings") or {}
        if current.get(stage, {}).get("fingerprint") == fingerprint:
            self.data = current
            return
        current[stage] = {"fingerprint": fingerprint, "inputs": inputs}
        self.data = current
        write_json(self.path, current, default=str)

    def drop(self, stages: list[str]) -> None:
        for s in stages:
            self.data.pop(s, None)
        write_json(self.path, self.data, default=str)


@dataclass
class ResumePlan:
    """The stages to redo (why: their changed settings), and those of them whose outputs stay
    valid where they are (``keep``: a proxy sweep whose grid grew keeps its trained runs)."""
    stale: dict[str, list[str]] = field(default_factory=dict)
    keep: set[str] = field(default_factory=set)


# proxy settings that choose which runs a sweep has, never what a run computes: a run's id names its
# shape, budget and seed, so with only these changed the trained runs stay valid and are reused
_PROXY_GRID = re.compile(r"^proxy\.sweeps?(\.\d+)?\.(name|params|hidden_over_sqrt_n|mlp_to_attn|n_layers|gqa|"
                         r"head_dim|build|seeds|retry_failed)(\.|$)")


def _legacy_inputs(out: Path) -> dict[str, dict[str, Any]] | None:
    """The stage inputs of a folder written before stages recorded theirs: from its config.json."""
    raw = read_json_tolerant(out / "config.json", "the study's stored config")
    if raw is None:
        return None
    try:
        return stage_inputs(from_dict(StudyConfig, nest_components(StudyConfig, raw)[0]))
    except (ArchsearchError, TypeError, ValueError, KeyError):
        return None


def _changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    def show(v: Any) -> str:
        s = json.dumps(v, default=str)
        return s if len(s) <= 60 else s[:57] + "..."
    keys = sorted(set(old) | set(new))
    return [f"{k} ({show(old.get(k))} -> {show(new.get(k))})" for k in keys
            if json.dumps(old.get(k), sort_keys=True, default=str) != json.dumps(new.get(k), sort_keys=True, default=str)]


def plan_resume(cfg: StudyConfig, out: Path, state_data: dict[str, Any], selected: set[str],
                applies: dict[str, bool], default_storage: bool) -> ResumePlan:
    """Compare what each stage in ``out`` was computed with against ``cfg``; raises
    :class:`ArchsearchError` for a change the folder cannot honour (nothing written yet)."""
    record = StageInputs(out)
    now_inputs, now_fp = stage_inputs(cfg), fingerprints(cfg, applies)
    legacy = None
    plan = ResumePlan()
    upstream_stale = None
    for stage, rec in record.data.items():
        _, renamed = renamed_values((rec or {}).get("inputs") or {})
        if renamed:
            raise ArchsearchError("out", f"{out} recorded its stages with setting values named otherwise since "
                                  f"({'; '.join(renamed)})", f"run archsearch migrate {out} once, then again")
    order = [st.name for st in fingerprinted()]
    for stage in order:
        rec = record.data.get(stage)
        started = rec is not None or stage in state_data
        if not started:
            if upstream_stale is not None and _has_outputs(out, stage):
                plan.stale[stage] = [f"after {upstream_stale}"]
            continue
        if rec is None:  # a folder from before the record: its config.json says what it ran with
            legacy = legacy if legacy is not None else (_legacy_inputs(out) or now_inputs)
            old_inputs, old_fp = legacy[stage], None
        else:
            old_inputs, old_fp = rec.get("inputs") or {}, rec.get("fingerprint")
        if not applies[stage]:
            if stage == "proxy" and cfg.proxy is not None and cfg.proxy.runs and \
                    (out / "proxies").resolve() in Path(cfg.proxy.runs).resolve().parents:
                continue  # proxy.runs reads the table the stage wrote: it stays where it is
            plan.stale[stage] = ["the stage no longer applies"]
        elif (old_fp is not None and old_fp != now_fp[stage]) or old_inputs != _jsonable(now_inputs[stage]) \
                or upstream_stale is not None:
            changed = _changed(old_inputs, _jsonable(now_inputs[stage]))
            plan.stale[stage] = changed or [f"after {upstream_stale}"]
            if stage == "proxy" and changed and all(_PROXY_GRID.match(c.split(" (")[0]) for c in changed):
                plan.keep.add(stage)
        if stage in plan.stale and upstream_stale is None:
            upstream_stale = stage
    if not plan.stale:
        return plan
    later = [s for s in order if s in selected and applies[s]]
    for stage, why in plan.stale.items():
        needed_by = [s for s in later if order.index(s) > order.index(stage)] + \
            (["report"] if "report" in selected else [])
        if stage not in selected and applies[stage] and needed_by:
            raise ArchsearchError(
                "--only/--skip", f"stage {stage} in {out} was computed with other settings ({'; '.join(why)}), "
                f"and {', '.join(needed_by)} would build on it", f"select {stage} too, so it is redone")
        if stage == "search" and not default_storage and not any(w.startswith("name (") for w in why):
            raise ArchsearchError(
                "optuna.storage", f"the study {cfg.name!r} in the storage optuna.storage names holds trials "
                f"computed with other settings ({'; '.join(why)})",
                "give the study a new name (name: ...) or another optuna.storage, or restore those settings")
    return plan


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


def _outputs(stage: str) -> tuple[str, ...]:
    return next(st.outputs for st in fingerprinted() if st.name == stage)


def _has_outputs(out: Path, stage: str) -> bool:
    return any((out / p).exists() for p in _outputs(stage))


def supersede(out: Path, plan: ResumePlan, state_data: dict[str, Any]) -> Path | None:
    """Move the stale stages' outputs into ``superseded/<time>/`` and forget them; returns the folder."""
    if not plan.stale:
        return None
    dest = out / SUPERSEDED_DIR / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    n = 0
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    for stage in plan.stale:
        for rel in () if stage in plan.keep else _outputs(stage):
            src = out / rel
            if src.exists() or src.is_symlink():
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(src), str(target))
        state_data.pop(stage, None)
    dest.mkdir(parents=True, exist_ok=True)
    write_json(dest / "why.json", {"stale": plan.stale, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "pid": os.getpid()})
    StageInputs(out).drop(list(plan.stale))
    return dest

"""A stage is one record (archsearch.search.stages.Stage): a toy stage added to the table in one
place runs, resumes (done: not redone; a setting it reads changed: redone, its output set aside),
is priced by the dry run and is reported, with no other file touched. The study is the analytic
one of test_search.py (deterministic and fast)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from archsearch.errors import ArchsearchError
from archsearch.fileio import write_json
from archsearch.search.config import ProxyConfig
from tests.test_search import load, study_config



def _toy_stage(calls: list):
    from archsearch.search import stages

    def run(r, fresh: bool):
        if not fresh:
            return None
        calls.append(r.cfg.measure.max_attempts)
        write_json(r.out / "toy.json", {"max_attempts": r.cfg.measure.max_attempts, "best_trial": r.best["trial"]})
        return {"toy_note": "counted"}

    return stages.Stage(
        "toy", run, plan=lambda p: {"stage": "toy", "action": f"count the trials of {p.cfg.name}", "gpu_hours": 0.25},
        settings=lambda cfg, measure_key: {"measure.max_attempts": cfg.measure.max_attempts}, outputs=("toy.json",), needs=("fit",))


def test_a_stage_added_in_one_place_runs_resumes_is_priced_and_reported(tmp_path, monkeypatch, capsys):
    from archsearch.search import pipeline, stages
    from archsearch.search.dryrun import dry_run, render

    calls: list = []
    at = stages.STAGE_NAMES.index("report")
    monkeypatch.setattr(stages, "STAGES", stages.STAGES[:at] + (_toy_stage(calls),) + stages.STAGES[at:])
    raw = study_config(tmp_path, optuna={"n_shapes": 2}, gqa_search={"enabled": False})
    cfg = load(raw)
    out = cfg.out_dir()

    # priced: the dry run lists it, in its place, with its cost
    plan = dry_run(cfg, out)
    names = [st["stage"] for st in plan["stages"]]
    assert names[-2:] == ["toy", "report"]
    assert plan["stages"][-2] == {"stage": "toy", "action": "count the trials of t", "gpu_hours": 0.25}
    assert any("toy" in line and "gpu_hours=0.25" in line for line in render(plan))

    # runs: its output, its state and the settings it was computed with are recorded
    pipeline.run(cfg, out)
    assert calls == [3] and json.loads((out / "toy.json").read_text())["max_attempts"] == 3
    state = json.loads((out / "state.json").read_text())
    assert state["toy"]["status"] == "done" and state["toy"]["toy_note"] == "counted"
    assert json.loads((out / "stage_inputs.json").read_text())["toy"]["inputs"] == {"measure.max_attempts": 3}
    # reported: the report's stage table has it
    assert any(line.startswith("| toy |") for line in (out / "report.md").read_text().splitlines())

    # resumes: done, it is not run again
    capsys.readouterr()
    pipeline.run(cfg, out)
    assert calls == [3]
    assert "stages done search, toy, report" in capsys.readouterr().err

    # a setting it reads changed: it alone is redone (the search is not), its output set aside
    raw2 = {k: v for k, v in raw.items() if k != "_path"} | {"measure": {**raw["measure"], "max_attempts": 2}}
    Path(raw["_path"]).write_text(yaml.safe_dump(raw2))
    cfg2 = load(raw)
    searched = state["search"]["seconds"]
    pipeline.run(cfg2, out)
    assert calls == [3, 2]
    err = capsys.readouterr().err
    assert "stage toy is redone: measure.max_attempts (3 -> 2)" in err and "stage search is redone" not in err
    assert [json.loads(p.read_text())["max_attempts"] for p in (out / "superseded").glob("*/toy.json")] == [3]
    assert json.loads((out / "state.json").read_text())["search"]["seconds"] == searched

    # selected alone, it runs where what it needs is there; where the law it needs is missing and fit
    # is not selected, the selection is refused before any work
    pipeline.run(cfg2, out, only={"toy"})
    refit = dataclasses.replace(cfg2, law=dataclasses.replace(cfg2.law, file=None),
                                proxy=ProxyConfig(runs=str(tmp_path / "runs.csv")))
    with pytest.raises(ArchsearchError, match=r"stage\(s\) toy need the law, but fit is not selected"):
        pipeline.select_stages(refit, tmp_path / "elsewhere", {"toy"}, set())


@pytest.mark.parametrize("name", ["demo-cpu", "demo-cpu-active", "demo-cpu-targets", "demo-cpu-online",
                                  "paper-1b-rehearsal", "paper-3b-rehearsal", "paper-1b-workload-offline-4k-1k",
                                  "paper-1b-workload-chat", "paper-1b-workload-long-context",
                                  "paper-1b-workload-single-stream"])
def test_the_example_studies_resume_with_no_stage_redone(name):
    """The example studies under results/examples resume with their configs and redo nothing: the
    stage records fingerprint what the folders recorded (planned, nothing written)."""
    from archsearch.search.config import load_study_config
    from archsearch.search.inputs import plan_resume
    from archsearch.search.stages import STAGE_NAMES, StudyState, stage_applies

    root = Path(__file__).resolve().parents[1]
    folder, cfg = root / "results" / "examples" / name, load_study_config(root / "configs" / f"{name}.yaml")
    state = StudyState(folder).data
    plan = plan_resume(cfg, folder, state, set(STAGE_NAMES), stage_applies(cfg), default_storage=True)
    assert plan.stale == {} and [s for s in STAGE_NAMES if s in state]

"""``archsearch migrate``: a store keyed in the older layout is re-keyed once, and read back."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import optuna
import pytest
import yaml

from archsearch.cli import main
from archsearch.configio import from_dict, nest_components, to_dict
from archsearch.errors import ArchsearchError
from archsearch.search.config import LawConfig, StudyConfig, load_study_config
from archsearch.search.measurements import MeasurementStore, Measurer
from tests.test_bench import TINY

REPO = Path(__file__).resolve().parent.parent
OTHER = dataclasses.replace(TINY, ffn=2 * TINY.ffn)
LAW = {"law": "conditional-multiplicative",
       "coefficients": {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04},
       "reference": {"law": "chinchilla", "coefficients": {"E": 1.8, "A": 400, "alpha": 0.34, "B": 410, "beta": 0.28}}}
STUDY = {"name": "st", "params": 200000, "tokens": 300000, "n_layers": 2, "vocab_size": 2048,
         "baseline": {"hidden_over_sqrt_n": 0.2, "mlp_to_attn": 3.0, "gqa": 2}, "law": {"file": "law.json"},
         "measure": {"backend": "analytic", "batch_sizes": [16], "input_len": 64, "output_len": 64,
                     "device_spec": "cpu"}}
# The older layout, as a version before the keying marks wrote it: TINY measured alone, and
# TINY and OTHER compared (the second attempt), under the measure block above.
OLD_SINGLE, OLD_PAIR = "bf3704921f3230d6", "018b9dc3e72cf03e"
NEW_SINGLE, NEW_PAIR = "453790d10d92a567", "9566ac25f0ecfd40"


def _old_study(d):
    (d / "law.json").write_text(json.dumps(LAW))
    study = d / "st"
    study.mkdir()
    (study / "config.json").write_text(json.dumps(STUDY))
    cfg = from_dict(StudyConfig, nest_components(StudyConfig, STUDY)[0])  # STUDY is written flat, as then
    from archsearch.benchmarks import measure

    single = {**measure(TINY, cfg.measure.bench_settings("analytic")).to_dict(), "measurement_key": OLD_SINGLE}
    pair = {"specs": [TINY.to_dict(), OTHER.to_dict()], "rounds": [[100.0, 120.0], [100.0, 121.0]], "settings": {},
            "paired": {"level": 0.9}, "batch_size": 16, "measurement_key": OLD_PAIR,
            "group": {"key": "9f145c9ebf37066f", "size": 2}}
    lines = [{"key": OLD_SINGLE, "result": single}, {"key": OLD_PAIR, "result": pair},
             {"key": "0123456789abcdef", "result": {"ok": True, "settings": {"dtype": "float16"}}}]
    (study / "measurements.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (study / "gqa.json").write_text(json.dumps({"steps": [{"gqa": 1, "measurement_key": OLD_SINGLE}]}))
    storage = f"sqlite:///{study / 'optuna.db'}"
    s = optuna.create_study(storage=storage, study_name="st")
    s.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"spec": TINY.to_dict(), "measurement_key": OLD_SINGLE}))
    return study, cfg, storage


def test_an_old_store_is_refused_with_the_command_then_migrated_once_and_read_back(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study, cfg, storage = _old_study(tmp_path)
    store = MeasurementStore(study / "measurements.jsonl")
    with pytest.raises(ArchsearchError) as e:  # un-migrated: every key would miss, so it is refused
        Measurer(cfg.measure, store)
    assert f"archsearch migrate {study}" in e.value.fix

    before = {p.name: p.read_bytes() for p in study.iterdir()}
    assert main(["migrate", str(study), "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert f"{OLD_SINGLE} -> {NEW_SINGLE}" in listed and f"{OLD_PAIR} -> {NEW_PAIR}" in listed
    assert "0123456789abcdef" in listed and "gqa.json" in listed and "1 trial attribute" in listed
    assert {p.name: p.read_bytes() for p in study.iterdir()} == before  # a dry run writes nothing

    assert main(["migrate", str(study)]) == 0
    lines = [json.loads(x) for x in (study / "measurements.jsonl").read_text().splitlines()]
    assert [(x["key"], x["layout"], x["result"]["measurement_key"]) for x in lines] == \
        [(NEW_SINGLE, 2, NEW_SINGLE), (NEW_PAIR, 2, NEW_PAIR)]
    assert json.loads((study / "measurements.unmatched.jsonl").read_text())["key"] == "0123456789abcdef"
    assert json.loads((study / "gqa.json").read_text())["steps"][0]["measurement_key"] == NEW_SINGLE
    trial = optuna.load_study(storage=storage, study_name="st").trials[0]
    assert trial.user_attrs["measurement_key"] == NEW_SINGLE

    def never(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr("archsearch.search.measurements.measure", never)
    monkeypatch.setattr("archsearch.search.measurements.measure_paired", never)
    m = Measurer(cfg.measure, store)
    assert m.key(TINY) == NEW_SINGLE and m.pair_key([TINY, OTHER], 1) == NEW_PAIR
    assert m.measure(TINY).cached and m.compare([TINY, OTHER], attempt=1).cached and m.measured_now == 0

    after = {p.name: p.read_bytes() for p in study.iterdir()}
    assert main(["migrate", str(study)]) == 0  # once: a migrated store is left as it is
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in study.iterdir()} == after


def test_migrate_names_a_folder_that_is_not_a_study(tmp_path, capsys):
    assert main(["migrate", str(tmp_path)]) == 2
    assert "measurements.jsonl" in capsys.readouterr().err


# A study an earlier version recorded (the 1B rehearsal as results/examples held it before the
# examples were rerun on the current code), with the config, law file and calibration it ran with,
# laid out as the repository was: tests/data/recorded-1b/{configs/..., study/}.
RECORDED = Path(__file__).resolve().parent / "data" / "recorded-1b"


def _recorded(tmp_path, monkeypatch):
    """The recorded study copied under ``tmp_path`` (migrate writes it), the current folder the copy's
    root (its config names files relative to it, as to the repository it ran in), and its config."""
    root = tmp_path / "repo"
    shutil.copytree(RECORDED, root)
    monkeypatch.chdir(root)
    return root / "study", load_study_config(root / "configs" / "paper-1b-rehearsal.yaml")


def test_a_recorded_study_migrates_and_resumes_with_its_stages_and_measurements(tmp_path, monkeypatch, capsys):
    from archsearch.search.inputs import plan_resume
    from archsearch.search.pipeline import STAGE_NAMES, STAGES, StudyState

    study, cfg = _recorded(tmp_path, monkeypatch)
    with pytest.raises(ArchsearchError):
        MeasurementStore(study / "measurements.jsonl").check_layout()
    assert main(["migrate", str(study)]) == 0

    stored = MeasurementStore(study / "measurements.jsonl").all()
    trials = optuna.load_study(storage=f"sqlite:///{study / 'optuna.db'}", study_name=cfg.name).trials
    keys = [t.user_attrs["measurement_key"] for t in trials if "measurement_key" in t.user_attrs]
    assert keys and all(k in stored for k in keys)  # every trial's measurement found under its new key
    assert all(s["measurement_key"] in stored for s in json.loads((study / "gqa.json").read_text())["steps"]
               if s.get("measurement_key"))
    applies = {st.name: st.applies(cfg) for st in STAGES}
    plan = plan_resume(cfg, study, StudyState(study).data, set(STAGE_NAMES), applies, default_storage=True)
    assert plan.stale == {}  # no stage is redone for the new names of its measurement settings
    # idempotent in what it says too: run again on the folder it just wrote, it finds nothing to do
    before = {p.name: p.read_bytes() for p in study.glob("*.json*")}
    capsys.readouterr()
    assert main(["migrate", str(study)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert before == {p.name: p.read_bytes() for p in study.glob("*.json*")}


def test_the_old_search_mode_name_is_refused_naming_the_new_one(tmp_path):
    (tmp_path / "law.json").write_text(json.dumps(LAW))
    study = {**nest_components(StudyConfig, STUDY)[0], "law": {"file": str(tmp_path / "law.json")}}
    with pytest.raises(ArchsearchError) as e:
        from_dict(StudyConfig, {**study, "mode": "algorithm5"})
    assert e.value.field == "mode" and "constrained" in str(e.value) and "archsearch migrate" in str(e.value)
    assert from_dict(StudyConfig, study).mode == "constrained"


def test_a_folder_that_recorded_an_old_setting_name_is_refused_then_migrated(tmp_path, monkeypatch):
    from archsearch.search.config import renamed_values
    from archsearch.search.inputs import INPUTS_FILE, fingerprints, plan_resume, stage_inputs
    from archsearch.search.pipeline import STAGE_NAMES, STAGES, StudyState

    study, cfg = _recorded(tmp_path, monkeypatch)
    assert main(["migrate", str(study)]) == 0
    assert json.loads((study / "config.json").read_text())["mode"] == "constrained"
    # a study whose train stage applies (the final training), as a version before the rename recorded it
    cfg = dataclasses.replace(cfg, final_train=dataclasses.replace(cfg.final_train, enabled=True))
    applies = {st.name: st.applies(cfg) for st in STAGES}
    assert applies["train"]
    old_in = {st: renamed_values(v, back=True)[0] for st, v in stage_inputs(cfg).items()}
    assert old_in["train"]["mode"] == "algorithm5"
    record = json.loads((study / INPUTS_FILE).read_text())
    record["train"] = {"fingerprint": fingerprints(cfg, applies, old_in)["train"],
                       "inputs": json.loads(json.dumps(old_in["train"], default=str))}
    (study / INPUTS_FILE).write_text(json.dumps(record))
    stored = json.loads(json.dumps(to_dict(cfg), default=str))
    (study / "config.json").write_text(json.dumps({**stored, "mode": "algorithm5"}))
    with pytest.raises(ArchsearchError) as e:
        plan_resume(cfg, study, StudyState(study).data, set(STAGE_NAMES), applies, default_storage=True)
    assert "archsearch migrate" in str(e.value) and "mode: algorithm5 -> constrained" in str(e.value)

    assert main(["migrate", str(study)]) == 0
    record = json.loads((study / INPUTS_FILE).read_text())
    assert record["train"]["inputs"]["mode"] == "constrained"
    assert record["train"]["fingerprint"] == fingerprints(cfg, applies)["train"]
    assert json.loads((study / "config.json").read_text())["mode"] == "constrained"
    assert plan_resume(cfg, study, StudyState(study).data, set(STAGE_NAMES), applies, default_storage=True).stale == {}
    assert main(["migrate", str(study)]) == 0  # idempotent: nothing left to do


def test_a_config_json_this_version_cannot_read_is_named_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    study, _, _ = _old_study(tmp_path)
    (study / "config.json").write_text(json.dumps({**STUDY, "search_space": {"hidden_multiple": 64}}))
    assert main(["migrate", str(study)]) == 2
    err = capsys.readouterr().err
    assert "config.json: search_space.hidden_multiple" in err and "run the study anew" in err


FLAT_YAML = """# a study config as older versions read it: the components' keys in their block
law:
  form: conditional-multiplicative
  # the fit's reference
  reference: best-observed
  bootstrap: 20     # intervals
  seed: 4
measure:
  backend: hf
  batch_sizes:
  - 2
  - 4
  calibration: null
  max_attempts: 2
optuna: {n_trials: 2}
"""


def test_a_config_written_flat_is_refused_naming_migrate_which_nests_it_keeping_comments(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text(FLAT_YAML)
    raw = yaml.safe_load(FLAT_YAML)
    with pytest.raises(ArchsearchError) as e:
        from_dict(LawConfig, raw["law"], "law")
    assert e.value.field == "law.reference" and "law.fit.reference" in e.value.fix and "migrate" in e.value.fix
    assert main(["migrate", "--config", str(path), "--dry-run"]) == 0
    assert path.read_text() == FLAT_YAML and "dry run" in capsys.readouterr().out
    assert main(["migrate", "--config", str(path)]) == 0
    text = path.read_text()
    new = yaml.safe_load(text)
    assert new["law"] == {"form": "conditional-multiplicative", "seed": 4,  # law.seed is the law block's own
                          "fit": {"reference": "best-observed", "bootstrap": 20}}
    assert new["measure"] == {"bench": {"backend": "hf", "batch_sizes": [2, 4]}, "calibration": None,
                              "max_attempts": 2}
    for comment in ("# the fit's reference", "# intervals", "# a study config as older versions"):
        assert comment in text
    assert main(["migrate", "--config", str(path)]) == 0 and "nothing to do" in capsys.readouterr().out


def test_a_study_folders_flat_config_json_is_nested_by_migrate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    study, _, _ = _old_study(tmp_path)
    assert main(["migrate", str(study)]) == 0
    stored = json.loads((study / "config.json").read_text())
    assert stored["measure"]["bench"]["backend"] == "analytic" and "backend" not in stored["measure"]
    assert from_dict(StudyConfig, stored) == from_dict(StudyConfig, nest_components(StudyConfig, STUDY)[0])

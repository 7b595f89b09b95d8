"""A resumed study whose config changed: every stage that reads a changed setting is redone (with
every stage after it), what is still valid is reused, a change the folder cannot honour is
refused before anything is written, and torn state files are redone rather than fatal.

The studies here are the analytic ones of test_search.py (deterministic and fast)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from archsearch.configio import from_dict
from archsearch.errors import ArchsearchError
from tests.test_search import load, merged, study_config


# the finished studies several tests change: each is run once per module (_finished), and each test
# resumes its own copy of the folder
LAW_FILE_STUDY = {"optuna": {"n_shapes": 2}, "gqa_search": {"enabled": False}}
TWO_BATCHES_GQA_STUDY = {"measure": {"bench": {"batch_sizes": [4, 8]}}, "optuna": {"n_shapes": 2}}


@pytest.fixture(scope="module")
def _finished(tmp_path_factory):
    """``name -> raw config`` of the finished studies above, each run once (figures unrendered).
    Their law file stays in the base folder, so that a copy's settings are the original's but for
    ``out`` (which changes no result: a copy resumes with every stage done)."""
    from archsearch.search import pipeline

    made = {}
    for name, over in (("law-file", LAW_FILE_STUDY), ("two-batches-gqa", TWO_BATCHES_GQA_STUDY)):
        made[name] = study_config(tmp_path_factory.mktemp(name), **over)
        cfg = load(made[name])
        pipeline.run(cfg, cfg.out_dir())
    return made


def _copy_of(finished: dict, name: str, tmp_path: Path) -> dict:
    """The raw config of a copy, in ``tmp_path``, of the finished study ``name`` (see _finished)."""
    shutil.copytree(finished[name]["out"], tmp_path / "study")
    raw = {k: v for k, v in finished[name].items() if k != "_path"} | {"out": str(tmp_path / "study")}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(raw))
    return raw | {"_path": str(path)}


def _trials(out: Path):
    import optuna

    return optuna.load_study(study_name="t", storage=f"sqlite:///{out / 'optuna.db'}").get_trials()


def _rewrite(cfg: dict, **over) -> dict:
    raw = merged({k: v for k, v in cfg.items() if k != "_path"}, over)
    Path(cfg["_path"]).write_text(yaml.safe_dump(raw))
    return raw | {"_path": cfg["_path"]}


def test_changed_measurement_settings_redo_the_search_never_mixing(tmp_path, capsys, _finished):
    from archsearch.search import pipeline

    raw = _copy_of(_finished, "two-batches-gqa", tmp_path)
    out = load(raw).out_dir()
    first_keys = {json.loads(x)["key"] for x in (out / "measurements.jsonl").read_text().splitlines()}
    assert all(set(t.user_attrs["throughput"]) == {"8"} for t in _trials(out) if t.user_attrs.get("throughput"))
    capsys.readouterr()

    # the objective's batch size and the input length change: every trial is measured anew at batch 4
    cfg2 = load(_rewrite(raw, measure={"bench": {"batch_sizes": [4, 8], "input_len": 32}, "reference_batch_size": 4}))
    s = pipeline.run(cfg2, out)
    err = capsys.readouterr().err
    assert "stage search is redone: measure.input_len (64 -> 32); measure.reference_batch_size (8 -> 4)" in err
    assert "stage gqa is redone: after search" in err
    measured = [t for t in _trials(out) if t.user_attrs.get("throughput")]
    assert measured and all(set(t.user_attrs["throughput"]) == {"4"} for t in measured)
    assert s["reference_batch_size"] == 4 and s["config"]["measure"]["bench"]["input_len"] == 32
    new_keys = {json.loads(x)["key"] for x in (out / "measurements.jsonl").read_text().splitlines()} - first_keys
    # the report's numbers are the new measurements only: every trial reads a key the first run did not write
    assert {t.user_attrs["measurement_key"] for t in measured} <= new_keys
    gqa = json.loads((out / "gqa.json").read_text())
    assert gqa["steps"]
    # the first search is kept aside, not deleted
    moved = list((out / "superseded").glob("*/optuna.db"))
    assert len(moved) == 1 and list((out / "superseded").glob("*/gqa.json"))

    # a resume with nothing changed reuses everything
    n = len((out / "measurements.jsonl").read_text().splitlines())
    s3 = pipeline.run(cfg2, out)
    assert s3["measurements_taken_this_run"] == 0 and len(list((out / "superseded").iterdir())) == 1
    assert len((out / "measurements.jsonl").read_text().splitlines()) == n


def test_a_change_that_cannot_be_honoured_is_refused_before_any_write(tmp_path, _finished):
    from archsearch.search import pipeline

    raw = _copy_of(_finished, "law-file", tmp_path)
    out = load(raw).out_dir()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    changed = load(_rewrite(raw, measure={"bench": {"dtype": "float16"}}))
    # the report alone would name float16 over float32 measurements
    with pytest.raises(ArchsearchError) as e:
        pipeline.run(changed, out, only={"report"})
    assert e.value.field == "--only/--skip" and "measure.dtype" in str(e.value) and "select search too" in str(e.value)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before and not (out / "superseded").exists()

    # an Optuna storage outside the folder cannot be set aside: refused, unless the study is renamed
    (tmp_path / "j").mkdir()
    jraw = study_config(tmp_path / "j", optuna={"n_shapes": 2, "storage": str(tmp_path / "j" / "journal.log")},
                        gqa_search={"enabled": False})
    jcfg = load(jraw)
    pipeline.run(jcfg, jcfg.out_dir())
    config_json = (jcfg.out_dir() / "config.json").read_bytes()
    with pytest.raises(ArchsearchError) as e:
        pipeline.run(load(_rewrite(jraw, measure={"bench": {"output_len": 8}})), jcfg.out_dir())
    assert e.value.field == "optuna.storage" and "measure.output_len (16 -> 8)" in str(e.value)
    assert (jcfg.out_dir() / "config.json").read_bytes() == config_json


def test_changed_law_form_and_run_table_refit_the_law(tmp_path, capsys):
    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs
    from archsearch.search import pipeline

    coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
    runs = synthetic_runs("conditional-multiplicative", coef, sizes=(5e5, 1e6, 2e6, 4e6), tokens_per_param=(10, 20))
    write_runs(tmp_path / "a.csv", runs)
    write_runs(tmp_path / "b.csv", runs[:-3])
    raw = study_config(tmp_path, law={"file": None, "fit": {"reference": "chinchilla", "bootstrap": 0}}, proxy={"runs": str(tmp_path / "a.csv")})
    cfg = load(raw)
    out = cfg.out_dir()
    pipeline.run(cfg, out, only={"fit"})
    assert json.loads((out / "law.json").read_text())["law"] == "conditional-multiplicative"

    cfg2 = load(_rewrite(raw, law={"file": None, "fit": {"reference": "chinchilla", "bootstrap": 0}, "form": "conditional-additive"}))
    pipeline.run(cfg2, out, only={"fit"})
    assert json.loads((out / "law.json").read_text())["law"] == "conditional-additive"
    assert "stage fit is redone: law.form" in capsys.readouterr().err

    # another run table (same path or not): the fit reads it
    law = (out / "law.json").read_text()
    write_runs(tmp_path / "a.csv", runs[:-3])
    pipeline.run(cfg2, out, only={"fit"})
    err = capsys.readouterr().err
    assert "stage fit is redone: proxy.runs (content)" in err
    assert (out / "law.json").read_text() != law

    # a law.json cut by a killed write: the fit is redone, not a JSONDecodeError on every rerun
    law = (out / "law.json").read_text()
    (out / "law.json").write_text(law[: len(law) // 2])
    pipeline.run(cfg2, out, only={"fit"})
    assert "law.json is not valid JSON" in capsys.readouterr().err
    assert json.loads((out / "law.json").read_text())["coefficients"] == json.loads(law)["coefficients"]


def test_torn_state_files_are_redone_not_fatal(tmp_path, capsys, _finished):
    from archsearch.search import pipeline

    cfg = load(_copy_of(_finished, "two-batches-gqa", tmp_path))
    out = cfg.out_dir()
    gqa = (out / "gqa.json").read_text()

    def tear(name: str) -> None:
        p = out / name
        p.write_text(p.read_text()[: len(p.read_text()) // 2])  # a write cut half-way

    tear("state.json")
    tear("stage_inputs.json")
    capsys.readouterr()
    s = pipeline.run(cfg, out)
    err = capsys.readouterr().err
    assert "state.json is not valid JSON" in err and "stage_inputs.json is not valid JSON" in err
    assert s["measurements_taken_this_run"] == 0
    assert json.loads((out / "state.json").read_text())["gqa"]["status"] == "done"
    tear("gqa.json")
    s = pipeline.run(cfg, out)
    assert "gqa.json is not valid JSON" in capsys.readouterr().err
    assert json.loads((out / "gqa.json").read_text()) == json.loads(gqa)  # redone, from the store
    assert s["measurements_taken_this_run"] == 0


def test_a_proxy_grid_that_grew_keeps_its_runs_other_proxy_changes_set_them_aside(tmp_path):
    """Which proxy changes keep the trained runs: a run's id names its shape, budget and seed, so
    a grid change reuses them; a training or data setting changes what every run computes."""
    from archsearch.search.inputs import StageInputs, fingerprints, plan_resume, stage_inputs

    sweep = {"name": "p", "params": [8.0e4], "n_layers": 2, "hidden_over_sqrt_n": [0.1, 0.2], "mlp_to_attn": [1.0],
             "gqa": 2, "head_dim": 32, "train": {"tokens_per_param": 1, "lr": 1e-3},
             "data": {"source": "shakespeare", "tokenizer": "bpe:512", "seq_len": 64}}
    raw = study_config(tmp_path, proxy={"sweep": sweep}, vocab_size=512)
    out = tmp_path / "study"
    out.mkdir()
    cfg = load(raw)
    applies = {"proxy": True, "fit": False, "search": True, "gqa": True, "train": False, "eval": False}
    StageInputs(out).record("proxy", fingerprints(cfg, applies)["proxy"], stage_inputs(cfg)["proxy"])
    state = {"proxy": {"status": "done"}}
    every = {"proxy", "fit", "search", "gqa", "report"}

    grown = load(_rewrite(raw, proxy={"sweep": {**sweep, "hidden_over_sqrt_n": [0.1, 0.2, 0.3]}}))
    plan = plan_resume(grown, out, state, every, applies, default_storage=True)
    assert plan.stale == {"proxy": ["proxy.sweep.hidden_over_sqrt_n ([0.1, 0.2] -> [0.1, 0.2, 0.3])"]}
    assert plan.keep == {"proxy"}

    relearnt = load(_rewrite(raw, proxy={"sweep": {**sweep, "train": {"tokens_per_param": 1, "lr": 3e-3}}}))
    plan = plan_resume(relearnt, out, state, every, applies, default_storage=True)
    assert plan.stale == {"proxy": ["proxy.sweep.train.lr (0.001 -> 0.003)"]} and not plan.keep
    assert plan_resume(cfg, out, state, every, applies, default_storage=True).stale == {}
    # compiling the step changes how the runs are executed, not what they compute: nothing is redone
    compiled = load(_rewrite(raw, proxy={"sweep": {**sweep, "train": {**sweep["train"], "compile": True}}}))
    assert compiled.proxy.sweep.train.compile is True
    assert plan_resume(compiled, out, state, every, applies, default_storage=True).stale == {}


def test_the_measured_dtype_is_read_from_this_studys_settings_only(tmp_path):
    """A store that also holds a resumed study's earlier float16 measurements: the chosen
    config's dtype comes from measurements taken with the study's own dtype setting."""
    from archsearch.search.config import MeasureConfig
    from archsearch.search.measurements import MeasurementStore, Measurer
    from tests.test_bench import TINY

    store = MeasurementStore(tmp_path / "m.jsonl")
    store.put("old", {"dtype": "float16", "settings": {"dtype": "float16", "backend": "analytic"}})
    m = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "analytic", "dtype": "bfloat16"}}, "measure"), store)
    assert m.measured_dtype(TINY) is None
    store.put("new", {"dtype": "bfloat16", "settings": {"dtype": "bfloat16", "backend": "analytic"}})
    assert m.measured_dtype(TINY) == "bfloat16"


def _every_byte(out: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(out)): (p.read_bytes() if p.is_file() else None) for p in sorted(out.rglob("*"))}


def test_every_refused_change_to_a_finished_study_changes_not_one_byte(tmp_path):
    """A finished study whose law it fitted itself, rerun with each change the folder cannot honour:
    each is refused, and not one byte of the folder changes (nothing rewritten, nothing set aside)."""
    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs
    from archsearch.search import pipeline

    coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
    write_runs(tmp_path / "a.csv", synthetic_runs("conditional-multiplicative", coef, sizes=(5e5, 1e6, 2e6, 4e6),
                                                  tokens_per_param=(10, 20)))
    raw = study_config(tmp_path, law={"file": None, "fit": {"reference": "chinchilla", "bootstrap": 0}},
                       proxy={"runs": str(tmp_path / "a.csv")}, optuna={"n_shapes": 2},
                       gqa_search={"enabled": False})
    cfg = load(raw)
    out = cfg.out_dir()
    pipeline.run(cfg, out)
    before = _every_byte(out)
    refused = [({"target": {"loss": 1.0}}, None, "target.loss"),  # below the folder law's optimum
               ({"measure": {"bench": {"dtype": "float16"}}}, {"report"}, "--only/--skip")]
    for change, only, field in refused:
        with pytest.raises(ArchsearchError) as e:
            pipeline.run(load(_rewrite(raw, **change)), out, only=only)
        assert e.value.field == field, str(e.value)
        assert _every_byte(out) == before, f"refusing {change} changed the folder"
        assert not (out / "superseded").exists()


def test_only_proxy_on_a_new_folder_asks_for_no_law(tmp_path):
    """``--only proxy`` on a new folder stops after the proxies: no stage after the last selected one
    runs when it was never done (the fit it was told not to make is not read)."""
    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs
    from archsearch.search import pipeline

    coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
    write_runs(tmp_path / "a.csv", synthetic_runs("conditional-multiplicative", coef, sizes=(5e5, 1e6),
                                                  tokens_per_param=(10, 20)))
    raw = study_config(tmp_path, law={"file": None, "fit": {"reference": "chinchilla", "bootstrap": 0}},
                       proxy={"runs": str(tmp_path / "a.csv")})
    cfg = load(raw)
    out = cfg.out_dir()
    s = pipeline.run(cfg, out, only={"proxy"})
    assert not (out / "law.json").exists() and s["target_loss"] is None


def test_settings_the_search_reads_redo_it_when_changed(tmp_path, capsys, _finished):
    """law.allow_extrapolation and optuna.target_objective decide which shapes the search admits and
    how it ranks them: changing either on a finished study redoes the search (and the stages after)."""
    from archsearch.search import pipeline

    raw = _copy_of(_finished, "law-file", tmp_path)
    out = load(raw).out_dir()
    capsys.readouterr()
    pipeline.run(load(_rewrite(raw, law={"allow_extrapolation": True})), out)
    assert "stage search is redone: law.allow_extrapolation (null -> true)" in capsys.readouterr().err
    pipeline.run(load(_rewrite(raw, law={"allow_extrapolation": True}, optuna={"target_objective": "geomean"})), out)
    assert "optuna.target_objective (null -> \"geomean\")" in capsys.readouterr().err


# settings a study's report states (its config) that change no result: how the work is scheduled,
# where it is recorded, or how far a search that resumes itself goes; each with why
CHANGES_NO_RESULT = {
    "cluster.": "where and how jobs run: every job's result is the same",
    "optuna.n_shapes": "the search resumes itself: more shapes extend it, fewer stop it (the budget, stated with "
                       "the shapes measured)",
    "optuna.n_trials": "the search resumes itself with the new trial budget",
    "optuna.seeds_together": "schedules the seeds' measurements; each is stored and read back under the same key",
    "optuna.log_with": "where trial records are also sent",
    "optuna.storage": "a new storage is a new study (refused where the folder's holds other trials)",
    "measure.max_attempts": "the search resumes itself: attempts left are spent at the next run",
    "optuna.seed_tolerance": "a check at load of the seeded shapes' N: a seed it no longer admits is refused at "
                             "load; one it admits is measured as published, whatever the tolerance",
    "measure.fallback_backend": "used only when the engine is missing: the engine that measured is in the key",
    "measure.bench.timeout_s": "a measurement that timed out failed, and is retried (measure.max_attempts)",
    "law.fit.n_jobs": "processes of the fit: the same fit",
    "out": "the folder itself",
    "final_train.train.log_with": "where metrics are also sent",
    "final_train.train.cpu_threads": "threads of the same computation",
    "final_train.train.compile": "a compiled step computes the eager one's (settings.EXECUTION_ONLY)",
    "proxy.sweep.train.compile": "a compiled step computes the eager one's (settings.EXECUTION_ONLY)",
    "proxy.active.": "read only by the active plan (proxy.plan: active): in the proxy stage's inputs there",
}

# a changed value for each setting that is not a number or a flag (those are changed generically)
EXAMPLES = {
    "name": "t2", "mode": "predict-rank-select", "law.form": "conditional-additive", "law.file": "LAW",
    "law.fit.method": "lbfgsb", "law.fit.reference": "best-observed", "law.fit.holdout_size": 2,
    "law.seed": 5, "law.size_tolerance": 0.1, "target.loss": 3.5, "target.confidence": 0.9,
    "limits.max_ttft_s": 10.0, "measure.bench.backend": "hf", "measure.bench.device_spec": "A100-40GB",
    "measure.bench.dtype": "float16", "measure.bench.engine_args": {"enforce_eager": True},
    "measure.calibration": "configs/calibration/h200-vllm.json", "measure.params": 1.0e6,
    "measure.reference_batch_size": 4, "measure.fallback_backend": "analytic",
    "measure.targets": [{"name": "h100", "backend": "analytic", "device_spec": "H100", "batch_size": 8}],
    "optuna.objective": "pareto", "optuna.sampler": "random", "optuna.target_objective": "geomean",
    "measure.objective": "latency", "optuna.seed_shapes": ["llama-3.2-1b"],
    "search_space.build.on_r_drift": "refuse", "search_space.build.family": "qwen3",
    "gqa_search.max_gqa": 2, "gqa_search.min_kv_heads": 2, "evaluation.tasks": "offline,offline2",
    "baseline.preset": "llama-3.2-1b", "baseline.arch": "configs", "proxy.runs": "RUNS", "proxy": "RUNS", "proxy.plan": "active",
    "proxy.sweep": {"name": "s2", "params": [1.0e5], "n_layers": 2}, "proxy.sweeps": [{"name": "s2", "params": [1.0e5]}],
    "proxy.store": "STORE", "law.fit.reference_law": {"law": "chinchilla", "coefficients": {
        "E": 1.7, "A": 400.0, "alpha": 0.34, "B": 400.0, "beta": 0.28}},
    "gqa_search.loss_noise": 0.01, "limits.max_tpot_s": 1.0, "limits.max_peak_memory_gib": 10.0,
    "final_train.tokens": 1.0e6, "final_train.train.tokens": 1.0e6, "final_train.train.tokens_per_param": 10.0,
    "final_train.train.micro_batch_size": 4, "final_train.train.warmup_steps": 5, "final_train.train.eval_interval": 50,
    "final_train.train.checkpoint_interval": 50, "final_train.train.dtype": "float32",
    "final_train.train.attn_implementation": "eager", "final_train.train.hparams": {"lr": 1.0e-3},
    "final_train.train.init_from": "configs", "final_train.train.lora_rank": 8, "final_train.train.lora_targets": ["q_proj"],
    "final_train.data": {"source": "shakespeare"}, "evaluation.limit": 10,
    # measure.mode: online and its settings (refused on this analytic study; online they key the search:
    # tests/test_online_study.py)
    "measure.mode": "online", "measure.rate": 1.0, "measure.n_requests": 8,
    "measure.slo": {"ttft_s": 1.0, "tpot_s": 0.1}, "measure.port": 8000,
}


def _changed_value(key: str, v):
    if key in EXAMPLES:
        return EXAMPLES[key]
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 1.5 if v else 0.5
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return [x * 2 for x in v]
    return None


@pytest.mark.parametrize("fitted", [True, False], ids=["law-fitted", "law-file"])
def test_every_setting_the_report_states_redoes_what_reads_it_or_is_refused(tmp_path, fitted):
    """Each setting of the study's config (which the report states): changed on a finished study,
    it is refused at load, or changes the fingerprint of a stage that applies (so that stage and
    those after it are redone), or is one that changes no result (CHANGES_NO_RESULT, with why)."""
    from archsearch.configio import to_dict
    from archsearch.laws.synthetic import synthetic_runs
    from archsearch.rundata import write_runs
    from archsearch.search.config import load_study_config
    from archsearch.search.inputs import fingerprints
    from archsearch.search.settings import flat
    from archsearch.search.stages import stage_applies

    coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
    if fitted:
        coef = {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04}
        write_runs(tmp_path / "a.csv", synthetic_runs("conditional-multiplicative", coef, sizes=(5e5, 1e6),
                                                      tokens_per_param=(10, 20)))
        raw = study_config(tmp_path, law={"file": None, "fit": {"reference": "chinchilla", "bootstrap": 0}},
                           proxy={"runs": str(tmp_path / "a.csv")})
    else:
        raw = study_config(tmp_path)
    cfg = load(raw)
    full = to_dict(cfg)

    def prints(c):  # every stage's, applying or not: one that does not apply runs with them once it does
        return fingerprints(c, stage_applies(c))

    base = prints(cfg)
    ignored, untried = [], []
    for key, value in flat(full, "").items():
        new = _changed_value(key, value)
        if any(key == k or (k.endswith(".") and key.startswith(k)) for k in CHANGES_NO_RESULT):
            continue
        if new is None or new == value:
            untried.append(key)
            continue
        if new == "LAW":
            new = str(tmp_path / "law.json") if fitted else None
        elif new == "RUNS":  # other runs (the file's content is what the fit reads)
            write_runs(tmp_path / "b.csv", synthetic_runs("conditional-multiplicative", coef, sizes=(5e5, 2e6),
                                                          tokens_per_param=(10, 20)))
            new = str(tmp_path / "b.csv") if key == "proxy.runs" else {"runs": str(tmp_path / "b.csv")}
        elif new == "STORE":
            new = str(tmp_path / "store")
        changed = json.loads(json.dumps(full))
        *path, last = key.split(".")
        node = changed
        for k in path:
            node = node[k]
        node[last] = new
        p = tmp_path / "changed.yaml"
        p.write_text(yaml.safe_dump(changed))
        try:
            c2 = load_study_config(p)
        except ArchsearchError:
            continue  # refused at load
        if prints(c2) == base:
            ignored.append(f"{key}: {value!r} -> {new!r}")
    assert not ignored, "changed on a finished study, these redo nothing:\n" + "\n".join(ignored)
    # every setting that is not a number or a flag has an example change (a new one must get one)
    assert not untried, f"no changed value to try for {untried}: add one to EXAMPLES or CHANGES_NO_RESULT"


def test_removing_measure_targets_redoes_the_search(tmp_path, capsys):
    from archsearch.search import pipeline

    targets = [{"name": "h100", "backend": "analytic", "device_spec": "H100", "batch_size": 8}]
    raw = study_config(tmp_path, measure={"targets": targets}, optuna={"n_shapes": 2}, gqa_search={"enabled": False})
    out = load(raw).out_dir()
    pipeline.run(load(raw), out)
    capsys.readouterr()
    plain = {k: v for k, v in raw.items() if k != "_path"}
    plain["measure"] = {k: v for k, v in plain["measure"].items() if k != "targets"}
    Path(raw["_path"]).write_text(yaml.safe_dump(plain))
    s = pipeline.run(load(raw), out)
    assert "stage search is redone: measure.targets" in capsys.readouterr().err
    assert "targets" not in s

"""The study is resolved once (archsearch.search.resolved): one object built at load holds what
every stage, the dry run, the jobs and the benchmark scripts derive from the config, and the
config's checks run once, in their order."""

from __future__ import annotations

import dataclasses
import pickle
import sys
from collections import Counter
from pathlib import Path

import pytest

from archsearch.errors import ArchsearchError
from archsearch.search import checks, derived
from archsearch.search.config import load_study_config
from archsearch.search.resolved import ResolvedStudy, as_resolved, derive, resolve
from archsearch.trainers.sweep import sweep_specs

REPO = Path(__file__).resolve().parent.parent

# each derivation and each check of the config, by its code (whatever name a module imported it by)
WATCHED = {f.__code__: name for name, f in {
    "vocab_size": checks.vocab_size, "build_settings": derived.build_settings, "baseline_spec": checks.baseline_spec,
    "measured_baseline": checks.measured_baseline, "check_settings": checks.check_settings,
    "check_search_space": checks.check_search_space, "check_study": checks.check_study,
    "check_reference_batches": checks.check_reference_batches, "sweep_specs": sweep_specs}.items()}


def _calls(fn) -> Counter:
    """How many times each watched function ran during ``fn()``."""
    seen: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in WATCHED:
            seen[WATCHED[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("config", ["demo-cpu", "paper-1b-targets-rehearsal"])
def test_the_dry_run_checks_the_config_once(config, tmp_path, capsys):
    """``archsearch search --dry-run``: every check runs once and every value is derived once,
    also with deployment targets and with the plan priced on GPUs (each target its own batch)."""
    from archsearch.cli import main

    seen = _calls(lambda: main(["search", "--config", str(REPO / "configs" / f"{config}.yaml"), "--dry-run",
                                "--gpus", "8xH100", "--out", str(tmp_path / "o")]))
    assert "plan for study" in capsys.readouterr().out
    cfg = load_study_config(REPO / "configs" / f"{config}.yaml")
    sweeps = len(cfg.proxy.sweep_list()) if cfg.proxy else 0
    assert seen == Counter({**{name: 1 for name in WATCHED.values() if name != "sweep_specs"},
                            **({"sweep_specs": sweeps} if sweeps else {})})


@pytest.mark.parametrize("config", ["demo-cpu", "paper-1b", "paper-1b-targets-rehearsal"])
def test_the_resolved_values_are_the_config_s_derivations(config):
    cfg = load_study_config(REPO / "configs" / f"{config}.yaml")
    s = derive(cfg)
    vocab = checks.vocab_size(cfg)
    build = derived.build_settings(cfg, vocab)
    assert (s.vocab_size, s.build) == (vocab, build)
    assert s.baseline == checks.baseline_spec(cfg)
    assert s.measured_baseline == checks.measured_baseline(cfg)
    assert (s.measured(s.baseline) == s.measured_baseline) and ((s.scale is None) == (cfg.measure.params is None))
    assert s.fit == cfg.fit_options()
    assert list(s.sweeps) == checks.proxy_sweeps(cfg)
    assert [list(x) for x in s.sweep_shapes] == [sweep_specs(sw, vocab) for sw in s.sweeps]
    assert [v.cfg for v in s.views] == [v.cfg for v in checks.target_views(cfg)]
    # checked or not, the values are the same
    checked = resolve(cfg, for_plan=True)
    assert {f.name: getattr(checked, f.name) for f in dataclasses.fields(s) if f.name != "scale"} == \
        {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "scale"}
    assert as_resolved(s) is s and isinstance(as_resolved(cfg), ResolvedStudy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.vocab_size = 1


def test_resolve_refuses_on_the_first_failing_check_in_the_checks_order():
    """A config with two errors is refused on the one the checks meet first (the baseline is
    rebuilt at measure.params only after the other checks), before any work."""
    path = REPO / "configs" / "paper-1b.yaml"
    with pytest.raises(ArchsearchError) as e:
        resolve(load_study_config(path, ["measure.params=1e8"]), for_plan=True)
    assert e.value.field == "measure.params"
    with pytest.raises(ArchsearchError) as e:
        resolve(load_study_config(path, ["measure.params=1e8", "optuna.n_shapes=100000"]), for_plan=True)
    assert e.value.field == "optuna.n_shapes"
    with pytest.raises(ArchsearchError) as e:
        resolve(load_study_config(path, ["target.confidence=0.9", "law.fit.bootstrap=0", "n_layers=1000"]))
    assert e.value.field == "target.confidence"


def test_a_measurement_job_gets_the_resolved_study_as_it_is():
    """The search stage hands each job the coordinator's resolved study (pickled by a local or
    Slurm executor), run inline: only the cluster block changes."""
    s = derive(load_study_config(REPO / "configs" / "paper-1b.yaml", ["measure.params=2e8"]))
    inline = s.with_cluster(dataclasses.replace(s.cfg.cluster, executor="inline", jobs_at_once=1, measure_workers=1))
    assert inline.cfg.cluster.executor == "inline" and all(v.cfg.cluster.executor == "inline" for v in inline.views)
    back = pickle.loads(pickle.dumps(inline))
    for f in dataclasses.fields(s):
        if f.name not in ("cfg", "views", "scale"):
            assert getattr(back, f.name) == getattr(s, f.name), f.name
    assert back.measured(s.baseline) == s.measured_baseline

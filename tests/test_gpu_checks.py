"""The GPU checks' one command (benchmarks/scripts/gpu_checks.sh, issue 41), rehearsed on the CPU.

A GPU machine is lent now and then, for minutes: the command it runs must start and run every step
the first time. Here it runs with --tiny (the same commands at sizes the CPU runs in seconds), so a
broken flag, a missing file or a step that cannot import fails here, not on the lent machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "scripts" / "gpu_checks.sh"


# torch.compile's graphs are captured (dynamo, AOTAutograd) but run with eager kernels (aot_eager) in the
# rehearsal: the CPU's inductor kernels (C++, ~25 s of g++ a graph here) are not what a GPU runs
# (Triton), so they would cost minutes of the suite and tell nothing of the lent machine's run;
# tests/test_hf_compiled.py decodes through inductor's own on the CPU
AOT_EAGER = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:aot_eager"}


def _run(out: Path, *args: str, budget: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, **AOT_EAGER)
    if budget is not None:
        env["BUDGET"] = str(budget)
    return subprocess.run(["bash", str(SCRIPT), str(out), "--tiny", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_device_command_runs_every_step_here_at_tiny_size(tmp_path):
    out = tmp_path / "out"
    run = _run(out)
    log = (out / "log.txt").read_text()
    assert run.returncode == 0, log[-4000:]
    for step in ("env", "gpu-tests", "train", "study", "serving"):
        assert f"=== {step}" in log
    assert "=== done in" in log and "stopped at its" not in log

    env = json.loads((out / "versions.json").read_text())
    assert env["provenance"]["versions"]["torch"] and env["provenance"]["versions"]["archsearch"]
    assert "passed" in (out / "pytest_gpu.txt").read_text() or "skipped" in (out / "pytest_gpu.txt").read_text()

    train = json.loads((out / "training_speed.jsonl").read_text().splitlines()[-1])
    assert train["compiled"] is True and train["ours_tokens_per_s"] > 0 and train["plain_tokens_per_s"] > 0
    assert train["mfu"] > 0 and len(train["first_step_s_ours"]) == 1

    assert "plan for study tiny-e2e" in log  # --tiny: the plan (tests/test_search_e2e.py runs it whole)

    records = [json.loads(ln) for ln in (out / "serving.jsonl").read_text().splitlines()]
    by_backend = {}
    for r in records:
        by_backend.setdefault(r["backend"], []).append(r)
    assert len(by_backend["analytic"]) == 2 and len(by_backend["hf"]) == 2
    for r in by_backend["hf"]:  # the compiled decode path end to end (on a GPU: test_hf_compiled.py's gpu test)
        assert r["ok"], r.get("error")
        eng = r["settings"]["engine"]
        assert eng["decode"] == "static KV cache + torch.compile (mode default, fullgraph)"
        assert eng["kwargs"]["cache"].startswith("static, one a batch size")
        assert eng["kwargs"]["compile_config"]["fullgraph"] is True and r["settings"]["engine_args"]["compile"]
    ratios = json.loads((out / "ratios.json").read_text())
    assert len(ratios["rows"]) == 1 and ratios["rows"][0]["predicted_ratio"] > 0
    assert "gap" in ratios["rows"][0]


def test_a_run_out_of_time_says_which_steps_did_not_run(tmp_path):
    """The run's budget caps every step; a step with no time left is named, and the run fails."""
    out = tmp_path / "out"
    run = _run(out, "env", "train", budget=5, timeout=120)
    log = (out / "log.txt").read_text()
    assert run.returncode == 1
    assert "=== env: not run, the run's 5 s are spent" in log and "=== train: not run" in log


def test_an_unknown_step_is_refused_by_name(tmp_path):
    run = _run(tmp_path / "out", "envv", timeout=120)
    assert run.returncode == 2 and "unknown step envv" in (tmp_path / "out" / "log.txt").read_text()


def test_serving_ratios_divide_by_the_baseline_at_each_batch_and_compare_with_the_predictor():
    from archsearch.benchmarks.scripts.serving_ratios import ratios, throughputs

    def rec(backend, name, tps):
        return {"backend": backend, "architecture": {"name": name},
                "per_batch": [{"batch_size": b, "ok": True, "output_throughput": v} for b, v in tps.items()]}

    lines = [rec("analytic", "base", {1: 100.0, 64: 1000.0}), rec("analytic", "wide", {1: 110.0, 64: 1500.0}),
             rec("hf", "base", {1: 50.0, 64: 400.0}), rec("hf", "wide", {64: 500.0}), rec("hf", "wide", {1: 60.0}),
             {"backend": "hf", "architecture": {"name": "failed"},
              "per_batch": [{"batch_size": 1, "ok": False, "output_throughput": None}]}]
    rows = ratios(throughputs(lines), "base")
    assert [(r["shape"], r["batch_size"]) for r in rows] == [("wide", 1), ("wide", 64)]
    assert rows[0]["measured_ratio"] == pytest.approx(1.2) and rows[0]["predicted_ratio"] == pytest.approx(1.1)
    assert rows[0]["gap"] == pytest.approx(1.2 / 1.1 - 1)
    assert rows[1]["gap"] == pytest.approx(1.25 / 1.5 - 1)
    assert rows[1]["measured_over_predicted"] == pytest.approx(500 / 1500)

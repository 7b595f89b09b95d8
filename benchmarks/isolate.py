"""Run one backend measurement in a child process with a timeout; failures become data.

Engines do not free device memory reliably and can crash or hang, so every candidate gets a
fresh interpreter (``python -m archsearch.benchmarks.isolate JOB RESULT``) in its own session (process
group). On timeout, or once it has finished, that whole group is terminated: the engine's
own workers go with it, and nothing else of the caller's is touched. If the caller itself is
killed (``kill -9``: no cleanup of its own runs), a watchdog in the child's group kills the group
(:func:`archsearch.benchmarks.scratch.watch_owner`), and the scratch folder is removed by the
next measurement on the machine. Because the child is a
fresh ``python -m`` process, callers need no ``if __name__ == "__main__"`` guard.

The child rewrites RESULT after every batch size, so a timeout keeps what was measured, and
at every long step (engine start, warm-up, repeat k of n) with an ``event`` the parent
prints as one line on stderr while it waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import archsearch
from archsearch.benchmarks.base import load_backend
from archsearch.benchmarks.engine_loop import describe_error
from archsearch.benchmarks.scratch import (engine_socket_env, reap_shared_memory, scratch_dir, shm_segments,
                                           watch_owner)
from archsearch.fileio import write_json  # atomic: the parent never reads half a file
from archsearch.logs import get_logger

# the folder holding the ``archsearch`` package this process runs (a checkout or site-packages):
# the child imports the same copy
_REPO_ROOT = Path(archsearch.__file__).resolve().parent.parent


@dataclass
class Outcome:
    """How the child ended. ``result`` is the last summary it wrote (possibly partial)."""

    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    returncode: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0
    log_tail: str = ""
    last_event: str | None = None  # the child's last progress event (e.g. "batch 8: repeat 2 of 3")


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM then SIGKILL the child's process group (the child and its engine workers)."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or the group never looks empty
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)


def _print_event(job: dict[str, Any], event: str) -> None:
    a = job.get("arch") or {}
    shape = f"d={a.get('hidden_size')} L={a.get('n_layers')} heads={a.get('n_heads')}/{a.get('n_kv_heads')}"
    get_logger("bench").info(f"[bench] {job.get('settings', {}).get('backend', '')} {shape}: {event}")


def _event(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("event")
    except (OSError, json.JSONDecodeError):  # not written yet
        return None


def run_isolated(job: dict[str, Any], timeout_s: float, env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, on_event=_print_event) -> Outcome:
    """Run ``load_backend(job['backend_class']).run(job)`` in a child; never raises for its
    failures (a crash, a timeout, an exception all come back as ``Outcome(ok=False)``).
    ``on_event(job, text)`` gets each progress event of the child (None: silent)."""
    with scratch_dir("bench") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job, default=str))  # a private scratch folder, read once by the child
        log_file = Path(log_path) if log_path else Path(tmp) / "child.log"
        child_env = dict(os.environ)
        child_env.update(engine_socket_env(tmp))  # the engine's socket files go with the scratch folder
        child_env.update(env or {})
        child_env["PYTHONPATH"] = os.pathsep.join(
            [str(_REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        child_env["ARCHSEARCH_OWNER_PID"] = str(os.getpid())  # the child's group dies with this process
        t0 = time.perf_counter()
        segments_before = shm_segments()
        with log_file.open("w") as log:  # the child's live output, streamed: a log, not a result
            proc = subprocess.Popen(
                [sys.executable, "-m", "archsearch.benchmarks.isolate", str(job_path), str(result_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env,
                start_new_session=True)
            timed_out, rc, last = False, None, None
            try:
                while rc is None:  # wait, reporting the child's progress events as they come
                    try:
                        rc = proc.wait(timeout=0.5)
                    except subprocess.TimeoutExpired:
                        if time.perf_counter() - t0 > timeout_s:
                            timed_out = True
                            break
                    ev = _event(result_path) if on_event else None
                    if ev and ev != last:
                        on_event(job, ev)
                        last = ev
            finally:
                kill_group(proc)
                if proc.poll() is None:
                    proc.wait()
                # the engine's segments its group left (the group is dead: none is in use by it)
                reap_shared_memory(0.0, only=shm_segments() - segments_before)
        wall = time.perf_counter() - t0
        rc = proc.returncode if rc is None else rc
        tail = _tail(log_file)
        result: dict[str, Any] = {}
        unreadable = None
        if result_path.exists():
            try:
                result = json.loads(result_path.read_text())
            except json.JSONDecodeError as e:
                unreadable = f"the engine process's result file is not valid JSON: {e}"
        status = result.pop("status", None)
        event = result.pop("event", None)  # progress only
        if timed_out:
            return Outcome(False, result, f"timeout after {timeout_s:g} s", rc, True, wall, tail, event)
        if status == "done" and rc == 0:
            return Outcome(True, result, None, rc, False, wall, tail, event)
        error = result.pop("error", None) or unreadable or _crash_reason(rc, tail)
        return Outcome(False, result, error, rc, False, wall, tail, event)


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-n_chars:]


def _crash_reason(rc: int | None, tail: str) -> str:
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        why = f"engine process killed by signal {name}"
        if -rc == signal.SIGKILL:
            why += " (out of memory?)"
    else:
        why = f"engine process exited with status {rc}"
    last = [line for line in tail.splitlines() if line.strip()][-1:] or [""]
    return f"{why}: {last[0].strip()[:300]}" if last[0] else why


def _child_main(job_path: str, result_path: str) -> int:
    if os.environ.get("ARCHSEARCH_OWNER_PID"):  # before any engine starts a worker
        watch_owner(int(os.environ["ARCHSEARCH_OWNER_PID"]))
    out = Path(result_path)
    job = json.loads(Path(job_path).read_text())
    state: dict[str, Any] = {}

    def report(partial: dict) -> None:
        state.update(partial)
        write_json(out, {"status": "running", **state}, default=str)

    try:
        summary = load_backend(job["backend_class"]).run(job, report)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as data
        traceback.print_exc()
        write_json(out, {"status": "error", **state, "error": describe_error(e)}, default=str)
        return 1
    write_json(out, {"status": "done", **state, **summary}, default=str)
    return 0


if __name__ == "__main__":
    code = _child_main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    # Engines may leave non-daemon threads behind; the result is written, so leave now
    # (the parent then ends the rest of this process group).
    os._exit(code)

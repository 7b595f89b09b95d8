"""Scratch folders of measurements (``/tmp/archsearch-<kind>-<pid>-*``) and the watchdog that
ends an engine process group whose owner died.

A study killed with ``kill -9`` runs no cleanup: its scratch folders stay and, without the
watchdog, the engine it started (which runs in its own process group, see
:mod:`archsearch.benchmarks.isolate`) and that engine's workers would keep running under PID 1.
Each scratch folder names the process that owns it, so the next measurement on the machine
removes those whose owner is gone (:func:`reap_stale`); the engine process starts a watchdog
(:func:`watch_owner`) that kills its whole process group once the owner has died.

An engine's workers also share memory through POSIX segments (``/dev/shm/psm_*``, Python's
``multiprocessing.shared_memory``, which vLLM's message queues use); a killed group, or an engine
that exits without unlinking them (four 160 MB segments per vLLM study), leaves them behind, and
nothing else ever removes them. They are reaped with the scratch (:func:`reap_shared_memory`): a
segment of this user that no live process maps or holds open is garbage, and goes.

vLLM's processes talk over ZMQ through Unix socket files (uuid-named) in ``VLLM_RPC_BASE_PATH``,
by default ``$TMPDIR``; a killed engine never removes them. Each engine process this project
starts is given its measurement's scratch folder as that path (:func:`engine_socket_env`), so the
files go with the folder: removed on exit, or reaped with it after a kill. Nothing else's sockets
in ``$TMPDIR`` are touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator

from archsearch.logs import get_logger

_NAME = re.compile(r"^archsearch-(bench|model|paired)-(\d+)-")
SHM = Path("/dev/shm")
_SEGMENT = "psm_*"  # multiprocessing.shared_memory's names
# the longest path a Unix socket may have (sun_path holds 108 bytes with its NUL on Linux, 104 on macOS)
SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
VLLM_SOCKET_NAME_LEN = 36  # vLLM names each socket file by a uuid4 under VLLM_RPC_BASE_PATH
_long_path_warned: set[str] = set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def reap_stale(root: str | Path | None = None) -> list[Path]:
    """Remove this user's scratch folders whose owner process is gone; returns them."""
    root = Path(root or tempfile.gettempdir())
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _NAME.match(p.name)
        if not m or int(m.group(2)) == os.getpid():
            continue
        try:
            if p.is_symlink() or not p.is_dir() or p.stat().st_uid != os.getuid() or _alive(int(m.group(2))):
                continue
        except OSError:
            continue
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p)
    if removed:
        get_logger("bench").warning(
            f"archsearch: removed {len(removed)} scratch folder(s) left by killed measurements "
            f"({', '.join(p.name for p in removed[:3])}{', ...' if len(removed) > 3 else ''})")
    return removed


def _segments_of(proc: Path) -> set[str]:
    """The ``/dev/shm`` paths the process of ``proc`` (its ``/proc/<pid>`` folder) maps or holds
    open; empty if it is gone or not this user's to read. A segment unlinked since is named as it was."""
    held: set[str] = set()
    with contextlib.suppress(OSError):
        held.update(line.split(None, 5)[5].removesuffix(" (deleted)") for line in (proc / "maps").read_text().splitlines()
                    if "/dev/shm/" in line and len(line.split(None, 5)) == 6)
    with contextlib.suppress(OSError):
        for fd in (proc / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd).removesuffix(" (deleted)")
                if target.startswith("/dev/shm/"):
                    held.add(target)
    return held


def segments_in_use() -> set[str]:
    """The ``/dev/shm`` paths some live process maps or holds open (of the processes this user
    may read: a segment of this user's is mapped by this user's processes or root's)."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            used |= _segments_of(proc)
    return used


def segments_held_by(pids: Iterable[int]) -> set[str]:
    """The ``/dev/shm`` paths the processes ``pids`` map or hold open: read just before they are
    killed, the segments a kill could leave behind (those of other processes on the machine are
    not among them)."""
    return set().union(*(_segments_of(Path("/proc") / str(pid)) for pid in pids))


def segments_left_unused(paths: Iterable[str]) -> set[str]:
    """Those of ``paths`` (``/dev/shm`` paths, e.g. from :func:`segments_held_by`) that still exist
    and that no live process maps or holds open: leaked."""
    left = {p for p in paths if os.path.lexists(p)}
    return left - segments_in_use() if left else left


def reap_shared_memory(min_age_s: float = 60.0, only: set[str] | None = None, root: Path = SHM) -> list[Path]:
    """Remove this user's shared-memory segments (``psm_*``) that no live process maps or holds
    open and that are older than ``min_age_s`` (a segment just made may not be mapped yet);
    ``only``: just these names (the segments one measurement made). Returns them."""
    try:
        candidates = [p for p in root.glob(_SEGMENT) if only is None or p.name in only]
    except OSError:
        return []
    now, removed = time.time(), []
    candidates = [p for p in candidates if _own_and_older(p, now - min_age_s)]
    if not candidates:
        return removed
    used = segments_in_use()
    for p in candidates:
        if str(p) not in used:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    if removed:
        get_logger("bench").warning(f"archsearch: removed {len(removed)} shared-memory segment(s) left by engines "
                                    f"({', '.join(p.name for p in removed[:3])}{', ...' if len(removed) > 3 else ''})")
    return removed


def _own_and_older(p: Path, before: float) -> bool:
    try:
        st = p.lstat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and st.st_mtime <= before and p.is_file()


def shm_segments() -> set[str]:
    """The names of the shared-memory segments now in ``/dev/shm`` (before a measurement: what it
    makes is what appears after)."""
    try:
        return {p.name for p in SHM.glob(_SEGMENT)}
    except OSError:
        return set()


@contextlib.contextmanager
def scratch_dir(kind: str) -> Iterator[str]:
    """A private temporary folder named for this process (reaped by :func:`reap_stale` if it is
    killed), removed on exit; stale ones of dead processes are reaped first, and so are the
    shared-memory segments no process uses (:func:`reap_shared_memory`)."""
    reap_stale()
    reap_shared_memory()
    with tempfile.TemporaryDirectory(prefix=f"archsearch-{kind}-{os.getpid()}-") as tmp:
        yield tmp


def engine_socket_env(folder: str | Path) -> dict[str, str]:
    """The environment that makes a vLLM engine process put its ZMQ socket files in ``folder`` (the
    measurement's scratch folder): ``{"VLLM_RPC_BASE_PATH": folder}``. Empty where the caller's
    environment names a ``VLLM_RPC_BASE_PATH`` itself (theirs stands), or where a socket's path in
    ``folder`` would be longer than a Unix socket allows (an engine could not start): vLLM's default
    (``$TMPDIR``) then stands, and a warning says once that its socket files stay there and how to
    avoid it."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        return {}
    folder = os.fspath(folder)
    if len(os.fsencode(folder)) + 1 + VLLM_SOCKET_NAME_LEN > SOCKET_PATH_MAX:
        parent = os.path.dirname(folder)
        if parent not in _long_path_warned:
            _long_path_warned.add(parent)
            get_logger("bench").warning(
                f"archsearch: the scratch folder {folder} is too long a path for vLLM's socket files "
                f"(a Unix socket's path holds {SOCKET_PATH_MAX} bytes): they stay in {parent}, and a killed "
                f"engine leaves them there; a shorter TMPDIR (at most "
                f"{SOCKET_PATH_MAX - 1 - VLLM_SOCKET_NAME_LEN - len(os.path.basename(folder)) - 1} bytes) keeps them "
                "in the scratch folder")
        return {}
    return {"VLLM_RPC_BASE_PATH": folder}


def watch_owner(owner_pid: int, poll_s: float = 0.2) -> int | None:
    """In an engine process that leads its own process group: fork a watchdog that kills the
    whole group (this process, its engine workers and itself) once ``owner_pid`` is gone.
    Where Linux offers it, this process also asks for SIGKILL when its parent dies
    (``PR_SET_PDEATHSIG``); the watchdog then takes the workers. Returns the watchdog's pid
    (None where it could not start: the owner is then still the only one to end the group)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if not hasattr(os, "fork"):
        return None
    import psutil

    try:
        owner = psutil.Process(owner_pid)
        owner.create_time()  # the owner's identity: a reused pid is another process
    except psutil.Error:
        owner = None
    pid = os.fork()
    if pid:
        return pid
    # the watchdog: no threads, nothing of the engine's
    try:
        while _running(owner):
            time.sleep(poll_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(0)


def _running(proc) -> bool:
    """Whether ``proc`` (a psutil.Process, or None) still runs: a zombie (killed, not yet reaped) does not."""
    import psutil

    try:
        return proc is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

"""The Optuna study's storage: its URL (SQLite in the study folder by default, any SQLAlchemy URL,
or a journal file ``*.log`` for several workers on a shared disk), checked before any work and
opened safely by several workers; and the liveness of its running trials (a worker's process id on
this host, its heartbeat elsewhere), so that a trial whose worker died is failed and enqueued again."""

from __future__ import annotations

import contextlib
import os
import platform
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from archsearch.configio import redact
from archsearch.errors import ArchsearchError
from archsearch.search import log
from archsearch.search.config import StudyConfig
from archsearch.search.measurements import file_lock


def storage_url(cfg: StudyConfig, out: Path) -> str:
    # relative like the study folder itself (sqlite:///runs/x/optuna.db), so the URL in a
    # committed report opens from the repository root on any machine
    return cfg.optuna.storage or f"sqlite:///{out / 'optuna.db'}"


def journal_path(url: str) -> Path | None:
    """The file of a journal storage URL (``journal:PATH`` or ``*.log``); None for a database."""
    if url.startswith("journal:"):
        return Path(url[len("journal:"):])
    return Path(url) if url.endswith(".log") else None


def check_storage(url: str, field: str = "optuna.storage") -> None:
    """Open a storage URL now, before any work, and create nothing: a journal or SQLite file's
    folder exists and is writable and an existing file is what it should be; a database's driver
    is installed and a connection is made. Errors show the URL with its password masked."""
    shown = redact(url)
    path = journal_path(url)
    if path is None and url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        db = make_url(url).database
        if not db or db == ":memory:" or db.startswith("file:"):
            raise ArchsearchError(field, f"{shown!r} names no SQLite file", "e.g. sqlite:///results/x/optuna.db")
        path = Path(db)
    if path is not None:
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ArchsearchError(field, f"{shown!r}: the folder {str(parent)!r} does not exist",
                                  "create it first, or give a file in an existing folder")
        if path.is_dir():
            raise ArchsearchError(field, f"{shown!r}: {str(path)!r} is a folder", "give a file path")
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.R_OK | os.W_OK)):
            raise ArchsearchError(field, f"{shown!r}: cannot write {str(path)!r} (permission denied)",
                                  "give a writable path")
        if path.exists() and path.stat().st_size and url.startswith("sqlite:"):
            _check_sqlite_file(path, shown, field)
        return
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(url, connect_args=_connect_timeout(url))
    except Exception as e:  # noqa: BLE001 - a missing driver (ImportError), a bad URL: said below
        raise ArchsearchError(field, f"{shown!r} cannot be used: no installed driver for it "
                              f"({redact(str(e)).splitlines()[0]})",
                              "install the database's driver (postgresql+psycopg://, mysql+pymysql://), or use "
                              "sqlite:///PATH or a journal file.log") from None
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:  # noqa: BLE001 - any failure to connect is the user's URL or server
        first = redact(str(getattr(e, "orig", None) or e)).strip().splitlines() or [type(e).__name__]
        raise ArchsearchError(field, f"cannot connect to {shown!r} ({first[0]})",
                              "check the host, port, user and that the server is running") from None
    finally:
        engine.dispose()


def _connect_timeout(url: str) -> dict[str, Any]:
    """A short connect timeout for the drivers that take one, so a wrong host fails in seconds."""
    return {"connect_timeout": 10} if url.startswith(("postgresql", "mysql", "mariadb")) else {}


def _check_sqlite_file(path: Path, shown: str, field: str) -> None:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as e:
        raise ArchsearchError(field, f"{shown!r}: {str(path)!r} is not a usable SQLite database ({e})",
                              "give a new file, or the optuna.db of a study") from None


def make_storage(url: str):
    """An Optuna storage from a URL: ``*.log`` / ``journal:PATH`` -> journal file, else RDB."""
    import optuna

    if url.startswith("journal:") or url.endswith(".log"):
        from optuna.storages.journal import JournalFileBackend

        path = journal_path(url)
        if not path.parent.is_dir():  # checked at load too: a typo must not create folders
            raise ArchsearchError("optuna.storage", f"the folder {str(path.parent)!r} does not exist",
                                  "create it first, or give a file in an existing folder")
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:"):
        # one host: stale trials are recovered by process id (see recover_stale_trials)
        return _sqlite_storage(url)
    # a cluster database: workers on other hosts are watched by their heartbeat (watch_peers);
    # Optuna's own heartbeat is left off: one mechanism fails a dead worker's trial and retries it
    return optuna.storages.RDBStorage(url)


def _sqlite_storage(url: str):
    """An RDB storage on SQLite whose every transaction begins ``BEGIN IMMEDIATE``.

    Optuna hands a waiting (enqueued) trial to a worker by reading it as WAITING and then
    writing RUNNING, relying on ``SELECT ... FOR UPDATE``; SQLite ignores ``FOR UPDATE`` and
    Python's sqlite3 driver opens its transaction only at the write, so two workers can both read
    WAITING and both run the same trial: the second to finish fails with "Cannot tell a COMPLETE
    trial" (optuna/optuna#4002; a seeded study with two workers hit it in CI). Taking SQLite's
    write lock when each transaction begins makes the read and the write one step; the busy
    timeout (60 s) makes a second worker wait its turn instead of failing."""
    import optuna
    from sqlalchemy import event

    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    # SQLAlchemy's recipe for pysqlite: the driver emits no BEGIN of its own, the engine emits
    # ours; the connections Optuna opened while creating the tables are dropped. Each process
    # opens its own storage (make_storage); a storage pickled to another process would get a
    # new engine without these listeners.
    event.listen(storage.engine, "connect", _driver_emits_no_begin)
    event.listen(storage.engine, "begin", _begin_immediate)
    storage.engine.dispose()
    return storage


def _driver_emits_no_begin(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None


def _begin_immediate(conn) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def open_storage(url: str, lock_dir: Path):
    """``make_storage`` under a file lock: two workers opening a new SQLite file at once
    otherwise race on Optuna's schema creation (UNIQUE constraint on alembic_version).
    Workers on other hosts share no lock: create the study once before starting them."""
    with file_lock(Path(lock_dir) / ".storage.lock"):
        return make_storage(url)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# a running trial's worker writes a heartbeat this often; one on another host silent for
# HEARTBEAT_GRACE_S is taken for dead (on this host the worker's process id says at once). A
# working worker checks its peers every WATCH_S: a dead peer's trial is taken over within
# HEARTBEAT_GRACE_S + WATCH_S (22 s) on another host, WATCH_S on this one.
HEARTBEAT_S = 5.0


HEARTBEAT_GRACE_S = 20.0


WATCH_S = 2.0


@contextlib.contextmanager
def _every(every_s: float, tick, name: str, at_once: bool) -> Iterator[None]:
    """Call ``tick()`` every ``every_s`` seconds in a daemon thread while the block runs (once at the
    start too where ``at_once``); ``tick`` returning False ends the thread early."""
    stop = threading.Event()

    def loop() -> None:
        if at_once and tick() is False:
            return
        while not stop.wait(every_s):
            if tick() is False:
                return

    th = threading.Thread(target=loop, name=name, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def heartbeat(trial, every_s: float = HEARTBEAT_S):
    """Write the time into the trial's system attribute ``heartbeat`` every ``every_s`` seconds
    while the trial runs, so a worker on another host can tell this one died."""
    storage, tid = trial.storage, trial._trial_id

    def beat() -> bool:
        try:
            storage.set_trial_system_attr(tid, "heartbeat", time.time())
        except Exception:  # noqa: BLE001 - the trial just finished (or its storage closed): nothing to beat for
            return False
        return True

    return _every(every_s, beat, "archsearch-heartbeat", at_once=True)


DIED = "its worker process died; parameters enqueued again"


def recover_stale_trials(study, storage, grace_s: float = 10.0,
                         heartbeat_grace_s: float = HEARTBEAT_GRACE_S, wait: bool = True) -> list[int]:
    """Fail trials left RUNNING by a dead worker and enqueue their parameters (user attribute
    ``retry_of``): on this host a worker whose process is gone, on another host one whose
    heartbeat has been silent for ``heartbeat_grace_s`` seconds. Several workers may judge the
    same trial at once: the one whose FAIL lands enqueues it, the others skip it.

    A worker names itself on a trial in the objective's first line; a trial with no worker is a
    live worker's only for the instant between Optuna creating it and that line, so one still
    without a worker ``grace_s`` after it started belongs to a process killed in that instant
    (``wait``: sleep until the youngest such trial is that old; else judge it at a later call)."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    def running():
        return study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def age(t) -> float:
        return time.time() - t.datetime_start.timestamp() if t.datetime_start else grace_s

    youngest = min((age(t) for t in running() if not t.user_attrs.get("worker")), default=grace_s)
    if wait and youngest < grace_s:
        time.sleep(grace_s - youngest)
    recovered = []
    for t in running():
        w = t.user_attrs.get("worker") or {}
        dead = w.get("host") == platform.node() and w.get("pid") and not _pid_alive(int(w["pid"]))
        beat = t.system_attrs.get("heartbeat")
        if w and w.get("host") != platform.node() and beat is not None and time.time() - float(beat) > heartbeat_grace_s:
            dead = True
        if dead or (not w and age(t) >= grace_s):
            try:
                storage.set_trial_user_attr(t._trial_id, "failure_reason", DIED)
                storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue  # another worker judged it first (or it finished meanwhile)
            if t.params:
                study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            recovered.append(t.number)
    return recovered


def pending_retries(study) -> list:
    """Enqueued trials that retry another (a dead worker's, or a failed measurement's): each is
    measured even once the study has its ``optuna.n_shapes`` shapes."""
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)) if "retry_of" in t.user_attrs]


def watch_peers(study, storage, on_recovered, every_s: float = WATCH_S):
    """While this worker runs trials: every ``every_s`` seconds, fail the running trials of dead
    peers and enqueue their parameters (``recover_stale_trials``), so this worker takes them
    over at its next trial rather than after its own; ``on_recovered(numbers)`` says so."""

    def watch() -> None:
        try:
            if taken := recover_stale_trials(study, storage, wait=False):
                on_recovered(taken)
        except Exception as e:  # noqa: BLE001 - a busy database: judged again at the next check
            log(f"checking the other workers' trials failed ({type(e).__name__}: {e}); checking again "
                f"in {every_s:g} s")

    return _every(every_s, watch, "archsearch-watch-peers", at_once=False)

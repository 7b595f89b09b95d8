"""Stopping cleanly and keeping secrets: a closed pipe, SIGTERM in forked children, a search space
with no shape left, a run folder of other settings, and a storage password never written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SECRET = "hunter2-s3cret"


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_a_closed_pipe_ends_quietly(json_flag):
    """`archsearch ... --json | head -c 10`: the reader is gone before the write; exit 141 (or 0),
    as a POSIX tool killed by SIGPIPE, and nothing on stderr."""
    p = subprocess.Popen([sys.executable, "-m", "archsearch", "arch", "list", *json_flag], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader goes away at once
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) in (0, 141), err
    assert err == "", err


def test_sigterm_raises_in_the_main_process_only():
    """The CLI turns SIGTERM into an exception that unwinds the main process; a forked child (lm-eval's
    and the datasets' worker pools) inherits the handler but dies of the signal as usual, with no
    traceback (before, it raised Terminated inside the pool worker)."""
    from archsearch.cli import Terminated, _terminate_like_interrupt

    old = signal.getsignal(signal.SIGTERM)
    try:
        _terminate_like_interrupt()
        pid = os.fork()
        if pid == 0:  # the child: the signal must kill it, not raise
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_main_in_process_gives_the_callers_sigterm_handler_back():
    """A caller that runs ``main()`` in-process (a test runner, a notebook) keeps its own SIGTERM
    handler afterwards: before, the CLI's handler stayed, and a later SIGTERM to pytest raised inside
    whatever test was running instead of stopping it."""
    from archsearch.cli import main

    def mine(signum, frame):  # pragma: no cover - only compared, never called
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["arch", "list", "--json"]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
        assert main(["arch", "describe", "--preset", "no-such-preset"]) == 2  # an error path too
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_search_stops_once_the_box_has_no_new_shape():
    """A sampler that can only propose three shapes: the study stops after the patience, not at
    optuna.n_trials, and records why."""
    import optuna

    from archsearch.search.callbacks import ExhaustedSpaceCallback

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))

    def objective(t):
        t.set_user_attr("spec_key", str(t.suggest_int("k", 0, 2)))
        return 1.0

    cb = ExhaustedSpaceCallback(study, n_shapes=10)
    study.optimize(objective, n_trials=1000, callbacks=[cb])
    n = len(study.trials)
    assert 100 <= n < 200, n  # three shapes seen, then 100 trials without a new one
    assert study.user_attrs["space_exhausted"]["distinct_shapes"] == 3


def test_the_box_bound_covers_every_shape_the_builder_gives():
    """box_shape_bound is an upper bound on the distinct shapes a dense grid of knobs builds, and
    close to it (it counts the builder's floor/ceil choices that meet the budget)."""
    import numpy as np

    from archsearch.candidates import BuildSettings, box_shape_bound, build_candidate
    from archsearch.errors import ArchsearchError

    b = BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.15, on_r_drift="flag")
    for params, layers in ((2e5, 2), (1e6, 4), (5e7, 8)):
        seen = set()
        for x1 in np.linspace(0.1, 0.4, 60):
            for r in np.geomspace(0.5, 5.0, 60):
                for g in (1, 2):
                    try:
                        seen.add(build_candidate(params, layers, float(x1), float(r), g, 32, b).spec)
                    except ArchsearchError:
                        pass
        bound = box_shape_bound(params, layers, (0.1, 0.4), (0.5, 5.0), [1, 2], 32, b)
        assert len(seen) <= bound <= 1.3 * len(seen) + 5, (params, len(seen), bound)


def test_a_run_folder_of_other_settings_is_refused(tmp_path):
    """A finished run is returned as is only for the same architecture, budget and seed; another one
    is refused, and `train --overwrite` deletes it and starts anew."""
    from archsearch.arch import ArchSpec
    from archsearch.cli.train import _clear_run_folder
    from archsearch.errors import ArchsearchError
    from archsearch.trainers.config import TrainConfig
    from archsearch.trainers.loop import check_run_folder

    spec = ArchSpec(n_layers=2, hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab_size=2048)
    tc = TrainConfig(tokens=20000, global_batch_size=8)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"status": "ok", "spec": spec.to_dict(), "tokens_target": 20000.0,
                                              "seed": tc.seed, "init_from": None}))
    check_run_folder(out, spec, tc)  # the same run: returned as it is
    with pytest.raises(ArchsearchError, match="hidden_size") as e:
        check_run_folder(out, spec.replace(hidden_size=256, head_dim=64), tc, "--out")
    assert e.value.field == "--out" and "--overwrite" in e.value.fix
    with pytest.raises(ArchsearchError, match="token budget"):
        check_run_folder(out, spec, TrainConfig(tokens=40000, global_batch_size=8))
    _clear_run_folder(out, spec, tc, None)  # same settings: kept
    assert (out / "run.json").is_file()
    _clear_run_folder(out, spec.replace(ffn=512), tc, None)
    assert not out.exists()


def test_a_storage_password_is_never_written_or_printed(tmp_path, monkeypatch, capsys):
    """A study on a database with a password, given as an override: the URL is used to connect
    (here mapped onto a local SQLite file, as no server runs in CI) and masked everywhere the
    project writes or prints: config.json, summary.json, report.md, state.json, measurements,
    every provenance's command, stdout and stderr."""
    import yaml

    from archsearch.cli import main
    from archsearch.search import checks, storage

    sys.path.insert(0, str(REPO / "tests"))
    from test_search import study_config

    cfg = study_config(tmp_path, optuna={"n_shapes": 1, "enqueue_solution": 1})
    url = f"postgresql+psycopg://u:{SECRET}@db.example:5432/studies"
    real_make = storage.make_storage
    opened = []

    def make_storage(u):
        opened.append(u)
        return real_make(f"sqlite:///{tmp_path / 'stand-in.db'}")

    monkeypatch.setattr(checks, "check_storage", lambda u, field="optuna.storage": opened.append(u))
    monkeypatch.setattr(storage, "make_storage", make_storage)
    argv = ["search", "--config", cfg["_path"], f"optuna.storage={url}"]
    monkeypatch.setattr(sys, "argv", ["archsearch", *argv])
    assert main(argv) == 0
    assert opened and all(u == url for u in opened)  # the real URL reaches the driver
    io = capsys.readouterr()
    assert SECRET not in io.out + io.err
    out = Path(cfg["out"])
    written = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".md", ".csv", ".yaml")]
    assert {"config.json", "summary.json", "report.md", "state.json", "measurements.jsonl"} <= {p.name for p in written}
    for p in written:
        assert SECRET not in p.read_text(errors="replace"), p
    assert "u:***@db.example" in (out / "config.json").read_text()
    assert yaml.safe_load((out / "config.json").read_text())["optuna"]["storage"].startswith("postgresql+psycopg://u:***@")


def test_an_error_or_traceback_masks_a_url_password(capsys):
    from archsearch.configio import redact
    from archsearch.errors import ArchsearchError

    e = ArchsearchError("optuna.storage", f"cannot connect to mysql://root:{SECRET}@h/db", None)
    assert SECRET not in str(e) and "mysql://root:***@h/db" in str(e)
    assert redact(f"a postgresql://u:{SECRET}@h:1/x and sqlite:///p.db") == "a postgresql://u:***@h:1/x and sqlite:///p.db"

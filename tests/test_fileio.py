"""archsearch.fileio: atomic writes keep the old content on failure; torn last lines are skipped."""

from __future__ import annotations

import json

import pytest

from archsearch.errors import ArchsearchError
from archsearch.fileio import (append_line, atomic_open, atomic_write, check_output,
                               read_jsonl_lines, read_table, truncate_jsonl, write_table)


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "a.json"
    atomic_write(p, "old\n")
    atomic_write(p, "new\n")
    assert p.read_text() == "new\n"
    assert [f.name for f in tmp_path.iterdir()] == ["a.json"]


def test_failed_write_keeps_old_content(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_open(p) as fh:
            fh.write("half of the new")
            raise RuntimeError("killed mid-write")
    assert p.read_text() == "old\n"
    assert [f.name for f in tmp_path.iterdir()] == ["a.txt"]


def test_write_table_round_trips_with_the_union_of_columns(tmp_path):
    p = write_table(tmp_path / "t.csv", [{"b": 1, "a": None}, {"c": "x", "b": 2.5}], first=("a", "z"))
    assert p.read_text().splitlines()[0] == "a,z,b,c"  # first, then the keys in order of appearance
    assert read_table(p, "t") == [{"a": "", "z": "", "b": "1", "c": ""}, {"a": "", "z": "", "b": "2.5", "c": "x"}]


def test_torn_last_line_skipped_and_healed(tmp_path, capsys):
    p = tmp_path / "log.jsonl"
    append_line(p, json.dumps({"key": 1}))
    with p.open("a") as fh:
        fh.write('{"key": 2, "resu')  # a write cut by kill -9
    assert read_jsonl_lines(p) == [{"key": 1}]
    assert "torn last line" in capsys.readouterr().err
    append_line(p, json.dumps({"key": 3}))  # the next append cuts the torn tail first
    assert read_jsonl_lines(p) == [{"key": 1}, {"key": 3}]
    assert p.read_text().count("\n") == 2


def test_file_warnings_are_log_records_a_study_log_keeps(tmp_path, capsys):
    """The torn-line and unreadable-state messages go through the project's logger: on the
    console as written, and into a running study's ``study.log``."""
    from archsearch.fileio import read_json_tolerant
    from archsearch.logs import study_log

    p = tmp_path / "log.jsonl"
    p.write_text('{"key": 1}\n{"key": 2, "resu')
    (tmp_path / "state.json").write_text('{"done": ')
    with study_log(tmp_path) as log:
        assert read_jsonl_lines(p) == [{"key": 1}]
        assert read_json_tolerant(tmp_path / "state.json", "the stage record") is None
    err = capsys.readouterr().err
    assert f"archsearch: {p}: skipped a torn last line 2" in err and "is not valid JSON" in err
    text = log.read_text()
    assert "WARNING archsearch.files: archsearch: " in text and "skipped a torn last line 2" in text
    assert "the stage record is treated as absent and redone" in text


def test_truncate_jsonl_drops_rejected_and_torn_lines(tmp_path):
    """A resumed training run cuts its metrics log back to its checkpoint's step."""
    p = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3):
        append_line(p, json.dumps({"step": step}))
    with p.open("a") as fh:
        fh.write('{"step": 4, "lo')  # killed mid-append
    truncate_jsonl(p, lambda rec: rec["step"] <= 2)
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    truncate_jsonl(tmp_path / "missing.jsonl", lambda rec: True)
    assert not (tmp_path / "missing.jsonl").exists()


def test_broken_middle_line_is_an_error(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text('{"a": 1}\n{broken\n{"a": 2}\n')
    with pytest.raises(ArchsearchError, match="line 2"):
        read_jsonl_lines(p)


def test_check_output_kinds(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(ArchsearchError, match="is a folder"):
        check_output("--out", tmp_path / "d")
    with pytest.raises(ArchsearchError, match="is a file"):
        check_output("--out", tmp_path / "f", "dir")
    with pytest.raises(ArchsearchError, match="cannot be made"):
        check_output("--out", tmp_path / "f" / "x.json")
    check_output("--out", tmp_path / "new" / "x.json")
    check_output("--out", tmp_path / "d", "dir")


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_are_written_with_the_users_umask(tmp_path, umask, mode):
    """What the project writes is readable as a plain open() would make it (0666 less the umask),
    not mkstemp's private 0600, and still replaced in one rename."""
    import os
    import stat

    old = os.umask(umask)
    try:
        p = tmp_path / "report.md"
        atomic_write(p, "old\n")
        atomic_write(p, "new\n")
        write_table(tmp_path / "t.csv", [{"a": 1}])
    finally:
        os.umask(old)
    for f in (p, tmp_path / "t.csv"):
        assert stat.S_IMODE(f.stat().st_mode) == mode, (f, oct(f.stat().st_mode))
    assert p.read_text() == "new\n" and sorted(f.name for f in tmp_path.iterdir()) == ["report.md", "t.csv"]


@pytest.mark.parametrize("data,kind", [(b"\xff\xfea\x00b\x00", "UTF-16"), (b"\x89PNG\x00\x01", "binary"),
                                       (b"caf\xe9\n", "not UTF-8")])
def test_read_text_refuses_what_is_not_utf8_text(tmp_path, data, kind):
    from archsearch.fileio import read_text

    p = tmp_path / "f.yaml"
    p.write_bytes(data)
    with pytest.raises(ArchsearchError, match=kind) as e:
        read_text(p, "--config")
    assert e.value.field == "--config" and "UTF-8" in e.value.fix
    p.write_bytes(b"\xef\xbb\xbfname: x\n")  # a UTF-8 byte-order mark is UTF-8
    assert read_text(p) == "name: x\n"


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "/abs", " pad", "tab\there"])
def test_a_name_cannot_be_a_path(name):
    from archsearch.fileio import check_name

    with pytest.raises(ArchsearchError) as e:
        check_name("sweep.name", name)
    assert e.value.field == "sweep.name"
    assert check_name("sweep.name", "my-sweep_2.b") == "my-sweep_2.b"


def test_file_lock_excludes_other_processes_and_dies_with_its_holder(tmp_path):
    """The study's lock (search.measure.file_lock) and the active plan's claims are ``flock``s:
    another process (or another lock object in this one) cannot take them while they are held,
    and a killed holder's lock is free again, its file left in place."""
    import subprocess
    import sys

    from filelock import FileLock, Timeout

    from archsearch.search.measurements import file_lock

    path = tmp_path / "sub" / "x.lock"
    with file_lock(path):
        assert path.is_file()
        with pytest.raises(Timeout):
            FileLock(path, timeout=0).acquire()
    hold = (f"import time\nfrom pathlib import Path\nfrom archsearch.search.measurements import file_lock\n"
            f"with file_lock(Path({str(path)!r})):\n    print('held', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(Timeout):
            FileLock(path, timeout=0).acquire()
    finally:
        holder.kill()
        holder.wait()
    with FileLock(path, timeout=0):
        assert path.is_file()

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

"""Every example in the commands' ``--help`` runs: each subcommand's ``examples:`` lines are
run from a folder that sees the repository's configs/ and results/, except the lines marked
``# slow:`` (they train, measure or evaluate), which are only parsed."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from archsearch.cli import build_parser, main, subcommands
from archsearch.cli._examples import OVERRIDE_EXAMPLES, SLOW

REPO = Path(__file__).resolve().parent.parent


def _examples() -> list[tuple[str, str]]:
    out = []
    for name, p in subcommands(build_parser()):
        for line in (p.epilog or "").splitlines()[1:]:
            out.append((name, line.strip()))
    return out


EXAMPLES = _examples()


def test_every_command_shows_examples_in_its_help():
    parser = build_parser()
    for name, p in subcommands(parser):
        if p.get_default("func") is None:  # a group ("arch"): its subcommands carry the examples
            continue
        lines = [line for n, line in EXAMPLES if n == name]
        assert lines, f"'archsearch {name} --help' shows no example"
        help_text = p.format_help()
        assert all(line in help_text for line in lines)  # shown as written, not re-wrapped
        for line in lines:
            argv = shlex.split(line, comments=True)
            assert argv[0] == "archsearch" and " ".join(argv[1:]).startswith(name)
            p.parse_args(argv[1 + len(name.split()):])  # every example parses, slow ones included
    for command, overrides in OVERRIDE_EXAMPLES.items():
        assert any(n == command and overrides in line and "--print-config" in line for n, line in EXAMPLES), \
            f"the overrides example of {command!r} is not run with --print-config"


@pytest.mark.parametrize("name, line", [e for e in EXAMPLES if SLOW not in e[1]],
                         ids=[e[1][len("archsearch "):60] for e in EXAMPLES if SLOW not in e[1]])
def test_help_example_runs(name, line, tmp_path, monkeypatch, capsys):
    for folder in ("configs", "results"):
        (tmp_path / folder).symlink_to(REPO / folder)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(line, comments=True)[1:]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, f"{line}\n{captured.err[-2000:]}"
    assert "Traceback" not in captured.err
    assert captured.out.strip()  # it answered something

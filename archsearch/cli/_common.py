"""Helpers shared by the subcommand modules (argument groups, output)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from archsearch.arch import FAMILIES, ArchSpec
from archsearch.candidates import BuildSettings
from archsearch.cli._examples import OVERRIDE_EXAMPLES
from archsearch.configio import number_from_text, to_yaml
from archsearch.errors import ArchsearchError
from archsearch.fileio import check_output
from archsearch.presets import load_arch

# Where print_json writes while a --json command runs (see json_stdout); None: sys.stdout.
_json_out: Any = None


def parse_number(text: str) -> float:
    """'1e9', '1B', '150M', '300k' -> a positive finite float (an argparse ``type``)."""
    try:
        v = number_from_text(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 1e9, 1B, 150M)") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive finite number (e.g. 1e9, 1B, 150M)")
    return v


def _bounded(kind, lo=None, hi=None, lo_open=False, what=""):
    """An argparse ``type``: ``kind`` (int or float), finite, within [lo, hi] (lo open if asked)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        ok = math.isfinite(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or v <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return v
    parse.__name__ = what or kind.__name__
    return parse


pos_int = _bounded(int, 1, what="a positive integer")
nonneg_int = _bounded(int, 0, what="an integer >= 0")
pos_float = _bounded(float, 0, lo_open=True, what="a positive finite number")
nonneg_float = _bounded(float, 0, what="a finite number >= 0")
finite_float = _bounded(float, what="a finite number")
fraction = _bounded(float, 0, 1, lo_open=True, what="a number in (0, 1]")
port = _bounded(int, 1, 65535, what="a port number in 1..65535")
learning_rate = _bounded(float, 0, 10, lo_open=True, what="a learning rate in (0, 10]")


def level(text: str) -> float:
    """An interval level in (0, 1) (an argparse ``type``)."""
    v = finite_float(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1), e.g. 0.9")
    return v


def _checked_output(text: str, kind: str) -> str:
    """``text`` through the one output check (:func:`archsearch.fileio.check_output`), as argparse
    reports a bad value."""
    try:
        check_output("path", text, kind)
    except ArchsearchError as e:
        raise argparse.ArgumentTypeError(f"{text[:60]!r}{'...' if len(text) > 60 else ''}: {e.problem}"
                                         + (f" ({e.fix})" if e.fix else "")) from None
    return text


def out_file(text: str) -> str:
    """A file to write (an argparse ``type``): a valid path, not an existing folder, device, pipe
    or link to nothing, nor under a file (:func:`archsearch.fileio.check_output`)."""
    return _checked_output(text, "file")


def out_dir(text: str) -> str:
    """A folder to write into (an argparse ``type``): a valid path, not an existing file or link
    to nothing, nor under a file (:func:`archsearch.fileio.check_output`)."""
    return _checked_output(text, "dir")


def parse_float_list(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0], each positive and finite (an argparse ``type``)."""
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not vals or any(not (math.isfinite(v) and v > 0) for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 0.5,1,2")
    return vals


def parse_int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32] (an argparse ``type``)."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return vals


def add_arch_args(p: argparse.ArgumentParser) -> None:
    """The architecture flags of ``arch describe``: a preset, a config dir, or the fields."""
    g = p.add_argument_group("architecture (a preset, a config folder, or the fields)")
    g.add_argument("--preset", help="a named preset (archsearch arch list)")
    g.add_argument("--arch", dest="arch_file", metavar="PATH",
                   help="a folder with config.json, an HF config.json, or an architecture JSON")
    g.add_argument("--layers", type=pos_int, dest="n_layers")
    g.add_argument("--hidden-size", type=pos_int)
    g.add_argument("--heads", type=pos_int, dest="n_heads")
    g.add_argument("--kv-heads", type=pos_int, dest="n_kv_heads", help="default: --heads (no GQA)")
    g.add_argument("--head-dim", type=pos_int, help="default: hidden_size / heads")
    g.add_argument("--ffn", type=pos_int, help="SwiGLU intermediate size")
    g.add_argument("--vocab-size", type=pos_int, default=None)
    g.add_argument("--tie-embeddings", action="store_true", default=None)
    g.add_argument("--family", choices=sorted(FAMILIES), default=None)


def add_build_args(p: argparse.ArgumentParser) -> None:
    """Flags of :class:`archsearch.candidates.BuildSettings` (defaults from the dataclass)."""
    d = BuildSettings()
    p.add_argument("--vocab-size", type=pos_int, default=d.vocab_size)
    p.add_argument("--hidden-multiple", type=pos_int, default=d.hidden_multiple)
    p.add_argument("--ffn-multiple", type=pos_int, default=d.ffn_multiple)
    p.add_argument("--tolerance", type=fraction, default=d.tolerance,
                   help=f"max relative distance of the realised N from the budget (default {d.tolerance})")
    p.add_argument("--r-tolerance", type=pos_float, default=d.r_tolerance,
                   help=f"max relative drift of the realised r from the requested one (default {d.r_tolerance})")
    p.add_argument("--on-r-drift", choices=["refuse", "flag"], default=d.on_r_drift,
                   help="beyond --r-tolerance: refuse the shape, or build it with a warning")


def build_settings_from_args(args: argparse.Namespace, **kw: Any):
    return BuildSettings(hidden_multiple=args.hidden_multiple, ffn_multiple=args.ffn_multiple,
                         tolerance=args.tolerance, r_tolerance=args.r_tolerance,
                         on_r_drift=args.on_r_drift, vocab_size=args.vocab_size, **kw)


def arch_from_args(args: argparse.Namespace):
    """Build the ArchSpec named by :func:`add_arch_args` flags; clear error when incomplete."""
    fields = ("n_layers", "hidden_size", "n_heads", "ffn")
    given = [f for f in fields if getattr(args, f, None) is not None]
    sources = [s for s in (args.preset, getattr(args, "arch_file", None)) if s]
    if len(sources) + bool(given) > 1:
        raise ArchsearchError("--preset/--arch/--layers...", "give only one way of naming the architecture")
    if args.preset or getattr(args, "arch_file", None):
        spec = load_arch(args.preset or args.arch_file)
        overrides = {k: getattr(args, k) for k in ("vocab_size", "tie_embeddings", "family")
                     if getattr(args, k, None) is not None}
        return spec.replace(**overrides) if overrides else spec
    if not given:
        raise ArchsearchError("architecture", "not given",
                              "use --preset NAME, --arch PATH, or --layers --hidden-size --heads --ffn")
    missing = [f for f in fields if getattr(args, f, None) is None]
    if missing:
        flag = {"n_layers": "--layers", "hidden_size": "--hidden-size", "n_heads": "--heads",
                "ffn": "--ffn"}
        raise ArchsearchError(flag[missing[0]], "is required when the fields are given as flags")
    if args.n_heads <= 0:
        raise ArchsearchError("n_heads", f"must be positive, got {args.n_heads}")
    head_dim = args.head_dim or args.hidden_size // args.n_heads
    kw = dict(n_layers=args.n_layers, hidden_size=args.hidden_size, n_heads=args.n_heads,
              n_kv_heads=args.n_kv_heads or args.n_heads, head_dim=head_dim, ffn=args.ffn)
    for k in ("vocab_size", "tie_embeddings", "family"):
        if getattr(args, k, None) is not None:
            kw[k] = getattr(args, k)
    return ArchSpec(**kw)


def add_overrides_arg(p: argparse.ArgumentParser) -> None:
    """Positional ``key.sub=value`` overrides of the ``--config`` file (OmegaConf dotlist syntax),
    with an example of the command's own config (``_examples.OVERRIDE_EXAMPLES``)."""
    command = p.prog.split()[-1]
    p.add_argument("overrides", nargs="*", metavar="KEY.SUB=VALUE",
                   help=f"override config fields, e.g. {OVERRIDE_EXAMPLES[command]}")


def add_print_config_arg(p: argparse.ArgumentParser) -> None:
    """``--print-config``: show the resolved config and stop (see :func:`print_config`)."""
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (file + overrides + defaults) as YAML and exit; "
                        "runs nothing, writes nothing (passwords in URLs masked)")


def print_config(cfg: Any) -> None:
    """A validated config (a dataclass, or a mapping of them) as YAML on stdout, secrets masked:
    what the command would run with; the output is itself a valid ``--config`` file."""
    sys.stdout.write(to_yaml(cfg))


@contextlib.contextmanager
def json_stdout(enabled: bool) -> Iterator[None]:
    """With ``--json``, stdout carries exactly the one JSON document: everything else printed
    meanwhile (lm-eval's progress, vLLM's engine processes, which inherit file descriptor 1)
    goes to stderr, at the descriptor level, and :func:`print_json` writes to the real stdout."""
    global _json_out
    if not enabled:
        yield
        return
    real = sys.stdout
    real.flush()
    try:
        real_fd = real.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # e.g. a test's capture object
        real_fd = None
    saved = os.dup(1)
    os.dup2(2, 1)
    _json_out = open(saved, "w", closefd=False) if real_fd == 1 else real
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = real
        _json_out.flush()
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)
        _json_out = None


def print_json(obj: Any) -> None:
    out = _json_out or sys.stdout
    json.dump(obj, out, indent=2, default=str)
    out.write("\n")


def print_table(rows: list[tuple[str, Any]], title: str | None = None) -> None:
    """Two-column key/value table for humans."""
    if title:
        print(title)
    width = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        if isinstance(v, float):
            v = f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        elif isinstance(v, int) and not isinstance(v, bool):
            v = f"{v:,}"
        print(f"  {k:<{width}}  {v}")


def add_group(sub, name: str, help: str) -> argparse._SubParsersAction:
    """A command group (``archsearch NAME SUBCOMMAND``) whose bare use prints its help."""
    p = sub.add_parser(name, help=help, description=help)
    p.set_defaults(func=None, _group_parser=p)
    return p.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND", parser_class=type(p))

"""Helpers shared by the subcommand modules (argument groups, output)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any


def parse_number(text: str) -> float:
    """'1e9', '1B', '150M', '300k' -> float (an argparse ``type``)."""
    t = text.strip().replace("_", "")
    mult = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:].lower())
    try:
        v = float(t[:-1]) * mult if mult else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 1e9, 1B, 150M)") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number (e.g. 1e9, 1B, 150M)")
    return v


def finite_float(text: str) -> float:
    """A float that is neither NaN nor infinite (the ``type`` of every float flag)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1 (an argparse ``type``)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return v


def parse_int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32] (an argparse ``type``)."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    return vals


def add_arch_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    """The architecture flags of ``arch describe``: a preset, a config dir, or the fields."""
    g = p.add_argument_group("architecture (a preset, a config folder, or the fields)")
    g.add_argument("--preset", help="a named preset (archsearch arch list)")
    g.add_argument("--arch", dest="arch_file", metavar="PATH",
                   help="a folder with config.json, an HF config.json, or an architecture JSON")
    g.add_argument("--layers", type=positive_int, dest="n_layers")
    g.add_argument("--hidden-size", type=positive_int)
    g.add_argument("--heads", type=positive_int, dest="n_heads")
    g.add_argument("--kv-heads", type=positive_int, dest="n_kv_heads", help="default: --heads (no GQA)")
    g.add_argument("--head-dim", type=positive_int, help="default: hidden_size / heads")
    g.add_argument("--ffn", type=positive_int, help="SwiGLU intermediate size")
    g.add_argument("--vocab-size", type=positive_int, default=None)
    g.add_argument("--tie-embeddings", action="store_true", default=None)
    g.add_argument("--family", choices=["llama", "qwen2", "qwen3", "olmo2"], default=None)


def arch_from_args(args: argparse.Namespace):
    """Build the ArchSpec named by :func:`add_arch_args` flags; clear error when incomplete."""
    from archsearch.arch import ArchSpec, load_arch
    from archsearch.errors import ArchsearchError

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


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


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

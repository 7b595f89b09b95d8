"""``archsearch arch {describe,build,list}``: the architecture spec and its accounting."""

from __future__ import annotations

import argparse

from archsearch.arch import FAMILIES, describe, write_hf_config
from archsearch.candidates import build_candidate
from archsearch.cli._common import (add_arch_args, add_build_args, add_group, arch_from_args,
                                    build_settings_from_args, parse_number,
                                    print_json, print_table)
from archsearch.cli._common import out_dir, pos_float, pos_int
from archsearch.presets import PRESETS


def register(sub) -> None:
    g = add_group(sub, "arch", "describe, build and list decoder architectures")

    p = g.add_parser("describe", help="parameter counts, ratios, KV bytes and FLOPs of a shape",
                     description="Print the accounting of one architecture (docs/method.md section 2).")
    add_arch_args(p)
    p.add_argument("--dtype", default="bfloat16", help="KV-cache dtype for the byte count")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--out", type=out_dir, metavar="DIR", help="also write DIR/config.json (HF format)")
    p.set_defaults(func=_describe)

    p = g.add_parser("build", help="build a concrete shape from a parameter budget and ratios",
                     description="Expand (N, layers, d/sqrt(N), r, GQA, head_dim) into a "
                                 "buildable spec, sizes snapped to multiples.")
    p.add_argument("--params", type=parse_number, required=True,
                   help="non-embedding parameter budget N (e.g. 1e9, 1B, 150M)")
    p.add_argument("--layers", type=pos_int, required=True)
    p.add_argument("--hidden-over-sqrt-n", type=pos_float, required=True, help="d / sqrt(N)")
    p.add_argument("--mlp-to-attn", type=pos_float, required=True, help="r = MLP / attention params")
    p.add_argument("--gqa", type=pos_int, default=4, help="query heads per KV head (default 4)")
    p.add_argument("--head-dim", type=pos_int, default=64)
    p.add_argument("--tie-embeddings", action="store_true")
    add_build_args(p)
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                   help="model family (llama shapes whose heads do not divide the width are "
                        "exported as Mistral, the same math)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=out_dir, metavar="DIR", help="write DIR/config.json (HF format)")
    p.set_defaults(func=_build)

    p = g.add_parser("list", help="list the named reference architectures")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_list)


def _describe(args: argparse.Namespace) -> int:
    spec = arch_from_args(args)
    d = describe(spec, args.dtype)
    if args.out:
        d["config_json"] = str(write_hf_config(spec, args.out))
    if args.json:
        print_json(d)
    else:
        print_table(list(d.items()), title=f"architecture {d.get('name', '')}".rstrip())
    return 0


def _build(args: argparse.Namespace) -> int:
    settings = build_settings_from_args(args, tie_embeddings=args.tie_embeddings, family=args.family)
    cand = build_candidate(args.params, args.layers, args.hidden_over_sqrt_n, args.mlp_to_attn,
                           gqa=args.gqa, head_dim=args.head_dim, settings=settings)
    d = cand.to_dict()
    if args.out:
        d["config_json"] = str(write_hf_config(cand.spec, args.out))
    if args.json:
        print_json(d)
    else:
        rows = [(k, v) for k, v in d.items() if k not in ("requested", "realised")]
        print_table(rows, title="built architecture")
        print("  requested vs realised:")
        for k, v in cand.requested.items():
            if k in cand.realised:
                print(f"    {k:<20} {v:>14,.4g}  ->  {cand.realised[k]:,.4g}")
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = []
    for name, p in PRESETS.items():
        d = describe(p.spec)
        rows.append({"name": name, "n_params_total": d["n_params_total"],
                     "n_params_non_embedding": d["n_params_non_embedding"],
                     "n_layers": p.spec.n_layers, "hidden_size": p.spec.hidden_size,
                     "n_heads": p.spec.n_heads, "n_kv_heads": p.spec.n_kv_heads,
                     "head_dim": p.spec.head_dim, "ffn": p.spec.ffn,
                     "mlp_to_attn_ratio": round(d["mlp_to_attn_ratio"], 3),
                     "hidden_over_sqrt_n": round(d["hidden_over_sqrt_n"], 4),
                     "source": p.source})
    if args.json:
        print_json(rows)
        return 0
    hdr = f"{'name':<14} {'total':>14} {'non-embed':>14} {'L':>3} {'d':>5} {'heads':>7} {'hd':>4} {'ffn':>6} {'r':>6} {'d/sqrtN':>8}"
    print(hdr)
    for r in rows:
        print(f"{r['name']:<14} {r['n_params_total']:>14,} {r['n_params_non_embedding']:>14,} "
              f"{r['n_layers']:>3} {r['hidden_size']:>5} {r['n_heads']:>3}/{r['n_kv_heads']:<3} "
              f"{r['head_dim']:>4} {r['ffn']:>6} {r['mlp_to_attn_ratio']:>6.2f} {r['hidden_over_sqrt_n']:>8.4f}")
    return 0

"""``archsearch fit | solve | validate``: scaling laws (docs/method.md section 3) and the constrained solve.

See docs/laws.md for the run-data and law-file formats.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from archsearch.arch import describe, write_hf_config
from archsearch.candidates import check_size
from archsearch.cli._common import (add_build_args, build_settings_from_args, parse_number, print_json,
                                    print_table)
from archsearch.cli._common import fraction, level, nonneg_int, out_dir, out_file, pos_float, pos_int
from archsearch.configio import field_defaults
from archsearch.errors import ArchsearchError
from archsearch.fileio import check_input_file, read_table, write_json, write_table
from archsearch.laws import fit_law, load_law, optimum, progressive_validation, solve
from archsearch.laws.diagnostics import DEFAULT_MAX_MARE, PROTOCOLS, validation_verdict
from archsearch.laws.fit import METHODS, REFERENCES, FitOptions, split_holdout
from archsearch.laws.registry import law_form, law_names
from archsearch.laws.plots import write_plots
from archsearch.provenance import provenance
from archsearch.rundata import ARCH_COLUMNS, read_runs



def _add_fit_options(p: argparse.ArgumentParser) -> None:
    d = field_defaults(FitOptions)  # one declaration of the defaults: the options type's
    p.add_argument("--data", required=True, metavar="RUNS", help="proxy runs (.csv or .jsonl; docs/laws.md)")
    p.add_argument("--law", required=True, choices=law_names())  # the forms registered when the parser is built
    g = p.add_argument_group("fitting")
    g.add_argument("--method", choices=METHODS, default=d["method"],
                   help="robust log-space Huber + multi-start L-BFGS-B (default), or "
                        "Levenberg-Marquardt on the loss (paper parity)")
    g.add_argument("--huber-delta", type=pos_float, default=d["huber_delta"])
    g.add_argument("--starts", type=pos_int, default=d["n_starts"], help="multi-start count (default %(default)s)")
    g.add_argument("--seed", type=nonneg_int, default=d["seed"])
    g.add_argument("--bootstrap", type=nonneg_int, default=d["bootstrap"], metavar="N",
                   help="bootstrap resamples for intervals (0 = none; 1000 is a good value)")
    g.add_argument("--jobs", type=pos_int, default=d["n_jobs"], help="processes for the bootstrap")
    g.add_argument("--r-range", type=pos_float, nargs=2, default=d["r_range"], metavar=("LOW", "HIGH"),
                   help="keep runs with r = mlp/attn params in [LOW, HIGH] (default %(default)s)")
    g.add_argument("--no-r-filter", action="store_true", help="keep every run whatever its r")
    g.add_argument("--reference", choices=REFERENCES, default=d["reference"],
                   help="L_opt of the conditional laws: a Chinchilla law fitted on the best run of "
                        "each (N, D), or those best losses as they are (predicts only at observed N, D)")
    g.add_argument("--reference-law", metavar="LAW.json",
                   help="a fitted chinchilla law file to use as L_opt instead of fitting one")
    g.add_argument("--free-exponents", action="store_true",
                   help="aspect-ratio law: fit alpha, beta, gamma separately (default: tied)")
    g.add_argument("--size-tolerance", type=fraction, default=d["size_tolerance"],
                   help="runs within this relative distance in N (and D) are one size (default %(default)s)")


def _options(args: argparse.Namespace, holdout=None):
    ref = load_law(args.reference_law) if args.reference_law else None
    try:
        return FitOptions(method=args.method, huber_delta=args.huber_delta, n_starts=args.starts,
                          seed=args.seed, bootstrap=args.bootstrap, n_jobs=args.jobs,
                          r_range=None if args.no_r_filter else tuple(args.r_range),
                          reference=args.reference, reference_law=ref,
                          tie_exponents=not args.free_exponents, holdout_size=holdout,
                          size_tolerance=args.size_tolerance)
    except ArchsearchError as e:  # the options' checks (bounds included) name the flag given
        raise ArchsearchError(_FLAGS.get(e.field, e.field), e.problem, e.fix) from None


_FLAGS = {"n_starts": "--starts", "n_jobs": "--jobs", "bootstrap": "--bootstrap", "huber_delta": "--huber-delta",
          "size_tolerance": "--size-tolerance", "r_range": "--r-range", "holdout_size": "--holdout-size",
          "reference_law": "--reference-law"}


def register(sub) -> None:
    p = sub.add_parser("fit", help="fit a scaling law to proxy runs",
                       description="Fit a scaling law (docs/method.md section 3) to proxy runs; print coefficients, "
                                   "metrics and warnings; save the law as JSON.")
    _add_fit_options(p)
    p.add_argument("--holdout-size", type=parse_number, metavar="N",
                   help="hold out the size nearest N (all its runs); metrics on it")
    p.add_argument("--out", type=out_file, required=True, metavar="LAW.json")
    p.add_argument("--plots", type=out_dir, metavar="DIR", help="write diagnostic PNGs into DIR")
    p.add_argument("--json", action="store_true", help="print the law file instead of a summary")
    p.set_defaults(func=_fit)

    p = sub.add_parser("solve", help="loss-optimal and throughput-optimal shapes from a law",
                       description="The closed-form optimum (hidden/sqrt(N)*, r*) of a conditional "
                                   "law, the buildable spec nearest to it, and, with --target-loss, "
                                   "the feasible candidates at fixed N, D and layers.")
    p.add_argument("--law", required=True, metavar="LAW.json", help="a fitted or hand-written law")
    p.add_argument("--params", type=parse_number, required=True, help="non-embedding N (e.g. 1B)")
    p.add_argument("--tokens", type=parse_number, required=True, help="training tokens D (e.g. 20B)")
    p.add_argument("--layers", type=pos_int, required=True)
    p.add_argument("--target-loss", type=pos_float, help="keep candidates whose predicted loss is <= this")
    p.add_argument("--reference-law", metavar="LAW.json", help="a chinchilla law file to use as L_opt")
    p.add_argument("--throughput", metavar="FILE",
                   help="measured throughputs (.csv/.jsonl with n_layers, hidden_size, n_heads, "
                        "n_kv_heads, head_dim, ffn, throughput): ranks the feasible candidates")
    p.add_argument("--gqa", type=pos_int, default=4)
    p.add_argument("--head-dim", type=pos_int, default=64)
    add_build_args(p)
    p.add_argument("--level", type=level, default=0.9, help="interval level (default 0.9)")
    p.add_argument("--all-points", action="store_true", help="include every scanned candidate (JSON)")
    p.add_argument("--out", type=out_dir, metavar="DIR",
                   help="write the chosen shape (with --target-loss the best feasible one, else the "
                        "loss-optimal one) into DIR: config.json (Hugging Face), spec.json and solve.json; "
                        "'archsearch train --arch DIR' trains it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_solve)

    p = sub.add_parser("validate", help="progressive and leave-one-size-out validation of a law",
                       description="Fit on some sizes, test on another: progressive (all smaller "
                                   "sizes), previous-size (the one just below), leave-one-size-out.")
    _add_fit_options(p)
    p.add_argument("--protocol", choices=["all", "progressive", "previous-size", "leave-one-size-out"],
                   default="all")
    p.add_argument("--out", type=out_file, metavar="TABLE.csv", help="also write the table as CSV")
    p.add_argument("--max-mare", type=_fraction, default=DEFAULT_MAX_MARE, metavar="F",
                   help=f"the verdict's bound on the held-out mean absolute relative error (default "
                        f"{DEFAULT_MAX_MARE}: 1%% of the loss)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_validate)


def _fit(args: argparse.Namespace) -> int:
    runs = read_runs(args.data)
    opts = _options(args, args.holdout_size)
    fit = fit_law(runs, args.law, opts)
    path = fit.save(args.out)
    plots = []
    if args.plots:
        fit_runs, held = split_holdout([r for r in runs if r.status == "ok"], args.holdout_size,
                                       args.size_tolerance)
        plots = write_plots(fit, fit_runs, held, args.plots)
    if args.json:
        print_json(fit.to_dict())
        return 0
    print(f"law {fit.law}: {fit.n_runs} runs fitted, {len(fit.dropped)} dropped by the r filter, "
          f"status {fit.status}")
    print_table(list(fit.coefficients.items()), title="coefficients")
    if fit.reference:
        ref = fit.reference
        if ref["law"] == "chinchilla":
            print_table(list(ref["coefficients"].items()), title="reference L_opt (chinchilla)")
        else:
            print(f"reference L_opt: {ref['law']}")
    if law_form(fit.law).optimum is not None:
        try:
            o = optimum(fit, 1.0, 1.0)
            rows = [("hidden_over_sqrt_n*", o.hidden_over_sqrt_n), ("mlp_to_attn_ratio*", o.mlp_to_attn_ratio)]
            if o.interval:
                lvl = o.interval["level"]
                rows += [(f"  {lvl:.0%} interval x1*", str([round(v, 5) for v in o.interval["hidden_over_sqrt_n"]])),
                         (f"  {lvl:.0%} interval r*", str([round(v, 4) for v in o.interval["mlp_to_attn_ratio"]]))]
            print_table(rows, title="optimum (same at every N, D)")
        except ArchsearchError as e:  # a factor that is not U-shaped has no optimum: say so
            print(f"optimum: none ({e})")
    for name, m in fit.metrics.items():
        if isinstance(m, dict):
            print_table([(k, v if v is not None else "n/a") for k, v in m.items()], title=f"metrics ({name})")
    if fit.warnings:
        print("warnings:")
        for w in fit.warnings:
            print(f"  - {w}")
    print(f"wrote {path}")
    for p in plots:
        print(f"wrote {p}")
    return 0


def _read_throughputs(path: str):
    """(arch tuple) -> throughput, from a runs-like CSV/JSONL with a ``throughput`` column."""

    need = "needs numbers " + ", ".join(ARCH_COLUMNS) + ", throughput (a positive one)"
    rows = read_table(check_input_file("--throughput", path), "--throughput")
    table, first = {}, {}
    for i, row in enumerate(rows, 1):
        try:
            key = tuple(int(float(row[c])) for c in ARCH_COLUMNS)
            tp = float(row["throughput"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ArchsearchError(f"--throughput row {i}", need) from None
        if not (math.isfinite(tp) and tp > 0):
            raise ArchsearchError(f"--throughput row {i}", f"throughput {tp} is not a positive number", need)
        if key in table:  # which one would rank the shape is not for us to guess
            raise ArchsearchError(f"--throughput row {i}", f"repeats the shape of row {first[key]} "
                                  f"({table[key]:g} there, {tp:g} here)",
                                  "give one row per shape (e.g. the mean of the repeats)")
        table[key], first[key] = tp, i
    return table


def _solve(args: argparse.Namespace) -> int:

    check_size(args.params, args.layers)
    fit = load_law(args.law)
    if args.reference_law:
        fit = fit.with_reference(load_law(args.reference_law))
    tp_fn = None
    if args.throughput:
        table = _read_throughputs(args.throughput)
        tp_fn = lambda s: table.get((s.n_layers, s.hidden_size, s.n_heads, s.n_kv_heads,  # noqa: E731
                                     s.head_dim, s.ffn))
    build = build_settings_from_args(args)
    res = solve(fit, args.params, args.tokens, args.layers, args.target_loss, tp_fn, gqa=args.gqa,
                head_dim=args.head_dim, build=build)
    arch = res.architecture
    if res.optimum is not None:
        opt = {"hidden_over_sqrt_n": res.optimum.hidden_over_sqrt_n,
               "mlp_to_attn_ratio": res.optimum.mlp_to_attn_ratio, "source": "closed-form",
               "loss": res.optimum.loss, "interval": res.optimum.interval}
    elif arch is not None:
        opt = {"hidden_over_sqrt_n": arch.hidden_over_sqrt_n, "mlp_to_attn_ratio": arch.mlp_to_attn_ratio,
               "source": "grid", "loss": arch.predicted_loss, "interval": None}
    else:
        opt = None
    interval = fit.predict_interval(arch.spec, args.tokens, args.level) if (
        arch is not None and arch.predicted_loss is not None) else None
    out = {"law": fit.law, "params": args.params, "tokens": args.tokens, "n_layers": args.layers,
           "optimum": opt, "architecture": describe(arch.spec) if arch else None,
           "predicted_loss": arch.predicted_loss if arch else None,
           "predicted_loss_interval": list(interval) if interval else None,
           "target_loss": args.target_loss, "n_candidates": len(res.points),
           "n_feasible": len(res.feasible) if args.target_loss is not None else None,
           "best": res.best.to_dict() if (res.best and args.target_loss is not None) else None,
           "pareto": [p.to_dict() for p in res.pareto], "notes": res.notes}
    if args.all_points:
        out["points"] = [p.to_dict() for p in res.points]
    written = _write_solved(args, res, out) if args.out else None
    if args.json:
        print_json(out)
        return 0
    if opt:
        print_table([("hidden_over_sqrt_n", opt["hidden_over_sqrt_n"]),
                     ("mlp_to_attn_ratio", opt["mlp_to_attn_ratio"]), ("source", opt["source"])],
                    title="optimum (continuous)")
    if arch:
        d = describe(arch.spec)
        print_table([(k, d[k]) for k in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim",
                                         "ffn", "n_params_non_embedding", "hidden_over_sqrt_n",
                                         "mlp_to_attn_ratio")], title="architecture (snapped)")
        print(f"  predicted loss {arch.predicted_loss if arch.predicted_loss is not None else 'n/a'}"
              + (f"  interval {interval[0]:.4f}..{interval[1]:.4f}" if interval else ""))
    if args.target_loss is not None:
        print(f"{len(res.feasible)} of {len(res.points)} candidates meet loss <= {args.target_loss}")
        if res.best:
            b = res.best
            print(f"  best: d={b.spec.hidden_size} heads={b.spec.n_heads}/{b.spec.n_kv_heads} ffn={b.spec.ffn} "
                  f"loss={b.predicted_loss:.4f} throughput={b.throughput}")
    for n in res.notes:
        print(f"note: {n}")
    if written:
        print(f"wrote {written}/config.json (train it: archsearch train --arch {written} ...)")
    return 0


def _write_solved(args: argparse.Namespace, res, out: dict) -> Path:
    """The chosen shape as a model folder: ``config.json`` (what ``--arch DIR``, transformers and
    vLLM read), ``spec.json`` (the architecture fields) and ``solve.json`` (the solve's answer, the
    law file it used and provenance)."""
    if args.target_loss is not None:
        chosen, which = res.best, "the best candidate that meets --target-loss"
        if chosen is None:
            raise ArchsearchError("--out", f"no candidate meets --target-loss {args.target_loss}",
                                  "raise --target-loss, or leave it out to write the loss-optimal shape")
    else:
        chosen, which = res.architecture, "the loss-optimal shape"
        if chosen is None:
            raise ArchsearchError("--out", "the law gives no buildable optimum at this N and layer count",
                                  "give --target-loss to pick among the scanned candidates")
    folder = Path(args.out)
    write_hf_config(chosen.spec, folder)
    write_json(folder / "spec.json", chosen.spec.to_dict())
    write_json(folder / "solve.json", {**out, "chosen": {"which": which, **chosen.to_dict()},
                                       "law_file": str(Path(args.law).resolve()),
                                       "provenance": provenance(device=False)})
    return folder


def _validate(args: argparse.Namespace) -> int:

    runs = read_runs(args.data)
    protocols = PROTOCOLS if args.protocol == "all" else (args.protocol,)
    rows = progressive_validation(runs, args.law, _options(args), protocols)
    if args.out:
        write_table(args.out, rows)
    if args.json:
        print_json(rows)
        return 0
    print(f"{'protocol':<19} {'test N':>10} {'train sizes':>11} {'n':>4} {'MSE':>10} {'R^2':>7} "
          f"{'MARE':>8} {'Spearman':>8}")

    def f(v, spec):
        return format(v, spec) if v is not None else "n/a"

    for r in rows:
        head = f"{r['protocol']:<19} {r['test_size']:>10.3g} {len(r['train_sizes']):>11} {r['n_test']:>4}"
        if r["error"]:
            print(f"{head}  error: {r['error']}")
        else:
            print(f"{head} {f(r['mse'], '10.3g')} {f(r['r2'], '7.3f')} {f(r['mare'], '8.4f')} "
                  f"{f(r['spearman'], '8.3f')}")
    print(validation_verdict(rows, args.max_mare)["line"])
    return 0


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fraction of the loss in (0, 1), e.g. 0.01")
    return v

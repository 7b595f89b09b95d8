"""``archsearch search``: run (or resume, or plan) a study from a YAML config."""

from __future__ import annotations

import argparse

from archsearch.cli._common import add_overrides_arg, add_print_config_arg, fraction, out_dir, print_config, print_json
from archsearch.errors import ArchsearchError
from archsearch.planning.time import TimeLaw
from archsearch.search import pipeline
from archsearch.search.config import load_study_config
from archsearch.search.pipeline import STAGE_NAMES as STAGES
from archsearch.search.dryrun import dry_run, render
from archsearch.search.resolved import resolve


def _stages(text: str) -> set[str]:
    vals = {s.strip() for s in text.split(",") if s.strip()}
    bad = vals - set(STAGES)
    if bad:
        raise argparse.ArgumentTypeError(f"unknown stage(s) {sorted(bad)}; stages: {','.join(STAGES)}")
    return vals


def register(sub) -> None:
    p = sub.add_parser(
        "search", help="run an architecture search study (proxies, law, Optuna, GQA, report)",
        description="Run, resume or plan a study: proxy sweep -> law fit -> Optuna search -> local GQA "
                    "search -> chosen architecture -> optional training and lm-eval -> report. "
                    "Rerunning the same command resumes; several workers may run it at once.")
    p.add_argument("--config", required=True, help="study YAML (see configs/)")
    p.add_argument("--out", type=out_dir, help="study folder (default: runs/<name>)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its compute; run nothing")
    p.add_argument("--gpus", help="price the plan on these GPUs, e.g. 8xH100 (with --dry-run)")
    p.add_argument("--profile", metavar="FILE",
                   help="machine profile of measured start-ups for the plan (archsearch profile; default: "
                        "cluster.profile; the study folder's own startups.json wins)")
    p.add_argument("--mfu", type=fraction,
                   help="with --dry-run: model FLOPs utilisation in (0, 1] the plan prices training with "
                        "(default: a --time-law's measured one, else 0.40 assumed)")
    p.add_argument("--time-law", metavar="TIME_LAW.json",
                   help="with --dry-run: a time law from 'archsearch estimate fit' on runs of the named device")
    p.add_argument("--only", type=_stages, help=f"run only these stages ({','.join(STAGES)})")
    p.add_argument("--skip", type=_stages, default=set(), help="skip these stages")
    p.add_argument("--json", action="store_true", help="print the plan / summary as JSON")
    add_print_config_arg(p)
    add_overrides_arg(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    cfg = load_study_config(args.config, args.overrides)
    if args.print_config:
        print_config(cfg)
        return 0
    out = cfg.out_dir(args.out)
    for flag, given in (("--mfu", args.mfu), ("--time-law", args.time_law)):
        if given is not None and not args.dry_run:
            raise ArchsearchError(flag, "prices the plan only", "add --dry-run, or leave it out")
        if given is not None and not args.gpus:
            raise ArchsearchError(flag, "prices training on the GPUs --gpus names, and none are given",
                                  "add --gpus, e.g. --gpus 8xH100")
    if args.time_law is not None:
        TimeLaw.load(args.time_law, "--time-law")  # read and checked now, not after the plan is built
    if args.dry_run:
        study = resolve(cfg, for_plan=True)  # checked once, before the plan
        plan = dry_run(study, out, gpus=args.gpus, profile=args.profile, mfu=args.mfu,
                          time_law=args.time_law)
        if args.json:
            print_json(plan)
        else:
            _print_plan(plan)
        return 0
    summary = pipeline.run(cfg, out, only=args.only, skip=args.skip)
    if args.json:
        print_json(summary)
    elif "chosen" in summary:  # the report stage ran
        print((out / "report.md").read_text())
        print(f"study folder: {out}")
    else:
        print(f"study folder: {out} (the report stage was not selected: no report written)")
    return 0


def _print_plan(plan: dict) -> None:
    print("\n".join(render(plan)))

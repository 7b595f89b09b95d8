"""``archsearch profile``: a machine profile of start-ups measured by studies (for ``--dry-run``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from archsearch.cli._common import out_file
from archsearch.cluster.startup import build_profile, load_profile
from archsearch.fileio import write_json


def register(sub) -> None:
    p = sub.add_parser(
        "profile", help="gather the start-ups studies measured into a machine profile for --dry-run",
        description="Pool the start-ups that studies run as jobs recorded (STUDY/startups.json: proxy jobs' "
                    "submission to first step, search workers' start, engine processes' and engines' starts, "
                    "the coordinator's) into a machine profile with where and when each was measured; give it "
                    "to `archsearch search --dry-run --profile FILE` or as cluster.profile. Run a small study "
                    "(e.g. configs/ci-cluster.yaml with your cluster: section) on the machine or cluster first.")
    p.add_argument("--study", type=Path, nargs="+", required=True, metavar="DIR",
                   help="study folders with a startups.json")
    p.add_argument("--out", type=out_file, required=True, metavar="FILE", help="the profile to write (JSON)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    prof = build_profile(args.study)
    write_json(args.out, prof)
    figs = load_profile(Path(args.out))  # what the plan will read
    if args.json:
        print(json.dumps(prof, indent=1))
    else:
        for f in figs.values():
            print(f"{f.name}: {f.label()}")
        print(f"machine profile -> {args.out}")
    return 0

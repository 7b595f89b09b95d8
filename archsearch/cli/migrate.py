"""``archsearch migrate``: bring a study folder (or a study config) written by an older version to
this version's layout; the work is :mod:`archsearch.search.migration`'s."""

from __future__ import annotations

import argparse

from archsearch.errors import ArchsearchError
from archsearch.search.migration import apply_migration, migrate_config_file, plan_migration


def migrate(args: argparse.Namespace) -> int:
    if (args.study_dir is None) == (args.config is None):
        raise ArchsearchError("STUDY_DIR", "give a study folder or --config FILE, one of the two")
    if args.config is not None:
        moved = migrate_config_file(args.config, dry_run=args.dry_run)
        print(f"{args.config}: " + (f"{len(moved)} key(s) nested: {', '.join(moved)}" if moved else "nothing to do"))
        if moved and args.dry_run:
            print("dry run: nothing written")
        return 0
    plan = plan_migration(args.study_dir)
    print(plan.describe())
    if args.dry_run:
        if not plan.current:
            print("dry run: nothing written")
        return 0
    apply_migration(plan)
    if not plan.current:
        print("migrated")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "migrate", help="bring a study folder (or a study config) written by an older version to this version's layout",
        description="Rewrite STUDY_DIR, written by an older version, to the layout this version reads: its "
                    "config.json nested as the configs compose (law.fit, measure.bench), and its "
                    "measurements.jsonl keyed as this version keys them, with every measurement key in the "
                    "folder's JSON files and Optuna trials; what is current already is left alone. Run it from "
                    "the folder the study was run from (its config.json's relative paths resolve there). "
                    "--config FILE rewrites a study config written flat, comments kept. See docs/search.md.")
    p.add_argument("study_dir", metavar="STUDY_DIR", nargs="?", help="the study folder (runs/<name>)")
    p.add_argument("--config", metavar="FILE", help="a study config (YAML) to rewrite nested instead")
    p.add_argument("--dry-run", action="store_true", help="list what it would change; write nothing")
    p.set_defaults(func=migrate)

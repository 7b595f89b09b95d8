"""``archsearch calibrate``: fit the GPU/CPU roofline calibration on measured throughput."""

from __future__ import annotations

from archsearch.benchmarks.calibration_fit import add_arguments, calibrate_cli


def register(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="fit a roofline calibration (one file per device x engine) on measured throughput",
        description="Fit the analytic roofline's calibration (efficiencies, per-step and per-sequence overheads; "
                    "docs/benchmarks.md) on a table of published or measured throughput (--table CSV) or on "
                    "bench --out records (--results JSONL), choosing the model's form by held-out error, and "
                    "write one file per device x engine stating its source and its leave-one-shape-out and "
                    "leave-one-batch-out errors. Use it as measure.calibration in a study, or "
                    "bench --backend analytic --calibration FILE.")
    add_arguments(p)
    p.set_defaults(func=calibrate_cli)

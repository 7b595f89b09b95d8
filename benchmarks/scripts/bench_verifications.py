"""Benchmark: the track record of verified studies -- how often the realised value fell inside the
predicted interval.

Every study with the verify stage writes ``verify.json`` with a ``track_record`` entry: the chosen
shape's predicted loss (the law's interval) against its realised loss (trained over seeds), and the
search's throughput ratio to the baseline (its interval) against the ratio the verification measured
in fresh paired rounds. This script appends the entries of the study folders it is given (default:
``results/examples/*``) to ``results/verifications.jsonl``, once each (a study's entry is keyed by
its name, git revision and time), then reports over ALL recorded verifications: how many, how often
the realised loss fell inside the predicted interval, how often the measured ratio fell inside the
search's interval, and the verdicts. Prints one JSON line; appends that summary to
``results/bench/verifications.jsonl``.

    python -m archsearch.benchmarks.scripts.bench_verifications [STUDY_DIR ...] [--record results/verifications.jsonl]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path

from archsearch.fileio import append_line, read_json_tolerant, read_jsonl_lines
from archsearch.provenance import provenance


def entry_key(e: dict) -> str:
    return f"{e.get('study')}|{e.get('git')}|{e.get('time_utc')}"


def collect(folders: list[str], record: Path) -> list[dict]:
    """Append the folders' verifications not recorded yet; returns every recorded entry."""
    have = read_jsonl_lines(record, "the verification record")
    keys = {entry_key(e) for e in have}
    for folder in folders:
        v = read_json_tolerant(Path(folder) / "verify.json", "the study's verification")
        e = (v or {}).get("track_record")
        if not e or entry_key(e) in keys:
            continue
        e = {**e, "folder": str(folder)}
        append_line(record, json.dumps(e, default=str))
        have.append(e)
        keys.add(entry_key(e))
    return have


def coverage(entries: list[dict], flag: str) -> dict:
    """How many entries say where the realised value fell, and the share inside its interval."""
    known = [e[flag] for e in entries if e.get(flag) is not None]
    return {"n": len(known), "inside": sum(known), "share_inside": (sum(known) / len(known)) if known else None}


def joint_agreement(entries: list[dict]) -> dict:
    """How often the realised loss agrees with the prediction within their JOINT uncertainty.

    The law's interval is the uncertainty of the expected loss at the shape; it leaves out how much
    one training run differs from another (data order, initialisation), which the realised mean over
    a few seeds carries (its own interval). A realised value outside the law's interval may still be
    within that noise: the two agree when |realised - predicted| <= sqrt(h_p^2 + h_r^2), h_p and h_r
    the two intervals' half-widths (both at the study's level). Entries without both intervals (one
    seed) are not counted."""
    known = []
    for e in entries:
        p, r = e.get("predicted_loss_interval"), e.get("realised_loss_interval")
        if e.get("realised_loss") is None or e.get("predicted_loss") is None or not p or not r:
            continue
        hp, hr = (p[1] - p[0]) / 2, (r[1] - r[0]) / 2
        known.append(abs(e["realised_loss"] - e["predicted_loss"]) <= (hp * hp + hr * hr) ** 0.5)
    return {"n": len(known), "agree": sum(known), "share_agree": (sum(known) / len(known)) if known else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", help="study folders with verify.json (default: results/examples/*)")
    ap.add_argument("--record", default="results/verifications.jsonl")
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args()
    folders = args.folders or sorted(glob.glob("results/examples/*"))
    entries = collect(folders, Path(args.record))
    rel_err = [e["realised_loss"] / e["predicted_loss"] - 1 for e in entries
               if e.get("realised_loss") is not None and e.get("predicted_loss")]
    out = {"benchmark": "verifications", "record": args.record, "verifications": len(entries),
           "studies": sorted({e.get("study") for e in entries}),
           "loss": {**coverage(entries, "loss_inside_interval"),
                    "mean_rel_error": statistics.fmean(rel_err) if rel_err else None,
                    "within_joint_interval": joint_agreement(entries)},
           "ratio": coverage(entries, "ratio_inside_interval"),
           "verdicts": {k: sum(1 for e in entries if (e.get("verdict") or {}).get("loss") == k)
                        for k in ("met", "within the noise", "missed", "not trained")},
           "provenance": provenance()}
    print(json.dumps(out, default=str))
    append_line(Path(args.out_dir) / "verifications.jsonl", json.dumps(out, default=str))


if __name__ == "__main__":
    main()

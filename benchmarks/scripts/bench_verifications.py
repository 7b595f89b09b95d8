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
                    "mean_rel_error": statistics.fmean(rel_err) if rel_err else None},
           "ratio": coverage(entries, "ratio_inside_interval"),
           "verdicts": {k: sum(1 for e in entries if (e.get("verdict") or {}).get("loss") == k)
                        for k in ("met", "within the noise", "missed", "not trained")},
           "provenance": provenance()}
    print(json.dumps(out, default=str))
    append_line(Path(args.out_dir) / "verifications.jsonl", json.dumps(out, default=str))


if __name__ == "__main__":
    main()

"""Benchmark: tokenisation throughput of the sharded, multi-process tokenizer.

Tokenizes the offline corpus's training side (split into paragraphs, so there are many shards)
with a byte-level BPE (``--vocab``, trained once and cached) through
``archsearch.trainers.data.tokenize_shards`` with 1 and more worker processes, each time into a
fresh folder and in a fresh Python process whose tokenizer threads are limited to one per
process (``RAYON_RS_NUM_CPUS=1``, so "1 worker" is one core, not the Rust thread pool), the
corpus read ``--copies`` times. ``--repeats`` rounds each time every worker count once, the
order reversed every round; prints tokens/s (median, min, max) per worker count and the speed-up
over the first count with its 90% interval over the rounds (or that it is inside the noise), and
appends one JSON line per worker count with provenance to ``results/bench/tokenize.jsonl``. The
plan (``archsearch search --dry-run``) prices data preparation with the one-process figure times
the processes it assumes.

    python -m archsearch.benchmarks.scripts.bench_tokenize [--vocab 8192] [--workers 1 2] [--repeats 5]

On a shared machine, the multi-process figure is bounded by the cores actually free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from archsearch.benchmarks.paired import ratio_estimate
from archsearch.fileio import append_line
from archsearch.provenance import provenance
from archsearch.trainers.config import default_cache_dir
from archsearch.trainers.corpus import shakespeare_split
from archsearch.trainers.data import token_dtype, tokenize_shards
from archsearch.trainers.tokenizer import load_tokenizer, separator_id

OUT = Path("results/bench/tokenize.jsonl")


def corpus_paragraphs() -> list[str]:
    train, _ = shakespeare_split()
    docs = []
    for f in train:
        docs += [p for p in f.read_text(encoding="utf-8", errors="replace").split("\n\n") if p.strip()]
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shard-docs", type=int, default=2000)
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: one timing
    ap.add_argument("--tokenizer-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one is not None:
        return _child(a)

    docs = corpus_paragraphs()
    chars = sum(len(d) for d in docs)
    tok = load_tokenizer(f"bpe:{a.vocab}", default_cache_dir(), bpe_texts=lambda: iter(docs),
                         bpe_key=json.dumps(["bench_tokenize", "shakespeare-train-paragraphs", chars]))
    with tempfile.TemporaryDirectory() as tdir:
        tok.save_pretrained(tdir)
        rows = _measure(a, tdir, docs, chars, provenance)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        append_line(a.out, json.dumps(r))
    print(f"appended {len(rows)} line(s) to {a.out}")
    return 0


def _child(a) -> int:
    import numpy as np
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(a.tokenizer_dir)
    docs = corpus_paragraphs() * a.copies
    sep, dtype = separator_id(tok), token_dtype(len(tok))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        paths = tokenize_shards(docs, Path(tmp), "train", tok, sep, dtype, shard_docs=a.shard_docs, workers=a.one)
        dt = time.perf_counter() - t0
        n = int(sum(p.stat().st_size for p in paths) // np.dtype(dtype).itemsize)
    print(json.dumps({"tokens": n, "seconds": dt, "documents": len(docs)}))
    return 0


def _one(a, tdir: str, w: int) -> tuple[float, int]:
    """(tokens/s, tokens) of one timing in a fresh process with ``w`` workers."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, RAYON_RS_NUM_CPUS="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_tokenize", "--one", str(w),
                        "--tokenizer-dir", tdir, "--copies", str(a.copies), "--shard-docs", str(a.shard_docs)],
                       env=env, capture_output=True, text=True, check=True)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return res["tokens"] / res["seconds"], res["tokens"]


def _measure(a, tdir: str, docs: list[str], chars: int, provenance) -> list[dict]:
    """``repeats`` rounds; each round times every worker count once, in an order that reverses
    every round (1 2, 2 1, ...) so a drift of the machine's load cancels within two rounds. The
    speed-up of each count over the first is the geometric mean of the per-round ratios with a
    90% t interval on their logs (``archsearch.benchmarks.paired.ratio_estimate``)."""
    rates: dict[int, list[float]] = {w: [] for w in a.workers}
    n_tokens = 0
    for rnd in range(a.repeats):
        order = a.workers if rnd % 2 == 0 else list(reversed(a.workers))
        for w in order:
            rate, n_tokens = _one(a, tdir, w)
            rates[w].append(rate)
        print(f"round {rnd + 1}/{a.repeats}: " + ", ".join(f"{w} process(es) {rates[w][-1]:,.0f} tokens/s"
                                                          for w in a.workers), flush=True)
    rows, first = [], a.workers[0]
    for w in a.workers:
        med = statistics.median(rates[w])
        est = ratio_estimate(rates[first], rates[w], level=0.9)
        inside = est.lo <= 1.0 <= est.hi
        verdict = ("baseline" if w == first else
                   f"inside the noise: the 90% interval [{est.lo:.2f}, {est.hi:.2f}] contains 1" if inside else
                   f"x{est.ratio:.2f} [{est.lo:.2f}, {est.hi:.2f}] (90%), outside the noise")
        row = {"bench": "tokenize", "tokenizer": f"bpe:{a.vocab} (byte-level, trained on the corpus)",
               "workers": w, "threads_per_process": 1, "documents": len(docs) * a.copies,
               "chars": chars * a.copies, "tokens": n_tokens,
               "shard_docs": a.shard_docs, "repeats": a.repeats, "design": "interleaved rounds, order reversed every round",
               "tokens_per_s": {"median": med, "min": min(rates[w]), "max": max(rates[w]), "all": rates[w]},
               "tokens_per_s_per_process": med / w,
               "speedup_vs_first": {"ratio": est.ratio, "lo": est.lo, "hi": est.hi, "level": est.level,
                                    "rounds": est.n, "verdict": verdict},
               "note": "one tokenizer thread per process; includes worker start-up (spawn), pickling documents to "
                       "the workers and shard writes; a shared machine bounds the multi-process figure by the "
                       "cores actually free",
               "provenance": provenance()}
        rows.append(row)
        print(f"processes={w}: median {med:,.0f} tokens/s (min {min(rates[w]):,.0f}, max {max(rates[w]):,.0f}; "
              f"{n_tokens:,} tokens, {len(docs) * a.copies:,} documents); vs {first} process(es): {verdict}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

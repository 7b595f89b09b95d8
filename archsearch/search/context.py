"""The search stage's context (the law, the target loss, the measurer on the study's store), as
the coordinator and every measurement worker build it, and the study's stored Optuna study."""

from __future__ import annotations

from pathlib import Path

from archsearch.laws import load_law
from archsearch.search.checks import check_loss_target
from archsearch.search.config import StudyConfig
from archsearch.search.measurements import MeasurementStore, Measurer
from archsearch.search.resolved import ResolvedStudy, as_resolved
from archsearch.search.study import SearchContext, create_study
from archsearch.search.targets import build_targets


def search_context(study: ResolvedStudy | StudyConfig, out: Path, law=None):
    """The search's context (law, target loss, measurer on the study's store) from the resolved
    study (a config is resolved unchecked, :func:`~archsearch.search.resolved.derive`); the law is
    read from the study folder (or ``law.file``) when not given, as a measurement worker does."""
    study = as_resolved(study)
    cfg = study.cfg
    if law is None:
        law = load_law(cfg.law.file or out / "law.json")
    lt = study.target_loss(law)
    check_loss_target(cfg, law, lt, study.build)
    store = MeasurementStore(out / "measurements.jsonl")

    targets = build_targets(cfg, store, study.scale)  # with targets, the first one's measurer is the study's
    measurer = targets[0].measurer if targets else Measurer(cfg.measure, store, scale=study.scale)
    return SearchContext(cfg=cfg, law=law, target_loss=lt, measurer=measurer, out=out,
                         build=study.build, baseline=study.baseline, targets=targets)


def load_study(ctx):
    """The stored study, or None when the search stage has not created it yet."""

    try:
        study, _ = create_study(ctx, load_only=True)
    except KeyError:  # optuna: no study of that name in the storage
        return None
    return study

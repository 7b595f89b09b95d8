"""The study's context as its search works on it (:class:`SearchContext`: the resolved study with
the law, the target loss and the measurer on the study's store), built once per process by
:func:`search_context`, as the coordinator and every measurement worker build it.

One study is carried down in one chain, each value in one place: the
:class:`~archsearch.search.resolved.ResolvedStudy` (every value the config gives, resolved once) is
held by the :class:`SearchContext` (adds what the fit gives), which is held by the stage run
(:class:`archsearch.search.stages.StudyRun`: adds each stage's result). Nothing below derives a
config value again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.candidates import BuildSettings
from archsearch.laws import load_law
from archsearch.search.checks import check_loss_target
from archsearch.search.config import StudyConfig
from archsearch.search.measurements import MeasurementStore, Measurer
from archsearch.search.resolved import ResolvedStudy, as_resolved
from archsearch.search.targets import build_targets


@dataclass
class SearchContext:
    """The resolved study with what the fit gives: the law, the target loss, the measurer on the
    study's store and the deployment targets. The config, the build settings and the baseline are
    the resolved study's (``study``), read through, never derived again."""
    study: ResolvedStudy
    law: Any  # archsearch.laws.FitResult
    target_loss: float
    measurer: Measurer | None
    out: Path
    # measure.targets (archsearch.search.targets): each with its Measurer; None: the measure block
    targets: list[Any] | None = None
    # False: each candidate is measured alone and the objective is its absolute throughput (the
    # sampler's benchmark, tests); True: paired with the baseline (archsearch.benchmarks.paired)
    paired: bool = True

    @property
    def cfg(self) -> StudyConfig:
        return self.study.cfg

    @property
    def build(self) -> BuildSettings:
        return self.study.build

    @property
    def baseline(self) -> ArchSpec | None:
        """The shape every candidate is compared with (None: measured alone)."""
        return self.study.baseline if self.paired else None

    @property
    def ref_batch(self) -> int:
        return self.cfg.measure.ref_batch


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
    return SearchContext(study=study, law=law, target_loss=lt, measurer=measurer, out=out, targets=targets)

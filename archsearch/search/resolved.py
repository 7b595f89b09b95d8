"""The study resolved once: :class:`ResolvedStudy` holds every value a study derives from its
config alone (the vocabulary, the build settings, the baseline and the shape it is measured as,
the law's fit options, the proxy sweeps and their shapes, the deployment targets' views), built
at load by :func:`resolve`, which runs the config checks (:mod:`archsearch.search.checks`) once,
in their order, deriving each value where the next check needs it. The stages, the dry run, the
measurement jobs and the benchmark scripts read these values from it instead of deriving them
again; :func:`derive` builds the same object without the checks, for code handed a config that
is checked elsewhere (a job, a benchmark script, a test).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from archsearch.arch import ArchSpec
from archsearch.candidates import BuildSettings
from archsearch.errors import ArchsearchError
from archsearch.laws.fit import FitOptions
from archsearch.search import checks
from archsearch.search.checks import baseline_spec, measured_baseline, seed_shape_specs, vocab_size
from archsearch.search.config import StudyConfig
from archsearch.search.derived import build_settings, measure_scale, proxy_sweeps
from archsearch.search.targets import StudyView, study_views
from archsearch.trainers.sweep import sweep_specs

if TYPE_CHECKING:
    from archsearch.cluster.config import ClusterConfig
    from archsearch.trainers.config import SweepConfig

# one proxy sweep's shapes: (grid point, spec or None where it does not build, error or None)
SweepShapes = tuple[tuple[dict[str, Any], ArchSpec | None, str | None], ...]


@dataclass(frozen=True)
class ResolvedStudy:
    """A study config with the values every part of the study derives from it alone."""
    cfg: StudyConfig
    vocab_size: int                   # the embeddings' size of every shape (checks.vocab_size)
    build: BuildSettings              # how shapes are built: search_space.build with the vocabulary,
                                      # tying and a context long enough for every measured length
    baseline: ArchSpec                # the shape every candidate is compared with
    scale: Callable[[ArchSpec], ArchSpec] | None  # measure.params: a shape -> the shape measured
    measured_baseline: ArchSpec       # the baseline as measured (rebuilt at measure.params where set)
    fit: FitOptions                   # the law's fit options
    sweeps: tuple[SweepConfig, ...]   # the proxy sweeps (none where the law is given or runs reused)
    sweep_shapes: tuple[SweepShapes, ...]  # each sweep's grid built (trainers.sweep.sweep_specs)
    views: tuple[StudyView, ...]      # the study as each deployment target measures it (or itself)
    seed_shapes: tuple[ArchSpec, ...] = ()  # optuna.seed_shapes as measured (checks.seed_shape_specs)

    def seed_shape(self, name: str) -> ArchSpec:
        """The seeded published shape ``name`` (a trial's ``seed_shape``)."""
        for spec in self.seed_shapes:
            if spec.name == name:
                return spec
        raise ArchsearchError("optuna.seed_shapes", f"the stored study seeded {name!r}, which this config does "
                              "not name", "name it again in optuna.seed_shapes, or use a new study folder")

    def measured(self, spec: ArchSpec) -> ArchSpec:
        """``spec`` as the study measures it (rebuilt at ``measure.params`` where set)."""
        return spec if self.scale is None else self.scale(spec)

    def target_loss(self, law) -> float:
        """The target loss under ``law`` (``target.loss``, else the baseline's predicted loss
        with ``target.slack``)."""
        return checks.target_loss(self.cfg, law, self.baseline)

    def with_cluster(self, cluster: ClusterConfig) -> ResolvedStudy:
        """The same study run under another ``cluster`` block (a measurement job runs inline):
        no derived value reads the cluster block, and the views are rebuilt from the new config."""
        cfg = dataclasses.replace(self.cfg, cluster=cluster)
        return dataclasses.replace(self, cfg=cfg, views=tuple(study_views(cfg)))


def resolve(cfg: StudyConfig, *, for_plan: bool = False) -> ResolvedStudy:
    """Check ``cfg`` before any work and resolve it, each check and each derivation once; the
    first failing check raises (an :class:`~archsearch.errors.ArchsearchError` naming the field
    and the fix). ``for_plan``: as the dry run checks (a missing engine is not an error, the data
    budgets are reported, the reference batch is checked only on a named device)."""
    checks.check_settings(cfg)
    vocab = vocab_size(cfg)
    build = build_settings(cfg, vocab)
    checks.check_search_space(cfg, build)
    base = baseline_spec(cfg, build)
    sweeps = tuple(proxy_sweeps(cfg))
    shapes = tuple(tuple(sweep_specs(sw, vocab)) for sw in sweeps)
    views = tuple(study_views(cfg))
    checks.check_study(cfg, build, base, views, list(shapes), for_plan)
    study = _assemble(cfg, vocab, build, base, sweeps, shapes, views)
    checks.check_reference_batches(views, study.measured_baseline, for_plan)
    checks.check_online_targets(views, study.measured_baseline)
    return study


def derive(cfg: StudyConfig) -> ResolvedStudy:
    """``cfg`` resolved without the checks (only what a derivation itself refuses raises)."""
    vocab = vocab_size(cfg)
    build = build_settings(cfg, vocab)
    sweeps = tuple(proxy_sweeps(cfg))
    return _assemble(cfg, vocab, build, baseline_spec(cfg, build), sweeps,
                     tuple(tuple(sweep_specs(sw, vocab)) for sw in sweeps), tuple(study_views(cfg)))


def as_resolved(study: ResolvedStudy | StudyConfig) -> ResolvedStudy:
    """``study`` itself, or a config resolved by :func:`derive` (for callers handed a config)."""
    return study if isinstance(study, ResolvedStudy) else derive(study)


def _assemble(cfg: StudyConfig, vocab: int, build: BuildSettings, base: ArchSpec, sweeps: tuple,
              shapes: tuple, views: tuple) -> ResolvedStudy:
    return ResolvedStudy(cfg=cfg, vocab_size=vocab, build=build, baseline=base,
                         scale=measure_scale(cfg, build),
                         measured_baseline=measured_baseline(cfg, base, build),
                         fit=cfg.fit_options(), sweeps=sweeps, sweep_shapes=shapes, views=views,
                         seed_shapes=seed_shape_specs(cfg, build))

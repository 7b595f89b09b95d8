"""Values derived from a study config: the search space's build settings, the shape a trial's
knobs expand to, the function to the measured shape (``measure.params``) and the proxy sweeps."""

from __future__ import annotations

import dataclasses
from functools import partial

from archsearch.arch import ArchSpec
from archsearch.candidates import BuildSettings, build_candidate
from archsearch.search.config import StudyConfig
from archsearch.search.deployment import target_measure
from archsearch.search.measurements import measured_shape


def build_settings(cfg: StudyConfig, vocab_size: int) -> BuildSettings:
    """The search space's build settings with the study's vocabulary and embedding tying, and a
    context long enough for the measured lengths."""
    b = cfg.search_space.build
    need = max(m.bench.input_len + m.bench.output_len for m in
               [cfg.measure, *(target_measure(cfg.measure, t) for t in cfg.measure.targets or ())])
    return dataclasses.replace(b, vocab_size=vocab_size, tie_embeddings=cfg.tie_embeddings,
                               max_position_embeddings=max(b.max_position_embeddings, need))


def expand(cfg: StudyConfig, build: BuildSettings, x1: float, r: float, gqa: int) -> ArchSpec:
    """The one function from knobs to a shape, used by every trial."""
    return build_candidate(cfg.params, cfg.n_layers, x1, r, gqa=gqa,
                           head_dim=cfg.search_space.head_dim, settings=build).spec


def measure_scale(cfg: StudyConfig, build: BuildSettings):
    """``measure.params``: the function from a study shape to the shape measured (the same realised
    ratios rebuilt at N_m); None where shapes are measured as built."""
    if cfg.measure.params is None:
        return None
    return partial(measured_shape, params=cfg.measure.params, head_dim=cfg.search_space.head_dim, build=build)


def proxy_sweeps(cfg: StudyConfig) -> list:
    """The study's proxy sweeps as validated ``archsearch.trainers.SweepConfig`` objects."""
    return cfg.proxy.sweep_list() if cfg.proxy is not None else []

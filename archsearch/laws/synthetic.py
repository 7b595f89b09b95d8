"""Synthetic proxy runs from a known law: for tests, benchmarks and trying the tools out.

Every run is a real buildable spec from :func:`archsearch.candidates.build_candidate`, so N, r
and hidden/sqrt(N) are derived from the architecture exactly as for trained runs; only the
loss is made up: the true law at that spec, times ``exp(noise * z)`` with z standard normal.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from archsearch.candidates import BuildSettings, build_candidate
from archsearch.errors import ArchsearchError
from archsearch.laws import forms
from archsearch.laws.lawfile import spec_arrays
from archsearch.laws.registry import law_form
from archsearch.rundata import RunRecord

# A reference L_opt in the range of small LLaMA proxies (loss ~3-4 at 10M-1B parameters).
TRUE_CHINCHILLA = {"E": 1.8, "A": 400.0, "alpha": 0.34, "B": 1500.0, "beta": 0.30}


def default_layers(params: float) -> int:
    """A depth that grows slowly with N (about 8 at 20M, 16 at 1B), even for easy snapping."""
    return 2 * max(2, round(1.6 * math.log10(params / 1e5)))


def synthetic_runs(law: str, coefficients: dict[str, float], sizes: Sequence[float],
                   tokens_per_param: Sequence[float] = (20.0,),
                   hidden_over_sqrt_n: Sequence[float] = (0.05, 0.08, 0.12),
                   mlp_to_attn: Sequence[float] = (1.0, 2.5, 4.0), noise: float = 0.005,
                   seed: int = 0, reference: dict[str, float] | None = None,
                   gqa: int = 4, head_dim: int = 64) -> list[RunRecord]:
    """Runs on the grid sizes x tokens_per_param x hidden_over_sqrt_n x mlp_to_attn; shapes
    that do not build within the 2% budget tolerance are skipped."""
    form = law_form(law)  # an unknown name fails here
    rng = np.random.default_rng(seed)
    # data, not a search: keep every shape, whatever its realised r (the law reads the realised r)
    settings = BuildSettings(hidden_multiple=32, ffn_multiple=32, on_r_drift="flag")
    specs, tokens = [], []
    for n in sizes:
        for k in tokens_per_param:
            for x1 in hidden_over_sqrt_n:
                for r in mlp_to_attn:
                    try:
                        cand = build_candidate(n, default_layers(n), x1, r, gqa=gqa, head_dim=head_dim,
                                               settings=settings)
                    except ArchsearchError:
                        continue
                    specs.append(cand.spec)
                    tokens.append(k * n)
    if not specs:
        raise ArchsearchError("sizes", "no shape of the grid builds", "use larger sizes")
    X = spec_arrays(specs, tokens)
    if form.conditional:
        X["Lref"] = forms.predict("chinchilla", reference or TRUE_CHINCHILLA, X)
    loss = forms.predict(law, coefficients, X) * np.exp(noise * rng.standard_normal(len(specs)))
    return [RunRecord.from_arch(s, tokens=float(t), loss=float(v), run_id=f"syn{i:04d}", seed=seed)
            for i, (s, t, v) in enumerate(zip(specs, tokens, loss))]

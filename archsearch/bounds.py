"""Upper bounds on every count a user gives, each derived once from what a run can do.

A count past its bound is not a bigger run but a hang (a billion repeats, a trillion bootstrap
resamples) or a silent wrong answer (a hundred million GPUs in an estimate). :func:`check_count`
refuses it before any work, with one error that names the field, states the bound and why it
is the bound. Bounds that depend on the model or the machine (a LoRA rank, a sequence length,
processes per machine) are computed from them by the functions below, each stating its reason
the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from archsearch.errors import ArchsearchError


@dataclass(frozen=True)
class Bound:
    """The largest value of a count and why no run needs more."""

    limit: int
    why: str


BOUNDS: dict[str, Bound] = {
    # a mean's interval narrows as 1/sqrt(n): 1,000 repeats (or paired rounds) give 1/32 of one
    # repeat's spread, below the drift of an engine between two runs
    "repeats": Bound(1000, "a mean's interval narrows as 1/sqrt(repeats); at 1,000 it is 1/32 of one "
                           "repeat's spread, finer than an engine's drift between runs"),
    "rounds": Bound(1000, "a paired comparison's interval narrows as 1/sqrt(rounds); at 1,000 it is 1/32 of "
                          "one round's spread, finer than an engine's drift between runs"),
    "warmup": Bound(100, "warm-up runs compile graphs and fill caches once; a few suffice"),
    # the Monte-Carlo error of a bootstrap interval's end is ~1/sqrt(resamples): 1e5 (lm-eval's
    # default) puts it far below the interval's width; more only takes hours
    "bootstrap": Bound(100_000, "a bootstrap interval's Monte-Carlo error shrinks as 1/sqrt(resamples); "
                                "100,000 (lm-eval's default) puts it far below the interval's width"),
    "devices": Bound(1_000_000, "the largest clusters built hold a few 10^5 accelerators"),
    "iterations": Bound(1_000_000, "an optimiser that has not converged in 10^6 iterations of a law's "
                                   "handful of coefficients does not converge"),
    # a study's jobs are its proxies and trials: no study holds more than 10,000 of either
    "jobs": Bound(10_000, "a study's jobs are its proxy trainings and trials, never more than 10,000 "
                          "side by side"),
    # pruned and failed trials count towards max_trials: 100 per shape asked for means the
    # sampler finds nothing new, and the study would sample forever
    # a model's heads: the largest published models have 128 query heads (Llama-3.1-405B); a GQA
    # group, a KV head count or a few-shot count beyond these describes no model and no prompt
    "heads": Bound(1024, "the largest published models have 128 query heads; a head count or GQA group "
                         "beyond 1,024 describes no model"),
    "fewshot": Bound(1000, "each few-shot example takes tens of tokens or more, so 1,000 of them fill the "
                           "longest context windows (10^5 tokens)"),
    # an evaluation loss's sampling error shrinks as 1/sqrt(batches): at 100,000 it is far below the
    # spread between two training runs
    "eval_batches": Bound(100_000, "an evaluation loss's sampling error shrinks as 1/sqrt(batches); at 100,000 "
                                   "it is far below the spread between two training runs"),
    # a throughput curve is sampled at a few batch sizes (powers of two): 64 reach 2^63 sequences
    "batch_sizes": Bound(64, "a throughput curve is sampled at a few batch sizes (powers of two); 64 of them "
                             "reach 2^63 sequences"),
    "attempts_per_trial": Bound(100, "more than 100 attempts per shape asked for means the sampler finds "
                                     "nothing new"),
}


def check_count(field: str, value: int, bound: str, scale: int = 1) -> int:
    """``value`` if it is at most ``BOUNDS[bound].limit * scale``, else an error naming ``field``,
    the limit and why it is the limit. Returns ``value``."""
    b = BOUNDS[bound]
    limit = b.limit * scale
    if value > limit:
        raise ArchsearchError(field, f"{value:,} is beyond what a run can do ({b.why})",
                              f"give at most {limit:,}")
    return value


def check_at_most(field: str, value: int, limit: int, why: str) -> int:
    """``value`` if it is at most ``limit`` (a bound computed from the model or the machine,
    ``why`` saying from what), else an error naming ``field``. Returns ``value``."""
    if value > limit:
        raise ArchsearchError(field, f"{value:,} is beyond what a run can do ({why})", f"give at most {limit:,}")
    return value


def devices_here() -> tuple[int, str]:
    """(how many, what): the processes one machine can run a training on, its GPUs, else the CPU
    cores this process may use."""
    import torch  # a heavy engine: imported only when a launch is checked

    if torch.cuda.is_available() and torch.cuda.device_count():
        return torch.cuda.device_count(), "GPUs"
    return len(os.sched_getaffinity(0)), "usable CPU cores and no GPU"

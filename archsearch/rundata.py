"""The proxy-run data format, shared by the trainers (which write it) and the laws (which fit it).

One row per training run, as CSV (header row) or JSONL (one object per line):

=============  ========  ====================================================================
column         required  meaning
=============  ========  ====================================================================
n_layers       yes (*)   decoder layers
hidden_size    yes (*)   model width d
n_heads        yes (*)   query heads
n_kv_heads     yes (*)   key/value heads
head_dim       yes (*)   size of one head
ffn            yes (*)   SwiGLU intermediate size
params         (*)       N, non-embedding, instead of the six architecture columns (published
                         scaling tables give only N, D and loss): such rows fit the Chinchilla
                         law and are refused, by name, by the laws that need the shape
vocab_size     no        vocabulary (only used for embedding counts)
tokens         yes       training tokens D
loss           yes       final loss (see loss_kind)
loss_kind      no        ``eval`` (held-out loss, default) or ``smoothed_train``
seed           no        training seed
run_id         no        unique name of the run
status         no        ``ok`` (default) or ``failed``; failed rows are never fitted
wall_time_s    no        training wall time (planning's time law)
n_devices      no        devices used; ``tp``, ``pp``: tensor / pipeline parallel degrees
device         no        device name (``H100-SXM``, ``cpu``)
=============  ========  ====================================================================

N (non-embedding), r and d/sqrt(N) are derived from the architecture columns, never typed by
hand; a row with both the architecture and ``params`` must agree on N within 1%. Other columns are kept in ``extra`` and written back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

from archsearch.arch import ArchSpec, hidden_over_sqrt_n, mlp_to_attn_ratio, non_embedding_params
from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_write, check_input_file, read_table, write_table

ARCH_COLUMNS = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn")
LOSS_KINDS = ("eval", "smoothed_train")
# Beyond this a row's budget is a typo, not a run: the largest trained models saw a few 1e13 tokens.
MAX_TOKENS = 1e15


@dataclass(frozen=True)
class RunRecord:
    """One proxy run: its architecture (an :class:`ArchSpec`; ``None`` for rows that give only N
    in ``params``), its budget and loss, and where it ran. N, r and d/sqrt(N) are derived from
    the architecture once."""

    tokens: float
    loss: float
    arch: ArchSpec | None = None
    params: float | None = None
    loss_kind: str = "eval"
    seed: int | None = None
    run_id: str | None = None
    status: str = "ok"
    wall_time_s: float | None = None
    n_devices: int | None = None
    tp: int | None = None
    pp: int | None = None
    device: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f"run {self.run_id}" if self.run_id else "run"
        if self.status not in ("ok", "failed"):
            raise ArchsearchError(f"{where}.status", f"{self.status!r} is not ok/failed")
        if self.loss_kind not in LOSS_KINDS:
            raise ArchsearchError(f"{where}.loss_kind", f"{self.loss_kind!r} is unknown",
                                  f"use one of {list(LOSS_KINDS)}")
        if self.status == "ok":
            if not (isinstance(self.loss, (int, float)) and math.isfinite(self.loss) and self.loss > 0):
                raise ArchsearchError(f"{where}.loss", f"must be a positive finite number, got {self.loss!r}",
                                      "drop the row or mark it status=failed")
            if not (isinstance(self.tokens, (int, float)) and math.isfinite(self.tokens) and self.tokens > 0):
                raise ArchsearchError(f"{where}.tokens", f"must be a positive finite number, got {self.tokens!r}")
            if self.tokens > MAX_TOKENS:
                raise ArchsearchError(f"{where}.tokens", f"{self.tokens:.3g} is beyond any training run "
                                      f"(at most {MAX_TOKENS:.0e})", "fix the row's tokens, or drop the row")
        if self.arch is not None:
            if self.params is not None and abs(self.params / self.n_params - 1) > 0.01:
                raise ArchsearchError(f"{where}.params", f"{self.params:.6g} disagrees with the "
                                      f"architecture columns (N = {self.n_params})", "drop one of them")
        elif self.params is None:
            raise ArchsearchError(f"{where}.params", "the run has neither the architecture columns "
                                  "nor params", f"give {', '.join(ARCH_COLUMNS)}, or params (N only)")
        elif not (math.isfinite(self.params) and self.params > 0):
            raise ArchsearchError(f"{where}.params", f"must be a positive finite number, got {self.params!r}")

    @property
    def has_arch(self) -> bool:
        """Whether the row gives the architecture (else only N, in ``params``)."""
        return self.arch is not None

    @property
    def spec(self) -> ArchSpec:
        if self.arch is None:
            raise ArchsearchError(f"run {self.run_id or '?'}.params", "gives N only, no architecture",
                                  f"this use needs the columns {', '.join(ARCH_COLUMNS)}")
        return self.arch

    @cached_property
    def n_params(self) -> float:
        return non_embedding_params(self.arch) if self.arch is not None else float(self.params)

    @cached_property
    def mlp_to_attn_ratio(self) -> float:
        return mlp_to_attn_ratio(self.spec)

    @cached_property
    def hidden_over_sqrt_n(self) -> float:
        return hidden_over_sqrt_n(self.spec)

    def to_row(self) -> dict[str, Any]:
        """The run as one flat row of the file format (the architecture as its columns)."""
        row: dict[str, Any] = {c: None for c in ROW_COLUMNS}
        if self.arch is not None:
            row.update({c: getattr(self.arch, c) for c in (*ARCH_COLUMNS, "vocab_size")})
        row.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("arch", "extra")})
        row.update(self.extra)
        return row

    @classmethod
    def from_arch(cls, spec: ArchSpec, tokens: float, loss: float, **kw: Any) -> "RunRecord":
        return cls(arch=spec, tokens=tokens, loss=loss, **kw)


_FIELDS = {f.name: f for f in dataclasses.fields(RunRecord) if f.name not in ("arch", "extra")}
# the file's columns, in order: the architecture's, then the record's own
ROW_COLUMNS = (*ARCH_COLUMNS, "vocab_size", *_FIELDS)
_INT = {*ARCH_COLUMNS, "vocab_size", "seed", "n_devices", "tp", "pp"}
_FLOAT = {"tokens", "loss", "wall_time_s", "params"}


def _parse(row: dict[str, Any], where: str) -> RunRecord:
    if not isinstance(row, dict):
        raise ArchsearchError(where, f"is not an object: {str(row)[:60]}",
                              "each line of a JSONL run file is one JSON object with the run's columns")
    given = lambda c: row.get(c) not in (None, "")  # noqa: E731
    needed = ("tokens", "loss") if given("params") and not any(given(c) for c in ARCH_COLUMNS) \
        else (*ARCH_COLUMNS, "tokens", "loss")
    missing = [c for c in needed if not given(c)]
    if missing:
        raise ArchsearchError(f"{where}.{missing[0]}", "missing required column",
                              f"every run needs tokens, loss and either {', '.join(ARCH_COLUMNS)} "
                              "or params (N only)")
    kw: dict[str, Any] = {}
    arch: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for k, v in row.items():
        if k not in ROW_COLUMNS:
            extra[k] = v
            continue
        if v in (None, ""):
            continue
        try:
            if k in _INT:
                f = float(v)
                if not f.is_integer():
                    raise ValueError
                v = int(f)
            elif k in _FLOAT:
                v = float(v)
            else:
                v = str(v)
        except (TypeError, ValueError):
            raise ArchsearchError(f"{where}.{k}", f"{v!r} is not a valid "
                                  f"{'integer' if k in _INT else 'number'}") from None
        (arch if k in (*ARCH_COLUMNS, "vocab_size") else kw)[k] = v
    try:
        if any(c in arch for c in ARCH_COLUMNS):
            try:
                # the vocabulary only sizes embeddings, which no law reads: 32000 when not given
                kw["arch"] = ArchSpec(**{"vocab_size": 32000, **arch})
            except ArchsearchError as e:
                raise ArchsearchError(f"run {kw.get('run_id') or '?'}.{e.field}", e.problem, e.fix) from None
        return RunRecord(**kw, extra=extra)
    except ArchsearchError as e:
        if e.field.startswith(where):
            raise
        raise ArchsearchError(f"{where}: {e.field}", e.problem, e.fix) from None


def check_one_loss_kind(runs: Iterable[RunRecord]) -> None:
    """Refuse to fit held-out and smoothed training losses together: they differ systematically
    (a training loss sits below the held-out one by the generalisation gap), so the law would fit
    the mix of kinds rather than the sizes and shapes."""
    kinds: dict[str, list[RunRecord]] = {}
    for r in runs:
        if r.status == "ok":
            kinds.setdefault(r.loss_kind, []).append(r)
    if len(kinds) > 1:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(kinds.items()))
        example = kinds["smoothed_train"][0]
        raise ArchsearchError("loss_kind", f"the runs mix loss kinds ({counts}; e.g. run "
                              f"{example.run_id or '?'} is smoothed_train)",
                              "fit one kind: keep the eval rows, or refit every run on the same loss")


def check_run_table(runs: Iterable[RunRecord]) -> None:
    """Refuse a run table a fit would read silently wrong: a row copied (same shape or N, budget,
    seed, loss kind and loss: it would weigh double) and runs of several vocabulary sizes (their
    losses are per token of different tokenizers, not comparable). Errors name the runs and what
    the fit assumes. Several layer counts are the method's own design (proxies deepen with N) and
    are not refused: the fit names them (``data_ranges["n_layers"]``)."""
    seen: dict[tuple, str] = {}
    vocab: dict[int, str] = {}
    for i, r in enumerate(runs, 1):
        if r.status != "ok":
            continue
        name = r.run_id or f"row {i}"
        shape = dataclasses.replace(r.arch, name=None) if r.arch is not None else r.params
        key = (shape, r.tokens, r.seed, r.loss_kind, r.loss)
        if key in seen:
            raise ArchsearchError(f"run {name}", f"repeats run {seen[key]} (same shape, tokens, seed, loss kind and "
                                  "loss: a copied row); the fit would weigh that point twice",
                                  "drop the duplicate row")
        seen[key] = name
        if r.arch is not None:
            vocab.setdefault(r.arch.vocab_size, name)
    if len(vocab) > 1:
        raise ArchsearchError("vocab_size", f"the runs mix vocabulary sizes ({', '.join(f'{v} in run {n}' for v, n in sorted(vocab.items()))}); "
                              "the fit assumes one tokenizer, as a loss per token of another is not comparable",
                              "fit the runs of one tokenizer (a row without vocab_size counts as 32000)")


def read_runs(path: str | Path) -> list[RunRecord]:
    """Read runs from ``.csv`` or ``.jsonl``/``.json``; errors name the row and column."""
    p = check_input_file("--data", path)
    if p.suffix not in (".csv", ".jsonl", ".json"):
        raise ArchsearchError("--data", f"unknown format {p.suffix!r}", "use .csv or .jsonl")
    rows = read_table(p, str(p))
    return [_parse(r, f"{p.name} row {i}") for i, r in enumerate(rows, 1)]


def write_runs(path: str | Path, runs: Iterable[RunRecord]) -> Path:
    """Write runs as CSV or JSONL (by suffix), atomically."""
    p = Path(path)
    rows = [r.to_row() for r in runs]
    if p.suffix == ".csv":
        return write_table(p, rows, first=tuple(ROW_COLUMNS))
    atomic_write(p, "".join(json.dumps(r) + "\n" for r in rows))
    return p

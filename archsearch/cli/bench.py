"""``archsearch bench``: measure (or predict) inference speed of one architecture."""

from __future__ import annotations

import argparse
import json
import sys

from archsearch.benchmarks import append_jsonl, measure
from archsearch.cli._common import add_arch_args, arch_from_args, parse_int_list, print_json
from archsearch.cli._common import nonneg_int, out_file, pos_float, pos_int
from archsearch.benchmarks.base import BACKENDS, DTYPES, BenchSettings
from archsearch.benchmarks.calibration import Calibration
from archsearch.configio import field_defaults
from archsearch.errors import ArchsearchError


def register(sub) -> None:
    p = sub.add_parser(
        "bench", help="measure inference throughput/TTFT of a shape (vllm, sglang, hf, analytic)",
        description="Measure output/total tokens/s, TTFT, TPOT, latency and peak memory per "
                    "batch size, with dummy weights, one engine process per run (docs/method.md section 5). "
                    "'analytic' is a roofline prediction, never a measurement.")
    d = field_defaults(BenchSettings)  # one declaration of the defaults: the settings type's
    p.add_argument("--backend", required=True, choices=list(BACKENDS))
    add_arch_args(p)
    p.add_argument("--config-dir", dest="arch_file", metavar="DIR",
                   help="a folder with a Hugging Face config.json (same as --arch)")
    p.add_argument("--model-path", metavar="DIR",
                   help="a folder with real weights to load instead of dummy weights")
    p.add_argument("--batch-sizes", type=parse_int_list, default=d["batch_sizes"],
                   help=f"e.g. 1,8 (default {','.join(map(str, d['batch_sizes']))})")
    p.add_argument("--input-len", type=pos_int, default=d["input_len"])
    p.add_argument("--output-len", type=pos_int, default=d["output_len"])
    p.add_argument("--repeats", type=pos_int, default=d["repeats"])
    p.add_argument("--warmup", type=nonneg_int, default=d["warmup"])
    p.add_argument("--dtype", default=d["dtype"], choices=list(DTYPES),
                   help="auto: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--device-spec", help="device table entry for --backend analytic (e.g. H200, "
                                         "A100-40GB, cpu); default: this machine")
    p.add_argument("--calibration", metavar="FILE",
                   help="--backend analytic: a calibration file (python -m archsearch calibrate)")
    p.add_argument("--timeout", type=pos_float, default=d["timeout_s"], help="seconds per engine process")
    p.add_argument("--seed", type=nonneg_int, default=d["seed"])
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="extra engine keyword, value parsed as JSON when it can be "
                        "(e.g. --engine-arg enforce_eager=false); repeatable")
    p.add_argument("--engine-per-batch", action="store_true",
                   help="one engine process per batch size (max_num_seqs exactly that size)")
    p.add_argument("--log", type=out_file, metavar="FILE", help="keep the engine's output in FILE")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", type=out_file, metavar="FILE.jsonl", help="append the result to this JSONL file")
    p.set_defaults(func=_bench)


def _engine_args(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArchsearchError("--engine-arg", f"{item!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _bench(args: argparse.Namespace) -> int:
    engine_args = _engine_args(args.engine_arg)
    if args.calibration:
        if args.backend != "analytic":
            raise ArchsearchError("--calibration", "applies to --backend analytic only",
                                  "drop it, or predict with --backend analytic")

        # a missing or broken file, or one of another device, fails before any work
        Calibration.load(args.calibration).check_matches(args.device_spec, None, "--calibration")
        engine_args["calibration"] = str(args.calibration)
    settings = BenchSettings(
        backend=args.backend, batch_sizes=args.batch_sizes, input_len=args.input_len,
        output_len=args.output_len, warmup=args.warmup, repeats=args.repeats, dtype=args.dtype,
        timeout_s=args.timeout, device_spec=args.device_spec,
        engine_args=engine_args, seed=args.seed,
        engine_per_batch=args.engine_per_batch)
    spec = None if args.model_path else arch_from_args(args)
    if spec is not None and args.n_layers is not None:
        # a shape from flags has dummy weights and no trained context: size it for the run
        need = settings.input_len + settings.output_len
        spec = spec.replace(max_position_embeddings=max(spec.max_position_embeddings, need))
    result = measure(spec, settings, model_path=args.model_path, log_path=args.log)
    if args.out:
        append_jsonl(args.out, result)
    d = result.to_dict()
    if args.json:
        print_json(d)
    else:
        _print_table(d)
        if args.out:
            print(f"appended to {args.out}")
    failed = [b for b in result.per_batch if not b.ok]
    if len(failed) == len(result.per_batch):  # recorded above; the exit status and this line say it failed
        print(f"archsearch: measurement failed: {result.error}", file=sys.stderr)
        return 1
    if failed:  # one batch size's failure keeps the others (they are recorded and printed above)
        print("archsearch: " + "; ".join(f"batch size {b.batch_size} failed: {b.error}" for b in failed)
              + f"; the other {len(result.per_batch) - len(failed)} batch size(s) are measured", file=sys.stderr)
    return 0


def _fmt(v, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:,.{digits}f}"


def _print_table(d: dict) -> None:
    arch = d["architecture"]
    kind = "PREDICTION (roofline, not measured)" if d["predicted"] else "measurement"
    print(f"{d['backend']} {d['backend_version'] or ''} on {d['device']}, {d['dtype']} - {kind}")
    print(f"architecture {arch.get('name', '')}: {arch['n_layers']} layers, d={arch['hidden_size']}, "
          f"heads {arch['n_heads']}/{arch['n_kv_heads']}x{arch['head_dim']}, ffn {arch['ffn']}, "
          f"N={arch['n_params_non_embedding']:,}")
    s = d["settings"]
    print(f"input {s['input_len']} / output {s['output_len']} tokens, warm-up {s['warmup']}, "
          f"repeats {s['repeats']}")
    cal = ((s.get("engine") or d.get("engine") or {}).get("calibration") if d["predicted"] else None)
    if cal:
        print(f"calibrated: {cal['fitted_on']}" if isinstance(cal, dict) else cal)
    start = d["timing"].get("engine_start_s")
    if start is not None:
        print(f"engine start {start:.1f} s")
    hdr = (f"{'batch':>6} {'out tok/s':>12} {'+-':>8} {'total tok/s':>12} {'TTFT ms':>9} "
           f"{'p99 ms':>8} {'TPOT ms':>8} {'e2e s':>7} {'peak MiB':>9}")
    print(hdr)
    for b in d["per_batch"]:
        if not b["ok"]:
            print(f"{b['batch_size']:>6}  FAILED: {b['error']}")
            continue
        print(f"{b['batch_size']:>6} {_fmt(b['output_throughput']):>12} "
              f"{_fmt(b['output_throughput_std']):>8} {_fmt(b['total_throughput']):>12} "
              f"{_fmt(b['ttft_mean'], 1e3):>9} {_fmt(b['ttft_p99'], 1e3):>8} "
              f"{_fmt(b['tpot_mean'], 1e3, 2):>8} {_fmt(b['e2e_latency_mean'], 1, 3):>7} "
              f"{_fmt(b['peak_memory_bytes'], 2**-20, 0):>9}")
        if b.get("note"):
            print(f"{'':>6}  {b['note']}")

"""``archsearch bench``: measure (or predict) inference speed of one architecture."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from archsearch.benchmarks import append_jsonl, measure
from archsearch.cli._common import add_arch_args, arch_from_args, parse_int_list, print_json
from archsearch.cli._common import nonneg_int, out_file, parse_float_list, pos_float, pos_int
from archsearch.benchmarks.base import BACKENDS, DTYPES, BenchSettings
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks.online import (check_engine, check_feasible, check_port, load_from_args, measure_online,
                                          simulate_online, sweep_figure)
from archsearch.benchmarks.simulator import SLO
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
    o = p.add_argument_group("online serving (--mode online: docs/benchmarks.md, 'Online serving')")
    o.add_argument("--mode", choices=("offline", "online"), default="offline",
                   help="offline: static batches (the paper's metric); online: the engine's OpenAI-compatible "
                        "server (vllm, sglang) or the serving simulator (simulated) at each of --rates")
    o.add_argument("--rates", type=parse_float_list, metavar="R1,R2,...",
                   help="offered request rates (requests/s, Poisson arrivals), e.g. 0.5,1,2")
    o.add_argument("--n-requests", type=pos_int, default=16, help="requests per rate (default 16)")
    o.add_argument("--slo-ttft", type=pos_float, metavar="S", help="SLO: time to first token, seconds")
    o.add_argument("--slo-tpot", type=pos_float, metavar="S", help="SLO: time per output token, seconds")
    o.add_argument("--max-num-batched-tokens", type=pos_int,
                   help="the scheduler's token budget per step (default max(2048, --input-len))")
    o.add_argument("--port", type=int, help="the server's port on 127.0.0.1 (default: a free one)")
    o.add_argument("--plot", type=out_file, metavar="FILE.png",
                   help="the sweep's figure (default: --out's name with .png)")
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
    if args.mode == "online":
        return _online(args, engine_args)
    for flag in ("rates", "slo_ttft", "slo_tpot", "port", "plot", "max_num_batched_tokens"):
        if getattr(args, flag) is not None:
            raise ArchsearchError(f"--{flag.replace('_', '-')}", "applies to --mode online only",
                                  "add --mode online, or drop it")
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


def _online(args: argparse.Namespace, engine_args: dict) -> int:
    """``--mode online``: a sweep of --rates for one shape, measured by its server or simulated; every
    bad setting (an SLO or rate the step model says no engine meets, a port in use) fails before any work."""
    if not args.rates:
        raise ArchsearchError("--rates", "--mode online needs the offered rates", "e.g. --rates 0.5,1,2")
    if (args.slo_ttft is None) != (args.slo_tpot is None):
        raise ArchsearchError("--slo-ttft/--slo-tpot", "an SLO needs both", "give both, or neither (no goodput)")
    if not (args.plot or args.out):
        raise ArchsearchError("--plot", "the sweep's figure needs a file", "give --plot FILE.png or --out FILE.jsonl")
    if args.backend not in ("vllm", "sglang", "simulated"):
        raise ArchsearchError("--backend", f"{args.backend} has no online mode",
                              "use vllm or sglang (measured by its server) or simulated (predicted)")
    cal = None  # measured: only to check the SLO and rates before any work; simulated: its step times
    if args.calibration:
        cal = Calibration.load(args.calibration)
        cal.check_matches(args.device_spec, None, "--calibration")
    if args.backend == "simulated" and cal is None and args.device_spec and args.device_spec.lower() != "cpu":
        print("archsearch: simulating without --calibration: peak device figures, an optimistic bound", file=sys.stderr)
    settings = BenchSettings(backend=args.backend, batch_sizes=args.batch_sizes, input_len=args.input_len,
                             output_len=args.output_len, dtype=args.dtype, timeout_s=args.timeout,
                             device_spec=args.device_spec, engine_args=engine_args, seed=args.seed, repeats=1)
    slo = SLO(args.slo_ttft, args.slo_tpot) if args.slo_ttft is not None else None
    load = load_from_args(settings, args.n_requests, slo, args.max_num_batched_tokens)
    spec = arch_from_args(args)
    if args.n_layers is not None:
        spec = spec.replace(max_position_embeddings=max(spec.max_position_embeddings,
                                                        settings.input_len + settings.output_len))
    if args.backend != "simulated":
        check_engine(args.backend)
        if args.port is not None:
            check_port(args.port)
    dtype = "float32" if args.dtype == "auto" and (args.device_spec or "cpu").lower() == "cpu" else (
        "bfloat16" if args.dtype == "auto" else args.dtype)
    bounds = check_feasible(spec, load, args.rates, args.device_spec, dtype, cal)
    if args.backend == "simulated":
        sweep = simulate_online([spec], settings, load, args.rates, cal)
    else:
        sweep = measure_online([spec], settings, load, args.rates, port=args.port,
                               log_dir=Path(args.log).parent if args.log else None)
    sweep.timing["step_model_bounds"] = bounds
    if args.out:
        append_jsonl(args.out, sweep.to_dict())
    png = sweep_figure(sweep, args.plot or Path(args.out).with_suffix(".png"))
    d = sweep.to_dict()
    if args.json:
        print_json(d)
    else:
        kind = "PREDICTION (serving simulator)" if sweep.predicted else f"measured ({sweep.backend} server)"
        print(f"online sweep, {kind} on {sweep.device}: {load.input_len} in / {load.output_len} out, "
              f"{load.n_requests} requests per rate, max_num_seqs {load.max_num_seqs}"
              + (f", SLO TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1e3:g} ms" if slo else ""))
        print(f"{'rate/s':>7} {'req/s':>7} {'goodput':>8} {'out tok/s':>10} {'TTFT p50 ms':>12} {'p99 ms':>8} "
              f"{'TPOT p50 ms':>12} {'e2e p50 s':>10} {'failed':>6}")
        for r, m in zip(sweep.rates, sweep.metrics[0]):
            if m is None:
                print(f"{r:>7g}  FAILED")
                continue
            print(f"{r:>7g} {m['request_throughput']:>7.2f} {_fmt(m['goodput'], 1, 2):>8} "
                  f"{m['output_throughput']:>10.1f} {m['ttft_p50'] * 1e3:>12.1f} {m['ttft_p99'] * 1e3:>8.1f} "
                  f"{_fmt(m['tpot_p50'], 1e3, 2):>12} {m['e2e_p50']:>10.3f} {m['failed']:>6}")
        print(f"figure: {png}" + (f"; appended to {args.out}" if args.out else ""))
    for e in sweep.errors:
        print(f"archsearch: {e}", file=sys.stderr)
    return 1 if all(m is None for m in sweep.metrics[0]) else 0


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

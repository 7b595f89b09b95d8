"""``archsearch plan``: which candidate model to serve and LoRA-fine-tune under limits
(docs/method.md section 8, the constraint-driven planner)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

from archsearch.arch import weight_bytes
from archsearch.cli._common import nonneg_int, out_dir, parse_int_list, parse_number, pos_float, pos_int, print_json
from archsearch.benchmarks.base import DTYPES, BenchSettings, get_backend
from archsearch.configio import field_defaults
from archsearch.errors import ArchsearchError
from archsearch.fileio import write_json
from archsearch.hardware import device_key, get_device, local_device_name
from archsearch.planning import planner as pl
from archsearch.planning.cost import resolve_price
from archsearch.planning.limits import Limits
from archsearch.planning.lora import LoraSettings, parse_targets
from archsearch.provenance import provenance


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="pick the largest model within serving and LoRA fine-tuning limits (measured)",
        description="Measure each candidate with a real engine on a grid of batch size x prefill x "
                    "decode length, predict its LoRA fine-tune (adapter parameters, step memory and "
                    "time), keep those within every limit and recommend the largest; writes OUT/plan.json, "
                    "OUT/plan.png/.pdf and OUT/measurements.jsonl (resumable).")
    d = field_defaults(BenchSettings)
    p.add_argument("--candidates", nargs="+", required=True, metavar="MODEL",
                   help="preset names, Hugging Face folders (config.json, weights optional), study folders (chosen/)")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm", "sglang"],
                   help="the engine that measures (a real engine: the planner never predicts serving speed)")
    p.add_argument("--out", type=out_dir, required=True, help="output folder (measurements resume from it)")
    g = p.add_argument_group("grid")
    g.add_argument("--batch-sizes", type=parse_int_list, default=[1, 4])
    g.add_argument("--prefill-lens", type=parse_int_list, default=[128], help="prompt lengths, e.g. 128,512")
    g.add_argument("--decode-lens", type=parse_int_list, default=[32], help="output lengths, e.g. 32,128")
    g.add_argument("--repeats", type=pos_int, default=d["repeats"])
    g.add_argument("--warmup", type=nonneg_int, default=d["warmup"])
    g.add_argument("--dtype", default=d["dtype"], choices=list(DTYPES))
    g.add_argument("--timeout", type=pos_float, default=d["timeout_s"], help="seconds per engine process")
    g.add_argument("--torch-threads", type=pos_int, help="hf backend: torch threads (recorded)")
    lim = p.add_argument_group("serving limits (each optional; measured)")
    lim.add_argument("--max-tpot-s", type=pos_float, help="time per output token, seconds (e.g. 0.01)")
    lim.add_argument("--max-ttft-s", type=pos_float, help="time to first token, seconds")
    lim.add_argument("--serve-max-memory-gib", type=pos_float, help="peak memory of serving, GiB")
    flim = p.add_argument_group("fine-tuning limits (each optional; predicted)")
    flim.add_argument("--finetune-max-memory-gib", type=pos_float, help="peak memory of the fine-tuning step, GiB")
    flim.add_argument("--max-finetune-hours", type=pos_float, help="predicted fine-tuning wall time, hours")
    flim.add_argument("--max-finetune-minutes", type=pos_float, help="the same in minutes (give one of the two)")
    flim.add_argument("--max-finetune-cost", type=pos_float, metavar="USD",
                      help="predicted fine-tuning cost: hours x the device's price (--price or the device table)")
    flim.add_argument("--price", type=pos_float, metavar="USD_PER_HOUR", help="price of the fine-tuning device per hour")
    lim.add_argument("--max-peak-memory-gib", type=pos_float,
                     help="one limit for both serving and fine-tuning memory (older form of "
                          "--serve-max-memory-gib plus --finetune-max-memory-gib)")
    ft = p.add_argument_group("LoRA fine-tune to plan: the search (variant x rank x targets x batch size)")
    ft.add_argument("--lora-variants", default="lora",
                    help="comma-separated: lora (base in the compute dtype), qlora (NF4 base, double-quantised), "
                         "lora-int8 (LLM.int8() base) (default lora)")
    ft.add_argument("--lora-ranks", type=parse_int_list, help="ranks to search, e.g. 8,16,64")
    ft.add_argument("--lora-rank", type=pos_int, help="one rank (default 8)")
    ft.add_argument("--lora-target-sets", help="target sets to search, separated by ';': each comma-separated "
                    "module names or groups (attention, mlp, experts, all-dense, all-moe), e.g. 'attention;all-dense'")
    ft.add_argument("--lora-targets", help="one target set (default attention: q_proj,k_proj,v_proj,o_proj)")
    ft.add_argument("--finetune-tokens", type=parse_number, default=1e6)
    ft.add_argument("--finetune-batch-sizes", type=parse_int_list, help="batch sizes to search, e.g. 1,2,4,8,16,32")
    ft.add_argument("--finetune-batch-size", type=pos_int, help="one batch size (default 8)")
    ft.add_argument("--finetune-seq-len", type=pos_int, default=512)
    ft.add_argument("--finetune-dtype", choices=["float32", "bfloat16", "float16"],
                    help="compute dtype of the step (default float32 on cpu, bfloat16 on a GPU)")
    ft.add_argument("--finetune-device", default=None,
                    help="device table entry the fine-tune runs on (default: this machine)")
    ft.add_argument("--mfu", type=pos_float, help="model FLOP utilisation for the step time (uncalibrated; "
                    "default: planning's assumed 0.40)")
    cal = ft.add_mutually_exclusive_group()
    cal.add_argument("--lora-calibration", metavar="JSON",
                     help="achieved FLOP/s of a real LoRA step on the fine-tuning device (bench_lora_step's "
                          "calibration-cpu.json, or an earlier plan's lora_calibration.json): calibrates the step time")
    cal.add_argument("--calibrate-lora", action="store_true",
                     help="measure one short real LoRA step (peft) of each candidate on this machine first and "
                          "calibrate its step time on it (OUT/lora_calibration/<candidate>.json, reused)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    # every check is arithmetic and happens before anything is measured or written
    for one, many in (("lora_rank", "lora_ranks"), ("lora_targets", "lora_target_sets"),
                      ("finetune_batch_size", "finetune_batch_sizes"), ("max_finetune_hours", "max_finetune_minutes")):
        if getattr(args, one) is not None and getattr(args, many) is not None:
            raise ArchsearchError(f"--{many.replace('_', '-')}", f"given together with --{one.replace('_', '-')}",
                                  "give one of them")
    for new in ("serve_max_memory_gib", "finetune_max_memory_gib"):
        if args.max_peak_memory_gib is not None and getattr(args, new) is not None:
            raise ArchsearchError("--max-peak-memory-gib", f"given together with --{new.replace('_', '-')}",
                                  "use --serve-max-memory-gib and --finetune-max-memory-gib (the older flag sets both)")
    serve_mem = args.serve_max_memory_gib if args.max_peak_memory_gib is None else args.max_peak_memory_gib
    ft_mem = args.finetune_max_memory_gib if args.max_peak_memory_gib is None else args.max_peak_memory_gib
    max_hours = args.max_finetune_hours if args.max_finetune_minutes is None else args.max_finetune_minutes / 60
    ranks = tuple(args.lora_ranks) if args.lora_ranks else ((args.lora_rank,) if args.lora_rank else (8,))
    sets = ([parse_targets(t) for t in args.lora_target_sets.split(";") if t.strip()] if args.lora_target_sets
            else [parse_targets(args.lora_targets or "attention")])
    lora = LoraSettings(rank=ranks[0], targets=sets[0])
    if not (args.finetune_tokens > 0):
        raise ArchsearchError("--finetune-tokens", f"must be positive, got {args.finetune_tokens!r}")
    limits = Limits(max_ttft_s=args.max_ttft_s, max_tpot_s=args.max_tpot_s, max_peak_memory_gib=serve_mem)
    grid = pl.PlanGrid(tuple(args.batch_sizes), tuple(args.prefill_lens), tuple(args.decode_lens))
    candidates = [pl.resolve_option(c) for c in args.candidates]
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ArchsearchError("--candidates", f"a candidate is named twice in {names}")
    if args.finetune_device is None:
        args.finetune_device = local_device_name() or "cpu"
    calibration = None
    if (args.lora_calibration or args.calibrate_lora) and args.mfu is not None:
        raise ArchsearchError("--mfu", "given together with a LoRA calibration", "give one of them")
    if args.lora_calibration:
        calibration = pl.LoraCalibration.load(args.lora_calibration)
        # refuses a calibration from another device (q_proj: an adapter every model has)
        pl.predict_lora_step_time(candidates[0].spec, LoraSettings(lora.rank, ("q_proj",)), 1, 8,
                                  args.finetune_device, calibration=calibration)
    if args.calibrate_lora:
        here = local_device_name()
        if here is None or device_key(args.finetune_device) != device_key(here):
            raise ArchsearchError("--calibrate-lora", f"this machine is {here}, the fine-tune is planned on "
                                  f"{args.finetune_device}", "calibrate on that device and pass --lora-calibration")
    variants = tuple(v.strip() for v in args.lora_variants.split(",") if v.strip())
    finetune = pl.FinetunePlan(lora=lora, tokens=args.finetune_tokens, batch_size=args.finetune_batch_size or 8,
                               seq_len=args.finetune_seq_len, max_hours=max_hours,
                               device=args.finetune_device, mfu=args.mfu, calibration=calibration,
                               variants=variants, ranks=ranks, target_sets=tuple(sets),
                               batch_sizes=tuple(args.finetune_batch_sizes or ()), dtype=args.finetune_dtype,
                               max_memory_gib=ft_mem, max_cost_usd=args.max_finetune_cost,
                               price_per_hour=args.price)
    if finetune.max_cost_usd is not None:
        price = resolve_price(get_device(finetune.device), finetune.price_per_hour)
        if price.usd_per_hour is None:
            raise ArchsearchError("--max-finetune-cost", f"a cost limit on {finetune.device}, which has no price",
                                  "give --price USD_PER_HOUR, or plan on a device of the table (--finetune-device)")
    # a lower bound of the weights' memory: "auto" is bfloat16 on a GPU, float32 on CPU
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    if limits.max_peak_memory_gib is not None:
        least = min(weight_bytes(c.spec, dtype) / 2**30 for c in candidates)
        if least > limits.max_peak_memory_gib:
            flag = "--max-peak-memory-gib" if args.max_peak_memory_gib is not None else "--serve-max-memory-gib"
            raise ArchsearchError(flag, f"{limits.max_peak_memory_gib:g} GiB is unsatisfiable for serving: the "
                                  f"smallest candidate's weights alone take {least:.4g} GiB at {dtype}",
                                  "raise the limit or add a smaller candidate")
    for c in candidates:  # some target set of the search must apply to every candidate
        pl.search_finetune(c.spec, finetune)
    if args.torch_threads and args.backend != "hf":
        raise ArchsearchError("--torch-threads", f"sets the hf backend's torch threads, not {args.backend}'s",
                              "leave it out with --backend " + args.backend)
    engine_args = {"torch_threads": args.torch_threads} if args.torch_threads else {}
    settings_kw = {"backend": args.backend, "repeats": args.repeats, "warmup": args.warmup, "dtype": args.dtype,
                   "timeout_s": args.timeout, "engine_args": engine_args}
    BenchSettings(**settings_kw, batch_sizes=list(grid.batch_sizes), input_len=max(grid.prefill_lens),
                  output_len=max(grid.decode_lens))  # bad grid/settings fail here, before any work

    get_backend(args.backend).check_available()
    out = Path(args.out)
    # per candidate: its own calibration (--calibrate-lora), else the given one, else none
    cals: dict[str, pl.LoraCalibration | str | None] = {c.name: None for c in candidates}
    if args.calibrate_lora:  # the measurements the fine-tune budget check below needs
        # the memory limit needs no time: checked before calibrating
        _fail_if_unreachable(pl.finetune_unreachable({c.name: c.spec for c in candidates}, dataclasses.replace(
            finetune, max_hours=None, max_cost_usd=None)), args)
        cals = pl.calibrate_lora(candidates, finetune, out, threads=args.torch_threads)
    _fail_if_unreachable(pl.finetune_unreachable(
        {c.name: c.spec for c in candidates}, finetune,
        {n: (v if isinstance(v, pl.LoraCalibration) else None) for n, v in cals.items()}), args)
    measured = pl.measure_grid(candidates, grid, settings_kw, out)
    plans = [pl.plan_option(c, grid, measured, args.backend, limits, finetune, cals[c.name]) for c in candidates]
    best = pl.recommend(plans)
    problems = pl.unsatisfiable(plans, limits, finetune)
    command = note = None
    if best is not None:
        cand = candidates[names.index(best.name)]
        command, note = pl.finetune_command(best, cand, finetune, out)
    doc = {"kind": "plan", "backend": args.backend, "grid": {"batch_sizes": list(grid.batch_sizes),
           "prefill_lens": list(grid.prefill_lens), "decode_lens": list(grid.decode_lens)},
           "limits": {"serving": limits.to_dict(),
                      "finetune": {"max_memory_gib": finetune.max_memory_gib, "max_hours": finetune.max_hours,
                                   "max_cost_usd": finetune.max_cost_usd}},
           "finetune": {"variants": list(finetune.variants), "ranks": list(ranks),
                        "target_sets": [list(t) for t in sets], "batch_sizes": list(finetune.batches()),
                        "tokens": finetune.tokens, "dtype": finetune.compute_dtype,
                        "seq_len": finetune.seq_len, "device": finetune.device, "rule": pl.FINETUNE_RULE,
                        "step_time": ("calibrated on each candidate's own real LoRA step (--calibrate-lora)"
                                      if args.calibrate_lora else finetune.calibration.describe() if finetune.calibration
                                      else "uncalibrated: MFU x peak (pass --calibrate-lora or --lora-calibration)"),
                        "calibration": finetune.calibration.to_dict() if finetune.calibration else None},
           "candidates": [pl.plan_to_dict(cp) for cp in plans],
           "recommended": best.name if best else None, "finetune_command": command, "finetune_note": note,
           "unsatisfiable": problems, "measurements": str(out / pl.MEASUREMENTS)}

    write_json(out / "plan.json", {**doc, "provenance": provenance(extra_packages=("peft",))})
    png = pl.plot_tradeoff(plans, out / "plan.png", limits, best)
    doc["figure"] = str(png)
    if args.json:
        print_json(doc)
    else:
        _print(plans, best, command, note, problems, out, png)
        print(f"LoRA step time: {doc['finetune']['step_time']}")
    if best is None:
        raise ArchsearchError("limits", "no candidate is within every limit: " +
                              ("; ".join(problems) if problems else
                               "; ".join(f"{cp.name}: {', '.join(cp.reasons)}" for cp in plans)),
                              f"see {out / 'plan.json'}")
    return 0


def _fail_if_unreachable(problems: list[str], args: argparse.Namespace) -> None:
    """One error naming the first unreachable fine-tuning limit (the flag as given) and every line."""
    if not problems:
        return
    flags = {"finetune_max_memory_gib": "--max-peak-memory-gib" if args.max_peak_memory_gib is not None
             else "--finetune-max-memory-gib",
             "max_finetune_hours": "--max-finetune-minutes" if args.max_finetune_minutes is not None
             else "--max-finetune-hours", "max_finetune_cost_usd": "--max-finetune-cost"}
    flag = flags.get(problems[0].split("=")[0], "limits")
    raise ArchsearchError(flag, "; ".join(problems), "raise the limit, add a smaller candidate, search more "
                          "variants or batch sizes, or plan fewer --finetune-tokens")


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f}"


def _print(plans, best, command, note, problems, out: Path, png: Path) -> None:
    print(f"{'candidate':<20} {'params':>12} {'batch':>5} {'prefill':>7} {'decode':>6} {'TTFT ms':>9} "
          f"{'TPOT ms':>8} {'peak GiB':>8} {'out tok/s':>10}  within limits")
    for cp in plans:
        for p in cp.points:
            mem = "-" if p.peak_memory_gib is None else f"{p.peak_memory_gib:.2f}"
            tput = "-" if p.output_throughput is None else f"{p.output_throughput:,.1f}"
            print(f"{cp.name[:20]:<20} {cp.params:>12,} {p.batch_size:>5} {p.prefill:>7} {p.decode:>6} "
                  f"{_ms(p.ttft_s):>9} {_ms(p.tpot_s):>8} {mem:>8} {tput:>10}  "
                  f"{'yes' if p.within_limits else 'no: ' + p.reason}")
    print()
    print(f"{'candidate':<20} {'variant':>9} {'rank':>4} {'batch':>5} {'LoRA params':>12} {'step mem GiB':>12} "
          f"{'step s (pred)':>13} {'hours (pred)':>12} {'cost $':>8}  verdict")
    for cp in plans:
        lo = cp.lora
        cost = "-" if lo["cost_usd"] is None else f"{lo['cost_usd']:.4g}"
        print(f"{cp.name[:20]:<20} {lo['variant']:>9} {lo['rank']:>4} {lo['batch_size']:>5} {lo['trainable_params']:>12,} "
              f"{lo['peak_memory_gib']:>12.3f} {lo['step_s']:>13.4g} {lo['hours']:>12.4g} {cost:>8}  "
              f"{'within every limit' if cp.feasible else '; '.join(cp.reasons)}")
        print(f"  targets {','.join(lo['targets'])}; {len(lo['search'])} configurations searched, "
              f"{sum(x['within_limits'] for x in lo['search'])} within the fine-tuning limits")
    print(f"  fine-tune chosen: {pl.FINETUNE_RULE}")
    for cp in plans:
        print(f"  {cp.name}: LoRA step time {cp.lora['time_method']}")
    for line in problems:
        print(f"unsatisfiable: {line}")
    print(f"plan written to {out / 'plan.json'}, figure {png} (+ .pdf), measurements {out / 'measurements.jsonl'}")
    if best is not None:
        lo = best.lora
        print(f"recommended: {best.name} ({best.params:,} parameters), {lo['variant']} rank {lo['rank']} on "
              f"{','.join(lo['targets'])}, batch {lo['batch_size']}: {lo['peak_memory_gib']:.3g} GiB, "
              f"{lo['hours'] * 60:.3g} min predicted")
        print("fine-tune it with:")
        print("  " + shlex.join(command))
        print(f"  ({note})")

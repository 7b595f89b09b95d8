"""``archsearch plan``: which candidate model to serve and LoRA-fine-tune under limits
(docs/method.md section 8, the constraint-driven planner)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

from archsearch.cli._common import nonneg_int, out_dir, parse_int_list, parse_number, pos_float, pos_int, print_json
from archsearch.benchmarks.base import BACKENDS, DTYPES, backend_class
from archsearch.configio import field_defaults
from archsearch.errors import ArchsearchError
from archsearch.planning.planner import FINETUNE_RULE
from archsearch.planning.request import PlanRequest, plan_deployment


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="pick the largest model within serving and LoRA fine-tuning limits (measured)",
        description="Measure each candidate with a real engine on a grid of batch size x prefill x "
                    "decode length, predict its LoRA fine-tune (adapter parameters, step memory and "
                    "time), keep those within every limit and recommend the largest; writes OUT/plan.json, "
                    "OUT/plan.png/.pdf and OUT/measurements.jsonl (resumable).")
    d = field_defaults(PlanRequest)
    p.add_argument("--candidates", nargs="+", required=True, metavar="MODEL",
                   help="preset names, Hugging Face folders (config.json, weights optional), study folders (chosen/)")
    p.add_argument("--backend", default="hf", choices=[b for b in BACKENDS if not backend_class(b).predicted],
                   help="the engine that measures (a real engine: the planner never predicts serving speed)")
    p.add_argument("--out", type=out_dir, required=True, help="output folder (measurements resume from it)")
    g = p.add_argument_group("grid")
    g.add_argument("--batch-sizes", type=parse_int_list, default=d["batch_sizes"])
    g.add_argument("--prefill-lens", type=parse_int_list, default=d["prefill_lens"], help="prompt lengths, e.g. 128,512")
    g.add_argument("--decode-lens", type=parse_int_list, default=d["decode_lens"], help="output lengths, e.g. 32,128")
    g.add_argument("--repeats", type=pos_int, default=d["repeats"])
    g.add_argument("--warmup", type=nonneg_int, default=d["warmup"])
    g.add_argument("--dtype", default=d["dtype"], choices=list(DTYPES))
    g.add_argument("--timeout", type=pos_float, default=d["timeout"], help="seconds per engine process")
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
    req = PlanRequest(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PlanRequest)})
    r = plan_deployment(req)  # every check before any measurement; then measure, plan, write plan.json
    if args.json:
        print_json(r.doc)
    else:
        _print(r.plans, r.best, r.command, r.note, r.problems, r.out, r.figure)
        print(f"LoRA step time: {r.doc['finetune']['step_time']}")
    if r.best is None:
        raise ArchsearchError("limits", "no candidate is within every limit: " +
                              ("; ".join(r.problems) if r.problems else
                               "; ".join(f"{cp.name}: {', '.join(cp.reasons)}" for cp in r.plans)),
                              f"see {r.out / 'plan.json'}")
    return 0


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
    print(f"  fine-tune chosen: {FINETUNE_RULE}")
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

"""``archsearch eval``: evaluate a model with lm-evaluation-harness (docs/method.md section 7)."""

from __future__ import annotations

import argparse
import math

from archsearch.cli._common import out_file, pos_int, print_json
from archsearch.errors import ArchsearchError
from archsearch.evaluation.runner import evaluate
from archsearch.evaluation.suites import list_tasks


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="evaluate a model with lm-evaluation-harness",
        description="Run lm-eval on a local HF folder, a trainers run folder or a named reference "
                    "model (smollm2-135m), or a Hub id ORG/NAME where huggingface.co is reachable. The 'offline' suite is shipped in the repo and needs no "
                    "network; Hub tasks need huggingface.co or a cached dataset.")
    p.add_argument("--model", help="HF folder, trainers run folder, a named model (smollm2-135m) or a Hub id")
    p.add_argument("--tasks", default="offline",
                   help="comma-separated suites and/or lm-eval tasks (default: offline)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                   help="hf: in-process transformers model (default); vllm: lm-eval's vLLM backend")
    p.add_argument("--limit", type=_limit, help="at most N documents per task (a float < 1 is a fraction)")
    p.add_argument("--batch-size", type=pos_int, default=8)
    p.add_argument("--model_args", "--model-args", dest="model_args", metavar="K=V,...",
                   help="passed to lm-eval's model class, as in lm-eval (e.g. max_length=512)")
    p.add_argument("--num_fewshot", "--num-fewshot", dest="num_fewshot", type=int,
                   help="few-shot examples per prompt, as in lm-eval (default: each task's own, 0 here)")
    p.add_argument("--bootstrap_iters", "--bootstrap-iters", dest="bootstrap_iters", type=_nonneg_int,
                   default=100_000, help="resamples for bootstrapped standard errors, as in lm-eval "
                                         "(default 100000; 0 skips them)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if present, else cpu)")
    p.add_argument("--json", action="store_true", help="print lm-eval's results structure as JSON")
    p.add_argument("--out", type=out_file, metavar="FILE", help="also write the JSON results to FILE")
    p.add_argument("--list-tasks", action="store_true", help="list the suites and their tasks, then exit")
    p.set_defaults(func=_eval)


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return v


def _limit(text: str) -> int | float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number (N documents, or a fraction below 1)")
    return int(v) if v >= 1 and v.is_integer() else v


def _eval(args: argparse.Namespace) -> int:
    if args.list_tasks:
        listing = list_tasks()
        if args.json:
            print_json(listing)
            return 0
        for name, s in listing["suites"].items():
            net = "needs network" if s["network"] else "offline"
            print(f"{name}  ({net}) {s['help']}")
            for t in s["tasks"]:
                print(f"  {t:<22} {listing['tasks'][t]}")
        print("Any other lm-eval task name is accepted too (lm-eval --tasks list).")
        return 0
    if not args.model:
        raise ArchsearchError("--model", "is required", "e.g. --model smollm2-135m, or a model folder")

    res = evaluate(args.model, args.tasks, backend=args.backend, limit=args.limit,
                   batch_size=args.batch_size, device=args.device, out=args.out,
                   model_args=args.model_args, num_fewshot=args.num_fewshot,
                   bootstrap_iters=args.bootstrap_iters)
    if args.json:
        print_json(res)
    else:
        print_results(res)
        if args.out:
            print(f"results written to {args.out}")
    return 0


def print_results(res: dict) -> None:
    """A table: task, metric, value, standard error, documents evaluated."""
    a = res["archsearch"]
    print(f"model {a['model']['name']} ({a['model']['kind']}), backend {a['backend']}, "
          f"device {a['device']}, limit {a['limit']}")
    rows = [("task", "metric", "value", "stderr", "n")]
    for task, metrics in res["results"].items():
        n = res.get("n-samples", {}).get(task, {}).get("effective", "")
        for key, value in metrics.items():
            if key in ("alias", "name", "sample_len") or "_stderr," in key:
                continue
            metric, _, _filter = key.partition(",")
            err = metrics.get(f"{metric}_stderr,{_filter}", "")
            rows.append((task, metric, _fmt(value), _fmt(err), str(n)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.1f}"
    return str(v)

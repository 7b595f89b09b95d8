"""``archsearch eval``: evaluate a model with lm-evaluation-harness (docs/method.md section 7)."""

from __future__ import annotations

import argparse
import contextlib
import io
import math

from archsearch.cli._common import out_dir, out_file, pos_int, print_json
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
    p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=pos_int, default=8,
                   help="requests per forward pass, as in lm-eval (default 8)")
    p.add_argument("--model_args", "--model-args", dest="model_args", metavar="K=V,...",
                   help="passed to lm-eval's model class, as in lm-eval (e.g. max_length=512)")
    p.add_argument("--num_fewshot", "--num-fewshot", dest="num_fewshot", type=int,
                   help="few-shot examples per prompt, as in lm-eval (default: each task's own, 0 here)")
    p.add_argument("--bootstrap_iters", "--bootstrap-iters", dest="bootstrap_iters", type=_nonneg_int,
                   default=100_000, help="resamples for bootstrapped standard errors, as in lm-eval "
                                         "(default 100000; 0 skips them)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if present, else cpu)")
    p.add_argument("--json", action="store_true", help="print lm-eval's results structure as JSON")
    p.add_argument("--output_path", "--output-path", dest="output_path", type=out_dir, metavar="DIR",
                   help="write lm-eval's own layout under DIR (DIR/<model>/results_<time>.json, as lm_eval "
                        "--output_path), and keep a request cache there: a rerun resumes where it stopped")
    p.add_argument("--log_samples", "--log-samples", dest="log_samples", action="store_true",
                   help="with --output_path: also write every document's prompt and answers "
                        "(samples_<task>_<time>.jsonl), as lm_eval --log_samples")
    p.add_argument("--use_cache", "--use-cache", dest="use_cache", metavar="PATH",
                   help="lm-eval's request cache (a SQLite file prefix): answered requests are kept as they "
                        "come, so an interrupted run resumes (default with --output_path: under DIR)")
    p.add_argument("--out", type=out_file, metavar="FILE", help="also write the JSON results (lm-eval's "
                                                               "structure and provenance) to FILE")
    p.add_argument("--list-tasks", action="store_true", help="list the suites and their tasks, then exit")
    p.set_defaults(func=_eval, on_interrupt=_on_interrupt)


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
    if args.log_samples and not args.output_path:
        raise ArchsearchError("--log_samples", "needs --output_path DIR (where lm-eval writes the samples)",
                              "add --output_path DIR, as with lm_eval")

    # -q: lm-eval's progress bars pass disable= themselves (so TQDM_DISABLE cannot reach them) and
    # write to the sys.stderr of the moment; its log records are already held back by -q
    quiet = getattr(args, "verbosity", 0) < 0
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        res = evaluate(args.model, args.tasks, backend=args.backend, limit=args.limit,
                       batch_size=args.batch_size, device=args.device, out=args.out,
                       model_args=args.model_args, num_fewshot=args.num_fewshot,
                       bootstrap_iters=args.bootstrap_iters, output_path=args.output_path,
                       log_samples=args.log_samples, use_cache=args.use_cache)
    if args.json:
        print_json(res)
    else:
        print_results(res)
        if args.out:
            print(f"results written to {args.out}")
        if res["archsearch"].get("output_path"):
            print(f"lm-eval's results{' and samples' if args.log_samples else ''} written under "
                  f"{res['archsearch']['output_path']}")
    return 0


def _on_interrupt(args: argparse.Namespace) -> str:
    """What an interrupted ``eval`` keeps: with a request cache, every answered request."""
    if args.output_path or args.use_cache:
        return ("the requests answered so far are in lm-eval's request cache: "
                "run the same command again to resume")
    return "nothing was kept (give --output_path DIR to keep answered requests and resume)"


def print_results(res: dict) -> None:
    """lm-eval's markdown table (as ``lm_eval`` prints it), under one line naming the model."""
    from lm_eval.utils import make_table

    a = res["archsearch"]
    print(f"model {a['model']['name']} ({a['model']['kind']}), backend {a['backend']}, "
          f"device {a['device']}, limit {a['limit']}, batch_size {a['batch_size']}")
    print(make_table(res))
    if res.get("groups"):
        print(make_table(res, "groups"))

"""``archsearch estimate``: training time, GPU-hours and cost; ``estimate fit``: the time law
from measured runs; ``estimate memory``: predicted peak memory and the largest batch."""

from __future__ import annotations

import argparse
from pathlib import Path

from archsearch.arch import sparsity
from archsearch.bounds import check_at_most
from archsearch.cli._common import parse_number, print_json, print_table
from archsearch.cli._common import fraction, nonneg_float, out_file, pos_int
from archsearch.errors import ArchsearchError
from archsearch.fileio import write_json
from archsearch.planning import (estimate_training, fit_time_law, max_inference_batch, max_training_batch, parse_gpus,
                                 predict_inference_memory, predict_training_memory, resolve_price)
from archsearch.planning.batchlaws import (estimate_from_batch_laws, fit_max_batch_law, fit_throughput_law, load_batch_laws,
                                          load_max_batch_law, model_memory_bytes, read_points, with_active_experts)
from archsearch.planning.finetune import max_finetune_batch, predict_finetune_memory
from archsearch.planning.formats import parse_format
from archsearch.planning.lora import LoraSettings, check_lora_targets, parse_targets
from archsearch.presets import load_arch
from archsearch.rundata import read_runs


def register(sub) -> None:
    p = sub.add_parser(
        "estimate", help="training time, GPU-hours and cost of an architecture",
        description="Estimate training time and cost, with every assumption printed. "
                    "Subcommands: 'fit' fits a time law to measured runs, 'memory' predicts "
                    "peak memory and the largest batch.")
    p.add_argument("--arch", "--preset", help="a preset name, a folder with config.json, or an architecture JSON")
    p.add_argument("--tokens", type=parse_number, help="training tokens D (e.g. 2e10, 20B)")
    p.add_argument("--gpus", default="8xH100", help="COUNTxDEVICE, DEVICE or cpu (default 8xH100)")
    p.add_argument("--tp", type=pos_int, default=1, help="tensor parallel degree (default 1)")
    p.add_argument("--pp", type=pos_int, default=1, help="pipeline parallel degree (default 1)")
    p.add_argument("--mfu", type=fraction, help="model FLOPs utilisation in (0, 1] "
                                             "(default: the law's measured one, else 0.40 assumed)")
    p.add_argument("--price", type=nonneg_float, help="USD per GPU-hour (default: archsearch.hardware table)")
    p.add_argument("--law", metavar="TIME_LAW.json", help="a time law from 'archsearch estimate fit'")
    p.add_argument("--batch-laws", metavar="LAWS.json",
                   help="fitted max-batch and throughput laws ('estimate batch-laws'): their answer "
                        "is shown beside the analytic one")
    p.add_argument("--dtype", default="bfloat16", help="training compute dtype (default bfloat16)")
    p.add_argument("--seq-len", type=pos_int, default=None,
                   help=f"sequence length for the memory check (default {DEFAULT_SEQ_LEN}; at most the model's positions)")
    p.add_argument("--parallelism", default="ddp", choices=["ddp", "zero1", "zero2", "fsdp"])
    _finetune_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_estimate)
    sp = p.add_subparsers(dest="estimate_command", metavar="SUBCOMMAND", parser_class=type(p))

    f = sp.add_parser("fit", help="fit the training-time law to runs with wall_time_s (scaling-law smart tuning)",
                      description="Fit T(N, D, TP, PP) (analytic, Amdahl, power; each with and "
                                  "without a boosted residual) and keep the best by cross-validated MAE. "
                                  "Collecting the runs is the source paper's scaling-law smart tuning: time "
                                  "short runs of small models on few tokens, fit the law, predict the full "
                                  "run (benchmarks/scripts/bench_planning.py does it here; docs/planning.md). "
                                  "Published coefficients: archsearch.planning.TimeLaw.from_coefficients.")
    f.add_argument("--data", required=True, help="runs (.csv or .jsonl, the rundata format)")
    f.add_argument("--holdout", help="runs to predict and report, never used for the fit")
    f.add_argument("--out", type=out_file, required=True, metavar="TIME_LAW.json")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=_fit)

    b = sp.add_parser("batch-laws", help="fit the max-batch and throughput-vs-batch laws (docs/method.md section 8)",
                      description="Fit throughput = C2*log(batch/(sparsity*C3)) + C4 and max batch = "
                                  "floor(C0*(M_gpu - M_model)/(seq_len*((1-C1) + C1*sparsity))) to "
                                  "measurements: 'bench --out' results or training-step timings.")
    b.add_argument("--data", required=True, help="JSONL: bench --out results or training timings")
    b.add_argument("--holdout", help="measurements of the same kind and device to predict, never fitted")
    b.add_argument("--out", required=True, type=out_file, metavar="LAWS.json")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=_batch_laws)

    m = sp.add_parser("memory", help="predicted peak memory (inference and training) and max batch")
    m.add_argument("--arch", "--preset", required=True, help="a preset name, a folder with config.json, or an architecture JSON")
    m.add_argument("--gpus", default="H100", help="device for the max-batch answer (default H100)")
    m.add_argument("--batch", type=pos_int, default=16, help="inference batch size (default 16)")
    m.add_argument("--input-len", type=pos_int, default=4096)
    m.add_argument("--output-len", type=pos_int, default=1024)
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--micro-batch", type=pos_int, default=1, help="training micro-batch per device")
    m.add_argument("--seq-len", type=pos_int, default=None,
                   help=f"training sequence length (default {DEFAULT_SEQ_LEN}; at most the model's positions)")
    m.add_argument("--tp", type=pos_int, default=1)
    m.add_argument("--pp", type=pos_int, default=1)
    m.add_argument("--parallelism", default="ddp", choices=["ddp", "zero1", "zero2", "fsdp"])
    _finetune_args(m)
    m.add_argument("--max-batch-law", metavar="published:NAME|LAWS.json",
                   help="a max-batch law (docs/method.md section 8) to answer beside the accounting, e.g. "
                        "published:xia2024-mixtral (C0 = 82, C1 = 0.95), with M_model set by --finetune/--weight-format")
    m.add_argument("--experts-per-token", type=pos_int,
                   help="MoE: experts routed per token (the number of experts = the dense fine-tune)")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=_memory)


def _finetune_args(p) -> None:
    g = p.add_argument_group("what is trained (training memory)")
    g.add_argument("--finetune", default="full", choices=["full", "lora", "qlora"],
                   help="full: every weight with AdamW (default); lora: adapters on a frozen base; "
                        "qlora: adapters on a 4-bit NF4 base")
    g.add_argument("--weight-format", help="frozen base weights: bf16, fp16, fp32, int8, nf4 (double-quantised), "
                                            "nf4-nodq (default: the dtype; nf4 with --finetune qlora)")
    g.add_argument("--lora-rank", type=pos_int, default=8, help="adapter rank (lora, qlora)")
    g.add_argument("--lora-targets", default="attention",
                   help="modules or groups: attention, mlp, experts, router, all-dense, all-moe, or names "
                        "(q_proj,...,experts.gate_up_proj,mlp.gate.weight) (default attention)")
    g.add_argument("--lora-expert-layout", choices=["fused", "per-expert"], default="fused",
                   help="experts as transformers >= 5 holds them (fused 3-D tensors; peft merges W + BA) or as "
                        "transformers 4.x did (per-expert nn.Linear, the MoE cost paper's) (default fused)")


def _finetune_settings(args: argparse.Namespace, spec):
    """(method, LoraSettings or None, weight format text or None), checked against the model."""
    fmt = args.weight_format
    if fmt is not None:
        parsed = parse_format(fmt)
        if args.finetune == "full" and parsed.quantised:
            raise ArchsearchError("--weight-format", f"{fmt} with --finetune full (a quantised base is frozen)",
                                  "use --finetune lora or qlora")
        if args.finetune == "qlora" and parsed.name != "nf4":
            raise ArchsearchError("--weight-format", f"{fmt} with --finetune qlora (QLoRA's base is NF4)",
                                  "leave --weight-format out, or use --finetune lora with it")
    if args.finetune == "full":
        return "full", None, fmt
    lora = LoraSettings(args.lora_rank, parse_targets(args.lora_targets), args.lora_expert_layout)
    check_lora_targets(spec, lora)
    return args.finetune, lora, fmt


DEFAULT_SEQ_LEN = 2048


def _check_seq_len(args: argparse.Namespace, spec) -> None:
    """``args.seq_len`` set: the given one, no longer than the model's positions (beyond them a
    run attends where the model never learned to, and the memory answer would be for a run that
    cannot be made), else :data:`DEFAULT_SEQ_LEN`."""
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
        return
    check_at_most("--seq-len", args.seq_len, spec.max_position_embeddings,
                  f"the model has {spec.max_position_embeddings:,} positions (max_position_embeddings)")


def _require(args: argparse.Namespace, *names: str) -> None:
    for n in names:
        if getattr(args, n) is None:
            raise ArchsearchError(f"--{n}", "is required", "e.g. archsearch estimate --arch llama-3.2-1b "
                                                          "--tokens 20B --gpus 8xH100")


def _estimate(args: argparse.Namespace) -> int:
    _require(args, "arch", "tokens")
    spec = load_arch(args.arch)
    _check_seq_len(args, spec)
    method, lora, fmt = _finetune_settings(args, spec)
    est = estimate_training(spec, args.tokens, args.gpus, tp=args.tp, pp=args.pp,
                            mfu=args.mfu, price_per_hour=args.price, time_law=args.law,
                            dtype=args.dtype, seq_len=args.seq_len, parallelism=args.parallelism)
    if method != "full":
        ft = predict_finetune_memory(spec, method, 1, args.seq_len, args.dtype, lora=lora, weight_format=fmt)
        est.assumptions.update({"finetune": f"{method}: {lora.describe()}", "memory_per_device_gib_at_micro_batch_1":
                                ft["total_gib"], "memory_bytes_per_param": "frozen base in its format + adapters "
                                "(see estimate memory --finetune)", "max_micro_batch_per_device": None})
    fitted = _fitted_beside(args, est, method, lora, fmt) if args.batch_laws else None
    if args.json:
        print_json({**est.to_dict(), **({"batch_laws": fitted.to_dict()} if fitted else {})})
        return 0
    a = est.assumptions
    cost = "n/a (no price: pass --price)" if est.cost_usd is None else f"${est.cost_usd:,.0f}"
    print_table([("wall time (hours)", est.hours), ("days", est.hours / 24), ("GPU-hours", est.gpu_hours),
                 ("cost", cost), ("method", est.method)]
                + ([("analytic hours (beside the law)", est.analytic_hours)] if est.law_hours is not None else []),
                title=f"training estimate: {args.arch} on {a['tokens']:.4g} tokens, "
                      f"{a['n_devices']}x{a['device']} (tp={a['tp']}, pp={a['pp']}, dp={a['dp']})")
    print_table([(k, v) for k, v in a.items() if k not in ("tokens",)], title="assumptions")
    if fitted is not None:
        fc = "n/a (no price: pass --price)" if fitted.cost_usd is None else f"${fitted.cost_usd:,.0f}"
        print_table([("analytic hours", est.analytic_hours), ("fitted-law hours", fitted.hours),
                     ("fitted-law cost", fc), ("batch (max-batch law)", fitted.batch_size),
                     ("throughput (law, per device)", fitted.throughput)],
                    title="analytic vs fitted batch/throughput laws (docs/method.md section 8)")
        print_table(list(fitted.assumptions.items()), title="fitted-law assumptions")
    return 0


def _fitted_beside(args: argparse.Namespace, est, method: str = "full", lora=None, fmt=None):
    """The batch/throughput-law answer for the same run (training tokens/s laws only)."""
    tl, ml = load_batch_laws(args.batch_laws)
    n, device = parse_gpus(args.gpus)
    if tl.quantity != "training tokens/s":
        raise ArchsearchError("--batch-laws", f"the throughput law is of {tl.quantity}",
                              "a training estimate needs laws fit on training-step timings")
    if tl.device not in (None, device.name):
        raise ArchsearchError("--batch-laws", f"fit on {tl.device!r}, not {device.name!r}",
                              "fit the laws on measurements from this device")
    spec = load_arch(args.arch)
    dtype = "float32" if device.measured else args.dtype
    return estimate_from_batch_laws(tl, ml, args.tokens, device.memory_bytes,
                                    model_memory_bytes(spec, tl.quantity, dtype, method=method, lora=lora,
                                                       weight_format=fmt), args.seq_len,
                                    sparsity(spec), n, resolve_price(device, args.price),
                                    max_batch_sparsity=ml.sparsity_of(spec))


def _batch_laws(args: argparse.Namespace) -> int:
    quantity, tp, mb, device = read_points(args.data)
    hq, htp, hmb, hdev = read_points(args.holdout) if args.holdout else (quantity, [], [], device)
    if (hq, hdev) != (quantity, device):
        raise ArchsearchError("--holdout", f"holds {hq} on {hdev}, --data holds {quantity} on {device}",
                              "give held-out measurements of the same kind and device")
    tl = fit_throughput_law(tp, quantity, device, holdout=htp)
    ml = fit_max_batch_law(mb, device, holdout=hmb)
    out = {"throughput": tl.to_dict(), "max_batch": ml.to_dict(), "data": args.data,
           "holdout_data": args.holdout}
    path = Path(args.out)
    write_json(path, out)
    if args.json:
        print_json({**out, "out": str(path)})
        return 0
    print(f"batch laws ({quantity}, device {device}) -> {path}")
    print_table([("throughput", f"{tl.c2:.4g} * log(b / (s * {tl.c3:g})) + {tl.c4:.4g}"),
                 ("  points / LOO / held-out", f"{tl.n_points} / {tl.loo} / {tl.holdout}"),
                 ("max batch", f"floor({ml.c0:.4g} * (M - M_model) / (seq * ((1 - {ml.c1:.3g}) + {ml.c1:.3g} * s)))"),
                 ("  points / LOO / held-out", f"{ml.n_points} / {ml.loo} / {ml.holdout}")])
    for note in tl.notes + ml.notes:
        print(f"  note: {note}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    fit = fit_time_law(read_runs(args.data), holdout=read_runs(args.holdout) if args.holdout else ())
    path = fit.law.save(args.out)
    if args.json:
        print_json({**fit.to_dict(), "out": str(path)})
        return 0
    law = fit.law
    print(f"time law: {law.form}{' + boosted residual' if law.residual_model else ''} "
          f"({law.n_runs} runs, device {law.device}) -> {path}")
    print_table([(k, v) for k, v in law.params.items()]
                + [("measured MFU", law.mfu if law.mfu is not None else "n/a (device peak unknown)")])
    print("  cross-validated (and held-out) error per candidate:")
    for r in fit.selection:
        ho = r.get("holdout")
        print(f"    {r['form']:<9} residual={str(r['residual_model']):<5} CV MAE {r['cv']['mae_s']:.4g} s "
              f"R^2 {r['cv']['r2']:.3f}" + (f" | held-out MAE {ho['mae_s']:.4g} s R^2 {ho['r2']:.3f}" if ho else ""))
    for n in law.notes:
        print(f"  note: {n}")
    return 0


def _memory(args: argparse.Namespace) -> int:
    spec = load_arch(args.arch)
    _check_seq_len(args, spec)
    if args.experts_per_token is not None:
        if not spec.is_moe or args.experts_per_token > spec.n_experts:
            raise ArchsearchError("--experts-per-token", f"{args.experts_per_token} for "
                                  f"{'a dense model' if not spec.is_moe else f'{spec.n_experts} experts'}",
                                  "give an MoE model and at most its number of experts")
        spec = with_active_experts(spec, args.experts_per_token)
    method, lora, fmt = _finetune_settings(args, spec)
    law = None
    if args.max_batch_law:
        law = load_max_batch_law(args.max_batch_law)
    n, device = parse_gpus(args.gpus)
    inf = predict_inference_memory(spec, args.batch, args.input_len, args.output_len, args.dtype,
                                   weight_format=fmt if method != "full" else None)
    kw = dict(parallelism=args.parallelism, n_devices=n, tp=args.tp, pp=args.pp)
    if method == "full":
        tr = predict_training_memory(spec, args.micro_batch, args.seq_len, args.dtype, **kw)
        max_tr = max_training_batch(spec, device.memory_bytes, args.seq_len, args.dtype, **kw)
    else:
        if (args.parallelism, n, args.tp, args.pp) != ("ddp", 1, 1, 1):
            raise ArchsearchError("--parallelism", f"sharding with --finetune {method}",
                                  "LoRA/QLoRA memory is planned on one device: leave --tp/--pp/--parallelism out")
        tr = predict_finetune_memory(spec, method, args.micro_batch, args.seq_len, args.dtype, lora=lora,
                                     weight_format=fmt)
        max_tr = max_finetune_batch(spec, method, device.memory_bytes, args.seq_len, args.dtype, lora=lora,
                                    weight_format=fmt)
    out = {"device": device.name, "device_memory_gib": device.memory_gib, "inference": inf, "training": tr,
           "finetune": method, "lora": None if lora is None else {"rank": lora.rank, "targets": list(lora.targets)},
           "max_inference_batch": max_inference_batch(spec, device.memory_bytes, args.input_len,
                                                      args.output_len, args.dtype),
           "max_training_micro_batch": max_tr}
    if law is not None:
        mm = model_memory_bytes(spec, "training tokens/s", args.dtype, method=method, lora=lora, weight_format=fmt)
        s = law.sparsity_of(spec)
        out["max_batch_law"] = {"law": law.to_dict(), "model_memory_bytes": mm, "sparsity": s,
                                "device_memory_bytes": device.memory_bytes,
                                "max_batch": law.predict(device.memory_bytes, mm, args.seq_len, s)}
    if args.json:
        print_json(out)
        return 0
    gib = lambda b: f"{b / 2**30:,.3f} GiB"  # noqa: E731
    print_table([(k, gib(inf[k])) for k in ("weights", "kv_cache", "activations", "total")],
                title=f"inference: batch {args.batch}, {args.input_len} in + {args.output_len} out, {args.dtype}")
    terms = [k for k, v in tr.items() if isinstance(v, (int, float)) and k not in
             ("total_gib", "trainable_params", "ffn_width_for_activations")]
    print_table([(k, gib(tr[k])) for k in terms],
                title=f"training per device ({method}{'' if lora is None else ', ' + lora.describe()}): "
                      f"micro-batch {args.micro_batch} x {args.seq_len}, {n} devices, tp={args.tp} pp={args.pp} "
                      f"{args.parallelism}")
    rows = [("device", f"{device.name} ({device.memory_gib:g} GiB)"),
            ("max inference batch (90% of memory)", out["max_inference_batch"]),
            ("max training micro-batch (95% of memory)", out["max_training_micro_batch"])]
    if method == "full":
        rows.append(("bytes per parameter (training)", tr["assumptions"]["bytes_per_param"]))
    if law is not None:
        lb = out["max_batch_law"]
        rows.append((f"max batch by the law (M_model {lb['model_memory_bytes'] / 1e9:.4g} GB, sparsity "
                     f"{lb['sparsity']:.3g})", lb["max_batch"]))
    print_table(rows)
    return 0

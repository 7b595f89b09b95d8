"""``archsearch train`` (one run) and ``archsearch sweep`` (a proxy sweep from a YAML file)."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from archsearch.cli._common import (add_arch_args, add_overrides_arg, add_print_config_arg, arch_from_args,
                                    parse_number)
from archsearch.cli._common import print_config, print_json, print_table
from archsearch.cli._common import learning_rate, nonneg_int, out_dir, out_file, port, pos_float, pos_int
from archsearch.bounds import check_at_most, devices_here
from archsearch.configio import apply_overrides, from_dict, load_config, load_yaml
from archsearch.errors import ArchsearchError
from archsearch.figures import sweep_loss_curves
from archsearch.fileio import atomic_write
from archsearch.logs import get_logger
from archsearch.trainers.config import DataConfig, SweepConfig, TrainConfig, get_hparams
from archsearch.trainers.data import prepare_data
from archsearch.trainers.launch import (ACCELERATE_LAUNCH, accelerate_config, launch_commands, sbatch_script,
                                        user_accelerate_config, write_accelerate_config)
from archsearch.trainers.loop import (RUN_FILE, check_cpu_threads, check_run_folder, check_train_budget, check_vocab,
                                      match_vocab, run_id_for, token_budget, train)
from archsearch.trainers.sweep import run_sweep
from archsearch.trainers.tokenizer import declared_vocab_size

_LAUNCH_ONLY = {"launch", "run", "num_processes", "num_machines", "main_process_ip",
                "main_process_port", "fsdp", "accelerate_config"}


def register(sub) -> None:
    p = sub.add_parser("train", help="train one architecture (proxy or full run)",
                       description="Train an architecture on a token budget; writes OUT/run.json, "
                                   "checkpoints and OUT/model (loads with from_pretrained). Runs "
                                   "again resume from the last checkpoint.")
    add_arch_args(p)
    p.add_argument("--config", help="YAML with 'train:' and 'data:' sections (archsearch.trainers.config); "
                                    "flags and KEY.SUB=VALUE overrides override it")
    add_print_config_arg(p)
    add_overrides_arg(p)
    b = p.add_argument_group("budget and optimisation")
    b.add_argument("--tokens", type=parse_number, help="token budget D (e.g. 2e9, 500M)")
    b.add_argument("--tokens-per-param", type=pos_float, help="D = this x N (non-embedding)")
    b.add_argument("--hparams", help="the method's per-size preset: 80m, 145m, 297m, 1b, 3b "
                                     "(batch, LR, warm-up; seq_len 2048 unless --seq-len)")
    b.add_argument("--global-batch-size", type=pos_int, help="sequences per optimizer step")
    b.add_argument("--micro-batch-size", type=pos_int, help="sequences per forward pass per process")
    b.add_argument("--lr", type=learning_rate)
    b.add_argument("--warmup-steps", type=nonneg_int)
    b.add_argument("--eval-interval", type=pos_int, help="steps between held-out evaluations")
    b.add_argument("--eval-batches", type=pos_int)
    b.add_argument("--checkpoint-interval", type=pos_int, help="steps between checkpoints")
    b.add_argument("--seed", type=nonneg_int)
    b.add_argument("--dtype", choices=["auto", "float32", "bfloat16"])
    b.add_argument("--attn-implementation", choices=["auto", "sdpa", "eager", "flash_attention_2"])
    b.add_argument("--cpu-threads", type=pos_int)
    b.add_argument("--compile", action="store_true", default=None,
                   help="torch.compile the model before the first step (GPU: steps at the kernels' speed)")
    ft = p.add_argument_group("fine-tuning (LoRA with peft)")
    ft.add_argument("--init-from", metavar="DIR", help="start from this Hugging Face folder's weights "
                                                        "(its config is the architecture unless one is given)")
    ft.add_argument("--lora-rank", type=pos_int, help="train LoRA adapters of this rank only (weights frozen)")
    ft.add_argument("--lora-targets", help="comma-separated modules for the adapters "
                                           "(default q_proj,k_proj,v_proj,o_proj)")
    d = p.add_argument_group("data")
    d.add_argument("--data", nargs="+", help="shakespeare | hf:NAME[:CONFIG] | .txt/.jsonl paths")
    d.add_argument("--tokenizer", help="bpe:VOCAB | smollm2 | an HF tokenizer name or folder")
    d.add_argument("--seq-len", type=pos_int)
    d.add_argument("--text-field")
    d.add_argument("--cache-dir")
    d.add_argument("--match-vocab", action="store_true",
                   help="set the architecture's vocab_size to the tokenizer's")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=out_dir, help="run folder (default runs/train/RUN_ID)")
    o.add_argument("--overwrite", action="store_true",
                   help="--out holds a run of other settings: delete it and start anew (default: refuse)")
    o.add_argument("--json", action="store_true", help="print the run record as JSON")
    o.add_argument("--no-progress", action="store_true")
    la = p.add_argument_group("multi-GPU / multi-node (accelerate launch)")
    la.add_argument("--launch", action="store_true",
                    help="write the accelerate config and print the launch command(s)")
    la.add_argument("--run", action="store_true", help="with --launch: run it (single machine)")
    la.add_argument("--num-processes", type=pos_int, default=None, help="total GPUs over all machines")
    la.add_argument("--num-machines", type=pos_int, default=1)
    la.add_argument("--main-process-ip")
    la.add_argument("--main-process-port", type=port, default=29500)
    la.add_argument("--fsdp", action="store_true", help="FSDP2 (sharded) instead of DDP")
    la.add_argument("--accelerate-config", type=out_file, help="where to write it (default OUT/accelerate_config.yaml)")
    p.set_defaults(func=_train, _parser=p)

    s = sub.add_parser("sweep", help="train a grid of proxies (resumable) into a run table",
                       description="Train every (N, d/sqrt(N), r) point of a sweep config; skips "
                                   "finished runs, resumes partial ones; writes OUT/runs.csv.")
    s.add_argument("--config", required=True, help="sweep YAML (archsearch.trainers.config.SweepConfig)")
    s.add_argument("--out", type=out_dir, help="sweep folder (default runs/sweeps/NAME)")
    s.add_argument("--json", action="store_true", help="print the rows as JSON")
    s.add_argument("--no-progress", action="store_true")
    add_print_config_arg(s)
    add_overrides_arg(s)
    s.set_defaults(func=_sweep)


def _configs(args: argparse.Namespace):
    raw = load_yaml(args.config, args.overrides) if args.config else apply_overrides({}, args.overrides)
    unknown = set(raw) - {"train", "data"}
    if unknown:
        raise ArchsearchError(f"{args.config}: {sorted(unknown)[0]}", "unknown section",
                              "a train config has 'train:' and 'data:' sections")
    for section in ("train", "data"):
        if raw.get(section) is not None and not isinstance(raw[section], dict):
            raise ArchsearchError(f"{args.config}: {section}", f"is a {type(raw[section]).__name__}",
                                  f"'{section}:' holds a mapping of fields")
    t = dict(raw.get("train") or {})
    dd = dict(raw.get("data") or {})
    # a flag sets the config field of its name (--data names the data source)
    for f in fields(TrainConfig):
        if getattr(args, f.name, None) is not None:
            t[f.name] = getattr(args, f.name)
    if args.tokens is not None:
        t.pop("tokens_per_param", None)
    if args.tokens_per_param is not None:
        t.pop("tokens", None)
    data_flags = {f.name: f.name for f in fields(DataConfig) if f.name != "source"} | {"data": "source"}
    for dest, key in data_flags.items():
        if getattr(args, dest, None) is not None:
            v = getattr(args, dest)
            dd[key] = v[0] if isinstance(v, list) and len(v) == 1 else v
    if t.get("hparams") and "seq_len" not in dd:
        dd["seq_len"] = get_hparams(t["hparams"]).seq_len
    return from_dict(TrainConfig, t, "train"), from_dict(DataConfig, dd, "data")


def _forwarded_args(args: argparse.Namespace, out: Path) -> list[str]:
    """The flags of this command minus the launch ones, for the launched processes."""
    argv: list[str] = []
    for a in args._parser._actions:
        if not a.option_strings or a.dest in _LAUNCH_ONLY or a.dest in ("help", "out"):
            continue
        v = getattr(args, a.dest, None)
        if v is None or v is False or v == a.default:
            continue
        flag = a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
        if isinstance(a, argparse._StoreConstAction) and not isinstance(v, bool):  # --quiet / --verbose
            if v == a.const:
                argv.append(flag)
        elif v is True:
            argv.append(flag)
        elif isinstance(v, list):
            argv += [flag, *map(str, v)]
        else:
            argv += [flag, str(v)]
    return argv + ["--out", str(out), *args.overrides]


def _train(args: argparse.Namespace) -> int:
    if args.lora_targets and not args.lora_rank:
        raise ArchsearchError("--lora-targets", "is given without --lora-rank", "add --lora-rank R (e.g. 8)")
    given = args.preset or args.arch_file or args.n_layers is not None
    if args.init_from and not given:
        args.arch_file = args.init_from  # the weights' own architecture
    if args.print_config:  # the train: and data: sections; the architecture is 'arch describe's
        tc, dc = _configs(args)
        print_config({"train": tc, "data": dc})
        return 0
    spec = arch_from_args(args)
    tc, dc = _configs(args)
    if args.run and not args.launch:
        raise ArchsearchError("--run", "only goes with --launch")
    if args.launch:
        return _launch(args, spec, tc, dc)

    if dc.seq_len > spec.max_position_embeddings:
        raise ArchsearchError("--seq-len", f"{dc.seq_len} exceeds the model's max_position_embeddings "
                              f"{spec.max_position_embeddings}", "lower --seq-len")
    if not args.match_vocab:  # a bpe:V tokenizer's size is known before it is trained or loaded
        check_vocab(spec, dc, declared_vocab_size(dc.tokenizer))
    check_train_budget(spec, token_budget(spec, tc), "--tokens")
    check_cpu_threads(tc, "--cpu-threads")
    out = Path(args.out) if args.out else None
    if out is not None and not args.overwrite:  # before the data is prepared
        check_run_folder(out, spec, tc, "--out", ignore=("vocab_size",) if args.match_vocab else (), dc=dc)

    from accelerate import PartialState

    with PartialState().main_process_first():  # under accelerate launch: rank 0 fills the cache
        data = prepare_data(dc, min_train_tokens=int(token_budget(spec, tc)) + 1)
    if args.match_vocab:
        spec = match_vocab(spec, data.tokenizer)
    if out is None:
        out = Path("runs/train") / run_id_for(spec, token_budget(spec, tc), tc.seed)
    elif args.overwrite:
        state = PartialState()  # under accelerate launch: one rank deletes, the others wait for it
        if state.is_main_process:
            _clear_run_folder(out, spec, tc, dc)
        state.wait_for_everyone()
    rec = train(spec, tc, dc, out, progress=not args.no_progress, data=data)
    if args.json:
        print_json(rec)
    else:
        print_table([(k, rec.get(k)) for k in (
            "status", "reason", "final_eval_loss", "smoothed_train_loss", "n_params_non_embedding",
            "tokens", "steps", "tokens_per_s", "mfu", "wall_time_s", "device", "model_dir")],
            title=f"run {out}")
    return 0 if rec.get("status") == "ok" else 1


def _clear_run_folder(out: Path, spec, tc, dc) -> None:
    """``--overwrite``: delete a run of other settings in ``out`` (a folder with a run record;
    any other folder is left alone and the run's own checks refuse it)."""
    try:
        check_run_folder(out, spec, tc, "--out", dc=dc)
    except ArchsearchError:
        if not (out / RUN_FILE).is_file():
            raise
        get_logger("train").warning(f"archsearch: --overwrite: deleting the run of other settings in {out}")
        shutil.rmtree(out)


def _launch(args, spec, tc, dc) -> int:
    if not args.out:
        raise ArchsearchError("--out", "is required with --launch", "every process must write to the same folder")
    own = user_accelerate_config() if args.num_processes is None else None
    if args.num_processes is None and own is None:
        raise ArchsearchError("--num-processes", "is required with --launch (no accelerate config of yours found)",
                              "give the total GPU count, or run `accelerate config` once: its default is then used")
    if args.num_processes is not None and args.num_machines == 1:  # every process on this machine: one per device
        n, what = devices_here()
        why = f"this machine has {n} {what}; one process drives one device (for several machines give --num-machines)"
        if args.run:  # launched here: refused before any process starts
            check_at_most("--num-processes", args.num_processes, n, why)
        elif args.num_processes > n:  # written for another machine (a GPU node): said, not refused
            get_logger("train").warning(f"archsearch: --num-processes {args.num_processes} is more than {why}: the "
                                        "written launch is for a machine that has them")
    if args.run and args.num_machines > 1:
        raise ArchsearchError("--run", "runs this machine's rank only when there are several machines",
                              "submit the written sbatch script, or run the printed command on each machine")
    out = Path(args.out)
    fwd = _forwarded_args(args, out)
    if own is not None:  # the user's `accelerate config` default: accelerate reads it itself
        path = None
        print(f"using your accelerate config {own} (from `accelerate config`; give --num-processes to write "
              "one for this run instead)", file=sys.stderr)
    else:
        mp = {"auto": "bf16", "bfloat16": "bf16", "float32": "no"}[tc.dtype]
        cfg = accelerate_config(spec, num_processes=args.num_processes, num_machines=args.num_machines,
                                main_process_ip=args.main_process_ip,
                                main_process_port=args.main_process_port, fsdp=args.fsdp,
                                mixed_precision=mp)
        path = write_accelerate_config(args.accelerate_config or out / "accelerate_config.yaml", cfg)
        print(f"accelerate config: {path}", file=sys.stderr)
        if args.num_machines > 1:
            script = atomic_write(out / "launch.sbatch", sbatch_script(
                path, fwd, num_machines=args.num_machines, num_processes=args.num_processes,
                main_process_port=args.main_process_port, out=out))
            print(f"Slurm: sbatch {script} (one launcher per node, rank 0's address from the allocation)",
                  file=sys.stderr)
    cmds = launch_commands(path, fwd, args.num_machines, program=ACCELERATE_LAUNCH)
    for rank, cmd in enumerate(cmds):
        prefix = f"# machine rank {rank}\n" if len(cmds) > 1 else ""
        print(prefix + shlex.join(cmd))
    if args.run:  # the same launch, through this Python (its environment's accelerate)
        return subprocess.run(launch_commands(path, fwd)[0], check=False).returncode
    return 0


def _sweep(args: argparse.Namespace) -> int:
    cfg = load_config(SweepConfig, args.config, args.overrides)
    if args.print_config:
        print_config(cfg)
        return 0
    out = Path(args.out) if args.out else Path("runs/sweeps") / cfg.name
    rows = run_sweep(cfg, out, progress=not args.no_progress)
    figure = sweep_loss_curves(out)  # every run's loss curve, from its metrics.jsonl
    if figure:
        get_logger("train").info(f"loss curves: {figure[0]}")
    if args.json:
        print_json([r.to_row() for r in rows])
    else:
        ok = sum(r.status == "ok" for r in rows)
        print(f"{ok}/{len(rows)} runs ok -> {out / 'runs.csv'}")
    return 0

"""The training loop: an HF causal LM built from an ArchSpec, driven by accelerate.

One flat loop (nanoGPT style). What is worth knowing:

* Precision: float32 on CPU (no native bf16 there, ~100x slower); on GPU bfloat16 autocast
  through accelerate with fp32 master weights and optimizer state.
* The learning rate is a pure function of the step (transformers' linear warm-up and cosine to
  ``min_lr_ratio x lr``, :func:`lr_schedule`), and the data position is a pure function of the step
  (archsearch.trainers.data), so a checkpoint holds only model, optimizer, RNG and a few counters.
* Gradient accumulation is done by hand: ``no_sync`` on all but the last micro-batch (no DDP
  all-reduce until the gradient is complete), each micro-loss scaled by 1/accum.
* Weight decay applies to matrices and embeddings, not to norm weights (the usual GPT rule).
* The loss is read back (``.item()``, a device sync) once per step: it is needed to stop on
  NaN/divergence at the step it happens, and it is all-reduced first so every process takes
  the same decision (a process that stopped alone would hang the others).
* Checkpoints are accelerate's ``save_state`` (model, optimizer, RNG) plus the loop's counters,
  written to a temporary folder and renamed, so a kill during a save leaves the previous
  checkpoint usable; ``load_state`` reads safetensors and ``weights_only`` pickles.
* Throughput counts optimizer steps only (not evaluation or checkpoint time); MFU uses
  6 x (N + head) + 6 x L x S x dq FLOPs per token (Kaplan et al. 2020: forward 2N +
  2 L n_ctx d_attn, backward twice the forward) against the device's peak: the GPU table in
  archsearch.hardware (bf16 or fp32 by the compute dtype) times the process count, or on CPU
  the fp32 matmul peak measured on this machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import shutil
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

from archsearch.arch import ArchSpec, non_embedding_params, to_hf_config, total_params, training_flops
from archsearch.configio import to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import follow_umask, truncate_jsonl, write_json
from archsearch.hardware import GPUS, detect_gpu_name, get_device, measure_cpu
from archsearch.hf import without_sklearn
from archsearch.modelcard import write_run_card
from archsearch.provenance import provenance
from archsearch.trainers.config import MAX_WARMUP_STEPS, DataConfig, TrainConfig, check_trackers
from archsearch.trainers.tokenizer import declared_vocab_size

RUN_FILE = "run.json"
CKPT_DIR = "checkpoints"
MODEL_DIR = "model"


# -- pure helpers ------------------------------------------------------------------------------

def lr_schedule(optimizer, steps: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """The learning rate's multiplier at each optimizer step (0-based) of a ``steps``-step run:
    transformers' ``get_cosine_with_min_lr_schedule_with_warmup``, a linear warm-up over
    ``warmup`` steps, then a cosine down to ``min_ratio`` at the last step.

    transformers' warm-up starts at 0 (a step that would train nothing); here warm-up step s is
    its step s + 1, so the warm-up reaches the peak at step ``warmup - 1`` and the cosine starts
    from it at step ``warmup`` (its ``num_training_steps`` is the last step, ``steps - 1``). The
    multiplier is a pure function of the step, which is what lets a checkpoint hold no schedule.
    """
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    factor = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=warmup, num_training_steps=steps - 1, min_lr_rate=min_ratio).lr_lambdas[0]
    return lambda step: factor(step + 1 if step < warmup else step)


def train_flops_per_token(spec: ArchSpec, seq_len: int) -> float:
    """6 (N + d V) + 6 L S dq: matmul FLOPs of forward + backward for one token (Kaplan)."""
    return training_flops(spec, 1, include_embedding=True) + 6.0 * spec.n_layers * seq_len * spec.q_dim


def token_budget(spec: ArchSpec, tc: TrainConfig) -> float:
    """D: explicit tokens, or tokens_per_param x N (non-embedding N)."""
    if tc.tokens is not None:
        return float(tc.tokens)
    if tc.tokens_per_param is not None:
        return float(tc.tokens_per_param) * non_embedding_params(spec)
    raise ArchsearchError("train.tokens", "no token budget",
                          "give tokens (D) or tokens_per_param (D = it x N)")


# A request that would take longer than this at 100% of the machine's peak is refused up front.
MAX_TRAIN_DAYS = 365.0


def check_train_budget(spec: ArchSpec, tokens: float, flag: str = "train.tokens") -> None:
    """Refuse, from 6*N*D against this machine's peak FLOP/s, a budget that could not finish
    within :data:`MAX_TRAIN_DAYS` even at full utilisation (before any data is prepared)."""
    import torch

    if not (math.isfinite(tokens) and tokens > 0):
        raise ArchsearchError(flag, f"must be a positive finite number, got {tokens!r}")
    if torch.cuda.is_available():
        name = detect_gpu_name(torch.cuda.get_device_name(0))
        per_device = GPUS[name].peak_flops_bf16 if name else max(g.peak_flops_bf16 for g in GPUS.values())
        peak, where = per_device * torch.cuda.device_count(), f"{torch.cuda.device_count()} GPU(s)"
    else:
        peak, where = measure_cpu(n=512, repeats=3).peak_flops_fp32, "this CPU"
    days = training_flops(spec, tokens) / peak / 86400
    if days > MAX_TRAIN_DAYS:
        raise ArchsearchError(flag, f"{tokens:.3g} tokens on N={non_embedding_params(spec):.3g} take "
                              f"{days:,.0f} days on {where} even at 100% of its peak",
                              "lower the budget, or launch on a cluster (archsearch train --launch)")


def match_vocab(spec: ArchSpec, tokenizer_or_size: Any) -> ArchSpec:
    """The spec with its vocab_size set to the tokenizer's (``len(tokenizer)``) or to a number."""
    size = tokenizer_or_size if isinstance(tokenizer_or_size, int) else len(tokenizer_or_size)
    return spec.replace(vocab_size=size)


def run_id_for(spec: ArchSpec, tokens: float, seed: int) -> str:
    """A stable, readable run name: the shape, D and the seed, plus a hash of the full spec."""
    h = hashlib.sha256(json.dumps([{k: v for k, v in spec.to_dict().items() if k != "name"}, float(tokens), seed],
                                  sort_keys=True).encode()).hexdigest()[:8]
    return (f"L{spec.n_layers}-d{spec.hidden_size}-h{spec.n_heads}kv{spec.n_kv_heads}x{spec.head_dim}"
            f"-f{spec.ffn}-D{tokens:.3g}-s{seed}-{h}").replace("+", "")


def read_record(out_dir: Path) -> dict | None:
    p = Path(out_dir) / RUN_FILE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return None


# the settings that make a run's trajectory (its fingerprint, besides the architecture, budget,
# seed, initial weights and LoRA rank): a run resumed with another of these would continue a
# curve it did not start; what only logs, checks or places files (intervals, threads, trackers,
# the stop rule, the cache folder, max_epochs) may change between sessions
TRAJECTORY_TRAIN = ("global_batch_size", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "betas",
                    "grad_clip", "dtype", "lora_targets")
TRAJECTORY_DATA = ("source", "tokenizer", "seq_len", "val_works", "val_fraction", "val_tokens", "text_field",
                   "max_train_tokens", "bpe_train_chars")


def settings_changes(rec: dict[str, Any], tc: TrainConfig, dc: DataConfig | None) -> list[str]:
    """The trajectory settings (:data:`TRAJECTORY_TRAIN`, :data:`TRAJECTORY_DATA`) in which ``tc``
    and ``dc`` differ from those a run record stored ('lr 0.003 -> 0.001'); a record of an older
    version without them differs in nothing."""
    diffs = []
    for section, cfg, keys in (("train", tc, TRAJECTORY_TRAIN), ("data", dc, TRAJECTORY_DATA)):
        stored = rec.get(f"{section}_config")
        if cfg is None or not isinstance(stored, dict):
            continue
        now = to_dict(cfg)
        diffs += [f"{section}.{k} {stored[k]!r} -> {now.get(k)!r}" for k in keys
                  if k in stored and stored[k] != now.get(k)]
    return diffs


def check_run_folder(out_dir: Path, spec: ArchSpec, tc: TrainConfig, flag: str = "out",
                     ignore: tuple[str, ...] = (), dc: DataConfig | None = None) -> None:
    """Refuse a run folder that holds a run (finished or checkpointed) of other settings: its
    record or checkpoints would be returned or resumed as this run's. What makes a run another
    run: its architecture (bar ``ignore``d fields and the display name), its token budget D,
    its seed, its initial weights, its LoRA rank, and (with ``dc``) the settings of its
    trajectory (:func:`settings_changes`: learning rate, batch, warm-up, seq_len, data...). An
    unfinished run whose checkpoint this version cannot read is refused too."""
    rec = read_record(out_dir)
    ckpts = _checkpoints(Path(out_dir))
    if ckpts and (rec or {}).get("status") != "ok":
        _check_checkpoint(ckpts[-1], flag)
    if rec is None:
        return
    skip = {"name", *ignore}
    theirs = {k: v for k, v in (rec.get("spec") or {}).items() if k not in skip}
    mine = {k: v for k, v in spec.to_dict().items() if k not in skip}
    diffs = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    # a key a record lacks (written by an older version) is not a difference
    budget, old = token_budget(spec, tc), rec.get("tokens_target")
    if "tokens_target" in rec and not (isinstance(old, (int, float)) and math.isclose(old, budget, rel_tol=1e-9)):
        diffs.append(f"token budget {old} -> {budget:.6g}")
    for key, now in (("seed", tc.seed), ("init_from", tc.init_from)):
        if key in rec and rec[key] != now:
            diffs.append(f"{key} {rec[key]!r} -> {now!r}")
    if (rec.get("lora") or {}).get("rank") != tc.lora_rank and (rec.get("lora") or tc.lora_rank):
        diffs.append("lora rank")
    diffs += settings_changes(rec, tc, dc)
    if diffs:
        raise ArchsearchError(flag, f"{str(out_dir)!r} holds a run ({rec.get('status')}) of other settings: "
                              + ", ".join(diffs[:6]),
                              "give another folder, or add --overwrite to delete it and start anew")


# -- the plan: everything checked before anything is written --------------------------------

def check_vocab(spec: ArchSpec, dc: DataConfig, vocab_size: int | None) -> None:
    """Refuse an architecture whose vocab_size is not the tokenizer's ``vocab_size`` (None: not
    known yet). Checked before any work where the tokenizer's name says its size
    (:func:`archsearch.trainers.tokenizer.declared_vocab_size`), and again once it is loaded."""
    if vocab_size is not None and spec.vocab_size != vocab_size:
        raise ArchsearchError("vocab_size", f"the architecture has vocab_size={spec.vocab_size} but "
                              f"the tokenizer {dc.tokenizer!r} has {vocab_size} tokens",
                              f"set vocab_size={vocab_size} (archsearch.trainers.match_vocab, or "
                              "--match-vocab on the command line) or use a matching tokenizer")


def _plan(spec: ArchSpec, tc: TrainConfig, dc: DataConfig, data, n_proc: int) -> dict[str, Any]:
    check_vocab(spec, dc, data.vocab_size)
    if dc.seq_len > spec.max_position_embeddings:
        raise ArchsearchError("data.seq_len", f"{dc.seq_len} exceeds max_position_embeddings="
                              f"{spec.max_position_embeddings}", "shorten seq_len or raise the limit")
    target = token_budget(spec, tc)
    from archsearch.trainers.data import check_epochs

    check_epochs(data, target, dc.max_epochs, "this run")
    gbs = tc.global_batch_size
    per_step = gbs * dc.seq_len
    steps = int(target // per_step)
    if steps < 1:
        raise ArchsearchError("train.tokens", f"the budget D={target:,.0f} tokens is smaller than one "
                              f"batch ({gbs} sequences x {dc.seq_len} = {per_step:,} tokens)",
                              "raise the budget or lower global_batch_size / seq_len")
    mbs = tc.micro_batch_size or max(1, gbs // n_proc)
    if gbs % (mbs * n_proc):
        raise ArchsearchError("train.micro_batch_size", f"global_batch_size={gbs} is not a multiple of "
                              f"micro_batch_size={mbs} x {n_proc} processes",
                              "pick sizes so that global = micro x processes x accumulation")
    warmup = tc.warmup_steps if tc.warmup_steps is not None else min(MAX_WARMUP_STEPS, max(1, steps // 10))
    if warmup >= steps:
        raise ArchsearchError("train.warmup_steps", f"{warmup} warm-up steps leave nothing of the "
                              f"{steps} steps", "lower warmup_steps or raise the budget")
    eval_seqs = min(data.n_val_seqs, tc.eval_batches * mbs * n_proc)
    if eval_seqs < n_proc:
        raise ArchsearchError("data", f"{data.n_val_seqs} validation sequences for {n_proc} processes",
                              "hold out more text or use a shorter seq_len")
    return {"tokens_target": target, "steps": steps, "tokens": steps * per_step,
            "micro_batch_size": mbs, "grad_accum": gbs // (mbs * n_proc), "warmup_steps": warmup,
            "eval_seqs": eval_seqs - eval_seqs % n_proc,
            "epochs": steps * gbs / data.n_train_seqs}


# -- device, model ----------------------------------------------------------------------------

def _resolve_precision(tc: TrainConfig, cuda: bool) -> str:
    if tc.dtype == "auto":
        return "bfloat16" if cuda else "float32"
    return tc.dtype


def _resolve_attn(tc: TrainConfig, cuda: bool) -> str:
    import importlib.util

    if tc.attn_implementation == "auto":
        return "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    if tc.attn_implementation == "flash_attention_2" and not (cuda and importlib.util.find_spec("flash_attn")):
        raise ArchsearchError("train.attn_implementation", "flash_attention_2 needs a CUDA GPU and "
                              "the flash-attn package", "pip install archsearch[flash-attn], or use sdpa")
    return tc.attn_implementation


def build_model(spec: ArchSpec, attn_implementation: str = "sdpa"):
    """A randomly initialised HF causal LM (fp32 weights) from the spec's exported config."""
    import torch

    without_sklearn()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(to_hf_config(spec, dtype="float32"))
    cfg.pop("architectures")
    model_type = cfg.pop("model_type")
    cfg.pop("torch_dtype", None)
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    hf_cfg.architectures = [to_hf_config(spec)["architectures"][0]]
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn_implementation,
                                             dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    if n != total_params(spec):  # the accounting the laws use must be the model we train
        raise RuntimeError(f"model has {n} parameters, the spec accounts {total_params(spec)}")
    return model


def _load_pretrained(model, folder: str) -> None:
    """Copy a Hugging Face folder's weights into ``model`` (built from the same spec): every
    tensor must be there with its shape, or this is an error, not a partial load. (``model`` came from
    :func:`build_model`, which has already set transformers' scikit-learn switch.)"""
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ArchsearchError("train.init_from", f"{folder} does not match the architecture: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}",
                              "train the architecture of that folder (--arch FOLDER or no architecture flags)")


def apply_lora(model, spec: ArchSpec, rank: int, targets: tuple[str, ...]):
    """Wrap ``model`` with peft LoRA adapters (``r=rank``, ``lora_alpha=2 r``, no dropout) on
    ``targets``; every other weight is frozen. Returns (model, record); the record's trainable
    count is peft's, checked against :func:`archsearch.planning.lora.lora_params`."""
    from peft import LoraConfig, get_peft_model

    from archsearch.planning.lora import PARAMETER_TARGETS, LoraSettings, lora_params

    # expert projections (3-D) and the router (2-D) are parameters in transformers' MoE blocks,
    # not modules: peft adapts them through target_parameters
    modules = [t for t in targets if t not in PARAMETER_TARGETS]
    params = [t for t in targets if t in PARAMETER_TARGETS]
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                             target_modules=modules, target_parameters=params or None,
                                             bias="none"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    predicted = lora_params(spec, LoraSettings(rank, tuple(targets)))
    if trainable != predicted:
        raise RuntimeError(f"peft made {trainable} trainable parameters, the accounting says {predicted}")
    return model, {"rank": rank, "alpha": 2 * rank, "targets": list(targets), "trainable_params": trainable,
                   "library": "peft"}


def check_cpu_threads(tc: TrainConfig, flag: str = "train.cpu_threads") -> None:
    """Refuse more intra-op threads than this process may run on (they would only queue)."""
    from archsearch.laws.fit import usable_cpus

    if tc.cpu_threads and tc.cpu_threads > usable_cpus():
        raise ArchsearchError(flag, f"{tc.cpu_threads} threads on {usable_cpus()} usable CPUs would only "
                              "compete for them", f"give at most {usable_cpus()}, or leave it out")


def cpu_threads_for(spec: ArchSpec, tc: TrainConfig) -> int:
    """Intra-op threads on CPU (see TrainConfig.cpu_threads)."""
    import torch

    if tc.cpu_threads:
        return tc.cpu_threads
    return 1 if spec.hidden_size <= 256 else torch.get_num_threads()


def _device_peak(accelerator, precision: str) -> tuple[float, str, str]:
    """(peak FLOP/s of one device, its name, where the number comes from)."""
    import torch

    if accelerator.device.type == "cuda":
        name = torch.cuda.get_device_name(accelerator.device)
        entry = detect_gpu_name(name)
        if entry is None:
            return float("nan"), name, "not in archsearch.hardware's GPU table: MFU not computed"
        dev = get_device(entry)
        return dev.peak_flops(precision), entry, dev.source
    dev = measure_cpu()
    return dev.peak_flops_fp32, "cpu", dev.source


# -- checkpoints --------------------------------------------------------------------------------

def _checkpoints(out_dir: Path) -> list[Path]:
    d = out_dir / CKPT_DIR
    if not d.is_dir():
        return []
    done = [p for p in d.iterdir() if p.is_dir() and p.name.startswith("step_")
            and (p / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[5:]))


class _Without(logging.Filter):
    """Drops the log records whose message contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _save_checkpoint(accelerator, out_dir: Path, step: int, state: dict, keep: int) -> None:
    """accelerate's ``save_state`` (model as safetensors; optimizer; every process's RNG; the
    sharded states under FSDP) into a temporary folder; then ``state.json`` (the counters), written
    last, marks it complete, and a rename makes it ``step_<step>``. A kill during the save leaves
    the previous checkpoint the latest complete one. The oldest beyond ``keep`` are removed after."""
    final = out_dir / CKPT_DIR / f"step_{step:08d}"
    tmp = out_dir / CKPT_DIR / f".tmp_step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    # accelerate notes each save that tied weights (the head sharing the embedding) are stored
    # once; that is expected, and load_state ties them back
    tied_note = _Without("Removed shared tensor")
    logging.getLogger("accelerate.utils.other").addFilter(tied_note)
    try:
        accelerator.save_state(str(tmp))  # collective: every process calls it
    finally:
        logging.getLogger("accelerate.utils.other").removeFilter(tied_note)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(tmp / "state.json", {"step": step, **state}, default=str)
        follow_umask(tmp)  # accelerate's safetensors are 0600: the folder follows the umask
        tmp.rename(final)
        for old in _checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file at ``path`` cannot be whole (None when its header parses and its
    size is the header's 8 + N bytes plus the end of its last tensor): a file cut short by a kill
    or a full disk is found by its size, without reading the tensors."""
    size = path.stat().st_size
    try:
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                return f"its header claims {n:,} bytes but the file has {size:,}"
            header = json.loads(fh.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"its header is not a safetensors header ({type(e).__name__})"
    if size != 8 + n + end:
        return f"it has {size:,} bytes where its header describes {8 + n + end:,}"
    return None


def _check_checkpoint(ckpt: Path, flag: str = "out") -> None:
    """Refuse, before any work, a checkpoint that would not load: in the layout the trainer wrote
    before it used accelerate's ``save_state``, or with a file cut short (a weights file whose
    size is not its header's, a torch file whose zip directory is gone, a ``state.json`` that
    is not a JSON object with the step)."""
    if (ckpt / "model.pt").is_file():
        raise ArchsearchError(flag, f"{ckpt} is a checkpoint of an earlier archsearch (model.pt, "
                              "optimizer.pt, rng.pt), which this version does not read",
                              "finish the run with the version that started it, or train it from "
                              f"the start (delete its {CKPT_DIR}/ folder, or --overwrite)")
    fix = (f"delete {ckpt} to resume from the checkpoint before it (or from the start), or start anew "
           "with --overwrite")
    for f in sorted(ckpt.rglob("*")):
        why = None
        if f.suffix == ".safetensors":
            why = safetensors_problem(f)
        elif f.suffix in (".bin", ".pt") and not zipfile.is_zipfile(f):  # torch.save's zip format
            why = "it is not a whole torch file (its zip directory is missing: cut short?)"
        if why:
            raise ArchsearchError(flag, f"the checkpoint file {f} is damaged: {why}", fix)
    try:
        state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ArchsearchError(flag, f"{ckpt / 'state.json'} is not valid JSON ({e})", fix) from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ArchsearchError(flag, f"{ckpt / 'state.json'} does not hold the checkpoint's step", fix)


def _load_checkpoint(accelerator, ckpt: Path) -> dict:
    """Restore what :func:`_save_checkpoint` wrote (accelerate's ``load_state``: safetensors for
    the model, ``weights_only`` loads for the rest) into the prepared model and optimizer; returns
    the counters."""
    accelerator.load_state(str(ckpt))
    return json.loads((ckpt / "state.json").read_text())


# -- evaluation -------------------------------------------------------------------------------

def eval_loss(accelerator, model, data, n_seqs: int, mbs: int) -> float:
    """Mean next-token loss over the first ``n_seqs`` validation sequences (split over processes)."""
    import torch

    rank, world = accelerator.process_index, accelerator.num_processes
    per = n_seqs // world  # n_seqs is a multiple of world (see _plan)
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    model.eval()
    # eager where the model is compiled (train.compile): a few held-out batches (the last one shorter)
    # would each cost a compile of their own graph (eval mode, no grad) and gain nothing from it
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    with torch.no_grad(), (stance("force_eager") if stance else contextlib.nullcontext()):
        for i in range(rank * per, (rank + 1) * per, mbs):
            n = min(mbs, (rank + 1) * per - i)
            x = torch.from_numpy(data.val_batch(i, n)).to(accelerator.device)
            loss = model(input_ids=x, labels=x).loss
            total[0] += loss.double() * n
            total[1] += n
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1])


# -- the run ----------------------------------------------------------------------------------

def train(spec: ArchSpec, train_cfg: TrainConfig, data_cfg: DataConfig, out_dir: str | Path, *,
          progress: bool = True, data=None) -> dict:
    """Train ``spec`` on ``data_cfg`` for the token budget; returns the run record (also in
    ``out_dir/run.json``).

    A finished run (run.json status ok) is returned as is; a run with a checkpoint resumes from
    it. Bad input raises :class:`ArchsearchError` before anything is written. NaN or divergence
    ends the run with status ``failed`` and the reason. ``data`` takes an already prepared
    :class:`archsearch.trainers.data.PreparedData` for ``data_cfg`` (sweeps prepare it once).
    """
    import torch

    threads_before = torch.get_num_threads()
    try:
        return _train(spec, train_cfg, data_cfg, out_dir, progress=progress, data=data)
    finally:  # the run may pin the CPU thread count; the caller's process gets its own back
        torch.set_num_threads(threads_before)


def _train(spec: ArchSpec, train_cfg: TrainConfig, data_cfg: DataConfig, out_dir: str | Path, *,
           progress: bool = True, data=None) -> dict:
    out_dir = Path(out_dir)
    check_run_folder(out_dir, spec, train_cfg, dc=data_cfg)
    done = read_record(out_dir)
    if done and done.get("status") == "ok":
        return done
    check_vocab(spec, data_cfg, declared_vocab_size(data_cfg.tokenizer))  # before the data is prepared

    import torch
    # imported before the clock starts, so the wall time is the run's, not the import's
    without_sklearn()
    from transformers import AutoModelForCausalLM  # noqa: F401
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from archsearch.trainers.data import describe_data, prepare_data

    wall0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    precision = _resolve_precision(train_cfg, cuda)
    check_trackers(train_cfg.log_with)
    accelerator = Accelerator(mixed_precision="bf16" if precision == "bfloat16" else "no",
                              cpu=not cuda, log_with=list(train_cfg.log_with) or None,
                              project_dir=str(out_dir / "tracking") if train_cfg.log_with else None)
    n_proc = accelerator.num_processes
    threads = None
    if not cuda:
        threads = cpu_threads_for(spec, train_cfg)
        torch.set_num_threads(threads)
    bound = int(token_budget(spec, train_cfg)) + 1
    if data is None:
        with accelerator.main_process_first():  # rank 0 tokenizes and caches, the others read
            data = prepare_data(data_cfg, min_train_tokens=bound)
    elif data.seq_len != data_cfg.seq_len:
        raise ArchsearchError("data.seq_len", "the prepared data was packed for another seq_len")
    # a streamed source: the run reads the prefix for its own budget, whatever bound the data
    # was prepared for (a sweep prepares it for its largest run)
    data = data.for_budget(data_cfg.max_train_tokens or bound)
    plan = _plan(spec, train_cfg, data_cfg, data, n_proc)
    attn = _resolve_attn(train_cfg, cuda)
    steps, mbs, accum = plan["steps"], plan["micro_batch_size"], plan["grad_accum"]
    gbs, seq_len = train_cfg.global_batch_size, data_cfg.seq_len

    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    ckpts = _checkpoints(out_dir)
    set_seed(train_cfg.seed)
    model = build_model(spec, attn)
    if train_cfg.init_from:
        _load_pretrained(model, train_cfg.init_from)
    lora_info = None
    if train_cfg.lora_rank:
        model, lora_info = apply_lora(model, spec, train_cfg.lora_rank, train_cfg.lora_targets)
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=train_cfg.lr, betas=train_cfg.betas, fused=cuda or None)
    lr_factor = lr_schedule(optimizer, steps, plan["warmup_steps"], train_cfg.min_lr_ratio)
    if train_cfg.compile:  # in place (Module.compile): parameter names, checkpoints and saved weights stay as they are
        model.compile()
    model, optimizer = accelerator.prepare(model, optimizer)

    state: dict[str, Any] = {"step": 0, "train_time_s": 0.0, "wall_time_s": 0.0, "ema": None,
                             "ema_weight": 0.0, "best_ema": None, "evals": [], "sessions": 0}
    resumed_from = None
    if ckpts:
        state.update(_load_checkpoint(accelerator, ckpts[-1]))
        resumed_from = state["step"]
    state["sessions"] += 1
    base_wall = state["wall_time_s"]

    flops_tok = train_flops_per_token(spec, seq_len)
    if lora_info is not None:  # forward + backward to the activations (4 N), adapters (6 per param), attention
        from archsearch.planning.lora import LoraSettings, lora_step_flops

        flops_tok = lora_step_flops(spec, LoraSettings(train_cfg.lora_rank, train_cfg.lora_targets), 1, seq_len)
    peak, device_name, peak_source = _device_peak(accelerator, precision)
    record: dict[str, Any] = {
        "run_id": out_dir.name, "status": "running", "reason": None,
        "spec": spec.to_dict(), "n_params_non_embedding": non_embedding_params(spec),
        "n_params_total": total_params(spec), "tokens": plan["tokens"],
        "tokens_target": plan["tokens_target"],
        "tokens_per_param": plan["tokens"] / non_embedding_params(spec),
        "steps": steps, "global_batch_size": gbs, "micro_batch_size": mbs,
        "grad_accum": accum, "seq_len": seq_len, "warmup_steps": plan["warmup_steps"],
        "epochs": plan["epochs"], "seed": train_cfg.seed, "dtype": precision,
        "attn_implementation": attn, "cpu_threads": threads, "device": device_name, "n_devices": n_proc,
        "distributed": str(accelerator.distributed_type), "flops_per_token": flops_tok,
        "peak_flops_per_device": peak, "peak_source": peak_source,
        "train_config": to_dict(train_cfg), "data_config": to_dict(data_cfg),
        "data": describe_data(data), "resumed_from_step": resumed_from,
        "init_from": train_cfg.init_from, "lora": lora_info,
        "provenance": provenance(extra_packages=("tokenizers", "safetensors")),
    }
    if accelerator.is_main_process:
        write_json(out_dir / RUN_FILE, record, default=str)
    if accelerator.is_main_process:  # the log restarts at the checkpoint: the steps after it are redone
        truncate_jsonl(out_dir / "metrics.jsonl", lambda rec: rec.get("step", 0) <= state["step"])
    metrics = (out_dir / "metrics.jsonl").open("a") if accelerator.is_main_process else None

    if train_cfg.log_with:  # the run's knobs next to its curves in TensorBoard / W&B / MLflow
        accelerator.init_trackers(out_dir.name, config={
            "n_params_non_embedding": record.get("n_params_non_embedding"), "tokens": record.get("tokens"),
            "lr": train_cfg.lr, "global_batch_size": gbs, "seq_len": seq_len, "seed": train_cfg.seed,
            "hidden_size": spec.hidden_size, "n_layers": spec.n_layers, "n_heads": spec.n_heads,
            "n_kv_heads": spec.n_kv_heads, "ffn": spec.ffn})

    def log(obj: dict) -> None:
        if metrics:
            metrics.write(json.dumps(obj) + "\n")
            metrics.flush()
        if train_cfg.log_with:
            accelerator.log({k: v for k, v in obj.items() if k != "step"}, step=obj["step"])

    from tqdm.auto import tqdm

    bar = tqdm(total=steps, initial=state["step"], unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=not (progress and accelerator.is_main_process), desc=out_dir.name[:40])
    rank = accelerator.process_index
    failure = None
    window_t, window_tok = time.perf_counter(), 0
    session_s, session_steps, first_step_s = 0.0, 0, None  # this session's steps: the first pays a compile
    model.train()
    try:
        for step in range(state["step"], steps):
            t0 = time.perf_counter()
            if "first_step_unix" not in record:  # this session's first step: the job's start-up ends here
                record["first_step_unix"] = time.time()
            lr = train_cfg.lr * lr_factor(step)
            for g in optimizer.param_groups:
                g["lr"] = lr
            loss_sum = torch.zeros((), device=accelerator.device)
            for micro in range(accum):
                # this process's micro-batch of the global batch at this step
                start = step * gbs + (micro * n_proc + rank) * mbs
                x = torch.from_numpy(data.train_batch(start, mbs, train_cfg.seed)).to(accelerator.device)
                sync = contextlib.nullcontext() if micro == accum - 1 else accelerator.no_sync(model)
                with sync:
                    loss = model(input_ids=x, labels=x).loss / accum
                    accelerator.backward(loss)
                loss_sum += loss.detach()
            accelerator.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_v = float(accelerator.reduce(loss_sum, reduction="mean"))
            dt = time.perf_counter() - t0
            state["train_time_s"] += dt
            state["step"] = step + 1
            session_s, session_steps = session_s + dt, session_steps + 1
            if first_step_s is None:
                first_step_s = dt
            if not math.isfinite(loss_v):
                failure = f"non-finite training loss ({loss_v}) at step {step + 1}"
                break
            b = train_cfg.smoothing
            state["ema"] = b * (state["ema"] or 0.0) + (1 - b) * loss_v
            state["ema_weight"] = b * state["ema_weight"] + (1 - b)
            smooth = state["ema"] / state["ema_weight"]
            if step >= plan["warmup_steps"]:
                best = state["best_ema"]
                state["best_ema"] = smooth if best is None else min(best, smooth)
                if smooth > train_cfg.divergence_factor * state["best_ema"]:
                    failure = (f"diverged: smoothed loss {smooth:.3f} > {train_cfg.divergence_factor}"
                               f" x best {state['best_ema']:.3f} at step {step + 1}")
                    break
            window_tok += gbs * seq_len
            bar.update(1)
            last = step + 1 == steps
            if (step + 1) % train_cfg.log_interval == 0 or last:
                now = time.perf_counter()
                tps = window_tok / (now - window_t)
                bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
                log({"step": step + 1, "loss": loss_v, "smoothed_loss": smooth, "lr": lr,
                     "tokens_per_s": tps})
                window_t, window_tok = now, 0
            if train_cfg.eval_interval and (step + 1) % train_cfg.eval_interval == 0 and not last:
                ev = eval_loss(accelerator, model, data, plan["eval_seqs"], mbs)
                state["evals"].append({"step": step + 1, "eval_loss": ev})
                log({"step": step + 1, "eval_loss": ev})
                window_t = time.perf_counter()
            if train_cfg.checkpoint_interval and (step + 1) % train_cfg.checkpoint_interval == 0 and not last:
                state["wall_time_s"] = base_wall + time.perf_counter() - wall0
                _save_checkpoint(accelerator, out_dir, step + 1,
                                 {k: v for k, v in state.items() if k != "step"},
                                 train_cfg.keep_checkpoints)
                window_t = time.perf_counter()
    finally:
        bar.close()

    tokens_done = state["step"] * gbs * seq_len
    tps = tokens_done / state["train_time_s"] if state["train_time_s"] else None
    record.update({
        "tokens_trained": tokens_done,
        "smoothed_train_loss": (state["ema"] / state["ema_weight"]) if state["ema"] is not None else None,
        "train_time_s": state["train_time_s"],
        "tokens_per_s": tps,
        # this session's rate without its first step (the compile, the allocator's warm-up), and that step's seconds
        "first_step_s": first_step_s,
        "steady_tokens_per_s": ((session_steps - 1) * gbs * seq_len / (session_s - first_step_s)
                                if session_steps > 1 and session_s > first_step_s else None),
        "mfu": (tps * flops_tok / (peak * n_proc)) if tps and math.isfinite(peak) else None,
        "eval_history": state["evals"],
    })
    if failure is None:
        ev = eval_loss(accelerator, model, data, plan["eval_seqs"], mbs)
        state["evals"].append({"step": steps, "eval_loss": ev})
        log({"step": steps, "eval_loss": ev})
        record["final_eval_loss"] = ev
        record["eval_tokens"] = plan["eval_seqs"] * seq_len
        _save_final_model(accelerator, model, data.tokenizer, out_dir / MODEL_DIR, progress)
        record["model_dir"] = str(out_dir / MODEL_DIR)
        record["status"] = "ok"
    else:
        record.update({"status": "failed", "reason": failure, "final_eval_loss": None})
    record["wall_time_s"] = base_wall + time.perf_counter() - wall0
    record["sessions"] = state["sessions"]
    record["finished_unix"] = time.time()
    if metrics:
        metrics.close()
    if train_cfg.log_with:
        accelerator.end_training()
    if accelerator.is_main_process:
        if record["status"] == "ok":  # the model folder's README.md: shape, training, provenance
            write_run_card(out_dir / MODEL_DIR, json.loads(json.dumps(record, default=str)))
        write_json(out_dir / RUN_FILE, record, default=str)
    accelerator.wait_for_everyone()
    return record


def _save_final_model(accelerator, model, tokenizer, folder: Path, progress: bool) -> None:
    """save_pretrained (safetensors) + tokenizer: loads with from_pretrained, evaluable by lm-eval.
    Not atomic, and need not be: run.json's status ``ok``, written after it, marks the model
    complete; a kill during the save leaves the run ``running``, so it resumes and saves again."""
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        if not progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        unwrapped = accelerator.unwrap_model(model)
        if hasattr(unwrapped, "merge_and_unload"):  # LoRA: the adapters alone, then merged weights
            unwrapped.save_pretrained(str(folder / "adapter"), safe_serialization=True)
            unwrapped = unwrapped.merge_and_unload()
            state = None
        unwrapped.config.use_cache = True
        unwrapped.save_pretrained(str(folder), state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(str(folder))
        follow_umask(folder)  # safetensors writes the weights 0600; the run folder follows the umask
    accelerator.wait_for_everyone()

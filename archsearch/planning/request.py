"""One deployment plan from start to end (``archsearch plan``; docs/method.md section 8): the
request as the command line gives it, every check before any measurement, then measure, choose
and write ``OUT/plan.json`` and its figure. The command (:mod:`archsearch.cli.plan`) parses its
flags into a :class:`PlanRequest`, calls :func:`plan_deployment` and prints what it returns; errors name
the command's flags, the way a user gave the request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archsearch.arch import weight_bytes
from archsearch.benchmarks.base import BenchSettings, get_backend
from archsearch.configio import field_defaults
from archsearch.errors import ArchsearchError
from archsearch.fileio import write_json
from archsearch.hardware import device_key, get_device, local_device_name
from archsearch.planning import planner as pl
from archsearch.planning.cost import resolve_price
from archsearch.planning.limits import Limits
from archsearch.planning.lora import LoraSettings, parse_targets
from archsearch.provenance import provenance


_BENCH = field_defaults(BenchSettings)  # a measurement's defaults, stated once in its type


@dataclass
class PlanRequest:
    """What ``archsearch plan`` is asked (one field per flag; None: not given)."""

    candidates: list[str]
    out: str
    backend: str = "hf"
    batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 4])
    prefill_lens: list[int] = dataclasses.field(default_factory=lambda: [128])
    decode_lens: list[int] = dataclasses.field(default_factory=lambda: [32])
    repeats: int = _BENCH["repeats"]
    warmup: int = _BENCH["warmup"]
    dtype: str = _BENCH["dtype"]
    timeout: float = _BENCH["timeout_s"]
    torch_threads: int | None = None
    max_tpot_s: float | None = None
    max_ttft_s: float | None = None
    serve_max_memory_gib: float | None = None
    finetune_max_memory_gib: float | None = None
    max_finetune_hours: float | None = None
    max_finetune_minutes: float | None = None
    max_finetune_cost: float | None = None
    price: float | None = None
    max_peak_memory_gib: float | None = None
    lora_variants: str = "lora"
    lora_ranks: list[int] | None = None
    lora_rank: int | None = None
    lora_target_sets: str | None = None
    lora_targets: str | None = None
    finetune_tokens: float = 1e6
    finetune_batch_sizes: list[int] | None = None
    finetune_batch_size: int | None = None
    finetune_seq_len: int = 512
    finetune_dtype: str | None = None
    finetune_device: str | None = None
    mfu: float | None = None
    lora_calibration: str | None = None
    calibrate_lora: bool = False


@dataclass
class PlanOutcome:
    """What :func:`plan_deployment` found and wrote: the plan document (``plan.json`` less its provenance,
    plus the figure), each candidate's plan, the recommended one and how to fine-tune it."""

    doc: dict[str, Any]
    plans: list[Any]
    best: Any
    command: list[str] | None
    note: str | None
    problems: list[str]
    out: Path
    figure: Path


@dataclass
class _Checked:
    limits: Limits
    grid: Any
    candidates: list[Any]
    finetune: Any
    settings_kw: dict[str, Any]


def check_request(req: PlanRequest) -> _Checked:
    """Every check of ``req`` (arithmetic, files named, the engine present), before anything is
    measured or written; an :class:`ArchsearchError` names the flag to fix."""
    for one, many in (("lora_rank", "lora_ranks"), ("lora_targets", "lora_target_sets"),
                      ("finetune_batch_size", "finetune_batch_sizes"), ("max_finetune_hours", "max_finetune_minutes")):
        if getattr(req, one) is not None and getattr(req, many) is not None:
            raise ArchsearchError(f"--{many.replace('_', '-')}", f"given together with --{one.replace('_', '-')}",
                                  "give one of them")
    for new in ("serve_max_memory_gib", "finetune_max_memory_gib"):
        if req.max_peak_memory_gib is not None and getattr(req, new) is not None:
            raise ArchsearchError("--max-peak-memory-gib", f"given together with --{new.replace('_', '-')}",
                                  "use --serve-max-memory-gib and --finetune-max-memory-gib (the older flag sets both)")
    serve_mem = req.serve_max_memory_gib if req.max_peak_memory_gib is None else req.max_peak_memory_gib
    ft_mem = req.finetune_max_memory_gib if req.max_peak_memory_gib is None else req.max_peak_memory_gib
    max_hours = req.max_finetune_hours if req.max_finetune_minutes is None else req.max_finetune_minutes / 60
    ranks = tuple(req.lora_ranks) if req.lora_ranks else ((req.lora_rank,) if req.lora_rank else (8,))
    sets = ([parse_targets(t) for t in req.lora_target_sets.split(";") if t.strip()] if req.lora_target_sets
            else [parse_targets(req.lora_targets or "attention")])
    lora = LoraSettings(rank=ranks[0], targets=sets[0])
    if not (req.finetune_tokens > 0):
        raise ArchsearchError("--finetune-tokens", f"must be positive, got {req.finetune_tokens!r}")
    limits = Limits(max_ttft_s=req.max_ttft_s, max_tpot_s=req.max_tpot_s, max_peak_memory_gib=serve_mem)
    grid = pl.PlanGrid(tuple(req.batch_sizes), tuple(req.prefill_lens), tuple(req.decode_lens))
    candidates = [pl.resolve_option(c) for c in req.candidates]
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ArchsearchError("--candidates", f"a candidate is named twice in {names}")
    if req.finetune_device is None:
        req.finetune_device = local_device_name() or "cpu"
    calibration = None
    if (req.lora_calibration or req.calibrate_lora) and req.mfu is not None:
        raise ArchsearchError("--mfu", "given together with a LoRA calibration", "give one of them")
    if req.lora_calibration:
        calibration = pl.LoraCalibration.load(req.lora_calibration)
        # refuses a calibration from another device (q_proj: an adapter every model has)
        pl.predict_lora_step_time(candidates[0].spec, LoraSettings(lora.rank, ("q_proj",)), 1, 8,
                                  req.finetune_device, calibration=calibration)
    if req.calibrate_lora:
        here = local_device_name()
        if here is None or device_key(req.finetune_device) != device_key(here):
            raise ArchsearchError("--calibrate-lora", f"this machine is {here}, the fine-tune is planned on "
                                  f"{req.finetune_device}", "calibrate on that device and pass --lora-calibration")
    variants = tuple(v.strip() for v in req.lora_variants.split(",") if v.strip())
    finetune = pl.FinetunePlan(lora=lora, tokens=req.finetune_tokens, batch_size=req.finetune_batch_size or 8,
                               seq_len=req.finetune_seq_len, max_hours=max_hours,
                               device=req.finetune_device, mfu=req.mfu, calibration=calibration,
                               variants=variants, ranks=ranks, target_sets=tuple(sets),
                               batch_sizes=tuple(req.finetune_batch_sizes or ()), dtype=req.finetune_dtype,
                               max_memory_gib=ft_mem, max_cost_usd=req.max_finetune_cost,
                               price_per_hour=req.price)
    if finetune.max_cost_usd is not None:
        price = resolve_price(get_device(finetune.device), finetune.price_per_hour)
        if price.usd_per_hour is None:
            raise ArchsearchError("--max-finetune-cost", f"a cost limit on {finetune.device}, which has no price",
                                  "give --price USD_PER_HOUR, or plan on a device of the table (--finetune-device)")
    # a lower bound of the weights' memory: "auto" is bfloat16 on a GPU, float32 on CPU
    dtype = "bfloat16" if req.dtype == "auto" else req.dtype
    if limits.max_peak_memory_gib is not None:
        least = min(weight_bytes(c.spec, dtype) / 2**30 for c in candidates)
        if least > limits.max_peak_memory_gib:
            flag = "--max-peak-memory-gib" if req.max_peak_memory_gib is not None else "--serve-max-memory-gib"
            raise ArchsearchError(flag, f"{limits.max_peak_memory_gib:g} GiB is unsatisfiable for serving: the "
                                  f"smallest candidate's weights alone take {least:.4g} GiB at {dtype}",
                                  "raise the limit or add a smaller candidate")
    for c in candidates:  # some target set of the search must apply to every candidate
        pl.search_finetune(c.spec, finetune)
    if req.torch_threads and req.backend != "hf":
        raise ArchsearchError("--torch-threads", f"sets the hf backend's torch threads, not {req.backend}'s",
                              "leave it out with --backend " + req.backend)
    engine_args = {"torch_threads": req.torch_threads} if req.torch_threads else {}
    settings_kw = {"backend": req.backend, "repeats": req.repeats, "warmup": req.warmup, "dtype": req.dtype,
                   "timeout_s": req.timeout, "engine_args": engine_args}
    BenchSettings(**settings_kw, batch_sizes=list(grid.batch_sizes), input_len=max(grid.prefill_lens),
                  output_len=max(grid.decode_lens))  # bad grid/settings fail here, before any work
    get_backend(req.backend).check_available()
    return _Checked(limits, grid, candidates, finetune, settings_kw)


def _fail_if_unreachable(problems: list[str], req: PlanRequest) -> None:
    """One error naming the first unreachable fine-tuning limit (the flag as given) and every line."""
    if not problems:
        return
    flags = {"finetune_max_memory_gib": "--max-peak-memory-gib" if req.max_peak_memory_gib is not None
             else "--finetune-max-memory-gib",
             "max_finetune_hours": "--max-finetune-minutes" if req.max_finetune_minutes is not None
             else "--max-finetune-hours", "max_finetune_cost_usd": "--max-finetune-cost"}
    flag = flags.get(problems[0].split("=")[0], "limits")
    raise ArchsearchError(flag, "; ".join(problems), "raise the limit, add a smaller candidate, search more "
                          "variants or batch sizes, or plan fewer --finetune-tokens")


def plan_deployment(req: PlanRequest) -> PlanOutcome:
    """Check ``req`` (:func:`check_request`), measure every candidate on the grid (resumable in
    ``req.out``), plan each one's serving and LoRA fine-tune, recommend the largest within every
    limit, and write ``plan.json`` (with provenance) and the figure."""
    c = check_request(req)
    out = Path(req.out)
    specs = {cand.name: cand.spec for cand in c.candidates}
    # per candidate: its own calibration (--calibrate-lora), else the given one, else none
    cals: dict[str, pl.LoraCalibration | str | None] = {cand.name: None for cand in c.candidates}
    if req.calibrate_lora:  # the measurements the fine-tune budget check below needs
        # the memory limit needs no time: checked before calibrating
        _fail_if_unreachable(pl.finetune_unreachable(specs, dataclasses.replace(
            c.finetune, max_hours=None, max_cost_usd=None)), req)
        cals = pl.calibrate_lora(c.candidates, c.finetune, out, threads=req.torch_threads)
    _fail_if_unreachable(pl.finetune_unreachable(
        specs, c.finetune, {n: (v if isinstance(v, pl.LoraCalibration) else None) for n, v in cals.items()}), req)
    measured = pl.measure_grid(c.candidates, c.grid, c.settings_kw, out)
    plans = [pl.plan_option(cand, c.grid, measured, req.backend, c.limits, c.finetune, cals[cand.name])
             for cand in c.candidates]
    best = pl.recommend(plans)
    problems = pl.unsatisfiable(plans, c.limits, c.finetune)
    command = note = None
    if best is not None:
        cand = next(x for x in c.candidates if x.name == best.name)
        command, note = pl.finetune_command(best, cand, c.finetune, out)
    ft = c.finetune
    doc = {"kind": "plan", "backend": req.backend, "grid": {"batch_sizes": list(c.grid.batch_sizes),
           "prefill_lens": list(c.grid.prefill_lens), "decode_lens": list(c.grid.decode_lens)},
           "limits": {"serving": c.limits.to_dict(),
                      "finetune": {"max_memory_gib": ft.max_memory_gib, "max_hours": ft.max_hours,
                                   "max_cost_usd": ft.max_cost_usd}},
           "finetune": {"variants": list(ft.variants), "ranks": list(ft.ranks),
                        "target_sets": [list(t) for t in ft.target_sets], "batch_sizes": list(ft.batches()),
                        "tokens": ft.tokens, "dtype": ft.compute_dtype,
                        "seq_len": ft.seq_len, "device": ft.device, "rule": pl.FINETUNE_RULE,
                        "step_time": ("calibrated on each candidate's own real LoRA step (--calibrate-lora)"
                                      if req.calibrate_lora else ft.calibration.describe() if ft.calibration
                                      else "uncalibrated: MFU x peak (pass --calibrate-lora or --lora-calibration)"),
                        "calibration": ft.calibration.to_dict() if ft.calibration else None},
           "candidates": [pl.plan_to_dict(cp) for cp in plans],
           "recommended": best.name if best else None, "finetune_command": command, "finetune_note": note,
           "unsatisfiable": problems, "measurements": str(out / pl.MEASUREMENTS)}
    write_json(out / "plan.json", {**doc, "provenance": provenance(extra_packages=("peft",))})
    png = pl.plot_tradeoff(plans, out / "plan.png", c.limits, best)
    doc["figure"] = str(png)
    return PlanOutcome(doc, plans, best, command, note, problems, out, png)

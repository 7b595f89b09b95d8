"""Measured counterparts of the predictions, on this machine: peak memory and training time.

Each memory point runs in a fresh Python subprocess (``python -m archsearch.planning.measured``)
so that no allocator state or cached tensor of an earlier point leaks into it. The peak is the
process's resident-set high-water mark (``VmHWM``), reset with ``/proc/self/clear_refs`` after
the imports so that only the model and the work count; the baseline RSS before the model is
built is subtracted. glibc is told to serve every allocation over 64 KiB with ``mmap``
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the RSS at once, as they leave a
CUDA caching allocator's "allocated" count; without it glibc may keep freed heap pages
resident and the peak then measures the allocator, not the model. On a GPU the same quantity
is ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

from archsearch.arch import ArchSpec, from_hf_config, to_hf_config, total_params
from archsearch.errors import ArchsearchError
from archsearch.evaluation.models import load_model, resolve_model
from archsearch.hf import without_sklearn
from archsearch.trainers.corpus import shakespeare_split
from archsearch.trainers.loop import apply_lora


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise ArchsearchError("measure", f"/proc/self/status has no {key}", "peak RSS needs Linux /proc")


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError as e:
        raise ArchsearchError("measure", f"cannot reset the RSS high-water mark: {e}",
                              "needs Linux >= 4.0 with a writable /proc/self/clear_refs") from None


def _build(spec: ArchSpec):
    import torch

    without_sklearn()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    # the spec's own family (LLaMA, Qwen, the MoE families), as exported
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec, "float32"))).float()


def _child(kind: str, spec: ArchSpec, batch: int, a: int, b: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    # warm-up on a tiny model of the same kind: every lazy import and first-use buffer of
    # transformers/torch is paid before the baseline, so the baseline holds none of the model
    tiny = ArchSpec(n_layers=1, hidden_size=64, n_heads=1, n_kv_heads=1, head_dim=64, ffn=64, vocab_size=64)
    _run(kind, _build(tiny), tiny, 1, 8, 1)
    gc.collect()
    rss0 = _status_bytes("VmRSS")
    model = _build(spec)
    gc.collect()
    rss_model = _status_bytes("VmRSS")
    _reset_peak()
    _run(kind, model, spec, batch, a, b)
    peak = _status_bytes("VmHWM")
    return {"weights_rss_bytes": rss_model - rss0, "peak_bytes": peak - rss0,
            "baseline_rss_bytes": rss0, "threads": threads}


def _run(kind: str, model, spec: ArchSpec, batch: int, a: int, b: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    if kind == "inference":  # a: input_len, b: output_len; the cache ends at a + b tokens
        model.eval()
        ids = torch.randint(0, spec.vocab_size, (batch, a), generator=g)
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            del out
            for _ in range(b):
                out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                del out
    else:  # training: a: seq_len, b: steps; gradients zeroed, not freed (as predicted)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(b):
            ids = torch.randint(0, spec.vocab_size, (batch, a), generator=g)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=False)


def measure_peak_memory(kind: str, spec: ArchSpec, batch_size: int, a: int, b: int,
                        threads: int = 1, timeout: float = 300) -> dict[str, Any]:
    """Peak RSS above the pre-model baseline (bytes) of one fp32 CPU inference or training run.

    ``kind='inference'``: ``a`` = input length, ``b`` = output tokens (prefill, then ``b``
    single-token decode steps). ``kind='training'``: ``a`` = sequence length, ``b`` = AdamW
    steps (the second step is the first with optimizer states). Runs in a fresh subprocess.
    """
    if kind not in ("inference", "training"):
        raise ArchsearchError("kind", f"{kind!r}", "use inference or training")
    job = {"kind": kind, "spec": spec.to_dict(), "batch": batch_size, "a": a, "b": b, "threads": threads}
    return _run_child(job, timeout, "memory measurement")


def measure_training_time(spec: ArchSpec, tokens: int, batch_size: int, seq_len: int,
                          threads: int = 1, seed: int = 0) -> dict[str, Any]:
    """Wall (and process CPU) seconds of a plain fp32 AdamW loop over ``tokens`` random tokens.

    One untimed warm-up step first (allocations, kernel selection); the timed steps cover
    ``tokens // (batch_size * seq_len)`` steps, and the tokens actually trained are returned.
    """
    import torch

    torch.set_num_threads(threads)
    steps = tokens // (batch_size * seq_len)
    if steps < 1:
        raise ArchsearchError("tokens", f"{tokens} is less than one batch of {batch_size}x{seq_len}")
    torch.manual_seed(seed)
    model = _build(spec).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)

    def step() -> None:
        ids = torch.randint(0, spec.vocab_size, (batch_size, seq_len), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    # process CPU time beside wall time: on a shared machine it is far less disturbed by
    # other jobs, so a law fit on it separates the law's error from the machine's noise
    return {"wall_time_s": time.perf_counter() - t0, "cpu_time_s": time.process_time() - c0,
            "tokens": steps * batch_size * seq_len, "steps": steps, "threads": threads}


def _lora_child(job: dict[str, Any]) -> dict[str, Any]:
    """One LoRA fine-tuning measurement in this (fresh) process: see :func:`measure_lora_step`."""
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    b, s, steps = job["batch"], job["seq_len"], job["steps"]
    model, spec, batches, weights = _lora_model(job)
    data = batches(b, s, steps + 1)
    gc.collect()
    rss_model = _status_bytes("VmRSS")
    model, info = apply_lora(model, spec, job["rank"], tuple(job["targets"]))
    _reset_peak()
    wall, cpu, losses = _lora_steps(model, data, job.get("lr", 1e-3))
    peak = _status_bytes("VmHWM") - rss_model
    return {"spec": spec.to_dict(), "weights": weights, "trainable_params": info["trainable_params"],
            "step_wall_s": wall, "step_cpu_s": cpu, "losses": losses, "peak_above_model_bytes": peak,
            "model_rss_bytes": rss_model, "threads": job["threads"], "rank": job["rank"],
            "targets": list(job["targets"]), "batch": b, "seq_len": s}


def _lora_model(src: dict[str, Any]):
    """(model in train mode, spec, batches(b, s, n) -> n x b x s token ids, description):
    ``src["model"]`` real weights and real text, else ``src["spec"]`` random weights and tokens."""
    import torch

    if src.get("model"):
        model, tok = load_model(resolve_model(src["model"]), device="cpu")
        spec = from_hf_config(model.config.to_dict())
        n = sum(p.numel() for p in model.parameters())
        if n != total_params(spec):
            raise RuntimeError(f"{src['model']}: {n} parameters, the spec accounts {total_params(spec)}")
        ids: list[int] = []
        for f in shakespeare_split()[0]:
            ids += tok(f.read_text(errors="replace")[:200_000])["input_ids"]
            if len(ids) >= 65536:
                break

        def batches(b: int, s: int, n: int):
            if len(ids) < b * s * n:
                raise RuntimeError("the corpus is shorter than the tokens asked for")
            return torch.tensor(ids[:b * s * n]).view(n, b, s)
        weights = f"{src['model']} (real weights, real text)"
    else:
        spec = ArchSpec.from_dict(src["spec"])
        model = _build(spec)

        def batches(b: int, s: int, n: int):
            return torch.randint(0, spec.vocab_size, (n, b, s), generator=torch.Generator().manual_seed(1))
        weights = f"{spec.name or 'spec'} (random weights, random tokens)"
    model.train()
    model.config.use_cache = False
    return model, spec, batches, weights


def _lora_steps(model, data, lr: float) -> tuple[list[float], list[float], list[float]]:
    """AdamW on the trainable (adapter) parameters over ``data``'s batches: step 0 is a
    warm-up, untimed; (wall seconds, process CPU seconds, losses)."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    wall, cpu, losses = [], [], []
    for i in range(len(data)):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=data[i], labels=data[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # adapter gradients stay allocated, as predicted
        losses.append(float(loss))
        del loss
        if i:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return wall, cpu, losses


def _lora_schedule_child(job: dict[str, Any]) -> dict[str, Any]:
    """Time a schedule of LoRA configurations in one process, every model loaded once: each
    entry wraps its model with fresh adapters, trains them (warm-up + timed steps) and removes
    them again (peft ``unload``), so neighbouring entries see the same machine state."""
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    models = {k: _lora_model(src) for k, src in job["models"].items()}
    out = []
    for e in job["schedule"]:
        model, spec, batches, weights = models[e["model"]]
        wrapped, info = apply_lora(model, spec, e["rank"], tuple(e["targets"]))
        wall, cpu, losses = _lora_steps(wrapped, batches(e["batch"], e["seq_len"], job["steps"] + 1), 1e-3)
        models[e["model"]] = (wrapped.unload(), spec, batches, weights)
        out.append({**e, "spec": spec.to_dict(), "weights": weights, "trainable_params": info["trainable_params"],
                    "step_wall_s": wall, "step_cpu_s": cpu, "losses": losses})
    return {"entries": out, "threads": job["threads"]}


def measure_lora_schedule(models: dict[str, dict[str, Any]], schedule: list[dict[str, Any]], steps: int = 3,
                          threads: int = 1, timeout: float = 3600) -> dict[str, Any]:
    """Time per step of each LoRA configuration in ``schedule`` (dicts with ``model`` (a key of
    ``models``), ``rank``, ``targets``, ``batch``, ``seq_len``), run in that order in one fresh
    subprocess; ``models``: key -> ``{"model": name or folder}`` (real weights) or ``{"spec":
    spec dict}`` (random weights). For ratios between neighbouring entries on a machine whose
    speed drifts; peak memory needs one process per configuration (:func:`measure_lora_step`)."""
    job = {"kind": "lora_schedule", "models": models, "schedule": schedule, "steps": steps, "threads": threads}
    return _run_child(job, timeout, "LoRA schedule measurement")


def measure_lora_points(*, spec: ArchSpec, rank: int, targets: tuple[str, ...], batch_sizes: tuple[int, ...],
                        seq_len: int, steps: int = 2, threads: int = 1, timeout: float = 1800) -> list[dict[str, Any]]:
    """Step times of real short LoRA fine-tunes of ``spec`` (random weights and tokens) at each of
    ``batch_sizes`` x ``seq_len``, one after the other in one fresh subprocess
    (:func:`measure_lora_schedule`: the model built once, fresh adapters per point, a warm-up and
    ``steps`` timed steps each): one dict per batch size (``weights``, ``threads``,
    ``step_wall_s``, ``step_cpu_s``, ...). For a step-time calibration: no peak memory (that needs a
    process per point, :func:`measure_lora_step`), one start of torch and peft instead of one per point."""
    schedule = [{"model": "m", "rank": rank, "targets": list(targets), "batch": b, "seq_len": seq_len}
                for b in batch_sizes]
    res = measure_lora_schedule({"m": {"spec": spec.to_dict()}}, schedule, steps=steps, threads=threads,
                                timeout=timeout)
    return [{**e, "threads": res["threads"]} for e in res["entries"]]


def _run_child(job: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
    """``job`` (a memory or LoRA measurement) run by this module in a fresh subprocess
    (``threads`` OpenMP threads); its last stdout line is the result."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(job["threads"]))
    p = subprocess.run([sys.executable, "-m", "archsearch.planning.measured", json.dumps(job)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}): {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure_lora_step(*, model: str | None = None, spec: ArchSpec | None = None, rank: int, targets: tuple[str, ...],
                      batch_size: int, seq_len: int, steps: int = 3, threads: int = 1,
                      timeout: float = 1800) -> dict[str, Any]:
    """Time per step and peak memory of a real short LoRA fine-tune (peft adapters from
    :func:`archsearch.trainers.loop.apply_lora`, AdamW on the adapters only), fp32 on CPU, in
    a fresh subprocess: ``model`` (a reference model name or a Hugging Face folder with weights
    and tokenizer: real text from the offline corpus) or ``spec`` (random weights and tokens,
    the same speed). One untimed warm-up step, then ``steps`` timed ones (wall and process CPU
    seconds each). Peak memory is the RSS high-water mark above the RSS after the model is
    loaded (:func:`archsearch.planning.lora.predict_lora_memory` less its weights term)."""
    if (model is None) == (spec is None):
        raise ArchsearchError("model", "give exactly one of model (real weights) and spec (random weights)")
    if steps < 1:
        raise ArchsearchError("steps", f"must be >= 1, got {steps}")
    job = {"kind": "lora", "model": model, "spec": None if spec is None else spec.to_dict(), "rank": rank,
           "targets": list(targets), "batch": batch_size, "seq_len": seq_len, "steps": steps, "threads": threads}
    return _run_child(job, timeout, "LoRA step measurement")


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    if job["kind"] == "lora":
        res = _lora_child(job)
    elif job["kind"] == "lora_schedule":
        res = _lora_schedule_child(job)
    else:
        res = _child(job["kind"], ArchSpec.from_dict(job["spec"]), job["batch"], job["a"], job["b"], job["threads"])
    print(json.dumps(res))

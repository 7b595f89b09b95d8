"""Model cards: a ``README.md`` in every model folder the project writes, for a person (and the
Hugging Face Hub, which shows a folder's README.md as its card) to read what the folder holds.

* a study's ``chosen/`` (:func:`write_study_cards`, from ``summary.json``): the shape, the law and
  the predicted loss with its interval, the measured throughput ratio to the baseline with its
  interval and the engine and device it was measured on, provenance, and how to load it; the
  study's trained model folders get the same card with their training run added;
* a trained model (``OUT/model`` of ``archsearch train``, :func:`write_run_card`): the shape, the
  training run (tokens, losses, device) and provenance.

Every card names the config it came from by hash (:func:`config_hash`, secrets masked first).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe
from archsearch.configio import mask_secrets
from archsearch.fileio import atomic_write, read_jsonl_lines

CARD = "README.md"
_SHAPE = (("n_layers", "layers"), ("hidden_size", "hidden size"), ("n_heads", "query heads"),
          ("n_kv_heads", "KV heads"), ("head_dim", "head dim"), ("ffn", "SwiGLU intermediate size"),
          ("vocab_size", "vocabulary"), ("tie_embeddings", "tied embeddings"), ("family", "family"),
          ("n_params_non_embedding", "parameters, non-embedding"), ("n_params_total", "parameters, total"),
          ("hidden_over_sqrt_n", "hidden / sqrt(N)"), ("mlp_to_attn_ratio", "r = MLP / attention"),
          ("gqa", "GQA (query heads per KV head)"), ("kv_cache_bytes_per_token", "KV cache bytes per token"))


def config_hash(config: Any) -> str | None:
    """A short SHA-256 of a config's canonical JSON (URL passwords masked before hashing)."""
    if config is None:
        return None
    text = json.dumps(mask_secrets(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _num(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower() if isinstance(v, bool) else "n/a"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _shape_table(arch: dict[str, Any]) -> list[str]:
    rows = ["| field | value |", "|---|---|"]
    rows += [f"| {label} | {_num(arch[k])} |" for k, label in _SHAPE if k in arch]
    return rows


def _provenance_lines(prov: dict[str, Any] | None, cfg_hash: str | None) -> list[str]:
    prov = prov or {}
    versions = {k: v for k, v in (prov.get("versions") or {}).items() if v}
    out = [f"- archsearch {versions.pop('archsearch', 'n/a')}, git {prov.get('git') or 'n/a'}",
           f"- config hash (SHA-256, first 16 hex): `{cfg_hash or 'n/a'}`",
           f"- recorded {prov.get('time_utc', 'n/a')} on {prov.get('host', 'n/a')} "
           f"({(prov.get('device') or {}).get('name') or 'n/a'})"]
    if versions:
        out.append("- versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))
    return out


def _load_lines(path: str, trained: bool, tokens: float | None = None) -> list[str]:
    if trained:
        how = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
               f"model = AutoModelForCausalLM.from_pretrained({path!r})",
               f"tokenizer = AutoTokenizer.from_pretrained({path!r})", "```",
               f"Evaluate it: `archsearch eval --model {path} --tasks offline`."]
    else:
        how = ["This folder holds the shape (a `config.json` that transformers and vLLM load), not weights.",
               "```python", "from transformers import AutoConfig, AutoModelForCausalLM",
               f"model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({path!r}))  # random weights",
               "```", f"Train it: `archsearch train --arch {path} --tokens {_num(tokens) if tokens else 'D'}`; "
               f"measure it: `archsearch bench --backend vllm --arch {path}` (random weights run at the same speed)."]
    return ["## How to load it", "", *how]


def _measurement(out: Path, arch: dict[str, Any], batch: int | None) -> dict[str, Any] | None:
    """The latest measurement record of the study that holds ``arch`` at the reference batch."""
    path = out / "measurements.jsonl"
    if not path.is_file():
        return None
    shape = ArchSpec.from_record(arch).to_dict()
    keys = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn")
    found = None
    for rec in read_jsonl_lines(path):
        res = (rec or {}).get("result") or {}
        specs = res.get("specs") or ([res["spec"]] if res.get("spec") else [])
        if any(all(s.get(k) == shape[k] for k in keys) for s in specs if isinstance(s, dict)) and \
                (batch is None or res.get("batch_size") in (None, batch)):
            found = res
    return found


def _engine_lines(s: dict[str, Any], measured: dict[str, Any] | None) -> list[str]:
    backend = s.get("backend")
    if measured is None:
        return [f"- engine: {backend or 'n/a'}; device: n/a (no measurement record found)"]
    prov = measured.get("provenance") or {}
    versions = prov.get("versions") or {}
    version = versions.get(backend) or versions.get(f"{backend}-cpu")
    device = measured.get("device") or (prov.get("device") or {}).get("name")
    settings = measured.get("settings") or {}
    line = (f"- engine: {backend}{' ' + version if version else ''}; device: {device or 'n/a'}; dtype "
            f"{measured.get('dtype') or settings.get('dtype') or 'n/a'}; input {settings.get('input_len')} / "
            f"output {settings.get('output_len')} tokens; measured {prov.get('time_utc', 'n/a')}")
    out = [line]
    if backend == "analytic":
        out.append("- the analytic backend predicts throughput from a roofline: a prediction, not a measurement")
    return out


def study_card(summary: dict[str, Any], out: Path, path: str, run: dict[str, Any] | None = None) -> str:
    """The card of a study's chosen shape (``summary``: the study's ``summary.json``); with
    ``run`` (a trained model's ``run.json``), that model's training added."""
    c = summary["chosen"]
    arch = c["architecture"]
    cfg = summary.get("config") or {}
    law = summary.get("law") or {}
    iv = c.get("predicted_loss_interval")
    level = f"{cfg.get('target', {}).get('confidence') or 0.9:.0%}" if iv else ""
    lines = ["---", "library_name: transformers", "tags: [archsearch]", "---", "",
             f"# {summary['study']}: the chosen architecture", "",
             f"Chosen by an archsearch study ({c.get('source')}): the fastest shape whose predicted loss "
             f"meets the target. The study folder's `report.md` has the evidence in full.", "",
             "## Shape", "", *_shape_table(arch), "",
             "## Predicted loss", "",
             f"- law: {law.get('form')} (`{law.get('file')}`, fit status {law.get('status') or 'n/a'})",
             f"- at N = {_num(cfg.get('params'))} non-embedding parameters and D = {_num(cfg.get('tokens'))} tokens",
             f"- predicted loss {_num(c.get('predicted_loss'))}"
             + (f", {level} interval [{_num(iv[0])}, {_num(iv[1])}]" if iv else " (no interval: the law has no bootstrap)"),
             f"- target loss {_num(summary.get('target_loss'))} ({summary.get('target_source')})", ""]
    lines += ["## Throughput", ""]
    q = c.get("ratio")
    b = summary.get("reference_batch_size")
    if c.get("is_baseline"):
        lines.append("- this is the baseline: no feasible shape measured significantly faster")
    if q:
        lines.append(f"- x{q['ratio']:.3f} the baseline's throughput at batch {b}, {q.get('level', 0.9):.0%} "
                     f"interval [{q['lo']:.3f}, {q['hi']:.3f}] over {q.get('n', 'n/a')} paired rounds "
                     f"({'significantly faster' if q.get('significantly_faster') else 'not significantly faster'})")
    if c.get("throughput"):
        lines.append(f"- {c['throughput']:,.0f} output tokens/s at batch {b}")
    lines += [*_engine_lines(summary, _measurement(out, arch, b)), ""]
    if run is not None:
        lines += _run_lines(run) + [""]
    lines += ["## Provenance", "", *_provenance_lines(summary.get("provenance"), config_hash(cfg)), "",
              *_load_lines(path, trained=run is not None, tokens=cfg.get("tokens")), ""]
    return "\n".join(lines)


def _run_lines(run: dict[str, Any]) -> list[str]:
    return ["## Training", "",
            f"- {_num(run.get('tokens_trained') or run.get('tokens'))} tokens in {_num(run.get('steps'))} steps "
            f"(batch {_num(run.get('global_batch_size'))} x {_num(run.get('seq_len'))} tokens), seed {run.get('seed')}",
            f"- final held-out eval loss {_num(run.get('final_eval_loss'))}; smoothed train loss "
            f"{_num(run.get('smoothed_train_loss'))}",
            f"- data: {(run.get('data_config') or {}).get('source')}, tokenizer "
            f"{(run.get('data_config') or {}).get('tokenizer')}",
            f"- trained on {run.get('device')} x{run.get('n_devices')} ({run.get('dtype')}), "
            f"{_num(run.get('wall_time_s'))} s, {_num(run.get('tokens_per_s'))} tokens/s"]


def run_card(run: dict[str, Any], path: str) -> str:
    """The card of a trained model (``run``: its ``run.json``)."""
    spec = ArchSpec.from_record(run["spec"])
    cfg = {"train": run.get("train_config"), "data": run.get("data_config")}
    lines = ["---", "library_name: transformers", "tags: [archsearch]", "---", "",
             f"# {run.get('run_id') or 'archsearch run'}", "",
             "A decoder trained from scratch with `archsearch train`.", "",
             "## Shape", "", *_shape_table(describe(spec)), "", *_run_lines(run), "",
             "## Provenance", "", *_provenance_lines(run.get("provenance"), config_hash(cfg)), "",
             *_load_lines(path, trained=True), ""]
    return "\n".join(lines)


def write_run_card(model_dir: str | Path, run: dict[str, Any]) -> Path:
    """``model_dir/README.md`` for a trained model."""
    model_dir = Path(model_dir)
    return atomic_write(model_dir / CARD, run_card(run, str(model_dir)))


def write_study_cards(out: Path, summary: dict[str, Any]) -> list[Path]:
    """``chosen/README.md``, and the card of each trained model of the study whose shape is the
    chosen one (``final/model``, ``final/candidate-*/model``) with its training run."""
    if not summary.get("chosen") or not (out / "chosen").is_dir():
        return []
    written = [atomic_write(out / "chosen" / CARD, study_card(summary, out, str(out / "chosen")))]
    keys = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn")
    arch = summary["chosen"]["architecture"]
    for run_file in sorted(out.glob("final/run.json")) + sorted(out.glob("final/candidate-*/run.json")):
        try:
            run = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        model = run_file.parent / "model"
        if run.get("status") == "ok" and model.is_dir() and all(run["spec"].get(k) == arch[k] for k in keys):
            written.append(atomic_write(model / CARD, study_card(summary, out, str(model), run)))
    return written

"""Model cards: a ``README.md`` in every model folder the project writes, for a person (and the
Hugging Face Hub, which shows a folder's README.md as its card) to read what the folder holds.

* a study's ``chosen/`` (:func:`write_study_cards`, from ``summary.json``): the shape, the law and
  the predicted loss with its interval, the measured throughput ratio to the baseline with its
  interval and the engine and device it was measured on, provenance, and how to load it; the
  study's trained model folders get the same card with their training run added;
* a trained model (``OUT/model`` of ``archsearch train``, :func:`write_run_card`): the shape, the
  training run (tokens, losses, device) and provenance.

Every card names the config it came from by hash (:func:`config_hash`, secrets masked first).
Cards are written through huggingface_hub's ``ModelCard``/``ModelCardData``: license, datasets,
pipeline tag, library and a results block (model-index: the held-out eval loss and lm-eval's
scores), which the Hub reads; each throughput figure says whether it was measured (engine,
device, at which N) or predicted (which roofline and calibration).
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
LICENSE = "apache-2.0"  # the project's (pyproject.toml): the code that wrote the shape and trained the weights
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


def _measurement(out: Path, arch: dict[str, Any], batch: int | None, key: str | None = None) -> dict[str, Any] | None:
    """The measurement record of the chosen shape: the one its trial names (``key``), else the
    latest record that holds ``arch`` at the reference batch."""
    path = out / "measurements.jsonl"
    if not path.is_file():
        return None
    shape = ArchSpec.from_record(arch).to_dict()
    keys = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn")
    found = None
    for rec in read_jsonl_lines(path):
        res = (rec or {}).get("result") or {}
        if key is not None and rec.get("key") == key:
            return res
        specs = res.get("specs") or ([res["spec"]] if res.get("spec") else [])
        if any(all(s.get(k) == shape[k] for k in keys) for s in specs if isinstance(s, dict)) and \
                (batch is None or res.get("batch_size") in (None, batch)):
            found = res
    return found


def _engine_lines(s: dict[str, Any], measured: dict[str, Any] | None) -> list[str]:
    """Where the throughput figures came from: measured on which engine and device, or predicted
    by which roofline and calibration; and at which N (``measure.params`` rebuilds every shape)."""
    backend = s.get("backend")
    cfg = s.get("config") or {}
    measure = cfg.get("measure") or {}
    n_measured = s.get("measured_params")
    at_n = (f"the shape rebuilt at N = {n_measured:,.0f} non-embedding parameters (measure.params; same "
            f"d/sqrt(N), r and GQA), not at the study's N = {_num(cfg.get('params'))}" if n_measured else
            f"at the study's N = {_num(cfg.get('params'))}")
    if backend == "analytic" or (measured or {}).get("predicted"):
        device = (((measured or {}).get("settings") or {}).get("device_spec")
                  or (measure.get("bench") or {}).get("device_spec") or "n/a")  # the device predicted for
        return [f"- **predicted, not measured**: the analytic roofline of {device}, "
                f"{s.get('calibration') or 'uncalibrated (peak figures)'}; {at_n}"]
    if measured is None:
        return [f"- engine: {backend or 'n/a'}; device: not recorded (no measurement record of this shape "
                f"in the study folder); {at_n}"]
    prov = measured.get("provenance") or {}
    versions = prov.get("versions") or {}
    version = measured.get("backend_version") or versions.get(backend) or versions.get(f"{backend}-cpu")
    device = measured.get("device") or (prov.get("device") or {}).get("name")
    settings = measured.get("settings") or {}
    return [f"- engine: {backend}{' ' + version if version else ''}; device: {device or 'n/a'}; dtype "
            f"{measured.get('dtype') or settings.get('dtype') or 'n/a'}; input {settings.get('input_len')} / "
            f"output {settings.get('output_len')} tokens; measured {prov.get('time_utc', 'n/a')}",
            f"- measured {at_n}"]


def _ratio_line(q: dict[str, Any], b: Any) -> str:
    if q.get("predicted"):  # a formula has no noise: no interval, no significance
        return f"- x{q['ratio']:.3f} the baseline's throughput at batch {b}, predicted (no interval)"
    return (f"- x{q['ratio']:.3f} the baseline's throughput at batch {b}, {q.get('level', 0.9):.0%} "
            f"interval [{q['lo']:.3f}, {q['hi']:.3f}] over {q.get('n', 'n/a')} paired rounds "
            f"({'significantly faster' if q.get('significantly_faster') else 'not significantly faster'})")


def _datasets(data_config: dict[str, Any] | None) -> list[str]:
    """The training data's names as a card's ``datasets`` lists them (a Hub id where it is one)."""
    src = (data_config or {}).get("source")
    srcs = src if isinstance(src, list) else [src] if src else []
    return [str(x).removeprefix("hf:").split(":")[0] for x in srcs]


def _eval_results(model_name: str, eval_loss: float | None, data_config: dict[str, Any] | None,
                  lm_eval: dict[str, Any] | None) -> list[Any]:
    """The card's results block (model-index): the held-out eval loss and lm-eval's scores."""
    from huggingface_hub import EvalResult

    out = []
    data = (_datasets(data_config) or ["n/a"])[0]
    if eval_loss is not None:
        out.append(EvalResult(task_type="text-generation", dataset_type=data, dataset_name=f"{data} (held-out split)",
                              metric_type="loss", metric_value=float(eval_loss), metric_name="eval loss"))
    for task, metrics in ((lm_eval or {}).get("results") or {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or "_stderr" in metric or not filt:
                continue
            out.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                  metric_type=metric, metric_value=float(value), metric_name=f"{task} {metric} (lm-evaluation-harness)"))
    return out


def _card(body: list[str], *, model_name: str, data_config: dict[str, Any] | None = None,
          eval_loss: float | None = None, lm_eval: dict[str, Any] | None = None) -> str:
    """A card through huggingface_hub's ModelCard: its metadata (license, datasets, pipeline tag,
    library, results) above ``body``."""
    from huggingface_hub import ModelCard, ModelCardData

    results = _eval_results(model_name, eval_loss, data_config, lm_eval)
    data = ModelCardData(license=LICENSE, library_name="transformers", pipeline_tag="text-generation",
                         tags=["archsearch"], datasets=_datasets(data_config) or None,
                         model_name=model_name if results else None, eval_results=results or None)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)))


def _lm_eval_lines(lm_eval: dict[str, Any] | None, where: str) -> list[str]:
    rows = [(t, k.partition(",")[0], v) for t, m in ((lm_eval or {}).get("results") or {}).items()
            for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and "_stderr" not in k and "," in k]
    if not rows:
        return []
    version = (((lm_eval or {}).get("provenance") or {}).get("versions") or {}).get("lm_eval")
    return ["## lm-evaluation-harness", "", f"From `{where}`" + (f" (lm-eval {version})." if version else "."),
            "", "| task | metric | value |", "|---|---|---|", *[f"| {t} | {m} | {_num(v)} |" for t, m, v in rows], ""]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def study_card(summary: dict[str, Any], out: Path, path: str, run: dict[str, Any] | None = None,
               lm_eval: dict[str, Any] | None = None) -> str:
    """The card of a study's chosen shape (``summary``: the study's ``summary.json``); with
    ``run`` (a trained model's ``run.json``), that model's training added, and with ``lm_eval``
    (its ``eval.json``) its lm-eval scores."""
    c = summary["chosen"]
    arch = c["architecture"]
    cfg = summary.get("config") or {}
    law = summary.get("law") or {}
    iv = c.get("predicted_loss_interval")
    level = f"{cfg.get('target', {}).get('confidence') or 0.9:.0%}" if iv else ""
    lines = [f"# {summary['study']}: the chosen architecture", "",
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
        lines.append(_ratio_line(q, b))
    if c.get("throughput"):
        pb = c.get("baseline_throughput_same_rounds")
        lines.append(f"- {c['throughput']:,.0f} output tokens/s at batch {b}"
                     + (f", beside the baseline's {pb:,.0f} in the same paired rounds" if pb else "")
                     + (" (predicted)" if (q or {}).get("predicted") or summary.get("backend") == "analytic" else ""))
    lines += [*_engine_lines(summary, _measurement(out, arch, b, c.get("measurement_key"))), ""]
    if run is not None:
        lines += _run_lines(run) + [""]
        lines += _lm_eval_lines(lm_eval, "eval.json")
    lines += ["## Provenance", "", *_provenance_lines(summary.get("provenance"), config_hash(cfg)), "",
              *_load_lines(path, trained=run is not None, tokens=cfg.get("tokens")), ""]
    data_cfg = (run or {}).get("data_config") or (((cfg.get("proxy") or {}).get("sweep") or {}).get("data"))
    return _card(lines, model_name=f"{summary['study']}-chosen", data_config=data_cfg,
                 eval_loss=(run or {}).get("final_eval_loss"), lm_eval=lm_eval if run is not None else None)


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


def run_card(run: dict[str, Any], path: str, lm_eval: dict[str, Any] | None = None) -> str:
    """The card of a trained model (``run``: its ``run.json``; ``lm_eval``: its ``eval.json``)."""
    spec = ArchSpec.from_record(run["spec"])
    cfg = {"train": run.get("train_config"), "data": run.get("data_config")}
    lines = [f"# {run.get('run_id') or 'archsearch run'}", "",
             "A decoder trained from scratch with `archsearch train`.", "",
             "## Shape", "", *_shape_table(describe(spec)), "", *_run_lines(run), "",
             *_lm_eval_lines(lm_eval, "eval.json"),
             "## Provenance", "", *_provenance_lines(run.get("provenance"), config_hash(cfg)), "",
             *_load_lines(path, trained=True), ""]
    return _card(lines, model_name=str(run.get("run_id") or "archsearch-run"), data_config=run.get("data_config"),
                 eval_loss=run.get("final_eval_loss"), lm_eval=lm_eval)


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
            # its lm-eval scores: its own eval.json (predict-rank-select), else the study's (the final model's)
            ev = _read_json(run_file.parent / "eval.json") or (_read_json(out / "eval.json")
                                                                  if run_file.parent == out / "final" else None)
            written.append(atomic_write(model / CARD, study_card(summary, out, str(model), run, ev)))
    return written

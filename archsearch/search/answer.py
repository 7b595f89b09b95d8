"""The study's answer: the chosen architecture and the evidence for it, decided in one place
(:func:`decide`), rendered by the report and ``summary.json`` (:meth:`Answer.summary`) and
written as a loadable model folder, ``chosen/`` (:func:`write_chosen`)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe, write_hf_config
from archsearch.trainers.tokenizer import load_saved_tokenizer


@dataclass(frozen=True)
class Answer:
    """A chosen shape and why: its predicted loss (with the law's interval), its measured
    throughput at the reference batch and its paired ratio to the baseline (with the 90% interval),
    and where it comes from (an Optuna trial, a local GQA step, predict-rank-select's released
    model, or the baseline kept because nothing was significantly faster)."""
    spec: ArchSpec
    source: str
    predicted_loss: float
    predicted_loss_interval: tuple[float, float] | None = None
    throughput: float | None = None       # tokens/s; None for the kept baseline (its paired mean is reported)
    ratio: dict[str, Any] | None = None   # paired ratio to the baseline: ratio, lo, hi, significantly_faster
    trial: int | None = None              # the Optuna trial it came from or was built around
    gqa: int | None = None                # the local GQA search's step, when that picked it
    trained: dict[str, Any] | None = None  # predict-rank-select: run_dir, eval_loss, downstream accuracy
    is_baseline: bool = False
    best_candidate: Answer | None = None  # with the kept baseline: the best shape, not significantly faster

    @property
    def significantly_faster(self) -> bool:
        return bool(self.ratio and self.ratio.get("significantly_faster"))

    def summary(self, baseline_throughput: float | None, config_json: Path) -> dict[str, Any]:
        """The ``chosen`` block of ``summary.json`` (the kept baseline's throughput is the mean of
        its paired rounds, measured beside the candidates)."""
        s = {"architecture": describe(self.spec),
             "throughput": baseline_throughput if self.is_baseline else self.throughput,
             "ratio": self.ratio, "predicted_loss": self.predicted_loss,
             "predicted_loss_interval": self.predicted_loss_interval, "is_baseline": self.is_baseline,
             "source": self.source, "trial": self.trial, "gqa_step": self.gqa,
             "config_json": str(config_json)}
        if self.trained is not None:
            s["trained"] = self.trained
        if self.best_candidate is not None:
            b = self.best_candidate
            s["best_candidate"] = {"architecture": describe(b.spec), "throughput": b.throughput,
                                   "ratio": b.ratio, "predicted_loss": b.predicted_loss, "source": b.source}
        return s


def predicted_interval(spec: ArchSpec, ctx) -> tuple[float, float] | None:
    """The law's bootstrap interval of the predicted loss at the study's N and D (at the chance
    constraint's level when the target has one)."""
    level = ctx.cfg.target.confidence
    iv = ctx.law.predict_interval(spec, ctx.cfg.tokens, params=ctx.cfg.params,
                                  **({"level": 2 * level - 1} if level else {}))
    return tuple(float(v) for v in iv) if iv is not None else None


def from_point(p: dict[str, Any], ctx) -> Answer:
    """An answer from a measured trial point (``report.pareto_set``'s rows)."""
    spec = ArchSpec.from_dict(p["spec"])
    return Answer(spec=spec, source=p["source"], predicted_loss=p["predicted_loss"],
                  predicted_loss_interval=predicted_interval(spec, ctx), throughput=p["throughput"],
                  ratio=p.get("ratio"), trial=p.get("trial"))


def decide(best: dict[str, Any] | None, gqa: dict[str, Any] | None, prs: dict[str, Any] | None, ctx) -> Answer | None:
    """The chosen shape: predict-rank-select's released model (``prs``) when that ran; else the
    local GQA search's pick (``gqa``) when it measured faster than the study's best trial, or when
    the walk did not admit that trial's head pair (:func:`gqa_admits`); else that trial. A new shape is the answer only if significantly faster than the baseline (its
    paired ratio's interval above 1); otherwise the baseline, with the best candidate beside it."""
    released = (prs or {}).get("released")
    if released:
        a = from_point(released, ctx)
        return Answer(**{**a.__dict__, "trained": {k: released.get(k) for k in
                                                   ("run_dir", "eval_loss", "downstream_accuracy")}})
    if best is None:
        return None
    answer = from_point(best, ctx)
    c = (gqa or {}).get("chosen")
    if c and c.get("ratio") and answer.ratio and (c["ratio"]["ratio"] > answer.ratio["ratio"]
                                                  or not gqa_admits(gqa, answer.spec)):
        spec = ArchSpec.from_dict(c["spec"])
        why = "" if gqa_admits(gqa, answer.spec) else \
            (f"; the walk did not admit the best trial's {answer.spec.n_heads}/{answer.spec.n_kv_heads} heads: "
             f"{'their loss was not checked or was worse' if gqa.get('loss_check') == 'proxies' else 'beyond its bound'}")
        answer = Answer(spec=spec, source=f"GQA search (GQA={c['gqa']}{why})", predicted_loss=c["predicted_loss"],
                        predicted_loss_interval=predicted_interval(spec, ctx), throughput=c["throughput"],
                        ratio=c["ratio"], trial=best.get("trial"), gqa=c["gqa"])
    return keep_baseline_unless_faster(answer, ctx)


def gqa_admits(gqa: dict[str, Any], spec: ArchSpec) -> bool:
    """Whether the local GQA search admits ``spec``'s head pair: the walk reached it (within its
    bounds, before any stop) and it passed the loss check where there was one. The best trial's
    pair is one of the walk's variants; one it did not admit (fewer KV heads than a variant whose
    loss was worse, or than the bound) is not the answer however fast. A result written before
    the walk checked loss (no ``loss_check``) admits every pair."""
    if "loss_check" not in gqa:
        return True
    return any(st.get("n_heads") == spec.n_heads and st.get("n_kv_heads") == spec.n_kv_heads and st["feasible"]
               and st.get("loss_ok") is not False for st in gqa.get("steps", []))


def keep_baseline_unless_faster(answer: Answer, ctx) -> Answer:
    """``answer`` when it was measured paired and is significantly faster than the baseline (or
    was not measured paired at all); otherwise the baseline, with ``answer`` as its best candidate."""
    if answer.ratio is None or answer.significantly_faster:
        return answer
    base = ctx.baseline
    return Answer(spec=base, source="the baseline: no feasible shape measured significantly faster",
                  predicted_loss=float(ctx.law.predict(base, ctx.cfg.tokens, params=ctx.cfg.params)),
                  predicted_loss_interval=predicted_interval(base, ctx), is_baseline=True, best_candidate=answer)


def write_chosen(ctx, out: Path, answer: Answer) -> Path:
    """``chosen/``, a folder vLLM and transformers load without extra flags: the config in the
    dtype the study measured it in, and the study's tokenizer when it trained with one."""
    spec = answer.spec
    dtype = ctx.measurer.measured_dtype(spec) or \
        (ctx.cfg.measure.bench.dtype if ctx.cfg.measure.bench.dtype != "auto" else "bfloat16")
    folder = out / "chosen"
    write_hf_config(spec, folder, dtype=dtype)
    tok = study_tokenizer(out)
    if tok is not None and not (folder / "tokenizer.json").is_file():
        with tempfile.TemporaryDirectory(prefix=".tokenizer.", dir=folder) as tmp:
            load_saved_tokenizer(tok).save_pretrained(tmp)
            # moved in with tokenizer.json last: its presence marks the tokenizer complete
            for f in sorted(Path(tmp).iterdir(), key=lambda f: f.name == "tokenizer.json"):
                os.replace(f, folder / f.name)
    return folder


def study_tokenizer(out: Path) -> Path | None:
    """A model folder of this study with a saved tokenizer (final model, else a proxy run)."""
    for pattern in ("final/model", "final/candidate-*/model", "proxies/*/runs/*/model"):
        for folder in sorted(out.glob(pattern)):
            if (folder / "tokenizer.json").is_file():
                return folder
    return None

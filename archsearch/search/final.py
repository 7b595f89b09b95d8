"""The study's last stages: train the answer on the full budget (predict-rank-select: the top k
candidates, each evaluated, and one released by :data:`RELEASE_RULE`), and evaluate it with
lm-evaluation-harness (docs/method.md sections 4 and 7)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.errors import ArchsearchError
from archsearch.evaluation.runner import evaluate
from archsearch.fileio import atomic_write, write_json
from archsearch.search.answer import Answer
from archsearch.search.checks import final_train_configs
from archsearch.search.config import StudyConfig
from archsearch.search.report import top_k_candidates
from archsearch.trainers.loop import train


def train_final(cfg: StudyConfig, out: Path, ctx, study, answer: Answer) -> dict[str, Any] | None:
    """Train the chosen shape; in predict-rank-select mode, train the top-k and release one
    (returned, and written to ``predict_rank_select.json``)."""
    tc, data_cfg = final_train_configs(cfg)
    if cfg.mode != "predict-rank-select":
        train(answer.spec, tc, data_cfg, out / "final")
        return None
    results = []
    for i, c in enumerate(top_k_candidates(study, ctx, cfg.top_k)):
        run_dir = out / "final" / f"candidate-{i}"
        rec = train(ArchSpec.from_dict(c["spec"]), tc, data_cfg, run_dir)
        row = {**c, "run_dir": str(run_dir), "status": rec.get("status"),
               "eval_loss": rec.get("final_eval_loss"), "downstream_accuracy": None}
        if rec.get("status") == "ok":
            ev = evaluate(run_dir / "model", cfg.evaluation.tasks, limit=cfg.evaluation.limit,
                          batch_size=cfg.evaluation.batch_size, out=run_dir / "eval.json")
            row["downstream_accuracy"] = downstream_accuracy(ev)
            row["downstream"] = {t: m.get("acc,none") for t, m in ev.get("results", {}).items()}
        results.append(row)
    released = release_best(results, ctx.target_loss, cfg.release_accuracy_tolerance)
    record = {"target_loss": ctx.target_loss, "tasks": cfg.evaluation.tasks, "candidates": results,
              "released": released, "rule": RELEASE_RULE.format(tol=cfg.release_accuracy_tolerance)}
    write_json(out / "predict_rank_select.json", record, default=str)
    return json.loads(json.dumps(record, default=str))  # as a resumed run reads it back


RELEASE_RULE = ("of the trained candidates, those whose mean downstream accuracy is within {tol} of the "
                "best; of these, the highest measured throughput. Without downstream accuracies: the "
                "fastest whose held-out loss meets the target, else the lowest held-out loss")


def downstream_accuracy(ev: dict[str, Any]) -> float | None:
    """Mean accuracy (lm-eval's ``acc``) over the tasks that report one; None if none does."""
    accs = [m["acc,none"] for m in ev.get("results", {}).values() if isinstance(m.get("acc,none"), (int, float))]
    return sum(accs) / len(accs) if accs else None


def release_best(results: list[dict[str, Any]], target_loss: float,
                 accuracy_tolerance: float = 0.01) -> dict[str, Any] | None:
    """Predict-rank-select's last step (docs/method.md section 4): chosen by downstream accuracy and measured
    efficiency (:data:`RELEASE_RULE`)."""
    trained = [r for r in results if r.get("status") == "ok" and r.get("eval_loss") is not None]
    if not trained:
        return None
    scored = [r for r in trained if r.get("downstream_accuracy") is not None]
    if scored:
        top = max(r["downstream_accuracy"] for r in scored)
        near = [r for r in scored if r["downstream_accuracy"] >= top - accuracy_tolerance]
        best = max(near, key=lambda r: r["throughput"])
        why = f"downstream accuracy {best['downstream_accuracy']:.4f} (best {top:.4f}), the fastest of {len(near)}"
    else:
        meeting = [r for r in trained if r["eval_loss"] <= target_loss]
        best = max(meeting, key=lambda r: r["throughput"]) if meeting else min(trained, key=lambda r: r["eval_loss"])
        why = f"held-out loss {best['eval_loss']:.4f}"
    return {**best, "source": f"predict-rank-select: trained candidate (trial {best['trial']}), {why}"}


def evaluate_final(cfg: StudyConfig, out: Path, prs: dict[str, Any] | None) -> None:
    released = (prs or {}).get("released")
    if released and (Path(released["run_dir"]) / "eval.json").is_file():
        # predict-rank-select already evaluated every candidate on these tasks
        atomic_write(out / "eval.json", (Path(released["run_dir"]) / "eval.json").read_text())
        return
    model = Path(released["run_dir"]) / "model" if released else out / "final" / "model"
    if not model.exists():
        raise ArchsearchError("evaluation.enabled", "there is no trained model to evaluate",
                              "enable final_train too, or run the train stage first")
    evaluate(model, cfg.evaluation.tasks, limit=cfg.evaluation.limit,
             batch_size=cfg.evaluation.batch_size, out=out / "eval.json")

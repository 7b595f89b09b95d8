"""The verify stage: the answer trained beside the baseline (docs/method.md section 4, step 5).

A prediction that no run checks is not an answer. As the method's source verified its own models,
this stage trains the chosen shape and the baseline at the study's N on the same tokens
(``final_train``'s budget, optimisation and data; one run per seed in ``verify.seeds``, the two
models of a seed sharing its data order and schedule), evaluates both with lm-evaluation-harness
on the study's tasks (``evaluation``), and measures both paired on the study's engine (fresh
rounds, apart from the search's). It writes ``verify.json``:

- each model's realised held-out loss over the seeds (mean, Student-t interval), beside the law's
  prediction and its interval;
- the paired relative loss difference (chosen / baseline - 1, per seed) and the verdict: the answer
  *met* the loss target when trained (the difference's interval entirely within the target's
  slack, or its realised loss's interval under an explicit ``target.loss``), was *within the noise*
  (the interval straddles it) or *missed* it (entirely beyond); and whether it is faster (the
  paired throughput ratio's interval above 1). A miss is said as a miss;
- where the answer did not meet the target, the fastest measured runner-up whose predicted loss,
  corrected by the answer's own prediction error, would have met it (untrained: said so);
- ``track_record``: the predicted and realised loss, and the search's and the verification's
  throughput ratio, which ``benchmarks/scripts/bench_verifications.py`` gathers over studies.

Training runs go through the cluster's executor (``cluster.parallel``) like the proxies, else here
one after another; a finished run (``run.json`` ok or failed) is never trained again, so the stage
resumes. Nothing here decides the answer: it checks it.
"""

from __future__ import annotations

import math
import statistics
import traceback
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec, describe
from archsearch.evaluation.runner import evaluate
from archsearch.fileio import read_json_tolerant, write_json
from archsearch.provenance import stage_provenance
from archsearch.search import log
from archsearch.search.answer import Answer, predicted_interval
from archsearch.search.checks import final_train_configs
from archsearch.search.config import StudyConfig
from archsearch.search.workers import JOBS_DIR
from archsearch.trainers.jobs import has_record, run_train_jobs
from archsearch.trainers.loop import RUN_FILE, read_record, run_id_for, train
from archsearch.trainers.sweep import failed_record

VERIFY_FILE = "verify.json"
VERIFY_DIR = "verify"
# the paired measurement's attempt number in the measurement store: fresh rounds, never the
# search's (attempt 0) or the GQA walk's re-measurement (1)
VERIFY_ATTEMPT = 100
ROLES = ("chosen", "baseline")


# -- statistics -----------------------------------------------------------------------------------

def mean_interval(xs: list[float], level: float) -> dict[str, Any]:
    """Mean of ``xs`` with its two-sided Student-t ``level`` interval (none from one value)."""
    from scipy.special import stdtrit

    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return {"n": 0, "mean": None, "lo": None, "hi": None, "sd": None}
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"n": 1, "mean": m, "lo": None, "hi": None, "sd": None}
    sd = statistics.stdev(xs)
    h = float(stdtrit(len(xs) - 1, (1 + level) / 2)) * sd / math.sqrt(len(xs))
    return {"n": len(xs), "mean": m, "lo": m - h, "hi": m + h, "sd": sd}


def loss_outcome(iv: dict[str, Any], bound: float) -> str:
    """``met`` (the interval entirely at or under ``bound``), ``within the noise`` (it straddles
    it), ``missed`` (entirely above); from one value, ``met``/``missed`` with no interval."""
    if iv["mean"] is None:
        return "not trained"
    if iv["lo"] is None:
        return "met" if iv["mean"] <= bound else "missed"
    if iv["hi"] <= bound:
        return "met"
    return "missed" if iv["lo"] > bound else "within the noise"


def speed_outcome(q: dict[str, Any] | None) -> str:
    if not q:
        return "not measured"
    return "faster" if q["lo"] > 1 else "slower" if q["hi"] < 1 else "not significantly faster"


def lm_eval_metrics(evs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """task -> metric -> {value: mean over the runs, stderr: lm-eval's, combined over the runs as
    for a mean of independent estimates, runs}: every metric lm-eval reports with a numeric stderr."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task in sorted({t for ev in evs for t in ev.get("results", {})}):
        per: dict[str, list[tuple[float, float]]] = {}
        for ev in evs:
            m = ev.get("results", {}).get(task) or {}
            for k, v in m.items():
                if "_stderr," in k or "," not in k or not isinstance(v, (int, float)):
                    continue
                name, filt = k.split(",", 1)
                se = m.get(f"{name}_stderr,{filt}")
                if isinstance(se, (int, float)) and math.isfinite(v) and math.isfinite(se):
                    per.setdefault(name, []).append((float(v), float(se)))
        out[task] = {name: {"value": statistics.fmean(v for v, _ in xs),
                            "stderr": math.sqrt(sum(se * se for _, se in xs)) / len(xs), "runs": len(xs)}
                     for name, xs in per.items()}
    return out


# -- the stage ------------------------------------------------------------------------------------

def verify_runs(cfg: StudyConfig, models: dict[str, ArchSpec]) -> list[tuple[str, str, int, ArchSpec, Any]]:
    """(role, run id, seed, spec, train config) of every verification run: each model once per
    seed, on ``final_train``'s budget and optimisation, the seed setting the data order."""
    tc, _ = final_train_configs(cfg)
    return [(role, f"{role}-{run_id_for(spec, tc.tokens, seed)}", seed, spec, tc.replace(seed=seed))
            for role, spec in models.items() for seed in cfg.verify.seeds]


def train_verify_runs(cfg: StudyConfig, out: Path, runs: list[tuple[str, str, int, ArchSpec, Any]],
                      progress: bool = True) -> dict[str, Path]:
    """Train the runs not finished yet into ``verify/runs/<run id>`` (as the cluster's jobs where
    ``cluster.parallel``); a run that fails is recorded failed, not raised. Returns run id -> folder."""
    _, data_cfg = final_train_configs(cfg)
    dirs = {rid: out / VERIFY_DIR / "runs" / rid for _, rid, _, _, _ in runs}
    todo = [(rid, spec, tc) for _, rid, _, spec, tc in runs if not has_record(dirs[rid])]
    if todo and cfg.cluster.parallel:
        log(f"verify: {len(todo)} training run(s) as jobs ({cfg.cluster.executor})")
        run_train_jobs(todo, data_cfg, dirs, cfg.cluster, out / JOBS_DIR / VERIFY_DIR)
    for i, (rid, spec, tc) in enumerate(todo if not cfg.cluster.parallel else []):
        log(f"verify: training {rid} ({i + 1}/{len(todo)}) on {tc.tokens:.3g} tokens into {dirs[rid]}")
        try:
            train(spec, tc, data_cfg, dirs[rid], progress=progress)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # recorded: the verdict then says the model was not verified
            dirs[rid].mkdir(parents=True, exist_ok=True)
            write_json(dirs[rid] / RUN_FILE, failed_record(spec, rid, tc.tokens, tc.seed,
                                                           f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)}"),
                       default=str)
    return dirs


def evaluate_runs(cfg: StudyConfig, dirs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """lm-eval on every trained run's model (``eval.json`` beside it; read back when there)."""
    evs = {}
    for rid, d in dirs.items():
        rec = read_record(d) or {}
        if rec.get("status") != "ok":
            continue
        ev = read_json_tolerant(d / "eval.json", "the run's evaluation")
        if ev is None:
            log(f"verify: lm-eval {cfg.evaluation.tasks} on {rid}")
            ev = evaluate(d / "model", cfg.evaluation.tasks, limit=cfg.evaluation.limit,
                          batch_size=cfg.evaluation.batch_size, out=d / "eval.json")
        evs[rid] = ev
    return evs


def measure_pair(ctx, chosen: ArchSpec) -> dict[str, Any]:
    """The chosen shape against the baseline, paired in one engine process on the study's engine,
    in fresh rounds (:data:`VERIFY_ATTEMPT`)."""
    m = ctx.measurer.compare([ctx.baseline, chosen], attempt=VERIFY_ATTEMPT)
    pr = m.result
    if not pr.ok:
        return {"ok": False, "error": pr.error, "measurement_key": m.key, "backend": ctx.measurer.backend}
    est = pr.estimate(1, instance_var=ctx.measurer.instance_var()).to_dict()
    return {"ok": True, "ratio": est, "throughput": {"chosen": pr.throughput(1), "baseline": pr.throughput(0)},
            "rounds": len(pr.rounds), "measurement_key": m.key, "backend": ctx.measurer.backend,
            "batch_size": ctx.ref_batch, "measured_params": ctx.cfg.measure.params,
            # what the rounds hold: output tokens/s, or online goodput / 1 / latency (measure.mode: online)
            "objective": pr.settings.get("objective", "throughput")}


def verify_answer(ctx, out: Path, answer: Answer, candidates: list[dict[str, Any]],
                  progress: bool = True) -> dict[str, Any]:
    """Train, evaluate and measure the answer beside the baseline; write and return ``verify.json``
    (module docstring). ``candidates``: the search's feasible measured shapes (``report.pareto_set``),
    where a runner-up is looked for."""
    cfg = ctx.cfg
    vc = cfg.verify
    tc, _ = final_train_configs(cfg)
    models = {"baseline": ctx.baseline} if answer.is_baseline else {"chosen": answer.spec, "baseline": ctx.baseline}
    runs = verify_runs(cfg, models)
    log(f"verify: {'the baseline (the answer)' if answer.is_baseline else 'the chosen shape and the baseline'}, "
        f"{len(vc.seeds)} seed(s) each, {tc.tokens:.3g} tokens, same data order and schedule per seed")
    dirs = train_verify_runs(cfg, out, runs, progress=progress)
    recs = {rid: read_record(dirs[rid]) or {} for _, rid, _, _, _ in runs}
    evs = evaluate_runs(cfg, dirs) if vc.lm_eval and cfg.evaluation.tasks else {}
    pair = measure_pair(ctx, answer.spec) if not answer.is_baseline else None
    if pair and pair["ok"]:
        q = pair["ratio"]
        log(f"verify: measured x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}] the baseline's throughput")
    losses = {role: {seed: recs[rid].get("final_eval_loss") if recs[rid].get("status") == "ok" else None
                     for r2, rid, seed, _, _ in runs if r2 == role} for role in models}
    per_model = {}
    for role, spec in models.items():
        pred = float(ctx.law.predict(spec, tc.tokens, params=cfg.params))
        piv = predicted_interval(spec, ctx) if tc.tokens == cfg.tokens else None
        iv = mean_interval(list(losses[role].values()), vc.level)
        rids = [rid for r2, rid, _, _, _ in runs if r2 == role]
        per_model[role] = {
            "architecture": describe(spec), "predicted_loss": pred, "predicted_loss_interval": piv,
            "losses": {str(s): v for s, v in losses[role].items()}, "loss": iv,
            "inside_predicted": (piv[0] <= iv["mean"] <= piv[1]) if piv and iv["mean"] is not None else None,
            "runs": {rid: {"dir": str(dirs[rid]), "status": recs[rid].get("status"),
                           "reason": recs[rid].get("reason")} for rid in rids},
            "lm_eval": lm_eval_metrics([evs[rid] for rid in rids if rid in evs])}
    if answer.is_baseline:
        per_model["chosen"] = per_model["baseline"]
    diffs = [] if answer.is_baseline else [losses["chosen"][s] / losses["baseline"][s] - 1 for s in vc.seeds
                                           if losses["chosen"][s] is not None and losses["baseline"][s] is not None]
    rel = mean_interval(diffs, vc.level)
    verdict = decide_verdict(cfg, answer, per_model["chosen"]["loss"], rel, pair)
    v = {"settings": {"seeds": list(vc.seeds), "tokens": tc.tokens, "level": vc.level, "tasks": cfg.evaluation.tasks
                      if vc.lm_eval else None, "limit": cfg.evaluation.limit, "attempt": VERIFY_ATTEMPT},
         "answer_is_baseline": answer.is_baseline, "answer_source": answer.source,
         "chosen": per_model["chosen"], "baseline": per_model["baseline"],
         "relative_loss": {"per_seed": diffs, **rel,
                           "predicted": per_model["chosen"]["predicted_loss"] / per_model["baseline"]["predicted_loss"] - 1},
         "search_ratio": answer.ratio, "paired": pair, "verdict": verdict,
         "runner_up": runner_up(cfg, answer, per_model, candidates, verdict) if verdict["loss"] != "met" else None,
         "provenance": stage_provenance()}
    v["track_record"] = track_record_entry(cfg, v)
    write_json(out / VERIFY_FILE, v, default=str)
    log(f"verify: {verdict['line']}")
    return read_json_tolerant(out / VERIFY_FILE, "the verification")  # as a resumed run reads it back


def decide_verdict(cfg: StudyConfig, answer: Answer, chosen_loss: dict[str, Any], rel: dict[str, Any],
                   pair: dict[str, Any] | None) -> dict[str, Any]:
    """Whether the trained answer met the loss target and whether it is faster, in one line.
    Relative target (the baseline's predicted loss x (1 + slack)): the paired relative difference's
    interval against the slack; explicit ``target.loss``: the chosen's realised loss interval against it."""
    if cfg.target.loss is not None:
        loss, bound, what = loss_outcome(chosen_loss, cfg.target.loss), cfg.target.loss, "its realised loss"
        shown = _iv_txt(chosen_loss, "{:.4f}") + f" against the target {cfg.target.loss:.4f}"
    else:
        loss, bound = loss_outcome(rel, cfg.target.slack), cfg.target.slack
        what = "its loss relative to the baseline's, trained the same way"
        shown = _iv_txt(rel, "{:+.2%}") + f" against the target's slack {cfg.target.slack:+.2%}"
    speed = speed_outcome((pair or {}).get("ratio")) if not answer.is_baseline else "the baseline itself"
    q = (pair or {}).get("ratio")
    n = chosen_loss["n"]
    noise = "" if n >= 2 else " (one seed: no interval, so no noise judged)"
    if answer.is_baseline:
        line = ("the answer is the baseline (no shape was significantly faster): nothing to compare; "
                f"its realised loss {_iv_txt(chosen_loss, '{:.4f}')}")
    else:
        says = {"met": "MET the loss target when trained, beyond the noise",
                "within the noise": "is WITHIN THE NOISE of the loss target when trained (neither met nor "
                                    "missed beyond it)",
                "missed": "MISSED the loss target when trained, beyond the noise",
                "not trained": "was NOT VERIFIED: its training runs failed"}[loss]
        if n < 2 and loss in ("met", "missed"):
            says = says.replace(", beyond the noise", "")
        fast = {"faster": "is significantly faster", "slower": "is significantly SLOWER",
                "not significantly faster": "is NOT significantly faster",
                "not measured": "was not measured"}[speed]
        line = (f"the chosen shape {says}{noise}: {what} {shown}; it {fast} than the baseline"
                + (f" (x{q['ratio']:.3f} [{q['lo']:.3f}, {q['hi']:.3f}], measured paired)" if q else ""))
    return {"loss": loss, "bound": bound, "speed": speed, "line": line}


def _iv_txt(iv: dict[str, Any], fmt: str) -> str:
    if iv.get("mean") is None:
        return "not available"
    if iv.get("lo") is None:
        return fmt.format(iv["mean"]) + " (one run)"
    return f"{fmt.format(iv['mean'])} [{fmt.format(iv['lo'])}, {fmt.format(iv['hi'])}]"


def runner_up(cfg: StudyConfig, answer: Answer, per_model: dict[str, Any], candidates: list[dict[str, Any]],
              verdict: dict[str, Any]) -> dict[str, Any] | None:
    """Where the answer did not meet the target: the fastest measured, significantly faster shape of
    the search whose predicted loss, scaled by the answer's realised / predicted loss, would still meet
    the target realised the same way (the baseline's realised loss x (1 + slack), or ``target.loss``).
    Untrained: a pointer for the next study, not a verified result. None where none would."""
    c, b = per_model["chosen"], per_model["baseline"]
    if answer.is_baseline or c["loss"]["mean"] is None or b["loss"]["mean"] is None:
        return None
    err = c["loss"]["mean"] / c["predicted_loss"]
    bound = cfg.target.loss if cfg.target.loss is not None else b["loss"]["mean"] * (1 + cfg.target.slack)
    key = describe(answer.spec)
    ok = [p for p in candidates if (p.get("ratio") or {}).get("significantly_faster")
          and p["predicted_loss"] * err <= bound and describe(ArchSpec.from_dict(p["spec"])) != key]
    if not ok:
        return {"found": False, "note": f"no measured shape significantly faster than the baseline would have met "
                                        f"the target with the answer's prediction error (x{err:.4f}) applied"}
    best = max(ok, key=lambda p: p["ratio"]["ratio"])
    return {"found": True, "trial": best.get("trial"), "architecture": describe(ArchSpec.from_dict(best["spec"])),
            "predicted_loss": best["predicted_loss"], "corrected_loss": best["predicted_loss"] * err, "bound": bound,
            "ratio": best["ratio"],
            "note": f"trial {best.get('trial')} would have met the target had the law erred on it as on the answer "
                    f"(predicted {best['predicted_loss']:.4f} x {err:.4f} = {best['predicted_loss'] * err:.4f} <= "
                    f"{bound:.4f}), at x{best['ratio']['ratio']:.3f} the baseline's throughput; it was not trained"}


def track_record_entry(cfg: StudyConfig, v: dict[str, Any]) -> dict[str, Any]:
    """One verification for the track record (``bench_verifications``): predicted and realised loss,
    the search's and the verification's throughput ratio, and whether each realised value fell inside
    its predicted interval."""
    c = v["chosen"]
    piv, loss = c["predicted_loss_interval"], c["loss"]["mean"]
    sq, vq = v["search_ratio"] or {}, ((v["paired"] or {}).get("ratio") or {})
    return {"study": cfg.name, "params": cfg.params, "tokens": v["settings"]["tokens"], "seeds": len(v["settings"]["seeds"]),
            "answer_is_baseline": v["answer_is_baseline"],
            "predicted_loss": c["predicted_loss"], "predicted_loss_interval": piv, "realised_loss": loss,
            "realised_loss_interval": [c["loss"]["lo"], c["loss"]["hi"]],
            "loss_inside_interval": c["inside_predicted"],
            "predicted_relative_loss": v["relative_loss"]["predicted"], "realised_relative_loss": v["relative_loss"]["mean"],
            "predicted_ratio": sq.get("ratio"), "predicted_ratio_interval": [sq.get("lo"), sq.get("hi")] if sq else None,
            "measured_ratio": vq.get("ratio"), "measured_ratio_interval": [vq.get("lo"), vq.get("hi")] if vq else None,
            "ratio_inside_interval": (sq["lo"] <= vq["ratio"] <= sq["hi"]) if sq and vq else None,
            "verdict": {k: v["verdict"][k] for k in ("loss", "speed")},
            "backend": (v["paired"] or {}).get("backend"), **{k: v["provenance"][k] for k in ("time_utc", "git", "host")}}


# -- the report's head-to-head ---------------------------------------------------------------------

def _arch(a: dict[str, Any]) -> str:
    return (f"hidden {a['hidden_size']}, {a['n_heads']}/{a['n_kv_heads']} heads, ffn {a['ffn']}"
            f"{', ' + str(a['n_layers']) + ' layers' if a.get('n_layers') else ''}")


def head_to_head_markdown(v: dict[str, Any]) -> list[str]:
    """The report's opening section: the trained answer against the trained baseline."""
    s, c, b = v["settings"], v["chosen"], v["baseline"]
    pair = v.get("paired") or {}
    q = pair.get("ratio")
    lvl = f"{s['level']:.0%}"

    def loss_cell(m: dict[str, Any]) -> str:
        return _iv_txt(m["loss"], "{:.4f}") + f" ({m['loss']['n']} seed(s))"

    def pred_cell(m: dict[str, Any]) -> str:
        iv = m.get("predicted_loss_interval")
        inside = {True: ": realised inside", False: ": realised OUTSIDE", None: ""}[m.get("inside_predicted")]
        return f"{m['predicted_loss']:.4f}" + (f" [{iv[0]:.4f}, {iv[1]:.4f}]{inside}" if iv else "")

    limit = f" (limit {s['limit']} documents a task)" if s.get("limit") else ""
    evals = f"; lm-eval on `{s['tasks']}`{limit}" if s.get("tasks") else "; no lm-eval (verify.lm_eval: false)"
    lines = ["## Head to head: the answer trained beside the baseline", "",
             f"Both trained at the study's N on {s['tokens']:.3g} tokens each, same data, order and schedule, "
             f"seeds {s['seeds']}; losses are held-out losses at the end of training, intervals {lvl} (Student t "
             f"over the seeds){evals}.", ""]
    if v["answer_is_baseline"]:
        lines += [f"**Verdict: {v['verdict']['line']}.**", ""]
        return lines
    lines += [f"| | chosen: {_arch(c['architecture'])} | baseline: {_arch(b['architecture'])} |", "|---|---|---|"]
    if q:
        lines.append(f"| throughput ratio to the baseline, measured paired ({pair['backend']}, batch {pair['batch_size']}, "
                     f"{pair['rounds']} rounds, {q['level']:.0%} interval) | **x{q['ratio']:.3f}** [{q['lo']:.3f}, "
                     f"{q['hi']:.3f}] | x1 |")
        t = pair["throughput"]
        lines.append(f"| output tokens/s in those rounds | {t['chosen']:.1f} | {t['baseline']:.1f} |")
    else:
        lines.append(f"| throughput ratio, measured paired | not measured: {pair.get('error')} | |")
    sq = v.get("search_ratio")
    if sq:
        lines.append(f"| throughput ratio the search measured (its answer's evidence) | x{sq['ratio']:.3f} "
                     f"[{sq['lo']:.3f}, {sq['hi']:.3f}] | x1 |")
    lines.append(f"| predicted loss (law, interval) | {pred_cell(c)} | {pred_cell(b)} |")
    lines.append(f"| realised loss, mean over seeds [{lvl}] | {loss_cell(c)} | {loss_cell(b)} |")
    rel = v["relative_loss"]
    lines.append(f"| loss relative to the baseline: predicted / realised (paired by seed) | {rel['predicted']:+.2%} / "
                 f"{_iv_txt(rel, '{:+.2%}')} | 0 |")
    for task in sorted(set(c["lm_eval"]) | set(b["lm_eval"])):
        for metric in sorted(set(c["lm_eval"].get(task, {})) | set(b["lm_eval"].get(task, {}))):
            cell = lambda m: (f"{m['value']:.4g} ± {m['stderr']:.2g}" if m else "-")  # noqa: E731
            lines.append(f"| lm-eval {task} {metric} (± stderr) | {cell(c['lm_eval'].get(task, {}).get(metric))} | "
                         f"{cell(b['lm_eval'].get(task, {}).get(metric))} |")
    failed = [f"{rid}: {r['reason']}" for m in (c, b) for rid, r in m["runs"].items() if r["status"] != "ok"]
    lines += ["", f"**Verdict: {v['verdict']['line']}.**", ""]
    if failed:
        lines += [f"Failed runs: {'; '.join(failed)}", ""]
    ru = v.get("runner_up")
    if ru:
        lines += [f"Runner-up: {ru['note']}" + (f" ({_arch(ru['architecture'])})." if ru.get("found") else "."), ""]
    lines += ["Runs, evaluations and this record: `verify/`, `verify.json`.", ""]
    return lines


# -- the dry run's price ------------------------------------------------------------------------------

def verify_plan(cfg: StudyConfig, train_flops_per_model: float, tokens: float) -> dict[str, Any]:
    """The dry run's line for the verify stage: what it trains, evaluates and measures."""
    vc, n = cfg.verify, 2 * len(cfg.verify.seeds)
    return {"stage": "verify",
            "action": f"train the answer and the baseline, {len(vc.seeds)} seed(s) each, on {tokens:.3g} tokens "
                      f"(same data order and schedule per seed)"
                      + (f"; lm-eval {cfg.evaluation.tasks} on each" if vc.lm_eval else "")
                      + "; one paired measurement of the two",
            "final_trainings": n, "train_flops": n * train_flops_per_model}

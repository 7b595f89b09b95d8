"""The study's stages, one record each (:class:`Stage`), in the order they run (:data:`STAGES`).

A record holds all that the rest of the study knows of its stage: its name, the work it does
(``run``), when it applies, the settings it reads (``settings``: its fingerprint, so that a
changed setting redoes it and every stage after it), the outputs it writes in the study folder
(``outputs``: moved aside when it is redone), the result a later stage reads (``result``), its
resume rules (``redo``, ``outdated``) and its entry in the dry run's plan with its cost
(``plan``). The loop (:mod:`archsearch.search.pipeline`), the dry run
(:mod:`archsearch.search.dryrun`), resume (:mod:`archsearch.search.inputs`) and the report (from
``state.json``, which the loop writes per record) read these records and nothing else; adding a
stage is one record here (docs/architecture.md).

The stages' work lives in their own modules (proxy training in :mod:`~archsearch.search.proxies`,
the law's constrained solution in :mod:`~archsearch.search.solution`, the Optuna study in
:mod:`~archsearch.search.study`, ...); the functions here join them to the study run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.cluster.startup import record_tail
from archsearch.configio import to_dict
from archsearch.errors import ArchsearchError
from archsearch.fileio import read_json_tolerant, write_json
from archsearch.laws import fit_law, load_law
from archsearch.laws.acquisition import fit_profiled
from archsearch.laws.diagnostics import held_out_error
from archsearch.laws.plots import write_plots
from archsearch.provenance import stage_provenance
from archsearch.rundata import read_runs
from archsearch.search import log
from archsearch.search.answer import Answer, decide, write_chosen
from archsearch.search.config import StudyConfig
from archsearch.search.context import search_context
from archsearch.search.final import evaluate_final, train_final
from archsearch.search.gqa import local_gqa_search
from archsearch.search.measurements import MeasurementStore, spec_key
from archsearch.search.proxies import train_active_proxies, train_proxy_grid
from archsearch.search.report import chosen_from_study, pareto_set, write_report
from archsearch.search.resolved import ResolvedStudy
from archsearch.search.settings import flat, named_file, pick
from archsearch.search.storage import recover_stale_trials
from archsearch.search.study import load_study, run_study, took_over_outcome
from archsearch.search.verify import VERIFY_FILE, verify_answer, verify_plan
from archsearch.search.workers import run_search_workers


class StudyState:
    """``state.json``: which stages are done, and for each run of a stage that did work, its
    seconds and where and when it ran (a resumed study adds a run; it never relabels one)."""

    def __init__(self, out: Path):
        self.path = out / "state.json"
        self.reload()

    def reload(self) -> None:
        """Read ``state.json``; one cut short by a killed write (or unreadable) is treated as
        absent, with a line saying so: the stages it marked done are redone, each from what it
        left (finished proxy runs, the Optuna storage, the measurement store)."""
        self.data = read_json_tolerant(self.path, "every stage it marked done") or {}

    def save(self) -> None:
        write_json(self.path, self.data, default=str)

    def done(self, stage: str) -> bool:
        return self.data.get(stage, {}).get("status") == "done"

    def mark(self, stage: str, seconds: float, extend: bool = False, **info: Any) -> None:
        """Mark ``stage`` done after a run that took ``seconds``; ``extend``: this run added to
        the stage's earlier runs (a resumed search) instead of replacing them."""
        self.reload()
        if "runs" in info:
            raise ValueError("'runs' is the stage's provenance list; name the count otherwise")
        run = {"seconds": round(seconds, 2), **stage_provenance()}
        runs = (self.data.get(stage, {}).get("runs", []) if extend else []) + [run]
        self.data[stage] = {"status": "done", "seconds": round(sum(r["seconds"] for r in runs), 2),
                            "runs": runs, **info}
        write_json(self.path, self.data, default=str)


@dataclass
class StudyRun:
    """What one run of a study passes from stage to stage: each value is computed once, by the
    stage that owns it (or read back from the study folder when that stage is done or skipped);
    what the config alone gives is on ``resolved``, resolved before the first stage."""
    resolved: ResolvedStudy
    out: Path
    state: StudyState
    progress: bool = True
    runs_path: Path | None = None     # proxy: the proxies' run table
    law: Any = None                   # fit: the fitted (or given) law
    ctx: Any = None                   # fit: the search context (law, target loss, measurer, baseline)
    study: Any = None                 # search: the Optuna study (None until one exists)
    best: dict[str, Any] | None = None    # search: the best feasible measured shape
    gqa: dict[str, Any] | None = None     # gqa: the local GQA search (as in gqa.json)
    prs: dict[str, Any] | None = None     # train: predict-rank-select's trained candidates and release
    answer: Answer | None = None      # gqa/train: the chosen shape and its evidence
    verify: dict[str, Any] | None = None   # verify: the answer trained beside the baseline (verify.json)
    summary: dict[str, Any] | None = None  # report

    @property
    def cfg(self) -> StudyConfig:
        return self.resolved.cfg


@dataclass
class PlanInputs:
    """What the dry run (:func:`archsearch.search.dryrun.dry_run`) works out once and each stage's
    ``plan`` reads: the study, its folder, and the counts of what its stages would do."""
    study: ResolvedStudy
    out: Path
    proxy_specs: list[dict[str, Any]] = field(default_factory=list)  # each proxy run to train
    backend: str | None = None        # the engine that measures here (None: missing)
    engine_note: str | None = None
    measurements: dict[str, int] = field(default_factory=dict)  # dryrun.search_comparisons
    gqa: dict[str, Any] | None = None  # dryrun.gqa_comparisons
    final_tokens: float = 0.0
    final_flops: float = 0.0          # one final model's training FLOPs
    nd_groups: int = 0                # the proxies' (N, D) groups (checks.planned_groups)

    @property
    def cfg(self) -> StudyConfig:
        return self.study.cfg


class StopStudy(Exception):
    """A stage found that the stages after it have nothing to work on: the loop stops there,
    with this line, and returns the study's state (not an error: the study resumes later)."""


@dataclass(frozen=True)
class Stage:
    """One step of the study, all its facts in one place.

    - ``run(r, fresh)`` does the stage's work when ``fresh`` (selected, applicable, not done) and
      returns what ``state.json`` records of it (None: nothing was done); otherwise it reads back
      what an earlier run left, so later stages find it on ``r``.
    - ``settings(cfg, measure_key)``: {dotted setting: value} of exactly what its outputs are
      computed with (``measure_key``: the measurement store's key settings, flat); its
      fingerprint chains these with the previous applicable stage's. None: not fingerprinted
      (rewritten on every run).
    - ``outputs``: what it writes in the study folder, moved into ``superseded/`` when it is redone.
    - ``result(cfg, out)``: the file a later stage reads (None: the config gives it); ``needs``:
      the stages whose result this one reads (``--only``/``--skip`` refuse a selection that
      leaves one missing).
    - resume rules besides the fingerprint: ``redo(cfg, out, state)`` on a done stage when a
      study starts (True: redo it; it logs why), and ``outdated(r)`` just before it runs, once
      earlier stages have run (a reason: it and the fingerprinted stages after it are redone).
    - ``plan(p)``: its entry in the dry run's plan, with what it would cost (None: not listed).
    """
    name: str
    run: Callable[[StudyRun, bool], dict[str, Any] | None]
    plan: Callable[[PlanInputs], dict[str, Any] | None]
    settings: Callable[[StudyConfig, dict[str, Any]], dict[str, Any]] | None = None
    outputs: tuple[str, ...] = ()
    applies: Callable[[StudyConfig], bool] = lambda cfg: True
    locked: Callable[[StudyConfig], bool] = lambda cfg: True  # under the folder's stage lock
    resumes_itself: bool = False  # runs even when done (the Optuna study tops itself up)
    result: Callable[[StudyConfig, Path], Path | None] = lambda cfg, out: None
    product: str = ""             # what ``result`` holds, as an error names it
    given_by: str = ""            # the setting that gives that result instead
    needs: tuple[str, ...] = ()
    redo: Callable[[StudyConfig, Path, dict[str, Any]], bool] = lambda cfg, out, state: False
    outdated: Callable[[StudyRun], str | None] = lambda r: None


def read_result(path: Path) -> dict[str, Any] | None:
    """A stage's JSON output; None where it is missing or cut short by a killed write."""
    return read_json_tolerant(path, "that stage's result")


def runs_path(cfg: StudyConfig, out: Path) -> Path:
    """The proxies' run table: ``proxy.runs``, else the one the proxy stage writes."""
    return Path(cfg.proxy.runs) if cfg.proxy.runs else out / "proxies" / "runs.csv"


def _torn(name: str) -> Callable[[StudyConfig, Path, dict[str, Any]], bool]:
    """The resume rule of a stage whose result is one JSON file: one cut by a killed write
    (read_result says so) is redone."""
    return lambda cfg, out, state: read_result(out / name) is None


# -- proxy: train the proxies ------------------------------------------------------------------

def _proxy(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Train the proxies (grid or active plan) into ``proxies/``; their table is ``runs.csv``."""
    cfg = r.cfg
    r.runs_path = runs_path(cfg, r.out) if cfg.proxy is not None else None
    if not fresh:
        return None
    train = train_active_proxies if cfg.proxy.plan == "active" else train_proxy_grid
    return train(r.resolved, r.out, r.runs_path)


def _proxy_settings(cfg: StudyConfig, measure_key: dict[str, Any]) -> dict[str, Any]:
    d = to_dict(cfg)
    s = pick(d, "proxy", drop=("proxy.runs",))
    if cfg.proxy is not None and cfg.proxy.plan == "active":  # the plan fits the law as it goes
        # the law block as recorded when it was written flat (law.fit's keys beside law's own), so
        # fingerprints recorded then still match
        law = {**d["law"]["fit"], **{k: v for k, v in d["law"].items() if k != "fit"}}
        s.update(pick({**d, "law": law}, "params", "law", drop=("law.file", "law.bootstrap")))
    return s


def _proxy_plan(p: PlanInputs) -> dict[str, Any]:
    cfg = p.cfg
    if cfg.proxy is None:
        return {"stage": "proxy", "action": f"none: the law comes from {cfg.law.file}"}
    if cfg.proxy.runs:
        return {"stage": "proxy", "action": f"reuse runs from {cfg.proxy.runs}"}
    specs, sweeps = p.proxy_specs, p.study.sweeps
    n_done = sum(1 for i in specs if i["done"])
    a = cfg.proxy.active
    return {"stage": "proxy", "action": (
            f"active plan over the grid of {len(sweeps)} sweep(s) (at most the runs and FLOPs "
            f"below; stops at interval half-width {a.tolerance} or budget {a.budget_flops}): "
            if cfg.proxy.plan == "active" else f"train {len(sweeps)} proxy sweep(s): ")
            + ", ".join(s.name for s in sweeps)
            + (f" ({n_done} of the runs already trained: "
               f"{sum(1 for i in specs if i['done'] == 'store')} in the store {cfg.proxy.store}, "
               f"{sum(1 for i in specs if i['done'] == 'study')} in this study folder; "
               "they cost nothing below)" if n_done else ""), "runs": len(specs),
            "runs_already_trained": n_done,
            "tokens": sum((i["tokens"] for i in specs), 0.0), "train_flops": sum((i["flops"] for i in specs), 0.0),
            "nd_groups": p.nd_groups}


# -- fit: the law ------------------------------------------------------------------------------

def law_plot_box(cfg: StudyConfig) -> dict[str, tuple[float, float]]:
    """The search box as the law's factor plots shade it."""
    s = cfg.search_space
    return {"x1": tuple(s.hidden_over_sqrt_n), "x2": tuple(s.mlp_to_attn)}


def _fit(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Fit the law on the proxies' runs (or read ``law.file`` / the study's ``law.json``), then
    build the search context once: the target loss and the measurer every later stage uses."""
    cfg, law_path, info = r.cfg, r.out / "law.json", None
    if cfg.law.file or not fresh:
        r.law = load_law(cfg.law.file or law_path)
    else:
        runs = [x for x in read_runs(r.runs_path) if x.status == "ok"]
        log(f"fitting {cfg.law.form} on {len(runs)} proxy runs")
        if cfg.proxy is not None and cfg.proxy.plan == "active":
            # the plan trains few runs at some sizes: fit every size's L_opt, as the plan did
            # (a best-observed L_opt biases the shape there; archsearch.laws.acquisition.fit_profiled)
            r.law = fit_profiled(runs, cfg.law.form, r.resolved.fit)
        else:
            r.law = fit_law(runs, cfg.law.form, r.resolved.fit)
        r.law = with_held_out_error(r.law, runs, r.resolved)
        r.law.save(law_path)
        write_plots(r.law, runs, [], r.out / "plots", box=law_plot_box(r.cfg))
        info = {"law_status": r.law.status, "warnings": list(r.law.warnings)}
    r.ctx = search_context(r.resolved, r.out, r.law)
    if r.ctx.measurer.note:
        log(r.ctx.measurer.note)
    return info


def with_held_out_error(law, runs, study: ResolvedStudy):
    """The fitted law with its error against trained models it was not fitted on (the loss
    constraint's margins carry it, archsearch.search.margins): the held-out size's error where
    ``law.fit.holdout_size`` held one out, else the progressive protocol's last step
    (``archsearch.laws.diagnostics.held_out_error``); with one proxy size none can be measured,
    and the law says so (its margins then rest on the bootstrap alone)."""
    cfg = study.cfg
    held = (law.metrics or {}).get("holdout")
    if held and held.get("n"):
        err = {"relative_sd": held["rmsre"], "n": held["n"], "mare": held["mare"],
               "source": f"held out: the size nearest law.fit.holdout_size={cfg.law.fit.holdout_size:.3g} ({held['n']} runs), "
                         "not fitted"}
    else:
        try:
            err = held_out_error(runs, cfg.law.form, study.fit)
        except ArchsearchError as e:
            log(f"the law's error against held-out runs is not measured: {e.problem}")
            return dataclasses.replace(law, warnings=list(law.warnings) + [
                f"prediction error not measured ({e.problem}): margins to the target rest on the bootstrap alone"])
        if cfg.proxy is not None and cfg.proxy.plan == "active":
            err["source"] += " (validated with the grid's fit, not the active plan's profiled fit)"
    log(f"the law's error on held-out runs: {err['relative_sd']:.2%} relative (sd) ({err['source']})")
    return dataclasses.replace(law, prediction_error=err)


def _fit_settings(cfg: StudyConfig, measure_key: dict[str, Any]) -> dict[str, Any]:
    s = {**{f"law.{k}": v for k, v in flat(to_dict(cfg.fit_options()), "").items()}, "law.form": cfg.law.form}
    if cfg.proxy is not None and cfg.proxy.runs:
        s.update(named_file("proxy.runs", cfg.proxy.runs))
    return s


def _fit_plan(p: PlanInputs) -> dict[str, Any]:
    cfg = p.cfg
    return {"stage": "fit", "action": f"fit {cfg.law.form} (reference {cfg.law.fit.reference}, "
            f"{cfg.law.fit.bootstrap} bootstrap resamples)" if not cfg.law.file else f"load {cfg.law.file}"}


# -- search: the law's constrained solution seeds the Optuna study ------------------------------

def _search(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """The Optuna study (it resumes from its storage; several workers may share it), seeded with
    the law's constrained solution (archsearch.search.solution), then the best feasible measured shape."""
    cfg, ctx, info = r.cfg, r.ctx, None
    if fresh:
        t = time.time()
        log(f"target loss {ctx.target_loss:.4f}; Optuna study {cfg.name} ({cfg.optuna.n_shapes} shapes, "
            f"at most {cfg.optuna.n_trials} trials) "
            f"measuring with {ctx.measurer.backend}")
        if cfg.cluster.parallel:
            workers = run_search_workers(r.resolved, r.out, stage_start=t)
            study = load_study(ctx)
        else:
            study, recovered = run_study(ctx, progress=r.progress)
            if recovered:
                log(f"recovered trials {recovered} left running by a dead process")
        while taken := wait_for_running(study):
            if cfg.cluster.parallel:  # the executor's workers are done: the next run of the stage measures them
                log(f"trials {taken} were left running by a worker that died; their shapes are enqueued again "
                    "and measured by the next run of the search stage")
                break
            log(f"trials {taken} were left running by a worker that died; their shapes are enqueued again: "
                "measuring them here")
            study, _ = run_study(ctx, progress=r.progress)
            log(took_over_outcome(study, taken))
        new = sum(1 for tr in study.get_trials(deepcopy=False)
                  if tr.datetime_start and tr.datetime_start.timestamp() >= t)
        if new or not r.state.done("search"):  # a no-op rerun adds no time and no run
            info = {"extend": True}
        else:
            log("search: the study has its trials already; nothing measured")
    r.study = load_study(ctx)
    r.best = chosen_from_study(r.study) if r.study is not None else None
    if fresh and cfg.cluster.parallel:  # the coordinator's seconds after its workers ended (startups.json)
        record_tail(r.out, "search", "search_tail_s", workers, since=t)
    if r.study is None:
        raise StopStudy("no Optuna study yet: run the search stage to measure candidates")
    return info


def wait_for_running(study, timeout_s: float = 3600, poll_s: float = 2.0) -> list[int]:
    """Another worker may still be measuring: the next stages need its result. A trial whose
    worker died meanwhile (its process gone on this host, its heartbeat silent elsewhere:
    ``recover_stale_trials``) is failed and its parameters enqueued at once; returns those
    trials, for this worker to take over."""
    from optuna.trial import TrialState

    t, recovered = time.time(), []
    while study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) and time.time() - t < timeout_s:
        recovered += recover_stale_trials(study, study._storage)
        if recovered or not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            break
        time.sleep(poll_s)
    return recovered



# Settings the search reads that were added to its fingerprint after studies were recorded, with their
# defaults: in it only away from their defaults, so a recorded study keeps its fingerprint while a
# change redoes it (measure.targets: which engines measure and what is ranked; paired.instance_sd: every
# trial's interval; sampler, seed, enqueue_solution, seed_shapes: which shapes the study proposes and
# seeds). ``archsearch migrate`` fills them in from a study's own config.json (what it ran with), so a
# study recorded before a key was added keeps its stages.
LATER_SEARCH_SETTINGS: tuple[tuple[str, Any], ...] = (
    ("law.allow_extrapolation", False), ("optuna.target_objective", "worst"), ("optuna.seed_shapes", []),
    ("measure.targets", None), ("measure.paired.instance_sd", 0.0), ("optuna.sampler", "tpe"),
    ("optuna.seed", 0), ("optuna.enqueue_solution", 3))

def _search_settings(cfg: StudyConfig, measure_key: dict[str, Any]) -> dict[str, Any]:
    written = to_dict(cfg)
    s = pick(written, "name", "params", "tokens", "n_layers", "baseline", "target", "search_space",
             "vocab_size", "tie_embeddings", "limits")
    s.update({"optuna.objective": cfg.optuna.objective, "optuna.measure_infeasible": cfg.optuna.measure_infeasible,
              "measure.reference_batch_size": cfg.measure.ref_batch, "measure.params": cfg.measure.params})
    s.update({f"measure.{k}": v for k, v in measure_key.items()})
    for name, default in LATER_SEARCH_SETTINGS:
        value = written
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value != default:
            s[name] = value
    if cfg.law.file:
        s.update(named_file("law.file", cfg.law.file))
    return s


def _search_plan(p: PlanInputs) -> dict[str, Any]:
    cfg = p.cfg
    return {"stage": "search", "action": f"Optuna {cfg.optuna.sampler} study, "
            f"{cfg.optuna.n_shapes} distinct shapes measured, at most {cfg.optuna.n_trials} trials "
            f"(objective {cfg.optuna.objective})",
            "backend": cfg.measure.bench.backend, "engine_here": p.backend or "missing",
            **({"engine_note": p.engine_note} if p.engine_note else {}),
            "batch_sizes": cfg.measure.bench.batch_sizes,
            "input_len": cfg.measure.bench.input_len, "output_len": cfg.measure.bench.output_len,
            **({"online": f"{cfg.measure.n_requests or cfg.measure.serving_load().n_requests} requests at "
                          f"{cfg.measure.rate:g}/s per shape and round, {cfg.measure.objective}"
                          + (f" under TTFT <= {cfg.measure.slo.ttft_s:g} s, TPOT <= {cfg.measure.slo.tpot_s:g} s"
                             if cfg.measure.slo else "")} if cfg.measure.online else {}),
            "measurements_at_most": p.measurements["shapes_high"]}


# -- gqa: the local GQA search ------------------------------------------------------------------

def best_key(best: dict[str, Any] | None) -> str | None:
    """The measurement key of the search's best shape (what ``gqa.json`` records it searched around)."""
    return spec_key(ArchSpec.from_dict(best["spec"])) if best and best.get("spec") else None


def _gqa(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """The local GQA search around the best shape (``gqa.json``; its variants' proxy runs, where the
    study trains proxies, in ``gqa/proxies/``), then the answer: the GQA pick when it measured
    faster, kept only if significantly faster than the baseline."""
    info = None
    if fresh and r.best is not None:
        log(f"local GQA search around trial {r.best['trial']}")
        g = local_gqa_search(ArchSpec.from_dict(r.best["spec"]), r.ctx, r.cfg.gqa_search.baseline_gqa,
                             progress=r.progress)
        write_json(r.out / "gqa.json", {**g.to_dict(), "around": {"trial": r.best["trial"],
                                                                  "spec_key": best_key(r.best)}}, default=str)
        info = {}
    r.gqa = read_result(r.out / "gqa.json")  # this run's, or an earlier run's when resuming
    _decide(r)
    return info


def _gqa_redo(cfg: StudyConfig, out: Path, state: dict[str, Any]) -> bool:
    """Redo a torn ``gqa.json``, or, before training starts, one with a failed measurement that
    may be taken again: run again, it reads every other measurement back and retries those
    (Measurer)."""
    if read_result(out / "gqa.json") is None:
        return True
    if "train" in state or not _gqa_retries(cfg, out):
        return False
    log("the GQA search has failed measurements with attempts left (measure.max_attempts): it is run again")
    return True


def _gqa_retries(cfg: StudyConfig, out: Path) -> bool:
    g = read_result(out / "gqa.json") or {}
    keys = [st.get("measurement_key") for st in g.get("steps") or [] if "measurement failed" in (st.get("note") or "")]
    if not any(keys):
        return False
    stored = MeasurementStore(out / "measurements.jsonl").all()
    return any(k in stored and stored[k].get("ok") is False and int(stored[k].get("attempts", 1)) < cfg.measure.max_attempts
               for k in keys)


def _gqa_outdated(r: StudyRun) -> str | None:
    """A resumed search (more trials, a retried measurement) may find another best shape: the GQA
    search around the old one is then redone, with the stages after it."""
    g = read_result(r.out / "gqa.json") if r.state.done("gqa") else None
    around = ((g or {}).get("around") or {}).get("spec_key")
    if around is None or around == best_key(r.best):
        return None
    return f"the search's best shape is now trial {r.best['trial'] if r.best else None}"


def _gqa_plan(p: PlanInputs) -> dict[str, Any] | None:
    cfg, gqa_n = p.cfg, p.gqa
    if not cfg.gqa_search.enabled:
        return None
    lc = gqa_n.get("loss_check") or {}
    b = gqa_n.get("bounds") or {}
    check = ("GQA's effect on loss unverified (no proxies to train): the walk stays within "
             + ", ".join(x for x in (f"GQA <= {b.get('max_gqa')}" if b.get("max_gqa") is not None else "",
                                     f"KV heads >= {b.get('min_kv_heads')}" if b.get("min_kv_heads") is not None
                                     else "") if x) + f" ({b.get('from')})" if lc.get("unverified") else
             f"each variant's loss checked at proxy scale: {lc.get('runs_low', 0)}-{lc.get('runs_high', 0)} "
             f"proxy runs of GQA variants ({len(lc.get('sizes', []))} sizes of sweep {lc.get('sweep')} x "
             f"{len(lc.get('seeds', []))} seed(s) per variant walked to)")
    return {"stage": "gqa", "action": f"local GQA search from GQA={cfg.gqa_search.baseline_gqa}; {check}",
            "gqa_values": gqa_n["variants"], "comparisons_at_most": len(gqa_n["high"]),
            **({"gqa_proxy_runs_low": lc["runs_low"], "gqa_proxy_runs_high": lc["runs_high"],
                "gqa_proxy_train_flops": lc["flops_high"]} if not lc.get("unverified") and lc else {})}


# -- train, eval: the chosen shape trained and evaluated ----------------------------------------

def _train(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """Train the answer (predict-rank-select: the top k, and release one)."""
    if not fresh or r.answer is None:
        r.prs = read_result(r.out / "predict_rank_select.json")  # an earlier run's, when resuming
        if r.prs is not None:
            _decide(r)
        return None
    r.prs = train_final(r.cfg, r.out, r.ctx, r.study, r.answer)
    if r.prs is not None:  # predict-rank-select released one of the trained candidates
        _decide(r)
    return {}


def _decide(r: StudyRun) -> None:
    """The answer from what the stages so far found, and its ``chosen/`` folder."""
    r.answer = decide(r.best, r.gqa, r.prs, r.ctx)
    if r.answer is not None:
        write_chosen(r.ctx, r.out, r.answer)


def _train_plan(p: PlanInputs) -> dict[str, Any] | None:
    cfg = p.cfg
    if not (cfg.final_train.enabled or _prs(cfg)):
        return None
    k = cfg.top_k if cfg.mode == "predict-rank-select" else 1
    return {"stage": "train", "action": f"train {k} chosen shape(s) on {p.final_tokens:.3g} tokens",
            "train_flops": k * p.final_flops}


def _eval(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    if not fresh:
        return None
    evaluate_final(r.cfg, r.out, r.prs)
    return {}


# -- verify: the answer trained beside the baseline ---------------------------------------------

def _verify(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """The answer trained, evaluated and measured beside the baseline (archsearch.search.verify)."""
    if fresh and r.answer is not None:
        r.verify = verify_answer(r.ctx, r.out, r.answer, pareto_set(r.study) if r.study is not None else [],
                                 progress=r.progress)
        return {"verdict": r.verify["verdict"]["loss"], "speed": r.verify["verdict"]["speed"]}
    r.verify = read_result(r.out / VERIFY_FILE) if r.cfg.verify.enabled else None  # an earlier run's
    return None


# -- report ------------------------------------------------------------------------------------

def _report(r: StudyRun, fresh: bool) -> dict[str, Any] | None:
    """``report.md``, ``summary.json``, ``trials.csv`` and the plots, rewritten on every run."""
    if not fresh:
        return None
    log("writing the report, trials.csv and plots")
    r.summary = write_report(r.ctx, r.study, r.answer, r.ctx.baseline, r.state, gqa=r.gqa, prs=r.prs,
                             verify=r.verify)
    return {}


def _prs(cfg: StudyConfig) -> bool:
    return cfg.mode == "predict-rank-select"


# the study's stages, in the order they run; the fingerprinted ones (``settings``) chain in this order
STAGES: tuple[Stage, ...] = (
    Stage("proxy", _proxy, _proxy_plan, settings=_proxy_settings, outputs=("proxies",),
          applies=lambda cfg: cfg.proxy is not None and not cfg.proxy.runs,
          # the active plan's workers train at once; it takes the lock only to write its table
          locked=lambda cfg: cfg.proxy is None or cfg.proxy.plan != "active",
          result=lambda cfg, out: runs_path(cfg, out) if cfg.proxy is not None else None,
          product="the proxies' runs", given_by="proxy.runs"),
    Stage("fit", _fit, _fit_plan, settings=_fit_settings, outputs=("law.json",), needs=("proxy",),
          applies=lambda cfg: not cfg.law.file, redo=_torn("law.json"),
          result=lambda cfg, out: None if cfg.law.file else out / "law.json", product="the law",
          given_by="law.file"),
    # search = the method's solve step, then the measured search: the law's constrained problem
    # (max I(P) s.t. L(P) <= L_t) solved on the box (archsearch.search.solution.solve_law) seeds the
    # Optuna study (archsearch.search.study.seed_study), which measures. The study is shared through
    # its storage by every worker, outside the lock; the default storage lives in the folder;
    # chosen/ is the search's answer
    Stage("search", _search, _search_plan, settings=_search_settings, outputs=("optuna.db", "chosen"),
          needs=("fit",), locked=lambda cfg: False, resumes_itself=True),
    Stage("gqa", _gqa, _gqa_plan, settings=lambda cfg, mk: pick(to_dict(cfg), "gqa_search"), outputs=("gqa.json",),
          needs=("fit",), applies=lambda cfg: cfg.gqa_search.enabled, redo=_gqa_redo, outdated=_gqa_outdated),
    Stage("train", _train, _train_plan, outputs=("final", "predict_rank_select.json"), needs=("fit",),
          settings=lambda cfg, mk: pick(to_dict(cfg), "mode", "top_k", "release_accuracy_tolerance",
                                        "final_train", "evaluation"),
          applies=lambda cfg: cfg.final_train.enabled or _prs(cfg),
          redo=lambda cfg, out, state: _prs(cfg) and _torn("predict_rank_select.json")(cfg, out, state)),
    Stage("eval", _eval, lambda p: {"stage": "eval", "action": f"lm-eval tasks {p.cfg.evaluation.tasks}"}
          if p.cfg.evaluation.enabled else None,
          settings=lambda cfg, mk: pick(to_dict(cfg), "evaluation"), outputs=("eval.json",), needs=("fit",),
          applies=lambda cfg: cfg.evaluation.enabled),
    Stage("verify", _verify, lambda p: verify_plan(p.cfg, p.final_flops, p.final_tokens) if p.cfg.verify.enabled
          else None, settings=lambda cfg, mk: pick(to_dict(cfg), "verify", "final_train", "evaluation", "target"),
          outputs=("verify", VERIFY_FILE), needs=("fit",), applies=lambda cfg: cfg.verify.enabled,
          redo=_torn(VERIFY_FILE)),
    Stage("report", _report, lambda p: {"stage": "report", "action": "summary.json, report.md, trials.csv, plots"},
          needs=("fit",), resumes_itself=True),
)
STAGE_NAMES = tuple(st.name for st in STAGES)


def table() -> tuple[Stage, ...]:
    """The stages as they stand (read at each call, so a test's added stage is seen everywhere)."""
    return STAGES


def fingerprinted() -> tuple[Stage, ...]:
    """The stages whose settings are fingerprinted, in order (the report is rewritten on every run)."""
    return tuple(st for st in STAGES if st.settings is not None)


def stage_applies(cfg: StudyConfig) -> dict[str, bool]:
    """{stage: whether it applies to ``cfg``}."""
    return {st.name: st.applies(cfg) for st in STAGES}

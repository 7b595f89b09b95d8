"""Fake engines for testing the code paths that need a GPU or a failure (no real engine).

``FakeVLLM`` and ``FakeSGLang`` stand in for the ``vllm`` and ``sglang`` modules: they record
the keywords the backend gave them and answer ``generate`` with outputs shaped like the real
ones (timestamps included). The ``Hang`` and ``Crash`` backends run in the isolated
child to check that a timeout and a crash become failed measurements. Nothing here is used
outside tests.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

from archsearch.benchmarks.base import Backend, Report, Session
from archsearch.benchmarks.engine_loop import RequestTiming, run_batches


class FakeVLLM:
    """A ``vllm`` module stand-in: ``LLM``, ``SamplingParams``, ``TokensPrompt``."""

    def __init__(self, step_s: float = 0.001, fail_batch: int | None = None, metrics: bool = True,
                 short_by: int = 0):
        self.step_s, self.fail_batch, self.metrics, self.short_by = step_s, fail_batch, metrics, short_by
        self.llm_kwargs: dict[str, Any] | None = None
        self.calls: list[list[list[int]]] = []
        fake = self

        class LLM:
            def __init__(self, **kw):
                fake.llm_kwargs = kw

            def generate(self, prompts, sp, use_tqdm=False):
                ids = [p["prompt_token_ids"] for p in prompts]
                fake.calls.append(ids)
                if fake.fail_batch is not None and len(ids) == fake.fail_batch:
                    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
                n = sp.max_tokens - fake.short_by
                t0 = time.monotonic()
                time.sleep(fake.step_s * n)
                outs = []
                for _ in ids:
                    m = (SimpleNamespace(first_token_latency=fake.step_s, first_token_ts=t0 + fake.step_s,
                                         last_token_ts=t0 + fake.step_s * n, num_preemptions=0)
                         if fake.metrics else None)
                    outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)))],
                                                metrics=m))
                return outs

        def SamplingParams(**kw):
            return SimpleNamespace(**kw)

        def TokensPrompt(prompt_token_ids):
            return {"prompt_token_ids": prompt_token_ids}

        self.LLM, self.SamplingParams, self.TokensPrompt = LLM, SamplingParams, TokensPrompt


class FakeSGLang:
    """An ``sglang`` module stand-in: ``Engine(**kw)`` with ``generate`` and ``shutdown``."""

    def __init__(self, step_s: float = 0.001):
        self.step_s = step_s
        self.engine_kwargs: dict[str, Any] | None = None
        self.calls: list[tuple[list[list[int]], dict]] = []
        self.shut_down = False
        fake = self

        class Engine:
            def __init__(self, **kw):
                fake.engine_kwargs = kw

            def generate(self, input_ids, sampling_params):
                fake.calls.append((input_ids, dict(sampling_params)))
                n = sampling_params["max_new_tokens"]
                time.sleep(fake.step_s * n)
                return [{"output_ids": list(range(n)),
                         "meta_info": {"completion_tokens": n, "e2e_latency": fake.step_s * n}}
                        for _ in input_ids]

            def shutdown(self):
                fake.shut_down = True

        self.Engine = Engine


class HangBackend(Backend):
    """Measures the first batch size, then hangs: a timeout must keep the first result."""

    name = "fake-hang"

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        s = job["settings"]

        def generate(prompts):
            if len(prompts) != job["batch_sizes"][0]:
                time.sleep(3600)
            return [RequestTiming(n_output=s["output_len"], ttft=0.001, e2e=0.002, tpot=0.0001)
                    for _ in prompts]

        report({"device": "fake", "dtype": "float32"})
        per_batch = run_batches(generate, job["batch_sizes"], s, 100, report=report)
        return {"device": "fake", "dtype": "float32", "engine": {}, "timing": {}, "per_batch": per_batch}


class CrashBackend(Backend):
    """Dies the way a segfaulting engine does: no result, no exception, a bad exit status."""

    name = "fake-crash"

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        print("fake engine: about to crash", flush=True)
        os.abort()


class SleepBackend(Backend):
    """An engine whose batch takes ``hidden_size * 2e-5`` s per output token, times a drifting
    load factor shared by every engine of the process (as a busy machine's load is): paired
    measurement must see the 2x difference of hidden 128 vs 64 through the drift."""

    name = "fake-sleep"
    _calls = 0

    def open(self, job: dict[str, Any], report: Report) -> Session:
        s, d = job["settings"], job["arch"]["hidden_size"]

        def generate(prompts):
            SleepBackend._calls += 1
            load = 1.0 + 0.5 * (SleepBackend._calls % 7) / 6  # drifts between 1x and 1.5x
            time.sleep(d * 2e-5 * s["output_len"] * load)
            return [RequestTiming(n_output=s["output_len"], ttft=None, e2e=None, tpot=None) for _ in prompts]

        return Session(generate, 100, None, "fake", "float32", {}, {})

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        sess = self.open(job, report)
        per_batch = run_batches(sess.generate, job["batch_sizes"], job["settings"], 100, report=report)
        return {**sess.summary(), "per_batch": per_batch}


class HangAtBackend(Backend):
    """Hangs in batch size 2 only (an engine stuck on one batch size): the batch sizes after it
    must still be measured, in a fresh engine process."""

    name = "fake-hang-at"

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        s = job["settings"]

        def generate(prompts):
            if len(prompts) == 2:
                time.sleep(3600)
            return [RequestTiming(n_output=s["output_len"], ttft=0.001, e2e=0.002, tpot=0.0001)
                    for _ in prompts]

        per_batch = run_batches(generate, job["batch_sizes"], s, 100, report=report)
        return {"device": "fake", "dtype": "float32", "engine": {}, "timing": {}, "per_batch": per_batch}


class SpawnBackend(Backend):
    """An engine that starts a worker process of its own (as vLLM's EngineCore does), listens on a
    Unix socket file where vLLM puts its ZMQ sockets (a uuid under ``VLLM_RPC_BASE_PATH``, else
    ``$TMPDIR``: vllm.utils.network_utils.get_open_zmq_ipc_path), writes both process ids to
    ``ARCHSEARCH_FAKE_PIDS`` and then measures forever: killing the process that waits for it must
    not leave either behind, nor the socket file outside the scratch that is reaped."""

    name = "fake-spawn"

    def run(self, job: dict[str, Any], report: Report) -> dict[str, Any]:
        import socket
        import subprocess
        import sys
        import tempfile
        import uuid

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()), str(uuid.uuid4())))
        listener.listen(1)
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(os.environ["ARCHSEARCH_FAKE_PIDS"], "w") as fh:
            fh.write(f"{os.getpid()} {worker.pid}\n")
        report({"event": f"batch {job['batch_sizes'][0]}: repeat 1 of 1"})
        time.sleep(3600)
        return {}

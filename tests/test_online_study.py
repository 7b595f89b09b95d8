"""A study measured online (``measure.mode: online``): every comparison serves the baseline and its
candidates at once and runs paired rounds of requests at the study's rate, goodput under its SLO the
objective. End to end on tests/test_online.py's stub OpenAI server (no engine: seconds), whose time per
output token follows the shape's KV heads; bad input refused at load, naming the field."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from archsearch.errors import ArchsearchError
from tests.test_online import STUB
from tests.test_search import load, study_config

# the stub's seconds per output token: 20 ms x (KV heads / heads), so GQA 1 misses a 15 ms TPOT SLO
# and GQA 2 or 4 (10 or 5 ms) meet it
TPOT_PER_KV_SHARE = 0.02
ONLINE = {"mode": "online", "rate": 10.0, "n_requests": 4, "slo": {"ttft_s": 1.0, "tpot_s": 0.015},
          "bench": {"backend": "vllm", "device_spec": None, "dtype": "float32", "batch_sizes": [4],
                    "input_len": 32, "output_len": 6},
          "paired": {"min_rounds": 2, "max_rounds": 2}}


def online_config(tmp_path, **measure):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return study_config(tmp_path, measure={**ONLINE, **measure}, optuna={"n_shapes": 1, "seed": 1,
                                                                           "enqueue_solution": 1},
                        gqa_search={"enabled": False})


@pytest.fixture
def stub_servers(tmp_path, monkeypatch):
    """Every server a study starts is the stub (its speed from the shape's config.json); returns the
    file where the stubs write which port got a request when, and the stub's path."""
    from archsearch.benchmarks import online
    from archsearch.search import measurements as measure_mod

    stub, seen = tmp_path / "stub_server.py", tmp_path / "seen.txt"
    stub.write_text(STUB)

    def stub_argv(engine, model_dir, port, dtype, max_model_len, load, seed, on_gpu, extra=None):
        c = json.loads((Path(model_dir) / "config.json").read_text())
        tpot = TPOT_PER_KV_SHARE * c["num_key_value_heads"] / c["num_attention_heads"]
        return [sys.executable, str(stub), str(port), "0.02", str(tpot), str(seen)]

    monkeypatch.setattr(online, "server_argv", stub_argv)
    monkeypatch.setattr(online, "check_engine", lambda engine: None)  # no vLLM needed: the stub serves
    monkeypatch.setattr(measure_mod, "_ENGINE_MODULE", {})
    return seen, stub


def _processes_running(fragment: str) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if fragment in cmd:
                out.append(int(p))
    return out


def test_online_study_end_to_end_with_stub_servers(tmp_path, stub_servers):
    from archsearch.search import pipeline

    seen, stub = stub_servers
    cfg = load(online_config(tmp_path))
    assert cfg.measure.online and cfg.measure.objective == "goodput"
    out = cfg.out_dir()
    pipeline.run(cfg, out, skip={"report"})  # the report's wording: test_online_report_says_goodput
    assert _processes_running(str(stub)) == [], "a stub server outlived the study"

    recs = [json.loads(x)["result"] for x in (out / "measurements.jsonl").read_text().splitlines()]
    paired = [r for r in recs if "rounds" in r]
    assert paired and all(r["ok"] for r in paired)
    for r in paired:
        # provenance of an online comparison: engine, device, load, rate, SLO, objective, versions
        on = r["online"]
        assert on["rate"] == 10.0 and on["n_requests"] == 4 and on["slo"] == {"ttft_s": 1.0, "tpot_s": 0.015}
        assert on["objective"] == r["settings"]["objective"] == "goodput" and r["predicted"] is False
        assert r["settings"]["backend"] == "vllm" and r["device"] and r["provenance"]["versions"]
        assert len(r["engines"]) == len(r["specs"]) and len(r["timing"]["engine_start_s"]) == len(r["specs"])
        # the shapes took turns, the order reversing every round
        n = len(r["rounds"])
        assert n == 2 and on["order"] == [[0, 1], [1, 0]]
        assert all(m["goodput"] is not None for row in on["rounds"] for m in row)
        # the candidate's ratio follows its TPOT: fewer KV heads meet the SLO the baseline misses
        base, cand = r["specs"]
        share = lambda s: s["n_kv_heads"] / s["n_heads"]  # noqa: E731
        ratio = r["ratios"][1]
        if share(cand) <= 0.5 < share(base):
            assert ratio["ratio"] > 2 and ratio["significantly_faster"]
        elif share(cand) == share(base):
            assert ratio["ratio"] == pytest.approx(1.0, rel=0.5)

    # the servers were really alternated: the stubs saw each round's requests shape by shape, in turn
    ports = [x.split()[0] for x in seen.read_text().splitlines()]
    assert len(ports) % 4 == 0
    runs = [ports[k:k + 4] for k in range(0, len(ports), 4)]  # one shape's 4 requests each, uninterrupted
    assert all(len(set(run)) == 1 for run in runs), runs
    runs = [run[0] for run in runs]
    assert len(runs) == 2 * 2 * len(paired)  # two shapes, two rounds per comparison
    for k in range(0, len(runs), 4):  # a comparison: A B, then B A
        a, b = runs[k:k + 2]
        assert a != b and runs[k:k + 4] == [a, b, b, a]

    # resumed: nothing measured again, no server started
    before = seen.read_text()
    pipeline.run(load(online_config(tmp_path)), out, only={"search"})
    assert seen.read_text() == before


def test_online_settings_key_measurements_and_the_search_stage(tmp_path):
    from archsearch.search.inputs import stage_inputs
    from archsearch.search.measurements import key_settings

    cfg = load(online_config(tmp_path))
    keyed = key_settings(cfg.measure, "vllm")
    assert keyed["online"] == {"rate": 10.0, "n_requests": 4, "slo": {"ttft_s": 1.0, "tpot_s": 0.015},
                               "max_num_seqs": 4} and keyed["objective"] == "goodput"
    def search_inputs(c):  # the search stage's inputs but the law file's path (each config has its own)
        return {k: v for k, v in stage_inputs(c)["search"].items() if not k.startswith("law.")}

    search = search_inputs(cfg)
    assert search["measure.online.rate"] == 10.0 and search["measure.objective"] == "goodput"
    for i, change in enumerate(({"rate": 5.0}, {"n_requests": 8}, {"slo": {"ttft_s": 1.0, "tpot_s": 0.02}})):
        other = search_inputs(load(online_config(tmp_path / str(i), **change)))
        assert other != search, change  # resume redoes the search with another rate, count or SLO
    assert search_inputs(load(online_config(tmp_path / "same"))) == search
    assert search_inputs(load(online_config(tmp_path / "p", port=free_port_now()))) == search  # no result changes
    # offline studies keep their keys: no online setting in them
    (tmp_path / "off").mkdir()
    assert "online" not in key_settings(load(study_config(tmp_path / "off")).measure, "analytic")


def free_port_now() -> int:
    from archsearch.benchmarks.online import free_port

    return free_port()


@pytest.mark.parametrize("measure, field, fragment", [
    ({"slo": {"ttft_s": 0.0, "tpot_s": 0.015}}, "measure.slo.ttft_s", "positive"),
    ({"slo": {"ttft_s": 1.0, "tpot_s": -1}}, "measure.slo.tpot_s", "positive"),
    ({"slo": None}, "measure.slo", "goodput under an SLO"),
    ({"rate": 0}, "measure.rate", "positive rate"),
    ({"rate": None}, "measure.rate", "positive rate"),
    ({"n_requests": 1}, "measure.n_requests", "integer"),
    ({"mode": "streaming"}, "measure.mode", "unknown"),
    ({"bench": {**ONLINE["bench"], "backend": "hf"}}, "measure.bench.backend", "no server"),
    ({"bench": {**ONLINE["bench"], "backend": "analytic"}}, "measure.bench.backend", "no server"),
    ({"fallback_backend": "hf"}, "measure.fallback_backend", "no server"),
    ({"mode": "offline"}, "measure.rate", "online measurement only"),
])
def test_bad_online_settings_refused_at_load(tmp_path, measure, field, fragment):
    with pytest.raises(ArchsearchError, match=fragment) as e:
        load(online_config(tmp_path, **measure))
    assert e.value.field == field, e.value


def test_a_measured_workload_target_names_measure_mode(tmp_path):
    """The other spelling (a target serving a workload preset with a measured engine) names the field
    that measures online."""
    cfg = study_config(tmp_path, measure={"targets": [{"name": "chat", "workload": "chat", "backend": "vllm"}]})
    with pytest.raises(ArchsearchError, match="measure.mode: online") as e:
        load(cfg)
    assert e.value.field == "measure.targets[0].backend"


@pytest.mark.parametrize("measure, field, fragment", [
    ({"rate": 1e9}, "measure.rate", "exceed what the engine can hold"),
    ({"slo": {"ttft_s": 1.0, "tpot_s": 1e-9}}, "measure.slo.tpot_s", "below the least any request can get"),
])
def test_online_study_no_shape_can_meet_is_refused_before_work(tmp_path, measure, field, fragment):
    from archsearch.search import pipeline

    cfg = load(online_config(tmp_path, **measure))
    with pytest.raises(ArchsearchError, match=fragment) as e:
        pipeline.run(cfg, cfg.out_dir())
    assert e.value.field == field
    assert not cfg.out_dir().exists()  # nothing written


def test_online_study_port_in_use_is_refused_before_work(tmp_path):
    from archsearch.search import pipeline

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = load(online_config(tmp_path, port=s.getsockname()[1]))
        with pytest.raises(ArchsearchError, match="in use") as e:
            pipeline.run(cfg, cfg.out_dir())
    assert e.value.field == "measure.port"
    assert not cfg.out_dir().exists()


def test_a_server_that_fails_is_a_failed_comparison_and_leaves_no_server(tmp_path, monkeypatch):
    """The candidate's server dies before answering: the comparison comes back failed with its reason
    (a study records it and measures it again later), and the baseline's server, already up, is ended."""
    from archsearch.benchmarks import online
    from archsearch.benchmarks.base import BenchSettings
    from archsearch.benchmarks.paired import PairedSettings
    from archsearch.benchmarks.simulator import SLO, ServingLoad
    from tests.test_online import TINY

    stub = tmp_path / "stub_server.py"
    stub.write_text(STUB)

    def argv(engine, model_dir, port, *rest, **kw):
        if model_dir.endswith("shape1"):
            return [sys.executable, "-c", "import sys; print('engine says: out of memory'); sys.exit(1)"]
        return [sys.executable, str(stub), str(port), "0.01", "0.01"]

    monkeypatch.setattr(online, "server_argv", argv)
    monkeypatch.setattr(online, "check_engine", lambda engine: None)
    load = ServingLoad(n_requests=2, input_len=16, output_len=4, rate=20.0, max_num_seqs=2, slo=SLO(1.0, 0.1))
    r = online.measure_paired_online([TINY, TINY.replace(n_kv_heads=1)],
                                     BenchSettings(backend="vllm", batch_sizes=[2], input_len=16, output_len=4,
                                                   dtype="float32", timeout_s=30),
                                     PairedSettings(min_rounds=2, max_rounds=2), load)
    assert not r.ok and "exited with status 1" in r.error and "out of memory" in r.error
    assert r.rounds == [] and r.online["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    assert _processes_running(str(stub)) == [], "the baseline's server outlived the failed comparison"


def test_a_round_no_request_meets_is_floored_at_half_a_request():
    from archsearch.benchmarks.online import round_score
    from archsearch.benchmarks.simulator import SLO, ServingLoad, serving_metrics

    load = ServingLoad(n_requests=2, input_len=8, output_len=3, rate=1.0, slo=SLO(ttft_s=0.1, tpot_s=0.1))
    missed = serving_metrics([0.0, 1.0], [0.5, 1.5], [1.5, 2.5], load, predicted=False)  # TTFT 0.5 s each
    assert missed.goodput == 0.0 and round_score("goodput", missed) == (pytest.approx(0.5 / 2.5), True)
    met = serving_metrics([0.0, 1.0], [0.05, 1.05], [0.15, 1.15], load, predicted=False)
    assert round_score("goodput", met) == (pytest.approx(2 / 1.15), False)
    assert round_score("latency", met)[0] == pytest.approx(1 / 0.15)


def test_online_report_says_goodput():
    """The report of an online study (the recorded example, results/examples/demo-cpu-online) names what
    its ratios compare: goodput under the SLO at the rate served, not output tokens/s."""
    from archsearch.search.report import render_markdown

    s = json.loads((Path(__file__).resolve().parents[1] / "results/examples/demo-cpu-online/summary.json").read_text())
    assert s["online"] == {"rate": 1.0, "n_requests": 12, "slo": {"ttft_s": 1.0, "tpot_s": 0.02}, "objective": "goodput"}
    md = render_markdown(s)
    assert "goodput (requests/s with TTFT <= 1 s and TPOT <= 20 ms) relative to the baseline" in md
    assert "## Feasible Pareto set (goodput ratio" in md and "| goodput req/s |" in md
    assert "tokens/s" not in md.split("## Law")[0]
    # the answer line of a study whose candidate won names the server, rate and SLO
    won = {**s, "chosen": {**s["chosen"]["best_candidate"], "is_baseline": False, "trial": 9, "source": "trial 9",
                           "ratio": {"ratio": 1.6, "lo": 1.1, "hi": 2.2, "level": 0.9, "n": 8,
                                     "significantly_faster": True, "significantly_slower": False},
                           "throughput": 1.0, "baseline_throughput_same_rounds": 0.6}}
    line = next(x for x in render_markdown(won).splitlines() if x.startswith("- Measured online"))
    assert "vllm**'s server at 1 requests/s (Poisson, 12 requests per shape and round, max_num_seqs 4)" in line
    assert "1 requests/s meeting the SLO beside the baseline's 0.6" in line


def test_a_run_on_another_server_waits_out_the_last_vllm_servers_busy_second(monkeypatch):
    """Shapes taking turns: a run on a server other than the last one's starts once the last one's engine has
    stopped busy-polling (vLLM's ``busy_loop_s``, ``online.SERVER_SETTLE_S``); the same server again, or a last
    server that is not vLLM's, starts at once."""
    from archsearch.benchmarks import online

    slept, clock = [], [100.0]
    monkeypatch.setattr(online, "run_load", lambda url, *a, **k: url)
    monkeypatch.setattr(online.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(online.time, "sleep", slept.append)

    def server(name, entry):
        return online.Server(f"http://{name}", "m", 1, 0.0, [sys.executable, "-m", entry, "--port", "1"], {})

    settle = online.SERVER_SETTLE_S["vllm.entrypoints.openai.api_server"]
    vllm_a, vllm_b = server("a", "vllm.entrypoints.openai.api_server"), server("b", "vllm.entrypoints.openai.api_server")
    stub = server("s", "stub_server")
    turns = online.Turns([vllm_a, vllm_b, stub])
    assert turns.run(0, None, None) == "http://a" and slept == []  # the first run: nothing to wait for
    clock[0] += 0.25
    assert turns.run(1, None, None) == "http://b"
    assert slept == [pytest.approx(settle - 0.25)]  # a's engine spins on for the rest of its second
    clock[0] += 0.1
    turns.run(1, None, None)
    assert len(slept) == 1  # the same server again: no wait
    clock[0] += settle + 1
    turns.run(2, None, None)
    assert len(slept) == 1  # b settled long ago: no time left to wait
    turns.run(0, None, None)
    assert len(slept) == 1  # after the stub (no engine spinning): no wait at all

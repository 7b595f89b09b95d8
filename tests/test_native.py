"""Fit with the tools users already know: overrides, clean --json output, Optuna's dashboard."""

from __future__ import annotations

import json
import os

import pytest

from archsearch.cli._common import json_stdout, print_json
from archsearch.configio import apply_overrides, from_dict, load_config, number_from_text
from archsearch.errors import ArchsearchError
from archsearch.search.config import StudyConfig, load_study_config


def test_number_suffixes_in_yaml_and_cli():
    assert number_from_text("200K") == 2e5 and number_from_text("1B") == 1e9
    assert number_from_text("1_500") == 1500 and number_from_text("3e5") == 3e5
    with pytest.raises(ValueError):
        number_from_text("12Q")


def test_overrides_merge_then_validate(tmp_path):
    data = {"a": {"b": 1, "c": [1, 2]}, "d": "x"}
    assert apply_overrides(data, ["a.b=3", "a.c=[4]", "e.f=200K"]) == \
        {"a": {"b": 3, "c": [4]}, "d": "x", "e": {"f": "200K"}}
    assert apply_overrides(data, []) is data
    with pytest.raises(ArchsearchError, match="is not an override"):
        apply_overrides(data, ["a.b"])
    cfg = load_study_config("configs/demo-cpu.yaml", ["optuna.n_trials=9", "params=150K",
                                                       "search_space.gqa=[1,2]"])
    assert cfg.optuna.n_trials == 9 and cfg.params == 150_000 and cfg.search_space.gqa == [1, 2]
    with pytest.raises(ArchsearchError, match="optuna.n_trial: unknown key.*n_trials"):
        load_study_config("configs/demo-cpu.yaml", ["optuna.n_trial=9"])
    law = tmp_path / "law.json"
    law.write_text('{"law": "conditional-multiplicative", "coefficients": {"a0": 1, "a1": 0.1, "a2": 0.01, '
                   '"b0": 1, "b1": 0.01, "b2": 0.01}}')
    (tmp_path / "s.yaml").write_text("name: s\nparams: 1B\ntokens: 20B\nn_layers: 16\n"
                                     f"baseline: {{preset: llama-3.2-1b}}\nlaw: {{file: {law}}}\n")
    cfg = load_config(StudyConfig, tmp_path / "s.yaml")
    assert cfg.params == 1_000_000_000 and cfg.tokens == 2e10
    with pytest.raises(ArchsearchError, match="params"):
        from_dict(StudyConfig, {"name": "s", "params": "1Q", "tokens": 1, "n_layers": 1,
                                "baseline": {"preset": "llama-3.2-1b"}, "law": {"file": str(law)}})


def test_json_stdout_carries_one_document(capfd):
    with json_stdout(True):
        print("library chatter")
        os.write(1, b"a child process writing to descriptor 1\n")
        print_json({"ok": 1})
    out, err = capfd.readouterr()
    assert json.loads(out) == {"ok": 1}
    assert "library chatter" in err and "descriptor 1" in err
    print("back to normal")
    assert capfd.readouterr().out == "back to normal\n"


@pytest.mark.rendered_figures
def test_figures_saved_as_png_and_pdf_with_plain_log_ticks(tmp_path):
    from archsearch.figures import count, log_axis, save, styled

    assert [count(v) for v in (2e5, 1.5e9, 64, 3e6)] == ["200K", "1.5B", "64", "3M"]

    @styled
    def draw():
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots()
        ax.plot([0.07, 0.35], [1, 2])
        log_axis(ax, "x")
        fig.canvas.draw()
        labels = [t.get_text() for t in ax.get_xticklabels() if 0.07 <= t.get_position()[0] <= 0.35]
        return save(fig, tmp_path / "f.png"), labels

    png, labels = draw()
    assert labels == ["0.1", "0.2", "0.3"]
    assert png.read_bytes()[:4] == b"\x89PNG" and png.with_suffix(".pdf").read_bytes()[:4] == b"%PDF"


def test_solve_messages_never_contradict_the_result(tmp_path):
    from archsearch.candidates import BuildSettings
    from archsearch.laws import load_law, solve

    law = tmp_path / "law.json"
    law.write_text(json.dumps({"law": "conditional-multiplicative", "coefficients": {
        "a0": 1.0651, "a1": 0.05, "a2": 0.005, "b0": 0.9153, "b1": 0.05, "b2": 0.1},
        "reference": {"law": "chinchilla", "coefficients": {"E": 1.8, "A": 400.0, "alpha": 0.34,
                                                             "B": 400.0, "beta": 0.28}}}))
    fit = load_law(law)
    # nothing builds at this budget with heads of 64: no architecture, and the notes say so
    res = solve(fit, 2e4, 3e5, 2, None, head_dim=64)
    assert res.architecture is None
    assert not any("architecture is the" in n for n in res.notes)
    assert any(n.startswith("no architecture: none of the") for n in res.notes), res.notes
    # with heads of 32 and finer multiples it builds, and the note names where it came from
    res = solve(fit, 2e5, 3e5, 2, None, head_dim=32,
                build=BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.15))
    assert res.architecture is not None and res.architecture.predicted_loss > 0


def test_optuna_n_trials_counts_trials_as_in_optuna_and_n_shapes_counts_shapes():
    """optuna.n_trials is Optuna's trial budget; the distinct shapes are optuna.n_shapes; an
    earlier version's max_trials is refused with what to write instead."""
    from archsearch.search.config import OptunaConfig, renamed_optuna_keys

    assert (OptunaConfig().n_shapes, OptunaConfig().n_trials) == (12, 120)
    assert (OptunaConfig(n_trials=12).n_shapes, OptunaConfig(n_trials=12).n_trials) == (12, 12)
    assert (OptunaConfig(n_shapes=4).n_shapes, OptunaConfig(n_shapes=4).n_trials) == (4, 40)
    with pytest.raises(ArchsearchError, match="optuna.n_shapes.*cannot be measured in optuna.n_trials=3"):
        OptunaConfig(n_shapes=5, n_trials=3)
    with pytest.raises(ArchsearchError, match="optuna.max_trials.*earlier version.*optuna.n_trials.*n_shapes"):
        load_study_config("configs/demo-cpu.yaml", ["optuna.max_trials=50"])
    # the demo keeps its four distinct shapes
    assert load_study_config("configs/demo-cpu.yaml").optuna.n_shapes == 4
    # a study folder's config.json of an earlier version: its n_trials were shapes, max_trials trials
    old = {"optuna": {"n_trials": 4, "max_trials": None, "seed": 0}}
    new, said = renamed_optuna_keys(old)
    assert new["optuna"] == {"n_shapes": 4, "n_trials": None, "seed": 0} and len(said) == 1
    assert renamed_optuna_keys(new) == (new, [])  # this version's config: nothing to say


def test_a_search_says_why_it_stopped_and_labels_predictions(tmp_path, capsys):
    """An analytic study (predictions, no noise): the search's last line says why it stopped, the
    report and the progress lines give the predicted ratio no interval and no significance, and
    each tokens/s beside the chosen ratio comes from the chosen trial's own rounds."""
    import sys
    from pathlib import Path

    from archsearch.search import pipeline

    sys.path.insert(0, str(Path(__file__).parent))
    from test_search import load, study_config

    cfg = load(study_config(tmp_path, optuna={"n_shapes": 3, "n_trials": 3, "seed": 1, "enqueue_solution": 2},
                            gqa_search={"enabled": False}))
    s = pipeline.run(cfg, cfg.out_dir())
    err = capsys.readouterr().err
    assert "search stopped" in err and "optuna.n_shapes=3" in err and "3 Optuna trials" in err or \
        "search stopped early: optuna.n_trials=3 trials spent" in err
    report = (cfg.out_dir() / "report.md").read_text()
    assert "significantly" not in report.split("## Baseline")[0]
    assert "interval [" not in report.split("## Baseline")[0]
    assert "a formula's figure: no noise, so no interval" in report
    ch = s["chosen"]
    if not ch["is_baseline"]:
        assert ch["ratio"]["predicted"] and ch["baseline_throughput_same_rounds"] is not None
        assert f"beside the baseline's {ch['baseline_throughput_same_rounds']:.1f} in the same paired rounds" in report
    assert "x1 by definition" in err or "predicted (no interval)" in err
    assert "plots/optuna_history.png" in s["plots"]  # Optuna's own figure, beside the project's


def test_the_dry_run_ends_with_the_whole_cost():
    """The dry run's bottom line sums its stages' own figures (low and high), prices them at the
    final training's dollars per GPU-hour, and adds the final training where it is no stage."""
    from archsearch.search.dryrun import bottom_line, render_bottom_line

    p = {"compute": {"gpus": "8xH100", "final_train": {"gpu_hours": 100.0, "hours": 12.0, "cost_usd": 250.0}},
         "stages": [{"stage": "proxy", "gpu_hours": 1000.0, "wall_hours": 240.0},
                    {"stage": "fit"},
                    {"stage": "search", "gpu_hours": 8.0, "gpu_hours_low": 4.0, "wall_hours": 1.0, "wall_hours_low": 0.5},
                    {"stage": "gqa", "gpu_hours": 2.0, "gpu_hours_low": 1.0, "wall_hours": 2.0, "wall_hours_low": 1.0,
                     "proxy_gpu_hours": 600.0, "proxy_gpu_hours_low": 200.0, "proxy_wall_hours": 500.0,
                     "proxy_wall_hours_low": 150.0}]}
    t = bottom_line(p)
    assert t["gpu_hours"] == {"low": 1205.0, "high": 1610.0}
    assert t["cost_usd"] == pytest.approx({"low": 1205.0 * 2.5, "high": 1610.0 * 2.5})
    assert t["days"] == pytest.approx({"low": 391.5 / 24, "high": 743.0 / 24})
    assert t["with_final_training"]["gpu_hours"] == {"low": 1305.0, "high": 1710.0}
    line = render_bottom_line(t)
    assert line.startswith("total on 8xH100: 1,205-1,610 GPU-h, $3,012-4,025, 16.3-31.0 days")
    assert "with the final training of the chosen shape: 1,305-1,710 GPU-h" in line
    assert bottom_line({"compute": {}, "stages": []}) is None
    assert "give --gpus" in render_bottom_line(None)


def test_validate_ends_with_a_verdict():
    from archsearch.laws.diagnostics import validation_verdict

    rows = [{"protocol": "progressive", "test_size": 2e5, "mare": 0.004, "error": None},
            {"protocol": "leave-one-size-out", "test_size": 1e5, "mare": 0.008, "error": None},
            {"protocol": "previous-size", "test_size": 5e4, "mare": None, "error": "too few runs"}]
    v = validation_verdict(rows)
    assert v["verdict"] == "holds" and v["worst"] == 0.008 and v["fitted"] == 2
    assert v["line"].startswith("verdict: the law holds") and "1 row(s) could not be fitted" in v["line"]
    v = validation_verdict(rows, max_mare=0.005)
    assert v["verdict"] == "fails" and "does NOT hold" in v["line"] and "leave-one-size-out" in v["line"]
    assert validation_verdict(rows[2:])["verdict"] == "inconclusive"


def test_cards_go_through_modelcard_and_say_where_each_number_came_from(tmp_path):
    """A card's metadata is huggingface_hub's (license, datasets, pipeline tag, results block
    with the eval loss and lm-eval's scores); a prediction says which roofline and calibration
    made it, a measurement at which N it was taken."""
    import sys
    from pathlib import Path

    from huggingface_hub import ModelCard

    from archsearch.modelcard import run_card, write_study_cards

    sys.path.insert(0, str(Path(__file__).parent))
    from test_everyday import ARCH, _study_folder

    summary = _study_folder(tmp_path)
    run = {"run_id": "r1", "status": "ok", "spec": ARCH, "tokens": 2e4, "final_eval_loss": 6.9,
           "data_config": {"source": "hf:HuggingFaceFW/fineweb-edu:sample-10BT", "tokenizer": "bpe:2048"}}
    ev = {"results": {"arc_easy": {"acc,none": 0.41, "acc_stderr,none": 0.01, "alias": "arc_easy"}}}
    card = ModelCard(run_card(run, "m", ev))
    d = card.data.to_dict()
    assert d["license"] == "apache-2.0" and d["pipeline_tag"] == "text-generation"
    assert d["datasets"] == ["HuggingFaceFW/fineweb-edu"]
    metrics = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert metrics == {("HuggingFaceFW/fineweb-edu", "loss"): 6.9, ("arc_easy", "acc"): 0.41}
    # measured at measure.params: the card says the shape was rebuilt there
    s = {**summary, "measured_params": 1e6}
    write_study_cards(tmp_path, s)
    text = (tmp_path / "chosen/README.md").read_text()
    assert "measured the shape rebuilt at N = 1,000,000 non-embedding parameters (measure.params" in text
    assert "device: NVIDIA H100 80GB HBM3" in text
    # a prediction: the device predicted for and the calibration, no interval and no verdict
    s = {**summary, "backend": "analytic", "calibration": "calibrated by h200-vllm.json (H200, vllm)",
         "config": {**summary["config"], "measure": {"bench": {"device_spec": "H200"}}},
         "chosen": {**summary["chosen"], "ratio": {**summary["chosen"]["ratio"], "predicted": True}}}
    write_study_cards(tmp_path, s)
    text = (tmp_path / "chosen/README.md").read_text()
    assert "**predicted, not measured**: the analytic roofline of H200, calibrated by h200-vllm.json" in text
    assert "predicted (no interval)" in text and "significantly" not in text and "interval [1.150" not in text
    assert "NVIDIA H100 80GB" not in text.split("## Provenance")[0]


def _tiny_model(folder):
    """A one-layer Llama with a byte-level BPE tokenizer trained on one line: an HF folder that
    lm-eval loads from its path in a second."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["To be, or not to be, that is the question."] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                 eos_token_id=fast.eos_token_id)).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def test_eval_writes_lm_eval_s_layout_quietly_and_resumes_from_its_request_cache(tmp_path, cli, monkeypatch):
    """--output_path DIR gets lm-eval's own layout (results and, with --log_samples, samples),
    stdout lm-eval's markdown table, and -q keeps lm-eval's warnings and bars off stderr. The
    request cache under DIR answers a rerun: the model is never asked again."""
    import glob
    import sqlite3

    model = _tiny_model(tmp_path / "tiny")
    out = tmp_path / "ev"
    p = cli("eval", "--model", str(model), "--tasks", "shakespeare_lastword", "--limit", "4", "--batch_size", "2",
            "--output_path", str(out), "--log_samples", "--bootstrap_iters", "0", "-q")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr == "", p.stderr[-2000:]
    assert "|shakespeare_lastword|" in p.stdout and "|perplexity|" in p.stdout.replace(" ", "")
    folder = out / str(model).replace("/", "__")
    results = glob.glob(str(folder / "results_*.json"))
    assert len(results) == 1 and glob.glob(str(folder / "samples_shakespeare_lastword_*.jsonl"))
    res = json.loads(open(results[0]).read())
    assert res["config"]["batch_size"] == 2 and res["archsearch"]["batch_size"] == 2
    cache = glob.glob(str(out / "requests-cache" / "*_rank0.db"))
    assert len(cache) == 1
    with sqlite3.connect(cache[0]) as db:
        assert db.execute("select count(*) from unnamed").fetchone()[0] == 4  # one per document

    # the rerun reads every answer from the cache: the model's loglikelihood is never called
    from lm_eval.models.huggingface import HFLM

    from archsearch.evaluation import evaluate

    def asked(*a, **k):
        raise AssertionError("the rerun asked the model again")

    monkeypatch.setattr(HFLM, "loglikelihood", asked)
    again = evaluate(model, "shakespeare_lastword", limit=4, batch_size=2, output_path=out, bootstrap_iters=0)
    first = res["results"]["shakespeare_lastword"]["perplexity,none"]
    assert again["results"]["shakespeare_lastword"]["perplexity,none"] == pytest.approx(first)
    assert again["archsearch"]["request_cache"] == cache[0].removesuffix("_rank0.db")


@pytest.mark.rendered_figures
def test_a_sweep_draws_its_loss_curves(tmp_path):
    """One line per run from its metrics.jsonl (a torn last line skipped), a panel per size."""
    import csv

    from archsearch.figures import sweep_loss_curves

    assert sweep_loss_curves(tmp_path) == []  # no runs.csv: nothing to draw
    rows = []
    for n, x in ((1e5, 0.12), (1e5, 0.2), (2e5, 0.12)):
        run = tmp_path / "runs" / f"r{int(n)}-{x}"
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"global_batch_size": 4, "seq_len": 8}))
        lines = [json.dumps({"step": s, "smoothed_loss": 7 - s / 10}) for s in range(1, 20)]
        (run / "metrics.jsonl").write_text("\n".join(lines + [json.dumps({"step": 19, "eval_loss": 5.3}), '{"step": 2'])
                                           + "\n")
        rows.append({"run_id": run.name, "requested_params": n, "requested_hidden_over_sqrt_n": x})
    with open(tmp_path / "runs.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    made = sweep_loss_curves(tmp_path)
    assert made == [str(tmp_path / "plots/loss_curves.png"), str(tmp_path / "plots/loss_curves.pdf")]
    assert all(os.path.getsize(p) > 1000 for p in made)


def test_every_interrupt_message_is_true_for_its_command():
    """Ctrl-C: a resuming command says to run it again; eval says whether its request cache kept
    anything; a command that does not resume does not claim to."""
    import argparse

    from archsearch.cli import build_parser, interrupt_note

    parse = build_parser().parse_args
    assert interrupt_note(parse(["search", "--config", "c.yaml"])) == "run the same command again to resume"
    assert "does not resume" in interrupt_note(parse(["estimate", "--arch", "llama-3.2-1b", "--tokens", "1e9",
                                                      "--gpus", "8xH100"]))
    assert "nothing was kept" in interrupt_note(parse(["eval", "--model", "m"]))
    assert "resume" in interrupt_note(parse(["eval", "--model", "m", "--output_path", "o"]))
    assert "does not resume" in interrupt_note(argparse.Namespace())


def test_the_planner_s_progress_goes_to_stderr_not_between_its_tables(tmp_path, capsys):
    import sys
    from pathlib import Path

    from archsearch.planning import planner as pl

    sys.path.insert(0, str(Path(__file__).parent))
    from test_planner import _fake_measure

    pl.measure_grid([pl.resolve_option("tiny")], pl.PlanGrid((1,), (16,), (4,)), {"backend": "hf", "repeats": 1},
                    tmp_path, measure_fn=_fake_measure([]))
    cap = capsys.readouterr()
    assert cap.out == "" and "plan: [1/1] tiny" in cap.err


def test_the_active_plan_s_title_says_whether_the_interval_shrank_or_grew():
    from archsearch.search.report import interval_trend

    def trace(*hws):
        return [{"interval": {"half_width_hidden_over_sqrt_n": a, "half_width_mlp_to_attn_ratio": b}} for a, b in hws]

    assert interval_trend(trace((0.4, 0.3), (0.2, 0.1))) == "shrank"
    assert interval_trend(trace((0.1, 0.1), (0.3, 0.2))) == "grew"
    assert interval_trend(trace((0.4, 0.1), (0.2, 0.3))) == "changed (d/sqrt(N)* shrank, r* grew)"
    assert interval_trend(trace((0.4, 0.1))).startswith("changed (too few")

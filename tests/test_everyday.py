"""Everyday use: --print-config, solve --out, the study log, model cards."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from archsearch.cli import main
from archsearch.configio import from_dict, mask_secrets, redact

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:secret@127.0.0.1:1/db", "postgresql://u:***@127.0.0.1:1/db"),
    ("postgresql+psycopg2://u:pa/ss@h/db", "postgresql+psycopg2://u:***@h/db"),
    ("mysql://root@h/db", "mysql://root@h/db"),  # no password: nothing to hide
    ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ("journal:/tmp/j.log", "journal:/tmp/j.log"),
])
def test_redact_masks_url_passwords(url, shown):
    assert redact(url) == shown


def test_mask_secrets_walks_nested_data():
    data = {"a": [{"storage": "postgresql://u:pw@h/db"}], "n": 3, "s": "plain"}
    assert mask_secrets(data) == {"a": [{"storage": "postgresql://u:***@h/db"}], "n": 3, "s": "plain"}


def _in_empty_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return sorted(tmp_path.rglob("*"))


def test_search_print_config_resolves_overrides_masks_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from archsearch.search.config import StudyConfig, load_study_config

    before = _in_empty_folder(tmp_path, monkeypatch)
    cfg_path = str(REPO / "configs/demo-cpu.yaml")
    rc = main(["search", "--config", cfg_path, "--print-config", "optuna.n_trials=7",
               "optuna.storage=postgresql://u:secret@127.0.0.1:1/db"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "secret" not in out and "u:***@127.0.0.1" in out
    printed = yaml.safe_load(out)
    assert printed["optuna"]["n_trials"] == 7
    assert "gqa_search" in printed and "limits" in printed  # defaults filled in
    # the printed YAML is the same config: it loads back equal (but for the masked password)
    want = load_study_config(cfg_path, ["optuna.n_trials=7", "optuna.storage=postgresql://u:***@127.0.0.1:1/db"])
    assert from_dict(StudyConfig, printed) == want
    assert sorted(tmp_path.rglob("*")) == before


def test_sweep_and_train_print_config(tmp_path, monkeypatch, capsys):
    from archsearch.trainers.config import DataConfig, SweepConfig, TrainConfig

    before = _in_empty_folder(tmp_path, monkeypatch)
    assert main(["sweep", "--config", str(REPO / "configs/sweep-demo.yaml"), "--print-config", "train.seed=3"]) == 0
    sweep = yaml.safe_load(capsys.readouterr().out)
    assert from_dict(SweepConfig, sweep).train.seed == 3
    assert main(["train", "--print-config", "--tokens", "1M", "--lr", "2e-3", "data.seq_len=96"]) == 0
    t = yaml.safe_load(capsys.readouterr().out)
    assert set(t) == {"train", "data"}
    assert from_dict(TrainConfig, t["train"], "train").lr == 2e-3
    assert from_dict(DataConfig, t["data"], "data").seq_len == 96
    assert sorted(tmp_path.rglob("*")) == before


LAW = {"law": "conditional-multiplicative",
       "coefficients": {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04},
       "reference": {"law": "chinchilla",
                     "coefficients": {"E": 1.8, "A": 400, "alpha": 0.34, "B": 410, "beta": 0.28}}}
SOLVE = ["solve", "--params", "2e5", "--tokens", "3e5", "--layers", "2", "--head-dim", "32", "--gqa", "2",
         "--hidden-multiple", "32", "--ffn-multiple", "32", "--tolerance", "0.15", "--vocab-size", "2048"]
SHAPE = ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab_size", "tie_embeddings")


def _law(tmp_path) -> str:
    import json

    (tmp_path / "law.json").write_text(json.dumps(LAW))
    return str(tmp_path / "law.json")


@pytest.mark.parametrize("target", [None, "25"])
def test_solve_out_writes_the_chosen_shape_that_train_arch_reads(tmp_path, capsys, target):
    import json

    from archsearch.arch import ArchSpec
    from archsearch.presets import load_arch

    extra = ["--target-loss", target] if target else []
    assert main([*SOLVE, "--law", _law(tmp_path), *extra, "--json", "--out", str(tmp_path / "solved")]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = printed["best"]["architecture"] if target else printed["architecture"]
    solved = json.loads((tmp_path / "solved/solve.json").read_text())
    assert solved["chosen"]["architecture"] == want and "provenance" in solved
    # `train --arch DIR` reads DIR/config.json; it and spec.json are the shape solve chose
    from_dir = load_arch(tmp_path / "solved")
    spec = ArchSpec.from_dict(json.loads((tmp_path / "solved/spec.json").read_text()))
    assert {k: getattr(from_dir, k) for k in SHAPE} == {k: want[k] for k in SHAPE} \
        == {k: getattr(spec, k) for k in SHAPE}


def test_solve_out_refuses_when_nothing_meets_the_target(tmp_path, capsys):
    rc = main([*SOLVE, "--law", _law(tmp_path), "--target-loss", "0.5", "--out", str(tmp_path / "solved")])
    assert rc == 2 and "--out" in capsys.readouterr().err
    assert not (tmp_path / "solved").exists()


@pytest.fixture
def console_reset():
    from archsearch.logs import configure

    yield
    configure(0)  # main() with -q/-v sets the process's console level: give the next test the default


def test_study_log_keeps_project_lines_and_library_warnings_off_the_console(tmp_path, capsys, console_reset):
    import logging
    import warnings

    from archsearch.logs import configure, get_logger, study_log

    configure(0)
    with study_log(tmp_path) as path:
        get_logger("search").info("[search] trial 0: a progress line")
        logging.getLogger("transformers").addHandler(logging.StreamHandler())  # as transformers adds its own
        lib = logging.getLogger("transformers.modeling_utils")
        from archsearch.logs import tame_libraries

        tame_libraries()
        lib.warning("Some weights were not initialized")
        lib.info("loading weights")  # a library's info: neither shown nor kept
        warnings.warn("a deprecation from a library", UserWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err.strip() == "[search] trial 0: a progress line"  # the project's line, as written, alone
    text = path.read_text()
    assert "INFO archsearch.search: [search] trial 0: a progress line" in text
    assert "WARNING transformers.modeling_utils: Some weights were not initialized" in text
    assert "a deprecation from a library" in text and "loading weights" not in text
    get_logger("search").info("[search] after the study")  # the file is closed with the block
    assert "after the study" not in path.read_text()
    lib.warning("outside a study")  # no study log to keep it: shown, named by its library
    assert "WARNING transformers.modeling_utils: outside a study" in capsys.readouterr().err


def test_search_writes_study_log_and_quiet_keeps_stderr_clean(tmp_path, monkeypatch, capsys, console_reset):
    import json

    study = {"name": "st", "params": 200000, "tokens": 300000, "n_layers": 2, "vocab_size": 2048,
             "baseline": {"hidden_over_sqrt_n": 0.2, "mlp_to_attn": 3.0, "gqa": 2},
             "search_space": {"head_dim": 32, "build": {"hidden_multiple": 32, "ffn_multiple": 32,
                                                        "tolerance": 0.15, "on_r_drift": "flag"}},
             "law": {"file": "law.json"}, "measure": {"bench": {"backend": "analytic"}}}
    monkeypatch.chdir(tmp_path)
    _law(tmp_path)
    (tmp_path / "st.yaml").write_text(json.dumps(study))
    # the search alone (the law is given): its progress lines go to the log, not to a quiet console
    assert main(["search", "--config", "st.yaml", "--out", "s", "--only", "search", "--quiet",
                 "optuna.n_shapes=2"]) == 0
    assert "[search]" not in capsys.readouterr().err
    assert "INFO archsearch.search: [search] target loss" in (tmp_path / "s/study.log").read_text()
    # a config refused before any work writes no folder, so no log either
    assert main(["search", "--config", "st.yaml", "--out", "bad", "tokens=-1"]) == 2
    assert not (tmp_path / "bad").exists()


ARCH = {"n_layers": 2, "hidden_size": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "ffn": 384,
        "vocab_size": 2048, "tie_embeddings": False, "family": "llama"}


def _study_folder(tmp_path):
    import json

    from archsearch.arch import ArchSpec, describe, write_hf_config

    spec = ArchSpec(**ARCH)
    write_hf_config(spec, tmp_path / "chosen")
    prov = {"time_utc": "2026-01-01T00:00:00+00:00", "host": "h", "git": "abc1234",
            "versions": {"archsearch": "0.1.0", "vllm": "0.9.1"}, "device": {"name": "NVIDIA H100"}}
    record = {"key": "k", "result": {"specs": [{**ARCH, "hidden_size": 96, "name": "baseline"}, ARCH],
                                     "batch_size": 16, "device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16",
                                     "settings": {"input_len": 4096, "output_len": 1024}, "provenance": prov}}
    (tmp_path / "measurements.jsonl").write_text(json.dumps(record) + "\n")
    summary = {"study": "st", "backend": "vllm", "reference_batch_size": 16, "target_loss": 3.3,
               "target_source": "baseline predicted loss x (1 + 0.01)",
               "law": {"file": "law.json", "form": "conditional-multiplicative", "status": "ok"},
               "chosen": {"architecture": describe(spec), "throughput": 5000.0, "predicted_loss": 3.21,
                          "predicted_loss_interval": [3.18, 3.25], "is_baseline": False, "source": "Optuna trial 7",
                          "ratio": {"ratio": 1.21, "lo": 1.15, "hi": 1.27, "level": 0.9, "n": 5,
                                    "significantly_faster": True}},
               "provenance": prov,
               "config": {"params": 1e9, "tokens": 2e10, "optuna": {"storage": "postgresql://u:pw@h/db"}}}
    return summary


def test_chosen_model_card_states_shape_law_ratio_engine_provenance(tmp_path):
    import json

    from archsearch.modelcard import config_hash, write_study_cards

    summary = _study_folder(tmp_path)
    # a trained final model of the chosen shape gets the card too, with its training run
    (tmp_path / "final/model").mkdir(parents=True)
    run = {"status": "ok", "spec": ARCH, "tokens_trained": 2e10, "steps": 9536, "global_batch_size": 512,
           "seq_len": 4096, "seed": 0, "final_eval_loss": 3.2, "smoothed_train_loss": 3.22,
           "data_config": {"source": "hf:fineweb", "tokenizer": "smollm2"}, "device": "cuda", "n_devices": 8,
           "dtype": "bfloat16", "wall_time_s": 36000.0, "tokens_per_s": 5.5e5}
    (tmp_path / "final/run.json").write_text(json.dumps(run))
    written = write_study_cards(tmp_path, summary)
    assert [p.relative_to(tmp_path).as_posix() for p in written] == ["chosen/README.md", "final/model/README.md"]
    card = (tmp_path / "chosen/README.md").read_text()
    for fact in ("| KV heads | 2 |", "conditional-multiplicative", "predicted loss 3.21, 90% interval [3.18, 3.25]",
                 "x1.210 the baseline's throughput at batch 16, 90% interval [1.150, 1.270] over 5 paired rounds",
                 "engine: vllm 0.9.1; device: NVIDIA H100 80GB HBM3; dtype bfloat16",
                 f"`{config_hash(summary['config'])}`", "git abc1234", "AutoConfig.from_pretrained",
                 "--tokens 2e+10"):
        assert fact in card, fact
    assert "pw" not in card
    trained = (tmp_path / "final/model/README.md").read_text()
    assert "## Training" in trained and "final held-out eval loss 3.2" in trained
    assert "AutoModelForCausalLM.from_pretrained" in trained
    # the hash is of the config with its password masked: the same whatever the password
    other = {**summary["config"], "optuna": {"storage": "postgresql://u:other@h/db"}}
    assert config_hash(other) == config_hash(summary["config"])


def test_trained_model_card(tmp_path):
    from archsearch.modelcard import write_run_card

    run = {"run_id": "r1", "status": "ok", "spec": ARCH, "tokens": 20000, "steps": 39, "global_batch_size": 8,
           "seq_len": 64, "seed": 0, "final_eval_loss": 6.9, "smoothed_train_loss": 7.07,
           "train_config": {"lr": 1.5e-3}, "data_config": {"source": "shakespeare", "tokenizer": "bpe:2048"},
           "device": "cpu", "n_devices": 1, "dtype": "float32", "wall_time_s": 2.0, "tokens_per_s": 1.5e4,
           "provenance": {"versions": {"archsearch": "0.1.0", "torch": "2.13"}, "git": "abc"}}
    text = write_run_card(tmp_path / "model", run).read_text()
    for fact in ("# r1", "| query heads | 4 |", "final held-out eval loss 6.9", "shakespeare, tokenizer bpe:2048",
                 "torch 2.13", "config hash"):
        assert fact in text, fact

"""The CLI shapes other tools rely on: arch describe/build/list, errors, lazy imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from archsearch.cli import build_parser, main


def test_import_is_light():
    code = ("import sys, archsearch, archsearch.cli; archsearch.cli.build_parser(); "
            "heavy = [m for m in ('torch', 'vllm', 'sglang', 'lm_eval', 'transformers', 'optuna', "
            "'accelerate', 'datasets', 'matplotlib') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "arch" in sub.choices
    for name, p in sub.choices.items():
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        nested = [a for a in p._actions if getattr(a, "choices", None) and a.dest.endswith("_command")]
        for a in nested:
            for child in a.choices:
                with pytest.raises(SystemExit) as e:
                    main([name, child, "--help"])
                assert e.value.code == 0


def test_describe_json(capsys):
    assert main(["arch", "describe", "--preset", "llama-3.2-1b", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_params_non_embedding"] == 973_078_528
    assert d["n_params_total"] == 1_235_814_400
    assert d["gqa"] == 4 and d["kv_cache_bytes_per_token"] == 32768


def test_describe_flags(capsys):
    assert main(["arch", "describe", "--layers", "4", "--hidden-size", "256", "--heads", "4",
                 "--kv-heads", "2", "--head-dim", "64", "--ffn", "704", "--vocab-size", "2048", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_params_non_embedding"] == 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 704)
    assert d["n_params_embedding"] == 2 * 2048 * 256


def test_build_writes_config(tmp_path, capsys):
    assert main(["arch", "build", "--params", "1e9", "--layers", "16", "--hidden-over-sqrt-n", "0.066",
                 "--mlp-to-attn", "4.8", "--gqa", "4", "--head-dim", "64", "--json", "--out", str(tmp_path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert abs(d["n_params_non_embedding"] / 1e9 - 1) < 0.02
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_attention_heads"] == 4 * cfg["num_key_value_heads"]


def test_list(capsys):
    assert main(["arch", "list", "--json"]) == 0
    names = {r["name"] for r in json.loads(capsys.readouterr().out)}
    assert {"llama-3.2-1b", "qwen3-8b", "smollm2-135m", "olmo-2-1b"} <= names


@pytest.mark.parametrize("argv, field", [
    (["arch", "describe", "--layers", "2", "--hidden-size", "64", "--heads", "4", "--kv-heads", "3", "--ffn", "64"], "n_kv_heads"),
    (["arch", "describe", "--layers", "2", "--hidden-size", "64", "--heads", "2", "--head-dim", "24", "--ffn", "64"], "head_dim"),
    (["arch", "describe", "--layers", "0", "--hidden-size", "64", "--heads", "2", "--ffn", "64"], "--layers"),
    (["arch", "describe", "--preset", "gpt-5"], "preset"),
    (["arch", "build", "--params", "1e5", "--layers", "8", "--hidden-over-sqrt-n", "0.5", "--mlp-to-attn", "3"], "params"),
    (["arch", "build", "--params", "1e9", "--layers", "16", "--hidden-over-sqrt-n", "0.06", "--mlp-to-attn", "3", "--gqa", "0"], "gqa"),
])
def test_user_errors_exit_2_one_line(cli, argv, field):
    r = cli(*argv)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_python_dash_m(cli):
    r = cli("--version")
    assert r.returncode == 0 and "archsearch" in r.stdout

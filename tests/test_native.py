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

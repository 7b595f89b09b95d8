"""What a person sees in the figures: legends without empty entries, captions naming only what is
drawn, fit plots with their optimum and R^2, the planner's limits labelled. Each figure is drawn
for real and read back from the matplotlib objects just before it is saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.rendered_figures  # the figures are this file's subject


@pytest.fixture
def drawn(monkeypatch):
    """The figures passed to ``save`` (in each module that imported it), by file name."""
    import archsearch.figures as figures

    out: dict[str, object] = {}
    real = figures.save

    def keep(fig, png, *a, **kw):
        out[Path(png).name] = [(ax.get_legend(), ax.get_xlabel(), ax) for ax in fig.axes]
        return real(fig, png, *a, **kw)

    monkeypatch.setattr(figures, "save", keep)
    import archsearch.laws.plots as plots
    import archsearch.search.report as report
    import archsearch.search.targets as targets

    for module in (plots, report, targets):
        monkeypatch.setattr(module, "save", keep)
    return out


def _legend_texts(legend) -> list[str]:
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def test_legend_leaves_out_entries_that_draw_nothing():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archsearch.figures import legend

    fig, ax = plt.subplots()
    ax.step([1.0], [2.0], where="post", label="one-point front")  # a step line needs two points
    ax.scatter([], [], label="empty group")
    ax.plot([1.0, 2.0], [1.0, 3.0], label="a line")
    ax.errorbar([1.0], [1.0], yerr=[0.1], fmt="o", label="a point")
    ax.axvline(1.5, label="a limit")
    assert _legend_texts(legend(ax)) == ["a line", "a limit", "a point"]
    fig2, ax2 = plt.subplots()
    ax2.step([1.0], [2.0], label="nothing")
    assert legend(ax2) is None
    plt.close("all")


def test_fit_plots_mark_the_optimum_and_give_r2(tmp_path, drawn):
    from archsearch.laws import load_law
    from archsearch.laws.plots import write_plots
    from archsearch.rundata import read_runs

    fit = load_law(REPO / "results/examples/demo-cpu/law.json")
    runs = [r for r in read_runs(REPO / "results/examples/demo-cpu/proxies/runs.csv") if r.status == "ok"]
    write_plots(fit, runs[:8], runs[8:], tmp_path)
    texts = _legend_texts(drawn["predicted_vs_actual.png"][0][0])
    assert any(t.startswith("fit (") and ", R^2 0." in t for t in texts) and any(t.startswith("held out") for t in texts)
    c = fit.coefficients
    for name, x_star in (("loss_vs_hidden_over_sqrt_n.png", c["a2"] / c["a1"]),
                         ("loss_vs_r.png", c["b2"] / c["b1"])):
        texts = _legend_texts(drawn[name][0][0])
        opt = [t for t in texts if t.startswith("optimum ")]
        assert opt and opt[0].endswith(f"= {x_star:.3g}")
        ax = drawn[name][0][2]
        assert ax.get_xlim()[0] < x_star < ax.get_xlim()[1]  # the minimum is on the plot


def test_throughput_caption_names_only_the_colours_drawn(tmp_path, drawn):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archsearch.benchmarks.workloads import objective_words
    from archsearch.search.report import _ratio_chart

    spec = {"hidden_size": 64, "n_heads": 4, "n_kv_heads": 2, "ffn": 256}
    pts = [{"trial": i, "spec": {**spec, "ffn": 256 + 32 * i}, "feasible": True,
            "ratio": {"ratio": r, "lo": r - 0.01, "hi": r + 0.01, "level": 0.9,
                      "significantly_faster": r > 1.02, "significantly_slower": r < 0.98}}
           for i, r in enumerate((1.2, 1.1))]
    _ratio_chart(None, pts, None, tmp_path, plt, objective_words("throughput"))
    caption = drawn["throughput.png"][0][1]
    assert "green: significantly faster" in caption
    assert "red:" not in caption and "grey:" not in caption


def test_planner_limit_lines_are_labelled(tmp_path, drawn):
    from archsearch.planning.limits import Limits
    from archsearch.planning.planner import OptionPlan, GridPoint, plot_tradeoff

    pts = [GridPoint("tiny", b, 64, 64, True, 0.01 * b, 0.002 * b, 0.5 + 0.01 * b, 100.0, b < 8, "")
           for b in (1, 4, 16)]
    plan = OptionPlan("tiny", "preset", 1000, 1000, pts, {}, True, True, pts[0], [])
    plot_tradeoff([plan], tmp_path / "plan.png", Limits(max_tpot_s=0.02, max_peak_memory_gib=4.0))
    (tpot_legend, _, _), (ttft_legend, _, _) = drawn["plan.png"][:2]
    assert "limit: TPOT <= 20 ms" in _legend_texts(tpot_legend)
    assert "limit: peak memory <= 4 GiB" in _legend_texts(ttft_legend)


def test_ucurves_reach_a_shape_outside_the_box_and_read_its_loss(tmp_path, drawn):
    import json
    import types

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from archsearch.arch import describe
    from archsearch.candidates import BuildSettings, build_candidate
    from archsearch.configio import from_dict
    from archsearch.laws import load_law
    from archsearch.search.config import StudyConfig
    from archsearch.search.report import _ucurves

    law = {"law": "conditional-multiplicative",
           "coefficients": {"a0": 1.08, "a1": 0.05, "a2": 0.004, "b0": 0.97, "b1": 0.02, "b2": 0.04},
           "reference": {"law": "chinchilla",
                         "coefficients": {"E": 1.8, "A": 400, "alpha": 0.34, "B": 410, "beta": 0.28}}}
    (tmp_path / "law.json").write_text(json.dumps(law))
    cfg = from_dict(StudyConfig, {"name": "st", "params": 2e5, "tokens": 3e5, "n_layers": 2, "vocab_size": 2048,
                                  "baseline": {"hidden_over_sqrt_n": 0.2, "mlp_to_attn": 3.0, "gqa": 2},
                                  "search_space": {"hidden_over_sqrt_n": [0.1, 0.18], "mlp_to_attn": [0.5, 5.0]},
                                  "law": {"file": str(tmp_path / "law.json")}})
    fit = load_law(tmp_path / "law.json")
    build = BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.15, on_r_drift="flag", vocab_size=2048)
    base = describe(build_candidate(2e5, 2, 0.2, 3.0, gqa=2, head_dim=32, settings=build).spec)
    X = {k: np.array([v]) for k, v in (("N", 2e5), ("D", 3e5), ("x1", base["hidden_over_sqrt_n"]),
                                         ("x2", base["mlp_to_attn_ratio"]), ("R", 1.0))}
    ctx = types.SimpleNamespace(cfg=cfg, law=fit, target_loss=float(fit.predict_arrays(X)[0]))
    _ucurves(ctx, tmp_path, plt, [("baseline", base, "tab:orange")])
    (leg, _, ax), _ = drawn["ucurves.png"][:2]
    texts = [t.get_text() for t in leg.get_texts()]
    assert base["hidden_over_sqrt_n"] > 0.18  # the baseline lies outside the box ...
    assert ax.get_lines()[0].get_xdata().max() > base["hidden_over_sqrt_n"]  # ... and the curve reaches it
    assert "outside the search box" in texts
    assert any(t.startswith("baseline (") and f"its loss {ctx.target_loss:.4g}" in t for t in texts)


def _texts(fig) -> list[str]:
    """Every piece of text a person reads on a figure: titles, axis labels, legend entries."""
    out = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    for ax in fig.axes:
        out += [ax.get_xlabel(), ax.get_ylabel(), *(ax.get_title(loc=loc) for loc in ("left", "center", "right"))]
        out += _legend_texts(ax.get_legend())
    return [t for t in out if t]


def test_an_online_study_is_never_labelled_throughput(tmp_path, monkeypatch):
    """A study whose ratios compare goodput (measure.mode: online, or a chat target) or latency (a
    single-stream target) names that objective on every figure and report column, read from the
    study's own objective (deployment.study_objective): the recorded online example's figures are drawn
    again from its own trials and records and no text on them, nor its report's tables, says throughput."""
    import shutil
    import types

    import matplotlib

    matplotlib.use("Agg")
    import optuna

    import archsearch.figures as figures
    import archsearch.search.report as report
    from archsearch.search.config import load_study_config
    from archsearch.search.deployment import study_objective

    seen: dict[str, list[str]] = {}
    real = figures.save

    def keep(fig, png, *a, **kw):
        seen[Path(png).name] = _texts(fig)
        return real(fig, png, *a, **kw)

    for module in (figures, report):
        monkeypatch.setattr(module, "save", keep)
    monkeypatch.setattr(report, "_ucurves", lambda *a, **kw: [])  # the law's curves: loss only, no objective

    # the objective, from the study's own settings
    cfg = load_study_config(REPO / "configs/demo-cpu-online.yaml")
    words = study_objective(cfg)
    assert (words.objective, words.column) == ("goodput", "goodput req/s")
    assert "TTFT <= 1 s and TPOT <= 20 ms" in words.meaning
    for name, objective in (("paper-1b-workload-chat", "goodput"), ("paper-1b-workload-single-stream", "latency"),
                            ("paper-1b-workload-long-context", "throughput"), ("paper-1b-targets-rehearsal", "throughput")):
        assert study_objective(load_study_config(REPO / "configs" / f"{name}.yaml")).objective == objective, name
    with pytest.raises(Exception, match="unknown"):
        report.objective_words("speed")

    # the recorded online study's figures, drawn again from its trials
    folder = REPO / "results/examples/demo-cpu-online"
    shutil.copy(folder / "optuna.db", tmp_path / "optuna.db")
    study = optuna.load_study(study_name=cfg.name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    summary = json.loads((folder / "summary.json").read_text())
    ctx = types.SimpleNamespace(cfg=cfg, ref_batch=4, target_loss=summary["target_loss"], out=tmp_path)
    base_point = {"predicted_loss": summary["baseline"]["predicted_loss"], "architecture": summary["baseline"]["architecture"]}
    made = report._plots(ctx, study, None, base_point, tmp_path / "plots", words)
    assert "plots/goodput.png" in made and not any("throughput" in p for p in made)
    assert {"pareto.png", "goodput.png", "optuna_history.png"} <= set(seen)
    for name, texts in seen.items():
        assert texts and not [t for t in texts if "throughput" in t.lower() or "tokens/s" in t], (name, texts)
    assert any("goodput" in t for t in seen["pareto.png"]) and any("goodput" in t for t in seen["goodput.png"])

    # the recorded example's own files say so too: its summary names the objective, its plots and tables
    assert summary["objective"]["objective"] == "goodput"
    assert not any("throughput" in p for p in summary["plots"])
    md = report.render_markdown(summary)
    assert "throughput" not in md.split("## Law")[0].lower() and "| goodput req/s |" in md

    # a latency study: its figures and columns say latency (seconds, lower is better), never throughput
    lat = report.objective_words("latency")
    seen.clear()
    pts = [{"trial": i, "spec": {"hidden_size": 64, "n_heads": 4, "n_kv_heads": 2, "ffn": 256 + 32 * i}, "feasible": True,
            "ratio": {"ratio": r, "lo": r, "hi": r, "level": 0.9, "predicted": True,
                      "significantly_faster": False, "significantly_slower": False}} for i, r in enumerate((1.02, 0.97))]
    import matplotlib.pyplot as plt

    report._ratio_chart(None, pts, None, tmp_path, plt, lat)
    (texts,) = seen.values()
    assert "latency.png" in seen and not [t for t in texts if "throughput" in t.lower()]
    assert "latency" in texts[0] and "predicted faster" in texts[0]
    assert lat.shown(0.5) == 2.0 and "lower is better" in lat.column

"""Paired, interleaved measurement (archsearch.benchmarks.paired) and the decisions built on it."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace

import pytest

from archsearch.arch import ArchSpec
from archsearch.configio import from_dict
from archsearch.errors import ArchsearchError
from archsearch.benchmarks import BenchSettings
from archsearch.benchmarks.paired import PairedResult, PairedSettings, measure_paired, ratio_estimate


def test_ratio_estimate_paired_cancels_common_drift():
    # the load doubles halfway; every round's ratio is 0.8, so the estimate is exact
    ref = [100.0, 100.0, 50.0, 50.0]
    other = [80.0, 80.0, 40.0, 40.0]
    q = ratio_estimate(ref, other)
    assert q.ratio == pytest.approx(0.8) and q.lo == pytest.approx(0.8) and q.hi == pytest.approx(0.8)
    assert q.slower and not q.faster


def test_ratio_estimate_interval_matches_t_formula():
    from scipy import stats

    ref = [100.0, 110.0, 90.0, 105.0, 95.0]
    other = [101.0, 112.0, 89.0, 108.0, 95.0]
    logs = [math.log(o / r) for r, o in zip(ref, other)]
    m = sum(logs) / 5
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 4)
    h = stats.t.ppf(0.95, 4) * sd / math.sqrt(5)
    q = ratio_estimate(ref, other, 0.9)
    assert (q.ratio, q.lo, q.hi) == pytest.approx((math.exp(m), math.exp(m - h), math.exp(m + h)))
    assert q.lo < 1 < q.hi and not q.faster and not q.slower  # a tie: neither significant


@pytest.mark.parametrize("kw, field", [
    ({"rel_halfwidth": 0}, "measure.paired.rel_halfwidth"),
    ({"level": 1.2}, "measure.paired.level"),
    ({"min_rounds": 5, "max_rounds": 3}, "measure.paired.min_rounds"),
])
def test_paired_settings_errors_name_the_field(kw, field):
    from archsearch.configio import from_dict
    from archsearch.search.config import MeasureConfig

    with pytest.raises(ArchsearchError) as e:
        from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "paired": kw}, "measure")
    assert e.value.field == field


def _spec(d: int) -> ArchSpec:
    return ArchSpec(n_layers=1, hidden_size=d, n_heads=2, n_kv_heads=2, head_dim=32, ffn=64, vocab_size=100)


def test_measure_paired_in_a_child_sees_a_2x_difference_through_drift():
    """Real isolated child, engines resident, alternating rounds, sequential stop."""
    s = BenchSettings(backend="hf", batch_sizes=[2], input_len=4, output_len=16, warmup=1, timeout_s=120)
    p = PairedSettings(level=0.9, rel_halfwidth=0.2, min_rounds=3, max_rounds=8)
    r = measure_paired([_spec(64), _spec(128), _spec(64)], s, p, 2, backend_class="tests.fakes:SleepBackend")
    assert r.ok, r.error
    assert 3 <= len(r.rounds) <= 8 and r.stop_reason
    slow, same = r.estimate(1), r.estimate(2)
    assert slow.slower and 0.4 < slow.ratio < 0.65  # hidden 128 takes twice as long
    # A/A: no invented difference (the rounds stop once the interval is within +-20%, so its width
    # alone proves nothing); 16 runs here: ratio 0.87-1.04, interval always around 1
    assert not same.faster and not same.slower and 0.75 < same.ratio < 1.33, same
    back = PairedResult.from_dict(json.loads(json.dumps(r.to_dict())))  # as stored: the derived ratios skipped
    assert back == r and back.estimate(1) == slow


def test_measure_paired_analytic_is_labelled_a_prediction():
    s = BenchSettings(backend="analytic", batch_sizes=[8], input_len=16, output_len=16, device_spec="H100")
    r = measure_paired([_spec(64), _spec(128)], s, PairedSettings(), 8)
    assert r.ok and r.predicted and r.estimate(1).lo == r.estimate(1).hi


def _twin_result(rounds):
    """A stored group: reference, one shape, the reference's twin (last)."""
    return PairedResult(specs=[_spec(64).to_dict(), _spec(128).to_dict(), _spec(64).to_dict()], rounds=rounds,
                        settings={}, paired={"level": 0.9, "twin": True}, batch_size=2)


def test_twin_reference_is_the_two_engines_geometric_mean_and_widens_by_instance_variance():
    from archsearch.benchmarks.paired import instance_variance

    # the twin runs 4% faster than the reference engine in every round (an instance effect)
    rounds = [[100.0 * w, 90.0 * w, 104.0 * w] for w in (1.0, 1.02, 0.98, 1.01, 0.99)]
    r = _twin_result(rounds)
    assert r.twin and r.ref_series()[0] == pytest.approx(math.sqrt(100 * 104))
    q = r.estimate(1)
    assert q.ratio == pytest.approx(90 / math.sqrt(100 * 104))  # the rounds' drift cancels exactly
    assert q.lo == pytest.approx(q.hi)  # no round-to-round spread: nothing but the instance term widens it
    iv, n = instance_variance([r])
    assert n == 1 and iv == pytest.approx(math.log(1.04) ** 2 / 2)  # d^2 - se^2 (se 0), halved
    wide = r.estimate(1, instance_var=iv)
    # candidate's own instance (iv) + the mean of two reference instances (iv / 2)
    from scipy import stats

    h = stats.t.ppf(0.95, 4) * math.sqrt(1.5 * iv)
    assert (wide.lo, wide.hi) == pytest.approx((q.ratio * math.exp(-h), q.ratio * math.exp(h)))
    # a group without a twin pools nothing; the pair keeps the twin's column
    plain = PairedResult(specs=r.specs[:2], rounds=[x[:2] for x in rounds], settings={}, paired={"level": 0.9},
                         batch_size=2)
    assert instance_variance([plain]) == (0.0, 0) and not plain.twin
    assert r.pair(1).rounds == rounds and r.pair(1).twin


def test_instance_variance_subtracts_the_rounds_own_error():
    from archsearch.benchmarks.paired import instance_variance

    # twin and reference differ only by round noise (alternating +-3%): the mean log ratio is ~0,
    # its own squared error exceeds it, so the estimate floors at 0 instead of inventing a spread
    rounds = [[100.0, 90.0, 100.0 * (1.03 if k % 2 else 0.97)] for k in range(6)]
    assert instance_variance([_twin_result(rounds)])[0] == 0.0


def test_measure_paired_with_twin_measures_the_reference_twice():
    s = BenchSettings(backend="hf", batch_sizes=[2], input_len=4, output_len=16, warmup=1, timeout_s=120)
    p = PairedSettings(level=0.9, rel_halfwidth=0.2, min_rounds=3, max_rounds=6, twin=True)
    r = measure_paired([_spec(64), _spec(128)], s, p, 2, backend_class="tests.fakes:SleepBackend")
    assert r.ok, r.error
    assert r.twin and len(r.specs) == 3 and r.specs[2] == r.specs[0] and all(len(x) == 3 for x in r.rounds)
    twin = r.estimate(2)
    assert not twin.faster and not twin.slower, twin  # the reference's twin is not a different speed
    assert r.estimate(1).slower


class _PairedFake:
    """A measurer whose paired comparisons give fixed ratios per GQA (first attempt) and others
    on re-measurement; records every group it was asked for."""

    note, backend = None, "fake"

    def __init__(self, ratios, retry_ratios=None):
        self.ratios, self.retry, self.calls, self.together = ratios, retry_ratios or {}, [], []

    def compare_together(self, ref, specs, fixed=None):
        """Records the group asked for and measures nothing (each step is then compared alone)."""
        self.together.append(([s.gqa for s in [ref, *(fixed or [])]], [s.gqa for s in specs]))
        return 0

    def instance_var(self):
        return 0.0

    def compare(self, specs, attempt=0):
        self.calls.append(([s.gqa for s in specs], attempt))
        table = self.retry if attempt else self.ratios
        rounds = []
        for k in range(4):  # +-1% noise around each ratio
            wig = 1 + 0.01 * (-1) ** k
            rounds.append([100.0] + [100.0 * table[s.gqa] * (wig if i == len(specs) - 2 else 1)
                                     for i, s in enumerate(specs[1:])])
        from archsearch.benchmarks.paired import PairedResult
        from archsearch.search.measurements import Measurement

        return Measurement(PairedResult(specs=[s.to_dict() for s in specs], rounds=rounds, settings={},
                                        paired={"level": 0.9}, batch_size=8), key="k", cached=False)


def _gqa_ctx(tmp_path, measurer, spec=None, **over):
    from archsearch.arch import non_embedding_params
    from archsearch.laws import load_law
    from archsearch.search.context import SearchContext
    from archsearch.search.resolved import derive
    from tests.test_search import load, study_config

    cfg = load(study_config(tmp_path, **({"params": non_embedding_params(spec)} if spec else {}), **over))
    base = ArchSpec(n_layers=16, hidden_size=2048, n_heads=16, n_kv_heads=16, head_dim=64, ffn=8192, vocab_size=256)
    return SearchContext(study=dataclasses.replace(derive(cfg), baseline=base), law=load_law(tmp_path / "law.json"),
                         target_loss=100.0, measurer=measurer, out=tmp_path)


def test_gqa_stop_needs_significantly_slower_else_remeasures(tmp_path):
    from archsearch.search.gqa import gqa_pairs, local_gqa_search

    spec = ArchSpec(n_layers=16, hidden_size=2048, n_heads=24, n_kv_heads=6, head_dim=64, ffn=8192, vocab_size=256)
    # a law-only study cannot check loss: a bound far out lets throughput end the walk here
    ctx = _gqa_ctx(tmp_path, None, spec, gqa_search={"max_gqa": 64})
    pairs = sorted(gqa_pairs(spec, ctx.cfg.params, ctx.build))
    up1, up2 = [g for g in pairs if g > 4][:2]
    down = max(g for g in pairs if g < 4)
    # up1 looks slower than GQA 4 (x0.995) but within the noise: re-measured, still a tie, so the
    # walk goes on; up2 and `down` are clearly slower: stop there
    m = _PairedFake({4: 1.30, up1: 1.30 * 0.995, up2: 1.30 * 0.7, down: 1.0},
                    retry_ratios={4: 1.30, up1: 1.30 * 0.998})
    ctx.measurer = m
    res = local_gqa_search(spec, ctx, baseline_gqa=4)
    assert m.calls == [([1, 4], 0), ([1, 4, up1], 0), ([1, 4, up1], 1), ([1, 4, up2], 0), ([1, 4, down], 0)]
    assert m.together == [([1, 4], [up1, down])]  # the first step each way, asked for in one engine process
    notes = {s.gqa: s.note for s in res.steps}
    assert "re-measured" in notes[up1] and "stop" not in notes[up1]
    assert "significantly slower" in notes[up2] and "stop" in notes[down]
    assert res.chosen.gqa == 4 and res.chosen.ratio["significantly_faster"]


def test_answer_keeps_the_baseline_unless_significantly_faster(tmp_path):
    from dataclasses import replace

    from archsearch.search.answer import Answer, keep_baseline_unless_faster

    ctx = _gqa_ctx(tmp_path, None)
    tie = Answer(spec=_spec(64), source="Optuna trial 3", predicted_loss=1.0, throughput=100.0,
                 ratio={"ratio": 1.04, "lo": 0.98, "hi": 1.10, "significantly_faster": False})
    kept = keep_baseline_unless_faster(tie, ctx)
    assert kept.is_baseline and kept.spec == ctx.baseline and kept.best_candidate is tie
    assert kept.summary(123.0, tmp_path / "c.json")["throughput"] == 123.0  # the baseline's paired mean
    win = replace(tie, ratio={**tie.ratio, "lo": 1.01, "significantly_faster": True})
    assert keep_baseline_unless_faster(win, ctx) is win


def test_calibration_recovers_known_efficiencies_and_labels_uncalibrated(tmp_path):
    """Results made by a known calibration are fitted back; held-out shapes then match."""
    import dataclasses

    from archsearch.benchmarks import measure
    from archsearch.benchmarks.calibration import Calibration
    from archsearch.benchmarks.calibration_fit import fit_calibration

    truth = Calibration("dev", "vllm", "float32", 0.2, 0.05, 2e-3, peak_flops=1e12, memory_bandwidth=1e11)
    truth.save(tmp_path / "truth.json")
    shapes = [ArchSpec(n_layers=2, hidden_size=d, n_heads=d // 32, n_kv_heads=kv, head_dim=32, ffn=f, vocab_size=2048)
              for d, kv, f in ((128, 4, 256), (256, 2, 512), (512, 16, 1024), (256, 8, 2048), (384, 4, 768))]
    made = []
    for sp in shapes:
        s = BenchSettings(backend="analytic", batch_sizes=[4, 16], input_len=32, output_len=16, dtype="float32",
                          device_spec="H100", engine_args={"calibration": str(tmp_path / "truth.json")})
        r = measure(sp, s)
        made.append(dataclasses.replace(r, predicted=False, device="dev", backend="vllm"))
    fit = fit_calibration(made[:3], "H100")
    fit.save(tmp_path / "fit.json")
    for sp, r in zip(shapes[3:], made[3:]):
        s = BenchSettings(backend="analytic", batch_sizes=[4, 16], input_len=32, output_len=16, dtype="float32",
                          device_spec="H100", engine_args={"calibration": str(tmp_path / "fit.json")})
        p = measure(sp, s)
        for b in (4, 16):
            assert p.throughput(b) == pytest.approx(r.throughput(b), rel=0.02)
        assert p.to_dict()["settings"]["engine_args"]["calibration"]
    plain = measure(shapes[0], BenchSettings(backend="analytic", batch_sizes=[4], device_spec="H100"))
    assert "uncalibrated" in json.dumps(plain.to_dict())
    with pytest.raises(ArchsearchError) as e:
        fit_calibration(made[:1], "H100")
    assert e.value.field == "results"


def _demo_raw(**measure):
    from archsearch.configio import load_yaml

    raw = load_yaml("configs/demo-cpu.yaml")
    raw["measure"] = {**raw["measure"], **measure}
    return raw


def test_measure_params_valid_only_where_feasibility_is_the_same_at_every_n():
    from archsearch.configio import from_dict
    from archsearch.search.config import StudyConfig, inherit_study_settings

    cfg = from_dict(StudyConfig, inherit_study_settings(_demo_raw(params="4e6")))
    assert cfg.measure.params == 4e6
    bad = [({"law": {"form": "conditional-additive"}}, "conditional-multiplicative"),
           ({"target": {"loss": 5.0}}, "target.slack")]
    for change, fix in bad:
        raw = _demo_raw(params=4e6)
        for k, v in change.items():
            raw[k] = {**raw[k], **v}
        with pytest.raises(ArchsearchError) as e:
            from_dict(StudyConfig, inherit_study_settings(raw))
        assert e.value.field == "measure.params" and fix in (e.value.problem + (e.value.fix or ""))
    with pytest.raises(ArchsearchError) as e:
        from_dict(StudyConfig, inherit_study_settings(_demo_raw(params=-1)))
    assert e.value.field == "measure.params"


def test_measured_shape_keeps_the_realised_ratios_at_the_measured_n():
    from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio, non_embedding_params
    from archsearch.candidates import BuildSettings, build_candidate
    from archsearch.search.measurements import measured_shape

    build = BuildSettings(hidden_multiple=32, ffn_multiple=32, tolerance=0.15, on_r_drift="flag")
    small = build_candidate(2e5, 2, 0.3, 2.0, gqa=2, head_dim=32, settings=build).spec
    big = measured_shape(small, 8e6, 32, build)
    assert non_embedding_params(big) == pytest.approx(8e6, rel=0.15)
    assert hidden_over_sqrt_n(big) == pytest.approx(hidden_over_sqrt_n(small), rel=0.05)
    assert mlp_to_attn_ratio(big) == pytest.approx(mlp_to_attn_ratio(small), rel=0.15)
    assert big.n_heads // big.n_kv_heads == 2 and big.n_layers == 2 and big.head_dim == 32


def test_measurer_measures_the_rescaled_shape_keyed_by_the_study_shape(tmp_path, monkeypatch):
    from archsearch.search.config import MeasureConfig
    from archsearch.search.measurements import MeasurementStore, Measurer

    seen = []

    def fake_paired(specs, settings, paired, b, **kw):
        seen.append([s.hidden_size for s in specs])
        return PairedResult(specs=[s.to_dict() for s in specs], rounds=[[1.0, 2.0], [1.0, 2.0]], settings={},
                            paired={"level": 0.9}, batch_size=b)

    monkeypatch.setattr("archsearch.search.measurements.measure_paired", fake_paired)
    store = MeasurementStore(tmp_path / "m.jsonl")
    double = lambda s: ArchSpec(**{**s.to_dict(), "hidden_size": 2 * s.hidden_size})  # noqa: E731
    plain = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf", "batch_sizes": [4]}}, "measure"), store)
    scaled = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf", "batch_sizes": [4]}, "params": 4e6}, "measure"), store, scale=double)
    a, b = _spec(64), _spec(128)
    scaled.compare([a, b])
    plain.compare([a, b])
    assert seen == [[128, 256], [64, 128]]  # rescaled shapes measured; the settings key them apart


def _keyed(tmp_path, backend="vllm", paired=None, **measure):
    """A Measurer of a CPU demo's measure block keyed as if ``backend`` measured (vLLM, with the
    demo's hf fallback, need not be installed here)."""
    from archsearch.search.config import MeasureConfig
    from archsearch.search.measurements import MeasurementStore, Measurer

    bench = {"backend": "vllm", "batch_sizes": [16], "input_len": 64, "output_len": 64, "repeats": 3,
             "dtype": "float32", "timeout_s": 300.0}
    own = {k: measure.pop(k) for k in list(measure) if k not in BenchSettings.__dataclass_fields__}  # the block's own
    cfg = replace(from_dict(MeasureConfig, {"bench": {**bench, **measure}, "fallback_backend": "hf", **own}, "measure"),
                  paired=paired or PairedSettings())
    m = Measurer(cfg, MeasurementStore(tmp_path / "m.jsonl"))
    m.backend = backend
    return m


# results/examples/demo-cpu-active/measurements.jsonl, written before measure.paired nested the paired
# settings (its config.json has measure.ci_level ...): the GQA step against the baseline
_OLD_BASELINE = {"n_layers": 2, "hidden_size": 96, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "ffn": 224,
                 "vocab_size": 2048, "tie_embeddings": False, "max_position_embeddings": 4096,
                 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "family": "llama", "name": "baseline"}
_OLD_STEP = {**_OLD_BASELINE, "hidden_size": 192, "n_heads": 2, "n_kv_heads": 1, "ffn": 96, "name": None}


def test_the_migration_reproduces_a_key_stored_in_the_older_layout(tmp_path):
    from archsearch.search.migration import old_key_settings
    from archsearch.search.measurements import measurement_key, paired_key, spec_key

    m = _keyed(tmp_path)
    keys = [spec_key(ArchSpec.from_dict(_OLD_BASELINE)), spec_key(ArchSpec.from_dict(_OLD_STEP))]
    first = measurement_key(keys[0], old_key_settings(m.cfg, m.backend))
    assert paired_key(keys, first) == "5233ef9e45249a25"  # the key stored then
    assert m.pair_key([ArchSpec.from_dict(_OLD_BASELINE), ArchSpec.from_dict(_OLD_STEP)]) != "5233ef9e45249a25"


def test_measurement_key_changes_with_what_changes_a_measurement_only(tmp_path):
    from dataclasses import dataclass, field

    from archsearch.configio import KEY

    spec = _spec(64)
    key = _keyed(tmp_path).key(spec)
    # study-only choices (fields not marked as keying) key nothing new
    assert _keyed(tmp_path, fallback_backend="sglang").key(spec) == key
    # the engine-instance sd widens intervals computed when read: the stored rounds are the same
    assert _keyed(tmp_path, paired=PairedSettings(instance_sd=0.02)).key(spec) == key
    assert _keyed(tmp_path, batch_sizes=[16, 32], reference_batch_size=16).key(spec) == \
        _keyed(tmp_path, batch_sizes=[16, 32]).key(spec)

    # a setting added later keys a measurement where it is marked so, at any value
    @dataclass(frozen=True)
    class WithProcesses(PairedSettings):
        processes: int = field(default=1, metadata=KEY)
        note: str = ""

    assert _keyed(tmp_path, paired=WithProcesses(note="x")).key(spec) == _keyed(tmp_path, paired=WithProcesses()).key(spec)
    assert _keyed(tmp_path, paired=WithProcesses()).key(spec) != key
    assert _keyed(tmp_path, paired=WithProcesses(processes=2)).key(spec) != _keyed(tmp_path, paired=WithProcesses()).key(spec)
    for changed in ({"seed": 1}, {"engine_per_batch": True}, {"params": 4e6}, {"input_len": 32}, {"batch_sizes": [8]},
                    {"paired": PairedSettings(level=0.95)}):
        paired = changed.pop("paired", None)
        assert _keyed(tmp_path, paired=paired, **changed).key(spec) != key, changed
    assert _keyed(tmp_path, backend="hf").key(spec) != key  # the engine that measured


def test_compare_together_measures_missing_pairs_in_one_group_and_stores_each_pair(tmp_path, monkeypatch):
    from archsearch.search.config import MeasureConfig
    from archsearch.search.measurements import MeasurementStore, Measurer

    calls, fail = [], []

    def fake_paired(specs, settings, paired, b, **kw):
        calls.append([s.hidden_size for s in specs])
        rounds = [[100.0] + [100.0 * (1 + i / 10) + k for i in range(1, len(specs))] for k in range(3)]
        return PairedResult(specs=[s.to_dict() for s in specs], rounds=rounds if not fail else [], settings={},
                            paired={"level": 0.9}, batch_size=b, ok=not fail, ttft=[0.1 * i for i in range(len(specs))],
                            timing={"engine_start_s": [1.0] * len(specs)})

    monkeypatch.setattr("archsearch.search.measurements.measure_paired", fake_paired)
    store = MeasurementStore(tmp_path / "m.jsonl")
    m = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf", "batch_sizes": [4]}}, "measure"), store)
    ref, b, c, d = _spec(32), _spec(64), _spec(96), _spec(128)
    assert m.compare_together(ref, [b, c]) == 2 and calls == [[32, 64, 96]]
    got = m.compare([ref, c])
    assert calls == [[32, 64, 96]] and not got.cached  # read back, but taken by this process
    assert got.result.rounds == [[100.0, 120.0 + k] for k in range(3)] and got.result.ttft == [0.0, 0.2]
    assert got.result.timing["group_size"] == 3 and store.get(got.key)["group"]["size"] == 3
    again = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf", "batch_sizes": [4]}}, "measure"), store)
    assert again.compare([ref, b]).cached and again.compare_together(ref, [b, c]) == 0
    assert again.compare_together(ref, [b, d]) == 0 and calls == [[32, 64, 96]]  # one missing: its trial measures it
    fail.append(True)
    e = _spec(160)
    assert again.compare_together(ref, [d, e]) == 0 and store.get(again.pair_key([ref, d])) is None


def test_test_retest_statistics_account_for_the_second_pass_noise():
    """Equal errors: a calibrated 90% interval holds the other pass's ratio ~75% of the time
    (not 90%); two passes differing by more than their combined error count as disagreeing."""
    import math

    from scipy import stats

    from archsearch.benchmarks.scripts.bench_test_retest import agreement

    def est(ratio, se, n=10, level=0.9):
        h = stats.t.ppf(0.5 + level / 2, n - 1) * se
        return {"ratio": ratio, "lo": ratio * math.exp(-h), "hi": ratio * math.exp(h), "level": level, "n": n}

    a = [est(1.0, 0.02), est(1.1, 0.02), est(1.2, 0.02)]
    b = [est(1.01, 0.02), est(1.1 * math.exp(0.03), 0.02), est(1.3, 0.02)]
    out = agreement(a, b)
    assert out["expected_coverage_if_calibrated"] == pytest.approx(2 * stats.norm.cdf(1.6449 / math.sqrt(2)) - 1, abs=1e-3)
    assert out["expected_coverage_if_calibrated"] == pytest.approx(0.755, abs=0.005)
    # |log ratio| 0.00995 and 0.03 are within 1.645 * 0.0283 = 0.0465; log(1.3/1.2) = 0.08 is not
    assert out["agree_within_combined_interval"] == pytest.approx(2 / 3)
    assert out["spearman"] == pytest.approx(1.0) and out["pairwise_order_agreement"] == 1.0


def test_expected_spearman_follows_the_passes_precision():
    """Shapes 10% apart measured at +-1%: repeatable ranks (Spearman ~1); shapes that are the same
    measured at +-3%: ranks are noise (Spearman ~0); halving the error raises the expectation."""
    import math

    from scipy import stats

    from archsearch.benchmarks.scripts.bench_test_retest import expected_spearman

    def est(ratio, se, n=10, level=0.9):
        h = stats.t.ppf(0.5 + level / 2, n - 1) * se
        return {"ratio": ratio, "lo": ratio * math.exp(-h), "hi": ratio * math.exp(h), "level": level, "n": n}

    apart = [est(1.1 ** i, 0.006) for i in range(6)]
    sure = expected_spearman(apart, apart, draws=300)
    assert sure[0]["spearman_mean"] > 0.99 and sure[0]["p_spearman_at_least_0_9"] == 1.0
    same_a = [est(1 + 0.01 * (-1) ** i, 0.02) for i in range(6)]
    same_b = [est(1 - 0.01 * (-1) ** i, 0.02) for i in range(6)]
    noise = expected_spearman(same_a, same_b, draws=300)
    assert abs(noise[0]["spearman_mean"]) < 0.15 and noise[0]["p_spearman_at_least_0_9"] < 0.1
    close = [est(1 + 0.02 * i, 0.015) for i in range(6)]
    by_scale = expected_spearman(close, close, scales=(1.0, 0.5), draws=300)
    assert by_scale[1]["spearman_mean"] > by_scale[0]["spearman_mean"] + 0.05
    assert by_scale[1]["mean_rel_halfwidth"] == pytest.approx(by_scale[0]["mean_rel_halfwidth"] / 2)


def test_calibration_chooses_the_model_variant_by_leave_one_shape_out_error(tmp_path):
    """Engine data made by an additive (compute + memory) step with per-sequence and per-head
    overheads: the fit picks that variant on the fitted shapes alone and predicts held-out shapes closely,
    where the roofline's max() form cannot."""
    import dataclasses

    from archsearch.benchmarks import measure
    from archsearch.benchmarks.calibration import Calibration
    from archsearch.benchmarks.calibration_fit import CPU_TERMS, fit_calibration

    truth = Calibration("dev", "vllm", "float32", 0.3, 0.2, 1e-3, 2e-4, 5e-6, 0.0, "sum", peak_flops=1e12,
                        memory_bandwidth=1e11)
    truth.save(tmp_path / "truth.json")

    def run(sp, cal):
        s = BenchSettings(backend="analytic", batch_sizes=[4, 32], input_len=32, output_len=16, dtype="float32",
                          device_spec="H100", engine_args={"calibration": str(cal)})
        return measure(sp, s)

    shapes = [ArchSpec(n_layers=4, hidden_size=d, n_heads=d // 64, n_kv_heads=kv, head_dim=64, ffn=f, vocab_size=32000)
              for d, kv, f in ((1024, 16, 2048), (1024, 2, 8192), (4096, 64, 2048), (4096, 8, 8192),
                               (2048, 8, 4096), (3072, 12, 3072))]
    made = [dataclasses.replace(run(sp, tmp_path / "truth.json"), predicted=False, device="dev", backend="vllm")
            for sp in shapes]
    fit = fit_calibration(made[:4], "H100", terms=CPU_TERMS)  # the forms tried on a CPU engine
    assert fit.fit["variant"] == "sum+seq+head" and fit.combine == "sum" and fit.head_overhead_s > 0
    scores = fit.fit["held_out_mape_by_variant"]
    assert fit.fit["leave_one_shape_out"]["mape"] < 0.01 < min(scores["max"], scores["sum"])
    assert scores["sum+seq+head"] == min(scores.values())
    fit.save(tmp_path / "fit.json")
    for sp, r in zip(shapes[4:], made[4:]):
        p = run(sp, tmp_path / "fit.json")
        for b in (4, 32):
            assert p.throughput(b) == pytest.approx(r.throughput(b), rel=0.02)
    with pytest.raises(ArchsearchError) as e:
        Calibration("dev", "vllm", "float32", 0.3, 0.2, 1e-3, 0.0, 0.0, 0.0, "mean")
    assert e.value.field == "calibration.combine"


def test_a_trial_proposing_the_baseline_is_not_measured(tmp_path):
    """Its ratio to itself is 1 by definition; it does not count as a measured shape."""
    import optuna

    from archsearch.search.objective import _paired_objective, was_measured

    class NoMeasure:
        def compare(self, specs, attempt=0):
            raise AssertionError("the baseline was measured against itself")

    ctx = _gqa_ctx(tmp_path, NoMeasure())
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    assert _paired_objective(trial, ctx, ctx.baseline, 5.0) == 1.0
    study.tell(trial, 1.0)
    t = study.trials[0]
    assert t.user_attrs["is_baseline"] and not was_measured(t)
    other = ArchSpec(**{**ctx.baseline.to_dict(), "n_kv_heads": 8})
    with pytest.raises(AssertionError):
        _paired_objective(study.ask(), ctx, other, 5.0)


def test_measurer_pools_instance_variance_once_per_group(tmp_path):
    from archsearch.benchmarks.paired import instance_variance
    from archsearch.configio import from_dict
    from archsearch.search.config import MeasureConfig
    from archsearch.search.measurements import MeasurementStore, Measurer

    cfg = from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "paired": {"twin": True}}, "measure")
    store = MeasurementStore(tmp_path / "measurements.jsonl")
    group = _twin_result([[100.0, 90.0, 106.0], [101.0, 91.0, 107.0], [99.0, 90.0, 105.0]])
    alone = _twin_result([[100.0, 90.0, 98.0], [101.0, 91.0, 99.0], [99.0, 90.0, 97.5]])
    for key in ("pair-a", "pair-b"):  # one group of three stored as two pairs
        store.put(key, {**group.pair(1).to_dict(), "group": {"key": "g1", "size": 3}})
    store.put("pair-c", alone.to_dict())
    m = Measurer(cfg, store)
    assert m.instance_var() == pytest.approx(instance_variance([group.pair(1), alone])[0])
    assert m.instance_var() != pytest.approx(instance_variance([group.pair(1), group.pair(1), alone])[0])
    off = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf"}}, "measure"), store)
    assert off.instance_var() == 0.0  # without twins in the settings, no widening


def test_calibration_fit_set_is_chosen_from_features_and_separates_r_from_gqa():
    """In the calibration grid the box corners pair r = 1 with GQA 1 and r = 5 with GQA 4, so a fit
    on them cannot tell the two apart; the D-optimal four span all three knobs independently."""
    import math
    from types import SimpleNamespace

    import numpy as np

    from archsearch.arch import hidden_over_sqrt_n, mlp_to_attn_ratio
    from archsearch.benchmarks.scripts.bench_calibration import corners, d_optimal
    from archsearch.benchmarks.scripts.bench_engines_cpu import shapes

    results = [SimpleNamespace(architecture=s.to_dict()) for s in shapes(16e6, 4, "calibration")]

    def design(rs):
        from archsearch.benchmarks.scripts.bench_calibration import _spec

        X = np.array([[1.0, math.log(hidden_over_sqrt_n(_spec(q))), math.log(mlp_to_attn_ratio(_spec(q))),
                       math.log(_spec(q).n_heads // _spec(q).n_kv_heads)] for q in rs])
        return np.corrcoef(X[:, 2], X[:, 3])[0, 1], np.linalg.det(X.T @ X)

    corr, det = design(corners(results))
    assert corr > 0.99  # log r and log GQA move together at the corners (measured 0.999)
    picked = d_optimal(results)
    corr_d, det_d = design(picked)
    assert len(picked) == 4 and abs(corr_d) < 0.5 and det_d > 1000 * det  # measured 0.07, 7.5 vs 0.001


def test_configured_instance_sd_widens_until_twins_measure_it(tmp_path):
    from archsearch.configio import from_dict
    from archsearch.search.config import MeasureConfig
    from archsearch.search.measurements import MeasurementStore, Measurer

    store = MeasurementStore(tmp_path / "measurements.jsonl")
    prior = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "paired": {"instance_sd": 0.02}}, "measure"), store)
    assert prior.instance_var() == pytest.approx(0.02 ** 2)  # no twins: the configured value
    twin = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "paired": {"instance_sd": 0.02, "twin": True}},
                              "measure"), store)
    assert twin.instance_var() == pytest.approx(0.02 ** 2)  # no twin group measured yet
    store.put("g", _twin_result([[100.0, 90.0, 106.0], [101.0, 91.0, 107.0], [99.0, 90.0, 105.0]]).to_dict())
    assert twin.instance_var() != pytest.approx(0.02 ** 2)  # the twins' pooled estimate replaces it
    analytic = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "analytic"}, "paired": {"instance_sd": 0.02}},
                                  "measure"), store)
    assert analytic.instance_var() == 0.0  # a prediction has no engine instance
    with pytest.raises(ArchsearchError) as e:
        from_dict(MeasureConfig, {"bench": {"backend": "hf"}, "paired": {"instance_sd": -0.1}}, "measure")
    assert "instance_sd" in str(e.value.field)


def test_instance_sd_between_passes_is_what_the_intervals_do_not_explain():
    import math

    from scipy import stats

    from archsearch.benchmarks.scripts.bench_test_retest import instance_sd_between_passes

    def est(ratio, se, n=20, level=0.9):
        h = stats.t.ppf(0.5 + level / 2, n - 1) * se
        return {"ratio": ratio, "lo": ratio * math.exp(-h), "hi": ratio * math.exp(h), "level": level, "n": n}

    a = [est(1.0 + 0.1 * i, 0.01) for i in range(6)]
    assert instance_sd_between_passes(a, a) == 0.0  # identical passes: nothing beyond the rounds
    # passes 6% apart (log) with +-1% rounds: d^2 = 0.0036, se^2 sum 0.0002 -> s = sqrt(0.0034 / 4)
    b = [est(x["ratio"] * math.exp(0.06 * (-1) ** i), 0.01) for i, x in enumerate(a)]
    assert instance_sd_between_passes(a, b) == pytest.approx(math.sqrt((0.06 ** 2 - 2 * 0.01 ** 2) / 4), rel=1e-6)
    close = [est(x["ratio"] * math.exp(0.005), 0.01) for x in a]  # inside the rounds' error: floored at 0
    assert instance_sd_between_passes(a, close) == 0.0


def test_compare_together_with_fixed_shapes_stores_each_group_the_walk_reads(tmp_path, monkeypatch):
    """The GQA walk's first steps: the baseline, the start variant (fixed) and each step in one
    engine process; each step's group [baseline, start, step] is read back with its own columns."""
    from archsearch.search.config import MeasureConfig
    from archsearch.search.measurements import MeasurementStore, Measurer

    calls = []

    def fake_paired(specs, settings, paired, b, **kw):
        calls.append([s.hidden_size for s in specs])
        rounds = [[100.0 + 10 * i + k for i in range(len(specs))] for k in range(3)]
        return PairedResult(specs=[s.to_dict() for s in specs], rounds=rounds, settings={},
                            paired={"level": 0.9}, batch_size=b, ttft=[0.1 * i for i in range(len(specs))],
                            timing={"engine_start_s": [1.0 + i for i in range(len(specs))]})

    monkeypatch.setattr("archsearch.search.measurements.measure_paired", fake_paired)
    store = MeasurementStore(tmp_path / "m.jsonl")
    m = Measurer(from_dict(MeasureConfig, {"bench": {"backend": "hf", "batch_sizes": [4]}}, "measure"), store)
    ref, start, b, c = _spec(32), _spec(64), _spec(96), _spec(128)
    assert m.compare_together(ref, [b, c], fixed=[start]) == 2 and calls == [[32, 64, 96, 128]]
    got = m.compare([ref, start, c])
    assert calls == [[32, 64, 96, 128]]  # read back, not measured again
    assert got.result.rounds == [[100.0 + k, 110.0 + k, 130.0 + k] for k in range(3)]
    assert got.result.ttft == pytest.approx([0.0, 0.1, 0.3]) and got.result.timing["engine_start_s"] == [1.0, 2.0, 4.0]
    ratios = [math.log((130.0 + k) / (110.0 + k)) for k in range(3)]  # the step over the start variant, per round
    assert got.result.estimate(2, ref=1).ratio == pytest.approx(math.exp(sum(ratios) / 3), rel=1e-6)
    assert store.get(got.key)["group"]["size"] == 4 and m.compare([ref, b]).key != got.key

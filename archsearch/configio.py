"""Plain-data configs: dict/YAML <-> typed dataclasses, with errors that name the field.

Every config of the project (architecture, training run, benchmark run, study) is a
dataclass. :func:`from_dict` builds one from parsed YAML/JSON with pydantic (its schema of the
dataclass, read as our configs are read: see :func:`_tuned`), checking unknown keys, types and
nested dataclasses, and raises :class:`ArchsearchError` naming the dotted path of the bad field
(``study.search.gqa_choices[2]``). The dataclass's own ``__post_init__`` then checks values.
Importing this module imports neither torch nor pydantic (loaded at the first :func:`from_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from typing import Any, Self, TypeVar

from archsearch.errors import ArchsearchError, redact  # redact: re-exported, what configs are masked with
from archsearch.yamlio import load_yaml_file

T = TypeVar("T")


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def number_from_text(text: str) -> float:
    """'1e9', '1B', '150M', '300k', '2_000' -> float; ValueError otherwise (the CLI's and the
    YAML files' one number syntax)."""
    t = text.strip().replace("_", "")
    mult = _SUFFIXES.get(t[-1:].lower())
    return float(t[:-1]) * mult if mult else float(t)


def _number(value: Any) -> Any:
    """What an int or float field reads before pydantic's strict check: the number syntax
    (``200K``, ``1e9``, which PyYAML reads as strings) and whole floats as integers."""
    if isinstance(value, str):
        try:
            value = number_from_text(value)
        except ValueError:
            return value
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _section(cls: type) -> Any:
    """The check before a dataclass section is read: unknown keys named with the closest field (a
    key of a :func:`component`, written in the enclosing block as the flat form of old did, named
    with its nested place), and each component block given in part completed from the field's
    default."""
    components = {f.name: f.default_factory for f in dataclasses.fields(cls) if f.metadata.get("component")}
    keys = [f.name for f in dataclasses.fields(cls) if f.init]
    owner = {g.name: name for name, make in components.items() for g in dataclasses.fields(make())
             if g.init and g.name not in keys}

    def check(data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key in data:
            if key in getattr(cls, "RENAMED_KEYS", {}):  # a key an earlier version took
                raise ArchsearchError(str(key), "is a key of an earlier version", cls.RENAMED_KEYS[key])
            if key in keys:
                continue
            if key in owner:
                raise ArchsearchError(str(key), f"belongs to the {owner[key]!r} block",
                                      f"write it as {{block}}{owner[key]}.{key}; archsearch migrate rewrites "
                                      "a config written flat")
            close = difflib.get_close_matches(str(key), keys + list(owner), n=1)
            hint = (f"did you mean '{{block}}{owner[close[0]]}.{close[0]}'?" if close and close[0] in owner else
                    f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(keys)}")
            raise ArchsearchError(str(key), "unknown key", hint)
        out = dict(data)
        for name, make in components.items():  # a key left out keeps the value of the field's default
            if isinstance(data.get(name), dict):
                default = make()
                base = {g.name: getattr(default, g.name) for g in dataclasses.fields(default) if g.init}
                out[name] = {**base, **data[name]}
        return out
    return check


def _tuned(node: Any) -> Any:
    """Pydantic's schema of a config read as our configs are: flags, text and numbers strict
    (no ``yes`` for true, no 5 for a text, finite numbers), numbers also in the number syntax,
    every section checked by :func:`_section`."""
    from pydantic_core import core_schema as cs

    if isinstance(node, list):
        return [_tuned(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _tuned(v) for k, v in node.items()}
    if node.get("type") in ("bool", "str", "int", "float"):
        if node["type"] in ("bool", "str"):
            return {**node, "strict": True}
        return cs.no_info_before_validator_function(_number, {**node, "strict": True, "allow_inf_nan": False})
    if node.get("type") == "dataclass":
        node["schema"] = cs.no_info_before_validator_function(_section(node["cls"]), node["schema"])
    return node


@functools.cache
def _validator(cls: type) -> Any:
    from pydantic import TypeAdapter
    from pydantic_core import SchemaValidator

    return SchemaValidator(_tuned(TypeAdapter(cls).core_schema))


def _path(where: str, loc: tuple[Any, ...], data: Any, missing: bool) -> str:
    """Pydantic's error location as a dotted path (``study.search.gqa_choices[2]``), read along
    the data so that a union member's name, which the data does not hold, is left out (but for
    the last of a ``missing`` field)."""
    path = where
    for i, part in enumerate(loc):
        if isinstance(data, dict) and part in data or missing and i == len(loc) - 1 and isinstance(part, str):
            path = f"{path}.{part}" if path else str(part)
            data = data.get(part) if isinstance(data, dict) else None
        elif isinstance(data, (list, tuple)) and isinstance(part, int) and part < len(data):
            path, data = f"{path}[{part}]", data[part]
    return path


def component(default_factory: Any, key: bool = False) -> Any:
    """A component config held as a field of an enclosing config, written nested as the
    dataclasses compose (``law: {fit: {bootstrap: 200}}`` for ``LawConfig.fit: FitOptions``).
    A block given in part keeps, for the keys it leaves out, the values of the field's default
    (``default_factory()``: the enclosing config's defaults, which may differ from the component
    class's own); a component's key written in the enclosing block is refused with its nested
    place. ``key``: the component's marked fields key a stored result (:func:`key_values`)."""
    return dataclasses.field(default_factory=default_factory, metadata={"component": True, "key": key})


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field's type hint holds (``X``, ``X | None``), else None."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    dcs = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a) and isinstance(a, type)]
    return dcs[0] if len(dcs) == 1 and type(None) in typing.get_args(hint) else None


def nest_components(cls: type, data: Any, where: str = "") -> tuple[Any, list[str]]:
    """``data`` (a config of ``cls`` as a mapping) with every :func:`component`'s keys written in
    the enclosing block, the flat form of older versions (``law: {bootstrap: 200}``), moved into
    the component's block (``law: {fit: {bootstrap: 200}}``); and the moved keys' new dotted
    names. A name the enclosing class declares itself stays its own (``law.seed``). What
    ``archsearch migrate`` applies to a config file and a study folder's ``config.json``."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return data, []
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        return data, []
    fields = [f for f in dataclasses.fields(cls) if f.init]
    own = {f.name for f in fields}
    out, moved = dict(data), []
    for f in fields:
        if f.metadata.get("component"):
            names = {g.name for g in dataclasses.fields(f.default_factory()) if g.init} - own
            flat = {k: out.pop(k) for k in list(out) if k in names}
            if flat:
                block = out.get(f.name) if isinstance(out.get(f.name), dict) else {}
                out[f.name] = {**flat, **block}
                moved += [f"{where}{f.name}.{k}" for k in flat]
        sub = _dataclass_of(hints.get(f.name))
        if sub is not None and isinstance(out.get(f.name), dict):
            out[f.name], m = nest_components(sub, out[f.name], f"{where}{f.name}.")
            moved += m
    return out, moved


KEY = {"key": True}  # field metadata: the field keys a stored result (key_values)


def key_values(obj: Any) -> dict[str, Any]:
    """The fields of config ``obj`` marked ``metadata=KEY`` (a component field marked so
    contributes its own marked fields, nested under its name, or flat for a :func:`component`,
    as stored results were keyed when components were written flat: keys stay valid), as plain
    data (:func:`to_dict`): what a result stored under this config is keyed by. A field that
    changes no result (a fallback, a retry budget) is left unmarked."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if not f.metadata.get("key"):
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            inner = key_values(value)
            if f.metadata.get("component"):
                out.update(inner)
            else:
                out[f.name] = inner
        else:
            out[f.name] = to_dict(value)
    return out


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, validating keys and types by their hints (a
    :func:`component` block given in part completed from its default); the dataclass's own
    ``__post_init__`` then checks values. An error names the dotted path of the bad field."""
    from pydantic import ValidationError

    try:
        return _validator(cls).validate_python(data)
    except ValidationError as e:
        err = e.errors()[0]
        path = _path(where, err["loc"], data, err["type"] == "missing")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ArchsearchError):  # a section's own check: its field under the section
            inside = path and cause.field.startswith(path)
            # a section that names itself (SLO's "slo.ttft_s" at "measure.slo"): named once
            parent, _, last = path.rpartition(".")
            named_self = bool(path) and not inside and cause.field.startswith(f"{last}.")
            field = cause.field if inside else ".".join(filter(None, (parent if named_self else path, cause.field)))
            fix = cause.fix.replace("{block}", f"{path}." if path else "") if cause.fix else cause.fix
            raise ArchsearchError(field, cause.problem, fix) from None
        msg = f"{err['msg'][:1].lower()}{err['msg'][1:]}, got {err['input']!r}"
        problem = "is required" if err["type"] == "missing" else msg
        raise ArchsearchError(path or cls.__name__, problem) from None


class PlainData:
    """A dataclass stored as JSON (a record, not a config): ``to_dict`` and a lenient ``from_dict``
    that ignores keys that are not fields, so a record written by another version loads."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def to_dict(obj: Any) -> Any:
    """A dataclass (possibly nested) as plain JSON/YAML-able data, every URL's password masked
    (:func:`redact`): what is written of a config never holds a secret."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, str):
        return redact(obj)
    return obj


def mask_secrets(obj: Any) -> Any:
    """``obj`` (plain data from :func:`to_dict`) with the password of every URL in it replaced by
    ``***`` (``postgresql://u:***@host/db``), so a config printed or written for people to read
    carries no secret; the structure and every other value are unchanged."""
    if isinstance(obj, dict):
        return {k: mask_secrets(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [mask_secrets(v) for v in obj]
    if isinstance(obj, str):
        return redact(obj)
    return obj


def to_yaml(obj: Any) -> str:
    """A config (dataclass or plain data) as YAML a person reads and :func:`load_yaml` reads
    back: keys in field order, secrets masked (:func:`mask_secrets`)."""
    import yaml

    return yaml.safe_dump(mask_secrets(to_dict(obj)), sort_keys=False, default_flow_style=False)


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``key.sub=value`` command-line overrides merged into a config mapping, with OmegaConf's
    dotlist syntax and YAML value parsing (``optuna.n_trials=12``, ``search_space.gqa=[1,2]``,
    ``params=200K``); the typed config then validates the result like the file itself."""
    if not overrides:
        return data
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for o in overrides:
        key = o.split("=", 1)[0]
        if "=" not in o or not key or key.startswith("-"):
            raise ArchsearchError(o, "is not an override", "write KEY.SUB=VALUE, e.g. optuna.n_trials=12")
    for o in overrides:  # each value parsed alone, so an error names the override it is in
        try:
            OmegaConf.from_dotlist([o])
        except (OmegaConfBaseException, yaml.YAMLError) as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ArchsearchError(o.split("=", 1)[0], f"the value in {o!r} is not valid YAML ({problem})",
                                  "quote it, or close its brackets: e.g. KEY=[1,2] or KEY='text'") from None
    try:
        merged = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_container(merged, resolve=True)
    except TypeError:  # OmegaConf merges a dotted index (gqa.0=4) as a mapping into a list
        raise ArchsearchError(" ".join(overrides), "an override cannot set one item of a list",
                              "give the whole list, e.g. search_space.gqa=[4,2]") from None
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ArchsearchError(" ".join(overrides), f"cannot apply the overrides: {e}".splitlines()[0],
                              "write KEY.SUB=VALUE, e.g. optuna.n_trials=12") from None


def load_yaml(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Parse a YAML file into a mapping (then apply ``key.sub=value`` overrides), with a clear
    error for a missing or broken file; read by :mod:`archsearch.yamlio` (duplicate keys, alias
    expansion, depth and integer size limited)."""
    p = Path(path)
    if not p.is_file():
        raise ArchsearchError("--config", f"no such file {str(p)!r}")
    data = load_yaml_file(p)
    if not isinstance(data, dict):
        raise ArchsearchError(str(p), "the top level must be a mapping of keys to values")
    return apply_overrides(data, overrides)


def load_config(cls: type[T], path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """YAML file (+ ``key.sub=value`` overrides) -> validated dataclass."""
    return from_dict(cls, load_yaml(path, overrides), where="")


def engine_arg_name(key: Any) -> str:
    """The one spelling of an engine or model keyword argument (``TRUST-Remote-Code`` ->
    ``trust_remote_code``), as the engines' own command lines read it: keys are normalised
    before any is checked, so no spelling passes a check another spelling fails."""
    return str(key).strip().lower().replace("-", "_")


def normalised_engine_args(field: str, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with every key in its one spelling (:func:`engine_arg_name`); two spellings of one
    key, or ``trust_remote_code`` set to anything but false (archsearch runs no remote model code:
    the shapes it builds and measures are families transformers ships), are errors naming
    ``field``."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        name = engine_arg_name(key)
        if name in out:
            raise ArchsearchError(f"{field}.{name}", "given twice (in two spellings)", "give it once")
        out[name] = value
    trc = out.get("trust_remote_code")
    if trc is not None and str(trc).strip().lower() not in ("false", "0", "no", "off"):
        raise ArchsearchError(f"{field}.trust_remote_code", f"{trc!r}: archsearch runs no remote model code "
                              "(the shapes it measures are configs of families transformers ships)",
                              "drop trust_remote_code from the arguments")
    return out


def field_defaults(cls: type) -> dict[str, Any]:
    """Each field's default value (a fresh one for ``default_factory`` fields), so that a CLI
    built on a settings type states its defaults once, in the type."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out

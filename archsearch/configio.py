"""Plain-data configs: dict/YAML <-> typed dataclasses, with errors that name the field.

Every config of the project (architecture, training run, benchmark run, study) is a
dataclass. :func:`from_dict` builds one from parsed YAML/JSON, checking unknown keys, types
and nested dataclasses, and raises :class:`ArchsearchError` naming the dotted path of the bad
field (``study.search.gqa_choices[2]``). The dataclass's own ``__post_init__`` then checks
values. Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, Union, get_args, get_origin

from archsearch.errors import ArchsearchError, redact  # redact: re-exported, what configs are masked with
from archsearch.fileio import read_text

T = TypeVar("T")


_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def number_from_text(text: str) -> float:
    """'1e9', '1B', '150M', '300k', '2_000' -> float; ValueError otherwise (the CLI's and the
    YAML files' one number syntax)."""
    t = text.strip().replace("_", "")
    mult = _SUFFIXES.get(t[-1:].lower())
    return float(t[:-1]) * mult if mult else float(t)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        alts = [a for a in args if a is not type(None)]
        sections = [a for a in alts if dataclasses.is_dataclass(a)]
        # an optional setting, or a mapping for a union with one section type, is that type: its
        # own error names the field, where "does not fit X | None" would not
        if len(alts) == 1 or (isinstance(value, dict) and len(sections) == 1):
            return _convert(value, alts[0] if len(alts) == 1 else sections[0], where)
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where)
            except ArchsearchError as e:
                errors.append(e.problem)
        raise ArchsearchError(where, f"{value!r} does not fit {_type_name(tp)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ArchsearchError(where, f"{value!r} is not allowed", f"use one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ArchsearchError(where, f"expected a mapping, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ArchsearchError(where, f"expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ArchsearchError(where, f"expected {len(args)} items, got {len(value)}")
            return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        out = [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ArchsearchError(where, f"expected a mapping, got {value!r}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(k, kt, where): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ArchsearchError(where, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ArchsearchError(where, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = number_from_text(value)  # "1e9" / "200K" in YAML, which PyYAML reads as strings
            except ValueError:
                pass
            else:
                if f.is_integer():
                    return int(f)
        raise ArchsearchError(where, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ArchsearchError(where, f"expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = number_from_text(value)
            except ValueError:
                pass
        if number is None:
            raise ArchsearchError(where, f"expected a number, got {value!r}")
        if not math.isfinite(number):  # no config field means anything at NaN or infinity
            raise ArchsearchError(where, f"must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ArchsearchError(where, f"expected a string, got {value!r}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ArchsearchError(where, f"expected {tp.__name__}, got {value!r}")
    return value


def inline(default_factory: Any, key: bool = False) -> Any:
    """A component config held as a field whose own fields are written in the enclosing block.

    The rule, for a field ``fit: FitOptions = inline(...)`` of ``LawConfig``: the YAML/JSON form
    of the block is flat, ``law: {bootstrap: 200, form: ...}``, and ``law.bootstrap`` is
    ``law.fit.bootstrap``. A name the enclosing class declares itself is the enclosing class's
    (``law.seed`` is ``LawConfig.seed``). A key left out keeps the value of the field's default
    (``default_factory()``: the enclosing config's defaults, which may differ from the component
    class's own). :func:`from_dict` reads this form, :func:`to_dict` writes it, and an error in the
    component names the flat path (``law.bootstrap``). ``key``: the component's marked fields key
    a stored result (:func:`key_values`).
    """
    return dataclasses.field(default_factory=default_factory, metadata={"inline": True, "key": key})


KEY = {"key": True}  # field metadata: the field keys a stored result (key_values)


def key_values(obj: Any) -> dict[str, Any]:
    """The fields of config ``obj`` marked ``metadata=KEY`` (a component field marked so
    contributes its own marked fields, nested under its name, or flat for an :func:`inline` one),
    as plain data (:func:`to_dict`): what a result stored under this config is keyed by. A field
    that changes no result (a fallback, a retry budget) is left unmarked."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if not f.metadata.get("key"):
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            inner = key_values(value)
            if f.metadata.get("inline"):
                out.update(inner)
            else:
                out[f.name] = inner
        else:
            out[f.name] = to_dict(value)
    return out


def _inlined(cls: type) -> dict[str, tuple[Any, list[str]]]:
    """``cls``'s inline fields: name -> (default, the component's field names written flat)."""
    own = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("inline"):
            default = f.default_factory()
            out[f.name] = (default, [g.name for g in dataclasses.fields(default) if g.init and g.name not in own])
    return out


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, validating keys and types by their hints (an
    :func:`inline` component read from the block's own keys)."""
    if not isinstance(data, dict):
        raise ArchsearchError(where or cls.__name__, f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    inlined = _inlined(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in inlined}
    keys = [*fields, *(n for _, names in inlined.values() for n in names)]
    for key in data:
        if key not in keys:
            close = difflib.get_close_matches(str(key), keys, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(keys)}"
            raise ArchsearchError(f"{where}.{key}" if where else str(key), "unknown key", hint)
    kwargs = {}
    for name, (default, names) in inlined.items():
        given = {n: data[n] for n in names if n in data}
        base = {g.name: getattr(default, g.name) for g in dataclasses.fields(default) if g.init}
        kwargs[name] = from_dict(hints[name], {**base, **given}, where) if given else default
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ArchsearchError(path, "is required")
    try:
        return cls(**kwargs)
    except ArchsearchError as e:
        if where and not e.field.startswith(where):
            raise ArchsearchError(f"{where}.{e.field}", e.problem, e.fix) from None
        raise


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
        out: dict[str, Any] = {}
        own = {f.name for f in dataclasses.fields(obj)}
        for f in dataclasses.fields(obj):
            if f.metadata.get("inline"):  # written flat, in the component's field order
                for k, v in to_dict(getattr(obj, f.name)).items():
                    out[k] = to_dict(getattr(obj, k)) if k in own else v
            elif f.name not in out:
                out[f.name] = to_dict(getattr(obj, f.name))
        return out
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
    if isinstance(obj, str) and "://" in obj:
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
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ArchsearchError(" ".join(overrides), f"cannot apply the overrides: {e}".splitlines()[0],
                              "write KEY.SUB=VALUE, e.g. optuna.n_trials=12") from None


def load_yaml(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Parse a YAML file into a mapping (then apply ``key.sub=value`` overrides), with a clear
    error for a missing or broken file."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ArchsearchError("--config", f"no such file {str(p)!r}")
    try:
        data = yaml.safe_load(read_text(p))
    except yaml.YAMLError as e:
        raise ArchsearchError(str(p), f"invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ArchsearchError(str(p), "the top level must be a mapping of keys to values")
    return apply_overrides(data, overrides)


def load_config(cls: type[T], path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """YAML file (+ ``key.sub=value`` overrides) -> validated dataclass."""
    return from_dict(cls, load_yaml(path, overrides), where="")


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

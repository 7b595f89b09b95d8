"""configio.from_dict reads a mapping as our configs are read: flags only true/false, text only
text, finite numbers also in the 200K/1e9 syntax, whole floats as integers; an error names the
dotted path of the field (an unknown key with the closest name, a section's own check under the
section), and a component block given in part is completed from the field's default; a component's
key written in the enclosing block (the flat form of older versions) is refused with its place."""

from __future__ import annotations

import dataclasses

import pytest

from archsearch.configio import KEY, component, from_dict, key_values, nest_components, to_dict
from archsearch.errors import ArchsearchError


@dataclasses.dataclass
class Part:
    size: int = 1
    scale: float = 1.0
    tags: tuple[str, ...] = ()

    def __post_init__(self):
        if self.size < 1:
            raise ArchsearchError("size", f"must be >= 1, got {self.size}", "give a positive size")


@dataclasses.dataclass
class Whole:
    name: str = "w"
    flag: bool = False
    part: Part = dataclasses.field(default_factory=Part)
    parts: list[Part] = dataclasses.field(default_factory=list)
    extra: Part | None = None
    own: Part = component(lambda: Part(size=7), key=True)
    pinned: float = dataclasses.field(default=0.5, metadata=KEY)


@pytest.mark.parametrize("data,value", [
    ({"part": {"size": "200K"}}, 200_000),
    ({"part": {"size": "1e9"}}, 1_000_000_000),
    ({"part": {"size": 3.0}}, 3),
    ({"part": {"size": "1_500"}}, 1500),
])
def test_an_integer_reads_the_number_syntax_and_whole_floats(data, value):
    got = from_dict(Whole, data).part.size
    assert got == value and type(got) is int


def test_a_float_reads_integers_and_the_number_syntax_as_floats():
    assert [type(from_dict(Part, {"scale": v}).scale) for v in (2, "3k", 2.5)] == [float] * 3
    assert from_dict(Part, {"scale": "3k"}).scale == 3000.0


@pytest.mark.parametrize("data,field", [
    ({"flag": "yes"}, "flag"),
    ({"flag": 1}, "flag"),
    ({"name": 5}, "name"),
    ({"part": {"size": True}}, "part.size"),
    ({"part": {"size": 2.5}}, "part.size"),
    ({"part": {"size": "lots"}}, "part.size"),
    ({"part": {"scale": float("nan")}}, "part.scale"),
    ({"part": {"scale": "inf"}}, "part.scale"),
    ({"part": 3}, "part"),
    ({"parts": [{"size": 2}, {"size": "x"}]}, "parts[1].size"),
    ({"part": {"tags": ["a", 2]}}, "part.tags[1]"),
    ({"extra": {"scale": []}}, "extra.scale"),
    ({"size": "x"}, "size"),  # the component's field, written flat: refused
    ({"own": {"size": "x"}}, "own.size"),
])
def test_a_bad_value_is_named_by_its_path(data, field):
    with pytest.raises(ArchsearchError) as e:
        from_dict(Whole, data, "")
    assert e.value.field == field


def test_a_sections_own_check_is_named_under_the_section():
    for data, field in (({"parts": [{}, {"size": 0}]}, "w.parts[1].size"), ({"own": {"size": 0}}, "w.own.size"),
                        ({"extra": {"size": -1}}, "w.extra.size")):
        with pytest.raises(ArchsearchError) as e:
            from_dict(Whole, data, "w")
        assert e.value.field == field and e.value.fix == "give a positive size"


def test_an_unknown_key_names_the_closest_field():
    for data, field, fix in (({"part": {"sise": 2}}, "w.part.sise", "did you mean 'size'?"),
                             ({"scal": 2}, "w.scal", "did you mean 'w.own.scale'?"),  # a component's
                             ({"owm": {"size": 2}}, "w.owm", "did you mean 'own'?"),
                             ({"nmae": 2}, "w.nmae", "did you mean 'name'?")):
        with pytest.raises(ArchsearchError) as e:
            from_dict(Whole, data, "w")
        assert (e.value.field, e.value.problem, e.value.fix) == (field, "unknown key", fix)


def test_a_component_block_given_in_part_keeps_the_fields_default():
    w = from_dict(Whole, {"own": {"scale": 2}, "name": "n"})
    assert (w.own, w.name) == (Part(size=7, scale=2.0), "n")  # size: the field's default, not Part's
    assert to_dict(w)["own"] == {"size": 7, "scale": 2.0, "tags": []}
    assert from_dict(Whole, to_dict(w)) == w
    assert key_values(w) == {"pinned": 0.5}  # Part marks no field as keying
    a, b = from_dict(Whole, {}), from_dict(Whole, {})
    assert a.own == b.own and a.own is not b.own  # each load its own default


def test_a_given_section_instance_is_kept():
    p = Part(size=4)
    assert from_dict(Whole, {"part": p}).part is p


@pytest.mark.parametrize("url, shown", [
    ("postgresql://u:hunter2@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u@h/db?password=hunter2", "postgresql://u@h/db?password=***"),
    ("mysql://u:hunter2@h/db?sslmode=require&sslpassword=hunter2&x=1",
     "mysql://u:***@h/db?sslmode=require&sslpassword=***&x=1"),
    ("redis://h:6379/0?Token=hunter2#frag", "redis://h:6379/0?Token=***#frag"),
    ("sqlite:///runs/optuna.db", "sqlite:///runs/optuna.db"),
    ("lr=3e-3", "lr=3e-3"),
])
def test_one_secret_mask_for_every_form_of_url(url, shown):
    """The password of user:password@ and a secret query parameter are masked by the one mask
    that errors, printed configs and stored configs go through."""
    from archsearch.configio import to_yaml
    from archsearch.errors import redact

    assert redact(url) == shown
    assert "hunter2" not in str(ArchsearchError("optuna.storage", f"cannot open {url}"))
    assert "hunter2" not in to_yaml({"optuna": {"storage": url}})


def test_yaml_is_read_within_limits(tmp_path):
    """A duplicate key (nested too), an alias bomb, deep nesting and a huge integer: one error naming
    the file and line, fast."""
    from archsearch.yamlio import load_yaml_file

    cases = {"dup": ("a:\n  b: 1\n  b: 2\n", "line 3"),
             "bomb": ("".join(f"{a}: &{a} [" + ",".join([f"*{b}" if b else "x"] * 9) + "]\n"
                              for b, a in zip(["", *"abcdefgh"], "abcdefghi")), "aliases"),
             "deep": ("a: " + "[" * 200 + "]" * 200 + "\n", "nested"),
             "int": ("a: " + "9" * 5000 + "\n", "digits")}
    for name, (text, fragment) in cases.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        with pytest.raises(ArchsearchError, match=fragment) as e:
            load_yaml_file(tmp_path / f"{name}.yaml")
        assert f"{name}.yaml" in e.value.field
    (tmp_path / "ok.yaml").write_text("base: &b {x: 1}\nuse: *b\nmerged: {<<: *b, y: 2}\n")
    assert load_yaml_file(tmp_path / "ok.yaml") == {"base": {"x": 1}, "use": {"x": 1}, "merged": {"x": 1, "y": 2}}


def test_a_flat_key_is_named_with_its_nested_place_and_nest_components_moves_it():
    with pytest.raises(ArchsearchError) as e:
        from_dict(Whole, {"scale": 2}, "w")
    assert e.value.field == "w.scale" and "w.own.scale" in e.value.fix and "archsearch migrate" in e.value.fix
    data, moved = nest_components(Whole, {"scale": 2, "name": "n", "own": {"size": 3}, "part": {"size": 2}})
    assert data == {"name": "n", "own": {"scale": 2, "size": 3}, "part": {"size": 2}} and moved == ["own.scale"]
    assert from_dict(Whole, data).own == Part(size=3, scale=2.0)
    assert nest_components(Whole, data) == (data, [])  # nested already: unchanged

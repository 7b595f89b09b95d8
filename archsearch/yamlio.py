"""The one YAML reader of the project: PyYAML's safe loader with limits.

A config file is plain data a person writes, so whatever it holds is read to a bounded size, or
refused with one error naming the file and line (:class:`ArchsearchError`):

- a key given twice in one mapping (``params:`` twice, at any depth), which plain YAML accepts
  with the last one silently winning;
- more than :data:`MAX_NODES` values once aliases are expanded (a "billion laughs" file, a few
  lines whose aliases expand to billions of values, would hang whatever walks the data);
- nesting deeper than :data:`MAX_DEPTH` (a config is a few levels deep; 1,000 levels exhaust
  Python's recursion);
- an integer of more than :data:`MAX_INT_DIGITS` digits (no count or size of the project has
  more; Python refuses to convert 4,300 and more).

Importing this module imports PyYAML only when a file is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from archsearch.errors import ArchsearchError
from archsearch.fileio import read_text

MAX_DEPTH = 64  # mappings and lists inside one another
MAX_NODES = 100_000  # values, aliases expanded (the largest shipped config holds a few hundred)
MAX_INT_DIGITS = 30  # 10**30 is beyond every count, size and budget the project accepts


def _loader(where: str) -> Any:
    """A SafeLoader class whose composer and constructor enforce the limits, errors naming
    ``where``."""
    import yaml

    def at(node_or_mark: Any) -> str:
        mark = getattr(node_or_mark, "start_mark", node_or_mark)
        return f"{where} line {mark.line + 1}" if mark is not None else where

    class Loader(yaml.SafeLoader):
        _depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self._depth += 1
            try:
                if self._depth > MAX_DEPTH:
                    raise ArchsearchError(at(self.peek_event().start_mark),
                                          f"nested more than {MAX_DEPTH} levels deep",
                                          "a config is a few levels of mappings and lists")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (list, dict)):
                    raise ArchsearchError(at(key_node), "a key is a list or a mapping", "keys are names")
                if key in seen:
                    raise ArchsearchError(at(key_node), f"the key {key!r} is given twice in one mapping "
                                          f"(first at line {seen[key]})",
                                          "keep one: YAML would silently use the last one")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node: Any) -> Any:
            digits = sum(c.isdigit() for c in str(node.value))
            if digits > MAX_INT_DIGITS:
                raise ArchsearchError(at(node), f"an integer of {digits} digits",
                                      f"no setting takes more than {MAX_INT_DIGITS} digits; write e.g. 1e9")
            return super().construct_yaml_int(node)

    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    return Loader


def _expanded_size(node: Any, where: str) -> int:
    """How many values ``node`` holds once every alias is expanded, counted without expanding
    (a shared node is counted once per use by memo); a node that holds itself is refused."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(n: Any) -> int:
        if id(n) in memo:
            return memo[id(n)]
        if id(n) in active:
            raise ArchsearchError(f"{where} line {n.start_mark.line + 1}", "an alias refers to the value "
                                  "that holds it", "remove the recursive alias")
        active.add(id(n))
        total = 1
        if isinstance(n.value, list):
            for item in n.value:
                for child in (item if isinstance(item, tuple) else (item,)):
                    total += size(child)
                    if total > MAX_NODES:
                        break
        active.discard(id(n))
        memo[id(n)] = min(total, MAX_NODES + 1)
        return memo[id(n)]

    return size(node)


def load_yaml_text(text: str, where: str) -> Any:
    """Parse YAML ``text`` (from ``where``, named in errors) within the limits of this module."""
    import yaml

    loader = _loader(where)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, where) > MAX_NODES:
            raise ArchsearchError(where, f"holds more than {MAX_NODES:,} values (its aliases, *name, counted as "
                                  "expanded)", "a config is small (the largest shipped one holds a few hundred "
                                  "values): give fewer values, or use fewer aliases")
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ArchsearchError(where, f"invalid YAML: {e}".replace("\n", " ")) from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path) -> Any:
    """A YAML file (UTF-8 text, :func:`read_text`) parsed within the limits of this module."""
    return load_yaml_text(read_text(path), str(path))

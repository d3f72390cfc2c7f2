"""YAML as recipes and ``--set`` values are read: PyYAML's safe loader, with what a recipe never needs refused.

A recipe is a flat mapping of config keys to scalars, so the loader refuses, at parse time and with the line:

- an alias (``*name``): a few hundred bytes of nested aliases expand to billions of items (a "billion laughs"
  bomb), which validation or an error message would then walk; a recipe writes its values out instead;
- nesting deeper than :data:`MAX_DEPTH` (a thousand ``[`` would otherwise end in a ``RecursionError``);
- a value longer than :data:`MAX_SCALAR_CHARS` (no key takes more: the longest are paths) and a file larger than
  :data:`MAX_RECIPE_BYTES`;
- a key given twice in one mapping (PyYAML keeps the last one silently; a recipe that sets ``learning_rate``
  twice is a mistake whichever was meant).

Every failure is a ``ValueError`` naming the source, never a ``yaml`` exception, a ``RecursionError`` or a
``MemoryError``. Standard library + PyYAML only.
"""
from __future__ import annotations

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

from fastprompt.messages import shown

#: The largest recipe file read (the papers' recipes are under 2 KB).
MAX_RECIPE_BYTES = 1 << 20
#: The longest value (PATH_MAX on Linux: no config value is longer than a path).
MAX_SCALAR_CHARS = 4096
#: The deepest nesting of lists and mappings (a recipe is a mapping of scalars: depth 1).
MAX_DEPTH = 16


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases, deep nesting, huge values and duplicate keys."""

    _depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise ComposerError(None, None, f"an alias (*{shown(event.anchor)[1:-1]}) is not allowed in a "
                                "fastprompt config: write the value out", event.start_mark)
        if isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_SCALAR_CHARS:
            raise ComposerError(None, None, f"a value of {len(event.value)} characters; a config value has at most "
                                f"{MAX_SCALAR_CHARS}", event.start_mark)
        if self._depth >= MAX_DEPTH:
            raise ComposerError(None, None, f"lists or mappings nested more than {MAX_DEPTH} deep; a fastprompt "
                                "config is a mapping of key: value", event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                continue
            if first is not key_node:
                raise ConstructorError(None, None, f"the key {shown(key)} is given twice (first on line "
                                       f"{first.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _one_line(exc: yaml.YAMLError) -> str:
    """PyYAML's error without its multi-line snippet: 'line 3, column 1: the key 'seed' is given twice ...'."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if problem is None:  # a ReaderError (a character YAML does not allow): its own text, on one line
        text = " ".join(str(exc).split())
    else:
        context = getattr(exc, "context", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        text = where + (f"{context}: " if context else "") + problem
    return text if len(text) <= 300 else text[:297] + "..."  # a problem may quote a (long) tag or key


def load_yaml(text: str, source: str):
    """The YAML document in ``text`` (a recipe, or one ``--set`` value), loaded by :class:`RecipeLoader`;
    ValueError ``"<source> is not valid YAML: ..."`` on any failure."""
    try:
        return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 (RecipeLoader is a SafeLoader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source} is not valid YAML: {_one_line(exc)}") from None
    except (ValueError, OverflowError) as exc:  # a timestamp like 2024-13-45 reaches datetime's own check
        raise ValueError(f"{source} is not valid YAML: {shown(str(exc))[1:-1]}") from None
    except RecursionError:
        raise ValueError(f"{source} is not valid YAML: nested too deeply") from None

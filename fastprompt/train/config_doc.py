"""The configuration reference, generated from the help texts of TrainConfig's sections.

``python -m fastprompt.train.config_doc > docs/config.md`` writes the Markdown reference (a test fails when
the committed file is stale); ``fastprompt train --help-config`` prints the same keys as a terminal table.
"""
from __future__ import annotations

import dataclasses
import typing

from fastprompt.fields import describe_rule, flat_key, type_name
from fastprompt.train.config import SECTIONS

_HEADER = """\
# Training configuration reference

Generated from the dataclasses of `fastprompt.train.config` by
`python -m fastprompt.train.config_doc > docs/config.md`; do not edit by hand.

Every key is flat: write it as is in a YAML recipe (`learning_rate: 5e-3`) or on the command line
(`fastprompt train --config recipe.yaml --set learning_rate=5e-3`; values are parsed as YAML, so `null`,
`true` and `1e-3` work). In Python, `TrainConfig(learning_rate=5e-3)` takes the same keys and
`config.optim.learning_rate` (or `config.learning_rate`) reads them. A recipe may begin with
`base: other.yaml` (a path relative to the recipe) to extend another recipe: the base's keys first, the
recipe's own on top; bases may chain, and a cycle is an error. `fastprompt train --help-config` prints this
table in the terminal.

The `identity` column marks the run-identity keys: a run does not resume a checkpoint (`last/`) written with
another value of one of them (it would mix two runs); the other keys may change between an interrupt and a
resume, with a warning ([training.md](training.md#checkpoints-and-resume)).
"""


def _rows(cls) -> list[tuple[str, str, str, str, str, bool]]:
    """(key, type, default, allowed values, help, run identity) of every field of a section dataclass."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((flat_key(f), type_name(hints[f.name]), yaml_scalar(default), describe_rule(f), f.metadata["help"],
                     bool(f.metadata["identity"])))
    return rows


def yaml_scalar(value) -> str:
    """A config value as a YAML recipe writes it (``null``, ``true``, ``0.05``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _doc_line(cls) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0]


def config_reference_markdown() -> str:
    out = [_HEADER]
    for attr, (cls, title) in SECTIONS.items():
        out.append(f"\n## {title}\n\n{_doc_line(cls)} In Python: `config.{attr}`, a "
                   f"`{cls.__module__}.{cls.__name__}`.\n")
        out.append("| key | type | default | allowed | identity | description |")
        out.append("|---|---|---|---|---|---|")
        for key, tp, default, rule, help_text, identity in _rows(cls):
            cells = [f"`{key}`", tp, f"`{default}`", rule, "yes" if identity else "", help_text]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"


def config_reference_text() -> str:
    """The keys grouped by section, one line each: key, type, default, help (and the allowed values)."""
    sections = [(title, _doc_line(cls), _rows(cls)) for cls, title in SECTIONS.values()]
    width = max(len(r[0]) for _, _, rows in sections for r in rows)
    out = []
    for title, doc, rows in sections:
        out.append(f"{title}: {doc}")
        for key, tp, default, rule, help_text, identity in rows:
            allowed = f" ({rule})" if rule else ""
            key = key + ("*" if identity else "")
            out.append(f"  {key:<{width + 1}} {tp:<12}  {default:<19}  {help_text}{allowed}")
        out.append("")
    out.append("* run identity: a run does not resume a checkpoint written with another value")
    return "\n".join(out) + "\n"


def main() -> None:
    print(config_reference_markdown(), end="")


if __name__ == "__main__":
    main()

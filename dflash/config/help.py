"""``--help`` of every app: each field of its config with its type, default and documentation.

The documentation of a field is the string that follows it in its dataclass (the convention of
``dflash/config/schema.py``), read from the source with ``ast`` since Python keeps no such string at
run time. Groups (a nested dataclass) print as a heading with their own fields.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from omegaconf import MISSING


@dataclass(frozen=True)
class FieldDoc:
    key: str
    """Dotted name (``train.max_steps``)."""
    type: str
    default: str
    doc: str
    group: bool
    """A nested config (its fields follow)."""


@cache
def _docstrings(cls: type) -> dict[str, str]:
    """field name -> the string literal right after it in ``cls``'s body ('' when there is none)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = ""
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                text = inspect.cleandoc(after.value.value)
            docs[node.target.id] = text
    return docs


def _type_name(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
    return text or str(hint).replace("typing.", "")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return "???" if f.default == MISSING else repr(getattr(f.default, "value", f.default))
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "" if dataclasses.is_dataclass(value) else repr(value)
    return "???"


def field_docs(schema: type, prefix: str = "") -> list[FieldDoc]:
    """Every field of ``schema`` and of its nested configs, in declaration order."""
    out: list[FieldDoc] = []
    hints = typing.get_type_hints(schema)
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):  # a field's documentation is where the field is declared
        if dataclasses.is_dataclass(cls):
            docs.update({k: v for k, v in _docstrings(cls).items() if v or k not in docs})
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        nested = [
            t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and dataclasses.is_dataclass(t)
        ]
        key = f"{prefix}{f.name}"
        doc = docs.get(f.name, "")
        if nested:
            own = nested[0].__doc__ or ""
            if own.startswith(f"{nested[0].__name__}("):  # the signature dataclass writes when there is none
                own = ""
            out.append(FieldDoc(key, nested[0].__name__, "", doc or inspect.cleandoc(own), True))
            out += field_docs(nested[0], f"{key}.")
        else:
            out.append(FieldDoc(key, _type_name(hint), _default(f), doc, False))
    return out


def render_help(schema: type, app: str) -> str:
    """The ``--help`` text of ``python -m <app>`` whose config is ``schema``."""
    lines = [
        f"python -m {app} [key=value ...] [group=option ...]",
        "",
        "Every field of the config: its type, default and meaning. Overrides are Hydra's (key=value changes,",
        "group=option switches a group of conf/, +key=value adds). `--cfg job` prints the composed config;",
        "`--hydra-help` is Hydra's own help.",
    ]
    for d in field_docs(schema):
        if d.group:
            lines += ["", f"{d.key}:" + (f"  {d.doc.splitlines()[0]}" if d.doc else "")]
            continue
        lines.append(f"  {d.key}: {d.type} = {d.default}")
        for para in d.doc.splitlines():
            lines.append(
                textwrap.fill(para, 110, initial_indent="      ", subsequent_indent="      ") if para else ""
            )
    return "\n".join(lines) + "\n"

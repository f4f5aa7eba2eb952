"""The RLJob field reference, generated from the pydantic models: ``docs/rljob-reference.md`` and
``stoker explain FIELD.PATH``.

Every field of ``RLJob`` with its YAML path (camelCase, as manifests spell it), type, default,
bounds and description. A test keeps the committed file equal to ``render_reference()``; after a
spec change run ``stoker explain --write``.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from stoker.spec import RLJob

REFERENCE_PATH = Path(__file__).resolve().parent.parent / "docs" / "rljob-reference.md"


@dataclass(frozen=True)
class FieldDoc:
    path: str  # e.g. spec.actors.sampling.topP; "[]" marks a list's items
    type: str
    default: str
    bounds: str
    description: str


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, tuple, set):
        return f"list[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return f"map[{_type_name(args[0])}, {_type_name(args[1])}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _constraints(metadata: list[Any]) -> list[str]:
    out = []
    for item in metadata:
        for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(item, attr, None)
            if isinstance(item, annotated_types.Ge | annotated_types.Gt | annotated_types.Le | annotated_types.Lt) and value is not None:
                out.append(f"{symbol} {value}")
        if isinstance(item, annotated_types.MinLen):
            out.append(f"min length {item.min_length}")
        if isinstance(item, annotated_types.MaxLen):
            out.append(f"max length {item.max_length}")
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            out.append(f"pattern `{pattern}`")
    return out


def _inner_constraints(annotation: Any, item: bool = False) -> list[str]:
    """Bounds written inside the type, e.g. ``Annotated[str, Field(pattern=...)] | None``; those of
    a list's items say so."""
    out: list[str] = []
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        for extra in typing.get_args(annotation)[1:]:
            found = _constraints(list(getattr(extra, "metadata", [])) + [extra])
            out += [f"each item {c}" for c in found] if item else found
        return out + _inner_constraints(typing.get_args(annotation)[0], item)
    for arg in typing.get_args(annotation):
        out += _inner_constraints(arg, item or origin in (list, tuple, set))
    return out


def _shown(value: Any) -> str:
    try:
        return f"`{json.dumps(value)}`"
    except TypeError:
        return f"`{value!r}`"


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        try:
            value = info.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(see fields)"
        return _shown(value)
    if info.default is PydanticUndefined:
        return "required"
    if isinstance(info.default, BaseModel):
        return "(see fields)"
    return _shown(info.default)


def _docstring(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    if doc.startswith(("A base class for creating Pydantic models", "Usage docs:")):
        return ""
    return " ".join(doc.split())


def walk(model: type[BaseModel], prefix: str = "") -> list[FieldDoc]:
    """Every field under ``model``, depth first, in declaration order."""
    out: list[FieldDoc] = []
    for name, info in model.model_fields.items():
        alias = info.alias or name
        path = f"{prefix}.{alias}" if prefix else alias
        annotation = info.annotation
        bounds = list(dict.fromkeys(_constraints(list(info.metadata)) + _inner_constraints(annotation)))
        description = info.description or ""
        nested = _models_in(annotation)
        if not description and nested:
            description = _docstring(nested[0])
        out.append(FieldDoc(path, _type_name(annotation), _default(info), ", ".join(bounds), description))
        for inner in nested:
            if inner is model:
                continue
            list_like = typing.get_origin(annotation) is list or any(
                typing.get_origin(a) is list for a in typing.get_args(annotation)
            )
            out += walk(inner, f"{path}[]" if list_like else path)
    return out


def all_fields() -> list[FieldDoc]:
    return walk(RLJob)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_reference() -> str:
    fields = all_fields()
    lines = [
        "# RLJob field reference",
        "",
        "Generated from the spec's pydantic models (`stoker/spec*.py`) by `stoker explain --write`;",
        "a test fails when it is stale. `stoker explain spec.actors.sampling` prints one field or section.",
        "Paths are as a manifest spells them; `[]` marks the items of a list.",
        "",
    ]
    sections: dict[str, list[FieldDoc]] = {}
    for field in fields:
        parts = field.path.split(".")
        section = ".".join(parts[:2]) if parts[0] == "spec" and len(parts) > 2 else parts[0]
        sections.setdefault(section, []).append(field)
    for section, entries in sections.items():
        lines += [f"## `{section}`", "", "| Field | Type | Default | Bounds | Description |", "|---|---|---|---|---|"]
        lines += [
            f"| `{f.path}` | {_cell(f.type)} | {_cell(f.default)} | {_cell(f.bounds)} | {_cell(f.description)} |"
            for f in entries
        ]
        lines.append("")
    return "\n".join(lines)


def explain(path: str) -> list[FieldDoc]:
    """The field at ``path`` and every field under it (``spec.`` may be left out; case-insensitive)."""
    wanted = path.strip().rstrip(".").replace("[]", "").lower()
    fields = all_fields()
    for candidate in (wanted, f"spec.{wanted}"):
        found = [
            f for f in fields
            if (plain := f.path.replace("[]", "").lower()) == candidate or plain.startswith(candidate + ".")
        ]
        if found:
            return found
    # A unique tail: ``sampling.topP`` for spec.actors.sampling.topP.
    roots = {f.path for f in fields if f.path.replace("[]", "").lower().endswith("." + wanted)}
    if len(roots) == 1:
        return explain(roots.pop())
    return []


def format_field(field: FieldDoc) -> str:
    lines = [f"{field.path}  <{field.type}>", f"  default: {field.default.strip('`')}"]
    if field.bounds:
        lines.append(f"  bounds: {field.bounds}")
    if field.description:
        lines.append(f"  {field.description}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ stoker explain


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("field", nargs="?", metavar="FIELD.PATH", help="e.g. spec.actors.sampling.topP (or a section)")
    parser.add_argument(
        "--write", nargs="?", const=str(REFERENCE_PATH), metavar="PATH",
        help=f"write the whole reference as Markdown to PATH (default: {REFERENCE_PATH})",
    )


def main(args: argparse.Namespace) -> int:
    if args.write:
        Path(args.write).write_text(render_reference())
        print(f"wrote {args.write}", file=sys.stderr)
        return 0
    if not args.field:
        sys.stdout.write(render_reference())
        return 0
    found = explain(args.field)
    if not found:
        near = sorted({f.path for f in all_fields() if args.field.split(".")[-1].lower() in f.path.lower()})[:5]
        hint = f"; did you mean {', '.join(near)}?" if near else "; `stoker explain` lists every field"
        print(f"stoker explain: no field {args.field!r} in the RLJob{hint}", file=sys.stderr)
        return 2
    print("\n\n".join(format_field(f) for f in found))
    return 0

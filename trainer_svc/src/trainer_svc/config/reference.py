"""The config reference, read from the code: each field's description is the `msgspec.Meta(description=...)`
on its type, each section's the docstring of its Struct. docs/config.md is written from here
(`python -m trainer_svc.config.reference docs/config.md`) and `trainer-svc config` prints it beside a
config's values; a test fails when docs/config.md is out of date."""

from __future__ import annotations

import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from .root import Config

REGENERATE = "python -m trainer_svc.config.reference docs/config.md"

# A word holding a placeholder such as <run.dir>/spool, which Markdown would read as an HTML tag
# and drop; trailing punctuation stays outside. Code spans (`...`) are matched first and kept.
_PLACEHOLDER_OR_CODE = re.compile(r"(`[^`]*`)|([^\s`(]*<[\w.-]+>[^\s`]*?)(?=[.,;:)]?(?:\s|$))")


def code_placeholders(text: str) -> str:
    """`text` with each word that holds a <placeholder> set as code, so Markdown shows it."""
    return _PLACEHOLDER_OR_CODE.sub(lambda m: m.group(1) or f"`{m.group(2)}`", text)


@dataclass(frozen=True)
class FieldDoc:
    section: str  # the TOML table, e.g. "train"
    name: str  # the key as written in TOML (env's "class")
    attr: str  # the Struct attribute holding it (env's "class_")
    type: str  # as a reader of the TOML would put it, e.g. "int >= 1"
    default: str  # TOML text of the default; "required" where there is none
    description: str


def sections() -> Iterator[tuple[str, type[msgspec.Struct], bool]]:
    """(table name, its Struct, whether the whole table may be left out and stay unset) in Config's order."""
    for info in msgspec.structs.fields(Config):
        struct, optional = _strip_optional(info.type)
        yield info.encode_name, struct, optional and info.default is None


def section_doc(struct: type[msgspec.Struct]) -> str:
    return inspect.cleandoc(struct.__doc__ or "")


def fields() -> Iterator[FieldDoc]:
    """Every field of every section, in the order the code defines them."""
    for section, struct, _ in sections():
        hints = typing.get_type_hints(struct, include_extras=True)
        for info in msgspec.structs.fields(struct):
            hint = hints[info.name]
            yield FieldDoc(
                section=section,
                name=info.encode_name,
                attr=info.name,
                type=type_name(hint),
                default=default_text(info),
                description=" ".join(meta.description for meta in _metas(hint) if meta.description),
            )


def _metas(hint) -> list[msgspec.Meta]:
    if typing.get_origin(hint) is typing.Annotated:
        return [m for m in hint.__metadata__ if isinstance(m, msgspec.Meta)]
    return []


def _strip_optional(hint):
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def type_name(hint) -> str:
    """A field's type as TOML sees it: "int >= 1", "float > 0 <= 1", "one of "auto", "on", "off"", "list of str"."""
    bounds = []
    for meta in _metas(hint):
        limits = ((">=", meta.ge), (">", meta.gt), ("<=", meta.le), ("<", meta.lt))
        # :g, because typing caches Annotated[float, Meta(gt=0)] and Meta(gt=0.0) as one (they are
        # equal), so which of 0 and 0.0 a bound holds depends on what was imported first.
        bounds += [f"{op} {value:g}" for op, value in limits if value is not None]
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    inner, optional = _strip_optional(hint)
    if optional:
        return f"{type_name(inner)}, or unset"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        name = "one of " + ", ".join(json.dumps(a) for a in args)
    elif origin is list:
        name = f"list of {type_name(args[0])}"
    elif origin is tuple:
        name = "[" + ", ".join(type_name(a) for a in args) + "]"
    else:
        name = {str: "string", int: "int", float: "float", bool: "bool"}.get(hint, getattr(hint, "__name__", str(hint)))
    return " ".join([name, *bounds]) if bounds else name


def default_text(info: msgspec.structs.FieldInfo) -> str:
    if info.required:
        return "required"
    value = info.default_factory() if info.default is msgspec.NODEFAULT else info.default
    return value_text(value)


def value_text(value) -> str:
    """A value as it would be written in TOML; None (a key left out) as "unset"."""
    if value is None:
        return "unset"
    return json.dumps(msgspec.to_builtins(value), ensure_ascii=False)


def markdown() -> str:
    lines = [
        "# Config reference",
        "",
        "Every key of a run config (TOML), its type, default and meaning. Generated from the field",
        "descriptions in `trainer_svc/src/trainer_svc/config/`; regenerate with",
        f"`{REGENERATE}` (a test fails while it is out of date).",
        "`trainer-svc config CONFIG.toml` prints a config's resolved values beside the same descriptions.",
    ]
    by_section: dict[str, list[FieldDoc]] = {}
    for doc in fields():
        by_section.setdefault(doc.section, []).append(doc)
    for section, struct, optional in sections():
        lines += ["", f"## [{section}]", ""]
        text = code_placeholders(section_doc(struct))
        if optional:
            text += ("\n\n" if text else "") + "Optional: left out, the section is unset."
        if text:
            lines += [text, ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for doc in by_section[section]:
            cells = [f"`{doc.name}`", doc.type, f"`{doc.default}`", code_placeholders(doc.description)]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def resolved(config) -> str:
    """A loaded config as `trainer-svc config` prints it: per section, each key's value, then its
    default and description; a section left out reads as unset."""
    lines: list[str] = []
    docs = list(fields())
    for section, _, _ in sections():
        values = getattr(config, section)
        lines += ["", f"[{section}]" + ("  # unset" if values is None else "")]
        for doc in (d for d in docs if d.section == section):
            value = "unset" if values is None else value_text(getattr(values, doc.attr))
            lines += [f"{doc.name} = {value}", f"    default {doc.default}; {doc.description}"]
    return "\n".join(lines).lstrip("\n") + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(f"usage: {REGENERATE}")
    Path(argv[0]).write_text(markdown(), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])

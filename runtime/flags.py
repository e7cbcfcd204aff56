"""Command-line flags derived from a pydantic settings model: one declaration per setting (type,
bounds, choices, default, help) serves the model, its flags and its environment variables.

A field becomes `--field-name` (`json_schema_extra={"flag": ...}` renames it). A boolean that
defaults to True becomes a `--no-…` switch, one that defaults to False a plain switch; with
`json_schema_extra={"negatable": True}` it takes both `--field-name` and `--no-field-name` (a
default that changed, whose old switch scripts still pass). A
`Literal` gives the flag its choices; `json_schema_extra={"lowercase": True}` folds the value to
lower case first.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def add_flags(
    group: argparse._ActionsContainer,
    model: type[BaseModel],
    names: typing.Iterable[str] | None = None,
    *,
    defaults: bool = True,
) -> None:
    """Add a flag per field of `model` (or of `names`). `defaults=False`: an absent flag leaves
    its destination unset, so that environment variables and model defaults apply."""
    wanted = set(model.model_fields if names is None else names)
    for name, info in model.model_fields.items():
        if name in wanted:
            add_flag(group, name, info, defaults)


def add_flag(group, name: str, info: FieldInfo, defaults: bool) -> None:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    options: dict[str, Any] = {"dest": name, "help": info.description}
    if defaults:
        options["default"] = info.get_default(call_default_factory=True)
    else:
        options["default"] = argparse.SUPPRESS
    kind = unwrap_optional(info.annotation)
    if kind is bool and extra.get("negatable"):
        group.add_argument("--" + kebab(name), action=argparse.BooleanOptionalAction, **options)
        return
    if kind is bool:
        switch_off = info.default is True
        flag = extra.get("flag") or ("--no-" if switch_off else "--") + kebab(name)
        if switch_off and info.description:
            options["help"] = f"off: {info.description}"
        group.add_argument(flag, action="store_false" if switch_off else "store_true", **options)
        return
    choices = literal_choices(kind)
    if choices is not None:
        options["choices"] = choices
        kind = type(choices[0])
    if extra.get("lowercase"):
        kind = str.lower
    elif typing.get_origin(kind) in (list, dict):
        kind = str  # one value per flag word (nargs) or a comma-separated list, split by the model
    if "nargs" in extra:
        options["nargs"] = extra["nargs"]
    options["type"] = kind
    if "metavar" in extra:
        options["metavar"] = extra["metavar"]
    group.add_argument(extra.get("flag") or "--" + kebab(name), **options)


def unwrap_optional(annotation: Any) -> Any:
    """`X | None` -> X (one level of `Annotated` removed too)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return unwrap_optional(members[0])
    return annotation


def literal_choices(annotation: Any) -> list[Any] | None:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return None


def kebab(name: str) -> str:
    return name.replace("_", "-")


def model_values(model: type[BaseModel], args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `model` present in parsed arguments."""
    return {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}

"""Values chosen by a tag in a config (``engine: vllm``, ``engine: command``): a tagged union whose tag may be
left out for the default member, so a config written before the union existed keeps its meaning.

    ServeEngineConfig = tagged_union({"auto": Auto, "builtin": Builtin, ...}, tag="engine", default="auto")

In Python, pydantic picks the member by the tag (the default when absent). In the JSON Schema Prefect shows
and validates deployment parameters with (``oneOf``), every member but the default requires the tag, so
exactly one member matches any config: a config without the tag matches the default alone.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, Discriminator, Field, Tag


def tagged_union(members: dict[str, type[BaseModel]], *, tag: str, default: str, description: str = "") -> Any:
    """``Annotated[A | B | ..., Discriminator(...)]`` of ``members`` (tag value -> model)."""
    if default not in members:
        raise ValueError(f"the default {default!r} is not one of {', '.join(members)}")

    def choose(value: Any) -> str:
        if isinstance(value, dict):
            return value.get(tag, default)
        return getattr(value, tag, default)

    options = tuple(
        Annotated[cls, Tag(name)] if name == default else Annotated[cls, Tag(name), _TagRequired(tag)]
        for name, cls in members.items()
    )
    return Annotated[
        Union[options],  # noqa: UP007 - built from the members at run time
        Discriminator(choose),
        Field(description=description or f"{tag}: {', '.join(members)} (default {default})"),
    ]


class _TagRequired:
    """In the JSON Schema, the member's tag is required (its definition's ``required`` gains it)."""

    def __init__(self, tag: str):
        self.tag = tag

    def __get_pydantic_json_schema__(self, core_schema, handler):
        schema = handler(core_schema)
        definition = handler.resolve_ref_schema(schema)
        definition["required"] = sorted({*definition.get("required", []), self.tag})
        # The same once more without the word "required": Prefect validates a deployment's parameters with
        # every "required" removed (they may be partial), and then a config without the tag matched every
        # member ("is valid under each of": `nemoflow deploy` refused prefect.yaml). A member whose tag
        # property may not be absent: "not (the tag, if present, fails)".
        absent = {"not": {"properties": {self.tag: False}}}
        if absent not in definition.setdefault("allOf", []):
            definition["allOf"].append(absent)
        return schema

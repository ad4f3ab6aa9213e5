"""Command-line options generated from a pydantic model, so a config's fields and defaults are declared once.

    options = ModelOptions(PrepareConfig, exclude={"image"}, fields={"tokenizer.vocab_file": Option("--vocab-file")})
    options.add_to(parser)                  # --name, --shards-per-file, --tokenizer-type, --append-eod/--no-append-eod ...
    config = options.build(parser.parse_args())

Each field becomes ``--kebab-case-name``; its help is the field's description and
the help shows the model's default. The option's own default is "not given"
(``argparse.SUPPRESS``): :meth:`ModelOptions.build` passes the model only what the
user typed, so every default lives in the model and nowhere else. Mapping:

- ``bool``: ``--flag`` / ``--no-flag``;
- ``list[X]``: ``nargs="+"`` of X (``Option(repeat=True)``: the flag once per value, ``--mount A --mount B``);
  ``X | list[X]``: ``nargs="+"``, and one value stays a scalar X;
- ``Literal[...]`` and enums: ``choices``;
- ``int``, ``float``, ``str`` (and ``X | None`` of them): typed values;
- a nested model: its fields flattened under the field's name (``tokenizer.type`` ->
  ``--tokenizer-type``).

Anything else (a union of models such as an executor, a dict, a secret) cannot be
spelled as one option: list it in ``exclude``, or give it an :class:`Option` with
``choices`` and ``convert`` (``--executor slurm`` -> ``{"kind": "slurm"}``). A
field the generator cannot map, or an ``exclude``/``fields`` entry that names no
field, raises :class:`TypeError` when the parser is built, so a model change cannot
silently drop or orphan an option.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from infra.secrets import CREDENTIAL_ERROR

SCALARS = (int, float, str)


class OptionsError(ValueError):
    """A value given on the command line is invalid; the message is one line naming the option."""


@dataclasses.dataclass(frozen=True)
class Option:
    """How one field is spelled, where the generated spelling is not the one users know.

    ``flag``: the option name (``--vocab-file``); ``help``: used when the field has no
    description; ``choices`` and ``convert`` (the parsed string -> the field's value)
    map a field the generator cannot map by itself; ``repeat``: a list field given as
    the flag once per value (argparse's ``append``) instead of values after one flag.
    """

    flag: str | None = None
    help: str | None = None
    choices: tuple[str, ...] | None = None
    convert: Callable[[str], Any] | None = None
    metavar: str | None = None
    repeat: bool = False


@dataclasses.dataclass
class _Mapped:
    path: tuple[str, ...]
    flag: str
    dest: str
    kwargs: dict[str, Any]
    scalar_if_one: bool = False
    convert: Callable[[Any], Any] | None = None


def _plain(annotation: Any) -> Any:
    """``Annotated[X, ...]`` -> ``X``, inside unions and lists too: validators are pydantic's, not argparse's."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _plain(typing.get_args(annotation)[0])
    if _is_union(annotation):
        return typing.Union[tuple(_plain(a) for a in typing.get_args(annotation))]  # noqa: UP007 - runtime tuple
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple, set, frozenset) and args:
        return origin[tuple(_plain(a) for a in args)] if len(args) > 1 else origin[_plain(args[0])]
    return annotation


def _strip_optional(annotation: Any) -> Any:
    """``X | None`` -> ``X`` (other unions unchanged); ``Annotated`` metadata dropped (:func:`_plain`)."""
    annotation = _plain(annotation)
    if _is_union(annotation):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        return typing.Union[tuple(args)]  # noqa: UP007 - rebuilt from a runtime tuple of types
    return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _literal_choices(annotation: Any) -> tuple | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(member.value for member in annotation)
    return None


def _scalar_kwargs(annotation: Any) -> dict[str, Any] | None:
    """argparse keywords for one value of ``annotation``, or None when it is not a scalar we can parse."""
    choices = _literal_choices(annotation)
    if choices is not None:
        kinds = {type(c) for c in choices}
        kwargs: dict[str, Any] = {"choices": list(choices)}
        if len(kinds) == 1 and kinds != {str} and next(iter(kinds)) in SCALARS:
            kwargs["type"] = next(iter(kinds))
        return kwargs
    if annotation in SCALARS:
        return {"type": annotation} if annotation is not str else {}
    return None


def _list_item(annotation: Any) -> Any | None:
    if typing.get_origin(annotation) in (list, tuple, set, frozenset, Iterable):
        args = typing.get_args(annotation)
        if args and (len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis)):
            return args[0]
    return None


def _show(value: Any, flag: str, is_bool: bool) -> str | None:
    """The default as the help shows it (None: do not show one)."""
    if value is None or value is PydanticUndefined:
        return None
    if is_bool:
        return flag if value else "--no-" + flag.removeprefix("--")
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value) or None  # an empty list: nothing to show
    return str(value)


class ModelOptions:
    """The options of one pydantic model, added to a parser and turned back into the model."""

    def __init__(
        self,
        model: type[BaseModel],
        *,
        exclude: Iterable[str] = (),
        fields: Mapping[str, Option] | None = None,
        prefix: str = "",
    ):
        self.model = model
        self.exclude = set(exclude)
        self.fields = dict(fields or {})
        self.prefix = prefix
        self._mapped: list[_Mapped] | None = None
        self._known: set[str] = set()

    # ---------------------------------------------------------------- building the parser

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        for mapped in self._plan():
            parser.add_argument(mapped.flag, **mapped.kwargs)

    def _plan(self) -> list[_Mapped]:
        """Every option with its argparse keywords (computed once; raises TypeError for an unmappable field)."""
        if self._mapped is None:
            self._mapped = []
            self._known = set()
            self._add_model(self.model, (), self.prefix, _default_instance(self.model))
            unknown = (self.exclude | set(self.fields)) - self._known
            if unknown:
                raise TypeError(f"{self.model.__name__} has no field(s) {', '.join(sorted(unknown))} (exclude/fields)")
        return self._mapped

    def _add_model(self, model: type[BaseModel], path: tuple[str, ...], prefix: str, defaults: Any) -> None:
        for name, info in model.model_fields.items():
            field_path = (*path, name)
            key = ".".join(field_path)
            self._known.add(key)
            if key in self.exclude:
                continue
            default = _field_default(info, defaults, name)
            annotation = _strip_optional(info.annotation)
            if _is_model(annotation) and key not in self.fields:
                self._add_model(annotation, field_path, f"{prefix}{name.replace('_', '-')}-", default)
                continue
            self._add_field(key, field_path, prefix, info, annotation, default)

    def _add_field(self, key, field_path, prefix, info: FieldInfo, annotation, default) -> None:
        override = self.fields.get(key, Option())
        flag = override.flag or f"--{prefix}{field_path[-1].replace('_', '-')}"
        dest = "model__" + "__".join(field_path)
        help_text = info.description or override.help or ""
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
        mapped = _Mapped(field_path, flag, dest, kwargs, convert=override.convert)
        is_bool = False
        if override.choices is not None or override.convert is not None:
            if override.choices is not None:
                kwargs["choices"] = list(override.choices)
        elif annotation is bool:
            is_bool = True
            kwargs["action"] = argparse.BooleanOptionalAction
        elif (scalar := _scalar_kwargs(annotation)) is not None:
            kwargs.update(scalar)
        elif (item := _list_item(annotation)) is not None and (scalar := _scalar_kwargs(item)) is not None:
            kwargs.update(scalar, **({"action": "append"} if override.repeat else {"nargs": "+"}))
        elif (one_or_many := _scalar_or_list(annotation)) is not None:
            kwargs.update(one_or_many, nargs="+")
            mapped.scalar_if_one = True
        else:
            raise TypeError(
                f"{self.model.__name__}.{key} ({info.annotation}) cannot be one command-line option: "
                "add it to exclude, or give it an Option with choices/convert"
            )
        if override.repeat and kwargs.get("action") != "append":
            raise TypeError(f"{self.model.__name__}.{key} ({info.annotation}) is not a list: it cannot repeat")
        if not is_bool and "choices" not in kwargs:
            kwargs["metavar"] = override.metavar or flag.removeprefix("--").replace("-", "_").upper()
        elif override.metavar:
            kwargs["metavar"] = override.metavar
        if override.repeat:
            help_text = f"{help_text} (repeatable)" if help_text else "repeatable"
        shown = _show(default, flag, is_bool)
        if info.is_required():
            kwargs["required"] = True
        elif shown is not None:
            help_text = f"{help_text} (default: {shown})" if help_text else f"default: {shown}"
        kwargs["help"] = help_text.replace("%", "%%")
        self._mapped.append(mapped)

    # ---------------------------------------------------------------- back to the model

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The values the user typed, nested like the model (``{"tokenizer": {"type": ...}}``)."""
        values: dict[str, Any] = {}
        for mapped in self._plan():
            if not hasattr(args, mapped.dest):
                continue
            value = getattr(args, mapped.dest)
            if mapped.scalar_if_one and isinstance(value, list) and len(value) == 1:
                value = value[0]
            if mapped.convert is not None:
                value = mapped.convert(value)
            target = values
            for part in mapped.path[:-1]:
                target = target.setdefault(part, {})
            target[mapped.path[-1]] = value
        return values

    def build(self, args: argparse.Namespace, **extra: Any) -> BaseModel:
        """The model from what the user gave (plus ``extra``); invalid values fail with one line naming the option."""
        values = _merge_nested_defaults(self.model, self.given(args))
        values.update(extra)
        try:
            return self.model.model_validate(values)
        except ValidationError as exc:
            raise OptionsError(self._one_line(exc)) from None

    def _one_line(self, exc: ValidationError) -> str:
        flags = {mapped.path: mapped.flag for mapped in self._plan()}
        errors = exc.errors()
        # A literal credential (infra.secrets) is the problem to report, not the other branches of a
        # union it failed too ("input should be a valid list"); and it is never repeated.
        if any(error["type"] == CREDENTIAL_ERROR for error in errors):
            errors = [error for error in errors if error["type"] == CREDENTIAL_ERROR]
        problems = []
        for error in errors:
            loc = tuple(str(part) for part in error["loc"])
            flag = next((flags[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in flags), None)
            where = flag or (".".join(loc) if loc else self.model.__name__)
            echo = (
                flag and "input" in error and not isinstance(error["input"], dict) and error["type"] != CREDENTIAL_ERROR
            )
            shown = f" {error['input']!r}" if echo else ""
            message = error["msg"][:1].lower() + error["msg"][1:]
            problems.append(f"{where}{shown}: {message}")
        return "; ".join(problems)


def _scalar_or_list(annotation: Any) -> dict[str, Any] | None:
    """``X | list[X]`` -> argparse keywords for X."""
    if not _is_union(annotation):
        return None
    args = typing.get_args(annotation)
    scalars = [a for a in args if _list_item(a) is None]
    lists = [_list_item(a) for a in args if _list_item(a) is not None]
    if len(scalars) == 1 and lists == scalars:
        return _scalar_kwargs(scalars[0])
    return None


def _default_instance(model: type[BaseModel]) -> BaseModel | None:
    try:
        return model()
    except ValidationError:
        return None  # required fields: defaults come field by field


def _field_default(info: FieldInfo, defaults: Any, name: str) -> Any:
    if isinstance(defaults, BaseModel):
        return getattr(defaults, name)
    if info.is_required():
        return PydanticUndefined
    return info.get_default(call_default_factory=True)


def _merge_nested_defaults(model: type[BaseModel], given: dict[str, Any]) -> dict[str, Any]:
    """Nested values the user gave, laid over the nested default the model would use.

    ``--tokenizer-type X`` changes the tokenizer's type and keeps the rest of the
    default tokenizer, even where a default factory set more than the nested model's
    own defaults.
    """
    merged = dict(given)
    for name, value in given.items():
        info = model.model_fields.get(name)
        if info is None or not isinstance(value, dict):
            continue
        annotation = _strip_optional(info.annotation)
        if not _is_model(annotation):
            continue
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        base = default.model_dump(exclude_unset=True) if isinstance(default, BaseModel) else {}
        merged[name] = {**base, **_merge_nested_defaults(annotation, value)}
    return merged

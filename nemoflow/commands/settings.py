"""``nemoflow settings``: show the effective settings (secrets masked)."""

from __future__ import annotations

import json
from typing import Any

MASK = "**********"


def register(sub) -> None:
    parser = sub.add_parser(
        "settings",
        help="show the effective settings (from NEMOFLOW_* variables and .env), secrets masked",
        description="Print every setting, where it can be set, and its current value, then the Slurm and "
        "Kubernetes executors' options as NEMOFLOW_SLURM_* / NEMOFLOW_K8S_* fill them. Secret values are never "
        "printed.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def sections() -> list[tuple[str | None, Any]]:
    """What is shown: (section name, settings object); the unnamed section is the core ``Settings``.

    Another settings model (a pydantic ``BaseSettings`` with an ``env_prefix``, such as the
    Slurm or Kubernetes executor options) is one more entry: ``("slurm", SlurmOptions())``.
    """
    from pydantic_settings import BaseSettings

    from infra.executors import EXECUTORS
    from infra.settings import get_settings

    # The executors' options as the environment fills them (a flow's executor adds its own values): those
    # that are settings models (NEMOFLOW_SLURM_*, NEMOFLOW_K8S_*); the others have nothing to fill.
    executors = [(kind, cls()) for kind, cls in EXECUTORS.items() if issubclass(cls, BaseSettings)]
    return [(None, get_settings()), *executors]


def rows(settings) -> list[tuple[str, str, Any, str]]:
    """(field, variable, value with secrets masked, description) for every field of a settings object."""
    prefix = settings.model_config.get("env_prefix", "")
    result = []
    for name, field in type(settings).model_fields.items():
        if name == "kind":  # the executor's tag, not a setting
            continue
        value = getattr(settings, name)
        if hasattr(value, "get_secret_value"):
            value = MASK
        elif hasattr(value, "model_dump"):
            value = value.model_dump(mode="json")
        result.append((name, (prefix + name).upper(), value, field.description or ""))
    return result


def run(args) -> int:
    if args.json:
        document: dict[str, Any] = {}
        for section, settings in sections():
            values = {name: value for name, _, value, _ in rows(settings)}
            if section is None:
                document.update(values)
            else:
                document[section] = values
        print(json.dumps(document, indent=2, default=str))
        return 0
    for section, settings in sections():
        if section is not None:
            print(f"\n[{section}]")
        for _, variable, value, description in rows(settings):
            print(f"{variable:<28} {value!s:<40} {description}")
    return 0

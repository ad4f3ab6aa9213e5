"""``nemoflow settings``: show the effective settings (secrets masked)."""

from __future__ import annotations

import json


def register(sub) -> None:
    parser = sub.add_parser(
        "settings",
        help="show the effective settings (from NEMOFLOW_* variables and .env), secrets masked",
        description="Print every setting, where it can be set, and its current value. Secret values are never printed.",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def run(args) -> int:
    from infra.settings import Settings, get_settings

    settings = get_settings()
    values = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if hasattr(value, "get_secret_value"):
            value = "**********"
        values[name] = value
    if args.json:
        print(json.dumps(values, indent=2))
        return 0
    for name, field in Settings.model_fields.items():
        print(f"{('NEMOFLOW_' + name.upper()):<28} {values[name]!s:<40} {field.description or ''}")
    return 0

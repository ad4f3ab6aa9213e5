"""``nemoflow``: the command line.

Each subcommand lives in ``nemoflow/commands/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with
the parsed arguments; its return value is the exit code). Add a module name to
``COMMANDS`` to add a subcommand. Options generated from a config model
(``nemoflow/options.py``) are added with ``parser.defer(...)``, so that only the
command that uses them imports the model.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "demo",
    "deploy",
    "settings",
    "preprocess",
    "prepare",
    "render",
    "stage_image",
    "serve",
    "fetch",
    "local_slurm",
    "models",
    "image",
    "interactive",
    "render_dpo",
    "refresh",
]

DESCRIPTION = """\
nemoflow runs the NVIDIA NeMo LLM lifecycle as Prefect flows: stage the container
image, prepare the dataset (download, extract, concatenate, tokenize into Megatron
indexed datasets, blend), pretrain or continue pretraining, validate the checkpoint,
deploy inference and smoke-test it, locally, on Slurm or on Kubernetes.

Settings come from NEMOFLOW_* environment variables or a .env file
(`nemoflow settings` shows them, secrets masked)."""


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose costly options are added only when that subcommand is used.

    ``parser.defer(add)`` runs ``add(parser)`` before the parser parses or prints help:
    options generated from a flow's config model import the flow (and Prefect, ~2 s),
    which every other command would otherwise pay for.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deferred: list = []

    def defer(self, add) -> None:
        self._deferred.append(add)

    def _populate(self) -> None:
        while self._deferred:
            self._deferred.pop(0)(self)

    def parse_known_args(self, args=None, namespace=None):
        self._populate()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._populate()
        return super().format_usage()

    def format_help(self) -> str:
        self._populate()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nemoflow",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=CommandParser)
    for name in COMMANDS:
        module = importlib.import_module(f"nemoflow.commands.{name}")
        module.register(sub)
    return parser


class UserError(Exception):
    """An error caused by input: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from infra.settings import SettingsError, get_settings

    try:
        get_settings()  # an invalid NEMOFLOW_* value: one line here, not a traceback from deep inside a flow
    except SettingsError as exc:  # its message never holds a secret value
        print(f"nemoflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (UserError, FileNotFoundError, ValueError, PermissionError) as exc:
        from infra.settings import redact

        print(f"nemoflow {args.command}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run the copy imported as nemoflow.cli, so that commands raising
    # nemoflow.cli.UserError are caught by the same class (not __main__'s twin).
    from nemoflow.cli import main as _main

    sys.exit(_main())

"""The subcommands, one module each (``nemoflow/cli.py`` lists them); :func:`add_command` makes their parsers."""

from __future__ import annotations

import argparse


def add_command(sub, name: str, summary: str, description: str, epilog: str | None = None) -> argparse.ArgumentParser:
    """A (sub)command's parser in ``sub`` (an ``add_subparsers()`` action) whose description and epilog print as
    written: their line breaks kept, nothing re-wrapped. ``summary``: its line in the list of commands."""
    return sub.add_parser(
        name, help=summary, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )

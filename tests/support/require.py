"""What a test needs from the machine: a service, a tool, root. Outside CI a missing one skips the test and
says what to install; under ``CI=true`` (``.ci/run``, whose test command installs and starts everything) it
fails the test, so a broken install cannot hide behind a skip.

    from tests.support.require import need
    need(shutil.which("mksquashfs"), "mksquashfs", "apt-get install squashfs-tools (scripts/setup.sh --test)")
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def need(condition: object, what: str, how_to_install: str) -> None:
    """Go on when ``condition`` is true; otherwise skip (fail under CI=true) naming ``what`` and how to get it."""
    if not condition:
        missing(what, how_to_install)


def missing(what: str, how_to_install: str) -> NoReturn:
    message = f"needs {what}: {how_to_install}"
    if in_ci():
        pytest.fail(f"CI=true and this test {message} (the test command provides it; a skip would hide that)")
    pytest.skip(message)

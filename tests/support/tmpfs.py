"""Small real tmpfs mounts for disk-full and read-only tests (root only; the test is skipped otherwise)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real tmpfs mounted at ``path`` with mount ``options`` (e.g. ``size=1m`` or ``size=4m,ro``).

    Skips the test, saying why, where mounting is not permitted (not root, no CAP_SYS_ADMIN).
    """
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, f"nemoflow-test-{uuid.uuid4().hex[:6]}", str(path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def resize(path: Path, size: str) -> None:
    """Grow (or shrink) a mounted tmpfs in place: "more space" for a re-run."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True)

"""Small real tmpfs mounts for disk-full and read-only tests (root only).

Where mounting is not permitted the test is skipped saying so, or fails under CI=true (tests/support/require.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import uuid
from pathlib import Path

from tests.support.require import missing


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real tmpfs mounted at ``path`` with mount ``options`` (e.g. ``size=1m`` or ``size=4m,ro``)."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, f"nemoflow-test-{uuid.uuid4().hex[:6]}", str(path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        missing(
            f"a tmpfs mount ({result.stderr.strip() or result.returncode})",
            "run the tests as root (CAP_SYS_ADMIN), as CI does",
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def resize(path: Path, size: str) -> None:
    """Grow (or shrink) a mounted tmpfs in place: "more space" for a re-run."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True)


def is_full(path: Path) -> bool:
    """True when the file system holding ``path`` refuses one more page with ENOSPC: the disk really is full."""
    probe = Path(path) / f".probe-{uuid.uuid4().hex[:8]}"
    fd = None
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"\0" * 4096)
        return False
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            return True
        raise
    finally:
        if fd is not None:
            os.close(fd)
        probe.unlink(missing_ok=True)

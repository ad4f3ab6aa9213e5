"""Fixtures for image staging: real squashfs images made with mksquashfs, served over HTTP and GCS."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.fault_server import FaultServer
from tests.support.require import need
from tests.support.tmpfs import tmpfs  # noqa: F401 - re-exported for the tests here

MKSQUASHFS = shutil.which("mksquashfs")


def make_squashfs(src_dir: Path, out: Path) -> Path:
    need(MKSQUASHFS, "mksquashfs", "apt-get install squashfs-tools (scripts/setup.sh --test)")
    subprocess.run(
        [MKSQUASHFS, str(src_dir), str(out), "-noappend", "-quiet", "-no-progress", "-comp", "gzip"],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def sqsh_image(tmp_path_factory, kjv_chapters) -> Path:
    """A real squashfs image, ~1.6 MiB: a small root file system with real text and incompressible bytes.

    Bigger than 1 MiB so a 1 MiB tmpfs cannot hold it (the free-space test).
    """
    root = tmp_path_factory.mktemp("rootfs")
    (root / "etc").mkdir()
    (root / "etc" / "os-release").write_text('NAME="nemoflow test image"\n')
    (root / "usr" / "share" / "doc").mkdir(parents=True)
    for i, chapter in enumerate(kjv_chapters[:40]):
        (root / "usr" / "share" / "doc" / f"chapter-{i:03d}.txt").write_text(chapter)
    (root / "opt").mkdir()
    (root / "opt" / "weights.bin").write_bytes(random.Random(1234).randbytes(1_600_000))
    return make_squashfs(root, tmp_path_factory.mktemp("images") / "nemo-test.sqsh")


@pytest.fixture
def served(tmp_path, sqsh_image):
    """A directory with the image, served over HTTP with x-goog-hash (md5) like GCS's XML API does."""
    root = tmp_path / "www"
    root.mkdir()
    shutil.copyfile(sqsh_image, root / "nemo-test.sqsh")
    with FaultServer(root, checksums=("x-goog-hash",)) as server:
        yield server, root


@pytest.fixture
def counted_server(served, monkeypatch):
    """``counted_server(row)`` -> the server of ``served``, the faults it injects from now on counted in the
    fault-ledger ``row`` (each test opens its own); copies resume without their backoff."""
    from infra.images import copying

    monkeypatch.setattr(copying, "RESUME_BACKOFF_S", 0.0)

    def count_into(row):
        server, _ = served
        row.injected_from(server.injected_count)
        return server

    return count_into


@pytest.fixture
def plain_served(tmp_path, sqsh_image):
    """The image over HTTP with only Content-Length and a non-md5 ETag: no checksum to compare."""
    root = tmp_path / "plain-www"
    root.mkdir()
    shutil.copyfile(sqsh_image, root / "nemo-test.sqsh")
    with FaultServer(root) as server:
        yield server, root


@pytest.fixture
def registry_env(monkeypatch):
    """Registry credentials unset, settings reloaded around the test."""
    from infra.settings import reload_settings

    for name in ("NEMOFLOW_REGISTRY_USER", "NEMOFLOW_REGISTRY_PASSWORD", "NGC_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    reload_settings()

    def set_env(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        reload_settings()

    yield set_env
    for name in ("NEMOFLOW_REGISTRY_USER", "NEMOFLOW_REGISTRY_PASSWORD", "NGC_API_KEY"):
        os.environ.pop(name, None)
    reload_settings()


def leftovers(directory: Path) -> list[str]:
    """Everything in ``directory`` (recursively) as relative names: nothing half-written may stay."""
    if not directory.exists():
        return []
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))

"""Faults injected into image staging against real local services (``pytest -m faults``).

GCS faults come from a fault proxy in front of the real GCS emulator; an unresolvable host is a
``.invalid`` name; a full disk is a small tmpfs; a damaged image is a real mksquashfs image whose
body was replaced. Each test checks that staging tells the truth: a verified image, or one clear
line with nothing under the final name. Each row of the fault table counts what the fault servers served.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest

from infra import images, storage
from infra.images import ImageDestinationError, ImageError, ImageNotFound, ImageVerificationError, copy_image, copying
from tests.conftest import REPO
from tests.support import fault_ledger
from tests.support.fault_proxy import does_not_resolve, gcs_behind, unresolvable_gcs
from tests.support.fault_server import Fault, FaultServer
from tests.support.tmpfs import is_full

from .conftest import leftovers, tmpfs

pytestmark = [pytest.mark.faults]

META = r"^GET /storage/v1/b/[^/]+/o/containers%2Fnemo-test\.sqsh$"
MEDIA = r"^GET /download/storage/v1/b/[^/]+/o/containers%2Fnemo-test\.sqsh"


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.gcs
def test_image_copy_survives_gcs_5xx_429_resets_and_timeouts(
    gcs_endpoint, gcs_bucket, sqsh_image, tmp_path, monkeypatch
):
    src = f"{gcs_bucket}/containers/nemo-test.sqsh"
    storage.put_file(str(sqsh_image), src)
    monkeypatch.setattr(copying, "RESUME_BACKOFF_S", 0.05)
    monkeypatch.setattr(copying, "TIMEOUT_S", 1.0)
    chunk = 512 << 10  # four range reads for the ~1.6 MiB image
    lines: list[str] = []
    row = fault_ledger.open_row("gcs 5xx/429/reset/timeout: image copy")
    with gcs_behind(gcs_endpoint) as proxy:
        proxy.add_faults(META, Fault(status=503), Fault(status=429, retry_after="1"))  # the probe retries both
        proxy.add_faults(MEDIA, Fault(), Fault(reset_at=100_000), Fault(delay=3.0), Fault(status=500))
        started = time.monotonic()
        staged = copy_image(src, str(tmp_path / "images"), chunk=chunk, log=lines.append)
        elapsed = time.monotonic() - started
        ranges = [r.headers.get("Range") for r in proxy.seen(MEDIA)]
        injected = sum(1 for i in proxy.injected if i.fault != Fault())
        row.injected += injected
    row.compare({"image": sha256(sqsh_image)}, {"image": sha256(staged.uri)})
    assert sha256(staged.uri) == sha256(sqsh_image)
    assert staged.checksum == "md5:" + hashlib.md5(sqsh_image.read_bytes()).hexdigest()
    assert injected == 5 and proxy.pending() == 0
    # The first block arrived; every resume asked for the second one, never byte 0 again.
    assert ranges[0] == f"bytes=0-{chunk - 1}" and set(ranges[1:4]) == {f"bytes={chunk}-{2 * chunk - 1}"}
    assert sum("resuming at byte 524288" in line for line in lines) == 3
    assert elapsed >= 1.0  # Retry-After: 1 on the probe was honoured
    assert leftovers(tmp_path / "images") == ["nemo-test.sqsh", "nemo-test.sqsh.meta.json"]


@pytest.mark.gcs
@pytest.mark.parametrize(
    "status, message",
    [(401, "cannot authenticate to GCS"), (403, "access denied"), (404, "image source not found: no such object")],
)
def test_unreachable_gcs_image_fails_at_once_in_one_line(
    gcs_endpoint, gcs_bucket, sqsh_image, tmp_path, status, message
):
    src = f"{gcs_bucket}/containers/nemo-test.sqsh"
    storage.put_file(str(sqsh_image), src)
    bucket = gcs_bucket.removeprefix("gs://")
    row = fault_ledger.open_row(f"gcs {status}: image copy")
    with gcs_behind(gcs_endpoint) as proxy:
        proxy.add_faults(rf"^GET /(download/)?storage/v1/b/{bucket}/o", *[Fault(status=status)] * 50)
        started = time.monotonic()
        with pytest.raises(ImageNotFound) as err:
            copy_image(src, str(tmp_path / "images"))
        elapsed = time.monotonic() - started
        row.injected += proxy.injected_count()
        assert proxy.count(META) == 1  # not retried
    row.compare({"source": sha256(sqsh_image)}, {"source": hashlib.sha256(storage.read_bytes(src)).hexdigest()})
    text = str(err.value)
    assert "\n" not in text and message in text and "containers/nemo-test.sqsh" in text
    assert not err.value.transient and elapsed < 2
    assert leftovers(tmp_path / "images") == []


def test_unresolvable_gcs_image_cli_prints_one_line(tmp_path):
    """`nemoflow stage-image` with a bucket behind a name that does not resolve: one error line, quickly."""
    env = {"NEMOFLOW_GCS_ENDPOINT": "http://nemoflow-gcs.invalid:9023", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    argv = ["stage-image", "gs://bucket/containers/nemo.sqsh", "--dest", str(tmp_path / "images"), "--no-prefect"]
    row = fault_ledger.open_row("gcs host does not resolve: image copy")
    row.injected += does_not_resolve("nemoflow-gcs.invalid")
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", *argv], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert re.match(
        r"nemoflow stage-image: error: cannot reach image source gs://bucket/containers/nemo\.sqsh: "
        r"cannot resolve host 'nemoflow-gcs\.invalid' .*\(gave up after 3 attempts\)$",
        run.stderr.strip(),
    ), run.stderr
    assert elapsed < 30
    with unresolvable_gcs():
        with pytest.raises(ImageError) as err:
            copy_image("gs://bucket/containers/nemo.sqsh", str(tmp_path / "images"))
    assert not err.value.transient  # the stage-image task does not retry it for minutes either


def test_disk_full_mid_image_copy_then_a_rerun_succeeds(sqsh_image, tmp_path, monkeypatch):
    """Another writer fills the disk during the copy: one line, nothing left; with space, it stages."""
    source = tmp_path / "src" / "nemo-test.sqsh"
    source.parent.mkdir()
    shutil.copyfile(sqsh_image, source)
    monkeypatch.setattr(copying, "PROGRESS_EVERY", 64 << 10)
    row = fault_ledger.open_row("disk full (tmpfs): image copy")
    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        filler = disk / "another-writer.bin"
        full = []

        def fill_the_disk(copied: int, total: int | None) -> None:
            if not filler.exists():
                with open(filler, "wb") as fh:  # takes whatever space is left
                    with pytest.raises(OSError):
                        while True:
                            fh.write(b"\0" * (64 << 10))
                            fh.flush()
                full.append(is_full(disk))  # ENOSPC for real

        with pytest.raises(ImageDestinationError) as err:
            copy_image(str(source), str(disk), chunk=64 << 10, progress=fill_the_disk)
        row.injected += sum(full)
        text = str(err.value)
        assert "\n" not in text and re.match(rf"{disk} ran out of space after [\d.]+ (B|KiB) of 1\.\d MiB", text), text
        assert leftovers(disk) == ["another-writer.bin"]  # no temporary, nothing under the final name
        filler.unlink()
        staged = copy_image(str(source), str(disk))
        row.compare({"image": sha256(sqsh_image)}, {"image": sha256(staged.uri)})
        assert not staged.cached and sha256(staged.uri) == sha256(sqsh_image)


# ---------------------------------------------------------------- a sound superblock on a bad body


@pytest.fixture
def random_body(sqsh_image, tmp_path):
    """The real image's superblock followed by random bytes: same size, a plausible superblock, no file system."""
    data = sqsh_image.read_bytes()
    bad = tmp_path / "src" / "nemo-test.sqsh"
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(data[: images.SUPERBLOCK_SIZE] + random.Random(7).randbytes(len(data) - images.SUPERBLOCK_SIZE))
    images.read_superblock(str(bad))  # the superblock alone would pass
    return bad


def test_random_body_behind_a_valid_superblock_is_refused(random_body, sqsh_image, tmp_path):
    dest = tmp_path / "images"
    row = fault_ledger.open_row("corrupted image (random body)")
    corrupt = sha256(random_body)
    row.injected += corrupt != sha256(sqsh_image)  # copied from a local path
    with pytest.raises(ImageVerificationError, match=r"squashfs file system is damaged .*\(unsquashfs -l: .+\)"):
        copy_image(str(random_body), str(dest))
    assert leftovers(dest) == []
    with FaultServer(random_body.parent, checksums=("x-goog-hash",)) as server:  # checksum matches: still refused
        with pytest.raises(ImageVerificationError, match="damaged"):
            copy_image(server.url("nemo-test.sqsh"), str(dest))
        row.injected += sum(1 for r in server.requests if r.method == "GET" and r.sha256 == corrupt)  # served
    assert leftovers(dest) == []


@pytest.mark.gcs
def test_random_body_is_refused_inside_gcs_too(random_body, sqsh_image, gcs_bucket):
    """Bucket to bucket no byte passes through here: only the tables region is fetched for unsquashfs."""
    row = fault_ledger.open_row("corrupted image (random body) in a bucket")
    storage.put_file(str(random_body), f"{gcs_bucket}/containers/bad.sqsh")
    row.injected += storage.read_bytes(f"{gcs_bucket}/containers/bad.sqsh") != sqsh_image.read_bytes()
    with pytest.raises(ImageVerificationError, match="damaged"):
        copy_image(f"{gcs_bucket}/containers/bad.sqsh", f"{gcs_bucket}/staged")
    assert storage.listdir(f"{gcs_bucket}/staged") == []
    storage.put_file(str(sqsh_image), f"{gcs_bucket}/containers/nemo-test.sqsh")
    staged = copy_image(f"{gcs_bucket}/containers/nemo-test.sqsh", f"{gcs_bucket}/staged")
    assert storage.read_bytes(staged.uri) == sqsh_image.read_bytes()


def test_imported_image_with_a_damaged_body_is_refused(random_body, sqsh_image, tmp_path):
    """convert_image's check on what enroot wrote is the same one (the plan's output is checked)."""
    row = fault_ledger.open_row("corrupted image (random body) after an import")
    row.injected += random_body.read_bytes() != sqsh_image.read_bytes()  # random bytes behind a valid superblock
    block = images.read_superblock(str(random_body))
    with pytest.raises(ImageVerificationError, match="damaged"):
        images.check_filesystem(str(random_body), block, "import output")
    assert os.path.exists(random_body)

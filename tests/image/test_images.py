"""Image staging against real parts: mksquashfs images, an HTTP server, the GCS emulator, tmpfs mounts."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess

import pytest

from infra import images, storage
from infra.images import (
    DockerRef,
    ImageCorrupted,
    ImageDestinationError,
    ImageError,
    ImageNotFound,
    ImageSourceError,
    ImageVerificationError,
    copy_image,
    copying,
    parse_docker_ref,
)
from tests.support import fault_ledger
from tests.support.fault_server import Fault
from tests.support.require import need

from .conftest import leftovers, make_squashfs, tmpfs


def sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def md5(path) -> str:
    return hashlib.md5(open(path, "rb").read()).hexdigest()


# ---------------------------------------------------------------- the superblock, against unsquashfs


def test_superblock_matches_unsquashfs(sqsh_image):
    """Our reader agrees with squashfs-tools' own reader on a real image."""
    need(shutil.which("unsquashfs"), "unsquashfs", "apt-get install squashfs-tools (scripts/setup.sh --test)")
    report = subprocess.run(["unsquashfs", "-s", str(sqsh_image)], capture_output=True, text=True, check=True).stdout
    block = images.read_superblock(str(sqsh_image))
    assert f"Number of inodes {block.inodes}" in report
    assert f"Block size {block.block_size}" in report
    assert f"Filesystem size {block.bytes_used} bytes" in report
    assert f"Compression {block.compression}" in report
    assert block.version == "4.0"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"GIF89a" + b[6:], "is not a squashfs image"),
        (lambda b: b[:28] + (3).to_bytes(2, "little") + b[30:], "version 3.0, expected 4.0"),
        (lambda b: b[:12] + (1000).to_bytes(4, "little") + b[16:], "implausible squashfs block size"),
        (lambda b: b[:4] + (0).to_bytes(4, "little") + b[8:], "no inodes"),
        (lambda b: b[: len(b) // 2], "is truncated"),
        (lambda b: b[:50], "50 bytes, shorter than a superblock"),
        (lambda b: b + bytes(200_000), "after the end of the squashfs file system"),
    ],
)
def test_damaged_superblocks_are_named(sqsh_image, tmp_path, damage, message):
    bad = tmp_path / "bad.sqsh"
    bad.write_bytes(damage(sqsh_image.read_bytes()))
    with pytest.raises(ImageVerificationError, match=message) as info:
        images.read_superblock(str(bad))
    assert str(bad) in str(info.value)


# ---------------------------------------------------------------- copies: gs://, https://, paths


def test_gs_copy_is_verified_against_object_md5(gcs_bucket, sqsh_image, tmp_path):
    src = f"{gcs_bucket}/containers/nemo-test.sqsh"
    storage.put_file(str(sqsh_image), src)
    dest = tmp_path / "images"
    staged = copy_image(src, str(dest))
    final = dest / "nemo-test.sqsh"
    assert staged.uri == str(final)
    assert sha256(final) == sha256(sqsh_image)
    # GCS states the md5; the copy is checked against it.
    assert staged.checksum == "md5:" + md5(sqsh_image)
    meta = json.loads((dest / "nemo-test.sqsh.meta.json").read_text())
    assert meta["source"] == src and meta["size"] == sqsh_image.stat().st_size
    assert meta["checksum"] == staged.checksum and meta["verified_at"]
    assert leftovers(dest) == ["nemo-test.sqsh", "nemo-test.sqsh.meta.json"]


def test_region_placeholder_resolves_from_settings(gcs_bucket, sqsh_image, tmp_path, monkeypatch):
    from infra.settings import reload_settings

    storage.put_file(str(sqsh_image), f"{gcs_bucket}/europe/nemo-test.sqsh")
    monkeypatch.setenv("NEMOFLOW_REGION", "europe")
    reload_settings()
    try:
        staged = copy_image(f"{gcs_bucket}/<region>/nemo-test.sqsh", str(tmp_path / "d"))
    finally:
        monkeypatch.delenv("NEMOFLOW_REGION")
        reload_settings()
    assert staged.source == f"{gcs_bucket}/europe/nemo-test.sqsh"
    assert sha256(staged.uri) == sha256(sqsh_image)


def test_copy_to_gs_destination_and_cache_hit(gcs_bucket, sqsh_image):
    dest = f"{gcs_bucket}/images"
    first = copy_image(str(sqsh_image), dest)
    assert first.uri == f"{dest}/nemo-test.sqsh" and not first.cached
    # What landed in the bucket has the bytes of the image: GCS's own md5 says so.
    stated = base64.b64decode(storage.info(first.uri)["md5Hash"]).hex()
    assert stated == md5(sqsh_image)
    assert first.checksum == "sha256:" + sha256(sqsh_image)
    second = copy_image(str(sqsh_image), dest)
    assert second.cached and second.bytes_copied == 0
    assert [storage.basename(u) for u in storage.listdir(dest)] == ["nemo-test.sqsh", "nemo-test.sqsh.meta.json"]


def test_https_copy_verified_with_x_goog_hash(served, tmp_path, sqsh_image):
    server, _ = served
    dest = tmp_path / "images"
    staged = copy_image(server.url("nemo-test.sqsh"), str(dest))
    assert staged.checksum == "md5:" + md5(sqsh_image)
    assert sha256(dest / "nemo-test.sqsh") == sha256(sqsh_image)
    assert server.count("/nemo-test.sqsh", "GET") == 1  # streamed in one request, not per block


def test_https_without_checksum_records_sha256(plain_served, tmp_path, sqsh_image):
    server, _ = plain_served
    staged = copy_image(server.url("nemo-test.sqsh"), str(tmp_path / "images"))
    assert staged.checksum == "sha256:" + sha256(sqsh_image)
    assert staged.size == sqsh_image.stat().st_size


def test_second_run_is_a_cache_hit(served, tmp_path):
    server, _ = served
    dest = tmp_path / "images"
    url = server.url("nemo-test.sqsh")
    copy_image(url, str(dest))
    before = os.stat(dest / "nemo-test.sqsh")
    again = copy_image(url, str(dest))
    after = os.stat(dest / "nemo-test.sqsh")
    assert again.cached and again.bytes_copied == 0
    assert server.count("/nemo-test.sqsh", "GET") == 1  # no byte fetched the second time
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_changed_source_is_staged_again(served, tmp_path, sqsh_image, kjv_chapters):
    server, root = served
    dest = tmp_path / "images"
    url = server.url("nemo-test.sqsh")
    copy_image(url, str(dest))
    rootfs = tmp_path / "rootfs2"
    rootfs.mkdir()
    (rootfs / "genesis.txt").write_text(kjv_chapters[0])
    make_squashfs(rootfs, root / "nemo-test.sqsh")
    staged = copy_image(url, str(dest))
    assert not staged.cached
    assert server.count("/nemo-test.sqsh", "GET") == 2
    assert sha256(dest / "nemo-test.sqsh") == sha256(root / "nemo-test.sqsh")


@pytest.mark.faults
def test_dropped_connections_are_resumed(tmp_path, sqsh_image, counted_server):
    row = fault_ledger.open_row("http stall/reset: image copy resumed")
    server = counted_server(row)
    # stall_at: the first 100000 bytes arrive and are read before the connection closes early,
    # so the resume point is exact (bytes that arrive together with the error are dropped by aiohttp).
    server.add_faults("/nemo-test.sqsh", Fault(stall_at=100_000, stall=0.5), Fault(reset_at=700_000))
    lines: list[str] = []
    staged = copy_image(server.url("nemo-test.sqsh"), str(tmp_path / "images"), log=lines.append)
    assert sha256(staged.uri) == sha256(sqsh_image)
    gets = [r for r in server.requests_for("/nemo-test.sqsh") if r.method == "GET"]
    ranges = [r.headers.get("Range") for r in gets]
    assert ranges[:2] == [None, "bytes=100000-"]
    # After a TCP reset the kernel may drop bytes already sent: resume from what actually arrived.
    assert 100_000 <= int(ranges[2].removeprefix("bytes=").rstrip("-")) <= 800_000
    assert all(r.headers.get("If-Range") for r in gets[1:])
    assert sum("resuming at byte" in line for line in lines) == 2


@pytest.mark.faults
def test_connection_that_keeps_dropping_leaves_nothing(tmp_path, counted_server):
    row = fault_ledger.open_row("http truncation every attempt: image copy")
    server = counted_server(row)
    server.add_faults("/nemo-test.sqsh", *[Fault(truncate_at=50_000) for _ in range(copying.RESUME_ATTEMPTS + 1)])
    dest = tmp_path / "images"
    with pytest.raises(ImageSourceError, match="nemo-test.sqsh") as info:
        copy_image(server.url("nemo-test.sqsh"), str(dest))
    assert info.value.transient  # the Prefect task retries it later
    assert server.count("/nemo-test.sqsh", "GET") == copying.RESUME_ATTEMPTS + 1
    assert leftovers(dest) == []


@pytest.mark.faults
def test_resume_refuses_a_file_replaced_meanwhile(tmp_path, counted_server):
    row = fault_ledger.open_row("http stall, then the file replaced: image copy")
    server = counted_server(row)
    # The second GET sees another ETag: If-Range fails, the server sends the whole (new) file with 200.
    server.add_faults("/nemo-test.sqsh", Fault(stall_at=100_000, stall=0.5), Fault(etag="replaced"))
    dest = tmp_path / "images"
    with pytest.raises(ImageSourceError, match="cannot resume .* at byte 100000: the server answered 200"):
        copy_image(server.url("nemo-test.sqsh"), str(dest))
    assert leftovers(dest) == []


@pytest.mark.faults
def test_corrupted_byte_is_a_checksum_mismatch(served, tmp_path, sqsh_image):
    server, root = served
    row = fault_ledger.open_row("image corrupted (one flipped byte) after its HEAD")
    data = bytearray(sqsh_image.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped after the HEAD announced the md5
    server.add_faults("/nemo-test.sqsh", Fault(before=lambda: (root / "nemo-test.sqsh").write_bytes(bytes(data))))
    dest = tmp_path / "images"
    with pytest.raises(ImageCorrupted, match="checksum mismatch") as info:
        copy_image(server.url("nemo-test.sqsh"), str(dest))
    row.injected += (root / "nemo-test.sqsh").read_bytes() != sqsh_image.read_bytes()  # served flipped
    assert "md5:" + md5(sqsh_image) in str(info.value)
    assert leftovers(dest) == []


def test_truncated_image_without_checksum_is_caught_by_superblock(sqsh_image, tmp_path):
    source = tmp_path / "src" / "half.sqsh"
    source.parent.mkdir()
    source.write_bytes(sqsh_image.read_bytes()[:500_000])
    dest = tmp_path / "images"
    with pytest.raises(ImageVerificationError, match="truncated"):
        copy_image(f"file://{source}", str(dest))
    assert leftovers(dest) == []


def test_not_a_squashfs_file(tmp_path, kjv_chapters):
    source = tmp_path / "src" / "notes.sqsh"
    source.parent.mkdir()
    source.write_text("\n".join(kjv_chapters[:3]))
    dest = tmp_path / "images"
    with pytest.raises(ImageVerificationError, match=r"is not a squashfs image \(first bytes") as info:
        copy_image(str(source), str(dest))
    assert str(source) in str(info.value)
    assert leftovers(dest) == []


def test_wrong_file_is_refused_after_its_first_bytes(tmp_path, monkeypatch, kjv_chapters):
    """An HTML error page or a tarball is rejected at once, not after copying all of it."""
    source = tmp_path / "src" / "nemo.sqsh"
    source.parent.mkdir()
    source.write_text("\n".join(kjv_chapters[:200]))  # ~1 MB of text
    monkeypatch.setattr(copying, "PROGRESS_EVERY", 64 << 10)
    reports: list[int] = []
    with pytest.raises(ImageVerificationError, match="is not a squashfs image"):
        copy_image(str(source), str(tmp_path / "images"), chunk=64 << 10, progress=lambda c, t: reports.append(c))
    assert reports == []  # stopped in the first 64 KiB block
    assert leftovers(tmp_path / "images") == []


def test_missing_sources_are_named(served, gcs_bucket, tmp_path):
    server, _ = served
    url = server.url("nope.sqsh")
    with pytest.raises(ImageNotFound, match=re.escape(f"image source not found: {url} (HTTP 404)")):
        copy_image(url, str(tmp_path / "d"))
    with pytest.raises(ImageNotFound, match=f"no such object {gcs_bucket}/missing.sqsh"):
        copy_image(f"{gcs_bucket}/missing.sqsh", str(tmp_path / "d"))
    with pytest.raises(ImageNotFound, match="no such file /nonexistent/x.sqsh"):
        copy_image("/nonexistent/x.sqsh", str(tmp_path / "d"))
    with pytest.raises(ImageError, match="unsupported scheme s3://"):
        copy_image("s3://bucket/x.sqsh", str(tmp_path / "d"))
    assert not (tmp_path / "d").exists() or leftovers(tmp_path / "d") == []


def test_destination_not_writable(served, tmp_path):
    server, _ = served
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ImageDestinationError, match=f"destination {blocker}/images is not writable"):
        copy_image(server.url("nemo-test.sqsh"), str(blocker / "images"))
    with tmpfs(tmp_path / "ro", "size=4m,ro") as mount:
        with pytest.raises(ImageDestinationError, match=f"{mount}.*not writable"):
            copy_image(server.url("nemo-test.sqsh"), str(mount))
    assert server.count("/nemo-test.sqsh", "GET") == 0  # refused before any byte was fetched


def test_disk_too_small_is_refused_before_copying(served, tmp_path, sqsh_image):
    server, _ = served
    with tmpfs(tmp_path / "small", "size=1m") as mount:
        with pytest.raises(ImageDestinationError) as info:
            copy_image(server.url("nemo-test.sqsh"), str(mount))
        message = str(info.value)
        assert re.search(rf"needs 1\.\d MiB, (1\.0 MiB|\d+\.\d KiB) free on {mount}", message), message
        assert leftovers(mount) == []
    assert server.count("/nemo-test.sqsh", "GET") == 0


@pytest.mark.faults
def test_disk_full_mid_copy_leaves_nothing(tmp_path, sqsh_image):
    """No size known up front (chunked HTTP would do this): ENOSPC while writing is reported clearly."""
    row = fault_ledger.open_row("disk full (tmpfs) mid-way through a chunked image copy")
    import http.server
    import threading

    body = sqsh_image.read_bytes()

    class Chunked(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_HEAD(self):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

        def do_GET(self):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(0, len(body), 65536):
                part = body[i : i + 65536]
                self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Chunked)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with tmpfs(tmp_path / "small", "size=1m") as mount:
            with pytest.raises(ImageDestinationError, match=f"{mount} ran out of space"):
                copy_image(f"http://127.0.0.1:{httpd.server_address[1]}/chunked.sqsh", str(mount))
            row.injected += 1  # the copy ran out of space on the 1 MiB tmpfs (the error above says so)
            assert leftovers(mount) == []
    finally:
        httpd.shutdown()


# ---------------------------------------------------------------- registry references


@pytest.mark.parametrize(
    "reference, canonical, enroot",
    [
        ("docker://nvcr.io/nvidia/nemo:24.07", "nvcr.io/nvidia/nemo:24.07", "docker://nvcr.io#nvidia/nemo:24.07"),
        ("docker://nvcr.io#nvidia/nemo:24.07", "nvcr.io/nvidia/nemo:24.07", "docker://nvcr.io#nvidia/nemo:24.07"),
        ("ubuntu:22.04", "docker.io/library/ubuntu:22.04", "docker://registry-1.docker.io#library/ubuntu:22.04"),
        ("localhost:5000/team/img:v1", "localhost:5000/team/img:v1", "docker://localhost:5000#team/img:v1"),
        (
            "nvcr.io/nvidia/nemo:24.07@sha256:" + "cd" * 32,
            "nvcr.io/nvidia/nemo:24.07@sha256:" + "cd" * 32,
            "docker://nvcr.io#nvidia/nemo:sha256:" + "cd" * 32,  # the digest, not the movable tag
        ),
        (
            "ghcr.io/org/app@sha256:" + "ab" * 32,
            "ghcr.io/org/app@sha256:" + "ab" * 32,
            "docker://ghcr.io#org/app:sha256:" + "ab" * 32,
        ),
    ],
)
def test_docker_references_normalise_like_docker(reference, canonical, enroot):
    ref = parse_docker_ref(reference)
    assert ref.canonical == canonical
    assert ref.enroot_uri == enroot
    # enroot's grammar: docker://[REGISTRY#]IMAGE[:TAG], lowercase image, no '@'.
    assert re.fullmatch(r"docker://[^#@]+#[a-z0-9/._-]+:[A-Za-z0-9._:-]+", ref.enroot_uri)


@pytest.mark.parametrize(
    "reference, message",
    [
        ("docker://nvcr.io/nvidia/nemo", "has no tag or digest"),
        ("docker://nvcr.io/nvidia/NeMo:24.07", "repository names are lowercase"),
        ("docker://nvcr.io/nvidia/nemo:bad tag", "tag 'bad tag'"),
        ("docker://nvcr.io/nvidia/nemo@sha256:1234", "digest 'sha256:1234' is not sha256"),
        ("docker://nvcr.io/nvidia/nemo:24.07@md5:" + "a" * 32, "is not sha256"),
        ("docker://bad_host.io#nvidia/nemo:1", "registry 'bad_host.io'"),
        ("docker://user@nvcr.io#nvidia/nemo:1", "set NEMOFLOW_REGISTRY_USER"),
        ("docker://", "is empty"),
        ("docker://nvcr.io//nemo:1", "is not lowercase components"),
    ],
)
def test_malformed_docker_references(reference, message):
    with pytest.raises(ImageError, match=re.escape(message)) as info:
        parse_docker_ref(reference)
    assert repr(reference) in str(info.value)


def test_sqsh_name_is_distinct_per_registry_and_tag():
    names = {
        parse_docker_ref(r).sqsh_name
        for r in ("nvcr.io/nvidia/nemo:24.07", "nvcr.io/nvidia/nemo:25.02", "ghcr.io/nvidia/nemo:24.07")
    }
    assert len(names) == 3 and all(n.endswith(".sqsh") and "/" not in n for n in names)
    assert DockerRef("nvcr.io", "nvidia/nemo", "24.07").sqsh_name == "nvcr.io+nvidia+nemo+24.07.sqsh"


def test_progress_is_reported_during_long_copies(served, tmp_path, monkeypatch, sqsh_image):
    server, _ = served
    monkeypatch.setattr(copying, "PROGRESS_EVERY", 256 << 10)
    reports: list[tuple[int, int | None]] = []
    copy_image(
        server.url("nemo-test.sqsh"),
        str(tmp_path / "images"),
        chunk=64 << 10,
        progress=lambda c, t: reports.append((c, t)),
    )
    size = sqsh_image.stat().st_size
    assert len(reports) >= size // (256 << 10)
    assert [c for c, _ in reports] == sorted(c for c, _ in reports)
    assert reports[-1] == (size, size) and all(t == size for _, t in reports)


def test_interrupted_copies_are_cleaned_up_only_when_stale(served, tmp_path):
    server, _ = served
    dest = tmp_path / "images"
    dest.mkdir()
    stale = dest / ".tmp-0123456789ab-nemo-test.sqsh"
    stale.write_bytes(b"x" * 1000)
    os.utime(stale, (1, 1))
    live = dest / ".tmp-ba9876543210-nemo-test.sqsh"  # another copy still writing
    live.write_bytes(b"y" * 10)
    other = dest / ".tmp-0123456789ab-other.sqsh"
    other.write_bytes(b"z")
    os.utime(other, (1, 1))
    copy_image(server.url("nemo-test.sqsh"), str(dest))
    assert not stale.exists() and live.exists() and other.exists()


def test_local_source_cache_survives_touch_but_not_edit(sqsh_image, tmp_path):
    source = tmp_path / "fuse" / "nemo-test.sqsh"
    source.parent.mkdir()
    shutil.copyfile(sqsh_image, source)
    dest = tmp_path / "images"
    first = copy_image(str(source), str(dest))
    assert first.checksum == "sha256:" + sha256(sqsh_image)
    staged = os.stat(dest / "nemo-test.sqsh")

    assert copy_image(str(source), str(dest)).cached
    os.utime(source, (1_700_000_000, 1_700_000_000))  # touched (or re-mounted): same bytes, new stat
    touched = copy_image(str(source), str(dest))
    assert touched.cached
    assert os.stat(dest / "nemo-test.sqsh").st_ino == staged.st_ino
    meta = json.loads((dest / "nemo-test.sqsh.meta.json").read_text())
    assert meta["source_checksum"] == touched.source_checksum != first.source_checksum

    data = bytearray(source.read_bytes())
    data[-5000] ^= 0x01  # same size, different content
    source.write_bytes(bytes(data))
    edited = copy_image(str(source), str(dest))
    assert not edited.cached and edited.checksum == "sha256:" + hashlib.sha256(data).hexdigest()


def test_source_changing_during_the_copy_is_detected(sqsh_image, tmp_path, monkeypatch):
    source = tmp_path / "src" / "nemo-test.sqsh"
    source.parent.mkdir()
    shutil.copyfile(sqsh_image, source)
    monkeypatch.setattr(copying, "PROGRESS_EVERY", 256 << 10)

    def rewrite_source(copied, total):
        if copied < total:
            with open(source, "r+b") as fh:  # another process replacing the image in place
                fh.seek(100)
                fh.write(b"\0" * 16)

    dest = tmp_path / "images"
    with pytest.raises(ImageCorrupted, match="changed while it was being copied"):
        copy_image(str(source), str(dest), chunk=64 << 10, progress=rewrite_source)
    assert leftovers(dest) == []


def test_bucket_to_bucket_copy_is_server_side_and_verified(gcs_bucket, sqsh_image, kjv_chapters, tmp_path):
    src = f"{gcs_bucket}/containers/nemo-test.sqsh"
    storage.put_file(str(sqsh_image), src)
    dest = f"{gcs_bucket}/staged"
    staged = copy_image(src, dest)
    assert staged.checksum == "md5:" + md5(sqsh_image)
    assert storage.read_bytes(staged.uri) == sqsh_image.read_bytes()
    assert copy_image(src, dest).cached
    # Not a squashfs image: GCS copies it faithfully, the superblock check still refuses it.
    bogus = f"{gcs_bucket}/containers/bogus.sqsh"
    storage.write_text(bogus, kjv_chapters[0])
    with pytest.raises(ImageVerificationError, match="is not a squashfs image"):
        copy_image(bogus, dest)
    names = [storage.basename(u) for u in storage.listdir(dest)]
    assert names == ["nemo-test.sqsh", "nemo-test.sqsh.meta.json"]


@pytest.mark.faults
def test_signed_url_credentials_stay_out_of_logs_and_records(tmp_path, sqsh_image, counted_server):
    row = fault_ledger.open_row("http stall on a signed URL: image copy")
    server = counted_server(row)
    signature = "X-Goog-Signature=5e1f0c0ffee0ddba11"
    url = server.url("nemo-test.sqsh") + "?X-Goog-Credential=svc%40proj&" + signature
    server.add_faults("/nemo-test.sqsh", Fault(stall_at=1000, stall=0.3))  # a resume, with its log line
    lines: list[str] = []
    dest = tmp_path / "images"
    staged = copy_image(url, str(dest), log=lines.append)
    assert sha256(staged.uri) == sha256(sqsh_image)
    assert staged.source.endswith("/nemo-test.sqsh?<query hidden>")
    recorded = "\n".join(lines) + (dest / "nemo-test.sqsh.meta.json").read_text() + staged.source
    assert "5e1f0c0ffee0ddba11" not in recorded and "svc%40proj" not in recorded
    # A fresh signature for the same object is the same source: still a cache hit.
    assert copy_image(server.url("nemo-test.sqsh") + "?X-Goog-Signature=other", str(dest)).cached
    with pytest.raises(ImageNotFound) as info:
        copy_image(server.url("gone.sqsh") + "?" + signature, str(dest))
    assert "5e1f0c0ffee0ddba11" not in str(info.value)


def test_crc32c_only_sources_are_verified(sqsh_image, tmp_path):
    """Composite GCS objects state only a crc32c; the copy is checked against it."""
    import http.server
    import struct
    import threading

    hasher = images.new_hasher("crc32c")
    hasher.update(b"123456789")
    assert hasher.hexdigest() == "e3069283"  # the CRC-32C check value (RFC 3720, appendix B.4)

    body = sqsh_image.read_bytes()
    import google_crc32c

    good = base64.b64encode(struct.pack(">I", google_crc32c.value(body))).decode()
    stated = {"/good.sqsh": good, "/bad.sqsh": base64.b64encode(b"\0\0\0\1").decode()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _headers(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("x-goog-hash", f"crc32c={stated[self.path]}")
            self.end_headers()

        def do_HEAD(self):
            self._headers()

        def do_GET(self):
            self._headers()
            self.wfile.write(body)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        staged = copy_image(f"{base}/good.sqsh", str(tmp_path / "a"))
        assert staged.checksum == "crc32c:" + base64.b64decode(good).hex()
        with pytest.raises(ImageCorrupted, match="the source states crc32c:00000001"):
            copy_image(f"{base}/bad.sqsh", str(tmp_path / "b"))
        assert leftovers(tmp_path / "b") == []
    finally:
        httpd.shutdown()

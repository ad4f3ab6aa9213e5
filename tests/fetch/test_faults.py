"""Faults injected into shard downloads against real local services (``pytest -m faults``).

GCS faults come from a fault proxy in front of the real GCS emulator (gcsfs talks HTTP to it);
a host name that cannot resolve is a ``.invalid`` name (RFC 2606); a full disk is a small tmpfs.
Each test checks that the run tells the truth (verified output, or one clear line and nothing
half-written under the final name); its row in the fault table counts what the fault servers served.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import pytest

from infra import storage
from infra.fetch import FetchError, NotFound, download, probe
from tests.conftest import REPO
from tests.support import fault_ledger
from tests.support.fault_proxy import does_not_resolve, gcs_behind, unresolvable_gcs
from tests.support.fault_server import Fault
from tests.support.tmpfs import is_full, resize, tmpfs

from .conftest import SHARD

pytestmark = [pytest.mark.faults]

OBJECT = "raw/chunk1/example_train_0.jsonl.zst"
META = r"^GET /storage/v1/b/[^/]+/o/raw%2Fchunk1%2Fexample_train_0\.jsonl\.zst"
MEDIA = r"^GET /download/storage/v1/b/[^/]+/o/raw%2Fchunk1%2Fexample_train_0\.jsonl\.zst"


def one_line(text: str) -> None:
    assert "\n" not in text and "Traceback" not in text, text


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.gcs
def test_shard_download_survives_gcs_5xx_429_resets_and_timeouts(gcs_endpoint, gcs_bucket, tmp_path):
    data = bytes(range(256)) * 80_000  # 20 MB: three 8 MiB range reads, so a resume skips finished blocks
    uri = f"{gcs_bucket}/{OBJECT}"
    storage.write_bytes(uri, data)
    row = fault_ledger.open_row("gcs 5xx/429/reset/timeout: shard download")
    faults = {
        META: [Fault(status=503)],
        MEDIA: [
            Fault(status=500),
            Fault(status=429, retry_after="1"),
            Fault(),  # the first block arrives whole
            Fault(reset_at=1_000_000),  # the second block's connection is reset
            Fault(delay=3.0),  # no answer within the 1 s timeout
            Fault(status=502),
        ],
    }
    lines: list[str] = []
    with gcs_behind(gcs_endpoint) as proxy:
        for pattern, queued in faults.items():
            proxy.add_faults(pattern, *queued)
        started = time.monotonic()
        result = download(uri, str(tmp_path / "x.zst"), backoff=0.05, max_backoff=2, timeout=1, log=lines.append)
        elapsed = time.monotonic() - started
        media = proxy.seen(MEDIA)
        injected = proxy.injected_count() - sum(1 for i in proxy.injected if i.fault == Fault())
        row.injected += injected
    row.compare({OBJECT: sha256(data)}, {OBJECT: sha256((tmp_path / "x.zst").read_bytes())})
    assert (tmp_path / "x.zst").read_bytes() == data
    assert result.sha256 == hashlib.sha256(data).hexdigest() and not result.skipped
    assert injected == 6 and proxy.pending() == 0
    assert result.attempts == 7  # 1 + 6 failed attempts (the reset block and the timeout each cost one)
    # Resumed at the 8 MiB block boundary, never from byte 0: the finished block is not fetched again.
    ranges = [r.headers.get("Range") for r in media]
    assert ranges[:3] == ["bytes=0-8388607"] * 3
    assert ranges[3:] == ["bytes=8388608-16777215"] * 4 + [f"bytes=16777216-{len(data) - 1}"]
    assert elapsed >= 1.0  # the 429's Retry-After: 1 was honoured
    assert any("retrying in 1.0s" in line for line in lines)
    assert not (tmp_path / "x.zst.part").exists()


@pytest.mark.gcs
@pytest.mark.parametrize("status", [401, 403])
def test_gcs_credentials_refused_fail_at_once_in_one_line(gcs_endpoint, gcs_bucket, tmp_path, status):
    uri = f"{gcs_bucket}/{OBJECT}"
    storage.write_bytes(uri, b"x" * 1000)
    bucket = gcs_bucket.removeprefix("gs://")
    row = fault_ledger.open_row(f"gcs {status}: shard download")
    with gcs_behind(gcs_endpoint) as proxy:
        # Every object request in the bucket is refused (gcsfs also lists the prefix when it stats).
        proxy.add_faults(rf"^GET /(download/)?storage/v1/b/{bucket}/o", *[Fault(status=status)] * 50)
        started = time.monotonic()
        with pytest.raises(FetchError) as err:
            download(uri, str(tmp_path / "x.zst"), backoff=5)
        with pytest.raises(FetchError) as probed:
            probe(uri)
        elapsed = time.monotonic() - started
        row.injected += proxy.injected_count()
        assert proxy.count(META + "$") == 2  # one metadata request each: refused credentials are not retried
    row.compare({OBJECT: sha256(b"x" * 1000)}, {OBJECT: sha256(storage.read_bytes(uri))})  # the source is intact
    message = str(err.value)
    one_line(message)
    assert f"{gcs_bucket}/{OBJECT}" in message and f"object '{OBJECT}'" in message
    assert ("cannot authenticate to GCS" if status == 401 else "access denied") in message
    assert str(probed.value) == message
    assert elapsed < 2
    assert not any(tmp_path.iterdir())


@pytest.mark.gcs
def test_missing_gcs_object_or_bucket_fails_at_once(gcs_bucket, tmp_path):
    row = fault_ledger.open_row("gcs object or bucket missing: shard download")
    for uri in (f"{gcs_bucket}/raw/missing.zst", "gs://nemoflow-no-such-bucket/raw/x.zst"):
        started = time.monotonic()
        with pytest.raises(NotFound, match=f"^not found: {uri}$"):
            download(uri, str(tmp_path / "x.zst"), backoff=5)
        row.injected += 1
        assert time.monotonic() - started < 2
    assert not any(tmp_path.iterdir())


def test_unresolvable_gcs_host_is_retried_briefly_then_one_line(tmp_path):
    row = fault_ledger.open_row("gcs host does not resolve: shard download")
    with unresolvable_gcs() as host:
        row.injected += does_not_resolve(host)
        started = time.monotonic()
        with pytest.raises(FetchError) as err:
            download("gs://bucket/raw/x.jsonl.zst", str(tmp_path / "x.zst"), backoff=0.2)
        elapsed = time.monotonic() - started
    message = str(err.value)
    one_line(message)
    assert "giving up on gs://bucket/raw/x.jsonl.zst after 3 attempts" in message
    assert f"cannot resolve host '{host}'" in message
    assert err.value.transient is False  # a task retry would not resolve it either
    assert elapsed < 5
    assert not any(tmp_path.iterdir())


def test_cli_with_unresolvable_gcs_prints_one_error_line(tmp_path):
    """What a user sees: a few progress lines and one FAILED line naming the object, no traceback."""
    row = fault_ledger.open_row("gcs host does not resolve: nemoflow fetch CLI")
    row.injected += does_not_resolve("nemoflow-gcs.invalid")
    env = {"NEMOFLOW_GCS_ENDPOINT": "http://nemoflow-gcs.invalid:9023", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "fetch", "gs://bucket/raw/x.jsonl.zst", "--dest", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 1
    lines = run.stderr.splitlines()
    failed = [line for line in lines if "FAILED" in line]
    assert len(failed) == 1 and "gs://bucket/raw/x.jsonl.zst" in failed[0] and "cannot resolve host" in failed[0]
    assert "Traceback" not in run.stderr and len(lines) <= 6, run.stderr
    assert elapsed < 30


def test_disk_full_mid_download_then_a_rerun_resumes(server, corpus, tmp_path):
    """ENOSPC while writing: one line, no file under the final name; with space, only the rest is fetched."""
    shards = ["/train/chunk1/example_train_0.jsonl.zst", "/train/chunk1/example_train_1.jsonl.zst"]
    sizes = [(corpus / s.lstrip("/")).stat().st_size for s in shards]
    row = fault_ledger.open_row("disk full (tmpfs): shard download")
    with tmpfs(tmp_path / "disk", "size=512k") as disk:
        dests = [disk / "chunk1" / s.rsplit("/", 1)[1] for s in shards]
        first = download(server.url(shards[0]), str(dests[0]))
        before = fault_ledger.checksums(dests[0])  # what existed before the disk filled up
        with pytest.raises(FetchError) as err:
            download(server.url(shards[1]), str(dests[1]))
        row.injected += is_full(disk)  # ENOSPC for real, not a simulated error
        message = str(err.value)
        one_line(message)
        assert "ran out of space" in message and "a new run continues from there" in message
        assert not dests[1].exists()  # nothing under the final name
        kept = (disk / "chunk1" / "example_train_1.jsonl.zst.part").stat().st_size
        assert 0 < kept < sizes[1]
        resize(disk, "4m")
        gets_before = server.count()
        again = [download(server.url(s), str(d)) for s, d in zip(shards, dests)]
        row.compare(before, fault_ledger.checksums(dests[0]))
    assert again[0].skipped and again[0].sha256 == first.sha256  # finished work is not redone
    assert not again[1].skipped and again[1].attempts == 1
    resumed = server.requests_for(shards[1])[-1]
    assert resumed.headers["Range"] == f"bytes={kept}-" and resumed.status == 206
    assert server.count() == gets_before + 1
    assert again[1].sha256 == hashlib.sha256((corpus / shards[1].lstrip("/")).read_bytes()).hexdigest()


def test_http_faults_counted(server, corpus, tmp_path):
    """The HTTP fault server's faults through the same stack, counted for the summary."""
    faults = [Fault(status=503, retry_after="0"), Fault(reset_at=50_000), Fault(delay=2.0), Fault(truncate_at=9000)]
    row = fault_ledger.open_row("http 503/reset/timeout/truncation: shard download")
    server.add_faults(SHARD, *faults)
    result = download(server.url(SHARD), str(tmp_path / "x.zst"), backoff=0.01, timeout=1)
    row.injected += server.injected_count(SHARD)
    source, copy = (corpus / SHARD.lstrip("/")).read_bytes(), (tmp_path / "x.zst").read_bytes()
    row.compare({SHARD: sha256(source)}, {SHARD: sha256(copy)})
    assert (tmp_path / "x.zst").read_bytes() == (corpus / SHARD.lstrip("/")).read_bytes()
    assert result.attempts == len(faults) + 1


def test_unresolvable_gcs_glob_fails_in_one_line():
    from infra.sources import SourceError, expand_sources

    row = fault_ledger.open_row("gcs host does not resolve: source glob")
    with unresolvable_gcs() as host:
        row.injected += does_not_resolve(host)
        started = time.monotonic()
        with pytest.raises(SourceError) as err:
            expand_sources("gs://bucket/raw/*.jsonl.zst")
    one_line(str(err.value))
    assert str(err.value).startswith("cannot expand 'gs://bucket/raw/*.jsonl.zst': cannot list gs://bucket/raw/")
    assert f"cannot resolve host '{host}'" in str(err.value)
    assert time.monotonic() - started < 5

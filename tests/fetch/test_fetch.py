"""infra.fetch against a real local HTTP server that injects faults, and the real GCS emulator."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import time

import pytest

from infra import storage
from infra.fetch import FetchError, NotFound, download, is_hf_host, probe
from tests.support import fault_ledger
from tests.support.fault_server import Fault, FaultServer

from .conftest import SHARD

FAST = dict(backoff=0.01, max_backoff=0.05, timeout=2)


def source_bytes(corpus, path=SHARD) -> bytes:
    return (corpus / path.lstrip("/")).read_bytes()


@pytest.mark.parametrize(
    "faults",
    [
        pytest.param([Fault(status=429, retry_after="0")], id="429"),
        pytest.param([Fault(status=500), Fault(status=503)], id="500-503"),
        pytest.param([Fault(status=408)], id="408"),
        pytest.param([Fault(truncate_at=150_000)], id="truncated-body"),
        pytest.param([Fault(reset_at=150_000)], id="connection-reset"),
        pytest.param([Fault(delay=3.0)], id="slow-headers-timeout"),
        pytest.param([Fault(stall_at=100_000, stall=3.0)], id="stalled-body-timeout"),
        pytest.param([Fault(truncate_at=150_000), Fault(reset_at=80_000), Fault(status=502)], id="mixed"),
    ],
)
@pytest.mark.faults
def test_each_fault_recovers_byte_identical(server, corpus, tmp_path, faults):
    row = fault_ledger.open_row("http fault injected into a shard download (recovered)")
    row.injected_from(server.injected_count)
    server.add_faults(SHARD, *faults)
    lines: list[str] = []
    dest = tmp_path / "dl" / "chunk1" / "example_train_0.jsonl.zst"
    result = download(server.url(SHARD), str(dest), **{**FAST, "timeout": 1}, log=lines.append)
    assert dest.read_bytes() == source_bytes(corpus)
    assert result.attempts == len(faults) + 1 == server.count(SHARD)
    assert result.sha256 == hashlib.sha256(source_bytes(corpus)).hexdigest()
    assert not result.skipped
    assert not (tmp_path / "dl" / "chunk1" / "example_train_0.jsonl.zst.part").exists()
    failures = [line for line in lines if "attempt" in line and "failed" in line]
    assert len(failures) == len(faults)
    assert all(line.startswith("chunk1/example_train_0.jsonl.zst: ") for line in lines)


@pytest.mark.faults
def test_wrong_checksum_header_restarts_then_verifies(corpus, tmp_path):
    with FaultServer(corpus, checksums=("x-goog-hash", "content-md5", "x-linked-etag")) as srv:
        row = fault_ledger.open_row("http bad checksum header: shard download")
        row.injected_from(srv.injected_count)
        srv.add_faults(SHARD, Fault(bad_checksum=True))
        lines: list[str] = []
        result = download(srv.url(SHARD), str(tmp_path / "x.zst"), **FAST, log=lines.append)
        assert result.attempts == 2
        assert any("mismatch" in line for line in lines)
        assert srv.requests_for(SHARD)[1].headers.get("Range") is None  # bad bytes are never resumed from
    assert (tmp_path / "x.zst").read_bytes() == source_bytes(corpus)


@pytest.mark.faults
def test_checksum_that_never_matches_fails_and_leaves_nothing(corpus, tmp_path):
    with FaultServer(corpus, checksums=("x-linked-etag",), always={SHARD: Fault(bad_checksum=True)}) as srv:
        row = fault_ledger.open_row("http checksum never matching: shard download")
        row.injected_from(srv.injected_count)
        with pytest.raises(FetchError, match="sha256 mismatch"):
            download(srv.url(SHARD), str(tmp_path / "dl" / "x.zst"), **FAST)
        assert srv.count(SHARD) == 3  # content errors stop after a couple of full restarts, not 8
    assert list((tmp_path / "dl").iterdir()) == []


def test_expected_sha256_is_enforced(server, tmp_path):
    with pytest.raises(FetchError, match="sha256 mismatch: expected_sha256 says 0+") as err:
        download(server.url(SHARD), str(tmp_path / "x.zst"), expected_sha256="0" * 64, **FAST)
    assert server.url(SHARD) in str(err.value)
    assert not (tmp_path / "x.zst").exists()


@pytest.mark.faults
def test_resume_sends_range_and_ends_identical(server, corpus, tmp_path):
    row = fault_ledger.open_row("http truncated body: resumed with Range")
    row.injected_from(server.injected_count)
    server.add_faults(SHARD, Fault(truncate_at=300_000))
    dest = tmp_path / "x.zst"
    download(server.url(SHARD), str(dest), **FAST)
    first, second = server.requests_for(SHARD)
    assert "Range" not in first.headers
    offset = int(second.headers["Range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < offset <= 300_000
    assert second.status == 206
    assert second.headers["If-Range"] == f'"{hashlib.sha256(source_bytes(corpus)).hexdigest()}"'
    assert dest.read_bytes() == source_bytes(corpus)


@pytest.mark.faults
def test_resume_across_calls_after_giving_up(server, corpus, tmp_path):
    """A crashed or abandoned download leaves <dest>.part; the next call continues from it."""
    row = fault_ledger.open_row("http reset then 503: resumed by a second call")
    row.injected_from(server.injected_count)
    server.add_faults(SHARD, Fault(reset_at=200_000), Fault(status=503))
    dest = tmp_path / "x.zst"
    with pytest.raises(FetchError, match="after 2 attempts: HTTP 503"):
        download(server.url(SHARD), str(dest), retries=1, **FAST)
    part = tmp_path / "x.zst.part"
    assert part.exists() and 0 < part.stat().st_size < len(source_bytes(corpus))
    assert not dest.exists()  # never a partial file under the final name
    kept = part.stat().st_size
    result = download(server.url(SHARD), str(dest), **FAST)
    last = server.requests_for(SHARD)[-1]
    assert last.headers["Range"] == f"bytes={kept}-" and last.status == 206
    assert result.attempts == 1
    assert dest.read_bytes() == source_bytes(corpus)


@pytest.mark.faults
def test_server_without_ranges_restarts_cleanly(corpus, tmp_path):
    with FaultServer(corpus, ranges=False) as srv:
        row = fault_ledger.open_row("http truncated body, server without ranges")
        row.injected_from(srv.injected_count)
        srv.add_faults(SHARD, Fault(truncate_at=250_000))
        download(srv.url(SHARD), str(tmp_path / "x.zst"), **FAST)
        second = srv.requests_for(SHARD)[1]
        assert second.headers.get("Range") and second.status == 200
    assert (tmp_path / "x.zst").read_bytes() == source_bytes(corpus)


@pytest.mark.faults
def test_file_changed_between_attempts_is_fetched_whole(server, corpus, tmp_path):
    """If-Range carries the old ETag; the server answers 200 with the new file, never a mix."""
    row = fault_ledger.open_row("http truncated body, file changed before the retry")
    row.injected_from(server.injected_count)
    other = (corpus / "train/chunk2/example_train_1.jsonl.zst").read_bytes()
    target = corpus / SHARD.lstrip("/")
    server.add_faults(SHARD, Fault(truncate_at=250_000), Fault(before=lambda: target.write_bytes(other)))
    dest = tmp_path / "x.zst"
    result = download(server.url(SHARD), str(dest), **FAST)
    second = server.requests_for(SHARD)[1]
    assert second.headers.get("If-Range") and second.status == 200
    assert dest.read_bytes() == other
    assert result.sha256 == hashlib.sha256(other).hexdigest()


@pytest.mark.faults
def test_retry_after_is_honoured_and_capped(server, tmp_path):
    row = fault_ledger.open_row("http 429/503 with Retry-After")
    row.injected_from(server.injected_count)
    server.add_faults(SHARD, Fault(status=429, retry_after="1"))
    t0 = time.monotonic()
    download(server.url(SHARD), str(tmp_path / "a.zst"), backoff=0.001, timeout=5)
    assert time.monotonic() - t0 >= 0.95
    # An HTTP date two seconds ahead also waits (about one second at least, given 1 s resolution).
    server.add_faults(SHARD, Fault(status=503, retry_after=email.utils.formatdate(time.time() + 2, usegmt=True)))
    t0 = time.monotonic()
    download(server.url(SHARD), str(tmp_path / "b.zst"), backoff=0.001, timeout=5)
    assert time.monotonic() - t0 >= 0.9
    # An hour is capped at max_backoff.
    server.add_faults(SHARD, Fault(status=429, retry_after="3600"))
    t0 = time.monotonic()
    download(server.url(SHARD), str(tmp_path / "c.zst"), backoff=0.001, max_backoff=0.2, timeout=5)
    assert time.monotonic() - t0 < 5


def test_404_fails_at_once_naming_the_url(server, tmp_path):
    url = server.url("/train/chunk9/example_train_0.jsonl.zst")
    t0 = time.monotonic()
    with pytest.raises(NotFound, match=f"not found: {url}$"):
        download(url, str(tmp_path / "x.zst"), retries=8, backoff=5)
    assert time.monotonic() - t0 < 2
    assert server.count("/train/chunk9/example_train_0.jsonl.zst") == 1


@pytest.mark.faults
def test_other_4xx_fail_at_once(server, tmp_path):
    row = fault_ledger.open_row("http 403: fails at once")
    row.injected_from(server.injected_count)
    server.add_faults(SHARD, Fault(status=403))
    with pytest.raises(FetchError, match="HTTP 403"):
        download(server.url(SHARD), str(tmp_path / "x.zst"), retries=8, backoff=5)
    assert server.count(SHARD) == 1


@pytest.mark.faults
def test_persistent_5xx_gives_up_after_retries(corpus, tmp_path):
    with FaultServer(corpus, always={SHARD: Fault(status=500)}) as srv:
        row = fault_ledger.open_row("http persistent 500: gives up after retries")
        row.injected_from(srv.injected_count)
        with pytest.raises(FetchError, match=r"example_train_0.jsonl.zst: giving up on .* after 4 attempts: HTTP 500"):
            download(srv.url(SHARD), str(tmp_path / "example_train_0.jsonl.zst"), retries=3, **FAST)
        assert srv.count(SHARD) == 4
    assert not (tmp_path / "example_train_0.jsonl.zst").exists()


@pytest.mark.faults
def test_verified_file_is_not_fetched_again(server, corpus, tmp_path):
    row = fault_ledger.open_row("downloaded file corrupted on disk (one flipped byte): repaired")
    dest = tmp_path / "x.zst"
    first = download(server.url(SHARD), str(dest), **FAST)
    meta = storage.read_json(str(dest) + ".meta.json")
    assert meta["sha256"] == first.sha256 and meta["size"] == len(source_bytes(corpus))
    again = download(server.url(SHARD), str(dest), **FAST)
    assert again.skipped and again.attempts == 0 and again.sha256 == first.sha256
    assert server.count(SHARD) == 1 and server.count(SHARD, method="HEAD") == 0
    # Same size, one byte different: the sidecar no longer vouches for it.
    data = bytearray(dest.read_bytes())
    data[1000] ^= 0xFF
    dest.write_bytes(bytes(data))
    row.injected += dest.read_bytes() != source_bytes(corpus)
    repaired = download(server.url(SHARD), str(dest), **FAST)
    assert not repaired.skipped and server.count(SHARD) == 2
    assert dest.read_bytes() == source_bytes(corpus)
    # A different expected checksum than the recorded one is not "verified" either.
    with pytest.raises(FetchError):
        download(server.url(SHARD), str(dest), expected_sha256="1" * 64, **FAST)


def test_file_placed_by_hand_is_adopted_only_with_a_matching_checksum(server, corpus, tmp_path):
    data = source_bytes(corpus)
    dest = tmp_path / "x.zst"
    dest.write_bytes(data)
    result = download(server.url(SHARD), str(dest), expected_sha256=hashlib.sha256(data).hexdigest(), **FAST)
    assert result.skipped and server.count(SHARD) == 0
    assert storage.read_json(str(dest) + ".meta.json")["sha256"] == hashlib.sha256(data).hexdigest()
    other = tmp_path / "y.zst"
    other.write_bytes(data)  # without a checksum to compare with, a stray file is not trusted
    assert not download(server.url(SHARD), str(other), **FAST).skipped and server.count(SHARD) == 1


def test_progress_reports_reach_the_total(server, corpus, tmp_path):
    seen: list[tuple[int, int | None]] = []
    download(server.url(SHARD), str(tmp_path / "x.zst"), progress=lambda done, total: seen.append((done, total)))
    size = len(source_bytes(corpus))
    assert seen[-1] == (size, size)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


# ----------------------------------------------------------------------- Hugging Face token


@pytest.mark.parametrize(
    ("url", "hf"),
    [
        ("https://huggingface.co/datasets/x/resolve/main/a.zst", True),
        ("https://cdn-lfs.huggingface.co/repos/ab/cd", True),
        ("https://hf.co/x", True),
        ("https://cas-bridge.xethub.hf.co/xet-bridge/abc", True),
        ("https://HuggingFace.co./x", True),
        ("https://huggingface.co.evil.example/x", False),
        ("https://nothuggingface.co/x", False),
        ("https://example.org/huggingface.co/x", False),
        ("https://evil.example/?u=https://huggingface.co", False),
    ],
)
def test_hf_host_detection(url, hf):
    assert is_hf_host(url) is hf


def test_token_goes_only_to_hugging_face(server, corpus, tmp_path, map_hosts, hf_token):
    map_hosts("huggingface.co", "cdn.example.org", "mirror.example.org")
    logs: list[str] = []
    # Hugging Face resolve URLs redirect to a CDN on another host: the header must not follow.
    server.add_faults(SHARD, Fault(redirect=server.url(SHARD, host="cdn.example.org")))
    hf_url = server.url(SHARD, host="huggingface.co")
    download(hf_url, str(tmp_path / "hf.zst"), **FAST, log=logs.append)
    download(server.url(SHARD, host="mirror.example.org"), str(tmp_path / "mirror.zst"), **FAST, log=logs.append)
    hf_req, cdn_req, mirror_req = server.requests_for(SHARD)
    assert hf_req.host.startswith("huggingface.co") and hf_req.headers["Authorization"] == f"Bearer {hf_token}"
    assert cdn_req.host.startswith("cdn.example.org") and "Authorization" not in cdn_req.headers
    assert mirror_req.host.startswith("mirror.example.org") and "Authorization" not in mirror_req.headers
    assert (tmp_path / "hf.zst").read_bytes() == (tmp_path / "mirror.zst").read_bytes() == source_bytes(corpus)
    assert logs and not any(hf_token in line for line in logs)


@pytest.mark.faults
def test_secrets_never_in_errors_or_logs(server, tmp_path, map_hosts, hf_token):
    row = fault_ledger.open_row("http 503/reset with secrets in the URL and headers")
    row.injected_from(server.injected_count)
    map_hosts("huggingface.co")
    missing = "/train/chunk9/example_train_0.jsonl.zst"
    signed = server.url(missing, host="huggingface.co") + "?X-Amz-Signature=sigSECRET42&token=qsSECRET43"
    logs: list[str] = []
    with pytest.raises(NotFound) as err:
        download(signed, str(tmp_path / "x.zst"), log=logs.append)
    assert server.requests_for(missing)[0].headers["Authorization"] == f"Bearer {hf_token}"
    server.add_faults(SHARD, Fault(status=503), Fault(reset_at=10))
    with pytest.raises(FetchError) as err2:
        download(
            server.url(SHARD, host="huggingface.co") + "?token=qsSECRET44",
            str(tmp_path / "y.zst"),
            retries=1,
            log=logs.append,
            **FAST,
        )
    text = " ".join([str(err.value), repr(err.value), str(err2.value), *logs])
    for secret in (hf_token, "sigSECRET42", "qsSECRET43", "qsSECRET44"):
        assert secret not in text
    assert "not found: http://huggingface.co:" in str(err.value) and "X-Amz-Signature=***" in str(err.value)
    with pytest.raises(NotFound) as err3:
        probe(signed)
    assert "sigSECRET42" not in str(err3.value) and hf_token not in str(err3.value)


# ----------------------------------------------------------------------- probe, GCS, files


def test_probe_http_states_identity_without_downloading(corpus, tmp_path):
    data = source_bytes(corpus)
    with FaultServer(corpus, checksums=("x-goog-hash", "x-linked-etag")) as srv:
        info = probe(srv.url(SHARD))
        assert srv.count(SHARD) == 0 and srv.count(SHARD, method="HEAD") == 1
        with pytest.raises(NotFound, match="not found"):
            probe(srv.url("/nope.zst"))
    assert info.size == len(data)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.md5 == hashlib.md5(data).hexdigest()
    assert info.etag and info.last_modified


def test_probe_falls_back_to_a_one_byte_get_when_head_is_refused(corpus):
    with FaultServer(corpus, head=False) as srv:
        info = probe(srv.url(SHARD))
        head, get = srv.requests_for(SHARD)
    assert (head.method, head.status, get.method, get.status) == ("HEAD", 405, "GET", 206)
    assert get.headers["Range"] == "bytes=0-0"
    assert info.size == len(source_bytes(corpus))


def test_gcs_source_to_local(gcs_bucket, corpus, tmp_path):
    data = source_bytes(corpus)
    uri = f"{gcs_bucket}/raw/chunk1/example_train_0.jsonl.zst"
    storage.put_file(str(corpus / SHARD.lstrip("/")), uri)
    info = probe(uri)
    assert info.size == len(data) and info.md5 == hashlib.md5(data).hexdigest()
    result = download(uri, str(tmp_path / "x.zst"), **FAST)
    assert (tmp_path / "x.zst").read_bytes() == data and result.attempts == 1
    with pytest.raises(NotFound, match=f"not found: {gcs_bucket}/raw/missing.zst"):
        download(f"{gcs_bucket}/raw/missing.zst", str(tmp_path / "y.zst"), **FAST)


@pytest.mark.faults
def test_http_to_gcs_destination(server, corpus, gcs_bucket):
    row = fault_ledger.open_row("http truncated body: download to a gs:// destination")
    row.injected_from(server.injected_count)
    dest = f"{gcs_bucket}/raw/chunk1/example_train_0.jsonl.zst"
    server.add_faults(SHARD, Fault(truncate_at=200_000))
    first = download(server.url(SHARD), dest, **FAST)
    assert storage.read_bytes(dest) == source_bytes(corpus) and first.attempts == 2
    meta = storage.read_json(dest + ".meta.json")
    remote_md5 = base64.b64decode(storage.info(dest)["md5Hash"]).hex()
    assert meta["md5"] == remote_md5 == hashlib.md5(source_bytes(corpus)).hexdigest()
    again = download(server.url(SHARD), dest, **FAST)
    assert again.skipped and server.count(SHARD) == 2
    assert [u for u in storage.listdir(f"{gcs_bucket}/raw/chunk1") if storage.TMP_MARK in u] == []


def test_plain_path_and_file_uri_are_copied(corpus, tmp_path):
    src = corpus / SHARD.lstrip("/")
    download(str(src), str(tmp_path / "a.zst"))
    download(f"file://{src}", str(tmp_path / "b.zst"))
    assert (tmp_path / "a.zst").read_bytes() == (tmp_path / "b.zst").read_bytes() == src.read_bytes()
    with pytest.raises(NotFound, match="not found: .*missing.zst"):
        download(str(corpus / "missing.zst"), str(tmp_path / "c.zst"))
    with pytest.raises(FetchError, match="unsupported scheme 's3'"):
        download("s3://bucket/x.zst", str(tmp_path / "d.zst"))


def test_redirect_loop_fails_without_retrying(server, tmp_path):
    server.add_faults(SHARD, *[Fault(redirect=server.url(SHARD))] * 40)
    with pytest.raises(FetchError, match="cannot fetch .*redirects"):
        download(server.url(SHARD), str(tmp_path / "x.zst"), retries=8, backoff=5)
    assert server.count(SHARD) == 31  # requests' own redirect limit (30), one call, no retry


class Crash(BaseException):
    """Stands in for a killed worker: not an Exception, so nothing retries it."""


def _crash_after(limit: int):
    def progress(done: int, total: int | None) -> None:
        if done >= limit:
            raise Crash()

    return progress


def test_crash_mid_download_resumes_over_http(server, corpus, tmp_path):
    dest = tmp_path / "x.zst"
    with pytest.raises(Crash):
        download(server.url(SHARD), str(dest), progress=_crash_after(1))
    kept = (tmp_path / "x.zst.part").stat().st_size
    assert 0 < kept < len(source_bytes(corpus)) and not dest.exists()
    result = download(server.url(SHARD), str(dest), **FAST)
    assert server.requests_for(SHARD)[-1].headers["Range"] == f"bytes={kept}-"
    assert result.attempts == 1 and dest.read_bytes() == source_bytes(corpus)


def test_crash_after_the_last_byte_verifies_without_refetching(server, corpus, tmp_path):
    """The .part is complete but uncommitted: the resume asks for bytes=N-, gets 416 */N, and verifies."""
    size = len(source_bytes(corpus))
    with pytest.raises(Crash):
        download(server.url(SHARD), str(tmp_path / "x.zst"), progress=_crash_after(size))
    assert (tmp_path / "x.zst.part").stat().st_size == size and not (tmp_path / "x.zst").exists()
    result = download(server.url(SHARD), str(tmp_path / "x.zst"), expected_size=size, **FAST)
    last = server.requests_for(SHARD)[-1]
    assert (last.headers["Range"], last.status) == (f"bytes={size}-", 416)
    assert result.attempts == 1 and (tmp_path / "x.zst").read_bytes() == source_bytes(corpus)


def test_crash_mid_download_resumes_from_gcs(gcs_bucket, tmp_path):
    data = bytes(range(256)) * 40_000  # 10 MB: several 8 MB reads
    uri = f"{gcs_bucket}/raw/big.bin"
    storage.write_bytes(uri, data)
    dest = tmp_path / "big.bin"
    with pytest.raises(Crash):
        download(uri, str(dest), progress=_crash_after(1))
    kept = (tmp_path / "big.bin.part").stat().st_size
    assert 0 < kept < len(data)
    lines: list[str] = []
    download(uri, str(dest), log=lines.append)
    assert any(f"resuming at byte {kept}" in line for line in lines)
    assert dest.read_bytes() == data


def test_concurrent_downloads_of_one_file_fetch_it_once(server, corpus, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    server.add_faults(SHARD, Fault(delay=0.5))  # the first GET is slow, so the others must wait
    dest = str(tmp_path / "x.zst")
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: download(server.url(SHARD), dest, **FAST), range(4)))
    assert server.count(SHARD) == 1
    assert sorted(r.skipped for r in results) == [False, True, True, True]
    assert (tmp_path / "x.zst").read_bytes() == source_bytes(corpus)


@pytest.mark.faults
def test_refused_hugging_face_request_hints_at_the_token(server, tmp_path, map_hosts, monkeypatch):
    row = fault_ledger.open_row("http 401 from Hugging Face")
    row.injected_from(server.injected_count)
    from infra.settings import reload_settings

    for var in ("HF_TOKEN", "NEMOFLOW_HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # no .env from the developer's directory
    reload_settings()
    map_hosts("huggingface.co")
    server.add_faults(SHARD, Fault(status=401))
    with pytest.raises(FetchError, match="HTTP 401 .*set HF_TOKEN"):
        download(server.url(SHARD, host="huggingface.co"), str(tmp_path / "x.zst"), **FAST)
    assert server.count(SHARD) == 1
    assert "Authorization" not in server.requests_for(SHARD)[0].headers
    monkeypatch.undo()
    reload_settings()

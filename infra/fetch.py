"""Download one dataset file robustly: resume, retry, verify, then commit atomically.

    from infra.fetch import download, probe
    result = download("https://huggingface.co/.../chunk1/example_train_0.jsonl.zst",
                      "gs://bucket/raw/chunk1/example_train_0.jsonl.zst", log=print)

Sources: ``https://`` / ``http://``, ``gs://``, ``file://`` or a plain path, read by the one
transfer stack (infra/transfer/: probe, resumable verified copy, retries through infra/retry.py
policies, redaction). Destinations: a local path or any URI infra.storage writes (``gs://``: the
file is staged locally, verified, then uploaded). What this module adds for dataset shards:

* A verified copy already at the destination is not fetched again. "Verified" is decided by a
  sidecar ``<dest>.meta.json`` (url digest, size, sha256, md5, etag) checked against the file
  itself (its sha256 locally, size + md5/crc32c on GCS), never by mtime. A local file without
  a sidecar is adopted only when ``expected_sha256`` matches it. Concurrent calls for one
  destination on one machine wait for each other (flock) instead of writing one ``.part`` twice.
* Bytes go to ``<dest>.part``, and ``<dest>.part.state.json`` records the source's validator
  (ETag / Last-Modified / GCS generation). A later call (after a crash, a give-up or a full
  disk) continues from the bytes kept: ``Range: bytes=N-`` with ``If-Range``; a ``200`` (no range
  support, or the file changed) restarts from zero.
* Retries with exponential backoff and jitter on 408, 429 (``Retry-After`` in seconds or as
  an HTTP date, capped at ``max_backoff``), 5xx, timeouts, connection resets and truncated
  bodies. Other 4xx fail at once (``not found: URL`` for 404); so does a full disk.
* Verification: size against ``Content-Length`` / ``Content-Range`` / ``expected_size``; every
  checksum the source states (``expected_sha256``, GCS md5/crc32c, ``x-goog-hash``,
  ``Content-MD5``, Hugging Face's ``X-Linked-Etag`` sha256). A file whose bytes keep mismatching
  is fetched whole at most CONTENT_RETRIES more times. The final name appears only after that.

Secrets: ``Authorization: Bearer $HF_TOKEN`` is added only for huggingface.co / hf.co hosts and
their subdomains. Every message that leaves this module passes :func:`redact`, which also hides
query-string values (signed URLs) and ``user:password@`` parts of URLs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
import time
from collections.abc import Callable

from pydantic import BaseModel

from infra import storage, transfer
from infra.retry import RetryPolicy
from infra.transfer import is_hf_host, redact

Log = Callable[[str], None]
Progress = Callable[[int, "int | None"], None]

# A source that keeps sending the wrong bytes is not a network glitch: stop after a few full restarts.
CONTENT_RETRIES = 2
# Seconds without a byte arriving after which a download gives up, however many retries are left.
BUDGET_S = 600.0


class FetchError(RuntimeError):
    """A download failed for good; the message names the (redacted) URL."""

    transient = False


class NotFound(FetchError):
    pass


class RemoteInfo(BaseModel):
    url: str
    size: int | None = None
    etag: str | None = None
    md5: str | None = None  # hex
    crc32c: str | None = None  # base64, as GCS states it
    sha256: str | None = None  # hex
    last_modified: str | None = None


class FetchResult(BaseModel):
    url: str  # redacted
    uri: str
    size: int
    sha256: str
    etag: str | None = None
    attempts: int
    skipped: bool = False
    seconds: float


def _fetch_error(exc: transfer.TransferError, prefix: str = "") -> FetchError:
    error = (NotFound if isinstance(exc, transfer.SourceNotFound) else FetchError)(prefix + str(exc))
    error.transient = exc.transient
    return error


# --------------------------------------------------------------------------- probe


def probe(url: str, *, timeout: float = 60) -> RemoteInfo:
    """Cheap identity of a remote file (size, etag, checksums) without downloading it."""
    try:
        remote = transfer.probe(url, timeout=timeout)
    except transfer.TransferError as exc:
        raise _fetch_error(exc) from None
    return RemoteInfo(
        url=redact(url),
        size=remote.size,
        etag=remote.etag,
        md5=remote.checksums.get("md5"),
        crc32c=transfer.hex_to_b64(remote.checksums["crc32c"]) if "crc32c" in remote.checksums else None,
        sha256=remote.checksums.get("sha256"),
        last_modified=remote.last_modified,
    )


# --------------------------------------------------------------------------- the sidecar


def _url_digest(url: str) -> str:
    # The sidecar must not hold a signed URL's token, but must still tell two URLs apart.
    return hashlib.sha256(url.encode()).hexdigest()


def _read_state(state_path: str, url: str) -> dict:
    import json

    try:
        with open(state_path) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return {}
    return state if state.get("url") == _url_digest(url) else {}


def _write_state(state_path: str, url: str, validator: str | None) -> None:
    import json

    with open(state_path, "w") as fh:
        json.dump({"url": _url_digest(url), "validator": validator}, fh)


def _existing(
    url: str, dest_uri: str, meta_uri: str, expected_size: int | None, expected_sha256: str | None
) -> dict | None:
    """The sidecar of a verified copy of ``url`` at ``dest_uri``, or None."""
    try:
        if not storage.exists(dest_uri):
            return None
        if not storage.exists(meta_uri):
            return _adopt(url, dest_uri, meta_uri, expected_size, expected_sha256)
        meta = storage.read_json(meta_uri)
        if meta.get("url_sha256") != _url_digest(url):
            return None
        if expected_size is not None and meta.get("size") != expected_size:
            return None
        if expected_sha256 and meta.get("sha256") != expected_sha256.lower():
            return None
        if storage.is_local(dest_uri):
            path = storage.local_path(dest_uri)
            if os.path.getsize(path) != meta.get("size"):
                return None
            if transfer.hash_file(path)["sha256"] != meta.get("sha256"):
                return None
        else:
            info = storage.info(dest_uri)
            if int(info.get("size", -1)) != meta.get("size"):
                return None
            # GCS states md5 for plain objects and crc32c for all (composite ones lack md5).
            remote_md5 = transfer.b64_to_hex(info.get("md5Hash"))
            if remote_md5 is not None:
                if remote_md5 != meta.get("md5"):
                    return None
            elif not info.get("crc32c") or info.get("crc32c") != meta.get("crc32c"):
                return None
        return meta
    except (OSError, ValueError, KeyError):
        return None


def _adopt(
    url: str, dest_uri: str, meta_uri: str, expected_size: int | None, expected_sha256: str | None
) -> dict | None:
    """A local file put there by hand (no sidecar) counts as verified if it has the expected sha256."""
    if not expected_sha256 or not storage.is_local(dest_uri):
        return None
    path = storage.local_path(dest_uri)
    size = os.path.getsize(path)
    if expected_size is not None and size != expected_size:
        return None
    hashes = transfer.hash_file(path)
    if hashes["sha256"] != expected_sha256.lower():
        return None
    meta = {"url": redact(url), "url_sha256": _url_digest(url), "size": size, "etag": None, **hashes}
    storage.write_json(meta_uri, meta)
    return meta


def shard_label(uri: str) -> str:
    """``.../chunk1/example_train_0.jsonl.zst`` -> ``chunk1/example_train_0.jsonl.zst`` (for log lines)."""
    folder = storage.basename(storage.parent(uri))
    return f"{folder}/{storage.basename(uri)}" if folder else storage.basename(uri)


def _staging_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "nemoflow-fetch")
    os.makedirs(path, exist_ok=True)
    return path


class _Progress:
    """Calls ``progress(done, total)`` at most a few times a second, and always at the end."""

    def __init__(self, fn: Progress | None):
        self.fn = fn
        self.last = 0.0
        self.reported: tuple[int, int | None] | None = None

    def __call__(self, done: int, total: int | None, final: bool = False) -> None:
        if self.fn is None or self.reported == (done, total):
            return
        now = time.monotonic()
        if final or done == total or now - self.last >= 0.25:
            self.last = now
            self.reported = (done, total)
            self.fn(done, total)


# --------------------------------------------------------------------------- download


def download(
    url: str,
    dest_uri: str,
    *,
    expected_size: int | None = None,
    expected_sha256: str | None = None,
    retries: int = 8,
    backoff: float = 1.0,
    max_backoff: float = 60,
    timeout: float = 60,
    log: Log | None = None,
    progress: Progress | None = None,
    label: str | None = None,
) -> FetchResult:
    """Fetch ``url`` to ``dest_uri`` (see the module docstring); returns what was done.

    ``log`` gets one line per event, prefixed with ``label`` (default: the destination's folder
    and file name, e.g. ``chunk1/example_train_0.jsonl.zst``, since shard file names repeat
    across chunks); ``progress(done_bytes, total_bytes_or_None)`` a few times a second.
    ``retries``/``backoff``/``max_backoff`` shape the retry policy (infra.retry): at most
    ``retries`` more attempts, waits growing from ``backoff`` up to ``max_backoff`` seconds.
    """
    started = time.monotonic()
    try:
        transfer.scheme(url)
    except transfer.TransferError as exc:
        raise _fetch_error(exc) from None
    name = label or shard_label(dest_uri)
    safe_url = redact(url)

    def say(msg: str) -> None:
        if log is not None:
            log(redact(f"{name}: {msg}", url))

    meta_uri = dest_uri + ".meta.json"

    def present() -> FetchResult | None:
        if (meta := _existing(url, dest_uri, meta_uri, expected_size, expected_sha256)) is None:
            return None
        say(f"already present and verified ({meta['size']} bytes, sha256 {meta['sha256'][:12]}…): not fetched again")
        return FetchResult(
            url=safe_url,
            uri=dest_uri,
            size=meta["size"],
            sha256=meta["sha256"],
            etag=meta.get("etag"),
            attempts=0,
            skipped=True,
            seconds=time.monotonic() - started,
        )

    if (done := present()) is not None:
        return done
    policy = RetryPolicy(attempts=retries + 1, initial=backoff, maximum=max_backoff, budget=BUDGET_S)
    with _dest_lock(dest_uri, say):
        # Another thread or process may have finished this file while we waited for the lock.
        if (done := present()) is not None:
            return done
        return _fetch(
            url, dest_uri, meta_uri, name, started, say, policy, expected_size, expected_sha256, timeout, progress
        )


@contextlib.contextmanager
def _dest_lock(dest_uri: str, say: Log):
    """One writer per destination on this machine: two writers would interleave bytes in one .part."""
    from filelock import FileLock, Timeout

    lock = FileLock(os.path.join(_staging_dir(), _url_digest(storage.normalize(dest_uri))[:24] + ".lock"))
    try:
        lock.acquire(blocking=False)
    except Timeout:
        say("another download of this file is running here: waiting for it")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _fetch(
    url: str,
    dest_uri: str,
    meta_uri: str,
    name: str,
    started: float,
    say: Log,
    policy: RetryPolicy,
    expected_size: int | None,
    expected_sha256: str | None,
    timeout: float,
    progress: Progress | None,
) -> FetchResult:
    safe_url = redact(url)
    local_dest = storage.is_local(dest_uri)
    if local_dest:
        final = storage.local_path(dest_uri)
        part = final + ".part"
    else:
        part = os.path.join(_staging_dir(), _url_digest(dest_uri)[:16] + "-" + storage.basename(dest_uri) + ".part")
    state_path = part + ".state.json"
    ticker = _Progress(progress)
    say(f"downloading {safe_url}")
    try:
        sink = transfer.FileSink(part)
    except OSError as exc:
        raise FetchError(f"{name}: cannot write {part}: {exc.strerror or exc}") from None
    state = _read_state(state_path, url) if sink.size else {}

    def retried(exc: BaseException, attempt: int, sleep: float, offset: int) -> None:
        reason = exc.reason if isinstance(exc, transfer.Transient) else transfer.describe(exc)
        say(f"attempt {attempt} failed: {reason}; retrying in {sleep:.1f}s")

    copy = transfer.ResumableCopy(
        transfer.Remote.bare(url),
        sink,
        # GCS states md5 (and crc32c) for the uploaded object: record both to recognise it later.
        kinds=("sha256",) if local_dest else ("sha256", "md5", "crc32c"),
        expected={"sha256": expected_sha256} if expected_sha256 else None,
        expected_size=expected_size,
        content_retries=CONTENT_RETRIES,
        timeout=timeout,
        validator=state.get("validator"),
        on_validator=lambda validator: _write_state(state_path, url, validator),
        on_block=ticker,
        log=say,
        on_retry=retried,
    )
    try:
        copied = copy.run(policy)
    except transfer.SourceUnreachable as exc:
        raise FetchError(
            redact(f"{name}: giving up on {safe_url} after {exc.attempts} attempts: {exc.reason}", url)
        ) from None
    except transfer.ContentMismatch as exc:
        raise FetchError(
            redact(f"{name}: giving up on {safe_url} after {copy.attempts} attempts: {exc}", url)
        ) from None
    except transfer.DestinationError as exc:
        # The bytes written so far stay in .part: a run with more space continues from them.
        kept = (
            f"; {transfer.human_bytes(sink.size)} kept in {part}, a new run continues from there" if sink.size else ""
        )
        raise FetchError(f"{name}: {exc}{kept}") from None
    except transfer.TransferError as exc:
        raise _fetch_error(exc) from None
    finally:
        sink.close()
        if not os.path.exists(part) or not os.path.getsize(part):  # nothing to resume from: leave no trace
            for leftover in (part, state_path):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
    hashes = copied.hashes
    record = {k: v for k, v in hashes.items() if k in ("sha256", "md5")}
    if "crc32c" in hashes:
        record["crc32c"] = transfer.hex_to_b64(hashes["crc32c"])  # as GCS states it
    sidecar = {"url": safe_url, "url_sha256": _url_digest(url), "size": copied.size, "etag": copied.etag, **record}
    try:
        if local_dest:
            # The sidecar first: it vouches for nothing until the file is renamed under it, and a
            # rename needs no space, so a full disk cannot leave a verified file without its record.
            storage.write_json(meta_uri, sidecar)
            os.replace(part, final)
        else:
            storage.put_file(part, dest_uri)
            storage.write_json(meta_uri, sidecar)
            os.remove(part)
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        cause = "out of space" if full else (exc.strerror or str(exc))
        raise FetchError(
            f"{name}: verified, but cannot store {dest_uri} ({cause}); {part} is kept, a new run continues from there"
        ) from None
    with contextlib.suppress(FileNotFoundError):
        os.remove(state_path)
    ticker(copied.size, copied.size, final=True)
    seconds = time.monotonic() - started
    say(f"done: {copied.size} bytes in {seconds:.1f}s, {copied.attempts} attempt(s), sha256 {hashes['sha256'][:12]}…")
    return FetchResult(
        url=safe_url,
        uri=dest_uri,
        size=copied.size,
        sha256=hashes["sha256"],
        etag=copied.etag,
        attempts=copied.attempts,
        skipped=False,
        seconds=seconds,
    )


__all__ = [
    "FetchError",
    "FetchResult",
    "NotFound",
    "RemoteInfo",
    "download",
    "is_hf_host",
    "probe",
    "redact",
    "shard_label",
]

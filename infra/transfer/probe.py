"""One request about a source, retried under one policy: :func:`probe` (size, validators, checksums), stats, listings, server-side copies."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from infra import storage
from infra.retry import RetryPolicy, describe, is_transient
from infra.transfer.errors import SourceNotFound, TransferError, unreachable
from infra.transfer.gcs import gcs_failure, gcs_filesystem, gcs_stat, remote_from_gcs
from infra.transfer.http_source import http_probe
from infra.transfer.redaction import redact
from infra.transfer.remote import Log, Remote, scheme

T = TypeVar("T")

# One remote metadata request (probe, stat): a few quick attempts.
PROBE = RetryPolicy(attempts=5, initial=0.5, maximum=10.0, budget=60.0)


def remote_call(
    fn: Callable[[], T], uri: str, *, what: str = "reach", policy: RetryPolicy = PROBE, log: Log | None = None
) -> T:
    """``fn()`` (one request about ``uri``: a stat, a listing, a HEAD), retried under ``policy``.

    Failures retrying cannot cure (404, 401/403, a bad request) raise at once as a
    :class:`TransferError`; transient ones that outlast the policy as :class:`SourceUnreachable`.
    Either way the message is one line naming ``uri`` (redacted) and the cause.
    """
    shown = redact(uri)
    attempts = 0

    def attempt() -> T:
        nonlocal attempts
        attempts += 1
        try:
            return fn()
        except TransferError:
            raise
        except Exception as exc:
            if uri.startswith("gs://") and (failure := gcs_failure(exc, uri)) is not None:
                raise failure from None
            raise

    try:
        return policy.retrying(what=f"{what} {shown}", log=log)(attempt)
    except TransferError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the client raised, after retries
        if is_transient(exc):
            raise unreachable(shown, exc, attempts, what) from None
        raise TransferError(f"cannot {what} {shown}: {describe(redact(exc, uri))}", shown=shown) from None


def probe(
    url: str, *, timeout: float = 60, policy: RetryPolicy = PROBE, etag_md5: bool = False, log: Log | None = None
) -> Remote:
    """Cheap identity of a remote file (size, validators, checksums) without downloading it."""
    proto = scheme(url)
    if proto == "file":
        path = storage.local_path(url)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise SourceNotFound(f"not found: {url}", shown=url, cause="no such file") from None
        from datetime import UTC, datetime

        modified = datetime.fromtimestamp(st.st_mtime, UTC).isoformat()
        return Remote(url=url, scheme="file", size=st.st_size, last_modified=modified, is_dir=os.path.isdir(path))
    if proto == "gs":
        fs = gcs_filesystem(timeout)
        meta = remote_call(lambda: gcs_stat(fs, url), url, policy=policy, log=log)
        return remote_from_gcs(url, meta)
    return remote_call(lambda: http_probe(url, timeout, etag_md5), url, policy=policy, log=log)


def server_side_copy(src_uri: str, dst_uri: str, *, policy: RetryPolicy = PROBE, log: Log | None = None) -> Remote:
    """Copy one GCS object to another inside GCS (no byte passes through here); the copy's metadata.

    GCS states the new object's md5/crc32c, which the caller compares with the source's.
    """
    fs = gcs_filesystem()
    _, src = storage.url_to_fs(src_uri)
    _, dst = storage.url_to_fs(dst_uri)

    def copy() -> dict:
        fs.cp_file(src, dst)
        return gcs_stat(fs, dst_uri)

    return remote_from_gcs(dst_uri, remote_call(copy, src_uri, what="copy", policy=policy, log=log))

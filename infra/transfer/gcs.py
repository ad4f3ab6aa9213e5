"""GCS with one retry layer: gcsfs without its own retry loop, its failures as one-line transfer errors."""

from __future__ import annotations

import functools
from contextvars import ContextVar

from infra import storage
from infra.retry import parse_retry_after
from infra.transfer.checksums import b64_to_hex
from infra.transfer.errors import AccessDenied, SourceNotFound, TransferError
from infra.transfer.remote import Remote

_LAST_RETRY_AFTER: ContextVar[str | None] = ContextVar("nemoflow_gcs_retry_after", default=None)


@functools.cache
def _retry_after_trace():
    """An aiohttp trace hook that remembers the Retry-After of the last answer in this asyncio task."""
    import aiohttp

    async def on_request_end(session, context, params) -> None:
        _LAST_RETRY_AFTER.set(params.response.headers.get("Retry-After"))

    config = aiohttp.TraceConfig()
    config.on_request_end.append(on_request_end)
    return config


@functools.cache
def _single_attempt_gcs_class() -> type:
    """gcsfs's file system with its internal retry decorator taken off ``_request``.

    gcsfs retries every request up to six times (1-16 s sleeps, a logged traceback when it gives
    up) before an error reaches us, and drops the Retry-After header. Two retry loops multiply:
    an unreachable bucket took minutes. Here the undecorated request runs once, the Retry-After
    of a failed answer is attached to the error, and an infra.retry policy is the only retry loop.
    """
    import gcsfs
    from gcsfs.retry import HttpError

    undecorated = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", gcsfs.GCSFileSystem._request)

    class SingleAttemptGCSFileSystem(gcsfs.GCSFileSystem):
        async def _request(self, *args, **kwargs):
            _LAST_RETRY_AFTER.set(None)
            try:
                return await undecorated(self, *args, **kwargs)
            except HttpError as exc:
                if (header := _LAST_RETRY_AFTER.get()) is not None:
                    exc.retry_after = parse_retry_after(header)
                raise

    return SingleAttemptGCSFileSystem


def gcs_filesystem(timeout: float = 60):
    """A gcsfs file system configured like :func:`infra.storage.filesystem`, without its own retries.

    ``timeout`` bounds connecting and each wait for bytes (not a whole transfer).
    """
    import aiohttp

    options = dict(storage.filesystem("gs://").storage_options)
    options["requests_timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    options["session_kwargs"] = {"trace_configs": [_retry_after_trace()]}
    return _single_attempt_gcs_class()(**options)


def split_gs(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = uri.split("://", 1)[1]
    bucket, _, name = rest.partition("/")
    return bucket, name


def gcs_failure(exc: BaseException, uri: str) -> TransferError | None:
    """A one-line TransferError for a GCS failure that retrying will not cure (None if it may)."""
    bucket, name = split_gs(uri)
    where = f"{uri} (bucket {bucket!r}, object {name!r})"
    if isinstance(exc, FileNotFoundError):
        return SourceNotFound(f"not found: {uri}", shown=uri, cause="no such object or bucket", status=404)
    text = " ".join(str(exc).split())
    code = getattr(exc, "code", None)
    if isinstance(exc, PermissionError) or text.startswith("Forbidden") or code == 403:
        return AccessDenied(
            f"access denied to {where}: HTTP 403 (the credentials in use may not read it)",
            shown=uri,
            cause="HTTP 403",
            status=403,
        )
    if code == 401 or type(exc).__name__ in ("DefaultCredentialsError", "RefreshError"):
        return AccessDenied(
            f"cannot authenticate to GCS for {where}: {text or type(exc).__name__} "
            "(set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`)",
            shown=uri,
            cause="credentials",
            status=401 if code == 401 else None,
        )
    if isinstance(exc, ValueError) and "Bad Request" in text:
        return TransferError(f"GCS refused the request for {where}: {text}", shown=uri, cause=text, status=400)
    return None


def gcs_stat(fs, uri: str) -> dict:
    """Object metadata, fresh (a listing cached earlier in this process may predate a re-upload)."""
    _, path = storage.url_to_fs(uri)
    fs.invalidate_cache(path)
    try:
        return fs.info(path)
    except Exception as exc:
        if (failure := gcs_failure(exc, uri)) is not None:
            raise failure from None
        raise


def remote_from_gcs(url: str, meta: dict) -> Remote:
    checksums = {}
    if md5 := b64_to_hex(meta.get("md5Hash")):
        checksums["md5"] = md5
    if crc := b64_to_hex(meta.get("crc32c")):
        checksums["crc32c"] = crc
    generation = str(meta["generation"]) if meta.get("generation") else None
    return Remote(
        url=url,
        scheme="gs",
        size=int(meta["size"]) if meta.get("size") is not None else None,
        etag=meta.get("etag") or generation,
        generation=generation,
        last_modified=meta.get("updated"),
        checksums=checksums,
        is_dir=meta.get("type") == "directory",
    )

"""One transfer stack for every download and copy: probe a source, copy it resumably and verified.

    from infra import transfer
    remote = transfer.probe("gs://bucket/raw/shard.jsonl.zst")       # size, validators, checksums
    sink = transfer.FileSink("/data/raw/shard.jsonl.zst.part")
    copied = transfer.ResumableCopy(remote, sink, kinds={"sha256"}).run(transfer.COPY)
    copied.hashes["sha256"], copied.size

Sources: ``https://`` / ``http://`` (requests, streamed), ``gs://`` (gcsfs, one range request per
block), ``file://`` or a plain path. infra/fetch.py (dataset shards, with sidecars and resume across
calls) and infra/images.py (container images, with squashfs checks) are thin layers over this.

What it does, and why here once:

* **probe** (:func:`probe`): size, ETag / Last-Modified / generation (the validators a resume needs)
  and every checksum the source states: GCS md5Hash/crc32c; HTTP ``x-goog-hash``, ``Content-MD5`` (of
  a whole body only), Hugging Face's ``X-Linked-Etag`` sha256 (and its ETag on the hub itself),
  optionally an md5-looking ETag (S3/GCS XML single-part uploads). A server that refuses HEAD is
  asked for one byte instead.
* **resumable copy** (:class:`ResumableCopy`): blocks go from the source to a :class:`Sink` while a
  second thread hashes and writes them, so network, checksum and disk overlap. A dropped connection
  continues at the next byte: HTTP ``Range`` + ``If-Range`` (a file replaced meanwhile is never
  spliced), a range request on GCS after checking the object's generation, a seek for files. A
  ``pinned`` copy (images) refuses a source that changed; an unpinned one (shards) starts again.
* **verification**: size against what the source announced and every stated checksum, before the
  caller commits anything under a final name.
* **retries** through :mod:`infra.retry` policies (tenacity): transport errors, 408/429/5xx and
  Retry-After are retried within a time budget; 404, 401/403, bad URLs and full disks fail at once;
  an unresolvable host is retried only briefly. gcsfs's own retry loop (six attempts, ~30 s and a
  logged traceback per call) is switched off for the transfer's requests, so one policy decides.
* **redaction** (:func:`redact`, :func:`public_uri`): settings secrets, URL passwords and
  query-string values (signed URLs) never reach a log line, an error or a record.
* **credentials by reference** (infra/secrets.py): a URL may hold ``<secret:NAME>`` (a Prefect
  Secret block) or ``<env:NAME>`` in place of a query, a query value or a password. Callers and
  records keep that form; only the HTTP request itself is made with the values (:func:`_request_url`),
  and the values are then hidden by :func:`redact` as well.
* **errors** are :class:`TransferError` subclasses with one-line messages that name the source
  (``gs://bucket/object``) and the cause; callers turn them into their own error types.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import errno
import functools
import hashlib
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from infra import permissions, secrets, storage
from infra.retry import RetryPolicy, Transient, describe, is_brief, is_transient, parse_retry_after, retry_after
from infra.settings import get_settings
from infra.settings import redact as redact_secrets

T = TypeVar("T")
Log = Callable[[str], None]
OnBlock = Callable[[int, "int | None"], None]

CHUNK = 8 << 20
HF_HOSTS: tuple[str, ...] = ("huggingface.co", "hf.co")
SCHEMES = ("http", "https", "gs", "file")
# In-flight bytes between the reading thread and the hash+write thread.
PIPELINE_BYTES = 32 << 20

# One remote metadata request (probe, stat): a few quick attempts.
PROBE = RetryPolicy(attempts=5, initial=0.5, maximum=10.0, budget=60.0)
# A copy: more patience, and the budget counts from the last byte that arrived.
COPY = RetryPolicy(attempts=9, initial=1.0, maximum=60.0, budget=600.0)


# --------------------------------------------------------------------------- errors


class TransferError(RuntimeError):
    """A transfer failed for good; ``str()`` is one line naming the source (redacted) and the cause."""

    transient = False  # whether trying again later (a task retry) may succeed

    def __init__(self, message: str, *, shown: str = "", cause: str = "", status: int | None = None):
        super().__init__(redact(message))
        self.shown = shown
        self.cause = redact(cause)
        self.status = status


class Unsupported(TransferError):
    """A URL this stack cannot read (unknown scheme, malformed)."""


class SourceNotFound(TransferError):
    """No such file, object, bucket or URL (404/410)."""


class AccessDenied(TransferError):
    """401/403 or missing/invalid credentials: waiting does not help, a login does."""


class SourceUnreachable(TransferError):
    """Transient failures outlasted the retry policy (the host, the network or the server is down).

    ``attempts``: how many were made; ``reason``: the last failure, one line; ``offset``: bytes
    copied when it gave up (a copy), kept by callers that resume across runs.
    """

    transient = True
    attempts: int = 0
    reason: str = ""
    offset: int = 0


class SourceChanged(TransferError):
    """A pinned source changed (or cannot be resumed) in the middle of a copy."""

    transient = True


class ContentMismatch(TransferError):
    """The bytes do not match the size or a checksum the source states."""

    transient = True

    def __init__(self, message: str, *, shown: str = "", kind: str, want: str, got: str, who: str = "the source"):
        super().__init__(message, shown=shown)
        self.kind, self.want, self.got, self.who = kind, want, got, who


class DestinationError(TransferError):
    """The destination cannot take the bytes."""


class NoSpace(DestinationError):
    """The destination's file system is full."""


# --------------------------------------------------------------------------- secrets


_USERINFO = re.compile(r"(://)[^/@\s]+@")
# A query value, unless it is a secret reference (<env:NAME>, <secret:NAME>): a name is no secret.
_QUERY_VALUE = re.compile(r"([?&][^=&#\s]+=)(?!<(?:env|secret):[\w.-]+>(?:[&#\s'\"]|$))[^&#\s'\"]*")


def redact(text: object, *uris: str) -> str:
    """``text`` without secrets: settings secrets, URL passwords, query-string values.

    ``uris``: URLs whose query and user info must go even where they appear in another
    spelling (quoted or split by a client's error message).

    >>> redact("GET https://h/x?X-Goog-Signature=abc failed")
    'GET https://h/x?X-Goog-Signature=*** failed'
    """
    text = str(text)
    for uri in uris:
        parts = urlsplit(uri) if "://" in uri else None
        for secret in (parts.query, parts.netloc.rpartition("@")[0]) if parts else ():
            # A part holding references (<env:NAME>) is no secret; the values it resolves to are
            # hidden below (infra.secrets remembers them), and literals around it by the patterns.
            if secret and not secrets.has_references(secret):
                text = text.replace(secret, "***")
    text = _USERINFO.sub(r"\1***@", text)
    text = _QUERY_VALUE.sub(r"\1***", text)
    return redact_secrets(text)


def public_uri(uri: str) -> str:
    """``uri`` without a query string or user info: what may be logged and recorded as an identity.

    Signed URLs (``X-Goog-Signature``, ``X-Amz-Signature``, SAS tokens) carry a credential in the
    query; a fresh signature for the same object gives the same public URI.

    >>> public_uri("https://storage.googleapis.com/b/nemo.sqsh?X-Goog-Signature=abc")
    'https://storage.googleapis.com/b/nemo.sqsh?<query hidden>'
    """
    if scheme(uri, strict=False) not in ("http", "https"):
        return uri
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "<query hidden>" if parts.query else "", ""))


def _request_url(url: str) -> str:
    """The URL a request goes to: ``url`` with its secret references resolved (never log it).

    An unresolvable reference is a :class:`TransferError` naming the reference, not retried.
    """
    try:
        return secrets.resolve(url)
    except secrets.SecretError as exc:
        raise TransferError(f"cannot fetch {redact(url)}: {exc}", shown=redact(url), cause=str(exc)) from None


def is_hf_host(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    return any(host == h or host.endswith("." + h) for h in HF_HOSTS)


def auth_headers(url: str) -> dict[str, str]:
    """``Authorization: Bearer $HF_TOKEN`` for Hugging Face hosts only (requests drops it on a cross-host redirect)."""
    if not is_hf_host(url):
        return {}
    token = get_settings().hf_token
    if token is None or not token.get_secret_value():
        return {}
    return {"Authorization": f"Bearer {token.get_secret_value()}"}


def auth_hint(url: str, status: int) -> str:
    if status in (401, 403) and is_hf_host(url):
        if get_settings().hf_token is None:
            return " (gated or private on Hugging Face? set HF_TOKEN)"
        return " (HF_TOKEN is set but was refused: check that it can read this repository)"
    return ""


# --------------------------------------------------------------------------- small helpers


def scheme(url: str, *, strict: bool = True) -> str:
    """``http``, ``https``, ``gs`` (``gcs`` too) or ``file`` (plain paths); :class:`Unsupported` otherwise."""
    if "://" not in url:
        return "file"
    proto = url.split("://", 1)[0].lower()
    proto = "gs" if proto == "gcs" else proto
    if strict and proto not in SCHEMES:
        raise Unsupported(
            f"unsupported scheme {proto!r} in {redact(url)}: supported are https, http, gs, file and plain paths",
            shown=redact(url),
        )
    return proto


def b64_to_hex(value: str | None) -> str | None:
    """A base64 checksum as GCS and HTTP headers state it, as hex; None when it is not valid base64."""
    if not value:
        return None
    try:
        return base64.b64decode(value.strip(), validate=True).hex()
    except (binascii.Error, ValueError):
        return None


def hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode()


def strip_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown size"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class _Crc32c:
    def __init__(self) -> None:
        import google_crc32c

        self._impl = google_crc32c.Checksum()

    def update(self, data: bytes) -> None:
        self._impl.update(data)

    def hexdigest(self) -> str:
        return self._impl.digest().hex()


def new_hasher(kind: str):
    """A hashlib-like object for ``sha256``, ``md5``, ``crc32c`` (Castagnoli, as GCS computes it)..."""
    if kind == "crc32c":
        return _Crc32c()
    if kind == "md5":
        return hashlib.md5(usedforsecurity=False)
    return hashlib.new(kind)


class MultiHash:
    """Several digests of one byte stream, fed together."""

    def __init__(self, kinds) -> None:
        self.kinds = tuple(sorted(set(kinds)))
        self._hashers = {kind: new_hasher(kind) for kind in self.kinds}

    def update(self, data) -> None:
        for hasher in self._hashers.values():
            hasher.update(data)

    def hexdigests(self) -> dict[str, str]:
        return {kind: h.hexdigest() for kind, h in self._hashers.items()}


def hash_file(path: str, kinds=("sha256",), limit: int | None = None) -> dict[str, str]:
    """Hex digests of a local file (or of its first ``limit`` bytes)."""
    hashes = MultiHash(kinds)
    left = limit
    with open(path, "rb") as fh:
        while left is None or left > 0:
            block = fh.read(CHUNK if left is None else min(CHUNK, left))
            if not block:
                break
            hashes.update(block)
            if left is not None:
                left -= len(block)
    return hashes.hexdigests()


def check_free_space(dest_dir: str, needed: int | None) -> None:
    """:class:`NoSpace` before copying when a local destination cannot hold ``needed`` bytes."""
    if needed is None or not storage.is_local(dest_dir):
        return
    path = storage.local_path(dest_dir)
    free = shutil.disk_usage(path).free
    if free < needed:
        raise NoSpace(f"needs {human_bytes(needed)}, {human_bytes(free)} free on {path}", shown=path)


# --------------------------------------------------------------------------- checksums stated by HTTP servers


_SHA256 = re.compile(r"[0-9a-f]{64}")
_MD5 = re.compile(r"[0-9a-f]{32}")


def stated_checksums(responses, url: str, *, etag_md5: bool = False) -> dict[str, str]:
    """Hex checksums the server states for the whole object, from a response and its redirects.

    Keys ``md5``, ``crc32c``, ``sha256``. ``Content-MD5`` describes one response's body, so it counts
    only for a 200 (HEAD or GET), never a 206. ``etag_md5``: also trust a strong 32-hex ETag as the
    md5 (S3 and GCS single-part uploads); off for hosts where ETags are opaque.
    """
    claims: dict[str, str] = {}
    for resp in responses:
        headers = resp.headers
        for part in ",".join(v for k, v in headers.items() if k.lower() == "x-goog-hash").split(","):
            key, _, value = part.strip().partition("=")
            if key in ("md5", "crc32c") and (hexed := b64_to_hex(value)):
                claims.setdefault(key, hexed)
        linked = strip_etag(headers.get("X-Linked-Etag"))
        if linked and _SHA256.fullmatch(linked.lower()):
            claims["sha256"] = linked.lower()
        etag = strip_etag(headers.get("ETag"))
        # Hugging Face's own resolve answer gives an LFS file's sha256 as its ETag; CDN hosts
        # (even *.hf.co ones) use other 64-hex hashes (Xet), so only the exact hub hosts count.
        host = (urlsplit(getattr(resp, "url", None) or url).hostname or "").lower().rstrip(".")
        if etag and host in HF_HOSTS and _SHA256.fullmatch(etag.lower()):
            claims.setdefault("sha256", etag.lower())
    if responses:
        last = responses[-1]
        if last.status_code == 200 and (hexed := b64_to_hex(last.headers.get("Content-MD5"))):
            claims.setdefault("md5", hexed)
        raw_etag = last.headers.get("ETag") or ""
        if etag_md5 and not raw_etag.startswith("W/") and _MD5.fullmatch(raw_etag.strip('"')):
            claims.setdefault("md5", raw_etag.strip('"'))
    return claims


# --------------------------------------------------------------------------- GCS with one retry layer


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


def _gcs_failure(exc: BaseException, uri: str) -> TransferError | None:
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
        if (failure := _gcs_failure(exc, uri)) is not None:
            raise failure from None
        raise


def unreachable(uri: str, exc: BaseException, attempts: int, what: str = "reach") -> SourceUnreachable:
    """The one-line error for transient failures that outlasted the policy."""
    cause = exc.reason if isinstance(exc, Transient) else describe(exc)
    if is_brief(exc):
        endpoint = get_settings().gcs_endpoint or "https://storage.googleapis.com"
        host = urlsplit(endpoint if uri.startswith("gs://") else uri).hostname
        cause = f"cannot resolve host {host!r} ({cause})"
    error = SourceUnreachable(
        f"cannot {what} {uri}: {cause} (gave up after {attempts} attempt{'s' if attempts != 1 else ''})",
        shown=uri,
        cause=cause,
    )
    error.attempts, error.reason = attempts, redact(cause, uri)
    # A name that did not resolve over a few attempts will not resolve on a task retry either.
    error.transient = not is_brief(exc)
    return error


# --------------------------------------------------------------------------- probe


@dataclasses.dataclass
class Remote:
    """What a source says about itself before (or while) its bytes are read."""

    url: str  # as given: may hold a signed query, never log it
    scheme: str
    size: int | None = None
    etag: str | None = None  # stripped of quotes and W/
    etag_header: str | None = None  # as sent
    last_modified: str | None = None
    generation: str | None = None  # GCS
    checksums: dict[str, str] = dataclasses.field(default_factory=dict)  # kind -> hex
    is_dir: bool = False

    @property
    def shown(self) -> str:
        return redact(self.url) if self.scheme in ("http", "https") else self.url

    @property
    def validator(self) -> str | None:
        """What proves a later read sees the same file: HTTP If-Range value, GCS generation."""
        if self.scheme == "gs":
            return self.generation or self.etag
        if self.etag_header and not self.etag_header.startswith("W/"):
            return self.etag_header
        return self.last_modified

    @classmethod
    def bare(cls, url: str) -> Remote:
        """Nothing known yet: a copy learns the facts from its first response."""
        return cls(url=url, scheme=scheme(url))


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
            if uri.startswith("gs://") and (failure := _gcs_failure(exc, uri)) is not None:
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
        return _remote_from_gcs(url, meta)
    return remote_call(lambda: _http_probe(url, timeout, etag_md5), url, policy=policy, log=log)


def _remote_from_gcs(url: str, meta: dict) -> Remote:
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


def _http_status_error(url: str, resp) -> TransferError | Transient:
    """The error for a non-success HTTP answer: transient ones retry, 404 / 401 / 403 / others fail."""
    from infra.retry import TRANSIENT_STATUSES

    code = resp.status_code
    shown = redact(url)
    if code in TRANSIENT_STATUSES:
        return Transient(f"HTTP {code} {resp.reason}", retry_after=parse_retry_after(resp.headers.get("Retry-After")))
    if code in (404, 410):
        return SourceNotFound(f"not found: {shown}", shown=shown, cause=f"HTTP {code}", status=code)
    message = f"HTTP {code} {resp.reason} for {shown}{auth_hint(url, code)}"
    if code in (401, 403):
        return AccessDenied(message, shown=shown, cause=f"HTTP {code} {resp.reason}", status=code)
    return TransferError(message, shown=shown, cause=f"HTTP {code} {resp.reason}", status=code)


def _request_failure(url: str, exc: Exception, resolved: str | None = None) -> BaseException:
    """requests' exceptions: transport ones stay (the policy retries them), the rest fail at once.

    ``resolved``: the URL the request went to (references resolved), whose secrets go too.
    """
    import requests

    shown = redact(url)
    hidden = (url, resolved) if resolved else (url,)
    if isinstance(exc, requests.exceptions.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return TransferError(f"TLS certificate of {shown} rejected: {redact(exc, *hidden)}", shown=shown)
    if isinstance(exc, (requests.Timeout, requests.ConnectionError)):
        return exc
    return TransferError(f"cannot fetch {shown}: {redact(exc, *hidden)}", shown=shown)  # bad URL, redirect loop


# requests, not httpx (the project's other HTTP client), for downloads: users' REQUESTS_CA_BUNDLE and ~/.netrc keep
# working (httpx reads neither), and the resumable reader relies on urllib3's read1 (no received byte lost on a break).
def _http_probe(url: str, timeout: float, etag_md5: bool) -> Remote:
    import requests

    headers = {"Accept-Encoding": "identity", **auth_headers(url)}
    target = _request_url(url)
    try:
        with requests.Session() as session:
            resp = session.head(target, headers=headers, allow_redirects=True, timeout=timeout)
            if resp.status_code in (403, 405, 501) and not is_hf_host(url):
                # Some servers (and signed URLs, which sign the method) refuse HEAD: ask for one byte.
                ranged = session.get(target, headers={**headers, "Range": "bytes=0-0"}, stream=True, timeout=timeout)
                ranged.close()
                if ranged.status_code in (200, 206):
                    resp = ranged
    except requests.RequestException as exc:
        raise _request_failure(url, exc, target) from None
    if resp.status_code >= 400:
        raise _http_status_error(url, resp)
    chain = [*resp.history, resp]
    size = None
    for r in chain:
        if r.headers.get("X-Linked-Size", "").isdigit():
            size = int(r.headers["X-Linked-Size"])
    total = re.fullmatch(r"bytes \d+-\d+/(\d+)", resp.headers.get("Content-Range", "").strip())
    encoded = resp.headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity")
    if size is None and total:
        size = int(total.group(1))
    elif size is None and resp.status_code == 200 and resp.headers.get("Content-Length", "").isdigit() and not encoded:
        size = int(resp.headers["Content-Length"])
    return Remote(
        url=url,
        scheme=scheme(url),
        size=size,
        etag=strip_etag(resp.headers.get("ETag")),
        etag_header=resp.headers.get("ETag"),
        last_modified=resp.headers.get("Last-Modified"),
        checksums=stated_checksums(chain, url, etag_md5=etag_md5),
    )


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

    return _remote_from_gcs(dst_uri, remote_call(copy, src_uri, what="copy", policy=policy, log=log))


# --------------------------------------------------------------------------- sinks


class Sink:
    """Where a copy's bytes go. ``size`` is the number of bytes written so far."""

    size: int = 0
    name: str = ""
    local_path: str | None = None  # set when the bytes can be read back (catch-up hashing, checks)

    def write(self, block: bytes) -> int:
        """Write ``block``; return how many bytes were written before an error (then raise it)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Throw the bytes away and start at 0 (a restart)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Make the bytes durable (fsync / upload)."""

    def close(self) -> None:
        pass

    def discard(self) -> None:
        """Remove whatever was written."""


class FileSink(Sink):
    """A local file, appended to: bytes already there (a resumed copy) count as written."""

    def __init__(self, path: str, *, resume: bool = True):
        self.path = self.local_path = self.name = path
        permissions.makedirs(os.path.dirname(os.path.abspath(path)) or ".")
        if not resume:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        # Unbuffered: a failed write (a full disk) leaves exactly the bytes we count.
        self._fh = open(path, "ab", buffering=0)
        self.size = os.fstat(self._fh.fileno()).st_size
        # The mode it keeps when renamed to its final name (shared storage: infra/permissions.py).
        permissions.secure_file(path)

    def write(self, block) -> int:
        view = memoryview(block)
        done = 0
        try:
            while done < len(view):
                n = self._fh.write(view[done:])
                if not n:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += n
        finally:
            self.size += done
        return done

    def reset(self) -> None:
        self._fh.truncate(0)
        self.size = 0

    def finish(self) -> None:
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()

    def discard(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


class FsspecSink(Sink):
    """A file written through fsspec (a ``gs://`` object uploaded while it streams)."""

    def __init__(self, uri: str):
        self.name = uri
        self.fs, self.path = storage.url_to_fs(uri)
        self._fh = self.fs.open(self.path, "wb")
        self.size = 0

    def write(self, block) -> int:
        self._fh.write(block)
        self.size += len(block)
        return len(block)

    def reset(self) -> None:
        self.discard()
        self._fh = self.fs.open(self.path, "wb")
        self.size = 0

    def finish(self) -> None:
        self._fh.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._fh.close()

    def discard(self) -> None:
        self.close()
        with contextlib.suppress(Exception):
            self.fs.rm(self.path)


def open_sink(uri: str, *, resume: bool = False) -> Sink:
    return FileSink(storage.local_path(uri), resume=resume) if storage.is_local(uri) else FsspecSink(uri)


class _SinkFailed(Exception):
    """The destination refused a write: carries the OSError."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _Pipeline:
    """Hash and write blocks on a second thread while the next block is read.

    hashlib, crc32c and file writes release the GIL, so network, checksum and disk overlap
    instead of taking turns: a copy runs at the speed of the slowest of the three, not their sum.
    The hashes always cover exactly the bytes the sink holds, even after a failed write.
    """

    def __init__(self, hashes: MultiHash, sink: Sink, limit: int = PIPELINE_BYTES):
        self._hashes, self._sink = hashes, sink
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._room = threading.Condition()
        self._pending = 0
        self._limit = limit
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="transfer-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (block := self._queue.get()) is not None:
            if self.error is None:
                before = self._sink.size
                try:
                    self._sink.write(block)
                except BaseException as exc:  # noqa: BLE001 - handed to the reading thread
                    self.error = exc
                written = self._sink.size - before
                self._hashes.update(block if written == len(block) else memoryview(block)[:written])
            with self._room:
                self._pending -= len(block)
                self._room.notify_all()

    def put(self, block: bytes) -> None:
        if self.error is not None:
            raise _SinkFailed(self.error)
        with self._room:
            while self._pending and self._pending + len(block) > self._limit and self.error is None:
                self._room.wait(0.5)
            self._pending += len(block)
        self._queue.put(block)

    def close(self) -> None:
        """Wait until every queued block is written (or refused)."""
        self._queue.put(None)
        self._thread.join()


# --------------------------------------------------------------------------- the copy


@dataclasses.dataclass
class Copied:
    size: int
    hashes: dict[str, str]  # kind -> hex, over the whole copy
    etag: str | None
    validator: str | None
    attempts: int
    seconds: float


def _nothing() -> None:
    pass


@dataclasses.dataclass
class _Opened:
    """One attempt's open source: where it starts, what it says, and how to read it."""

    offset: int
    total: int | None
    read: Callable[[int], bytes]
    close: Callable[[], None] = _nothing
    etag: str | None = None
    validator: str | None = None
    claims: dict[str, str] = dataclasses.field(default_factory=dict)
    complete: bool = False  # nothing left to read (a resume found the previous run had every byte)


class ResumableCopy:
    """Copy ``remote`` into ``sink``, resuming within the run, verifying the result.

    kinds:            digests to compute while copying (``sha256``, ``md5``, ``crc32c``); claims
                      of other kinds are hashed afterwards from the sink when it is local.
    pinned:           the source is the one probed: a resume that finds it changed raises
                      :class:`SourceChanged` (images); unpinned copies restart from byte 0 (shards).
    expected:         checksums the copy must have (hex by kind), e.g. from a manifest or probe.
    expected_size:    the size it must have.
    content_retries:  restarts from zero after a size/checksum mismatch before giving up.
    validator:        the validator recorded when the sink's existing bytes were written (a
                      resume across runs); without one, existing bytes are not trusted (unpinned).
    on_validator:     called with each attempt's validator before its bytes are written, so a
                      crash leaves a record that matches the partial file.
    on_block:         ``(done, total)`` after each block (may raise to abort, e.g. a bad header).
    inspect:          ``(block, offset)`` before a block is written (may raise to refuse the source).
    log:              one line per event (resumes, restarts).
    on_retry:         ``(exc, attempt, sleep, offset)`` before each retry wait (the caller's log line).
    """

    def __init__(
        self,
        remote: Remote,
        sink: Sink,
        *,
        kinds=("sha256",),
        pinned: bool = False,
        expected: dict[str, str] | None = None,
        expected_size: int | None = None,
        content_retries: int = 0,
        timeout: float = 60,
        chunk: int = CHUNK,
        etag_md5: bool = False,
        validator: str | None = None,
        on_validator: Callable[[str | None], None] | None = None,
        on_block: OnBlock | None = None,
        inspect: Callable[[bytes, int], None] | None = None,
        log: Log | None = None,
        on_retry: Callable[[BaseException, int, float, int], None] | None = None,
    ):
        self.remote, self.sink = remote, sink
        self.base_kinds = set(kinds)
        self.pinned = pinned
        self.expected = {k: v.lower() for k, v in (expected or {}).items() if v}
        self.expected_size = expected_size
        self.content_retries = content_retries
        self.timeout, self.chunk, self.etag_md5 = timeout, chunk, etag_md5
        self.validator = validator if validator is not None else (remote.validator if pinned else None)
        self.on_validator = on_validator
        self.on_block, self.inspect = on_block, inspect
        self.log = log or (lambda line: None)
        self.on_retry = on_retry
        self.hashes = MultiHash(self.base_kinds | set(self.expected))
        self.content_failures = 0
        self.attempts = 0
        self.total = remote.size
        self.last_progress = time.monotonic()
        self._session = None
        self._gcs = None

    # ------------------------------------------------------------------ the loop

    def run(self, policy: RetryPolicy = COPY) -> Copied:
        """Copy, resuming and retrying under ``policy``; verified, durable in the sink, not committed."""
        started = time.monotonic()
        if self.sink.size:
            self._catch_up(self.sink.size)
        retrying = policy.replace(transient=self._retryable(policy.transient)).retrying(
            on_retry=self._retrying, progress=lambda: self.last_progress
        )
        try:
            for attempt in retrying:
                with attempt:
                    self.attempts += 1
                    opened = self._attempt()
                    hashes = self._verify(opened)
            self.sink.finish()
        except _SinkFailed as exc:
            raise sink_failure(exc.error, self.sink, self.sink.size, self.total) from None
        except TransferError:
            raise
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # fsync, the final upload
                raise sink_failure(exc, self.sink, self.sink.size, self.total) from None
            if isinstance(exc, Transient) or is_transient(exc):  # transient failures outlasted the policy
                error = unreachable(self.remote.shown, exc, self.attempts, what="read")
                error.offset = self.sink.size
                raise error from None
            raise
        finally:
            if self._session is not None:
                self._session.close()
        return Copied(
            size=self.sink.size,
            hashes=hashes,
            etag=opened.etag,
            validator=opened.validator,
            attempts=self.attempts,
            seconds=time.monotonic() - started,
        )

    @staticmethod
    def _retryable(transient: Callable[[BaseException], bool]) -> Callable[[BaseException], bool]:
        """The policy's verdict, except that final verdicts (TransferError, a caller's own error
        type such as an image check, a refused write) are never retried inside the copy."""

        def retryable(exc: BaseException) -> bool:
            if isinstance(exc, Transient):
                return True
            if isinstance(exc, (TransferError, _SinkFailed)) or getattr(exc, "transient", None) is not None:
                return False
            return transient(exc)

        return retryable

    def _retrying(self, exc: BaseException, attempt: int, sleep: float) -> None:
        if self.on_retry is not None:
            self.on_retry(exc, attempt, sleep, self.sink.size)

    def _catch_up(self, size: int) -> None:
        """Hash the bytes a previous run left in the sink, so the digests cover the whole file."""
        if self.sink.local_path is None:
            self.sink.reset()
            return
        self.hashes = MultiHash(self.hashes.kinds)
        with open(self.sink.local_path, "rb") as fh:
            left = size
            while left > 0 and (block := fh.read(min(CHUNK, left))):
                self.hashes.update(block)
                left -= len(block)

    def _restart(self) -> None:
        self.sink.reset()
        self.hashes = MultiHash(self.hashes.kinds)

    # ------------------------------------------------------------------ one attempt

    def _attempt(self) -> _Opened:
        offset = self.sink.size
        opened = {"http": self._open_http, "https": self._open_http, "gs": self._open_gcs, "file": self._open_file}[
            self.remote.scheme
        ](offset)
        if opened.offset == 0 and self.sink.size:
            self._restart()
        if opened.offset == 0 and not self.pinned:
            # The first answer tells which checksums the source states: hash those while copying.
            wanted = set(self.hashes.kinds) | set(opened.claims)
            if wanted != set(self.hashes.kinds):
                self.hashes = MultiHash(wanted)
        elif opened.offset:
            self.log(f"resuming at byte {opened.offset}")
        if self.on_validator is not None and not opened.complete:
            self.on_validator(opened.validator)
        self.validator = opened.validator or self.validator
        self.total = opened.total if opened.total is not None else self.total
        try:
            if not opened.complete:
                self._stream(opened)
        finally:
            opened.close()
        if opened.total is not None and self.sink.size < opened.total:
            raise Transient(
                f"{self.remote.shown} ended after {self.sink.size} of {opened.total} bytes (connection closed early)"
                if self.pinned
                else f"truncated body: {self.sink.size} of {opened.total} bytes"
            )
        return opened

    def _stream(self, opened: _Opened) -> None:
        pipeline = _Pipeline(self.hashes, self.sink)
        done = opened.offset
        try:
            while True:
                try:
                    block = opened.read(self.chunk)
                except (TransferError, Transient):
                    raise
                except Exception as exc:  # noqa: BLE001 - classified below, the read position is exact
                    raise self._read_failure(exc, done) from None
                if not block:
                    break
                if self.inspect is not None:
                    self.inspect(block, done)
                pipeline.put(block)
                done += len(block)
                self.last_progress = time.monotonic()
                if self.on_block is not None:
                    self.on_block(done, opened.total)
        finally:
            pipeline.close()
        if pipeline.error is not None:
            raise _SinkFailed(pipeline.error)

    def _read_failure(self, exc: Exception, done: int) -> BaseException:
        if self.remote.scheme == "gs" and (failure := _gcs_failure(exc, self.remote.url)) is not None:
            return failure
        if isinstance(exc, FileNotFoundError):
            return SourceNotFound(f"not found: {self.remote.shown}", shown=self.remote.shown, cause="no such file")
        if not (is_transient(exc) or (self.remote.scheme == "file" and isinstance(exc, OSError))):
            return exc
        detail = describe(redact(exc, self.remote.url))
        wait = retry_after(exc)
        if self.pinned:
            return Transient(
                f"reading {self.remote.shown} failed after {done} of {human_bytes(self.remote.size)} bytes: "
                f"{type(exc).__name__}: {detail}",
                retry_after=wait,
            )
        if "timeout" in type(exc).__name__.lower() or isinstance(exc, TimeoutError):
            return Transient(f"timeout after {done} bytes: {detail}", retry_after=wait)
        return Transient(f"connection broken after {done} bytes: {detail}", retry_after=wait)

    # ------------------------------------------------------------------ HTTP

    def _open_http(self, offset: int) -> _Opened:
        import requests

        url = self.remote.url
        target = _request_url(url)
        if self._session is None:
            self._session = requests.Session()
        headers = {"Accept-Encoding": "identity", **auth_headers(url)}
        if offset and (self.validator or self.pinned):
            headers["Range"] = f"bytes={offset}-"
            if self.validator:
                headers["If-Range"] = self.validator
        elif offset:
            # Without a validator we cannot know the bytes on disk belong to the current file.
            self._restart()
            offset = 0
        try:
            resp = self._session.get(target, headers=headers, stream=True, timeout=self.timeout, allow_redirects=True)
        except requests.RequestException as exc:
            failure = _request_failure(url, exc, target)
            if isinstance(failure, TransferError):
                raise failure from None
            kind = "timeout" if isinstance(exc, requests.Timeout) else "connection error"
            raise Transient(f"{kind}: {describe(redact(exc, url, target))}") from None
        try:
            return self._http_response(resp, offset)
        except BaseException:
            resp.close()
            raise

    def _http_response(self, resp, offset: int) -> _Opened:
        code = resp.status_code
        shown = self.remote.shown
        if code == 416 and offset:
            m = re.fullmatch(r"bytes \*/(\d+)", resp.headers.get("Content-Range", "").strip())
            resp.close()
            if m and int(m.group(1)) == offset:
                # The validator matched (else the answer is 200) and nothing is missing: the previous
                # run stopped after the last byte. Verify what we have.
                return _Opened(
                    offset,
                    offset,
                    lambda n: b"",
                    complete=True,
                    validator=self.validator,
                    etag=strip_etag(self.validator),
                )
            self._restart()
            raise Transient("HTTP 416 (range not satisfiable): restarting from zero", immediate=True)
        if code not in (200, 206):
            raise _http_status_error(self.remote.url, resp)
        validator = strip_etag(resp.headers.get("ETag"))
        validator = f'"{validator}"' if validator else resp.headers.get("Last-Modified")
        claims = stated_checksums([*resp.history, resp], self.remote.url, etag_md5=self.etag_md5)
        encoded = resp.headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity")
        if code == 206:
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", "").strip())
            if not m or int(m.group(1)) != offset:
                self._restart()
                raise Transient(
                    f"bad Content-Range {resp.headers.get('Content-Range')!r} for a resume at {offset}: restarting",
                    immediate=True,
                )
            if not self.pinned and self.validator and validator and validator != self.validator:
                self._restart()
                raise Transient("the file changed on the server (validator differs): restarting", immediate=True)
            total = int(m.group(3)) if m.group(3) != "*" else None
        else:
            if offset and self.pinned:
                raise SourceChanged(
                    f"cannot resume {shown} at byte {offset}: the server answered {code} instead of 206 "
                    "(no range support, or the file changed)",
                    shown=shown,
                )
            if offset:
                self.log(
                    f"server sent the whole file instead of bytes {offset}- (no range support or it changed): restarting"
                )
            offset = 0
            length = resp.headers.get("Content-Length", "")
            total = int(length) if length.isdigit() and not encoded else None
        if self.pinned and total is not None and self.remote.size is not None and total != self.remote.size:
            raise SourceChanged(
                f"{shown} changed while it was being copied: it now has {total} bytes, not {self.remote.size}",
                shown=shown,
            )
        raw = resp.raw

        def read(n: int) -> bytes:
            # read1: whatever arrived, at once; a connection that breaks loses no byte already received.
            return raw.read1(n, decode_content=True)

        return _Opened(
            offset,
            total,
            read,
            resp.close,
            etag=strip_etag(resp.headers.get("ETag")),
            validator=validator,
            claims=claims,
        )

    # ------------------------------------------------------------------ GCS

    def _open_gcs(self, offset: int) -> _Opened:
        if self._gcs is None:
            self._gcs = gcs_filesystem(self.timeout)
        fs = self._gcs
        meta = gcs_stat(fs, self.remote.url)
        remote = _remote_from_gcs(self.remote.url, meta)
        if remote.is_dir:
            raise SourceNotFound(f"{self.remote.url} is a directory, not a file", shown=self.remote.url)
        total = remote.size or 0
        generation = remote.validator
        if offset and (not generation or generation != self.validator or offset > total):
            if self.pinned:
                raise SourceChanged(
                    f"cannot resume {self.remote.url} at byte {offset}: the object changed (generation "
                    f"{generation}, was {self.validator})",
                    shown=self.remote.url,
                )
            self._restart()
            offset = 0
        _, path = storage.url_to_fs(self.remote.url)
        position = offset

        def read(n: int) -> bytes:
            nonlocal position
            if position >= total:
                return b""
            block = fs.cat_file(path, start=position, end=min(position + n, total))
            position += len(block)
            return block

        return _Opened(offset, total, read, etag=remote.etag, validator=generation, claims=remote.checksums)

    # ------------------------------------------------------------------ files

    def _open_file(self, offset: int) -> _Opened:
        path = storage.local_path(self.remote.url)
        try:
            fh = open(path, "rb")
            total = os.fstat(fh.fileno()).st_size
        except FileNotFoundError:
            raise SourceNotFound(f"not found: {self.remote.url}", shown=self.remote.url, cause="no such file") from None
        except OSError as exc:
            raise Transient(f"copy failed: {exc}") from None
        if offset and not self.pinned:
            self._restart()
            offset = 0
        fh.seek(offset)
        return _Opened(offset, total, fh.read, fh.close)

    # ------------------------------------------------------------------ verification

    def _verify(self, opened: _Opened) -> dict[str, str]:
        size = self.sink.size
        # A pinned copy checks what the caller expects (from its probe); others also what this answer states.
        claims = {} if self.pinned else dict(opened.claims)
        hashes = self.hashes.hexdigests()
        checks = [("size", str(opened.total), "the server announced")] if opened.total is not None else []
        if self.expected_size is not None:
            checks.append(("size", str(self.expected_size), "expected"))
        missing = (set(claims) | set(self.expected)) - set(hashes)
        if missing and self.sink.local_path is not None:
            hashes.update(hash_file(self.sink.local_path, missing, limit=size))
        checks += [(kind, want, f"expected_{kind} says") for kind, want in self.expected.items()]
        checks += [(kind, want, "the server says") for kind, want in claims.items()]
        for kind, want, who in checks:
            got = str(size) if kind == "size" else hashes.get(kind)
            if got is None or got == want:
                continue
            text = f"got {got} bytes, {who} {want}" if kind == "size" else f"{who} {want}, the bytes hash to {got}"
            mismatch = ContentMismatch(
                f"{kind} mismatch: {text}", shown=self.remote.shown, kind=kind, want=want, got=got, who=who
            )
            self.content_failures += 1
            self._restart()  # wrong bytes are never resumed from, nor kept
            if self.content_failures > self.content_retries:
                raise mismatch
            # A body shorter or longer than announced is a protocol slip: fetch it again at once.
            raise Transient(str(mismatch), immediate=who == "the server announced")
        return hashes


def sink_failure(error: BaseException, sink: Sink, copied: int, total: int | None) -> DestinationError:
    """The one-line error for a destination that refused a write."""
    where = os.path.dirname(sink.name) or sink.name
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"{where} ran out of space after {human_bytes(copied)} of {human_bytes(total)}", shown=sink.name)
    return DestinationError(f"cannot write {sink.name}: {redact(error)}", shown=sink.name)


__all__ = [
    "CHUNK",
    "COPY",
    "PROBE",
    "AccessDenied",
    "ContentMismatch",
    "Copied",
    "DestinationError",
    "FileSink",
    "FsspecSink",
    "MultiHash",
    "NoSpace",
    "Remote",
    "ResumableCopy",
    "Sink",
    "SourceChanged",
    "SourceNotFound",
    "SourceUnreachable",
    "TransferError",
    "Unsupported",
    "auth_headers",
    "b64_to_hex",
    "check_free_space",
    "gcs_filesystem",
    "hash_file",
    "is_hf_host",
    "new_hasher",
    "open_sink",
    "probe",
    "public_uri",
    "redact",
    "remote_call",
    "scheme",
    "server_side_copy",
    "stated_checksums",
]

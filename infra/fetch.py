"""Download one file robustly: resume, retry, verify, then commit atomically.

    from infra.fetch import download, probe
    result = download("https://huggingface.co/.../chunk1/example_train_0.jsonl.zst",
                      "gs://bucket/raw/chunk1/example_train_0.jsonl.zst", log=print)

Sources: ``https://`` / ``http://`` (streamed with requests), ``gs://`` (gcsfs, through
infra.storage), ``file://`` or a plain path (copied). Destinations: a local path or any URI
infra.storage writes (``gs://``: the file is staged locally, verified, then uploaded).

What makes it robust, in the order things happen:

* A verified copy already at the destination is not fetched again. "Verified" is decided by a
  sidecar ``<dest>.meta.json`` (url digest, size, sha256, md5, etag) checked against the file
  itself (its sha256 locally, size + md5/crc32c on GCS), never by mtime. A local file without
  a sidecar is adopted only when ``expected_sha256`` matches it. Concurrent calls for one
  destination on one machine wait for each other (flock) instead of writing one ``.part`` twice.
* Bytes go to ``<dest>.part``. After a failure the next attempt asks for the rest with
  ``Range: bytes=N-`` and ``If-Range: <validator>``; a ``206`` whose ``Content-Range`` starts
  at N is appended, a ``200`` (no range support, or the file changed) restarts from zero.
* Retries with exponential backoff and jitter on 408, 429 (``Retry-After`` in seconds or as
  an HTTP date, capped at ``max_backoff``), 5xx, timeouts, connection resets and truncated
  bodies. Other 4xx fail at once (``not found: URL`` for 404).
* Verification: size against ``Content-Length`` / ``Content-Range`` / ``expected_size``; every
  checksum the source states (``expected_sha256``, GCS md5/crc32c, ``x-goog-hash``,
  ``Content-MD5``, Hugging Face's ``X-Linked-Etag`` sha256). The final name appears only after
  that (atomic rename or upload).

Secrets: ``Authorization: Bearer $HF_TOKEN`` is added only for huggingface.co / hf.co hosts and
their subdomains (requests drops it when a redirect leaves the host). Every message that leaves
this module passes :func:`redact`, which also hides query-string values (signed URLs) and
``user:password@`` parts of URLs.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import json
import os
import random
import re
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from urllib.parse import urlsplit

from pydantic import BaseModel

from infra import storage
from infra.settings import get_settings
from infra.settings import redact as redact_secrets

Log = Callable[[str], None]
Progress = Callable[[int, "int | None"], None]

HF_HOSTS: tuple[str, ...] = ("huggingface.co", "hf.co")
CHUNK = 1 << 20
# Small network reads: an interrupted read loses its buffer, so this bounds what a resume repeats.
NET_CHUNK = 64 << 10
# A source that keeps sending the wrong bytes is not a network glitch: stop after a few full restarts.
CONTENT_RETRIES = 2


class FetchError(RuntimeError):
    """A download failed for good; the message names the (redacted) URL."""


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


class _Retry(Exception):
    """One attempt failed in a way worth retrying."""

    def __init__(self, reason: str, *, retry_after: float | None = None, now: bool = False, content: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.now = now  # restart at once (a protocol mismatch, not an overloaded server)
        self.content = content  # the bytes were wrong, not the transfer


# --------------------------------------------------------------------------- secrets


_USERINFO = re.compile(r"(://)[^/@\s]+@")
_QUERY_VALUE = re.compile(r"([?&][^=&#\s]+=)[^&#\s'\"]*")


def redact(text: str) -> str:
    """``text`` without secrets: settings secrets, URL passwords and query-string values."""
    text = _USERINFO.sub(r"\1***@", str(text))
    text = _QUERY_VALUE.sub(r"\1***", text)
    return redact_secrets(text)


def is_hf_host(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    return any(host == h or host.endswith("." + h) for h in HF_HOSTS)


def _auth_headers(url: str) -> dict[str, str]:
    if not is_hf_host(url):
        return {}
    token = get_settings().hf_token
    if token is None or not token.get_secret_value():
        return {}
    return {"Authorization": f"Bearer {token.get_secret_value()}"}


# --------------------------------------------------------------------------- helpers


def _scheme(url: str) -> str:
    if "://" not in url:
        return "file"
    proto = url.split("://", 1)[0].lower()
    if proto == "gcs":
        return "gs"
    if proto not in ("http", "https", "gs", "file"):
        raise FetchError(
            f"unsupported scheme {proto!r} in {redact(url)}: supported are https, http, gs, file and plain paths"
        )
    return proto


def _b64_to_hex(value: str) -> str | None:
    try:
        return base64.b64decode(value.strip()).hex()
    except (ValueError, TypeError):
        return None


def _strip_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _checksum_claims(responses, url: str, full_body: bool) -> dict[str, str]:
    """Checksums the server states for the whole object, from the response and its redirects.

    Keys: ``md5`` (hex), ``crc32c`` (base64), ``sha256`` (hex). ``Content-MD5`` describes the
    body of one response, so it counts only for a full (200) body.
    """
    claims: dict[str, str] = {}
    for resp in responses:
        headers = resp.headers
        for part in ",".join(v for k, v in headers.items() if k.lower() == "x-goog-hash").split(","):
            key, _, value = part.strip().partition("=")
            if key == "md5" and value and (hexed := _b64_to_hex(value)):
                claims["md5"] = hexed
            elif key == "crc32c" and value:
                claims["crc32c"] = value.strip()
        linked = _strip_etag(headers.get("X-Linked-Etag"))
        if linked and _SHA256.fullmatch(linked.lower()):
            claims["sha256"] = linked.lower()
        etag = _strip_etag(headers.get("ETag"))
        # Hugging Face's own resolve answer gives an LFS file's sha256 as its ETag; CDN hosts
        # (even *.hf.co ones) use other 64-hex hashes (Xet), so only the exact hub hosts count.
        host = (urlsplit(resp.url or url).hostname or "").lower().rstrip(".")
        if etag and host in HF_HOSTS and _SHA256.fullmatch(etag.lower()):
            claims.setdefault("sha256", etag.lower())
    if full_body and responses:
        md5 = responses[-1].headers.get("Content-MD5")
        if md5 and (hexed := _b64_to_hex(md5)):
            claims.setdefault("md5", hexed)
    return claims


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _hash_file(path: str, want_md5: bool, want_crc32c: bool) -> dict[str, str]:
    sha = hashlib.sha256()
    md5 = hashlib.md5(usedforsecurity=False) if want_md5 else None
    crc = None
    if want_crc32c:
        with contextlib.suppress(ImportError):
            import google_crc32c

            crc = google_crc32c.Checksum()
    with open(path, "rb") as fh:
        while block := fh.read(8 * CHUNK):
            sha.update(block)
            if md5 is not None:
                md5.update(block)
            if crc is not None:
                crc.update(block)
    out = {"sha256": sha.hexdigest()}
    if md5 is not None:
        out["md5"] = md5.hexdigest()
    if crc is not None:
        out["crc32c"] = base64.b64encode(crc.digest()).decode()
    return out


def _url_digest(url: str) -> str:
    # The sidecar must not hold a signed URL's token, but must still tell two URLs apart.
    return hashlib.sha256(url.encode()).hexdigest()


# --------------------------------------------------------------------------- probe


def probe(url: str, *, timeout: float = 60) -> RemoteInfo:
    """Cheap identity of a remote file (size, etag, checksums) without downloading it."""
    proto = _scheme(url)
    if proto == "file":
        path = storage.local_path(url)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise NotFound(f"not found: {url}") from None
        modified = datetime.fromtimestamp(st.st_mtime, UTC).isoformat()
        return RemoteInfo(url=redact(url), size=st.st_size, last_modified=modified)
    if proto == "gs":
        try:
            meta = storage.info(url)
        except FileNotFoundError:
            raise NotFound(f"not found: {url}") from None
        return RemoteInfo(
            url=redact(url),
            size=int(meta["size"]) if meta.get("size") is not None else None,
            etag=meta.get("etag") or (str(meta["generation"]) if meta.get("generation") else None),
            md5=_b64_to_hex(meta["md5Hash"]) if meta.get("md5Hash") else None,
            crc32c=meta.get("crc32c"),
            last_modified=meta.get("updated"),
        )
    import requests

    headers = {"Accept-Encoding": "identity", **_auth_headers(url)}
    try:
        with requests.Session() as session:
            resp = session.head(url, headers=headers, allow_redirects=True, timeout=timeout)
            if resp.status_code in (403, 405, 501) and not is_hf_host(url):
                # Some servers (and signed URLs, which sign the method) refuse HEAD: ask for one byte.
                ranged = session.get(url, headers={**headers, "Range": "bytes=0-0"}, stream=True, timeout=timeout)
                ranged.close()
                if ranged.status_code in (200, 206):
                    resp = ranged
    except requests.RequestException as exc:
        raise FetchError(f"cannot reach {redact(url)}: {redact(exc)}") from None
    if resp.status_code in (404, 410):
        raise NotFound(f"not found: {redact(url)}")
    if resp.status_code >= 400:
        raise FetchError(f"HTTP {resp.status_code} {resp.reason} for {redact(url)}{_auth_hint(url, resp.status_code)}")
    chain = [*resp.history, resp]
    claims = _checksum_claims(chain, url, full_body=False)
    size = None
    for r in chain:
        if r.headers.get("X-Linked-Size", "").isdigit():
            size = int(r.headers["X-Linked-Size"])
    total = re.fullmatch(r"bytes \d+-\d+/(\d+)", resp.headers.get("Content-Range", "").strip())
    if size is None and total:
        size = int(total.group(1))
    elif size is None and resp.status_code == 200 and resp.headers.get("Content-Length", "").isdigit():
        size = int(resp.headers["Content-Length"])
    return RemoteInfo(
        url=redact(url),
        size=size,
        etag=_strip_etag(resp.headers.get("ETag")),
        md5=claims.get("md5"),
        crc32c=claims.get("crc32c"),
        sha256=claims.get("sha256"),
        last_modified=resp.headers.get("Last-Modified"),
    )


def _auth_hint(url: str, status: int) -> str:
    if status in (401, 403) and is_hf_host(url):
        if get_settings().hf_token is None:
            return " (gated or private on Hugging Face? set HF_TOKEN)"
        return " (HF_TOKEN is set but was refused: check that it can read this repository)"
    return ""


# --------------------------------------------------------------------------- transfers


class _Outcome(BaseModel):
    total: int | None
    etag: str | None = None
    claims: dict[str, str] = {}


def _discard(part: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(part)


def _read_state(state_path: str, url: str) -> dict:
    try:
        with open(state_path) as fh:
            state = json.load(fh)
    except (OSError, ValueError):
        return {}
    return state if state.get("url") == _url_digest(url) else {}


def _write_state(state_path: str, url: str, validator: str | None) -> None:
    with open(state_path, "w") as fh:
        json.dump({"url": _url_digest(url), "validator": validator}, fh)


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


def _http_attempt(
    session, url: str, part: str, state_path: str, timeout: float, say: Log, progress: _Progress
) -> _Outcome:
    import requests
    import urllib3

    have = os.path.getsize(part) if os.path.exists(part) else 0
    state = _read_state(state_path, url)
    headers = {"Accept-Encoding": "identity", **_auth_headers(url)}
    if have and state.get("validator"):
        headers["Range"] = f"bytes={have}-"
        headers["If-Range"] = state["validator"]
    elif have:
        # Without a validator we cannot know the bytes on disk belong to the current file.
        _discard(part)
        have = 0
    try:
        resp = session.get(url, headers=headers, stream=True, timeout=timeout, allow_redirects=True)
    except requests.Timeout as exc:
        raise _Retry(f"timeout: {exc}") from None
    except requests.exceptions.SSLError as exc:
        if "CERTIFICATE_VERIFY_FAILED" in str(exc):  # waiting will not fix a certificate
            raise FetchError(f"TLS certificate of {redact(url)} rejected: {redact(exc)}") from None
        raise _Retry(f"TLS error: {exc}") from None
    except requests.ConnectionError as exc:
        raise _Retry(f"connection error: {exc}") from None
    except requests.RequestException as exc:  # bad URL, redirect loop: retrying cannot help
        raise FetchError(f"cannot fetch {redact(url)}: {redact(exc)}") from None
    with resp:
        code = resp.status_code
        if code in (404, 410):
            raise NotFound(f"not found: {redact(url)}")
        if code in (408, 429) or code >= 500:
            raise _Retry(f"HTTP {code} {resp.reason}", retry_after=_retry_after(resp.headers.get("Retry-After")))
        if code == 416:
            m = re.fullmatch(r"bytes \*/(\d+)", resp.headers.get("Content-Range", "").strip())
            if m and int(m.group(1)) == have:
                # The validator matched (else the answer is 200) and nothing is missing: the
                # previous run stopped after the last byte. Verify what we have.
                return _Outcome(total=have, etag=_strip_etag(state.get("validator")))
            _discard(part)
            raise _Retry("HTTP 416 (range not satisfiable): restarting from zero", now=True)
        if code not in (200, 206):
            raise FetchError(f"HTTP {code} {resp.reason} for {redact(url)}{_auth_hint(url, code)}")
        validator = _strip_etag(resp.headers.get("ETag"))
        validator = f'"{validator}"' if validator else resp.headers.get("Last-Modified")
        total: int | None = None
        if code == 206:
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", "").strip())
            if not m or int(m.group(1)) != have:
                _discard(part)
                raise _Retry(
                    f"bad Content-Range {resp.headers.get('Content-Range')!r} for a resume at {have}: restarting",
                    now=True,
                )
            if state.get("validator") and validator and validator != state["validator"]:
                _discard(part)
                raise _Retry("the file changed on the server (validator differs): restarting", now=True)
            total = int(m.group(3)) if m.group(3) != "*" else None
            mode = "ab"
            say(f"resuming at byte {have}")
        else:
            if have:
                say(f"server sent the whole file instead of bytes {have}- (no range support or it changed): restarting")
            have = 0
            length = resp.headers.get("Content-Length", "")
            total = int(length) if length.isdigit() else None
            mode = "wb"
        _write_state(state_path, url, validator)
        done = have
        try:
            with open(part, mode) as fh:
                for block in resp.iter_content(NET_CHUNK):
                    fh.write(block)
                    done += len(block)
                    progress(done, total)
        except requests.Timeout as exc:
            raise _Retry(f"timeout after {done} bytes: {exc}") from None
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise _Retry(f"connection broken after {done} bytes: {exc}") from None
        if total is not None and done < total:
            raise _Retry(f"truncated body: {done} of {total} bytes")
        claims = _checksum_claims([*resp.history, resp], url, full_body=(code == 200))
        return _Outcome(total=total, etag=_strip_etag(resp.headers.get("ETag")), claims=claims)


def _gcs_attempt(url: str, part: str, state_path: str, say: Log, progress: _Progress) -> _Outcome:
    fs, path = storage.url_to_fs(url)
    try:
        meta = fs.info(path)
    except FileNotFoundError:
        raise NotFound(f"not found: {url}") from None
    except Exception as exc:  # noqa: BLE001 - gcsfs raises several types for transient errors
        raise _Retry(f"cannot stat: {exc}") from None
    total = int(meta["size"])
    generation = str(meta.get("generation") or meta.get("etag") or meta.get("md5Hash") or "")
    have = os.path.getsize(part) if os.path.exists(part) else 0
    state = _read_state(state_path, url)
    if have and (not generation or state.get("validator") != generation or have > total):
        _discard(part)
        have = 0
    _write_state(state_path, url, generation or None)
    if have:
        say(f"resuming at byte {have}")
    done = have
    with open(part, "ab" if have else "wb") as fh:
        try:
            src = fs.open(path, "rb")
            src.seek(have)
        except FileNotFoundError:
            raise NotFound(f"not found: {url}") from None
        except Exception as exc:  # noqa: BLE001 - gcsfs/aiohttp raise many types for transient errors
            raise _Retry(f"open failed: {exc}") from None
        with src:
            while True:
                try:
                    block = src.read(8 * CHUNK)
                except Exception as exc:  # noqa: BLE001 - any read error is retried by the caller
                    raise _Retry(f"read failed after {done} bytes: {exc}") from None
                if not block:
                    break
                fh.write(block)
                done += len(block)
                progress(done, total)
    claims = {}
    if meta.get("md5Hash") and (hexed := _b64_to_hex(meta["md5Hash"])):
        claims["md5"] = hexed
    if meta.get("crc32c"):
        claims["crc32c"] = meta["crc32c"]
    return _Outcome(total=total, etag=meta.get("etag") or generation or None, claims=claims)


def _file_attempt(url: str, part: str, progress: _Progress) -> _Outcome:
    path = storage.local_path(url)
    try:
        total = os.path.getsize(path)
        done = 0
        with open(path, "rb") as src, open(part, "wb") as fh:
            while block := src.read(8 * CHUNK):
                fh.write(block)
                done += len(block)
                progress(done, total)
    except FileNotFoundError:
        raise NotFound(f"not found: {url}") from None
    except OSError as exc:
        raise _Retry(f"copy failed: {exc}") from None
    return _Outcome(total=total)


# --------------------------------------------------------------------------- verify & commit


def _verify(
    part: str, outcome: _Outcome, expected_size: int | None, expected_sha256: str | None, want_md5: bool
) -> dict[str, str]:
    size = os.path.getsize(part)
    if outcome.total is not None and size != outcome.total:
        _discard(part)
        raise _Retry(f"size mismatch: got {size} bytes, the server announced {outcome.total}", now=True, content=True)
    if expected_size is not None and size != expected_size:
        _discard(part)
        raise _Retry(f"size mismatch: got {size} bytes, expected {expected_size}", content=True)
    claims = outcome.claims
    hashes = _hash_file(part, want_md5=want_md5 or "md5" in claims, want_crc32c=want_md5 or "crc32c" in claims)
    checks = [("sha256", expected_sha256.lower(), "expected_sha256")] if expected_sha256 else []
    checks += [(kind, value, "the server") for kind, value in claims.items()]
    for kind, want, who in checks:
        got = hashes.get(kind)
        if got is not None and got != want:
            _discard(part)
            raise _Retry(f"{kind} mismatch: {who} says {want}, the bytes hash to {got}", content=True)
    return hashes


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
            if _hash_file(path, False, False)["sha256"] != meta.get("sha256"):
                return None
        else:
            info = storage.info(dest_uri)
            if int(info.get("size", -1)) != meta.get("size"):
                return None
            # GCS states md5 for plain objects and crc32c for all (composite ones lack md5).
            remote_md5 = _b64_to_hex(info["md5Hash"]) if info.get("md5Hash") else None
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
    hashes = _hash_file(path, False, False)
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
    """
    started = time.monotonic()
    proto = _scheme(url)
    name = label or shard_label(dest_uri)
    safe_url = redact(url)

    def say(msg: str) -> None:
        if log is not None:
            log(redact(f"{name}: {msg}"))

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
    with _dest_lock(dest_uri, say):
        # Another thread or process may have finished this file while we waited for the lock.
        if (done := present()) is not None:
            return done
        return _fetch(
            url,
            dest_uri,
            meta_uri,
            proto,
            name,
            safe_url,
            started,
            say,
            expected_size=expected_size,
            expected_sha256=expected_sha256,
            retries=retries,
            backoff=backoff,
            max_backoff=max_backoff,
            timeout=timeout,
            progress=progress,
        )


@contextlib.contextmanager
def _dest_lock(dest_uri: str, say: Log):
    """One writer per destination on this machine: two writers would interleave bytes in one .part."""
    import fcntl

    path = os.path.join(_staging_dir(), _url_digest(storage.normalize(dest_uri))[:24] + ".lock")
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("another download of this file is running here: waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fetch(
    url,
    dest_uri,
    meta_uri,
    proto,
    name,
    safe_url,
    started,
    say,
    *,
    expected_size,
    expected_sha256,
    retries,
    backoff,
    max_backoff,
    timeout,
    progress,
) -> FetchResult:
    local_dest = storage.is_local(dest_uri)
    if local_dest:
        final = storage.local_path(dest_uri)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        part = final + ".part"
    else:
        part = os.path.join(_staging_dir(), _url_digest(dest_uri)[:16] + "-" + storage.basename(dest_uri) + ".part")
    state_path = part + ".state.json"
    ticker = _Progress(progress)
    say(f"downloading {safe_url}")

    session = None
    if proto in ("http", "https"):
        import requests

        session = requests.Session()
    attempts = content_failures = 0
    try:
        while True:
            attempts += 1
            try:
                if session is not None:
                    outcome = _http_attempt(session, url, part, state_path, timeout, say, ticker)
                elif proto == "gs":
                    outcome = _gcs_attempt(url, part, state_path, say, ticker)
                else:
                    outcome = _file_attempt(url, part, ticker)
                hashes = _verify(part, outcome, expected_size, expected_sha256, want_md5=not local_dest)
                break
            except _Retry as exc:
                content_failures += exc.content
                if attempts > retries or content_failures > CONTENT_RETRIES:
                    raise FetchError(
                        f"{name}: giving up on {safe_url} after {attempts} attempts: {redact(exc.reason)}"
                    ) from None
                if exc.now:
                    delay = 0.0
                elif exc.retry_after is not None:
                    delay = min(exc.retry_after, max_backoff)
                else:
                    delay = min(max_backoff, backoff * 2 ** (attempts - 1)) * random.uniform(0.5, 1.0)
                say(f"attempt {attempts} failed: {exc.reason}; retrying in {delay:.1f}s")
                time.sleep(delay)
    except FetchError as exc:
        if not os.path.exists(part):  # nothing to resume from: leave no trace
            with contextlib.suppress(FileNotFoundError):
                os.remove(state_path)
        # The message is built from the URL we were given: redact it in case it carries a token.
        raise type(exc)(redact(str(exc))) from None
    finally:
        if session is not None:
            session.close()

    size = os.path.getsize(part)
    if local_dest:
        os.replace(part, final)
    else:
        storage.put_file(part, dest_uri)
        _discard(part)
    with contextlib.suppress(FileNotFoundError):
        os.remove(state_path)
    storage.write_json(
        meta_uri,
        {"url": safe_url, "url_sha256": _url_digest(url), "size": size, "etag": outcome.etag, **hashes},
    )
    ticker(size, size, final=True)
    seconds = time.monotonic() - started
    say(f"done: {size} bytes in {seconds:.1f}s, {attempts} attempt(s), sha256 {hashes['sha256'][:12]}…")
    return FetchResult(
        url=safe_url,
        uri=dest_uri,
        size=size,
        sha256=hashes["sha256"],
        etag=outcome.etag,
        attempts=attempts,
        skipped=False,
        seconds=seconds,
    )


def download_many(sources, dest_dir: str, **kwargs) -> list[FetchResult]:
    """Download :class:`infra.sources.Source` items under ``dest_dir`` one after another."""
    from infra.sources import local_name

    return [download(src.url, storage.join(dest_dir, local_name(src)), **kwargs) for src in sources]


__all__ = [
    "FetchError",
    "FetchResult",
    "NotFound",
    "RemoteInfo",
    "download",
    "download_many",
    "is_hf_host",
    "probe",
    "redact",
]

"""HTTP sources through requests: credentials for the request only, checksums the server states, status errors, the probe."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from infra import secrets
from infra.retry import Transient, parse_retry_after
from infra.settings import get_settings
from infra.transfer.checksums import b64_to_hex, strip_etag
from infra.transfer.errors import AccessDenied, SourceNotFound, TransferError
from infra.transfer.redaction import redact
from infra.transfer.remote import Remote, scheme

HF_HOSTS: tuple[str, ...] = ("huggingface.co", "hf.co")


def request_url(url: str) -> str:
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


def http_status_error(url: str, resp) -> TransferError | Transient:
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


def request_failure(url: str, exc: Exception, resolved: str | None = None) -> BaseException:
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
def http_probe(url: str, timeout: float, etag_md5: bool) -> Remote:
    import requests

    headers = {"Accept-Encoding": "identity", **auth_headers(url)}
    target = request_url(url)
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
        raise request_failure(url, exc, target) from None
    if resp.status_code >= 400:
        raise http_status_error(url, resp)
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

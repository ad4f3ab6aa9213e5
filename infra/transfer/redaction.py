"""Secrets out of every line a transfer writes: settings secrets, URL passwords, query-string values."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from infra import secrets
from infra.settings import redact as redact_secrets

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
    # remote.scheme() spelled out: it raises errors whose messages this module redacts, so it sits above it
    if "://" not in uri or uri.split("://", 1)[0].lower() not in ("http", "https"):
        return uri
    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "<query hidden>" if parts.query else "", ""))

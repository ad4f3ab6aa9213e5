"""What a source is before its bytes are read: its scheme, and :class:`Remote` (size, validators, checksums)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from infra.transfer.errors import Unsupported
from infra.transfer.redaction import redact

Log = Callable[[str], None]

SCHEMES = ("http", "https", "gs", "file")


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

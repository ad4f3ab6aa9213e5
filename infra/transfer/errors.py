"""The transfer errors: :class:`TransferError` and its kinds, each ``str()`` one line naming the source and the cause."""

from __future__ import annotations

from urllib.parse import urlsplit

from infra.retry import Transient, describe, is_brief
from infra.settings import get_settings
from infra.transfer.redaction import redact


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


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown size"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

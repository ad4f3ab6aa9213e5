"""Retry policies for everything that talks to a network: one place that says what is worth retrying.

    from infra.retry import RetryPolicy

    K8S_API = RetryPolicy(attempts=5, initial=0.5, maximum=10, budget=60)

    job = K8S_API.call(batch.create_namespaced_job, namespace, manifest, what=f"create Job {name}", log=log.warning)

    for attempt in K8S_API.retrying(what="read pod logs", log=log.warning):   # a block instead of a function
        with attempt:
            lines = core.read_namespaced_pod_log(...)

    async for attempt in K8S_API.async_retrying(what="watch jobs"):              # asyncio code
        with attempt:
            ...

A :class:`RetryPolicy` is a small frozen value built on tenacity (the engine prefect-kubernetes
uses too): how many attempts, how the waits grow (exponential with full jitter, each capped at
``maximum``), and a total time ``budget`` after which nobody waits any more, so a failure ends
in a bounded time instead of minutes of quiet retrying. On top of tenacity's building blocks it
adds what every caller here needs and tenacity has no name for:

* **what is transient** (:func:`is_transient`): timeouts, dropped and refused connections, HTTP
  408 / 429 / 5xx (except 501) from any client that exposes a status (requests, httpx, aiohttp,
  gcsfs, the kubernetes client, openai), and :class:`Transient`, which callers raise for their own
  "try again" conditions (a truncated body, a checksum that did not match). Everything else (404,
  403, 401, a bad request, a programming error) fails at once: waiting does not fix it.
* **brief failures** (:func:`is_brief`): a host name that does not resolve is retried, but only
  ``brief_attempts`` times, since DNS failures rarely heal within a retry loop.
* **Retry-After**: a wait the server asks for (a ``Retry-After`` header in seconds or as an HTTP
  date, on the exception or its response, or :attr:`Transient.retry_after`) replaces the backoff,
  still capped at ``maximum``; :attr:`Transient.immediate` retries without waiting (a protocol
  mismatch, not an overloaded server).
* **the budget** counts from the first attempt, or from the moment a caller last made progress
  (``progress=`` a clock of the last success, so a long download that keeps advancing is never
  cut off by a budget meant for failures).

When the policy gives up, the last exception is re-raised unchanged (never tenacity's
RetryError), so callers keep their own one-line error messages. ``log`` gets one line per retry:
``"<what>: attempt 2 failed (HTTP 503 Service Unavailable); retrying in 1.4s"``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import tenacity
from tenacity.wait import wait_base

T = TypeVar("T")
Log = Callable[[str], None]
OnRetry = Callable[[BaseException, int, float], None]

# Statuses that say "later" rather than "no": request timeout, too many requests, server errors.
# 501 Not Implemented is a server error that never heals.
TRANSIENT_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504, 507, 509, 520, 521, 522, 523, 524, 529})


class Transient(Exception):
    """Raise inside a retried block for a failure worth another attempt.

    ``retry_after``: seconds the other side asked us to wait; ``immediate``: retry at once (the
    next attempt does something different, e.g. restarts a download from byte 0).
    """

    def __init__(self, reason: str, *, retry_after: float | None = None, immediate: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.immediate = immediate


# --------------------------------------------------------------------------- classification


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, whichever client raised it (None if it carries none).

    ``status`` (kubernetes ApiException, aiohttp ClientResponseError), ``status_code`` (openai),
    ``code`` (gcsfs HttpError), ``response.status_code`` (requests and httpx HTTPStatusError).
    """
    for name in ("status", "status_code", "code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and 100 <= value <= 599:
            return value
        if isinstance(value, str) and value.isdigit() and 100 <= int(value) <= 599:
            return int(value)
    response = getattr(exc, "response", None)
    value = getattr(response, "status_code", None) or getattr(response, "status", None)
    return value if isinstance(value, int) and 100 <= value <= 599 else None


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds from a ``Retry-After`` value: delta-seconds or an HTTP date (RFC 9110 10.2.3).

    >>> parse_retry_after("120")
    120.0
    """
    if value is None:
        return None
    value = str(value).strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def retry_after(exc: BaseException) -> float | None:
    """The wait an exception asks for: ``exc.retry_after``, else a Retry-After header on it or its response."""
    value = getattr(exc, "retry_after", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return max(0.0, float(value))
    for holder in (exc, getattr(exc, "response", None)):
        headers = getattr(holder, "headers", None)
        if headers is None:
            continue
        try:
            header = headers.get("Retry-After") or headers.get("retry-after")
        except (AttributeError, TypeError):
            continue
        if header is not None:
            return parse_retry_after(header)
    return None


def _chain(exc: BaseException):
    """``exc`` and the exceptions it wraps (``__cause__``, ``__context__``, urllib3's ``reason``), at most 8 deep."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < 8:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for name in ("__cause__", "__context__", "reason", "os_error"):
            nested = getattr(current, name, None)
            if isinstance(nested, BaseException):
                todo.append(nested)
        if current.args and isinstance(current.args[-1], BaseException):
            todo.append(current.args[-1])


def is_brief(exc: BaseException) -> bool:
    """A host name that does not resolve (``socket.gaierror`` anywhere in the chain): retried only briefly."""
    for current in _chain(exc):
        if isinstance(current, socket.gaierror):
            return True
        # aiohttp >= 3.10 wraps the resolver's error; its type name says what happened.
        if type(current).__name__ in ("ClientConnectorDNSError", "NameResolutionError"):
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """True for failures that another attempt may cure (see the module docstring)."""
    if isinstance(exc, Transient):
        return True
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, a cancelled task
        return False
    explicit = getattr(exc, "transient", None)
    if isinstance(explicit, bool):
        return explicit
    status = http_status(exc)
    if status is not None:
        return status in TRANSIENT_STATUSES
    for current in _chain(exc):
        if isinstance(current, (TimeoutError, ConnectionError, asyncio.TimeoutError, socket.gaierror)):
            return True
        # Transport errors of the HTTP clients in use, recognised by class name (own or inherited)
        # without importing every client.
        for cls in type(current).__mro__:
            if cls.__module__.startswith(_CLIENT_MODULES) and any(word in cls.__name__ for word in _TRANSPORT_WORDS):
                return True
    return False


_CLIENT_MODULES = ("requests", "urllib3", "aiohttp", "httpx", "httpcore", "http.client", "openai", "fsspec")
_TRANSPORT_WORDS = ("Timeout", "Connection", "Connect", "Protocol", "Incomplete", "Disconnected", "Payload", "Chunked")


def describe(exc: BaseException) -> str:
    """A short, single-line account of a failure for retry log lines."""
    if isinstance(exc, Transient):
        return exc.reason
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


# --------------------------------------------------------------------------- tenacity parts


class wait_server_or_backoff(wait_base):
    """The server's Retry-After (or 0 for an immediate retry), else ``fallback``; never more than ``maximum``."""

    def __init__(self, fallback: wait_base, maximum: float):
        self.fallback = fallback
        self.maximum = maximum

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
        if exc is not None:
            if getattr(exc, "immediate", False) is True:
                return 0.0
            asked = retry_after(exc)
            if asked is not None:
                return min(asked, self.maximum)
        return min(self.fallback(retry_state), self.maximum)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry; see the module docstring for what counts as transient.

    attempts:        total attempts, the first included (1 = never retry).
    initial:         the first backoff's upper bound in seconds; each later one doubles (full jitter:
                     a wait is uniform in [0, bound], which spreads many clients out best).
    maximum:         the most one wait may last, a server's Retry-After included.
    budget:          seconds after which no further attempt starts (None: attempts alone decide);
                     counted from the first attempt or from the last progress (see ``retrying``).
    brief_attempts:  attempts for brief failures (unresolvable host names) before giving up.
    transient:       the predicate that decides what is retried (default :func:`is_transient`).
    """

    attempts: int = 8
    initial: float = 1.0
    maximum: float = 60.0
    budget: float | None = 600.0
    brief_attempts: int = 3
    transient: Callable[[BaseException], bool] = is_transient

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if self.initial < 0 or self.maximum < 0 or (self.budget is not None and self.budget < 0):
            raise ValueError("initial, maximum and budget must not be negative")

    def replace(self, **changes: Any) -> RetryPolicy:
        """A copy with some fields changed: ``policy.replace(attempts=2)``."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ building tenacity objects

    def _kwargs(
        self, what: str, log: Log | None, on_retry: OnRetry | None, progress: Callable[[], float] | None
    ) -> dict[str, Any]:
        brief_failures = 0
        started = time.monotonic()

        def should_retry(state: tenacity.RetryCallState) -> bool:
            nonlocal brief_failures
            exc = state.outcome.exception() if state.outcome is not None else None
            if exc is None or not self.transient(exc):
                return False
            if is_brief(exc):
                brief_failures += 1
                return brief_failures < self.brief_attempts
            return True

        def out_of_budget(state: tenacity.RetryCallState) -> bool:
            if self.budget is None:
                return False
            since = max(started, progress()) if progress is not None else started
            return time.monotonic() + state.upcoming_sleep - since > self.budget

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            sleep = state.next_action.sleep if state.next_action is not None else 0.0
            if on_retry is not None and exc is not None:
                on_retry(exc, state.attempt_number, sleep)
            if log is not None and exc is not None:
                prefix = f"{what}: " if what else ""
                log(f"{prefix}attempt {state.attempt_number} failed ({describe(exc)}); retrying in {sleep:.1f}s")

        backoff = tenacity.wait_random_exponential(multiplier=self.initial, max=self.maximum)
        return {
            "stop": tenacity.stop_any(tenacity.stop_after_attempt(self.attempts), out_of_budget),
            "wait": wait_server_or_backoff(backoff, self.maximum),
            "retry": should_retry,
            "before_sleep": before_sleep,
            "reraise": True,
        }

    def retrying(
        self,
        *,
        what: str = "",
        log: Log | None = None,
        on_retry: OnRetry | None = None,
        progress: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> tenacity.Retrying:
        """A fresh ``tenacity.Retrying`` for ``for attempt in ...: with attempt: ...``.

        ``what`` prefixes log lines; ``on_retry(exc, attempt_number, sleep_seconds)`` is called
        before each wait; ``progress()`` returns the ``time.monotonic()`` of the caller's last
        progress, from which the budget counts. After the loop, ``.statistics["attempt_number"]``
        says how many attempts ran.
        """
        return tenacity.Retrying(sleep=sleep, **self._kwargs(what, log, on_retry, progress))

    def async_retrying(
        self,
        *,
        what: str = "",
        log: Log | None = None,
        on_retry: OnRetry | None = None,
        progress: Callable[[], float] | None = None,
    ) -> tenacity.AsyncRetrying:
        """The asyncio twin of :meth:`retrying` (``async for attempt in ...: with attempt: ...``)."""
        return tenacity.AsyncRetrying(**self._kwargs(what, log, on_retry, progress))

    def call(self, fn: Callable[..., T], *args: Any, what: str = "", log: Log | None = None, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, retried under this policy; the last exception is re-raised unchanged."""
        return self.retrying(what=what, log=log)(fn, *args, **kwargs)

    async def acall(
        self, fn: Callable[..., Awaitable[T]], *args: Any, what: str = "", log: Log | None = None, **kwargs: Any
    ) -> T:
        """``await fn(*args, **kwargs)``, retried under this policy."""
        return await self.async_retrying(what=what, log=log)(fn, *args, **kwargs)


# Defaults for one remote request (a probe, a stat, a metadata call): a few quick attempts.
REQUEST = RetryPolicy(attempts=5, initial=0.5, maximum=10.0, budget=60.0)

__all__ = [
    "REQUEST",
    "TRANSIENT_STATUSES",
    "RetryPolicy",
    "Transient",
    "describe",
    "http_status",
    "is_brief",
    "is_transient",
    "parse_retry_after",
    "retry_after",
    "wait_server_or_backoff",
]

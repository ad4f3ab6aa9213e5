"""A real HTTP reverse proxy on 127.0.0.1 that injects faults in front of another server (the GCS emulator).

    with FaultProxy(gcs_endpoint) as proxy:
        proxy.add_faults(r"/download/.*/o/raw%2Fshard", Fault(status=503), Fault(reset_at=100_000))
        proxy.add_faults(r"/storage/v1/b/[^/]+/o/raw%2Fshard", Fault(status=429, retry_after="1"))
        # point NEMOFLOW_GCS_ENDPOINT at proxy.url, then download through gcsfs as usual
        assert proxy.injected_count() == 3

Every request is forwarded to the upstream server unless a fault is queued for it. Faults are
queued per pattern (a regular expression searched in ``METHOD PATH?QUERY``, e.g. ``GET /download/``)
and consumed one per matching request, in order, so the n-th attempt's behaviour is fixed. The
:class:`tests.support.fault_server.Fault` fields mean the same as for the file server:

    status + retry_after   answer this status with a GCS-style JSON error body (and Retry-After)
    delay                  wait this long before answering (trips the client's read timeout)
    truncate_at / reset_at forward the answer but close cleanly / reset (TCP RST) after N body bytes
    stall_at + stall       forward N body bytes, then go silent for ``stall`` seconds

Every request and every fault injected is recorded, for assertions and the faults summary.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from tests.support.fault_server import Fault, FaultyHandler, ThreadedHTTP

# Headers that describe one hop, not the message (RFC 9110 7.6.1): never forwarded.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Error"}


@dataclass
class Seen:
    line: str  # "GET /download/...?alt=media"
    headers: dict[str, str]


@dataclass
class Injected:
    pattern: str
    request: str  # "GET /download/..."
    fault: Fault


@dataclass
class _Queue:
    pattern: re.Pattern
    faults: list[Fault] = field(default_factory=list)


class FaultProxy(ThreadedHTTP):
    """Forward to ``upstream`` (``http://host:port``) with scripted faults. Use as a context manager."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        self.requests: list[Seen] = []
        self.injected: list[Injected] = []
        self._queues: list[_Queue] = []
        self._lock = threading.Lock()
        super().__init__(_Handler, "proxy")

    @property
    def url(self) -> str:
        assert self._httpd is not None, "proxy not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def add_faults(self, pattern: str, *faults: Fault) -> None:
        """Queue ``faults`` for the next requests whose ``METHOD PATH?QUERY`` matches ``pattern``."""
        with self._lock:
            for queue in self._queues:
                if queue.pattern.pattern == pattern:
                    queue.faults.extend(faults)
                    return
            self._queues.append(_Queue(re.compile(pattern), list(faults)))

    def pending(self) -> int:
        """Faults queued but not (yet) injected."""
        with self._lock:
            return sum(len(q.faults) for q in self._queues)

    def injected_count(self, pattern: str | None = None) -> int:
        with self._lock:
            return sum(1 for i in self.injected if pattern is None or i.pattern == pattern)

    def count(self, pattern: str) -> int:
        """Requests (faulty or not) whose ``METHOD PATH?QUERY`` matches ``pattern``."""
        with self._lock:
            return sum(1 for r in self.requests if re.search(pattern, r.line))

    def seen(self, pattern: str) -> list[Seen]:
        """The requests whose ``METHOD PATH?QUERY`` matches ``pattern``, in order."""
        with self._lock:
            return [r for r in self.requests if re.search(pattern, r.line)]

    def _next(self, line: str, headers: dict[str, str]) -> tuple[str, Fault] | None:
        with self._lock:
            self.requests.append(Seen(line, headers))
            for queue in self._queues:
                if queue.faults and queue.pattern.search(line):
                    fault = queue.faults.pop(0)
                    self.injected.append(Injected(queue.pattern.pattern, line, fault))
                    return queue.pattern.pattern, fault
        return None


class _Handler(FaultyHandler):
    proxy: FaultProxy

    def do_GET(self):
        self._relay()

    def do_HEAD(self):
        self._relay()

    def do_POST(self):
        self._relay()

    def do_PUT(self):
        self._relay()

    def do_DELETE(self):
        self._relay()

    def do_PATCH(self):
        self._relay()

    def _relay(self) -> None:
        try:
            self._answer()
        except OSError:  # the client gave up (a timeout we caused): nothing to tell it
            self._aborted = True

    def _answer(self) -> None:
        proxy = self.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        hit = proxy._next(f"{self.command} {self.path}", dict(self.headers.items()))
        fault = hit[1] if hit else Fault()
        if fault.before is not None:
            fault.before()
        if fault.delay and proxy._stop.wait(fault.delay):
            return
        if fault.status is not None:
            self._error(fault)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
        upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=30)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
            status, reason, answer_headers = response.status, response.reason, response.getheaders()
        finally:
            upstream.close()
        self.send_response(status, reason)
        for name, value in answer_headers:
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = fault.cut_at
        self.wfile.write(payload if cut is None else payload[:cut])
        if cut is not None:
            self._cut_off(fault, proxy._stop)

    def _error(self, fault: Fault) -> None:
        """A GCS JSON API error answer (what gcsfs parses into its HttpError / OSError)."""
        messages = {
            401: "Anonymous caller does not have storage.objects.get access to the Google Cloud Storage object.",
            403: "nemoflow-test@example.iam.gserviceaccount.com does not have storage.objects.get access.",
            404: "No such object.",
            429: "The rate of change requests to the object is too high; slow down.",
        }
        code = fault.status
        body = json.dumps(
            {"error": {"code": code, "message": messages.get(code, f"{code} injected"), "errors": []}}
        ).encode()
        self.send_response(code, REASONS.get(code))
        if fault.retry_after is not None:
            self.send_header("Retry-After", fault.retry_after)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@contextlib.contextmanager
def gcs_behind(endpoint: str):
    """A FaultProxy in front of the GCS emulator at ``endpoint``, with NEMOFLOW_GCS_ENDPOINT pointing at it.

    Objects written before (or after, through the proxy) are the emulator's own; afterwards the
    settings point at the emulator again.
    """
    from infra.settings import reload_settings

    with FaultProxy(endpoint) as proxy:
        os.environ["NEMOFLOW_GCS_ENDPOINT"] = proxy.url
        reload_settings()
        try:
            yield proxy
        finally:
            os.environ["NEMOFLOW_GCS_ENDPOINT"] = endpoint
            reload_settings()


@contextlib.contextmanager
def unresolvable_gcs():
    """NEMOFLOW_GCS_ENDPOINT on a host name that cannot resolve (``.invalid``, RFC 2606)."""
    from infra.settings import reload_settings

    old = os.environ.get("NEMOFLOW_GCS_ENDPOINT")
    os.environ["NEMOFLOW_GCS_ENDPOINT"] = "http://nemoflow-gcs.invalid:9023"
    reload_settings()
    try:
        yield "nemoflow-gcs.invalid"
    finally:
        if old is None:
            os.environ.pop("NEMOFLOW_GCS_ENDPOINT", None)
        else:
            os.environ["NEMOFLOW_GCS_ENDPOINT"] = old
        reload_settings()


def does_not_resolve(host: str) -> bool:
    """The fault is in place: the name really does not resolve here."""
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror:
        return True
    return False

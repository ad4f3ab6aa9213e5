"""A real HTTP file server on 127.0.0.1 that misbehaves on purpose, deterministically.

    with FaultServer(root) as server:
        server.add_faults("/train/chunk1/example_train_0.jsonl.zst",
                          Fault(status=429, retry_after="1"),     # 1st GET
                          Fault(truncate_at=1000),                 # 2nd GET
                          )                                        # 3rd GET and later: served normally
        url = server.url("/train/chunk1/example_train_0.jsonl.zst")
        ...
        assert server.count("/train/chunk1/example_train_0.jsonl.zst") == 3
        server.requests[-1].headers["Range"]

It serves the files under ``root`` (GET and HEAD) with ``Content-Length``, an ``ETag`` (the
sha256 of the content, quoted) and ``Last-Modified``; it honours ``Range: bytes=N-`` / ``N-M``
with ``206`` + ``Content-Range``, and ``If-Range`` (a stale validator gets the whole file, as
RFC 9110 says). Faults are queued per path and consumed one per GET of that path, so the
n-th attempt's behaviour is fixed: no randomness, no timing races. Every request is recorded
(method, path, Host, headers, response status) for assertions, e.g. on which hosts saw an
``Authorization`` header.

Used by the dataset download tests and reusable for any stage that downloads over HTTP
(image staging): ``checksums=`` adds ``x-goog-hash`` / ``Content-MD5`` / ``X-Linked-Etag``.
"""

from __future__ import annotations

import base64
import dataclasses
import email.utils
import hashlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Self
from urllib.parse import parse_qsl, unquote, urlsplit


@dataclass
class Fault:
    """What one GET of a path does instead of (or on top of) a normal answer.

    status:       answer with this status and no file (e.g. 429, 500, 503, 404).
    retry_after:  the ``Retry-After`` header value sent with ``status`` (seconds or HTTP date).
    delay:        seconds to wait before the status line (a slow server; trips read timeouts).
    truncate_at:  announce the full length but close cleanly after this many body bytes.
    reset_at:     send this many body bytes, then reset the connection (TCP RST).
    stall_at:     send this many body bytes, then go silent for ``stall`` seconds (then close).
    no_range:     ignore ``Range`` on this request (answer 200 with the whole file).
    etag:         advertise this ETag instead of the content hash (a file that "changed").
    bad_checksum: send checksum headers that do not match the bytes.
    redirect:     answer 302 to this URL (another host, a CDN).
    before:       called before answering (e.g. to replace the file on disk).
    """

    status: int | None = None
    retry_after: str | None = None
    delay: float = 0.0
    truncate_at: int | None = None
    reset_at: int | None = None
    stall_at: int | None = None
    stall: float = 0.0
    no_range: bool = False
    etag: str | None = None
    bad_checksum: bool = False
    redirect: str | None = None
    before: Callable[[], None] | None = None

    @property
    def cut_at(self) -> int | None:
        """Where the body stops (truncated, reset or stalled); None: it is sent whole."""
        return next((n for n in (self.truncate_at, self.reset_at, self.stall_at) if n is not None), None)

    def misbehaves(self) -> bool:
        """True unless this fault serves normally (a ``before`` hook alone changes nothing on the wire)."""
        return dataclasses.replace(self, before=None) != Fault()


@dataclass
class Request:
    method: str
    path: str
    host: str
    headers: dict[str, str]
    status: int | None = None
    attempt: int = 0  # n-th GET of this path (HEADs are 0)
    fault: Fault | None = None  # the fault applied, if it misbehaves
    sha256: str | None = None  # of the file as served (before any cut), when a file was served


@dataclass(frozen=True)
class _Digests:
    sha256: str
    md5: bytes
    sha256_bad: str  # of the content plus junk: what a wrong checksum header states
    md5_bad: bytes


@dataclass
class _PathState:
    faults: list[Fault] = field(default_factory=list)
    gets: int = 0


class FaultyHandler(BaseHTTPRequestHandler):
    """A request handler for fault-injecting test servers: no keep-alive, nothing in pytest's output, and
    answers cut off as a :class:`Fault` says."""

    protocol_version = "HTTP/1.0"  # one request per connection: a fault never leaks into the next attempt

    def log_message(self, format, *args):  # noqa: A002 - keep pytest output clean
        pass

    def _cut_off(self, fault: Fault, stop: threading.Event) -> None:
        """End an answer cut at ``fault.cut_at``: stall (until ``stop``), reset the connection, or close it."""
        self.wfile.flush()
        if fault.stall_at is not None:
            stop.wait(fault.stall)
        elif fault.reset_at is not None:
            # SO_LINGER 0: close() sends RST instead of FIN, as a dropped connection does.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self._abort()

    def _abort(self) -> None:
        try:
            self.connection.close()
        except OSError:
            pass
        self._aborted = True

    def finish(self) -> None:
        if getattr(self, "_aborted", False):
            return
        try:
            super().finish()
        except OSError:
            pass


class ThreadedHTTP:
    """A ThreadingHTTPServer on 127.0.0.1 (a free port), served by a daemon thread; a context manager.

    Each handler reaches its server through the attribute ``handler_attr``; :meth:`stop` also sets ``_stop``,
    which wakes handlers sleeping in a delay or a stall.
    """

    def __init__(self, handler: type[BaseHTTPRequestHandler], handler_attr: str):
        self._handler = type("Handler", (handler,), {handler_attr: self})
        self._stop = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None

    def start(self) -> Self:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class FaultServer(ThreadedHTTP):
    """Serve ``root`` over HTTP on 127.0.0.1 with scripted faults. Use as a context manager."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        ranges: bool = True,
        checksums: tuple[str, ...] = (),
        always: dict[str, Fault] | None = None,
        head: bool = True,
        require_query: dict[str, str] | None = None,
    ):
        """``ranges``: honour Range requests; ``checksums``: any of "x-goog-hash",
        "content-md5", "x-linked-etag"; ``always``: a fault applied to every GET of a path
        after its queued faults run out (e.g. a permanent 404 or a server without ranges);
        ``head=False``: refuse HEAD with 405, as some object stores and signed URLs do;
        ``require_query``: query parameters every request must carry (a signed URL's
        signature), else 403 as GCS answers a bad signature."""
        self.head = head
        self.require_query = dict(require_query or {})
        self.root = Path(root)
        self.ranges = ranges
        self.checksums = tuple(checksums)
        self.always = dict(always or {})
        self.requests: list[Request] = []
        self._paths: dict[str, _PathState] = {}
        self._lock = threading.Lock()
        super().__init__(_Handler, "server_state")

    # ---------------------------------------------------------------- control

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        """The URL of ``path``; ``host`` lets a test use a name mapped to 127.0.0.1."""
        return f"http://{host}:{self.port}/{path.lstrip('/')}"

    def add_faults(self, path: str, *faults: Fault) -> None:
        """Queue faults for the next GETs of ``path``, one per GET, in order."""
        with self._lock:
            self._state(path).faults.extend(faults)

    def count(self, path: str | None = None, method: str = "GET") -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.method == method and (path is None or r.path == _norm(path)))

    def injected_count(self, path: str | None = None) -> int:
        """Requests answered with a fault that misbehaves (a status, a delay, a cut, ...): what was injected."""
        with self._lock:
            return sum(1 for r in self.requests if r.fault is not None and (path is None or r.path == _norm(path)))

    def requests_for(self, path: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.path == _norm(path)]

    def clear_log(self) -> None:
        with self._lock:
            self.requests.clear()

    # ---------------------------------------------------------------- internals

    def _state(self, path: str) -> _PathState:
        return self._paths.setdefault(_norm(path), _PathState())

    def _next(self, path: str, method: str, record: Request) -> Fault | None:
        with self._lock:
            self.requests.append(record)
            if method != "GET":
                return self.always.get(path)
            state = self._state(path)
            state.gets += 1
            record.attempt = state.gets
            fault = state.faults.pop(0) if state.faults else self.always.get(path)
            if fault is not None and fault.misbehaves():
                record.fault = fault
            return fault

    def _digests(self, file: Path) -> _Digests:
        """Hashes of ``file`` as it is now (not cached: a test may rewrite it within one clock tick)."""
        sha, md5 = hashlib.sha256(), hashlib.md5()
        with file.open("rb") as fh:
            while block := fh.read(1 << 20):
                sha.update(block)
                md5.update(block)
        sha_bad, md5_bad = sha.copy(), md5.copy()
        sha_bad.update(b"corrupted")
        md5_bad.update(b"corrupted")
        return _Digests(sha.hexdigest(), md5.digest(), sha_bad.hexdigest(), md5_bad.digest())

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless the server stops; True when it stopped."""
        return self._stop.wait(seconds)


def _norm(path: str) -> str:
    return "/" + unquote(urlsplit(path).path).lstrip("/")


class _Handler(FaultyHandler):
    server_state: FaultServer

    def do_HEAD(self):
        self._serve_quietly(head=True)

    def do_GET(self):
        self._serve_quietly(head=False)

    def _serve_quietly(self, head: bool) -> None:
        try:
            self._serve(head)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading (it gave up, or its disk is full)
            self._aborted = True

    def _serve(self, head: bool) -> None:
        srv = self.server_state
        path = _norm(self.path)
        record = Request(
            method=self.command, path=path, host=self.headers.get("Host", ""), headers=dict(self.headers.items())
        )
        fault = srv._next(path, self.command, record) or Fault()
        if head and not srv.head:
            fault = Fault(status=405)
        if srv.require_query:
            given = dict(parse_qsl(urlsplit(self.path).query, keep_blank_values=True))
            if any(given.get(name) != value for name, value in srv.require_query.items()):
                fault = Fault(status=403)
        if fault.before is not None:
            fault.before()
        if fault.delay and srv._sleep(fault.delay):
            return
        if fault.redirect:
            record.status = 302
            self.send_response(302)
            self.send_header("Location", fault.redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault.status is not None:
            record.status = fault.status
            body = f"{fault.status} injected\n".encode()
            self.send_response(fault.status)
            if fault.retry_after is not None:
                self.send_header("Retry-After", fault.retry_after)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)
            return
        file = (srv.root / path.lstrip("/")).resolve()
        if not file.is_file() or srv.root.resolve() not in file.parents:
            record.status = 404
            self.send_error(404)
            return
        size = file.stat().st_size
        digests = srv._digests(file)
        record.sha256 = digests.sha256
        etag = f'"{fault.etag or digests.sha256}"'
        start, end = 0, size - 1
        status = 200
        wanted = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        if wanted and srv.ranges and not fault.no_range and (if_range is None or if_range == etag):
            spec = wanted.strip().removeprefix("bytes=")
            lo, _, hi = spec.partition("-")
            if lo.isdigit() and (hi == "" or hi.isdigit()):
                start = int(lo)
                end = min(int(hi), size - 1) if hi else size - 1
                if start >= size:
                    record.status = 416
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = 206
        length = end + 1 - start
        record.status = status
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", email.utils.formatdate(file.stat().st_mtime, usegmt=True))
        if srv.ranges:
            self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self._checksum_headers(digests, status, fault.bad_checksum)
        self.end_headers()
        if head:
            return
        cut = fault.cut_at
        limit = length if cut is None else min(cut, length)
        # Streamed from disk, so large files (container images) cost no memory.
        with file.open("rb") as fh:
            fh.seek(start)
            sent = 0
            while sent < limit and (block := fh.read(min(64 << 10, limit - sent))):
                self.wfile.write(block)
                sent += len(block)
        if cut is not None:
            self._cut_off(fault, srv._stop)

    def _checksum_headers(self, digests: _Digests, status: int, bad: bool) -> None:
        srv = self.server_state
        md5 = digests.md5_bad if bad else digests.md5
        sha256 = digests.sha256_bad if bad else digests.sha256
        if "x-goog-hash" in srv.checksums:
            self.send_header("x-goog-hash", f"md5={base64.b64encode(md5).decode()}")
        if "content-md5" in srv.checksums and status == 200:
            self.send_header("Content-MD5", base64.b64encode(md5).decode())
        if "x-linked-etag" in srv.checksums:
            self.send_header("X-Linked-Etag", f'"{sha256}"')

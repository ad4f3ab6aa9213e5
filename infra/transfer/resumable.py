"""The copy: :class:`ResumableCopy` streams a source into a sink, resumes a broken read, and verifies the bytes."""

from __future__ import annotations

import dataclasses
import errno
import os
import queue
import re
import threading
import time
from collections.abc import Callable

from infra import storage
from infra.retry import RetryPolicy, Transient, describe, is_transient, retry_after
from infra.transfer.checksums import CHUNK, MultiHash, hash_file, strip_etag
from infra.transfer.errors import (
    ContentMismatch,
    SourceChanged,
    SourceNotFound,
    TransferError,
    human_bytes,
    unreachable,
)
from infra.transfer.gcs import gcs_failure, gcs_filesystem, gcs_stat, remote_from_gcs
from infra.transfer.http_source import auth_headers, http_status_error, request_failure, request_url, stated_checksums
from infra.transfer.redaction import redact
from infra.transfer.remote import Log, Remote
from infra.transfer.sinks import Sink, sink_failure

OnBlock = Callable[[int, "int | None"], None]

# In-flight bytes between the reading thread and the hash+write thread.
PIPELINE_BYTES = 32 << 20
# A copy: more patience, and the budget counts from the last byte that arrived.
COPY = RetryPolicy(attempts=9, initial=1.0, maximum=60.0, budget=600.0)


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
        if self.remote.scheme == "gs" and (failure := gcs_failure(exc, self.remote.url)) is not None:
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
        target = request_url(url)
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
            failure = request_failure(url, exc, target)
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
            raise http_status_error(self.remote.url, resp)
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
        remote = remote_from_gcs(self.remote.url, meta)
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

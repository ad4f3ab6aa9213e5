"""Where a copy's bytes go: a local file (appended to, so a copy resumes) or an fsspec upload; full disks named."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

from infra import permissions, storage
from infra.transfer.errors import DestinationError, NoSpace, human_bytes
from infra.transfer.redaction import redact


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


def check_free_space(dest_dir: str, needed: int | None) -> None:
    """:class:`NoSpace` before copying when a local destination cannot hold ``needed`` bytes."""
    if needed is None or not storage.is_local(dest_dir):
        return
    path = storage.local_path(dest_dir)
    free = shutil.disk_usage(path).free
    if free < needed:
        raise NoSpace(f"needs {human_bytes(needed)}, {human_bytes(free)} free on {path}", shown=path)


def sink_failure(error: BaseException, sink: Sink, copied: int, total: int | None) -> DestinationError:
    """The one-line error for a destination that refused a write."""
    where = os.path.dirname(sink.name) or sink.name
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"{where} ran out of space after {human_bytes(copied)} of {human_bytes(total)}", shown=sink.name)
    return DestinationError(f"cannot write {sink.name}: {redact(error)}", shown=sink.name)

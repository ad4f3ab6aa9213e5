"""Artifact storage: every location is a URI, read and written through fsspec.

Accepted forms: ``gs://bucket/path`` (gcsfs), ``file:///abs/path``, or a plain
path (a PVC mount, a cluster file system, a local directory).

Writes are atomic: data goes to a temporary name beside the target and is moved
into place only after it was written completely (``os.replace`` locally; copy
then delete on GCS, whose emulator and real service lack a cheap rename).
A reader therefore never sees a half-written file under its final name, and a
crash leaves at worst a ``.tmp-*`` file that the next write ignores.

Local files and directories get explicit permissions (infra/permissions.py: NEMOFLOW_UMASK,
default files 0640 / directories 0750, NEMOFLOW_GROUP), set on the temporary file before it
takes its name, whatever umask the process inherited. Objects on ``gs://`` have no modes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator
from typing import IO, Any

# gcsfs probes a gRPC endpoint for hierarchical-namespace buckets on every
# bucket operation; against the emulator (and most buckets) that probe stalls
# ~60 s. It must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import fsspec

from infra import permissions
from infra.settings import get_settings

TMP_MARK = ".tmp-"


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI."""


def scheme(uri: str) -> str:
    if "://" in uri:
        return uri.split("://", 1)[0]
    return "file"


def is_local(uri: str) -> bool:
    return scheme(uri) == "file"


def local_path(uri: str) -> str:
    """The local file-system path of a plain or file:// URI."""
    if not is_local(uri):
        raise StorageError(f"{uri} is not a local path")
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    return os.path.abspath(os.path.expanduser(path))


def normalize(uri: str) -> str:
    """Canonical form: absolute plain path for local files, the URI otherwise."""
    return local_path(uri) if is_local(uri) else uri.rstrip("/")


def join(base: str, *parts: str) -> str:
    if is_local(base):
        return os.path.join(local_path(base), *parts)
    return posixpath.join(base.rstrip("/"), *parts)


def basename(uri: str) -> str:
    return posixpath.basename(uri.rstrip("/"))


def parent(uri: str) -> str:
    if is_local(uri):
        return os.path.dirname(local_path(uri))
    head, _, _ = uri.rstrip("/").rpartition("/")
    return head


def filesystem(uri: str) -> fsspec.AbstractFileSystem:
    proto = scheme(uri)
    if proto in ("gs", "gcs"):
        settings = get_settings()
        # No listings cache: a pipeline's processes write the same buckets (an array's tasks write journal
        # segments, the flow lists them), and gcsfs keeps a listing for the life of the process, so a
        # cached one hid files written since (tests/foundation/test_storage_listing.py).
        options: dict[str, Any] = {"use_listings_cache": False}
        if settings.gcs_endpoint:
            options.update(endpoint_url=settings.gcs_endpoint, token="anon")
        if settings.gcs_project:
            options["project"] = settings.gcs_project
        return fsspec.filesystem("gs", **options)
    return fsspec.filesystem(proto)


def url_to_fs(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The file system and the path inside it (no scheme) for ``uri``."""
    fs = filesystem(uri)
    if is_local(uri):
        return fs, local_path(uri)
    return fs, fs._strip_protocol(uri)


def to_uri(fs: fsspec.AbstractFileSystem, path: str) -> str:
    proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if proto in ("file", "local"):
        return path
    return f"{'gs' if proto in ('gs', 'gcs') else proto}://{path}"


def exists(uri: str) -> bool:
    fs, path = url_to_fs(uri)
    return fs.exists(path)


def info(uri: str) -> dict[str, Any]:
    fs, path = url_to_fs(uri)
    try:
        return fs.info(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no such file: {uri}") from exc


def size(uri: str) -> int:
    return int(info(uri)["size"])


def makedirs(uri: str) -> None:
    fs, path = url_to_fs(uri)
    if is_local(uri):
        try:
            permissions.makedirs(path)
        except OSError as exc:
            raise StorageError(f"cannot create directory {uri}: {exc.strerror or exc}") from exc
    # Object stores have no directories: nothing to create.


def ensure_writable(uri: str) -> None:
    """Fail early, naming ``uri``, when a directory cannot be written."""
    makedirs(uri)
    probe = join(uri, f"{TMP_MARK}probe-{uuid.uuid4().hex}")
    try:
        fs, path = url_to_fs(probe)
        with fs.open(path, "wb") as fh:
            fh.write(b"")
        fs.rm(path)
    except (OSError, PermissionError) as exc:
        raise StorageError(f"directory {uri} is not writable: {exc}") from exc


def glob(pattern: str) -> list[str]:
    fs, path = url_to_fs(pattern)
    return sorted(to_uri(fs, p) for p in fs.glob(path))


def listdir(uri: str) -> list[str]:
    fs, path = url_to_fs(uri)
    if not fs.exists(path):
        return []
    return sorted(to_uri(fs, p) for p in fs.ls(path, detail=False))


def remove(uri: str, recursive: bool = False) -> None:
    fs, path = url_to_fs(uri)
    if fs.exists(path):
        fs.rm(path, recursive=recursive)


def _tmp_name(uri: str) -> str:
    return join(parent(uri), f"{TMP_MARK}{uuid.uuid4().hex[:12]}-{basename(uri)}")


def commit(tmp_uri: str, final_uri: str) -> None:
    """Move a completely written temporary file to its final name."""
    if is_local(final_uri):
        os.replace(local_path(tmp_uri), local_path(final_uri))
        return
    fs, tmp = url_to_fs(tmp_uri)
    _, final = url_to_fs(final_uri)
    # GCS has no rename; fs.mv retries an unsupported rewrite call. Copy then delete.
    fs.cp_file(tmp, final)
    fs.rm(tmp)


@contextlib.contextmanager
def atomic_open(uri: str, mode: str = "wb") -> Iterator[IO]:
    """Open ``uri`` for writing; it appears under its name only if the block succeeds."""
    if "w" not in mode:
        raise ValueError("atomic_open is for writing")
    makedirs(parent(uri))
    tmp = _tmp_name(uri)
    fs, tmp_path = url_to_fs(tmp)
    try:
        with fs.open(tmp_path, mode) as fh:
            yield fh
            if is_local(uri):
                fh.flush()
                os.fsync(fh.fileno())
        if is_local(uri):
            permissions.secure_file(tmp_path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp_path)
        raise
    commit(tmp, uri)


def open_read(uri: str, mode: str = "rb") -> IO:
    fs, path = url_to_fs(uri)
    try:
        return fs.open(path, mode)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no such file: {uri}") from exc


def read_bytes(uri: str) -> bytes:
    with open_read(uri) as fh:
        return fh.read()


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    with atomic_open(uri, "wb") as fh:
        fh.write(data)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def read_json(uri: str) -> Any:
    return json.loads(read_bytes(uri))


def write_json(uri: str, obj: Any) -> None:
    write_text(uri, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def put_file(local: str, uri: str) -> None:
    """Upload (or copy) a finished local file atomically to ``uri``."""
    if is_local(uri):
        if os.path.abspath(local) == local_path(uri):
            return
        makedirs(parent(uri))
        tmp = _tmp_name(uri)
        try:
            shutil.copyfile(local, local_path(tmp))
            permissions.secure_file(local_path(tmp))
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(local_path(tmp))
            raise
        commit(tmp, uri)
        return
    fs, _ = url_to_fs(uri)
    tmp = _tmp_name(uri)
    _, tmp_path = url_to_fs(tmp)
    try:
        # Streamed (a resumable upload on GCS), not fs.put_file: gcsfs uploads small files in one
        # multipart request, and the GCS emulator drops a trailing carriage-return byte from those.
        with open(local, "rb") as src, fs.open(tmp_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp_path)
        raise
    commit(tmp, uri)


def get_file(uri: str, local: str) -> None:
    """Download ``uri`` to a local path atomically."""
    permissions.makedirs(os.path.dirname(os.path.abspath(local)))
    if is_local(uri):
        put_file(local_path(uri), local)
        return
    fs, path = url_to_fs(uri)
    tmp = _tmp_name(local)
    try:
        fs.get_file(path, tmp)
        permissions.secure_file(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, local)


def file_sha256(uri: str, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open_read(uri) as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(uri: str) -> str:
    """A cheap identity of a file's content for cache keys.

    GCS states an md5 (or crc32c) for every object; for local files we hash the
    content (sha256), which is what a cache key must depend on: size and mtime
    alone would miss a same-size edit.
    """
    if is_local(uri):
        return "sha256:" + file_sha256(uri)
    meta = info(uri)
    for key in ("md5Hash", "crc32c", "etag", "ETag"):
        if meta.get(key):
            return f"{key}:{meta[key]}:{meta.get('size')}"
    return "sha256:" + file_sha256(uri)

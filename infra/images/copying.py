"""A prebuilt ``.sqsh`` copied from its source (gs://, https://, a path) to shared storage, resumed, verified, cached."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import Callable

from infra import storage, transfer
from infra.images.errors import ImageCorrupted, ImageDestinationError, ImageError, ImageNotFound, ImageSourceError
from infra.images.references import is_docker_source, resolve_region
from infra.images.squashfs import SUPERBLOCK, SUPERBLOCK_SIZE, check_filesystem, check_superblock
from infra.images.staged import (
    LogSink,
    StagedImage,
    cached_image,
    destination_name,
    local_sha256,
    prepare_destination,
    read_sidecar,
    remove_stale_temporaries,
    write_sidecar,
)
from infra.retry import RetryPolicy
from infra.transfer import human_bytes, public_uri

CHUNK = 8 << 20
PROGRESS_EVERY = 256 << 20
RESUME_ATTEMPTS = 3
RESUME_BACKOFF_S = 1.0
# Seconds to wait for a connection or for the next bytes before a read counts as failed (and is resumed).
TIMEOUT_S = 60.0


def new_hasher(algorithm: str):
    """A hashlib-like object for ``sha256``, ``md5`` or ``crc32c`` (the transfer stack's)."""
    return transfer.new_hasher(algorithm)


@dataclasses.dataclass(frozen=True)
class SourceInfo:
    """What a source states about itself before any byte is copied."""

    uri: str
    size: int | None
    checksum: str | None  # "md5:<hex>" / "crc32c:<hex>" / "sha256:<hex>": what the copy must match
    # Cache key part: the stated checksum, else the strongest validator the source has;
    # for a local or fuse-mounted file its stat identity, so a 20 GB image is not read
    # an extra time just to find out it was staged already.
    identity: str
    # HTTP If-Range validator (strong ETag or Last-Modified): a resumed download
    # only continues if the file is still the one whose first part we have.
    validator: str | None = None
    remote: transfer.Remote | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def shown(self) -> str:
        return public_uri(self.uri)


_local_sha256_memo: dict[tuple, str] = {}


def _stat_identity(path: str) -> str:
    """Inode, size, mtime and ctime: any rewrite or replacement of the file changes one of them."""
    st = os.stat(path)
    return f"stat:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _stated(remote: transfer.Remote) -> str | None:
    # md5 first: hashlib's md5 is faster than crc32c in pure Python, and composite GCS objects
    # (parallel uploads) state only crc32c, so that is the fallback.
    for algorithm in ("md5", "crc32c"):
        if value := remote.checksums.get(algorithm):
            return f"{algorithm}:{value}"
    return None


def _source_error(exc: transfer.TransferError, source: str) -> ImageError:
    """The image error for a transfer failure, worded for image sources."""
    shown = public_uri(source)
    if isinstance(exc, transfer.SourceNotFound):
        kind = storage.scheme(source)
        if kind in ("gs", "gcs"):
            return ImageNotFound(f"image source not found: no such object {source}")
        if kind == "file":
            return ImageNotFound(f"image source not found: no such file {storage.local_path(source)}")
        return ImageNotFound(f"image source not found: {shown} (HTTP {exc.status or 404})")
    if isinstance(exc, transfer.SourceUnreachable):
        error = ImageSourceError(
            f"cannot reach image source {shown}: {exc.reason} (gave up after {exc.attempts} attempts)"
        )
        error.transient = exc.transient  # False for a host name that does not resolve
        return error
    if exc.status is not None and storage.scheme(source) in ("http", "https"):
        return ImageNotFound(f"image source {shown} answered {exc.cause}")
    if isinstance(exc, transfer.AccessDenied):
        return ImageNotFound(f"image source: {exc}")
    error = ImageSourceError(str(exc))
    error.transient = exc.transient
    return error


def probe_source(source: str) -> SourceInfo:
    """Size and stated checksum of a ``.sqsh`` source; :class:`ImageSourceError` when it cannot be read."""
    kind = storage.scheme(source)
    if kind not in ("http", "https", "gs", "gcs", "file"):
        raise ImageError(
            f"image source {source!r}: unsupported scheme {kind}:// (use gs://, https://, file://, a path, or docker://)"
        )
    if kind == "file":
        path = storage.local_path(source)
        if not os.path.exists(path):
            raise ImageNotFound(f"image source not found: no such file {path}")
        if os.path.isdir(path):
            raise ImageNotFound(f"image source {path} is a directory, not a .sqsh file")
        remote = transfer.Remote(url=path, scheme="file", size=os.path.getsize(path))
        return SourceInfo(path, remote.size, None, _stat_identity(path), remote=remote)
    try:
        remote = transfer.probe(source, timeout=TIMEOUT_S, etag_md5=True)
    except transfer.TransferError as exc:
        raise _source_error(exc, source) from None
    checksum = _stated(remote)
    if remote.scheme == "gs":
        if remote.is_dir:
            raise ImageNotFound(f"image source {source} is a directory, not a .sqsh file")
        identity = f"{checksum or 'generation:' + str(remote.generation)}:{remote.size}"
        return SourceInfo(source, remote.size, checksum, identity, remote=remote)
    validator = checksum or (f"etag:{remote.etag_header}" if remote.etag_header else None)
    if validator is None and remote.last_modified:
        validator = f"last-modified:{remote.last_modified}"
    identity = f"{validator or 'unvalidated'}:{remote.size}"
    return SourceInfo(source, remote.size, checksum, identity, remote.validator, remote=remote)


def _revalidate_local(final: str, info: SourceInfo, log: LogSink) -> StagedImage | None:
    """A local source whose stat changed (touched, re-mounted) but whose bytes may not have.

    Reading it once to compare with the staged copy's sha256 is cheaper than
    copying it again; on a match the sidecar learns the new stat identity.
    """
    if not info.identity.startswith("stat:"):
        return None
    meta = read_sidecar(final)
    if not meta or meta.get("source") != info.uri or meta.get("size") != info.size:
        return None
    if not str(meta.get("checksum", "")).startswith("sha256:") or not storage.exists(final):
        return None
    log(f"{info.shown} was touched since it was staged; comparing its sha256 with the staged copy")
    if local_sha256(info.uri) != meta["checksum"]:
        return None
    hit = cached_image(final, info.uri, meta.get("source_checksum"), log)
    if hit is not None:
        hit.source_checksum = info.identity
        write_sidecar(hit, verified_at=meta.get("verified_at"))
    return hit


def _is_gcs(uri: str) -> bool:
    return storage.scheme(uri) in ("gs", "gcs")


def _copy_within_gcs(info: SourceInfo, tmp: str, final: str, log: LogSink, progress) -> StagedImage:
    """Bucket to bucket: GCS copies server-side (no byte passes through here) and states the new md5/crc32c."""
    algorithm = info.checksum.split(":", 1)[0]
    started = time.monotonic()
    log(f"copying {info.shown} ({human_bytes(info.size)}) to {final} inside GCS")
    try:
        try:
            copy = transfer.server_side_copy(info.uri, tmp)
        except transfer.TransferError as exc:
            raise _source_error(exc, info.uri) from None
        stated = copy.checksums.get(algorithm)
        actual = f"{algorithm}:{stated}" if stated else None
        if copy.size != info.size or actual != info.checksum:
            raise ImageCorrupted(
                f"GCS copy of {info.uri} does not match: the source states {info.checksum} ({info.size} bytes), "
                f"the copy {actual} ({copy.size} bytes) (copy discarded)"
            )
        with storage.open_read(tmp) as fh:
            header = fh.read(SUPERBLOCK_SIZE)
        superblock = check_superblock(header, copy.size, info.uri)
        check_filesystem(tmp, superblock, info.uri)
        storage.commit(tmp, final)
    except BaseException:
        with contextlib.suppress(Exception):
            storage.remove(tmp)
        raise
    image = StagedImage(
        uri=final,
        size=info.size,
        checksum=info.checksum,
        source=info.uri,
        source_checksum=info.identity,
        bytes_copied=info.size,
        seconds=time.monotonic() - started,
        superblock=superblock,
    )
    write_sidecar(image)
    if progress is not None:
        progress(info.size, info.size)
    log(
        f"verified {final}: {info.checksum} stated by GCS for the copy, squashfs {superblock.version} "
        f"{superblock.compression}, {superblock.inodes} inodes"
    )
    return image


def copy_policy() -> RetryPolicy:
    """How a copy resumes after a dropped connection: RESUME_ATTEMPTS resumes, waits from RESUME_BACKOFF_S."""
    return RetryPolicy(
        attempts=RESUME_ATTEMPTS + 1,
        initial=RESUME_BACKOFF_S,
        maximum=max(RESUME_BACKOFF_S * 2**RESUME_ATTEMPTS, RESUME_BACKOFF_S),
        budget=transfer.COPY.budget,
    )


def copy_image(
    source: str,
    dest_dir: str,
    *,
    force: bool = False,
    log: LogSink | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    chunk: int = CHUNK,
) -> StagedImage:
    """Stream a ``.sqsh`` from ``source`` into the directory ``dest_dir``, verified; reuse a verified copy.

    Nothing appears under the final name unless the bytes match the source's checksum (and size),
    the superblock is sound and ``unsquashfs -l`` reads the file system. A dropped connection is
    resumed at the next byte (RESUME_ATTEMPTS times); a failed copy leaves nothing behind.
    ``progress(copied, total)`` is called about every PROGRESS_EVERY bytes and at the end (total
    is None when unknown).
    """
    log = log or (lambda line: None)
    source = resolve_region(source)
    if is_docker_source(source):
        raise ImageError(f"{source} is a registry image: convert it with enroot (--convert), not copy it")
    if storage.is_local(source):
        source = storage.local_path(source)
    dest_dir = storage.normalize(dest_dir)
    shown = public_uri(source)
    info = probe_source(source)
    final = storage.join(dest_dir, destination_name(source))
    if storage.is_local(final) and storage.is_local(source) and os.path.abspath(final) == source:
        raise ImageError(f"destination {final} is the source itself; choose another --dest")
    if not force and (hit := cached_image(final, shown, info.identity, log) or _revalidate_local(final, info, log)):
        log(f"{final} already verified from {shown} ({hit.checksum}); nothing copied")
        return hit
    prepare_destination(dest_dir, info.size)
    remove_stale_temporaries(dest_dir, storage.basename(final), log)
    algorithm, _, stated = (info.checksum or "sha256:").partition(":")
    tmp = storage.join(dest_dir, f"{storage.TMP_MARK}{uuid.uuid4().hex[:12]}-{storage.basename(final)}")
    if _is_gcs(source) and _is_gcs(dest_dir) and info.checksum:
        return _copy_within_gcs(info, tmp, final, log, progress)

    header = bytearray()

    def inspect(block: bytes, offset: int) -> None:
        # Refuse a wrong file (an HTML error page, a tarball) after 96 bytes, not 20 GB.
        if len(header) < SUPERBLOCK_SIZE:
            header.extend(block[: SUPERBLOCK_SIZE - len(header)])
            if len(header) == SUPERBLOCK_SIZE:
                bytes_used = SUPERBLOCK.unpack_from(header)[12] if header[:4] == b"hsqs" else 0
                check_superblock(bytes(header), info.size if info.size is not None else bytes_used, shown)

    marks = {"log": 1 << 30, "progress": PROGRESS_EVERY}

    def on_block(copied: int, total: int | None) -> None:
        if copied >= marks["log"]:
            log(f"  {human_bytes(copied)} of {human_bytes(info.size)}")
            marks["log"] += 1 << 30
        if progress is not None and copied >= marks["progress"]:
            progress(copied, info.size)
            marks["progress"] += PROGRESS_EVERY

    def on_retry(exc: BaseException, attempt: int, sleep: float, offset: int) -> None:
        reason = exc.reason if isinstance(exc, transfer.Transient) else transfer.describe(exc)
        log(transfer.redact(f"{reason}; retrying in {sleep:.1f}s (resume {attempt} of {RESUME_ATTEMPTS})", source))

    log(f"copying {shown} ({human_bytes(info.size)}) to {final}")
    try:
        sink = transfer.open_sink(tmp)
    except OSError as exc:
        raise ImageDestinationError(f"destination {dest_dir} is not writable: {exc}") from exc
    copied = 0
    try:
        try:
            result = transfer.ResumableCopy(
                info.remote,
                sink,
                kinds=(algorithm,),
                pinned=True,
                expected={algorithm: stated} if stated else None,
                expected_size=info.size,
                timeout=TIMEOUT_S,
                chunk=chunk,
                etag_md5=True,
                inspect=inspect,
                on_block=on_block,
                log=log,
                on_retry=on_retry,
            ).run(copy_policy())
        except transfer.ContentMismatch as exc:
            if exc.kind == "size":
                raise ImageCorrupted(
                    f"copy of {shown} is incomplete: {exc.got} of {exc.want} bytes arrived (copy discarded)"
                ) from None
            raise ImageCorrupted(
                f"checksum mismatch for {shown}: the source states {info.checksum}, the copy has "
                f"{algorithm}:{exc.got} (copy discarded)"
            ) from None
        except transfer.DestinationError as exc:
            if isinstance(exc, transfer.NoSpace):
                raise ImageDestinationError(
                    f"{dest_dir} ran out of space after {human_bytes(sink.size)} of {human_bytes(info.size)} "
                    "(copy discarded)"
                ) from None
            raise ImageDestinationError(str(exc)) from None
        except transfer.SourceUnreachable as exc:
            error = ImageSourceError(f"{exc.reason} (gave up after {exc.attempts} attempts)")
            error.transient = exc.transient
            raise error from None
        except transfer.SourceChanged as exc:
            raise ImageSourceError(str(exc)) from None
        except transfer.TransferError as exc:
            raise _source_error(exc, source) from None
        copied = result.size
        actual = f"{algorithm}:{result.hashes[algorithm]}"
        superblock = check_superblock(bytes(header), copied, shown)
        if info.identity.startswith("stat:") and _stat_identity(source) != info.identity:
            raise ImageCorrupted(f"{source} changed while it was being copied (copy discarded)")
        sink.close()
        check_filesystem(tmp, superblock, shown)
        storage.commit(tmp, final)
    except BaseException:
        sink.discard()
        raise
    image = StagedImage(
        uri=final,
        size=copied,
        checksum=actual,
        source=shown,
        source_checksum=info.identity,
        bytes_copied=copied,
        seconds=result.seconds,
        superblock=superblock,
    )
    write_sidecar(image)
    if progress is not None:
        progress(copied, info.size)
    rate = copied / image.seconds / (1 << 20) if image.seconds > 0 else 0.0
    log(
        f"verified {final}: {actual}, squashfs {superblock.version} {superblock.compression}, "
        f"{superblock.inodes} inodes; {human_bytes(copied)} in {image.seconds:.1f} s ({rate:.0f} MiB/s)"
    )
    return image

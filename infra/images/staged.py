"""Staged images on shared storage: the sidecar cache beside each image, the destination's checks, a crashed copy's leftovers."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra import storage, transfer
from infra.images.errors import ImageDestinationError, ImageError, ImageVerificationError
from infra.images.squashfs import Superblock, read_superblock
from infra.transfer import human_bytes

LogSink = Callable[[str], None]

SIDECAR_SUFFIX = ".meta.json"
STALE_TMP_S = 3600


@dataclasses.dataclass
class StagedImage:
    uri: str
    size: int
    checksum: str
    source: str
    source_checksum: str
    digest: str | None = None
    cached: bool = False
    bytes_copied: int = 0
    seconds: float = 0.0
    superblock: Superblock | None = None


def sidecar_uri(image_uri: str) -> str:
    return image_uri + SIDECAR_SUFFIX


def read_sidecar(image_uri: str) -> dict[str, Any] | None:
    try:
        return storage.read_json(sidecar_uri(image_uri))
    except (OSError, ValueError):  # absent, unreadable or half-understood: not a cache hit
        return None


def cached_image(image_uri: str, source: str, source_identity: str, log: LogSink | None = None) -> StagedImage | None:
    """The image at ``image_uri`` if its sidecar says it was verified from this source at this checksum.

    Re-checks the size and the superblock (cheap), not the full checksum: the
    file was hashed when it was written and nothing here rewrites it in place.
    """
    meta = read_sidecar(image_uri)
    if not meta or not storage.exists(image_uri):
        return None
    if meta.get("source") != source or meta.get("source_checksum") != source_identity:
        if log:
            log(f"{image_uri} was staged from {meta.get('source')} at {meta.get('source_checksum')}; staging again")
        return None
    try:
        if storage.size(image_uri) != meta.get("size"):
            raise ImageVerificationError(f"{image_uri} changed size since it was verified")
        superblock = read_superblock(image_uri)
    except ImageVerificationError as exc:
        if log:
            log(f"cached image is not usable ({exc}); staging again")
        return None
    return StagedImage(
        uri=image_uri,
        size=meta["size"],
        checksum=meta["checksum"],
        source=source,
        source_checksum=source_identity,
        digest=meta.get("digest"),
        cached=True,
        superblock=superblock,
    )


_local_sha256_memo: dict[tuple, str] = {}


def local_sha256(path: str) -> str:
    """sha256 of a local file, remembered by (path, inode, size, mtime): the cache key and the copy both need it."""
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _local_sha256_memo:
        _local_sha256_memo[key] = "sha256:" + transfer.hash_file(path)["sha256"]
    return _local_sha256_memo[key]


def write_sidecar(image: StagedImage, verified_at: str | None = None) -> None:
    storage.write_json(
        sidecar_uri(image.uri),
        {
            "source": image.source,
            "source_checksum": image.source_checksum,
            "checksum": image.checksum,
            "size": image.size,
            "digest": image.digest,
            "verified_at": verified_at or datetime.now(UTC).isoformat(timespec="seconds"),
            "superblock": dataclasses.asdict(image.superblock) if image.superblock else None,
        },
    )


def check_free_space(dest_dir: str, needed: int | None) -> None:
    """Fail before copying when a local destination cannot hold ``needed`` bytes."""
    try:
        transfer.check_free_space(dest_dir, needed)
    except transfer.NoSpace as exc:
        raise ImageDestinationError(str(exc)) from None


def destination_name(source: str) -> str:
    name = storage.basename(source.split("?", 1)[0])
    if not name or name in (".", ".."):
        raise ImageError(f"image source {source!r} does not end in a file name")
    return name


def prepare_destination(dest_dir: str, needed: int | None) -> None:
    try:
        storage.ensure_writable(dest_dir)
    except (storage.StorageError, OSError) as exc:
        raise ImageDestinationError(f"destination {dest_dir} is not writable: {exc}") from exc
    check_free_space(dest_dir, needed)


def remove_stale_temporaries(dest_dir: str, name: str, log: LogSink) -> None:
    """Delete what a crashed copy of ``name`` left behind: images are large, and nobody else cleans up.

    Only local temporaries untouched for STALE_TMP_S go: a copy in progress
    writes continuously, so its file's mtime stays fresh.
    """
    if not storage.is_local(dest_dir):
        return
    now = time.time()
    for path in Path(storage.local_path(dest_dir)).glob(f"{storage.TMP_MARK}*-{name}"):
        with contextlib.suppress(OSError):
            st = path.stat()
            if now - st.st_mtime > STALE_TMP_S:
                path.unlink()
                log(f"removed {path}, {human_bytes(st.st_size)} left by an interrupted copy")

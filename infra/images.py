"""Container images for the stages: prebuilt squashfs files, registry references, enroot imports.

Three ways to say which image a run uses:

* a prebuilt enroot/pyxis ``.sqsh``: ``gs://``, ``https://``, ``file://`` or a
  plain path (a fuse mount such as ``/gcs/...``). :func:`copy_image` streams it
  through fsspec to shared storage, verifies it and caches it;
* ``docker://REGISTRY/IMAGE:TAG`` (or enroot's ``docker://REGISTRY#IMAGE:TAG``):
  :func:`convert_image` imports it with ``enroot import`` in a cluster job;
* on Kubernetes the reference itself (``nvcr.io/nvidia/nemo:25.02``), checked
  by :func:`parse_docker_ref` and recorded, digest included when given.

``<region>`` in a source (``gs://vmds-containers-<region>/...``) becomes the
``region`` setting (us, europe or asia).

Bytes move through the one transfer stack (infra/transfer/: probe, resumable
copy, retries through infra/retry.py policies, redaction); this module adds what
is specific to images. A copy is verified three times: against the checksum the
source states (GCS object md5/crc32c; HTTP ``x-goog-hash``, ``Content-MD5`` or an
md5 ETag, plus Content-Length); by the squashfs superblock (magic, version 4.0,
block size, inode count, ``bytes_used`` against the file size), which catches a
truncated or wrong file even when the source states no checksum; and by
squashfs-tools' ``unsquashfs -l``, which reads the inode, directory, fragment and
id tables, so a sound superblock in front of a damaged body is refused too. It is
written under a temporary name and renamed only once verified. Beside each image a
sidecar ``<image>.meta.json`` records the source, the source's checksum, the
image's checksum, its size and when it was verified; a later copy of the same
source with the same checksum finds it and copies nothing. A local (or fuse)
source states no checksum: its identity is its stat (inode, size, mtime, ctime),
the copy records its sha256, and a touched-but-unchanged source is recognised
by comparing that sha256 instead of copying again.

Registry credentials (``NEMOFLOW_REGISTRY_USER`` / ``NEMOFLOW_REGISTRY_PASSWORD``;
for nvcr.io the user defaults to ``$oauthtoken`` and the password is the NGC
API key) reach the conversion job only through its environment; the job writes
them to a private, temporary enroot config and deletes it at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import struct
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from infra import storage, transfer
from infra.jobs import Backend, JobResult, JobSpec, JobState, Resources
from infra.retry import RetryPolicy
from infra.settings import get_settings

LogSink = Callable[[str], None]

CHUNK = 8 << 20
SIDECAR_SUFFIX = ".meta.json"
TEMPLATE = Path(__file__).resolve().parent.parent / "deployments" / "slurm" / "enroot-import.sh.j2"
ENROOT_MISSING = "enroot not found on the node (install enroot + pyxis, or stage a prebuilt .sqsh)"
# Registries that refuse anonymous pulls of the images we care about; others
# are tried anonymously when no credentials are set.
LOGIN_REQUIRED = {"nvcr.io": "$oauthtoken"}
# Hosts enroot's curl talks to while pulling from a registry: the token
# service lives elsewhere for Docker Hub and NGC, and needs the same login.
NETRC_HOSTS = {
    "nvcr.io": ["nvcr.io", "authn.nvidia.com"],
    "docker.io": ["registry-1.docker.io", "auth.docker.io"],
}
IMPORT_CPUS = 4
IMPORT_TIME = "02:00:00"
PROGRESS_EVERY = 256 << 20
RESUME_ATTEMPTS = 3
RESUME_BACKOFF_S = 1.0
# Seconds to wait for a connection or for the next bytes before a read counts as failed (and is resumed).
TIMEOUT_S = 60.0
STALE_TMP_S = 3600
# mksquashfs pads images to 4 KiB; anything much longer is not a plain image.
MAX_TRAILING_BYTES = 64 << 10


class ImageError(ValueError):
    """A problem with an image source, a copy or a conversion; the message names the input."""

    # True where trying again may succeed (a dropped connection, a corrupted
    # transfer); the Prefect task retries only those.
    transient = False


class ImageSourceError(ImageError):
    """The source cannot be read completely (a transfer problem: worth a retry)."""

    transient = True


class ImageNotFound(ImageSourceError):
    """The source does not exist."""

    transient = False


class ImageVerificationError(ImageError):
    """The file is not a usable squashfs image."""


class ImageCorrupted(ImageVerificationError):
    """A copy does not match its source (size or checksum): the transfer went wrong."""

    transient = True


class ImageDestinationError(ImageError):
    """The destination cannot take the image (not writable, not enough space)."""


class RegistryCredentialsError(ImageError):
    """A private registry needs credentials that are not set."""


class EnrootNotFound(ImageError):
    """The conversion job ran on a node without enroot."""


human_bytes = transfer.human_bytes


# ---------------------------------------------------------------- sources and references


public_uri = transfer.public_uri


def resolve_region(source: str, region: str | None = None) -> str:
    """Replace ``<region>`` with the configured region (us, europe, asia).

    >>> resolve_region("gs://vmds-containers-<region>/nemo.sqsh", "europe")
    'gs://vmds-containers-europe/nemo.sqsh'
    """
    return source.replace("<region>", region or get_settings().region)


# Docker's image reference grammar (distribution/reference), defined once: parse_docker_ref (enroot and
# docker:// references) and infra/k8s/images.py (what a pod pulls) match against these parts.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
REGISTRY = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*|\[[0-9a-fA-F:]+\])(?::[0-9]{{1,5}})?"
REPOSITORY = rf"{_COMPONENT}(?:/{_COMPONENT})*"
TAG = r"[\w][\w.-]{0,127}"
DIGEST = r"sha256:[0-9a-f]{64}"
# [registry[:port]/]path[:tag][@sha256:<64 hex>], as docker pull and Kubernetes read it
REFERENCE = re.compile(
    rf"^(?:(?P<registry>{REGISTRY})/)?(?P<repository>{REPOSITORY})(?::(?P<tag>{TAG}))?(?:@(?P<digest>{DIGEST}))?$"
)
_REGISTRY_RE = re.compile(rf"^{REGISTRY}$")
_REPOSITORY_RE = re.compile(rf"^{REPOSITORY}$")
_TAG_RE = re.compile(rf"^{TAG}$")
_DIGEST_RE = re.compile(rf"^{DIGEST}$")


@dataclasses.dataclass(frozen=True)
class DockerRef:
    """A registry image: ``registry/repository[:tag][@sha256:digest]``."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def canonical(self) -> str:
        """The form Kubernetes and docker pull take."""
        return self.registry + "/" + self._name_tag_digest

    @property
    def enroot_uri(self) -> str:
        """The form ``enroot import`` takes: ``docker://REGISTRY#IMAGE:TAG``.

        enroot has no ``@digest`` syntax; it puts the text after ``:`` into the
        manifest URL (``/v2/IMAGE/manifests/<it>``), and since 3.2 accepts ``:``
        there, so a digest goes where the tag would (``IMAGE:sha256:...``).
        Docker Hub's registry API is served by registry-1.docker.io, not docker.io.
        """
        registry = "registry-1.docker.io" if self.registry == "docker.io" else self.registry
        return f"docker://{registry}#{self.repository}:{self.digest or self.tag}"

    @property
    def _name_tag_digest(self) -> str:
        return self.repository + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    @property
    def sqsh_name(self) -> str:
        """File name of the imported image, enroot's ``+``-joined style, registry included."""
        parts = [self.registry.replace(":", "_"), *self.repository.split("/")]
        if self.tag:
            parts.append(self.tag)
        if self.digest:
            parts.append(self.digest.replace(":", "-")[:19])
        return "+".join(parts) + ".sqsh"


def is_docker_source(source: str) -> bool:
    return source.startswith("docker://")


def parse_docker_ref(reference: str) -> DockerRef:
    """Parse and validate an image reference; raise :class:`ImageError` naming what is wrong.

    Accepts ``docker://`` or none, enroot's ``REGISTRY#IMAGE`` and Docker's
    ``REGISTRY/IMAGE``; a first component without a dot, colon or ``localhost``
    is a Docker Hub repository, as ``docker pull`` reads it. A tag or a digest
    is required: an image that silently drifts makes runs irreproducible.

    >>> parse_docker_ref("docker://nvcr.io#nvidia/nemo:24.07").canonical
    'nvcr.io/nvidia/nemo:24.07'
    """
    text = reference.strip()
    body = text[len("docker://") :] if text.startswith("docker://") else text
    if "://" in body:
        raise ImageError(f"image reference {reference!r}: only docker:// references name a registry image")
    if not body:
        raise ImageError(f"image reference {reference!r} is empty")
    if "@" in body.split("#", 1)[0].split("/", 1)[0] and "#" in body:
        raise ImageError(
            f"image reference {reference!r} carries a user name; set NEMOFLOW_REGISTRY_USER and "
            "NEMOFLOW_REGISTRY_PASSWORD instead"
        )
    digest = None
    if "@" in body:
        body, digest = body.rsplit("@", 1)
        if not _DIGEST_RE.match(digest):
            raise ImageError(
                f"image reference {reference!r}: digest {digest!r} is not sha256: followed by 64 lowercase hex digits"
            )
    if "#" in body:
        registry, path = body.split("#", 1)
    else:
        first, _, rest = body.partition("/")
        if rest and ("." in first or ":" in first or first == "localhost"):
            registry, path = first, rest
        else:
            registry, path = "docker.io", body
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG_RE.match(tag):
            raise ImageError(
                f"image reference {reference!r}: tag {tag!r} is not letters, digits, '_', '.', '-' (max 128)"
            )
    if not _REGISTRY_RE.match(registry):
        raise ImageError(f"image reference {reference!r}: registry {registry!r} is not a host name[:port]")
    if registry == "docker.io" and "/" not in path:
        path = "library/" + path
    if not _REPOSITORY_RE.match(path):
        hint = " (repository names are lowercase)" if path.lower() != path else ""
        raise ImageError(
            f"image reference {reference!r}: repository {path!r} is not lowercase components separated by '/'{hint}"
        )
    if tag is None and digest is None:
        raise ImageError(
            f"image reference {reference!r} has no tag or digest: name one (e.g. :24.07 or "
            "@sha256:...) so every run uses the same image"
        )
    return DockerRef(registry=registry, repository=path, tag=tag, digest=digest)


# ---------------------------------------------------------------- squashfs superblock

# Squashfs 4.0 superblock, the first 96 bytes of an image, little-endian
# (squashfs-tools' squashfs_fs.h, struct squashfs_super_block):
#   u32 s_magic ('hsqs'), u32 inodes, i32 mkfs_time, u32 block_size,
#   u32 fragments, u16 compression, u16 block_log, u16 flags, u16 no_ids,
#   u16 s_major, u16 s_minor, u64 root_inode, u64 bytes_used,
#   u64 id_table_start, u64 xattr_id_table_start, u64 inode_table_start,
#   u64 directory_table_start, u64 fragment_table_start, u64 lookup_table_start
SUPERBLOCK = struct.Struct("<IIiIIHHHHHHQQQQQQQQ")
SUPERBLOCK_SIZE = SUPERBLOCK.size  # 96
SQUASHFS_MAGIC = 0x73717368  # b"hsqs" read little-endian
COMPRESSORS = {1: "gzip", 2: "lzma", 3: "lzo", 4: "xz", 5: "lz4", 6: "zstd"}
NO_TABLE = 0xFFFFFFFFFFFFFFFF


@dataclasses.dataclass(frozen=True)
class Superblock:
    inodes: int
    block_size: int
    compression: str
    version: str
    bytes_used: int
    # Where the metadata tables begin (inode table first; all of them end at bytes_used).
    table_start: int = SUPERBLOCK_SIZE


def check_superblock(header: bytes, file_size: int, name: str) -> Superblock:
    """Validate a squashfs superblock against the file's size; raise naming ``name`` and the fault."""
    if len(header) < SUPERBLOCK_SIZE:
        raise ImageVerificationError(
            f"{name} is not a squashfs image (or is truncated): {len(header)} bytes, shorter than a superblock "
            f"({SUPERBLOCK_SIZE})"
        )
    fields = SUPERBLOCK.unpack_from(header)
    (
        magic,
        inodes,
        _mtime,
        block_size,
        _frags,
        compression,
        block_log,
        _flags,
        _ids,
        major,
        minor,
        _root,
        bytes_used,
        *tables,
    ) = fields
    if magic != SQUASHFS_MAGIC:
        if header[:4] == b"sqsh":
            raise ImageVerificationError(f"{name} is a big-endian (pre-4.0) squashfs image; enroot needs 4.0")
        raise ImageVerificationError(f"{name} is not a squashfs image (first bytes {header[:4]!r}, expected b'hsqs')")
    if (major, minor) != (4, 0):
        raise ImageVerificationError(f"{name}: squashfs version {major}.{minor}, expected 4.0")
    if not (4096 <= block_size <= 1 << 20) or block_size & (block_size - 1) or 1 << block_log != block_size:
        raise ImageVerificationError(
            f"{name}: implausible squashfs block size {block_size} (log {block_log}); the superblock is damaged"
        )
    if compression not in COMPRESSORS:
        raise ImageVerificationError(f"{name}: unknown squashfs compression id {compression}")
    if inodes == 0:
        raise ImageVerificationError(f"{name}: squashfs image with no inodes")
    if bytes_used < SUPERBLOCK_SIZE or any(t != NO_TABLE and t > bytes_used for t in tables):
        raise ImageVerificationError(f"{name}: squashfs tables point past bytes_used; the superblock is damaged")
    if file_size < bytes_used:
        raise ImageVerificationError(
            f"{name} is truncated: {file_size} bytes, but its squashfs superblock says {bytes_used}"
        )
    if file_size - bytes_used > MAX_TRAILING_BYTES:
        raise ImageVerificationError(
            f"{name}: {file_size - bytes_used} bytes after the end of the squashfs file system "
            f"({bytes_used} bytes); not a plain squashfs image"
        )
    return Superblock(
        inodes=inodes,
        block_size=block_size,
        compression=COMPRESSORS[compression],
        version=f"{major}.{minor}",
        bytes_used=bytes_used,
        table_start=min((t for t in tables if t != NO_TABLE), default=bytes_used),
    )


def read_superblock(uri: str) -> Superblock:
    """Check the superblock of an image at ``uri`` (reads 96 bytes and the size)."""
    with storage.open_read(uri) as fh:
        header = fh.read(SUPERBLOCK_SIZE)
    return check_superblock(header, storage.size(uri), uri)


# ---------------------------------------------------------------- the file system behind the superblock


def check_filesystem(uri: str, superblock: Superblock, name: str) -> None:
    """Refuse an image whose superblock is sound but whose file system is not (``unsquashfs -l``).

    squashfs-tools' own reader walks the inode, directory, fragment and id tables, which a wrong
    or damaged body (random bytes behind a copied superblock) does not survive. The tables sit
    after the data blocks, from ``table_start`` to ``bytes_used``; for an image that is not a
    local file (a ``gs://`` object) only that region is fetched, into a sparse local file.
    """
    unsquashfs = shutil.which("unsquashfs")
    if unsquashfs is None:
        raise ImageVerificationError(
            f"cannot check the file system of {name}: unsquashfs not found (install squashfs-tools, "
            "which enroot needs too)"
        )
    with contextlib.ExitStack() as stack:
        if storage.is_local(uri):
            path = storage.local_path(uri)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="nemoflow-sqsh-"))
            path = os.path.join(tmp, "tables.sqsh")
            with storage.open_read(uri) as src, open(path, "wb") as out:
                out.write(src.read(SUPERBLOCK_SIZE))
                src.seek(superblock.table_start)
                out.seek(superblock.table_start)
                out.write(src.read(superblock.bytes_used - superblock.table_start))
                out.truncate(superblock.bytes_used)
        try:
            result = subprocess.run(
                [unsquashfs, "-l", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1800
            )
        except subprocess.TimeoutExpired:
            raise ImageVerificationError(f"{name}: unsquashfs -l did not finish in 30 minutes") from None
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        raise ImageVerificationError(
            f"{name}: the squashfs file system is damaged although its superblock is sound "
            f"(unsquashfs -l: {lines[-1] if lines else f'exit code {result.returncode}'})"
        )


# ---------------------------------------------------------------- sources


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


def _local_sha256(path: str) -> str:
    """sha256 of a local file, remembered by (path, inode, size, mtime): the cache key and the copy both need it."""
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _local_sha256_memo:
        _local_sha256_memo[key] = "sha256:" + transfer.hash_file(path)["sha256"]
    return _local_sha256_memo[key]


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


# ---------------------------------------------------------------- staged images and the sidecar cache


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
    if _local_sha256(info.uri) != meta["checksum"]:
        return None
    hit = cached_image(final, info.uri, meta.get("source_checksum"), log)
    if hit is not None:
        hit.source_checksum = info.identity
        _write_sidecar(hit, verified_at=meta.get("verified_at"))
    return hit


def _write_sidecar(image: StagedImage, verified_at: str | None = None) -> None:
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


def _prepare_destination(dest_dir: str, needed: int | None) -> None:
    try:
        storage.ensure_writable(dest_dir)
    except (storage.StorageError, OSError) as exc:
        raise ImageDestinationError(f"destination {dest_dir} is not writable: {exc}") from exc
    check_free_space(dest_dir, needed)


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
    _write_sidecar(image)
    if progress is not None:
        progress(info.size, info.size)
    log(
        f"verified {final}: {info.checksum} stated by GCS for the copy, squashfs {superblock.version} "
        f"{superblock.compression}, {superblock.inodes} inodes"
    )
    return image


def _remove_stale_temporaries(dest_dir: str, name: str, log: LogSink) -> None:
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
    _prepare_destination(dest_dir, info.size)
    _remove_stale_temporaries(dest_dir, storage.basename(final), log)
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
    _write_sidecar(image)
    if progress is not None:
        progress(copied, info.size)
    rate = copied / image.seconds / (1 << 20) if image.seconds > 0 else 0.0
    log(
        f"verified {final}: {actual}, squashfs {superblock.version} {superblock.compression}, "
        f"{superblock.inodes} inodes; {human_bytes(copied)} in {image.seconds:.1f} s ({rate:.0f} MiB/s)"
    )
    return image


# ---------------------------------------------------------------- registry credentials


USER_ENV = "NEMOFLOW_REGISTRY_USER"
PASSWORD_ENV = "NEMOFLOW_REGISTRY_PASSWORD"


def registry_login(ref: DockerRef) -> tuple[str, SecretStr] | None:
    """(user, password) for ``ref``'s registry from the settings; None for an anonymous pull.

    Raises :class:`RegistryCredentialsError` before anything is submitted when
    the registry needs a login that is not configured.
    """
    settings = get_settings()
    default_user = LOGIN_REQUIRED.get(ref.registry)
    user = settings.registry_user.get_secret_value() if settings.registry_user else default_user
    password = settings.registry_password
    if password is None:
        if ref.registry in LOGIN_REQUIRED:
            raise RegistryCredentialsError(
                f"{ref.registry} needs credentials to pull {ref.canonical}: set {PASSWORD_ENV} (for nvcr.io, "
                f"your NGC API key; the user defaults to {default_user})"
            )
        if settings.registry_user is not None:
            raise RegistryCredentialsError(f"{USER_ENV} is set but {PASSWORD_ENV} is not")
        return None
    if not user:
        raise RegistryCredentialsError(f"{PASSWORD_ENV} is set but {USER_ENV} is not (registry {ref.registry})")
    for label, value in (("user", user), ("password", password.get_secret_value())):
        if not value or any(c.isspace() for c in value) or '"' in value:
            # netrc separates tokens by white space; such a value cannot be written safely.
            raise RegistryCredentialsError(
                f"registry {label} for {ref.registry} is empty or contains white space or quotes"
            )
    return user, password


def netrc_hosts(registry: str) -> list[str]:
    return NETRC_HOSTS.get(registry, [registry.split(":", 1)[0]])


# ---------------------------------------------------------------- conversion job (enroot import)


def render_import_script(
    ref: DockerRef, output_tmp: str, *, login_user_default: str | None, with_credentials: bool
) -> str:
    """The bash script a conversion job runs; it holds no secret values, only variable names."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env.get_template(TEMPLATE.name).render(
        reference=ref.canonical,
        enroot_uri=ref.enroot_uri,
        output_tmp=output_tmp,
        with_credentials=with_credentials,
        netrc_hosts=netrc_hosts(ref.registry),
        login_user_default=login_user_default or "",
        user_env=USER_ENV,
        password_env=PASSWORD_ENV,
        enroot_missing=ENROOT_MISSING,
    )


def default_import_resources() -> Resources:
    # enroot import decompresses layers and runs mksquashfs on every CPU it gets:
    # one CPU makes a 20 GB NeMo image take the better part of an hour.
    return Resources(cpus_per_task=IMPORT_CPUS, time=IMPORT_TIME)


def _job_name(ref: DockerRef) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{ref.repository.rsplit('/', 1)[-1]}-{ref.tag or ref.digest[7:19]}".lower())
    return ("enroot-import-" + slug.strip("-"))[:63].rstrip("-")


@dataclasses.dataclass
class ConversionPlan:
    ref: DockerRef
    spec: JobSpec
    script: str
    script_uri: str
    output_tmp: str
    final: str
    identity: str


def plan_conversion(
    reference: str,
    dest_dir: str,
    *,
    resources: Resources | None = None,
) -> ConversionPlan:
    """Validate the reference and credentials and build the job; nothing is submitted or written."""
    ref = parse_docker_ref(reference)
    if not storage.is_local(dest_dir):
        raise ImageError(
            f"--dest {dest_dir}: enroot writes the image on the node, so the destination must be a shared file "
            "system path the nodes see (e.g. /lustre/... or a gcsfuse mount like /gcs/bucket/...), not a URL"
        )
    dest_dir = storage.local_path(dest_dir)
    login = registry_login(ref)
    final = os.path.join(dest_dir, ref.sqsh_name)
    token = uuid.uuid4().hex[:12]
    output_tmp = os.path.join(dest_dir, f"{storage.TMP_MARK}{token}-{ref.sqsh_name}")
    script = render_import_script(
        ref,
        output_tmp,
        login_user_default=LOGIN_REQUIRED.get(ref.registry),
        with_credentials=login is not None,
    )
    jobs_dir = os.path.join(dest_dir, ".nemoflow-jobs")
    script_uri = os.path.join(jobs_dir, f"{_job_name(ref)}-{token}.sh")
    spec = JobSpec(
        name=_job_name(ref),
        command=["bash", script_uri],
        secret_env=[USER_ENV, PASSWORD_ENV] if login is not None else [],
        resources=resources or default_import_resources(),
        log_dir=jobs_dir,
        workdir=dest_dir,
    )
    # A tag can move to another image; only a digest names content, so a tag-only
    # reference is cached by name (re-import with force=True after a re-push).
    identity = ref.digest or f"tag:{ref.canonical}"
    return ConversionPlan(ref, spec, script, script_uri, output_tmp, final, identity)


def convert_image(
    reference: str,
    dest_dir: str,
    *,
    backend: Backend,
    force: bool = False,
    log: LogSink | None = None,
    resources: Resources | None = None,
) -> StagedImage:
    """Import a registry image into ``dest_dir`` with ``enroot import`` in a job of ``backend``; verify, cache."""
    from infra.settings import redact

    log = log or (lambda line: None)
    plan = plan_conversion(reference, dest_dir, resources=resources)
    if not force and (hit := cached_image(plan.final, plan.ref.canonical, plan.identity, log)):
        log(f"{plan.final} already imported from {plan.ref.canonical}; nothing to do")
        return hit
    _prepare_destination(os.path.dirname(plan.final), None)
    # A job killed outright (SIGKILL after its time limit) skips its cleanup trap.
    _remove_stale_temporaries(os.path.dirname(plan.final), plan.ref.sqsh_name, log)
    storage.write_text(plan.script_uri, plan.script)
    # Backends inject JobSpec.secret_env by name from the settings; redact
    # again here so no backend's log path can leak the password.
    hidden = get_settings().secret_values()
    started = time.monotonic()
    log(f"importing {plan.ref.canonical} with enroot in a {backend.name} job")
    try:
        result: JobResult = backend.run(plan.spec, on_log=lambda line: log(redact(line, hidden)))
        if result.state is not JobState.COMPLETED:
            tail = "\n".join(redact(line, hidden) for line in result.log_tail[-20:])
            if ENROOT_MISSING in tail or "enroot: command not found" in tail:
                raise EnrootNotFound(
                    f"cannot import {plan.ref.canonical}: {ENROOT_MISSING} ({result.backend} job {result.job_id})"
                )
            raise ImageError(
                f"enroot import of {plan.ref.canonical} failed: {result.backend} job {result.job_id} ended "
                f"{result.state.value} (exit code {result.exit_code}; {result.reason or 'no reason given'})"
                + (f"\nlast log lines:\n{tail}" if tail else "")
            )
        if not os.path.exists(plan.output_tmp):
            raise ImageError(
                f"{result.backend} job {result.job_id} reported success but wrote no image at {plan.output_tmp}"
            )
        superblock = read_superblock(plan.output_tmp)
        check_filesystem(plan.output_tmp, superblock, plan.output_tmp)
        size = os.path.getsize(plan.output_tmp)
        checksum = _local_sha256(plan.output_tmp)
        os.replace(plan.output_tmp, plan.final)
    finally:
        with contextlib.suppress(OSError):
            os.remove(plan.output_tmp)
    image = StagedImage(
        uri=plan.final,
        size=size,
        checksum=checksum,
        source=plan.ref.canonical,
        source_checksum=plan.identity,
        digest=plan.ref.digest,
        bytes_copied=size,
        seconds=time.monotonic() - started,
        superblock=superblock,
    )
    _write_sidecar(image)
    log(f"verified {plan.final}: {checksum}, {human_bytes(size)}")
    return image


# ---------------------------------------------------------------- the local "image": the Python environment

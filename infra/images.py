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

A copy is verified twice: against the checksum the source states (GCS object
md5/crc32c; HTTP ``x-goog-hash``, ``Content-MD5`` or an md5 ETag, plus
Content-Length), and by the squashfs superblock (magic, version 4.0, block
size, inode count, ``bytes_used`` against the file size), which catches a
truncated or wrong file even when the source states no checksum. It is written
under a temporary name and renamed only once verified. Beside each image a
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

import base64
import binascii
import contextlib
import dataclasses
import errno
import hashlib
import os
import queue
import re
import shlex
import shutil
import struct
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from infra import storage
from infra.jobs import Backend, JobResult, JobSpec, JobState, Resources
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


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown size"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- sources and references


def public_uri(uri: str) -> str:
    """``uri`` without a query string or user info: what may be logged and recorded.

    Signed URLs (``X-Goog-Signature``, ``X-Amz-Signature``, SAS tokens) carry a
    credential in the query; it must not reach logs, sidecars or artifacts.

    >>> public_uri("https://storage.googleapis.com/b/nemo.sqsh?X-Goog-Signature=abc")
    'https://storage.googleapis.com/b/nemo.sqsh?<query hidden>'
    """
    if storage.scheme(uri) not in ("http", "https"):
        return uri
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "<query hidden>" if parts.query else "", ""))


def _scrub(text: str, uri: str) -> str:
    """Remove ``uri``'s query and user info from an error text (requests and aiohttp quote URLs)."""
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    for secret in (parts.query, parts.netloc.rpartition("@")[0]):
        if secret:
            text = text.replace(secret, "<hidden>")
    return text


def resolve_region(source: str, region: str | None = None) -> str:
    """Replace ``<region>`` with the configured region (us, europe, asia).

    >>> resolve_region("gs://vmds-containers-<region>/nemo.sqsh", "europe")
    'gs://vmds-containers-europe/nemo.sqsh'
    """
    return source.replace("<region>", region or get_settings().region)


_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_REGISTRY_RE = re.compile(rf"^{_HOST_PART}(?:\.{_HOST_PART})*(?::[0-9]{{1,5}})?$")
_REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


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
    )


def read_superblock(uri: str) -> Superblock:
    """Check the superblock of an image at ``uri`` (reads 96 bytes and the size)."""
    with storage.open_read(uri) as fh:
        header = fh.read(SUPERBLOCK_SIZE)
    return check_superblock(header, storage.size(uri), uri)


# ---------------------------------------------------------------- checksums


class _Crc32c:
    def __init__(self) -> None:
        import google_crc32c

        self._impl = google_crc32c.Checksum()

    def update(self, data: bytes) -> None:
        self._impl.update(data)

    def hexdigest(self) -> str:
        return self._impl.digest().hex()


def new_hasher(algorithm: str):
    if algorithm == "crc32c":
        return _Crc32c()
    return hashlib.new(algorithm)


def _b64_to_hex(value: str) -> str | None:
    try:
        return base64.b64decode(value, validate=True).hex()
    except (binascii.Error, ValueError):
        return None


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

    @property
    def shown(self) -> str:
        return public_uri(self.uri)


_local_sha256_memo: dict[tuple, str] = {}


def _local_sha256(path: str) -> str:
    """sha256 of a local file, remembered by (path, inode, size, mtime): the cache key and the copy both need it."""
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _local_sha256_memo:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(CHUNK):
                digest.update(block)
        _local_sha256_memo[key] = "sha256:" + digest.hexdigest()
    return _local_sha256_memo[key]


def _stat_identity(path: str) -> str:
    """Inode, size, mtime and ctime: any rewrite or replacement of the file changes one of them."""
    st = os.stat(path)
    return f"stat:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _http_checksum(headers) -> str | None:
    goog = headers.get("x-goog-hash")
    if goog:
        hashes = dict(part.strip().split("=", 1) for part in goog.split(",") if "=" in part)
        for algorithm in ("md5", "crc32c"):
            if algorithm in hashes and (value := _b64_to_hex(hashes[algorithm])):
                return f"{algorithm}:{value}"
    if (md5 := headers.get("Content-MD5")) and (value := _b64_to_hex(md5)):
        return f"md5:{value}"
    etag = (headers.get("ETag") or "").strip('"')
    # S3/GCS single-part uploads use the md5 as ETag; weak or multipart ETags are not content hashes.
    if re.fullmatch(r"[0-9a-f]{32}", etag) and not headers.get("ETag", "").startswith("W/"):
        return f"md5:{etag}"
    return None


def probe_source(source: str) -> SourceInfo:
    """Size and stated checksum of a ``.sqsh`` source; :class:`ImageSourceError` when it cannot be read."""
    kind = storage.scheme(source)
    if kind in ("http", "https"):
        import requests

        shown = public_uri(source)
        try:
            response = requests.head(source, allow_redirects=True, timeout=30)
        except requests.RequestException as exc:
            raise ImageSourceError(f"cannot reach image source {shown}: {_scrub(str(exc), source)}") from None
        if response.status_code == 404:
            raise ImageNotFound(f"image source not found: {shown} (HTTP 404)")
        if response.status_code >= 400:
            transient = response.status_code in (408, 429) or response.status_code >= 500
            error = ImageSourceError if transient else ImageNotFound
            raise error(f"image source {shown} answered HTTP {response.status_code} {response.reason}")
        headers = response.headers
        length = headers.get("Content-Length")
        encoded = "gzip" in headers.get("Content-Encoding", "")  # the length would be the compressed one
        size = int(length) if length and length.isdigit() and not encoded else None
        checksum = _http_checksum(headers)
        validator = checksum or (f"etag:{headers['ETag']}" if headers.get("ETag") else None)
        if validator is None and headers.get("Last-Modified"):
            validator = f"last-modified:{headers['Last-Modified']}"
        etag = headers.get("ETag")
        if_range = etag if etag and not etag.startswith("W/") else headers.get("Last-Modified")
        return SourceInfo(source, size, checksum, f"{validator or 'unvalidated'}:{size}", if_range)
    if kind in ("gs", "gcs"):
        try:
            fs, path = storage.url_to_fs(source)
            fs.invalidate_cache(path)  # a listing cached earlier in this process may predate a re-upload
            meta = storage.info(source)
        except FileNotFoundError as exc:
            raise ImageNotFound(f"image source not found: no such object {source}") from exc
        if meta.get("type") == "directory":
            raise ImageNotFound(f"image source {source} is a directory, not a .sqsh file")
        size = int(meta["size"])
        checksum = None
        # md5 first: hashlib's md5 is faster than crc32c in pure Python and composite objects
        # (parallel uploads) have only crc32c, so that is the fallback.
        for key, algorithm in (("md5Hash", "md5"), ("crc32c", "crc32c")):
            if meta.get(key) and (value := _b64_to_hex(meta[key])):
                checksum = f"{algorithm}:{value}"
                break
        return SourceInfo(source, size, checksum, f"{checksum or 'generation:' + str(meta.get('generation'))}:{size}")
    if kind == "file":
        path = storage.local_path(source)
        if not os.path.exists(path):
            raise ImageNotFound(f"image source not found: no such file {path}")
        if os.path.isdir(path):
            raise ImageNotFound(f"image source {path} is a directory, not a .sqsh file")
        return SourceInfo(path, os.path.getsize(path), None, _stat_identity(path))
    raise ImageError(
        f"image source {source!r}: unsupported scheme {kind}:// (use gs://, https://, file://, a path, or docker://)"
    )


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
    if needed is None or not storage.is_local(dest_dir):
        return
    path = storage.local_path(dest_dir)
    free = shutil.disk_usage(path).free
    if free < needed:
        raise ImageDestinationError(f"needs {human_bytes(needed)}, {human_bytes(free)} free on {path}")


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


class _ResumableReader:
    """The source, read front to back; a dropped connection is resumed where it stopped.

    Re-reading gigabytes because the connection broke at 90 % is what makes
    manual staging painful. The bytes already hashed and written stay; the
    source is reopened at the next byte (HTTP ``Range`` with ``If-Range``, so a
    file replaced in the meantime is refused rather than spliced; a seek for
    GCS and files), up to RESUME_ATTEMPTS times per copy. The final checksum
    comparison covers the whole stream either way.
    """

    def __init__(self, info: SourceInfo, log: LogSink):
        self.info, self.log = info, log
        self.fs, self.path = storage.url_to_fs(info.uri)
        self.http = storage.scheme(info.uri) in ("http", "https")
        self.offset = 0
        self.resumes = 0
        self.fh = self._open(0)

    def _open(self, offset: int):
        uri = self.info.shown
        try:
            if self.http:
                headers = {}
                if offset:
                    headers["Range"] = f"bytes={offset}-"
                    if self.info.validator:
                        headers["If-Range"] = self.info.validator
                # block_size=0: one streamed GET, not a range request per block; a size
                # (any, when unknown) spares fsspec a HEAD request per open.
                fh = self.fs.open(self.path, "rb", block_size=0, size=self.info.size or -1, headers=headers)
                status = getattr(getattr(fh, "r", None), "status", None)
                if offset and status != 206:
                    fh.close()
                    raise ImageSourceError(
                        f"cannot resume {uri} at byte {offset}: the server answered {status} instead of 206 "
                        "(no range support, or the file changed)"
                    )
                return fh
            fh = self.fs.open(self.path, "rb")
            if offset:
                fh.seek(offset)
            return fh
        except FileNotFoundError as exc:
            raise ImageNotFound(f"image source not found: {uri}") from exc
        except ImageError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported with its type, scrubbed of credentials
            detail = _scrub(str(exc), self.info.uri)
            raise ImageSourceError(f"cannot open {uri} at byte {offset}: {type(exc).__name__}: {detail}") from None

    def read(self, n: int) -> bytes:
        while True:
            try:
                block = _read_source(self.fh, n, self.info.uri, self.offset, self.info.size)
                if not block and self.info.size is not None and self.offset < self.info.size:
                    raise ImageSourceError(
                        f"{self.info.shown} ended after {self.offset} of {self.info.size} bytes "
                        "(connection closed early)"
                    )
            except ImageNotFound:
                raise
            except ImageSourceError as exc:
                if self.resumes >= RESUME_ATTEMPTS:
                    raise
                self.resumes += 1
                self.log(f"{exc}; resuming at byte {self.offset} (attempt {self.resumes} of {RESUME_ATTEMPTS})")
                with contextlib.suppress(Exception):
                    self.fh.close()
                time.sleep(RESUME_BACKOFF_S * 2 ** (self.resumes - 1))
                try:
                    self.fh = self._open(self.offset)
                except ImageNotFound:
                    raise
                except ImageSourceError as reopen:
                    self.log(str(reopen))
                    if "instead of 206" in str(reopen):
                        raise
                    self.fh = _Broken(reopen)
                continue
            self.offset += len(block)
            return block

    def __enter__(self) -> _ResumableReader:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.fh.close()


class _Broken:
    """A source handle whose reopening failed: its read raises, which counts as the next failed attempt."""

    def __init__(self, error: Exception):
        self.error = error

    def read(self, n: int) -> bytes:
        raise self.error

    def close(self) -> None:
        pass


class _HashWriter:
    """Hash and write blocks on a second thread while the next block is read.

    hashlib and file writes release the GIL, so network, checksum and disk
    overlap instead of taking turns: on a multi-core node a copy runs at the
    speed of the slowest of the three, not of their sum.
    """

    def __init__(self, hasher, out, depth: int = 4):
        self._hasher, self._out = hasher, out
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="image-copy-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (block := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._hasher.update(block)
                    self._out.write(block)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the reading thread
                    self._error = exc

    def put(self, block: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(block)

    def close(self, raise_error: bool = True) -> None:
        self._queue.put(None)
        self._thread.join()
        if raise_error and self._error is not None:
            raise self._error


def _is_gcs(uri: str) -> bool:
    return storage.scheme(uri) in ("gs", "gcs")


def _copy_within_gcs(info: SourceInfo, tmp: str, final: str, log: LogSink, progress) -> StagedImage:
    """Bucket to bucket: GCS copies server-side (no byte passes through here) and states the new md5/crc32c."""
    fs, tmp_path = storage.url_to_fs(tmp)
    _, src_path = storage.url_to_fs(info.uri)
    algorithm = info.checksum.split(":", 1)[0]
    key = {"md5": "md5Hash", "crc32c": "crc32c"}[algorithm]
    started = time.monotonic()
    log(f"copying {info.shown} ({human_bytes(info.size)}) to {final} inside GCS")
    try:
        fs.cp_file(src_path, tmp_path)
        fs.invalidate_cache(tmp_path)
        meta = fs.info(tmp_path)
        stated = _b64_to_hex(meta.get(key) or "")
        actual = f"{algorithm}:{stated}" if stated else None
        if int(meta["size"]) != info.size or actual != info.checksum:
            raise ImageCorrupted(
                f"GCS copy of {info.uri} does not match: the source states {info.checksum} ({info.size} bytes), "
                f"the copy {actual} ({meta['size']} bytes) (copy discarded)"
            )
        with fs.open(tmp_path, "rb") as fh:
            header = fh.read(SUPERBLOCK_SIZE)
        superblock = check_superblock(header, int(meta["size"]), info.uri)
        storage.commit(tmp, final)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp_path)
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


def _read_source(fh, chunk: int, source: str, copied: int, size: int | None) -> bytes:
    """One block of the source; a dropped connection becomes an error that names the source."""
    try:
        return fh.read(chunk)
    except ConnectionError as exc:
        detail = _scrub(str(exc), source)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - aiohttp's payload errors are not OSErrors
        detail = f"{type(exc).__name__}: {_scrub(str(exc), source)}"
    raise ImageSourceError(f"reading {public_uri(source)} failed after {copied} of {human_bytes(size)} bytes: {detail}")


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

    Nothing appears under the final name unless the bytes match the source's
    checksum (and size) and the superblock is sound. ``progress(copied, total)``
    is called about every 256 MiB and at the end (total is None when unknown).
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
    algorithm = info.checksum.split(":", 1)[0] if info.checksum else "sha256"
    hasher = new_hasher(algorithm)
    tmp = storage.join(dest_dir, f"{storage.TMP_MARK}{uuid.uuid4().hex[:12]}-{storage.basename(final)}")
    if _is_gcs(source) and _is_gcs(dest_dir) and info.checksum:
        return _copy_within_gcs(info, tmp, final, log, progress)
    fs_dst, tmp_path = storage.url_to_fs(tmp)
    header = b""
    copied = 0
    started = time.monotonic()
    log(f"copying {shown} ({human_bytes(info.size)}) to {final}")
    try:
        reader = _ResumableReader(info, log)
        with reader, fs_dst.open(tmp_path, "wb") as out:
            next_log, next_progress = 1 << 30, PROGRESS_EVERY
            pipeline = _HashWriter(hasher, out)
            try:
                while block := reader.read(chunk):
                    if len(header) < SUPERBLOCK_SIZE:
                        header += block[: SUPERBLOCK_SIZE - len(header)]
                        if len(header) == SUPERBLOCK_SIZE:
                            # Refuse a wrong file (an HTML error page, a tarball) after 96 bytes, not 20 GB.
                            bytes_used = SUPERBLOCK.unpack_from(header)[12] if header[:4] == b"hsqs" else 0
                            check_superblock(header, info.size if info.size is not None else bytes_used, shown)
                    pipeline.put(block)
                    copied += len(block)
                    if copied >= next_log:
                        log(f"  {human_bytes(copied)} of {human_bytes(info.size)}")
                        next_log += 1 << 30
                    if progress is not None and copied >= next_progress:
                        progress(copied, info.size)
                        next_progress += PROGRESS_EVERY
            except BaseException:
                pipeline.close(raise_error=False)
                raise
            pipeline.close()
            if storage.is_local(tmp):
                out.flush()
                os.fsync(out.fileno())
        actual = f"{algorithm}:{hasher.hexdigest()}"
        if info.size is not None and copied != info.size:
            raise ImageCorrupted(
                f"copy of {shown} is incomplete: {copied} of {info.size} bytes arrived (copy discarded)"
            )
        if info.checksum is not None and actual != info.checksum:
            raise ImageCorrupted(
                f"checksum mismatch for {shown}: the source states {info.checksum}, the copy has {actual} "
                "(copy discarded)"
            )
        superblock = check_superblock(header, copied, shown)
        if info.identity.startswith("stat:") and _stat_identity(source) != info.identity:
            raise ImageCorrupted(f"{source} changed while it was being copied (copy discarded)")
        storage.commit(tmp, final)
    except OSError as exc:
        with contextlib.suppress(Exception):
            fs_dst.rm(tmp_path)
        if exc.errno == errno.ENOSPC:
            raise ImageDestinationError(
                f"{dest_dir} ran out of space after {human_bytes(copied)} of {human_bytes(info.size)} (copy discarded)"
            ) from exc
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            fs_dst.rm(tmp_path)
        raise
    image = StagedImage(
        uri=final,
        size=copied,
        checksum=actual,
        source=shown,
        source_checksum=info.identity,
        bytes_copied=copied,
        seconds=time.monotonic() - started,
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

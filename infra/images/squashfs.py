"""Is a file a usable squashfs image: its superblock against its size, then ``unsquashfs -l`` over its tables."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import struct
import subprocess
import tempfile

from infra import storage
from infra.images.errors import ImageVerificationError

# mksquashfs pads images to 4 KiB; anything much longer is not a plain image.
MAX_TRAILING_BYTES = 64 << 10


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

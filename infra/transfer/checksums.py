"""Digests as sources state them (base64, hex, ETags) and as we compute them (sha256, md5, GCS's crc32c)."""

from __future__ import annotations

import base64
import binascii
import hashlib

CHUNK = 8 << 20


def b64_to_hex(value: str | None) -> str | None:
    """A base64 checksum as GCS and HTTP headers state it, as hex; None when it is not valid base64."""
    if not value:
        return None
    try:
        return base64.b64decode(value.strip(), validate=True).hex()
    except (binascii.Error, ValueError):
        return None


def hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode()


def strip_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"')


class _Crc32c:
    def __init__(self) -> None:
        import google_crc32c

        self._impl = google_crc32c.Checksum()

    def update(self, data: bytes) -> None:
        self._impl.update(data)

    def hexdigest(self) -> str:
        return self._impl.digest().hex()


def new_hasher(kind: str):
    """A hashlib-like object for ``sha256``, ``md5``, ``crc32c`` (Castagnoli, as GCS computes it)..."""
    if kind == "crc32c":
        return _Crc32c()
    if kind == "md5":
        return hashlib.md5(usedforsecurity=False)
    return hashlib.new(kind)


class MultiHash:
    """Several digests of one byte stream, fed together."""

    def __init__(self, kinds) -> None:
        self.kinds = tuple(sorted(set(kinds)))
        self._hashers = {kind: new_hasher(kind) for kind in self.kinds}

    def update(self, data) -> None:
        for hasher in self._hashers.values():
            hasher.update(data)

    def hexdigests(self) -> dict[str, str]:
        return {kind: h.hexdigest() for kind, h in self._hashers.items()}


def hash_file(path: str, kinds=("sha256",), limit: int | None = None) -> dict[str, str]:
    """Hex digests of a local file (or of its first ``limit`` bytes)."""
    hashes = MultiHash(kinds)
    left = limit
    with open(path, "rb") as fh:
        while left is None or left > 0:
            block = fh.read(CHUNK if left is None else min(CHUNK, left))
            if not block:
                break
            hashes.update(block)
            if left is not None:
                left -= len(block)
    return hashes.hexdigests()

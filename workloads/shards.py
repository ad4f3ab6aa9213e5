"""Shard handling between download and tokenization: extract ``.zst`` and concatenate ``.jsonl``.

    from workloads.shards import extract_zst, concatenate, group
    extract_zst("raw/chunk1/example_train_0.jsonl.zst", "jsonl/chunk1/example_train_0.jsonl")
    for i, batch in enumerate(group(sorted(jsonl_files), 10)):
        concatenate(batch, f"merged/train_{i:04d}.jsonl")

Pure functions over URIs (local paths or ``gs://``, through infra.storage), usable in-process
or inside a job. Both write atomically: a crash never leaves a half-written ``.jsonl`` under its
final name.

Why the truncation check: zstandard raises on a corrupt frame, but a frame cut short simply
yields fewer bytes. We decompress frame by frame and require every frame to reach its end
(``decompressobj().eof``); a file that stops inside a frame is a :class:`CorruptArchive`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from infra import storage

Log = Callable[[str], None]
T = TypeVar("T")
READ_SIZE = 1 << 20
# decompressobj returns all output for what it is fed: small feeds keep memory near
# FEED_SIZE x compression ratio (about 0.3 MB for JSON text) instead of READ_SIZE x ratio.
FEED_SIZE = 32 << 10


class CorruptArchive(Exception):
    """A compressed shard is truncated or corrupt; the message names the shard.

    ``CorruptArchive("message naming the shard")`` works too (callers re-raise with context).
    """

    def __init__(self, shard: str, reason: str | None = None):
        super().__init__(shard if reason is None else f"corrupt archive {shard}: {reason}")
        self.shard = shard if reason is not None else None
        self.reason = reason


class ExtractResult(BaseModel):
    uri: str
    bytes: int
    lines: int
    source: str


class ConcatResult(BaseModel):
    uri: str
    bytes: int
    lines: int
    inputs: list[str]


class _LineCounter:
    """Counts lines the way a JSON-lines reader sees them: a last line without '\\n' still counts."""

    def __init__(self) -> None:
        self.bytes = 0
        self.newlines = 0
        self.last = b"\n"

    def update(self, block: bytes) -> None:
        if block:
            self.bytes += len(block)
            self.newlines += block.count(b"\n")
            self.last = block[-1:]

    @property
    def lines(self) -> int:
        return self.newlines + (0 if self.last == b"\n" else 1)


def _decompress_frames(src, shard: str):
    """Decompressed pieces of every zstd frame in ``src``; raises if the input stops inside a frame."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    dobj = dctx.decompressobj()
    in_frame = False  # bytes of the current frame were fed but its end was not reached
    produced = 0
    seen_any = False
    while chunk := src.read(READ_SIZE):
        seen_any = True
        for start in range(0, len(chunk), FEED_SIZE):
            block = chunk[start : start + FEED_SIZE]
            while block:
                out = dobj.decompress(block)
                in_frame = True
                produced += len(out)
                if out:
                    yield out
                if not dobj.eof:
                    break
                # A frame ended; what is left of this block starts the next frame.
                in_frame = False
                block = dobj.unused_data
                dobj = dctx.decompressobj()
    if not seen_any:
        raise CorruptArchive(shard, "the file is empty")
    if in_frame:
        raise CorruptArchive(shard, f"truncated: the last zstd frame ends early (after {produced} bytes out)")


def shard_label(uri: str) -> str:
    """``.../chunk1/example_train_0.jsonl.zst`` -> ``chunk1/example_train_0.jsonl.zst`` (for log lines)."""
    folder = storage.basename(storage.parent(uri))
    return f"{folder}/{storage.basename(uri)}" if folder else storage.basename(uri)


def extract_zst(src_uri: str, dst_uri: str, *, delete_source: bool = False, log: Log | None = None) -> ExtractResult:
    """Decompress ``src_uri`` (zstd, one or more frames) to ``dst_uri`` in constant memory."""
    import zstandard

    name = shard_label(src_uri)
    counter = _LineCounter()
    try:
        with storage.open_read(src_uri) as src, storage.atomic_open(dst_uri, "wb") as dst:
            for out in _decompress_frames(src, src_uri):
                dst.write(out)
                counter.update(out)
    except zstandard.ZstdError as exc:
        raise CorruptArchive(src_uri, str(exc)) from None
    if delete_source:
        # Only now: the output is committed, so a crash above leaves the input to retry from.
        storage.remove(src_uri)
        storage.remove(src_uri + ".meta.json")  # infra.fetch's sidecar would describe a deleted file
    if log is not None:
        log(f"{name}: extracted {counter.bytes} bytes, {counter.lines} lines -> {dst_uri}")
    return ExtractResult(uri=dst_uri, bytes=counter.bytes, lines=counter.lines, source=src_uri)


def concatenate(inputs: list[str], dst_uri: str, *, log: Log | None = None) -> ConcatResult:
    """Concatenate ``inputs`` in order into ``dst_uri``, adding a newline after any input that lacks one."""
    if not inputs:
        raise ValueError(f"nothing to concatenate into {dst_uri}: the input list is empty")
    counter = _LineCounter()
    with storage.atomic_open(dst_uri, "wb") as dst:
        for uri in inputs:
            last = b"\n"
            with storage.open_read(uri) as src:
                while block := src.read(READ_SIZE):
                    dst.write(block)
                    counter.update(block)
                    last = block[-1:]
            if last != b"\n":
                # Without it the next file's first JSON object would join this file's last line.
                dst.write(b"\n")
                counter.update(b"\n")
    if log is not None:
        log(f"{storage.basename(dst_uri)}: {len(inputs)} inputs, {counter.bytes} bytes, {counter.lines} lines")
    return ConcatResult(uri=dst_uri, bytes=counter.bytes, lines=counter.lines, inputs=list(inputs))


def group(items: list[T], n: int) -> list[list[T]]:
    """``items`` in groups of ``n`` in the given order; the last group holds the remainder."""
    if n < 1:
        raise ValueError(f"group size must be at least 1, got {n}")
    items = list(items)
    return [items[i : i + n] for i in range(0, len(items), n)]

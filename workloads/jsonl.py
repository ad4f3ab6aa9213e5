"""Streaming JSON-lines reading for the tokenizer: ``.jsonl`` or ``.jsonl.zst``.

Lines come out in batches of raw bytes with their line numbers; only one
read-block of input (a few MiB) is held at a time, whatever the file size.

Line splitting follows Megatron-LM's ``preprocess_data.py``, which iterates a
text-mode file: ``\\n``, ``\\r\\n`` and a lone ``\\r`` all end a line. Line
numbers count ``\\n`` (what ``sed -n Np`` and editors show for ordinary files).
Blank lines are skipped (Megatron stops with a JSONDecodeError on them).

A truncated ``.zst`` (an incomplete last frame) raises ``InputError`` naming
the file: zstandard's stream reader would silently stop early instead.

A line longer than ``max_line_bytes`` (default ``MAX_LINE_BYTES``, 16 MiB) raises
``InputError`` naming the file, the line and the limit as soon as that much of it
has been read: one document is tokenized in one piece, and tokenizing a 50 MB line
took 3 GB of memory (see ``MAX_LINE_BYTES``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

import orjson

READ_BLOCK = 4 << 20
# The longest line (one JSON document) read by default. Megatron's tokenizers take a document
# whole, so memory grows with the longest line. Measured peak RSS of `nemoflow preprocess` (Mixtral
# sentencepiece model, 2 cores): 50 MB of ordinary lines 0.30 GB; one 16 MB line 0.27 GB through
# gigatoken, 0.81 GB through sentencepiece itself (--no-fast, or a text holding a control piece
# such as "<s>"); one 50 MB line 0.40 GB through gigatoken (3.1 GB before the fast-path check
# skipped documents over 1 MiB), ~2.4 GB through sentencepiece. 16 MiB keeps real documents
# (books, long code files) and the worst case under 1 GB.
MAX_LINE_BYTES = 16 << 20


class InputError(ValueError):
    """Bad input; the message names the file (and line where it applies)."""


@dataclass
class LineBatch:
    lines: list[bytes] = field(default_factory=list)
    line_numbers: list[int] = field(default_factory=list)
    raw_bytes: int = 0  # uncompressed bytes of input these lines came from (newlines included)
    read_bytes: int = 0  # bytes read from the file so far (compressed bytes for .zst)


def _zst_blocks(fh: IO[bytes], name: str) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    obj = dctx.decompressobj()
    frame_has_data = False
    while True:
        chunk = fh.read(READ_BLOCK)
        if not chunk:
            break
        while chunk:
            try:
                out = obj.decompress(chunk)
            except zstandard.ZstdError as exc:
                raise InputError(f"{name}: corrupt zstd data: {exc}") from exc
            frame_has_data = True
            if out:
                yield out
            if obj.eof:
                # Several frames back to back (e.g. concatenated .zst files) are one stream.
                chunk = obj.unused_data
                obj = dctx.decompressobj()
                frame_has_data = False
            else:
                chunk = b""
    if frame_has_data and not obj.eof:
        raise InputError(f"{name}: truncated zstd file (the last frame is incomplete)")


def _raw_blocks(fh: IO[bytes]) -> Iterator[bytes]:
    while True:
        chunk = fh.read(READ_BLOCK)
        if not chunk:
            return
        yield chunk


def open_input(path: str) -> IO[bytes]:
    """Open a local path or any fsspec URI (gs://...) for binary reading."""
    from infra import storage

    if storage.is_local(path):
        try:
            return open(storage.local_path(path), "rb")
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"input file not found: {path}") from exc
        except IsADirectoryError as exc:
            raise InputError(f"input {path} is a directory, not a .jsonl file") from exc
    return storage.open_read(path, "rb")


def line_too_long(path: str, line_no: int, limit: int) -> InputError:
    return InputError(
        f"{path}:{line_no}: the line is longer than the limit of {limit:,} bytes (one document is tokenized "
        "whole, and memory grows with it); split the document, or raise the limit with --max-line-bytes "
        "(max_line_bytes; 0 = no limit)"
    )


def iter_line_batches(
    path: str, batch_bytes: int = READ_BLOCK, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[LineBatch]:
    """Yield the non-blank lines of ``path`` in batches of about ``batch_bytes``.

    A line over ``max_line_bytes`` (0: no limit) raises ``InputError`` as soon as that much
    of it was read, so the limit also bounds what reading holds.
    """
    compressed = path.endswith(".zst")
    limit = max_line_bytes if max_line_bytes and max_line_bytes > 0 else None
    with open_input(path) as fh:
        blocks = _zst_blocks(fh, path) if compressed else _raw_blocks(fh)
        pending = b""
        line_no = 0
        batch = LineBatch()
        for block in blocks:
            data = pending + block if pending else block
            parts = data.split(b"\n")
            pending = parts.pop()
            for line in parts:
                line_no += 1
                if limit is not None and len(line) > limit:
                    raise line_too_long(path, line_no, limit)
                batch.raw_bytes += len(line) + 1
                _add_line(batch, line, line_no)
            if limit is not None and len(pending) > limit:
                raise line_too_long(path, line_no + 1, limit)
            if batch.raw_bytes >= batch_bytes:
                batch.read_bytes = fh.tell() if not compressed else _tell(fh)
                yield batch
                batch = LineBatch()
        if pending:
            line_no += 1
            batch.raw_bytes += len(pending)
            _add_line(batch, pending, line_no)
        batch.read_bytes = _tell(fh)
        if batch.lines or batch.raw_bytes:
            yield batch


def _tell(fh: IO[bytes]) -> int:
    try:
        return fh.tell()
    except (OSError, ValueError):
        return 0


def _add_line(batch: LineBatch, line: bytes, line_no: int) -> None:
    if b"\r" in line:
        # Text-mode iteration (what Megatron does) also ends lines at a lone \r.
        pieces = line[:-1].split(b"\r") if line.endswith(b"\r") else line.split(b"\r")
        for piece in pieces:
            if piece.strip():
                batch.lines.append(piece)
                batch.line_numbers.append(line_no)
        return
    if line.strip():
        batch.lines.append(line)
        batch.line_numbers.append(line_no)


def parse_line(line: bytes, path: str, line_no: int) -> dict:
    """Parse one JSON line as Python's ``json.loads`` would (what Megatron uses).

    orjson is the fast path; where it refuses something ``json.loads`` accepts
    (NaN, huge integers, lone surrogate escapes) the standard library decides.
    """
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(
                f"{path}:{line_no}: not valid UTF-8 (byte {exc.start} of the line: {line[exc.start : exc.start + 4]!r})"
            ) from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{line_no}: malformed JSON: {exc.msg} (column {exc.colno})") from None
        try:
            # json.loads accepts "\ud800" escapes that no tokenizer can encode (Megatron crashes there).
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"{path}:{line_no}: a string holds a lone surrogate escape (\\ud800-\\udfff)") from None
    if not isinstance(obj, dict):
        raise InputError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
    return obj

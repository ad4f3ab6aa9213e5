"""Read a W&B transaction log (``run-<id>.wandb``, what ``WANDB_MODE=offline`` writes and ``wandb sync`` uploads).

wandb 0.31 no longer ships a Python reader (its Go core writes the file), so tests read it here.
Layout (LevelDB's log format, as W&B uses it): a 7-byte header ``":W&B"``, magic ``0xBEE1`` (u16 LE),
version ``0`` (u8); then 32 KiB blocks of chunks, each ``crc32 (u32 LE), length (u16 LE), type (u8)``
followed by ``length`` bytes; type 1 = a whole record, 2/3/4 = its first/middle/last piece; fewer
than 7 bytes left in a block are zero padding. A record is a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path} is not a W&B transaction log (header {ident!r} {magic:#x} {version})")
    out, pending, pos = [], b"", HEADER.size
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:
            pos += left  # block trailer padding
            continue
        _crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:
            pos += left  # zero padding to the end of the block
            continue
        body = data[pos + CHUNK.size : pos + CHUNK.size + length]
        pos += CHUNK.size + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            out.append(pending + body)
            pending = b""
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos}")
    return out


def read_run(path: str | Path) -> dict:
    """The run's config (key -> value), history rows (one dict per logged step) and summary updates (key ->
    value, the last one kept) from its transaction log."""
    import json

    from wandb.proto import wandb_internal_pb2

    config, history, summary = {}, [], {}
    for data in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "run" and record.run.config.update:
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            history.append(
                {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            )
    return {"config": config, "history": history, "summary": summary}

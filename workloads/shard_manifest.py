"""What the data stage knows about each shard, kept per shard and read in batches.

A shard that was downloaded and extracted has a :class:`ShardRecord`: the source it came
from (a digest of its URL and the remote identity it was fetched for), the sha256 of the
download, the extracted file and the fingerprint of the extraction code. The record is kept
in three places, each for one reader:

``extracted/<shard>.jsonl.shard.json``  (the sidecar)
    written by the fetch array task right after the shard is extracted. It is the ground
    truth a task checks before doing anything, so a retried, requeued or killed-and-rerun
    task never redoes a finished shard, even when nobody merged its journal.
``shards/journal/<plan>-<task>-<seq>.jsonl``  (journal segments)
    the same records, written by each array task in batches (every few hundred shards or
    seconds), plus one line per failed shard (``{"name", "error"}``). Segments are only ever
    created, never appended to, so they work on object stores too.
``shards/manifest.jsonl``  (the manifest)
    every record of the dataset, one JSON line each after a header line, sorted by name.
    The flow reads this one file to decide which shards need work (one read instead of one
    per shard: 59,166 sidecars would take minutes on GCS), and merges the journals into it
    after each fetch job (and at the start of a run, for journals a killed run left).

A record is current for a source when the URL digest, the extraction code and (where the
flow knows it) the remote identity all match: :func:`is_current`. The remote identity is
what changes when the source changes: size and modification time for local files; size,
etag, md5 and crc32c for GCS objects; size and etag of the download for HTTP(S), which the
flow does not re-check unless asked (``revalidate``), because that is one request per shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
from pydantic import BaseModel

from infra import storage

MANIFEST_FORMAT = "nemoflow-shard-manifest/1"
SIDECAR_SUFFIX = ".shard.json"
# A journal segment is written when this many lines are waiting, or this many seconds passed.
FLUSH_LINES = 500
FLUSH_SECONDS = 10.0


class ShardRecord(BaseModel):
    """One shard, downloaded and extracted."""

    name: str
    url: str  # as the download reported it (query values and passwords redacted)
    url_sha256: str  # digest of the URL as given: tells sources apart without keeping tokens
    remote: dict[str, Any]  # the remote identity it was fetched for (see the module docstring)
    raw: str  # where the download went
    size: int
    sha256: str
    etag: str | None = None
    extracted: str
    bytes: int
    lines: int
    code: str  # fingerprint of the extraction code (workloads.shards)


class ShardFailure(BaseModel):
    name: str
    error: str


def url_digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


def is_current(record: dict, url_sha256: str, remote: dict | None, code: str) -> bool:
    """``record`` (a dict of :class:`ShardRecord`) still describes this source and this code.

    ``remote`` None: the flow does not know the source's identity now (HTTP without
    revalidation): the recorded one is trusted.
    """
    return (
        record.get("url_sha256") == url_sha256
        and record.get("code") == code
        and (remote is None or record.get("remote") == remote)
    )


def sidecar_uri(extracted: str) -> str:
    return extracted + SIDECAR_SUFFIX


def read_sidecar(extracted: str) -> ShardRecord | None:
    """The record beside an extracted shard, if it is there and the file still has its size."""
    try:
        record = ShardRecord.model_validate_json(storage.read_bytes(sidecar_uri(extracted)))
        if storage.size(extracted) != record.bytes:
            return None
    except (FileNotFoundError, ValueError, OSError):
        return None
    return record


def write_sidecar(record: ShardRecord) -> None:
    storage.write_bytes(sidecar_uri(record.extracted), orjson.dumps(record.model_dump(mode="json")))


# ----------------------------------------------------------------------------- the manifest


def manifest_uri(dataset_uri: str) -> str:
    return storage.join(dataset_uri, "shards", "manifest.jsonl")


def journal_dir(dataset_uri: str) -> str:
    return storage.join(dataset_uri, "shards", "journal")


def manifest_lines(dataset_uri: str) -> Iterator[bytes]:
    """The manifest's record lines, streamed (nothing held: 59,166 records are ~25 MB of JSON)."""
    uri = manifest_uri(dataset_uri)
    try:
        fh = storage.open_read(uri)
    except FileNotFoundError:
        return
    with fh:
        header = fh.readline()
        if not header:
            return
        if orjson.loads(header).get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{uri} is not a shard manifest ({MANIFEST_FORMAT}); delete it to rebuild it")
        for line in fh:
            if line.strip():
                yield line.rstrip(b"\n")


def read_manifest(dataset_uri: str) -> dict[str, dict]:
    """name -> record as a dict (every field; for small datasets and tests, see :func:`index_manifest`)."""
    return {(record := orjson.loads(line))["name"]: record for line in manifest_lines(dataset_uri)}


def write_manifest_lines(dataset_uri: str, lines: dict[str, bytes]) -> None:
    """Write records given as their JSON lines (name -> line), sorted by name."""
    header = orjson.dumps({"format": MANIFEST_FORMAT, "shards": len(lines)})
    with storage.atomic_open(manifest_uri(dataset_uri), "wb") as fh:
        fh.write(header + b"\n")
        for name in sorted(lines):
            fh.write(lines[name] + b"\n")


def write_manifest(dataset_uri: str, records: dict[str, dict]) -> None:
    write_manifest_lines(dataset_uri, {name: orjson.dumps(record) for name, record in records.items()})


def state_key(url_sha256: str, code: str, remote: dict | None = None) -> bytes:
    """A short digest of what makes a record current (:func:`is_current`); ``remote`` None: the trusted form."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(url_sha256.encode() + b"\0" + code.encode())
    if remote is not None:
        digest.update(b"\0" + orjson.dumps(remote, option=orjson.OPT_SORT_KEYS))
    return digest.digest()


class ShardEntry(bytes):
    """What the flow keeps per shard, packed in 72 bytes (about 100 with the object; a parsed record
    is ~2 KB): the two state keys (16 + 16), the download's sha256 (32) and the extracted size (8)."""

    __slots__ = ()

    @classmethod
    def pack(cls, trusted: bytes, full: bytes, sha256: str, size: int) -> ShardEntry:
        return cls(trusted + full + bytes.fromhex(sha256) + size.to_bytes(8, "little"))

    @property
    def trusted(self) -> bytes:
        """state_key without the remote identity"""
        return bytes(self[:16])

    @property
    def full(self) -> bytes:
        """state_key with it"""
        return bytes(self[16:32])

    @property
    def sha256(self) -> str:
        return self[32:64].hex()

    @property
    def bytes(self) -> int:
        return int.from_bytes(self[64:72], "little")


def index_manifest(dataset_uri: str) -> dict[str, ShardEntry]:
    """name -> :class:`ShardEntry` for every record, parsed one line at a time."""
    index = {}
    for line in manifest_lines(dataset_uri):
        r = orjson.loads(line)
        index[r["name"]] = ShardEntry.pack(
            state_key(r["url_sha256"], r["code"]),
            state_key(r["url_sha256"], r["code"], r["remote"]),
            r["sha256"],
            r["bytes"],
        )
    return index


# ----------------------------------------------------------------------------- journals


def segment_name(plan_id: str, task: int, seq: int) -> str:
    return f"{plan_id}-{task:05d}-{seq:05d}.jsonl"


def progress_name(plan_id: str, task: int) -> str:
    return f"progress-{plan_id}-{task:05d}.json"


class Journal:
    """What one array task reports, in segments of up to ``FLUSH_LINES`` lines (thread-safe)."""

    def __init__(self, directory: str, plan_id: str, task: int, total: int):
        self.directory = directory
        self.plan_id = plan_id
        self.task = task
        self.total = total
        self.done = 0
        self.failed = 0
        self._lines: list[bytes] = []
        self._seq = len(self.segments())  # a requeued task adds segments after its earlier ones
        self._flushed_at = time.monotonic()
        self._lock = threading.Lock()

    def segments(self) -> list[str]:
        prefix = f"{self.plan_id}-{self.task:05d}-"
        return [u for u in storage.listdir(self.directory) if storage.basename(u).startswith(prefix)]

    def add(self, entry: ShardRecord | ShardFailure) -> None:
        with self._lock:
            self._lines.append(orjson.dumps(entry.model_dump(mode="json")))
            if isinstance(entry, ShardFailure):
                self.failed += 1
            else:
                self.done += 1
            due = len(self._lines) >= FLUSH_LINES or time.monotonic() - self._flushed_at >= FLUSH_SECONDS
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            seq = self._seq
            if lines:
                self._seq += 1
            self._flushed_at = time.monotonic()
            progress = {"total": self.total, "done": self.done, "failed": self.failed}
        if lines:
            storage.write_bytes(
                storage.join(self.directory, segment_name(self.plan_id, self.task, seq)), b"\n".join(lines) + b"\n"
            )
        storage.write_bytes(
            storage.join(self.directory, progress_name(self.plan_id, self.task)), orjson.dumps(progress)
        )


def read_progress(directory: str, plan_id: str) -> tuple[int, int]:
    """(done, failed) over every task of ``plan_id`` so far (a few small files: cheap to poll)."""
    done = failed = 0
    prefix = f"progress-{plan_id}-"
    for uri in storage.listdir(directory):
        if storage.basename(uri).startswith(prefix):
            with contextlib.suppress(FileNotFoundError, ValueError):
                progress = orjson.loads(storage.read_bytes(uri))
                done += progress["done"]
                failed += progress["failed"]
    return done, failed


def merge_journals(dataset_uri: str, clean: bool = False) -> tuple[int, dict[str, str]]:
    """Fold every journal segment into the manifest, then delete the segments (``clean``: and the
    tasks' progress and cooldown files too: at the start of a run, they belong to an older job).

    Returns (records merged, failures by shard name). Segments are read in name order (plan ids
    sort by time), so a shard that failed and later succeeded counts as done. The manifest is
    written before any segment is deleted: a crash in between loses nothing. Records are kept
    as their JSON lines while merging (a few hundred bytes each), never parsed into models.
    """
    directory = journal_dir(dataset_uri)
    files = storage.listdir(directory)
    segments = sorted(u for u in files if u.endswith(".jsonl"))
    merged = 0
    failures: dict[str, str] = {}
    if segments:
        lines = {orjson.loads(line)["name"]: line for line in manifest_lines(dataset_uri)}
        for uri in segments:
            for line in storage.read_bytes(uri).splitlines():
                entry = orjson.loads(line)
                if "error" in entry:
                    failures[entry["name"]] = entry["error"]
                else:
                    lines[entry["name"]] = line
                    failures.pop(entry["name"], None)
                    merged += 1
        write_manifest_lines(dataset_uri, lines)
    for uri in files if clean else segments:
        storage.remove(uri)
    return merged, failures

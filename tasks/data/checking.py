"""Check (in the flow, one pass): the sources' identities against the shard manifest; which parts are pending."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from infra import storage
from tasks.common import code_fingerprint, logger
from tasks.data.records import PartInput, PartKey
from tasks.refs import TokenizerRef
from workloads.shard_manifest import ShardEntry, index_manifest, merge_journals, state_key, url_digest
from workloads.tokenize_array import finished_part


def raw_uri(dataset_uri: str, name: str) -> str:
    return storage.join(dataset_uri, "raw", name)


def extracted_uri(dataset_uri: str, name: str) -> str:
    return storage.join(dataset_uri, "extracted", name.removesuffix(".zst"))


def url_scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _folder_listing(folder: str) -> dict[str, dict]:
    """fsspec info of every object in ``folder``, by URI (one listing call, not one per object)."""
    fs, path = storage.url_to_fs(folder)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return {}
    return {storage.to_uri(fs, entry["name"]): entry for entry in entries}


def iter_identities(urls: list[str]) -> Iterator[dict | None]:
    """What tells a changed source from a known one, per source (None: not checked, see revalidate).

    Local files: size and modification time (infra.fetch.probe, a stat). GCS: size, etag/generation,
    md5, crc32c, from one listing per folder (sources come folder by folder). HTTP(S): None; a HEAD
    per shard per run is what made re-runs cost as much as the work at 59,166 shards (and a
    rate-limited host would refuse it).
    """
    from infra.fetch import NotFound, probe

    folder, listing = None, {}
    for url in urls:
        scheme = url_scheme(url)
        if scheme == "file":
            info = probe(url)
            yield {"size": info.size, "last_modified": info.last_modified}
        elif scheme in ("gs", "gcs"):
            url = "gs://" + url.split("://", 1)[1]
            if storage.parent(url) != folder:
                folder = storage.parent(url)
                listing = _folder_listing(folder)
            meta = listing.get(url)
            if meta is None:
                raise NotFound(f"not found: {url}")
            yield {
                "size": int(meta["size"]) if meta.get("size") is not None else None,
                "etag": meta.get("etag") or (str(meta["generation"]) if meta.get("generation") else None),
                "md5": meta.get("md5Hash"),
                "crc32c": meta.get("crc32c"),
            }
        else:
            yield None


@dataclasses.dataclass
class ShardCheck:
    """The flow's view of the sources after :func:`check_shards`: plain data, a few hundred bytes a
    shard (names and URLs as strings, not Source models; records as :class:`ShardEntry`; the pending
    shards' identities as JSON bytes). Never a task input."""

    dataset_uri: str
    names: list[str]
    urls: list[str]
    index: dict[str, ShardEntry]
    pending: list[tuple[int, bytes]]  # (position in names/urls, the identity the flow saw as JSON: b"null" if none)
    code: str
    seconds: float


def _compact_json(value: Any) -> bytes:
    # Not orjson: each bytes object it returns keeps a ~4 KB buffer (234 MB for 59,166 kept results).
    return json.dumps(value, separators=(",", ":")).encode()


def check_shards(names: list[str], urls: list[str], dataset_uri: str, revalidate: bool = False) -> ShardCheck:
    """Which shards need downloading/extracting: one manifest read, one identity per source.

    ``names``/``urls``: the sources' (:func:`infra.sources.expand_sources`) as plain strings, so the
    caller can free the Source models (~700 bytes a shard) first.
    """
    started = time.monotonic()
    merged, _ = merge_journals(dataset_uri, clean=True)  # what a killed run finished but did not merge
    if merged:
        logger().info("merged %d shard record(s) a previous run left in its journal", merged)
    storage.remove(storage.join(dataset_uri, "shards", "plans"), recursive=True)
    code = code_fingerprint("workloads.shards")
    index = index_manifest(dataset_uri)
    pending: list[tuple[int, bytes]] = []
    for position, (name, url, remote) in enumerate(zip(names, urls, iter_identities(urls))):
        entry = index.get(name)
        if entry is not None:
            digest = url_digest(url)
            if remote is not None:
                current = entry.full == state_key(digest, code, remote)
            else:
                current = not revalidate and entry.trusted == state_key(digest, code)
            if current:
                continue
        pending.append((position, _compact_json(remote)))
    return ShardCheck(dataset_uri, names, urls, index, pending, code, time.monotonic() - started)


def _sizes(uris: list[str]) -> dict[str, int]:
    """Sizes of the files that exist among ``uris`` (a stat each locally, one listing per folder on GCS)."""
    sizes: dict[str, int] = {}
    listings: dict[str, dict[str, dict]] = {}
    for uri in uris:
        if storage.is_local(uri):
            with contextlib.suppress(OSError):
                sizes[uri] = os.path.getsize(storage.local_path(uri))
            continue
        folder = storage.parent(uri)
        if folder not in listings:
            listings[folder] = _folder_listing(folder)
        if (meta := listings[folder].get(uri)) is not None:
            sizes[uri] = int(meta.get("size") or 0)
    return sizes


def concat_uri(dataset_uri: str, part_name: str) -> str:
    return storage.join(dataset_uri, "concat", f"{part_name}.jsonl")


def output_base(dataset_uri: str, part_name: str) -> str:
    return storage.join(dataset_uri, "tokenized", part_name)


def part_keys(check: ShardCheck, groups: list[list[str]]) -> list[PartKey | None]:
    """Each part's content key from the shard records (None while one of its shards has none)."""
    keys: list[PartKey | None] = []
    for index, names in enumerate(groups):
        entries = [check.index.get(n) for n in names]
        if any(e is None for e in entries):
            keys.append(None)
            continue
        digest = hashlib.sha256(check.code.encode() + b"\n")
        for name, entry in zip(names, entries):
            digest.update(f"{extracted_uri(check.dataset_uri, name)}\0{entry.sha256}\n".encode())
        keys.append(
            PartKey(
                name=f"part-{index:05d}",
                shards=len(names),
                shards_sha256=digest.hexdigest(),
                bytes=sum(e.bytes for e in entries),
            )
        )
    return keys


def part_identity(
    key: PartKey, dataset_uri: str, tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool
) -> dict:
    """What a tokenized part's stats file must state for the part to count as done."""
    return {
        "input": concat_uri(dataset_uri, key.name),
        "shards": key.shards,
        "shards_sha256": key.shards_sha256,
        "tokenizer": tokenizer.fingerprint,
        "json_keys": list(json_keys),
        "append_eod": append_eod,
        "code": code_fingerprint("workloads.tokenize"),
    }


def part_done(key: PartKey, dataset_uri: str, tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool) -> bool:
    identity = part_identity(key, dataset_uri, tokenizer, json_keys, append_eod)
    base = output_base(dataset_uri, key.name)
    return all(finished_part(f"{base}_{k}_document", identity) for k in json_keys)


def settle_parts(
    check: ShardCheck, groups: list[list[str]], tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool
) -> tuple[set[int], int]:
    """(parts already tokenized from the shards as recorded, shards to extract again).

    A part whose shards are all current and which is tokenized with the same identity needs
    nothing (its extracted shards may even have been deleted to save space). Any other part needs
    every shard's extracted file, so recorded shards whose file is gone are fetched again (added to
    ``check.pending``). Costs a stat per shard of the parts left to do, nothing for finished parts.
    """
    pending = {position for position, _ in check.pending}
    done: set[int] = set()
    wanted: list[int] = []
    start = 0
    for index, (key, names) in enumerate(zip(part_keys(check, groups), groups)):
        positions = range(start, start + len(names))
        start += len(names)
        untouched = not any(p in pending for p in positions)
        if key is not None and untouched and part_done(key, check.dataset_uri, tokenizer, json_keys, append_eod):
            done.add(index)
        else:
            wanted += [p for p in positions if p not in pending]
    if not wanted:
        return done, 0
    uris = {p: extracted_uri(check.dataset_uri, check.names[p]) for p in wanted}
    sizes = _sizes(list(uris.values()))
    missing = [p for p in wanted if sizes.get(uris[p]) != check.index[check.names[p]].bytes]
    identities = iter_identities([check.urls[p] for p in missing])
    check.pending += [(p, _compact_json(remote)) for p, remote in zip(missing, identities)]
    return done, len(missing)


def part_inputs(check: ShardCheck, groups: list[list[str]], keys: list[PartKey | None]) -> list[PartInput]:
    """The parts given (by key) with their extracted shards, for the tokenize plan."""
    out = []
    by_name = {f"part-{i:05d}": names for i, names in enumerate(groups)}
    for key in keys:
        if key is None:
            raise RuntimeError(f"a shard of the dataset has no record after the fetch step (see {check.dataset_uri})")
        inputs = [extracted_uri(check.dataset_uri, n) for n in by_name[key.name]]
        out.append(PartInput(**key.model_dump(), inputs=inputs))
    return out

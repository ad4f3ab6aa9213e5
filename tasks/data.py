"""Dataset preparation stage: download -> extract -> concatenate -> tokenize -> blend.

Each step is a Prefect task fanned out over shards. The heavy lifting lives in
plain functions (``infra.sources``, ``infra.fetch``, ``workloads.shards``,
``workloads.tokenize``); these tasks add caching, retries, logging by shard
and the hand-off as small typed results.

Layout under the dataset URI (``<work_dir>/datasets/<name>`` by default)::

    raw/<chunk>/<shard>.jsonl.zst      downloaded shards (+ .meta.json sidecars)
    extracted/<chunk>/<shard>.jsonl    streamed out of the .zst
    concat/part-00000.jsonl            N shards per part, deterministic order
    tokenized/part-00000_text_document.bin/.idx (+ .stats.json)
    blend.json       NeMo data_prefix as JSON: [w1, "prefix1", w2, "prefix2", ...]
    data_prefix.txt  the same list as NeMo's auto_blend.py prints it
    manifest.json    everything above, machine-readable (DatasetManifest)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta

from prefect import task
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, Field

from infra import storage
from infra.fetch import FetchResult, RemoteInfo, download
from infra.jobs import JobSpec, Resources
from infra.sources import Source
from tasks.common import cache_policy, logger, run_job
from tasks.refs import DatasetRef, TokenizerRef
from workloads.shards import ConcatResult, CorruptArchive, ExtractResult, concatenate, extract_zst

RETRIES = 3


# ----------------------------------------------------------------------------- results


class TokenizedPart(BaseModel):
    input: str
    prefix: str = Field(..., description="'{prefix}' of '{prefix}.bin/.idx'")
    documents: int
    tokens: int
    bytes_in: int
    bin_bytes: int
    seconds: float
    skipped_malformed: int = 0
    reused: bool = False


class DatasetManifest(BaseModel):
    name: str
    uri: str
    sources: list[str]
    shards: list[dict]
    parts: list[TokenizedPart]
    blend: list
    tokenizer: TokenizerRef
    json_keys: list[str]
    append_eod: bool
    created: str


# ----------------------------------------------------------------------------- download / extract


def _short(name: str) -> str:
    return name.replace("/", "-")


@task(
    name="download-shard",
    task_run_name="download {source.name}",
    retries=RETRIES,
    retry_delay_seconds=[5, 20, 60],
    cache_policy=cache_policy("infra.fetch"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def download_shard(source: Source, remote: RemoteInfo, dataset_uri: str) -> FetchResult:
    """Fetch one shard into ``raw/``; ``remote`` (etag/size/checksum) is part of the cache key."""
    log = logger()
    dest = storage.join(dataset_uri, "raw", source.name)
    result = download(source.url, dest, expected_size=remote.size, expected_sha256=remote.sha256, log=log.info)
    log.info(
        "%s: %s (%d bytes, %d attempt(s))",
        source.name,
        "already present and verified" if result.skipped else "downloaded",
        result.size,
        result.attempts,
    )
    return result


def _extracted_uri(dataset_uri: str, source_name: str) -> str:
    name = source_name[: -len(".zst")] if source_name.endswith(".zst") else source_name
    return storage.join(dataset_uri, "extracted", name)


@task(
    name="extract-shard",
    task_run_name="extract {source.name}",
    retries=RETRIES,
    retry_delay_seconds=5,
    cache_policy=cache_policy("workloads.shards", "infra.fetch"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def extract_shard(
    source: Source, fetched: FetchResult, dataset_uri: str, delete_compressed: bool = False
) -> ExtractResult:
    """Stream ``.zst`` -> ``.jsonl``. A corrupt or truncated archive is fetched again once."""
    log = logger()
    dest = _extracted_uri(dataset_uri, source.name)
    if not fetched.uri.endswith(".zst"):
        # Already plain JSON lines: "extracting" is a verified copy under extracted/.
        result = concatenate([fetched.uri], dest)
        return ExtractResult(uri=result.uri, bytes=result.bytes, lines=result.lines, source=fetched.uri)
    try:
        return extract_zst(fetched.uri, dest, delete_source=delete_compressed)
    except CorruptArchive as first:
        log.warning("%s: %s; fetching it again once", source.name, first)
        storage.remove(fetched.uri)
        storage.remove(fetched.uri + ".meta.json")
        again = download(source.url, fetched.uri, log=log.info)
        try:
            return extract_zst(again.uri, dest, delete_source=delete_compressed)
        except CorruptArchive as second:
            raise CorruptArchive(f"shard {source.name} is corrupt even after a fresh download: {second}") from second


@task(
    name="concatenate",
    task_run_name="concatenate {part_name}",
    retries=RETRIES,
    retry_delay_seconds=5,
    cache_policy=cache_policy("workloads.shards"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def concatenate_part(
    part_name: str, inputs: list[ExtractResult], dataset_uri: str, checksums: list[str]
) -> ConcatResult:
    """Join the extracted shards of one part; ``checksums`` (of the downloads) key the cache by content."""
    dest = storage.join(dataset_uri, "concat", f"{part_name}.jsonl")
    result = concatenate([i.uri for i in inputs], dest)
    logger().info("%s: %d shard(s), %d lines, %d bytes", part_name, len(inputs), result.lines, result.bytes)
    return result


# ----------------------------------------------------------------------------- tokenize


def _stats_uri(prefix: str) -> str:
    return prefix + ".stats.json"


def _part_identity(
    concat: ConcatResult, checksums: list[str], tokenizer: TokenizerRef, json_keys: list[str], append_eod: bool
) -> dict:
    from tasks.common import code_fingerprint

    return {
        "input": concat.uri,
        "source_checksums": list(checksums),
        "input_bytes": concat.bytes,
        "input_lines": concat.lines,
        "inputs": concat.inputs,
        "tokenizer": tokenizer.fingerprint,
        "json_keys": list(json_keys),
        "append_eod": append_eod,
        "code": code_fingerprint("workloads.tokenize"),
    }


def _finished_part(prefix: str, identity: dict) -> TokenizedPart | None:
    """A part tokenized earlier with the same identity, if its files are all there."""
    stats_uri = _stats_uri(prefix)
    if not storage.exists(stats_uri):
        return None
    stats = storage.read_json(stats_uri)
    if stats.get("identity") != identity:
        return None
    if not (storage.exists(prefix + ".bin") and storage.exists(prefix + ".idx")):
        return None
    if storage.size(prefix + ".bin") != stats["part"]["bin_bytes"]:
        return None
    return TokenizedPart(**{**stats["part"], "reused": True})


def _tokenizer_config(tokenizer: TokenizerRef):
    from workloads.tokenize import TokenizerConfig

    return TokenizerConfig(
        type=tokenizer.type, model=tokenizer.model, vocab_file=tokenizer.vocab_file, merge_file=tokenizer.merge_file
    )


def read_index_counts(prefix: str) -> tuple[int, int]:
    """(documents, tokens) from a Megatron ``.idx`` header and lengths, without loading ``.bin``."""
    import numpy as np

    with storage.open_read(prefix + ".idx") as fh:
        header = fh.read(9 + 8 + 1 + 8 + 8)
        if header[:9] != b"MMIDIDX\x00\x00":
            raise ValueError(f"{prefix}.idx is not a Megatron index (bad magic)")
        sequences = int.from_bytes(header[18:26], "little")
        documents = int.from_bytes(header[26:34], "little") - 1
        lengths = np.frombuffer(fh.read(4 * sequences), dtype=np.int32)
    return documents, int(lengths.sum())


def _tokenize_naming_shard_lines(concat: ConcatResult, base: str, **options):
    """tokenize_file, with input errors pointing at the shard and line they came from.

    A part concatenates several shards, so "part-00001.jsonl:7302" would send a
    person hunting; we translate it to the extracted shard and its own line.
    """
    import re

    from workloads.jsonl import InputError
    from workloads.tokenize import tokenize_file

    try:
        return tokenize_file(concat.uri, base, **options)
    except InputError as exc:
        match = re.match(r"^(.*?):(\d+): (.*)$", str(exc), re.S)
        if not match or match.group(1) != concat.uri:
            raise
        line = int(match.group(2))
        for shard in concat.inputs:
            with storage.open_read(shard) as fh:
                count = sum(1 for _ in fh)
            if line <= count:
                raise InputError(f"{shard}:{line}: {match.group(3)} (in {storage.basename(concat.uri)})") from None
            line -= count
        raise


@task(
    name="tokenize",
    task_run_name="tokenize {concat.uri}",
    retries=2,
    retry_delay_seconds=10,
    cache_policy=cache_policy("workloads.tokenize", "tasks.data"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def tokenize_part(
    concat: ConcatResult,
    checksums: list[str],
    tokenizer: TokenizerRef,
    dataset_uri: str,
    json_keys: list[str],
    append_eod: bool = True,
    workers: int = 2,
    skip_malformed: bool = False,
) -> list[TokenizedPart]:
    """Tokenize one concatenated file in this process (the local backend)."""
    log = logger()
    base = storage.join(dataset_uri, "tokenized", storage.basename(concat.uri).removesuffix(".jsonl"))
    identity = _part_identity(concat, checksums, tokenizer, json_keys, append_eod)
    prefixes = {key: f"{base}_{key}_document" for key in json_keys}
    done = {key: _finished_part(p, identity) for key, p in prefixes.items()}
    if all(done.values()):
        log.info("%s: already tokenized with the same tokenizer and flags", concat.uri)
        return list(done.values())  # type: ignore[arg-type]
    started = time.monotonic()
    stats = _tokenize_naming_shard_lines(
        concat,
        base,
        tokenizer=_tokenizer_config(tokenizer),
        json_keys=tuple(json_keys),
        append_eod=append_eod,
        workers=workers,
        skip_malformed=skip_malformed,
    )
    seconds = time.monotonic() - started
    parts = []
    for prefix in prefixes.values():
        documents, tokens = read_index_counts(prefix)
        part = TokenizedPart(
            input=concat.uri,
            prefix=prefix,
            documents=documents,
            tokens=tokens,
            bytes_in=concat.bytes,
            bin_bytes=storage.size(prefix + ".bin"),
            seconds=seconds,
            skipped_malformed=getattr(stats, "malformed_skipped", 0),
        )
        storage.write_json(_stats_uri(prefix), {"identity": identity, "part": part.model_dump()})
        parts.append(part)
        log.info(
            "%s -> %s: %d documents, %d tokens, %.1f MB/s",
            storage.basename(concat.uri),
            storage.basename(prefix),
            documents,
            tokens,
            concat.bytes / 1e6 / max(seconds, 1e-9),
        )
    return parts


@task(
    name="tokenize-array",
    task_run_name="tokenize {n} part(s) as one job array",
    retries=1,
    cache_policy=cache_policy("workloads.tokenize", "tasks.data"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def tokenize_parts_as_array(
    concats: list[ConcatResult],
    checksums: list[list[str]],
    tokenizer: TokenizerRef,
    dataset_uri: str,
    json_keys: list[str],
    append_eod: bool,
    workers: int,
    skip_malformed: bool,
    backend: str,
    n: int,
    image: str | None = None,
) -> list[TokenizedPart]:
    """Tokenize on a cluster: ONE array job (a Slurm array / an Indexed Job), one task per unfinished part."""
    log = logger()
    plan = []
    parts: list[TokenizedPart] = []
    for concat, sums in zip(concats, checksums):
        base = storage.join(dataset_uri, "tokenized", storage.basename(concat.uri).removesuffix(".jsonl"))
        identity = _part_identity(concat, sums, tokenizer, json_keys, append_eod)
        prefixes = {key: f"{base}_{key}_document" for key in json_keys}
        if all(_finished_part(p, identity) for p in prefixes.values()):
            continue
        plan.append({"input": concat.uri, "output_prefix": base, "identity": identity, "bytes": concat.bytes})
    if plan:
        plan_uri = storage.join(dataset_uri, "tokenized", "array-plan.json")
        storage.write_json(
            plan_uri,
            {
                "items": plan,
                "tokenizer": tokenizer.model_dump(),
                "json_keys": json_keys,
                "append_eod": append_eod,
                "workers": workers,
                "skip_malformed": skip_malformed,
            },
        )
        spec = JobSpec(
            name="nemoflow-tokenize",
            command=[sys.executable, "-m", "workloads.tokenize_array", "--plan", plan_uri],
            resources=Resources(cpus_per_task=workers),
            array_size=len(plan),
            workdir=os.getcwd(),
            container_image=image,
        )
        log.info("tokenizing %d part(s) as one %s job array", len(plan), backend)
        run_job(spec, backend)
    for concat, sums in zip(concats, checksums):
        base = storage.join(dataset_uri, "tokenized", storage.basename(concat.uri).removesuffix(".jsonl"))
        identity = _part_identity(concat, sums, tokenizer, json_keys, append_eod)
        for key in json_keys:
            part = _finished_part(f"{base}_{key}_document", identity)
            if part is None:
                raise RuntimeError(f"the array job ended but {base}_{key}_document is missing or incomplete")
            parts.append(part)
    return parts


# ----------------------------------------------------------------------------- blend


def blend_weights(prefixes_and_sizes: list[tuple[str, int]], alpha: float = 1.0) -> list:
    """NeMo ``data_prefix``: weights proportional to each file's ``.bin`` size (to the power alpha).

    Same rule as NeMo's auto_blend.py for GPT (every .bin is its own split):
    weight = size**alpha / sum(size**alpha), rounded to 6 digits.

    >>> blend_weights([("a", 300), ("b", 100)])
    [0.75, 'a', 0.25, 'b']
    """
    if not prefixes_and_sizes:
        raise ValueError("nothing to blend: no tokenized files")
    powered = [(p, math.pow(size, alpha)) for p, size in prefixes_and_sizes]
    total = sum(w for _, w in powered)
    if total <= 0:
        raise ValueError("nothing to blend: every tokenized file is empty")
    out: list = []
    for prefix, weight in powered:
        out.extend([round(weight / total, 6), prefix])
    return out


def auto_blend_text(blend: list) -> str:
    """The blend exactly as NeMo's auto_blend.py prints it (Python repr, no spaces)."""
    return str(blend).replace(" ", "")


@task(
    name="blend",
    task_run_name="blend {name}",
    retries=RETRIES,
    retry_delay_seconds=5,
    cache_policy=cache_policy("tasks.data"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def write_blend(
    name: str,
    dataset_uri: str,
    sources: list[Source],
    fetched: list[FetchResult],
    parts: list[TokenizedPart],
    tokenizer: TokenizerRef,
    json_keys: list[str],
    append_eod: bool,
    alpha: float = 1.0,
) -> DatasetRef:
    from tasks.refs import now

    ordered = sorted(parts, key=lambda p: p.prefix)
    blend = blend_weights([(p.prefix, p.bin_bytes) for p in ordered], alpha)
    manifest = DatasetManifest(
        name=name,
        uri=dataset_uri,
        sources=[s.url for s in sources],
        shards=[
            {"name": s.name, "url": s.url, "uri": f.uri, "size": f.size, "sha256": f.sha256, "etag": f.etag}
            for s, f in zip(sources, fetched)
        ],
        parts=ordered,
        blend=blend,
        tokenizer=tokenizer,
        json_keys=json_keys,
        append_eod=append_eod,
        created=now().isoformat(),
    )
    manifest_uri = storage.join(dataset_uri, "manifest.json")
    storage.write_text(storage.join(dataset_uri, "blend.json"), json.dumps(blend) + "\n")
    storage.write_text(storage.join(dataset_uri, "data_prefix.txt"), auto_blend_text(blend) + "\n")
    storage.write_json(manifest_uri, manifest.model_dump(mode="json"))
    logger().info("data_prefix=%s", auto_blend_text(blend))
    return DatasetRef(
        prefixes=[p.prefix for p in ordered],
        blend=blend,
        manifest_uri=manifest_uri,
        tokenizer=tokenizer,
        documents=sum(p.documents for p in ordered),
        tokens=sum(p.tokens for p in ordered),
        bytes=sum(p.bytes_in for p in ordered),
    )


def publish_table(dataset: DatasetRef, parts: list[TokenizedPart], seconds: float) -> None:
    rows = [
        {
            "file": storage.basename(p.prefix),
            "documents": p.documents,
            "tokens": p.tokens,
            "text MB": round(p.bytes_in / 1e6, 2),
            ".bin MB": round(p.bin_bytes / 1e6, 2),
            "MB/s": "cached" if p.reused else round(p.bytes_in / 1e6 / max(p.seconds, 1e-9), 2),
            "weight": dataset.blend[2 * i],
        }
        for i, p in enumerate(sorted(parts, key=lambda p: p.prefix))
    ]
    rows.append(
        {
            "file": "TOTAL",
            "documents": dataset.documents,
            "tokens": dataset.tokens,
            "text MB": round(dataset.bytes / 1e6, 2),
            ".bin MB": round(sum(p.bin_bytes for p in parts) / 1e6, 2),
            "MB/s": round(dataset.bytes / 1e6 / max(seconds, 1e-9), 2),
            "weight": 1.0,
        }
    )
    create_table_artifact(
        key="prepared-dataset",
        table=rows,
        description=f"Prepared dataset: {dataset.manifest_uri}\n\n`data_prefix={auto_blend_text(dataset.blend)}`",
    )

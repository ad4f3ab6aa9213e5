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
from datetime import timedelta
from typing import Any

from prefect import task
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel

from infra import storage
from infra.executors import Executor
from infra.fetch import FetchResult, RemoteInfo, download
from infra.jobs import ImageRef, JobSpec, Resources, workload_job
from infra.settings import get_settings
from infra.sources import Source
from tasks.common import cache_policy, logger, run_job
from tasks.refs import DatasetRef, TokenizerRef
from workloads.shards import ConcatResult, CorruptArchive, ExtractResult, concatenate, extract_zst
from workloads.tokenize_array import (
    PlanItem,
    TokenizedPart,
    TokenizePlan,
    TokenizerSpec,
    finished_part,
)

RETRIES = 3


# ----------------------------------------------------------------------------- results


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


def _output_base(dataset_uri: str, concat: ConcatResult) -> str:
    return storage.join(dataset_uri, "tokenized", storage.basename(concat.uri).removesuffix(".jsonl"))


def build_tokenize_job(
    plan_uri: str, items: int, workers: int, image: ImageRef | None = None, paths: list[str] | None = None
) -> JobSpec:
    """ONE array job: a task per unfinished part (local processes, a Slurm array, an Indexed Job)."""
    return workload_job(
        "nemoflow-tokenize",
        "workloads.tokenize_array",
        ["--plan", plan_uri],
        image=image,
        resources=Resources(cpus_per_task=workers),
        array_size=items,
        paths=paths or [],
        # a Hugging Face tokenizer named by its hub id is downloaded by the job
        secret_env=[name for name in ("HF_TOKEN",) if name in get_settings().secret_env()],
    )


@task(
    name="tokenize",
    task_run_name="tokenize {n} part(s)",
    retries=2,
    retry_delay_seconds=10,
    cache_policy=cache_policy("workloads.tokenize", "workloads.tokenize_array", "tasks.data"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def tokenize_parts(
    concats: list[ConcatResult],
    checksums: list[list[str]],
    tokenizer: TokenizerRef,
    dataset_uri: str,
    json_keys: list[str],
    append_eod: bool,
    workers: int,
    skip_malformed: bool,
    n: int,
    executor: Executor | Any = None,
    image: ImageRef | None = None,
) -> list[TokenizedPart]:
    """Tokenize every part not already tokenized with the same identity, as ONE array job where the
    executor says; parts finished by an earlier (even failed) run are reused."""
    log = logger()
    items: list[PlanItem] = []
    for concat, sums in zip(concats, checksums):
        base = _output_base(dataset_uri, concat)
        identity = _part_identity(concat, sums, tokenizer, json_keys, append_eod)
        if all(finished_part(f"{base}_{key}_document", identity) for key in json_keys):
            continue
        items.append(
            PlanItem(input=concat.uri, inputs=concat.inputs, output_prefix=base, identity=identity, bytes=concat.bytes)
        )
    if items:
        plan_uri = storage.join(dataset_uri, "tokenized", "array-plan.json")
        plan = TokenizePlan(
            items=items,
            tokenizer=TokenizerSpec(
                type=tokenizer.type,
                model=tokenizer.model,
                vocab_file=tokenizer.vocab_file,
                merge_file=tokenizer.merge_file,
            ),
            json_keys=json_keys,
            append_eod=append_eod,
            workers=workers,
            skip_malformed=skip_malformed,
        )
        storage.write_json(plan_uri, plan.model_dump(mode="json"))
        tokenizer_files = [f for f in (tokenizer.model, tokenizer.vocab_file, tokenizer.merge_file) if f]
        local = [storage.local_path(dataset_uri)] if storage.is_local(dataset_uri) else []
        local += [os.path.dirname(os.path.abspath(f)) for f in tokenizer_files if os.path.exists(f)]
        log.info("tokenizing %d of %d part(s) as one job array", len(items), len(concats))
        run_job(build_tokenize_job(plan_uri, len(items), workers, image, local), executor)
    else:
        log.info("all %d part(s) already tokenized with the same tokenizer and flags", len(concats))
    parts: list[TokenizedPart] = []
    for concat, sums in zip(concats, checksums):
        base = _output_base(dataset_uri, concat)
        identity = _part_identity(concat, sums, tokenizer, json_keys, append_eod)
        for key in json_keys:
            part = finished_part(f"{base}_{key}_document", identity)
            if part is None:
                raise RuntimeError(f"the tokenize job ended but {base}_{key}_document is missing or incomplete")
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

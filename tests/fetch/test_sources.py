"""Source expansion: URL templates with ranges, globs on local disk and on GCS, lists."""

from __future__ import annotations

import pytest

from infra import storage
from infra.sources import Source, SourceError, expand_sources, parse_range

SLIMPAJAMA = (
    "https://huggingface.co/datasets/cerebras/SlimPajama-627B/resolve/main/"
    "train/chunk{chunk}/example_train_{shard}.jsonl.zst"
)


def test_template_expands_chunk_then_shard():
    sources = expand_sources(SLIMPAJAMA, chunks="2,1", shards="0,3,5-6")
    expected = []
    for c in (1, 2):
        for s in (0, 3, 5, 6):
            expected.append(
                Source(
                    url=f"https://huggingface.co/datasets/cerebras/SlimPajama-627B/resolve/main/"
                    f"train/chunk{c}/example_train_{s}.jsonl.zst",
                    name=f"chunk{c}/example_train_{s}.jsonl.zst",
                )
            )
    assert sources == expected


def test_template_with_one_placeholder():
    sources = expand_sources("gs://b/raw/part-{shard}.jsonl", shards="8-10")
    assert [s.url for s in sources] == [
        "gs://b/raw/part-8.jsonl",
        "gs://b/raw/part-9.jsonl",
        "gs://b/raw/part-10.jsonl",
    ]
    assert [s.name for s in sources] == ["part-8.jsonl", "part-9.jsonl", "part-10.jsonl"]


def test_template_format_spec_pads_numbers():
    sources = expand_sources("https://h/c4/en/c4-train.{shard:05d}-of-01024.json.gz", shards="9-10")
    assert [s.name for s in sources] == ["c4-train.00009-of-01024.json.gz", "c4-train.00010-of-01024.json.gz"]
    with pytest.raises(SourceError, match="bad format spec 'q'"):
        expand_sources("https://h/x-{shard:q}.gz", shards="1")


@pytest.mark.parametrize(
    ("text", "values"),
    [("0,3,5-7", [0, 3, 5, 6, 7]), ("7", [7]), ("3-3", [3]), ("2,1-2, 0", [0, 1, 2])],
)
def test_parse_range(text, values):
    assert parse_range(text) == values


@pytest.mark.parametrize("bad", ["", "x", "5-3", "1,,2", "-1", "1-", "1.5"])
def test_bad_range_is_named(bad):
    with pytest.raises(SourceError, match="bad chunk range") as err:
        expand_sources(SLIMPAJAMA, chunks=bad, shards="0")
    assert repr(bad) in str(err.value)


def test_template_errors_name_the_problem():
    with pytest.raises(SourceError, match=r"\{shard\} placeholder but no shard range"):
        expand_sources(SLIMPAJAMA, chunks="1")
    with pytest.raises(SourceError, match=r"has no \{chunk\}"):
        expand_sources("https://host/x_{shard}.zst", chunks="1", shards="1")
    with pytest.raises(SourceError, match=r"unknown placeholder.*\{split\}"):
        expand_sources("https://host/{split}/x_{shard}.zst", shards="1")
    with pytest.raises(SourceError, match="no {chunk} or {shard} placeholder"):
        expand_sources("https://host/x.zst", shards="1")


@pytest.mark.parametrize("uri", ["s3://bucket/x.jsonl", "ftp://host/x.zst", "hdfs://nn/x_{shard}.zst"])
def test_unsupported_scheme_is_named(uri):
    with pytest.raises(SourceError, match="unsupported scheme") as err:
        expand_sources(uri, shards="1" if "{shard}" in uri else None)
    assert uri.split("://")[0] in str(err.value)


# The corpus template's shards as a recursive glob names them (their folders kept), local or in a bucket.
TEMPLATE_SHARDS = [
    "chunk1/example_train_0.jsonl.zst",
    "chunk1/example_train_1.jsonl.zst",
    "chunk2/example_train_0.jsonl.zst",
    "chunk2/example_train_1.jsonl.zst",
]


def test_local_glob_keeps_subfolders_in_names(corpus_template):
    root = corpus_template / "train"
    sources = expand_sources(f"{root}/**/*.jsonl.zst")
    assert [s.name for s in sources] == TEMPLATE_SHARDS
    for src in sources:
        assert (root / src.name).read_bytes() == storage.read_bytes(src.url)
    assert [s.name for s in expand_sources(f"file://{root}/chunk2/*.zst")] == [
        "example_train_0.jsonl.zst",
        "example_train_1.jsonl.zst",
    ]


def test_glob_matching_nothing_names_the_pattern(tmp_path):
    pattern = f"{tmp_path}/nothing-here/*.jsonl.zst"
    with pytest.raises(SourceError, match="matched no files") as err:
        expand_sources(pattern)
    assert pattern in str(err.value)


def test_glob_on_gcs(gcs_bucket, corpus_template):
    for path in sorted(corpus_template.glob("train/chunk*/*.zst")):
        storage.put_file(str(path), f"{gcs_bucket}/raw/{path.parent.name}/{path.name}")
    storage.write_text(f"{gcs_bucket}/raw/README.txt", "not a shard")
    flat = expand_sources(f"{gcs_bucket}/raw/chunk1/*.jsonl.zst")
    assert [s.url for s in flat] == [
        f"{gcs_bucket}/raw/chunk1/example_train_0.jsonl.zst",
        f"{gcs_bucket}/raw/chunk1/example_train_1.jsonl.zst",
    ]
    deep = expand_sources(f"{gcs_bucket}/raw/**/*.jsonl.zst")
    assert [s.name for s in deep] == TEMPLATE_SHARDS
    assert storage.read_bytes(deep[3].url) == (corpus_template / "train/chunk2/example_train_1.jsonl.zst").read_bytes()
    with pytest.raises(SourceError, match=f"{gcs_bucket}/raw/\\*\\.parquet"):
        expand_sources(f"{gcs_bucket}/raw/*.parquet")


def test_list_names_stay_distinct():
    sources = expand_sources(["https://h/d/chunk1/a.zst", "https://h/d/chunk2/a.zst"])
    assert [s.name for s in sources] == ["chunk1/a.zst", "chunk2/a.zst"]
    assert [s.name for s in expand_sources(["/data/x/a.jsonl", "/data/x/b.jsonl"])] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(SourceError, match="same name 'a.zst'"):
        expand_sources(["https://h1/d/a.zst", "https://h2/d/a.zst"])
    with pytest.raises(SourceError, match="empty"):
        expand_sources([])


def test_glob_over_http_is_refused():
    with pytest.raises(SourceError, match="cannot expand a glob over https"):
        expand_sources("https://host/train/*.zst")

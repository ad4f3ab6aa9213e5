"""Extract (.zst -> .jsonl) and concatenate on real KJV shards, locally and on GCS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from infra import storage
from infra.fetch import download
from tests.conftest import REPO
from workloads.demo_data import kjv_citations, read_jsonl_zst
from workloads.shards import CorruptArchive, concatenate, extract_zst, group

from .conftest import SHARD


def shard(corpus_template: Path, tmp_path: Path, rel: str = SHARD) -> Path:
    dst = tmp_path / "raw" / Path(rel).name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes((corpus_template / rel.lstrip("/")).read_bytes())
    return dst


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in storage.read_text(str(path)).splitlines()]


def test_extract_matches_the_reference_reader(corpus_template, tmp_path):
    src = shard(corpus_template, tmp_path)
    out = tmp_path / "jsonl" / "example_train_0.jsonl"
    logs: list[str] = []
    result = extract_zst(str(src), str(out), log=logs.append)
    records = read_jsonl(out)
    assert records == read_jsonl_zst(src)
    assert result.lines == len(records) and result.bytes == out.stat().st_size
    assert result.source == str(src) and src.exists()
    assert logs and "example_train_0.jsonl.zst" in logs[0]


def test_multi_frame_archive_is_read_whole(tmp_path):
    cctx = zstandard.ZstdCompressor()
    parts = [b'{"text": "a"}\n', b'{"text": "b"}\n{"text": "c"}\n']
    (tmp_path / "multi.jsonl.zst").write_bytes(b"".join(cctx.compress(p) for p in parts))
    result = extract_zst(str(tmp_path / "multi.jsonl.zst"), str(tmp_path / "multi.jsonl"))
    assert (tmp_path / "multi.jsonl").read_bytes() == b"".join(parts)
    assert result.lines == 3


def _truncated(data: bytes) -> bytes:
    return data[: len(data) - 100]


def _corrupted(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0x5A for b in data[mid : mid + 64]) + data[mid + 64 :]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_truncated, id="truncated"),
        pytest.param(_corrupted, id="corrupt"),
        pytest.param(lambda data: data[:8], id="header-only"),
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: b"this is not zstd at all\n" * 10, id="not-zstd"),
    ],
)
def test_damaged_archive_raises_naming_the_shard(corpus_template, tmp_path, damage):
    src = shard(corpus_template, tmp_path)
    src.write_bytes(damage(src.read_bytes()))
    out_dir = tmp_path / "jsonl"
    with pytest.raises(CorruptArchive, match="example_train_0.jsonl.zst") as err:
        extract_zst(str(src), str(out_dir / "example_train_0.jsonl"), delete_source=True)
    assert err.value.shard == str(src)
    assert not out_dir.exists() or list(out_dir.iterdir()) == []  # no .jsonl, no temporary left
    assert src.exists()  # a failed extract never deletes its input


def test_truncation_at_a_frame_boundary_is_not_an_error(tmp_path):
    """Proof the check is per frame: two whole frames are fine, a cut inside the second is not."""
    cctx = zstandard.ZstdCompressor()
    first, second = cctx.compress(b'{"a": 1}\n' * 1000), cctx.compress(b'{"b": 2}\n' * 1000)
    (tmp_path / "ok.zst").write_bytes(first + second)
    assert extract_zst(str(tmp_path / "ok.zst"), str(tmp_path / "ok.jsonl")).lines == 2000
    (tmp_path / "cut.zst").write_bytes(first + second[: len(second) // 2])
    with pytest.raises(CorruptArchive, match="cut.zst: truncated"):
        extract_zst(str(tmp_path / "cut.zst"), str(tmp_path / "cut.jsonl"))


def test_delete_source_after_commit(corpus_template, tmp_path):
    src = shard(corpus_template, tmp_path)
    storage.write_json(str(src) + ".meta.json", {"size": src.stat().st_size})
    expected = read_jsonl_zst(src)
    result = extract_zst(str(src), str(tmp_path / "out.jsonl"), delete_source=True)
    assert not src.exists() and not Path(str(src) + ".meta.json").exists()
    assert read_jsonl(result.uri) == expected


def test_concatenate_keeps_order_and_line_boundaries(tmp_path):
    a, b, c, d = (tmp_path / n for n in ("a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl"))
    a.write_bytes(b'{"i": 0}\n{"i": 1}\n')
    b.write_bytes(b'{"i": 2}')  # no final newline: must not merge with c's first line
    c.write_bytes(b"")
    d.write_bytes(b'{"i": 3}\n')
    result = concatenate([str(p) for p in (a, b, c, d)], str(tmp_path / "out" / "all.jsonl"))
    assert [r["i"] for r in read_jsonl(result.uri)] == [0, 1, 2, 3]
    assert result.lines == 4 and result.bytes == (tmp_path / "out" / "all.jsonl").stat().st_size
    assert result.inputs == [str(p) for p in (a, b, c, d)]
    with pytest.raises(ValueError, match="empty"):
        concatenate([], str(tmp_path / "none.jsonl"))


def test_concatenate_missing_input_leaves_no_output(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"i": 0}\n')
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        concatenate([str(tmp_path / "a.jsonl"), str(tmp_path / "missing.jsonl")], str(tmp_path / "out.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


def test_group():
    items = [f"s{i}" for i in range(10)]
    assert group(items, 4) == [["s0", "s1", "s2", "s3"], ["s4", "s5", "s6", "s7"], ["s8", "s9"]]
    assert group(items, 10) == [items] and group(items, 20) == [items]
    assert group([], 3) == []
    with pytest.raises(ValueError, match="at least 1, got 0"):
        group(items, 0)


def test_download_extract_concatenate_n_per_file(server, tmp_path):
    """The three steps end to end: 4 shards served over HTTP -> 2 files of 3 + 1 shards."""
    paths = [f"/train/chunk{c}/example_train_{s}.jsonl.zst" for c in (1, 2) for s in (0, 1)]
    extracted = []
    for p in paths:
        name = p.removeprefix("/train/")
        raw = download(server.url(p), str(tmp_path / "raw" / name), backoff=0.01)
        out = extract_zst(raw.uri, str(tmp_path / "jsonl" / name.removesuffix(".zst")), delete_source=True)
        extracted.append(out)
    batches = group([e.uri for e in extracted], 3)
    merged = [concatenate(b, str(tmp_path / "merged" / f"train_{i:04d}.jsonl")) for i, b in enumerate(batches)]
    assert [len(m.inputs) for m in merged] == [3, 1]
    docs = [r for m in merged for r in read_jsonl(m.uri)]
    # The demo deals chapters round-robin over the 4 shards: shard k holds chapters k, k+4, ...
    expected = [cite for k in range(4) for cite in kjv_citations()[k::4]]
    assert [d["meta"]["citation"] for d in docs] == expected
    assert sum(m.lines for m in merged) == len(kjv_citations())
    assert not list((tmp_path / "raw").rglob("*.zst"))


def test_extract_and_concatenate_on_gcs(gcs_bucket, corpus_template, tmp_path):
    src = f"{gcs_bucket}/raw/example_train_0.jsonl.zst"
    storage.put_file(str(corpus_template / SHARD.lstrip("/")), src)
    out = extract_zst(src, f"{gcs_bucket}/jsonl/example_train_0.jsonl", delete_source=True)
    assert not storage.exists(src)
    local = tmp_path / "x.jsonl"
    storage.get_file(out.uri, str(local))
    assert read_jsonl(local) == read_jsonl_zst(corpus_template / SHARD.lstrip("/"))
    merged = concatenate([out.uri, out.uri], f"{gcs_bucket}/merged/all.jsonl")
    assert merged.lines == 2 * out.lines and storage.size(merged.uri) == 2 * out.bytes
    storage.write_bytes(f"{gcs_bucket}/raw/bad.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"\x00" * 20)
    with pytest.raises(CorruptArchive, match="bad.jsonl.zst"):
        extract_zst(f"{gcs_bucket}/raw/bad.jsonl.zst", f"{gcs_bucket}/jsonl/bad.jsonl")
    assert not storage.exists(f"{gcs_bucket}/jsonl/bad.jsonl")
    assert [u for u in storage.listdir(f"{gcs_bucket}/jsonl") if storage.TMP_MARK in u] == []


# Runs in a fresh process: extract_zst's whole footprint, Python objects and zstd's C buffers alike, shows in the
# process's resident set. Its peak (VmHWM) is reset after the imports, so only the extraction counts.
MEASURE_RSS = """
import json, pathlib, sys
from workloads.shards import extract_zst

def status(key):
    line = next(l for l in pathlib.Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set (Linux >= 4.0)
start = status("VmRSS")
result = extract_zst(sys.argv[1], sys.argv[2])
print(json.dumps({"start": start, "peak": status("VmHWM"), "bytes": result.bytes, "lines": result.lines}))
"""


def test_extract_resident_memory_stays_flat(tmp_path, kjv_chapters):
    """~43 MB of JSON lines extract while the process's resident memory (RSS, C buffers included) grows by
    less than a quarter of that: nothing holds the whole file, compressed or not."""
    body = "".join(json.dumps({"text": t}) + "\n" for t in kjv_chapters).encode() * 10
    (tmp_path / "big.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=1).compress(body))
    size = len(body)
    del body
    run = subprocess.run(
        [sys.executable, "-c", MEASURE_RSS, str(tmp_path / "big.jsonl.zst"), str(tmp_path / "big.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.splitlines()[-1])
    assert measured["bytes"] == size > 40_000_000 and measured["lines"] == 10 * len(kjv_chapters)
    growth = measured["peak"] - measured["start"]
    print(
        f"extracting {size / 1e6:.1f} MB: resident set grew {growth / 1e6:.1f} MB (from {measured['start'] / 1e6:.1f} MB)"
    )
    assert growth < size // 4, f"resident set grew {growth} bytes while extracting {size}"


def test_corrupt_archive_accepts_a_caller_message():
    err = CorruptArchive("shard chunk1/example_train_0.jsonl.zst is corrupt even after a fresh download")
    assert str(err).startswith("shard chunk1/example_train_0.jsonl.zst")
    assert CorruptArchive("gs://b/x.zst", "truncated").shard == "gs://b/x.zst"

"""The fetch job array's parts without Prefect: plan -> array tasks -> sidecars, journals, manifest.

Real files, a real HTTP server with scripted faults (tests/support/fault_server.py), and the
local backend running array tasks as processes, as the data stage does.
"""

from __future__ import annotations

import json
import os
import threading

import orjson
import pytest
import zstandard

from infra import storage
from infra.backends.local import LocalBackend
from infra.configs.fetch import FetchOptions
from infra.jobs import JobState
from infra.sources import expand_sources
from tasks.data import build_fetch_job, write_fetch_plan, write_json_streaming
from tasks.data import check_shards as check_names
from tests.support import fault_ledger
from tests.support.fault_server import Fault, FaultServer
from workloads.fetch_array import FetchPlan, run_task
from workloads.shard_manifest import (
    FLUSH_LINES,
    Journal,
    ShardFailure,
    ShardRecord,
    index_manifest,
    merge_journals,
    read_manifest,
    read_progress,
    state_key,
    write_manifest,
)
from workloads.throttle import HostThrottle


def _layout(root, chunks: int, shards: int) -> str:
    cctx = zstandard.ZstdCompressor()
    for c in range(1, chunks + 1):
        folder = root / "train" / f"chunk{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for s in range(shards):
            text = "".join(json.dumps({"text": f"chunk {c} shard {s} line {i}"}) + "\n" for i in range(3))
            (folder / f"example_train_{s}.jsonl.zst").write_bytes(cctx.compress(text.encode()))
    return "train/chunk{chunk}/example_train_{shard}.jsonl.zst"


def check_shards(sources, dataset: str, revalidate: bool = False):
    return check_names([s.name for s in sources], [s.url for s in sources], dataset, revalidate)


def _plan(tmp_path, template: str, chunks: int, shards: int, tasks: int = 2, **options):
    dataset = str(tmp_path / "dataset")
    sources = expand_sources(template, chunks=f"1-{chunks}", shards=f"0-{shards - 1}")
    check = check_shards(sources, dataset)
    uri, plan = write_fetch_plan(check, FetchOptions(**options), tasks)
    return dataset, check, uri, plan


def _run_all(plan: FetchPlan) -> None:
    for index in range(plan.tasks):
        run_task(plan, index, log=lambda line: None)


def test_tasks_split_the_shards_and_a_rerun_reads_only_sidecars(tmp_path, monkeypatch):
    template = _layout(tmp_path / "src", chunks=2, shards=150)
    dataset, check, _, plan = _plan(tmp_path, str(tmp_path / "src" / template), 2, 150, tasks=4)
    assert plan.tasks == 2  # 300 shards: at least 256 per task below fetch_tasks=4 would be too few
    per_task = [len(storage.read_bytes(plan.items_uri(i)).splitlines()) for i in range(plan.tasks)]
    assert per_task == [150, 150]
    _run_all(plan)
    assert read_progress(plan.journal_dir, plan.plan_id) == (300, 0)
    merged, failures = merge_journals(dataset)
    assert (merged, failures) == (300, {})
    left = [storage.basename(u) for u in storage.listdir(plan.journal_dir)]
    assert left == [f"progress-{plan.plan_id}-0000{i}.json" for i in range(2)]  # merged segments are removed
    records = read_manifest(dataset)
    record = records["chunk2/example_train_7.jsonl.zst"]
    assert record["lines"] == 3 and record["code"] == check.code
    extracted = open(record["extracted"]).read()
    assert extracted.splitlines()[0] == json.dumps({"text": "chunk 2 shard 7 line 0"})

    # A task given the same shards again (a requeued task) downloads nothing: the sidecars answer...
    calls = []
    monkeypatch.setattr("infra.fetch.download", lambda *a, **k: calls.append(a) or pytest.fail("downloaded again"))
    journal = run_task(plan, 0, log=lambda line: None)
    assert journal.done == 150 and calls == []
    merge_journals(dataset)
    # ...and with everything recorded, a new check finds nothing to do.
    sources = expand_sources(str(tmp_path / "src" / template), chunks="1-2", shards="0-149")
    assert check_shards(sources, dataset).pending == []


def test_changed_local_source_is_fetched_again_and_touched_one_is_not_reextracted(tmp_path):
    template = _layout(tmp_path / "src", chunks=1, shards=3)
    spec = str(tmp_path / "src" / template)
    dataset, _, _, plan = _plan(tmp_path, spec, 1, 3, tasks=1)
    _run_all(plan)
    merge_journals(dataset)
    extracted = read_manifest(dataset)["chunk1/example_train_1.jsonl.zst"]["extracted"]
    before = os.stat(extracted).st_mtime_ns

    src = tmp_path / "src" / "train" / "chunk1"
    os.utime(src / "example_train_1.jsonl.zst")  # same bytes, new mtime
    changed = zstandard.ZstdCompressor().compress(json.dumps({"text": "new"}).encode() + b"\n")
    (src / "example_train_2.jsonl.zst").write_bytes(changed)
    again = check_shards(expand_sources(spec, chunks="1", shards="0-2"), dataset)
    assert sorted(again.names[p] for p, _ in again.pending) == [
        "chunk1/example_train_1.jsonl.zst",
        "chunk1/example_train_2.jsonl.zst",
    ]
    _, plan = write_fetch_plan(again, FetchOptions(), 1)
    _run_all(plan)
    merge_journals(dataset)
    records = read_manifest(dataset)
    assert os.stat(extracted).st_mtime_ns == before  # same sha256: the extraction stands
    assert open(records["chunk1/example_train_2.jsonl.zst"]["extracted"]).read() == '{"text": "new"}\n'
    assert check_shards(expand_sources(spec, chunks="1", shards="0-2"), dataset).pending == []


def test_http_shards_are_trusted_unless_revalidated(tmp_path):
    template = _layout(tmp_path / "site", chunks=1, shards=3)
    with FaultServer(tmp_path / "site") as server:
        spec = server.url(template)
        dataset, _, _, plan = _plan(tmp_path, spec, 1, 3, tasks=1)
        _run_all(plan)
        merge_journals(dataset)
        assert server.count(method="HEAD") == 0  # the download itself tells size and etag
        sources = expand_sources(spec, chunks="1", shards="0-2")
        assert check_shards(sources, dataset).pending == []
        server.clear_log()

        # The server's copy of shard 0 changes; only revalidation notices (a HEAD per shard, in the job).
        changed = zstandard.ZstdCompressor().compress(json.dumps({"text": "changed"}).encode() + b"\n")
        (tmp_path / "site" / "train" / "chunk1" / "example_train_0.jsonl.zst").write_bytes(changed)
        again = check_shards(sources, dataset, revalidate=True)
        assert len(again.pending) == 3
        _, plan = write_fetch_plan(again, FetchOptions(revalidate=True), 1)
        _run_all(plan)
        merge_journals(dataset)
        assert server.count(method="HEAD") == 3
        assert server.count(method="GET") == 1  # only the changed shard is downloaded
        record = read_manifest(dataset)["chunk1/example_train_0.jsonl.zst"]
        assert open(record["extracted"]).read() == '{"text": "changed"}\n'


@pytest.mark.faults
def test_a_failing_shard_is_recorded_and_the_others_finish(tmp_path):
    template = _layout(tmp_path / "site", chunks=1, shards=4)
    with FaultServer(
        tmp_path / "site", always={"/train/chunk1/example_train_2.jsonl.zst": Fault(status=404)}
    ) as server:
        row = fault_ledger.open_row("http 404 for one shard of a download task")
        row.injected_from(server.injected_count)
        dataset, _, _, plan = _plan(tmp_path, server.url(template), 1, 4, tasks=1)
        lines: list[str] = []
        journal = run_task(plan, 0, log=lines.append)
    assert (journal.done, journal.failed) == (3, 1)
    assert any(line.startswith("FAILED chunk1/example_train_2.jsonl.zst: not found") for line in lines), lines
    merged, failures = merge_journals(dataset)
    assert merged == 3 and list(failures) == ["chunk1/example_train_2.jsonl.zst"]
    assert "not found" in failures["chunk1/example_train_2.jsonl.zst"]
    assert sorted(read_manifest(dataset)) == [f"chunk1/example_train_{i}.jsonl.zst" for i in (0, 1, 3)]


def test_array_tasks_run_as_processes_on_the_local_backend(tmp_path):
    template = _layout(tmp_path / "src", chunks=3, shards=200)
    dataset, _, uri, plan = _plan(tmp_path, str(tmp_path / "src" / template), 3, 200, tasks=3)
    lines: list[str] = []
    result = LocalBackend(max_parallel=2).run(build_fetch_job(uri, plan.tasks), on_log=lines.append)
    assert result.state is JobState.COMPLETED, result
    assert {line.split(" ", 1)[0] for line in lines} == {"[0]", "[1]", "[2]"}
    assert len(lines) <= 3 * 4, lines  # start, summary and at most a couple of progress lines per task
    assert merge_journals(dataset) == (600, {})


def test_journal_segments_and_merge_order(tmp_path):
    dataset = str(tmp_path / "d")
    directory = storage.join(dataset, "shards", "journal")
    record = ShardRecord(
        name="a",
        url="u",
        url_sha256="x",
        remote={},
        raw="r",
        size=1,
        sha256="s",
        extracted="e",
        bytes=1,
        lines=1,
        code="c",
    )
    earlier = Journal(directory, "20260101T000000-aaaaaa", 0, total=2)
    earlier.add(ShardFailure(name="a", error="boom"))
    earlier.add(ShardFailure(name="b", error="gone"))
    earlier.flush()
    later = Journal(directory, "20260101T000001-bbbbbb", 0, total=1)
    for _ in range(FLUSH_LINES + 1):
        later.add(record)
    later.flush()
    assert len(later.segments()) == 2  # a segment every FLUSH_LINES lines
    requeued = Journal(directory, "20260101T000001-bbbbbb", 0, total=1)
    assert requeued._seq == 2  # a requeued task never overwrites the segments of its first run
    merged, failures = merge_journals(dataset)
    assert merged == FLUSH_LINES + 1 and failures == {"b": "gone"}  # "a" failed, then succeeded
    assert list(read_manifest(dataset)) == ["a"]


def test_manifest_index_is_compact_and_state_keys_tell_identities_apart(tmp_path):
    dataset = str(tmp_path / "d")
    records = {
        f"s{i}": dict(
            name=f"s{i}",
            url="u",
            url_sha256="d",
            remote={"size": i},
            raw="r",
            size=1,
            sha256=f"{i:064x}",
            etag=None,
            extracted="e",
            bytes=i,
            lines=1,
            code="c",
        )
        for i in range(3)
    }
    write_manifest(dataset, records)
    index = index_manifest(dataset)
    assert list(index) == ["s0", "s1", "s2"] and index["s2"].bytes == 2 and index["s2"].sha256 == f"{2:064x}"
    assert index["s1"].full == state_key("d", "c", {"size": 1}) != state_key("d", "c", {"size": 2})
    assert index["s1"].trusted == state_key("d", "c") != state_key("d", "other code")
    storage.write_text(storage.join(dataset, "shards", "manifest.jsonl"), '{"format": "something else"}\n')
    with pytest.raises(ValueError, match="is not a shard manifest"):
        index_manifest(dataset)


def test_streamed_manifest_json_is_byte_identical_to_json_dumps(tmp_path):
    obj = {"z": 1, "a": {"nested": [1, {"b": None}]}, "empty": [], "name": "x"}
    streamed = {"shards": [{"name": "s1", "size": 3}, {"name": "s2", "etag": None}], "none": [], "sources": ["u1"]}
    path = tmp_path / "m.json"
    with open(path, "w") as fh:
        write_json_streaming(fh, obj, {k: iter(v) for k, v in streamed.items()})
    assert path.read_text() == json.dumps({**obj, **streamed}, indent=2, sort_keys=True) + "\n"


# ----------------------------------------------------------------------------- rate limits


class FakeClock:
    def __init__(self):
        self.now = 1000.0
        self.lock = threading.Lock()

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


def test_pacing_spaces_requests_evenly():
    clock = FakeClock()
    throttle = HostThrottle(rate_per_s=4.0, clock=clock.time, sleep=clock.sleep)
    starts = []
    for _ in range(5):
        throttle.wait("h")
        starts.append(clock.now)
    assert [round(b - a, 6) for a, b in zip(starts, starts[1:])] == [0.25] * 4
    throttle.wait("other-host")
    assert clock.now == starts[-1]  # hosts are paced separately


def test_a_429_pauses_every_task_through_the_shared_directory(tmp_path):
    clock = FakeClock()
    shared = str(tmp_path / "journal")
    first = HostThrottle(shared_dir=shared, clock=clock.time, sleep=clock.sleep)
    second = HostThrottle(shared_dir=shared, clock=clock.time, sleep=clock.sleep)
    second.wait("hf.co")  # nothing to wait for yet
    assert clock.now == 1000.0
    first.note_log_line("hf.co", "chunk1/x.jsonl.zst: attempt 1 failed: HTTP 429 Too Many Requests; retrying in 30.0s")
    clock.now += second.refresh_s  # the other task re-reads the shared file at most every refresh_s
    second.wait("hf.co")
    assert clock.now == pytest.approx(1030.0)
    assert second.paused_s == pytest.approx(30.0 - second.refresh_s)
    first.note_log_line("hf.co", "chunk1/y.jsonl.zst: attempt 1 failed: HTTP 503 Service Unavailable; retrying in 2s")
    assert json.loads((tmp_path / "journal" / "cooldown-hf.co.json").read_text())["until"] == pytest.approx(1030.0)


@pytest.mark.faults
def test_a_429_in_the_download_reaches_the_shared_cooldown(tmp_path, monkeypatch):
    """The wording infra.fetch logs for a 429 is what HostThrottle listens for: checked end to end."""
    template = _layout(tmp_path / "site", chunks=1, shards=2)
    with FaultServer(tmp_path / "site") as server:
        row = fault_ledger.open_row("http 429 in a download task (shared cool-down)")
        row.injected_from(server.injected_count)
        server.add_faults("/train/chunk1/example_train_0.jsonl.zst", Fault(status=429, retry_after="1"))
        dataset, _, _, plan = _plan(tmp_path, server.url(template), 1, 2, tasks=1, threads=1)
        seen: list[tuple[str, float]] = []
        original = HostThrottle.cool_down
        monkeypatch.setattr(HostThrottle, "cool_down", lambda self, h, s: seen.append((h, s)) or original(self, h, s))
        journal = run_task(plan, 0, log=lambda line: None)
    assert journal.done == 2
    assert seen and seen[0][0] == "127.0.0.1" and 0 < seen[0][1] <= 1.0


def test_requests_per_second_is_shared_by_the_tasks(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr("tasks.data.fetching.MIN_SHARDS_PER_FETCH_TASK", 1)
    template = _layout(tmp_path / "site", chunks=1, shards=12)
    started: dict[str, float] = {}
    with FaultServer(tmp_path / "site") as server:
        for s in range(12):
            path = f"/train/chunk1/example_train_{s}.jsonl.zst"
            server.add_faults(path, Fault(before=lambda path=path: started.setdefault(path, time.monotonic())))
        _, _, uri, plan = _plan(tmp_path, server.url(template), 1, 12, tasks=2, requests_per_second=8.0, threads=3)
        result = LocalBackend(max_parallel=2).run(build_fetch_job(uri, plan.tasks))
    assert result.state is JobState.COMPLETED and plan.tasks == 2
    # 8 requests/s for the job = 4 per task: a task's GETs start at least 0.25 s apart, even with 3 threads.
    for index in range(plan.tasks):
        paths = [
            "/" + orjson.loads(line)["url"].split("/", 3)[3]
            for line in storage.read_bytes(plan.items_uri(index)).splitlines()
        ]
        times = sorted(started[p] for p in paths)
        gaps = [b - a for a, b in zip(times, times[1:])]
        # Paced, the 6 GETs span 1.25 s; measured at the server, a first request that reached it late (a
        # loaded machine) shortens that; unpaced, 3 threads send all 6 within a few milliseconds. The exact
        # spacing is test_pacing_spaces_requests_evenly's.
        assert len(times) == 6 and times[-1] - times[0] >= 0.8, gaps


def test_on_kubernetes_the_fetch_job_is_one_indexed_job(monkeypatch):
    """The same JobSpec through the k8s backend's manifests: an Indexed Job, a completion per array task,
    HF_TOKEN from the Secret by reference; it passes strict schema validation."""
    import kubernetes_validate

    from infra.jobs import ImageRef
    from infra.k8s.manifests import job_objects, to_dict
    from infra.k8s.options import K8sOptions
    from infra.settings import reload_settings

    monkeypatch.setenv("HF_TOKEN", "hf_secret_value_never_in_manifests")
    reload_settings()
    try:
        image = ImageRef(kind="registry", uri="registry.example.com/nemoflow:1")
        plan = "/nemo-workspace/nemoflow/datasets/sp/shards/plans/p/plan.json"
        spec = build_fetch_job(plan, 16, image, paths=["/nemo-workspace/nemoflow/datasets/sp"])
        (job,) = job_objects(spec, K8sOptions(namespace="llm"))
        manifest = to_dict(job)
    finally:
        monkeypatch.delenv("HF_TOKEN")
        reload_settings()
    kubernetes_validate.validate(manifest, "1.37.0", strict=True)
    assert manifest["kind"] == "Job"
    assert manifest["spec"]["completionMode"] == "Indexed" and manifest["spec"]["completions"] == 16
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-4:] == ["-m", "workloads.fetch_array", "--plan", plan]
    hf = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert "secretKeyRef" in hf["valueFrom"]
    assert "hf_secret_value_never_in_manifests" not in json.dumps(manifest)


def test_delete_compressed_keeps_the_record_and_a_rerun_fetches_nothing(tmp_path, monkeypatch):
    template = _layout(tmp_path / "src", chunks=1, shards=3)
    spec = str(tmp_path / "src" / template)
    dataset, _, _, plan = _plan(tmp_path, spec, 1, 3, tasks=1, delete_compressed=True)
    _run_all(plan)
    merge_journals(dataset)
    assert not list((tmp_path / "dataset" / "raw").rglob("*.zst*"))  # archive and its sidecar are gone
    assert len(read_manifest(dataset)) == 3
    assert check_shards(expand_sources(spec, chunks="1", shards="0-2"), dataset).pending == []


@pytest.mark.gcs
def test_gcs_sources_are_identified_by_one_listing_per_folder(tmp_path, gcs_bucket, monkeypatch):
    cctx = zstandard.ZstdCompressor()
    for s in range(3):
        text = json.dumps({"text": f"gcs shard {s}"}) + "\n"
        storage.write_bytes(f"{gcs_bucket}/raw/chunk1/example_train_{s}.jsonl.zst", cctx.compress(text.encode()))
    spec = f"{gcs_bucket}/raw/chunk{{chunk}}/example_train_{{shard}}.jsonl.zst"
    sources = expand_sources(spec, chunks="1", shards="0-2")
    listings = []
    from tasks.data import checking

    original = checking._folder_listing
    monkeypatch.setattr(checking, "_folder_listing", lambda folder: listings.append(folder) or original(folder))
    dataset = str(tmp_path / "dataset")
    check = check_shards(sources, dataset)
    assert listings == [f"{gcs_bucket}/raw/chunk1"]
    remote = json.loads(check.pending[0][1])
    assert remote["size"] > 0 and remote["md5"] and remote["crc32c"]
    _, plan = write_fetch_plan(check, FetchOptions(), 1)
    _run_all(plan)
    merge_journals(dataset)
    assert check_shards(sources, dataset).pending == []
    storage.write_bytes(f"{gcs_bucket}/raw/chunk1/example_train_1.jsonl.zst", cctx.compress(b'{"text": "new"}\n'))
    again = check_shards(sources, dataset)
    assert [again.names[p] for p, _ in again.pending] == ["chunk1/example_train_1.jsonl.zst"]


def test_render_plans_the_fetch_job_a_cold_run_submits(tmp_path):
    from tasks.data import fetch_task_count, planned_fetch_job

    urls = [f"/data/sp/train/chunk{c}/example_train_{s}.jsonl.zst" for c in (1, 2) for s in range(600)]
    spec = planned_fetch_job(str(tmp_path / "ds"), urls, max_tasks=16)
    assert spec.array_size == fetch_task_count(1200, 16) == 5  # 1,200 shards, tasks of at least 256
    assert spec.command[1:3] == ["-m", "workloads.fetch_array"]
    assert fetch_task_count(59166, 16) == 16 and fetch_task_count(8, 16) == 1

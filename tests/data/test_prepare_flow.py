"""The prepare-dataset flow end to end, against a real Prefect server, real files and real text.

Outputs are read back with megatron-core's own reader and dataset builder.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import json
import os
import time

import numpy as np
import pytest
import sentencepiece

from flows.prepare_dataset import PrepareConfig, prepare_dataset
from infra import storage
from tasks.data import auto_blend_text, blend_weights
from tasks.refs import TokenizerRef
from tests.support import fault_ledger
from tests.support.fault_server import Fault, FaultServer
from workloads.demo_data import write_slimpajama_layout
from workloads.shard_manifest import read_manifest
from workloads.tokenize_array import read_index_counts

pytestmark = pytest.mark.prefect


def _task_states(flow_run_id, timeout: float = 30) -> dict[str, str]:
    """Final task-run states; task states reach the server as events, so wait until none is in flight."""
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200
            )
        states = {r.name: r.state.name for r in runs}
        if not any(s in ("Pending", "Running", "Scheduled") for s in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def _run(config: PrepareConfig):
    state = prepare_dataset(config, return_state=True)
    assert state.is_completed(), state.message
    return state.result(), state.state_details.flow_run_id


@pytest.mark.slow
def test_demo_dataset_matches_megatron_reader_and_blend(prefect_server, work_dir, mixtral_tokenizer_model):
    dataset, _ = _run(PrepareConfig())

    # The blend is NeMo's data_prefix: weights proportional to .bin sizes, summing to ~1.
    assert len(dataset.prefixes) == 4 and dataset.documents == 1189
    sizes = [os.path.getsize(p + ".bin") for p in dataset.prefixes]
    assert dataset.blend[1::2] == dataset.prefixes
    assert dataset.blend[0::2] == [round(s / sum(sizes), 6) for s in sizes]
    root = storage.local_path(storage.parent(dataset.manifest_uri))
    assert json.loads(open(os.path.join(root, "blend.json")).read()) == dataset.blend
    printed = open(os.path.join(root, "data_prefix.txt")).read().strip()
    assert " " not in printed and ast.literal_eval(printed) == dataset.blend  # auto_blend.py's format

    # Tokens read back by megatron-core equal sentencepiece's encoding plus EOD.
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sp = sentencepiece.SentencePieceProcessor(model_file=str(mixtral_tokenizer_model))
    first = IndexedDataset(dataset.prefixes[0])
    first_docs = [json.loads(line)["text"] for line in open(os.path.join(root, "concat", "part-00000.jsonl"))]
    assert len(first) == len(first_docs)
    for i in (0, 1, len(first_docs) - 1):
        assert first[i].tolist() == sp.encode(first_docs[i]) + [sp.eos_id()]
    assert first[0].dtype == np.uint16  # vocab 32000 < 65500
    assert sum(read_index_counts(p)[1] for p in dataset.prefixes) == dataset.tokens


@pytest.mark.slow
def test_gpt_dataset_builds_from_the_blend(prefect_server, work_dir):
    dataset, _ = _run(PrepareConfig())
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tok:
        eod = 2
        pad = 0
        vocab_size = 32000
        unique_identifiers = {"name": "mixtral"}

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=128,
        blend=(dataset.blend[1::2], dataset.blend[0::2]),
        split="98,1,1",
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(work_dir / "index-cache"),
        mid_level_dataset_surplus=0.005,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [64, 8, 0], lambda: True, config).build()
    sample = train[0]
    assert sample["tokens"].shape[0] == 128 and len(train) >= 64 and len(valid) >= 8


@pytest.mark.slow
def test_rerun_is_cached_and_added_shards_are_processed_alone(prefect_server, work_dir, tmp_path):
    source = tmp_path / "src"
    write_slimpajama_layout(source, chunks=1, shards_per_chunk=4)
    template = str(source / "train" / "chunk{chunk}" / "example_train_{shard}.jsonl.zst")
    config = PrepareConfig(name="grow", sources=template, chunks="1", shards="0-2", shards_per_file=1)
    first, run_id = _run(config)
    assert sorted(_task_states(run_id)) == ["blend grow", "download and extract 3 shard(s)", "tokenize 3 part(s)"]
    root = config.dataset_uri()
    kept = sorted(glob.glob(f"{root}/raw/**/*.zst", recursive=True) + glob.glob(f"{root}/tokenized/*.bin"))
    mtimes = {p: os.path.getmtime(p) for p in kept}

    # Nothing changed: no download step at all, and the two task runs a re-run makes are Cached.
    again, run_id = _run(config)
    states = _task_states(run_id)
    assert again.blend == first.blend
    assert states == {"tokenize 3 part(s)": "Cached", "blend grow": "Cached"}, states

    # One shard added: one shard downloaded and extracted, one part tokenized; the rest untouched.
    grown, run_id = _run(config.model_copy(update={"shards": "0-3"}))
    assert len(grown.prefixes) == 4
    states = _task_states(run_id)
    assert states["download and extract 1 shard(s)"] == "Completed", states
    assert all(os.path.getmtime(p) == mtime for p, mtime in mtimes.items()), "a finished shard or part was redone"
    records = read_manifest(root)
    assert sorted(records) == [f"chunk1/example_train_{i}.jsonl.zst" for i in range(4)]


@pytest.mark.faults
def test_https_source_with_faults_to_gcs_output(prefect_server, work_dir, tmp_path, gcs_bucket):
    root = tmp_path / "site"
    write_slimpajama_layout(root, chunks=1, shards_per_chunk=2)
    with FaultServer(root) as server:
        row = fault_ledger.open_row("http 429/503/truncation: prepare flow to gs://")
        row.injected_from(server.injected_count)
        server.add_faults(
            "/train/chunk1/example_train_0.jsonl.zst", Fault(status=429, retry_after="0"), Fault(status=503)
        )
        server.add_faults("/train/chunk1/example_train_1.jsonl.zst", Fault(truncate_at=500))
        config = PrepareConfig(
            name="remote",
            sources=server.url("/train/chunk{chunk}/example_train_{shard}.jsonl.zst"),
            chunks="1",
            shards="0-1",
            output=f"{gcs_bucket}/datasets/remote",
        )
        dataset, _ = _run(config)
    assert dataset.prefixes[0].startswith(f"{gcs_bucket}/datasets/remote/tokenized/")
    for prefix in dataset.prefixes:
        assert storage.exists(prefix + ".bin") and storage.exists(prefix + ".idx")
    manifest = storage.read_json(dataset.manifest_uri)
    assert [s["name"] for s in manifest["shards"]] == [
        "chunk1/example_train_0.jsonl.zst",
        "chunk1/example_train_1.jsonl.zst",
    ]
    expected_docs = sum(1 for _ in open_jsonl_zst_lines(root))
    assert dataset.documents == expected_docs


def open_jsonl_zst_lines(root):
    from workloads.demo_data import read_jsonl_zst

    for path in sorted(root.rglob("*.jsonl.zst")):
        yield from read_jsonl_zst(path)


@pytest.mark.faults
def test_corrupt_shard_is_fetched_again_once_then_fails_naming_it(prefect_server, work_dir, tmp_path):
    """A complete download that does not extract is fetched again exactly once: a fresh copy that
    extracts is used; one that is still corrupt fails the shard, naming it."""
    import hashlib

    root = tmp_path / "site"
    files = write_slimpajama_layout(root, chunks=1, shards_per_chunk=2)
    path = "/train/chunk1/example_train_0.jsonl.zst"
    good = files[0].read_bytes()
    corrupt = good[: len(good) // 2]  # a truncated archive, served whole (its length is the full response)
    assert files[0] == root / path.lstrip("/")
    row = fault_ledger.open_row("corrupted shard (once, then at the source)")
    corrupt_sha = hashlib.sha256(corrupt).hexdigest()

    def served_corrupt(server) -> int:
        return sum(1 for r in server.requests_for(path) if r.method == "GET" and r.sha256 == corrupt_sha)

    # 1. corrupt on the first download only: the second (the re-fetch) is good and the flow completes
    files[0].write_bytes(corrupt)
    with FaultServer(root) as server:
        server.add_faults(path, Fault(), Fault(before=lambda: files[0].write_bytes(good)))
        config = PrepareConfig(
            name="refetched",
            sources=server.url("/train/chunk{chunk}/example_train_{shard}.jsonl.zst"),
            chunks="1",
            shards="0-1",
        )
        dataset, flow_run_id = _run(config)
        row.watch_runs([flow_run_id])
        row.injected += served_corrupt(server)
        assert server.count(path, "GET") == 2  # the first download and exactly one re-fetch
        assert server.count("/train/chunk1/example_train_1.jsonl.zst", "GET") == 1
    expected_docs = sum(1 for _ in open_jsonl_zst_lines(root))
    row.compare({"documents": expected_docs}, {"documents": dataset.documents})  # rows of the source, tokenized
    assert dataset.documents == expected_docs  # the re-fetched shard's documents are all there

    # 2. corrupt at the source itself: the re-fetch is corrupt too, and the shard fails naming itself
    files[0].write_bytes(corrupt)
    with FaultServer(root) as server:
        config = PrepareConfig(name="corrupt", sources=server.url(path))
        state = prepare_dataset(config, return_state=True)
        row.watch_runs([state.state_details.flow_run_id])
        row.injected += served_corrupt(server)
        assert state.is_failed()
        with pytest.raises(Exception, match=r"shard \S*example_train_0\S* is corrupt even after a fresh download"):
            state.result()
        gets = server.count(path, "GET")
    assert gets == 2, f"{gets} downloads: expected the first and one re-fetch"


@pytest.mark.slow
def test_malformed_line_names_file_and_line_and_finished_parts_survive(prefect_server, work_dir, tmp_path):
    good = tmp_path / "good.jsonl"
    bad = tmp_path / "bad.jsonl"
    good.write_text("".join(json.dumps({"text": f"verse {i}"}) + "\n" for i in range(20)))
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    config = PrepareConfig(name="mixed", sources=[str(good), str(bad)], shards_per_file=1)
    state = prepare_dataset(config, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"bad\.jsonl:2: malformed JSON"):
        state.result()
    # Fix the input and run again: the part made from good.jsonl is not tokenized twice.
    tokenized = storage.join(config.dataset_uri(), "tokenized")
    done = [p for p in storage.listdir(tokenized) if p.endswith(".bin")]
    assert len(done) == 1
    mtime = os.path.getmtime(done[0])
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "mended"}) + "\n")
    dataset, _ = _run(config)
    assert os.path.getmtime(done[0]) == mtime and len(dataset.prefixes) == 2


def test_skip_malformed_counts_lines(prefect_server, work_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n" + json.dumps({"text": "also fine"}) + "\n")
    dataset, _ = _run(PrepareConfig(name="skip", sources=str(bad), skip_malformed=True))
    assert dataset.documents == 2
    manifest = storage.read_json(dataset.manifest_uri)
    assert manifest["parts"][0]["skipped_malformed"] == 1


def test_invalid_configs_fail_before_any_work(work_dir):
    with pytest.raises(ValueError, match="backend"):
        PrepareConfig(backend="slurm")  # where it runs is the flow's executor, not a config field
    with pytest.raises(ValueError, match="without sources"):
        PrepareConfig(chunks="1-2")
    with pytest.raises(Exception, match="tokenizer"):
        PrepareConfig(tokenizer=TokenizerRef(type="NoSuchTokenizer", model="x")).resolved()


def test_blend_weights_follow_auto_blend():
    assert blend_weights([("a", 300), ("b", 100)]) == [0.75, "a", 0.25, "b"]
    assert blend_weights([("a", 300), ("b", 100)], alpha=0.5)[0] == round(300**0.5 / (300**0.5 + 100**0.5), 6)
    assert auto_blend_text([0.75, "a", 0.25, "b"]) == "[0.75,'a',0.25,'b']"
    with pytest.raises(ValueError, match="nothing to blend"):
        blend_weights([])


# ----------------------------------------------------------------------------- at scale: batches, failures, kills


@pytest.mark.slow
def test_outputs_equal_the_primitives_applied_in_order(prefect_server, work_dir, tmp_path, mixtral_tokenizer_model):
    """Parts hold the shards in source order (chunk, then shard), N per part; their bytes are what
    extract + concatenate + tokenize give when run by hand: the batching changes no output byte."""
    import zstandard

    from workloads.tokenize import TokenizerConfig, tokenize_file

    files = write_slimpajama_layout(tmp_path / "src", chunks=2, shards_per_chunk=6)
    template = str(tmp_path / "src" / "train" / "chunk{chunk}" / "example_train_{shard}.jsonl.zst")
    dataset, _ = _run(PrepareConfig(name="order", sources=template, chunks="1-2", shards="0-5", shards_per_file=5))
    ordered = sorted(
        files, key=lambda p: (int(p.parent.name.removeprefix("chunk")), int(p.stem.split("_")[-1].split(".")[0]))
    )
    assert len(dataset.prefixes) == 3
    tokenizer = TokenizerConfig(type="GPTSentencePieceTokenizer", model=str(mixtral_tokenizer_model))
    for i, prefix in enumerate(dataset.prefixes):
        text = b""
        for path in ordered[5 * i : 5 * i + 5]:
            data = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
            text += data if data.endswith(b"\n") else data + b"\n"
        reference = tmp_path / f"ref-{i}.jsonl"
        reference.write_bytes(text)
        assert (
            open(storage.join(storage.parent(dataset.manifest_uri), "concat", f"part-{i:05d}.jsonl"), "rb").read()
            == text
        )
        tokenize_file(str(reference), str(tmp_path / f"ref-{i}"), tokenizer=tokenizer, workers=1)
        for ext in (".bin", ".idx"):
            assert open(prefix + ext, "rb").read() == open(tmp_path / f"ref-{i}_text_document{ext}", "rb").read()


def _artifacts(flow_run_id, key: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])
            )
        )


@pytest.mark.faults
def test_failed_shards_are_shown_and_the_others_are_kept(prefect_server, work_dir, tmp_path):
    root = tmp_path / "site"
    write_slimpajama_layout(root, chunks=1, shards_per_chunk=4)
    missing = "/train/chunk1/example_train_2.jsonl.zst"
    with FaultServer(root, always={missing: Fault(status=404)}) as server:
        row = fault_ledger.open_row("http 404 for one shard: prepare flow")
        config = PrepareConfig(
            name="holes",
            sources=server.url("/train/chunk{chunk}/example_train_{shard}.jsonl.zst"),
            chunks="1",
            shards="0-3",
        )
        state = prepare_dataset(config, return_state=True)
        assert state.is_failed()
        with pytest.raises(Exception, match=r"1 of 4 shard\(s\) failed: chunk1/example_train_2.jsonl.zst: not found"):
            state.result()
        run_id = state.state_details.flow_run_id
        table = _artifacts(run_id, "failed-shards")
        assert len(table) == 1 and "example_train_2" in str(table[0].data) and "not found" in str(table[0].data)
        progress = _artifacts(run_id, "prepare-dataset-progress")
        assert progress and 0 < float(progress[0].data) < 100
        assert sorted(read_manifest(config.dataset_uri())) == [f"chunk1/example_train_{i}.jsonl.zst" for i in (0, 1, 3)]
        assert server.count(missing) == 1  # a 404 is final, and the step is not retried for a shard's failure

        # The file appears: the next run downloads it alone.
        row.injected += server.injected_count(missing)  # the 404s served, before the log is cleared
        server.always.clear()
        server.clear_log()
        dataset, run_id = _run(config)
    assert server.count(method="GET") == 1 and server.count(missing) == 1
    assert len(dataset.prefixes) == 1 and dataset.documents > 0
    # the final update of the progress artifact may land in the API just after the run returns (seen at 80 on a
    # loaded machine): read it until it is 100 or 30 s have passed
    deadline = time.monotonic() + 30
    while float(_artifacts(run_id, "prepare-dataset-progress")[0].data) != 100 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert float(_artifacts(run_id, "prepare-dataset-progress")[0].data) == 100


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@pytest.mark.slow
@pytest.mark.faults
def test_a_killed_run_resumes_without_redoing_finished_shards(prefect_server, work_dir, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    root = tmp_path / "site"
    write_slimpajama_layout(root, chunks=1, shards_per_chunk=40)
    template = "/train/chunk{chunk}/example_train_{shard}.jsonl.zst"
    slow = {f"/train/chunk1/example_train_{s}.jsonl.zst": Fault(delay=0.4) for s in range(40)}
    with FaultServer(root, always=slow) as server:
        row = fault_ledger.open_row("prepare flow and its array tasks SIGKILLed mid-download")
        args = ["--sources", server.url(template), "--chunks", "1", "--shards", "0-39", "--shards-per-file", "10"]
        env = dict(os.environ, PREFECT_API_URL=prefect_server, NEMOFLOW_WORK_DIR=str(work_dir))
        flow = subprocess.Popen(
            [sys.executable, "-m", "nemoflow.cli", "prepare", "--name", "killed", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        extracted = work_dir / "datasets" / "killed" / "extracted" / "chunk1"
        deadline = time.monotonic() + 120
        while len(list(extracted.glob("*.shard.json"))) < 8:
            assert flow.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
        for pid in [*_descendants(flow.pid), flow.pid]:  # a crash: the flow process and its array tasks at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        row.injected += flow.wait() == -signal.SIGKILL  # the flow process died of the kill
        time.sleep(0.5)
        done_before = {p.name.removesuffix(".shard.json") + ".zst" for p in extracted.glob("*.shard.json")}
        assert 8 <= len(done_before) < 40
        server.clear_log()

        config = PrepareConfig(
            name="killed", sources=server.url(template), chunks="1", shards="0-39", shards_per_file=10
        )
        resumed, _ = _run(config)
        fetched_again = {r.path.rsplit("/", 1)[1] for r in server.requests if r.method == "GET"}
        assert not fetched_again & done_before, "a shard finished before the kill was downloaded again"
        assert len(fetched_again) == 40 - len(done_before)
        clean, _ = _run(config.model_copy(update={"name": "clean"}))
    for a, b in zip(resumed.prefixes, clean.prefixes):
        for ext in (".bin", ".idx"):
            assert open(a + ext, "rb").read() == open(b + ext, "rb").read()

"""A whole end-to-end run with ``NEMOFLOW_WORK_DIR=gs://bucket/prefix`` (the GCS emulator behind gcsfs),
on the local backend and on the local Slurm: the raw shards, the tokenized dataset, the training run
(checkpoints, metrics), the validation report, the registry, the run summary and Prefect's task results
all land in the bucket; training, validation and the server read the dataset and the checkpoint from
it (staged to the node's disk by workloads/staging.py). Jobs reach the emulator at
NEMOFLOW_GCS_ENDPOINT, as jobs on a cluster reach GCS.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import free_port, get_json
from tests.slurm.conftest import slurm_cluster  # noqa: F401 - the fixture (skips, or fails under CI=true)
from tests.support.tiny import TINY_TRAIN

pytestmark = pytest.mark.gcs

SERVE_KEY = "sk-gcs-e2e-SENTINEL-1618"


@pytest.fixture
def gcs_work_dir(gcs_bucket, prefect_server, tmp_path, monkeypatch):
    """NEMOFLOW_WORK_DIR in the bucket; NEMOFLOW_HOME (the stage cache, local state) in the test's directory."""
    from infra.settings import reload_settings

    work_dir = f"{gcs_bucket}/nemoflow"
    monkeypatch.setenv("NEMOFLOW_WORK_DIR", work_dir)
    monkeypatch.delenv("NEMOFLOW_RESULT_STORAGE", raising=False)  # default: <work_dir>/prefect-results
    monkeypatch.setenv("NEMOFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NEMOFLOW_SERVE_API_KEY", SERVE_KEY)
    reload_settings()
    yield work_dir
    monkeypatch.undo()
    reload_settings()


@pytest.mark.parametrize("size", [10, 300_000])
def test_an_uploaded_file_keeps_its_last_byte(gcs_bucket, tmp_path, size):
    """storage.put_file once went through gcsfs's one-request upload, which the emulator cuts a trailing
    carriage return from: a demo shard ending in b"\\r" arrived one byte short (a "truncated" zstd frame)."""
    from infra import storage

    local = tmp_path / "data.bin"
    local.write_bytes(os.urandom(size - 1) + b"\r")
    storage.put_file(str(local), f"{gcs_bucket}/x/data.bin")
    assert storage.read_bytes(f"{gcs_bucket}/x/data.bin") == local.read_bytes()


def _upload_demo_sources(bucket: str, tmp_path) -> str:
    """The demo corpus (SlimPajama layout, .jsonl.zst shards) in the bucket; returns its URL template."""
    from flows.prepare_dataset import DEMO_TEMPLATE
    from infra import storage
    from workloads.demo_data import write_slimpajama_layout

    local = tmp_path / "source"
    for path in write_slimpajama_layout(local, chunks=2, shards_per_chunk=4):
        storage.put_file(str(path), storage.join(bucket, "raw", str(path.relative_to(local))))
    return storage.join(bucket, "raw", DEMO_TEMPLATE)


def _run_and_check(executor: dict, image: dict, work_dir: str, bucket: str, tmp_path, train: dict) -> dict:
    from flows.end_to_end import EndToEndConfig, end_to_end
    from infra import storage
    from infra.executors import get_backend
    from infra.registry import ModelRegistry

    port = free_port()
    model = f"nemoflow-gcs-{executor['kind']}"
    config = EndToEndConfig(
        executor=executor,
        image=image,
        data={
            "name": "kjv",
            "sources": _upload_demo_sources(bucket, tmp_path),
            "chunks": "1-2",
            "shards": "0-3",
            "shards_per_file": 2,
            "workers": 1,
        },
        train=train,
        serve={"port": port, "model_name": model},
        validation_threshold=9.5,
    )
    try:
        summary = end_to_end(config)
        assert summary["answer"].strip(), summary

        # every artifact is in the bucket
        dataset = f"{work_dir}/datasets/kjv"
        assert summary["dataset"] == f"{dataset}/manifest.json"
        parts = storage.glob(f"{dataset}/tokenized/part-*_text_document.bin")
        assert len(parts) == 4 and all(storage.exists(p.removesuffix(".bin") + ".idx") for p in parts), parts
        assert all(prefix.startswith(f"{dataset}/tokenized/") for prefix in summary["data_prefix"][1::2])
        run_dir = storage.parent(storage.parent(storage.parent(storage.parent(summary["checkpoint"]))))
        assert run_dir.startswith(f"{work_dir}/runs/"), summary["checkpoint"]
        manifest = storage.read_json(storage.join(summary["checkpoint"], "MANIFEST.json"))
        assert {"config.json", "tokenizer.model", "meta.json"} <= set(manifest["files"])
        meta = storage.read_json(storage.join(summary["checkpoint"], "meta.json"))
        assert meta["data_prefix"] == summary["data_prefix"], "meta.json records the gs:// blend it trained on"
        metrics = storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines()
        assert json.loads(metrics[-1])["step"] == train["max_steps"], metrics[-3:]
        reports = storage.glob(f"{run_dir}/validation/*.json")
        assert len(reports) == 1 and storage.read_json(reports[0])["checkpoint"] == summary["checkpoint"]
        assert storage.read_json(reports[0])["passed"] is True
        promoted = ModelRegistry(f"{work_dir}/registry").read().promoted_model()
        assert promoted is not None and promoted.checkpoint == summary["checkpoint"]
        assert storage.exists(f"{work_dir}/flow-runs/{summary['flow_run_id']}.json")
        assert storage.glob(f"{work_dir}/prefect-results/*"), "Prefect's task results persist in the bucket"

        # the server serves the gs:// checkpoint (a local copy by its manifest) and wants its key
        status, models = get_json(f"{summary['endpoint']}/v1/models", SERVE_KEY)
        assert status == 200 and models["data"][0]["id"] == model
        assert get_json(f"{summary['endpoint']}/v1/models", None)[0] == 401
        return summary
    finally:
        get_backend(executor).stop_service(model)


@pytest.mark.slow
@pytest.mark.prefect
def test_end_to_end_with_a_gcs_work_dir_on_the_local_backend(gcs_work_dir, gcs_bucket, tmp_path):
    summary = _run_and_check({"kind": "local"}, {}, gcs_work_dir, gcs_bucket, tmp_path, TINY_TRAIN)
    assert summary["endpoint"].startswith("http://127.0.0.1:")
    # the jobs read the dataset from node-local copies (this machine's stage cache), one per file
    staged = sorted(p.name for p in (tmp_path / "home" / "cache" / "stage").rglob("part-*_text_document.bin"))
    assert staged == [f"part-0000{i}_text_document.bin" for i in range(4)], staged


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.slurm
def test_end_to_end_with_a_gcs_work_dir_on_slurm(gcs_work_dir, gcs_bucket, tmp_path, slurm_cluster):  # noqa: F811 - fixture
    summary = _run_and_check(
        {"kind": "slurm", "partition": "cpu"},
        {"source": "python-env"},
        gcs_work_dir,
        gcs_bucket,
        tmp_path,
        {**TINY_TRAIN, "cpus_per_task": 1},
    )
    # the stages ran as Slurm jobs of this flow run (their --comment carries its id)
    import subprocess

    jobs = subprocess.run(["scontrol", "-o", "show", "job"], capture_output=True, text=True).stdout.splitlines()
    ours = [line for line in jobs if f"flow-run={summary['flow_run_id']}" in line]
    names = {n.split("=", 1)[1] for line in ours for n in line.split() if n.startswith("JobName=")}
    assert {"nemoflow-tokenize"} <= names and any(n.startswith("train-") for n in names), names
    assert any(n.startswith("validate-") for n in names), names

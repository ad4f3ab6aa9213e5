"""What another process wrote to gs:// is seen by the next listing here (gcsfs caches listings per process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from infra import storage
from tests.conftest import REPO

pytestmark = pytest.mark.gcs


def _write_elsewhere(uri: str) -> None:
    """Write ``uri`` from another process, as a job of an array does for the flow."""
    code = "import sys; from infra import storage; storage.write_bytes(sys.argv[1], b'{}')"
    subprocess.run([sys.executable, "-c", code, uri], cwd=REPO, check=True)


def test_a_listing_sees_files_another_process_wrote_since_the_last_one(gcs_bucket):
    journal = f"{gcs_bucket}/datasets/remote/shards/journal"
    storage.write_bytes(f"{journal}/a.jsonl", b"{}")
    assert [storage.basename(u) for u in storage.listdir(journal)] == ["a.jsonl"]
    _write_elsewhere(f"{journal}/b.jsonl")
    assert [storage.basename(u) for u in storage.listdir(journal)] == ["a.jsonl", "b.jsonl"]


def test_a_folder_another_process_created_is_listed(gcs_bucket):
    dataset = f"{gcs_bucket}/datasets/remote"
    storage.write_bytes(f"{dataset}/manifest.jsonl", b"{}")
    assert storage.listdir(f"{dataset}/shards/journal") == []  # not there yet
    assert len(storage.listdir(dataset)) == 1
    _write_elsewhere(f"{dataset}/shards/journal/a.jsonl")
    assert [storage.basename(u) for u in storage.listdir(f"{dataset}/shards/journal")] == ["a.jsonl"]

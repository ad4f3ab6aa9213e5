"""Download + extract and tokenize as Slurm job arrays on the real local cluster (nemoflow local-slurm).

The flow runs here; each step's job is ONE sbatch array whose tasks split the shards (or parts),
exactly what a cluster's login node would submit. The outputs match a local run byte for byte.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from flows.prepare_dataset import PrepareConfig, prepare_dataset
from infra.executors import SlurmExecutor
from tests.slurm.conftest import slurm_cluster  # noqa: F401 - the fixture (skips, or fails under CI=true)
from workloads.demo_data import write_slimpajama_layout

pytestmark = [pytest.mark.slurm, pytest.mark.prefect, pytest.mark.slow]


def test_fetch_and_tokenize_run_as_slurm_job_arrays(slurm_cluster, prefect_server, work_dir, tmp_path, monkeypatch):  # noqa: F811 - fixture
    monkeypatch.setattr("tasks.data.fetching.MIN_SHARDS_PER_FETCH_TASK", 2)  # 6 shards over 3 array tasks
    write_slimpajama_layout(tmp_path / "src", chunks=1, shards_per_chunk=6)
    template = str(tmp_path / "src" / "train" / "chunk{chunk}" / "example_train_{shard}.jsonl.zst")
    config = PrepareConfig(
        name="on-slurm", sources=template, chunks="1", shards="0-5", shards_per_file=3, fetch_tasks=3
    )
    logs = tmp_path / "slurm-logs"
    executor = SlurmExecutor(partition="cpu", log_dir=str(logs), time="00:10:00")
    state = prepare_dataset(config, executor, return_state=True)
    assert state.is_completed(), state.message
    on_slurm = state.result()

    job_ids = sorted({m.group(1) for p in logs.rglob("*.out") if (m := re.search(r"-(\d+)(?:_\d+)?\.out$", p.name))})
    sacct = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-o", "JobID,JobName,State", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    tasks: dict[str, list[str]] = {}
    for line in sacct.splitlines():
        job_id, name, job_state = line.split("|")
        assert job_state == "COMPLETED", line
        tasks.setdefault(name, []).append(job_id)
    assert sorted(tasks) == ["nemoflow-fetch", "nemoflow-tokenize"], sacct
    assert len(tasks["nemoflow-fetch"]) == 3 and all("_" in t for t in tasks["nemoflow-fetch"]), sacct
    assert len(tasks["nemoflow-tokenize"]) == 2, sacct

    local = prepare_dataset(config.model_copy(update={"name": "local"}))
    for a, b in zip(on_slurm.prefixes, local.prefixes):
        for ext in (".bin", ".idx"):
            assert open(a + ext, "rb").read() == open(b + ext, "rb").read()

"""end-to-end/slurm on the real local Slurm: the flow run is an sbatch job (the `slurm` worker), and
every stage runs as a Slurm job of its own (tokenization as a job array, training, validation,
the inference server). The training job must show COMPLETED in sacct.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from tests.conftest import REPO, VENV_BIN, free_port, prefect_worker_env, prefect_worker_process
from tests.slurm.conftest import slurm_cluster  # noqa: F401 - the fixture (skips, or fails under CI=true)
from tests.support.tiny import TINY_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.prefect]


SERVE_KEY = "sk-slurm-e2e-SENTINEL-4711"


@pytest.fixture
def slurm_pool(prefect_server, work_dir, tmp_path, slurm_cluster):  # noqa: F811 - fixture
    from devtools.prefect_local import ensure_pools

    env = prefect_worker_env(
        prefect_server,
        work_dir,
        tmp_path / "home",
        PREFECT_WORKER_QUERY_SECONDS="1",
        # a server on a cluster node answers only with the key (it reaches the job by name, via sbatch's env)
        NEMOFLOW_SERVE_API_KEY=SERVE_KEY,
    )
    ensure_pools(prefect_server)
    subprocess.run(
        [str(VENV_BIN / "prefect"), "--no-prompt", "deploy", "--name", "end-to-end/slurm"],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    worker = prefect_worker_process("gpu-cluster", "slurm", env, tmp_path / "worker.log")
    yield env
    from infra.executors import get_backend

    get_backend("slurm").stop_service("nemoflow-slurm-e2e")
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        if worker.poll() is None:
            os.killpg(worker.pid, sig)
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass


def test_end_to_end_on_slurm_every_stage_a_job(slurm_pool, work_dir, tmp_path):
    port = free_port()
    config = {
        "executor": {"kind": "slurm", "partition": "cpu"},
        "image": {"source": "python-env"},
        "data": {"workers": 1},
        "train": {**TINY_TRAIN, "cpus_per_task": 1},
        "serve": {"port": port, "model_name": "nemoflow-slurm-e2e"},
        "validation_threshold": 9.5,
    }
    proc = subprocess.run(
        [
            str(VENV_BIN / "prefect"),
            "deployment",
            "run",
            "end-to-end/slurm",
            "--params",
            json.dumps({"config": config}),
            "--watch",
            "--watch-timeout",
            "900",
        ],
        cwd=REPO,
        env=slurm_pool,
        capture_output=True,
        text=True,
        timeout=1000,
    )
    worker_log = (tmp_path / "worker.log").read_text()[-3000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:] + worker_log
    import re

    run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", proc.stdout).group(1)
    summary = json.loads((work_dir / "flow-runs" / f"{run_id}.json").read_text())
    assert summary["answer"].strip() and summary["endpoint"].endswith(f":{port}")

    # The stages were Slurm jobs of THIS flow run (their --comment carries its id), and training COMPLETED.
    from infra.slurm.parsers import parse_scontrol_record

    records = [
        parse_scontrol_record(line)
        for line in subprocess.run(
            ["scontrol", "-o", "show", "job"], capture_output=True, text=True
        ).stdout.splitlines()
        if line.strip()
    ]
    ours = [r for r in records if f"flow-run={run_id}" in r.get("Comment", "")]
    names = {r["JobName"]: r["JobState"] for r in ours}
    assert any(n.startswith("nemoflow-tokenize") for n in names), names
    training = [state for name, state in names.items() if name.startswith("train-")]
    assert training == ["COMPLETED"], names
    # The endpoint answered the smoke test with the key; without it, it refuses.
    import httpx

    denied = httpx.post(summary["endpoint"] + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert denied.status_code == 401
    assert SERVE_KEY not in proc.stdout + worker_log

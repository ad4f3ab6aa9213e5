"""end-to-end/slurm on the real local Slurm: the flow run is an sbatch job (the `slurm` worker), and
every stage runs as a Slurm job of its own (tokenization as a job array, training, validation,
the inference server). The training job must show COMPLETED in sacct.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO, VENV_BIN, free_port
from tests.support.tiny import TINY_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.prefect]


@pytest.fixture
def slurm_pool(prefect_server, work_dir, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root")
    from devtools.slurm_cluster import LocalSlurm

    try:
        LocalSlurm().up()
    except Exception as exc:  # noqa: BLE001 - the reason is reported
        pytest.skip(f"local Slurm could not start: {exc}")
    from devtools.prefect_local import ensure_pools

    env = dict(
        os.environ,
        PREFECT_API_URL=prefect_server,
        NEMOFLOW_WORK_DIR=str(work_dir),
        NEMOFLOW_HOME=str(tmp_path / "home"),
        PREFECT_WORKER_QUERY_SECONDS="1",
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
    worker = subprocess.Popen(
        [str(VENV_BIN / "prefect"), "worker", "start", "--pool", "gpu-cluster", "--type", "slurm"],
        cwd=REPO,
        env=env,
        stdout=(tmp_path / "worker.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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
        "backend": "slurm",
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

    # The stages were Slurm jobs, and the training job ended COMPLETED in accounting.
    deadline = time.monotonic() + 60
    while True:
        rows = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-S", "now-1hours", "-o", "JobName,State"], capture_output=True, text=True
        ).stdout.splitlines()
        states = [r.split("|") for r in rows if "|" in r]
        training = [s for name, s in states if name.startswith("train-")]
        if training and training[-1] == "COMPLETED" or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert training and training[-1] == "COMPLETED", states
    assert any(name.startswith("nemoflow-tokenize") for name, _ in states), states

"""The `slurm` Prefect worker end to end: a real Prefect server, a real worker process, the real local Slurm.

A flow deployed to a `--type slurm` work pool runs inside a Slurm job and
completes; a cancel from the API scancels its job; a job that dies is reported
Crashed with Slurm's state and exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import jobs_under

pytestmark = [pytest.mark.slurm, pytest.mark.prefect]
REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "gpu-cluster-test"


def test_base_job_template_file_matches_the_worker():
    from infra.slurm_worker import default_base_job_template

    shipped = json.loads((REPO / "deployments/slurm/base-job-template.json").read_text())
    assert shipped == default_base_job_template()
    variables = shipped["variables"]["properties"]
    for name in (
        "partition",
        "time",
        "nodes",
        "cpus_per_task",
        "mem",
        "account",
        "qos",
        "gpus_per_node",
        "extra_sbatch_flags",
        "setup_lines",
        "working_dir",
    ):
        assert name in variables, name
    assert shipped["job_configuration"]["env"] == "{{ env }}"


def test_worker_type_is_discoverable_through_the_entry_point():
    code = (
        "from prefect.plugins import load_prefect_collections; load_prefect_collections();"
        "from prefect.workers.base import BaseWorker; from prefect.utilities.dispatch import lookup_type;"
        "print(lookup_type(BaseWorker, 'slurm').__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "infra.slurm_worker"


@pytest.fixture(scope="module")
def slurm_worker(prefect_server, slurm_cluster, tmp_path_factory):
    log = tmp_path_factory.mktemp("slurm-worker") / "worker.log"
    env = dict(os.environ, PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5")
    subprocess.run(
        [
            PREFECT,
            "--no-prompt",
            "work-pool",
            "create",
            POOL,
            "--type",
            "slurm",
            "--overwrite",
            "--base-job-template",
            str(REPO / "deployments/slurm/base-job-template.json"),
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    proc = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", POOL, "--type", "slurm"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    yield log
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def deploy(entry: str, tmp_path: Path) -> str:
    from prefect import flow

    loaded = flow.from_source(source=str(REPO), entrypoint=f"tests/slurm/worker_flows.py:{entry}")
    loaded.deploy(
        name="t",
        work_pool_name=POOL,
        job_variables={"log_dir": str(tmp_path / "logs"), "poll_interval_s": 1.0},
        print_next_steps=False,
    )
    return f"{loaded.name}/t"


def wait_final(flow_run_id, timeout: float, log: Path):
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state and run.state.is_final():
                return run
            time.sleep(1)
    pytest.fail(f"flow run not final after {timeout}s; worker log:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_flow_run_executes_inside_a_slurm_job(slurm_worker, tmp_path, slurm):
    from prefect.deployments import run_deployment

    marker = tmp_path / "marker.txt"
    run = run_deployment(deploy("inside_slurm", tmp_path), parameters={"marker": str(marker)}, timeout=0)
    final = wait_final(run.id, 240, slurm_worker)
    assert final.state.is_completed(), final.state
    job_id, flow_run_id = marker.read_text().split("\n")
    assert job_id and job_id == final.infrastructure_pid
    assert flow_run_id == str(run.id)
    # The engine reports the flow run done just before its process (the job) exits.
    deadline = time.monotonic() + 60
    while jobs_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    state = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state


@pytest.mark.slow
def test_cancel_from_the_api_scancels_the_job(slurm_worker, tmp_path, slurm):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    marker = tmp_path / "running.txt"
    run = run_deployment(deploy("sleeps", tmp_path), parameters={"marker": str(marker)}, timeout=0)
    deadline = time.monotonic() + 180
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marker.exists(), slurm_worker.read_text()[-3000:]
    job_id = marker.read_text()
    assert jobs_under(tmp_path) == [job_id]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)  # what the UI's Cancel does
    final = wait_final(run.id, 90, slurm_worker)
    assert final.state.is_cancelled(), final.state
    with get_client(sync_client=True) as client:
        history = [s.type.value for s in client.read_flow_run_states(run.id)]
    assert "CRASHED" not in history, history  # the engine in the job never saw a SIGTERM
    deadline = time.monotonic() + 30
    while jobs_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert jobs_under(tmp_path) == []
    state = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    # The engine got SIGKILL, never scancel's SIGTERM (which would make it report Crashed): Slurm
    # records the flow-run job as ended by signal 9 (FAILED 0:9), the run itself is Cancelled.
    assert "JobState=FAILED" in state and "ExitCode=0:9" in state, state


@pytest.mark.slow
def test_job_that_dies_is_reported_crashed_with_slurm_reason(slurm_worker, tmp_path, slurm):
    from prefect.deployments import run_deployment

    run = run_deployment(deploy("dies", tmp_path), parameters={"code": 7}, timeout=0)
    final = wait_final(run.id, 240, slurm_worker)
    assert final.state.is_crashed(), final.state
    assert "ended FAILED" in final.state.message and "exit code 7" in final.state.message


def test_kill_infrastructure_scancels_a_pending_or_running_job(slurm, tmp_path):
    """What the worker does for a cancel that arrives before the flow run started."""
    import anyio
    from prefect.exceptions import InfrastructureNotFound

    from infra.backends.slurm import SlurmBackend
    from infra.jobs import JobSpec
    from infra.slurm_worker import SlurmJobConfiguration, SlurmWorker

    job_id, _ = SlurmBackend(log_dir=str(tmp_path / "logs")).submit(
        JobSpec(name="pending-flow-run", command=["sleep", "300"])
    )
    assert jobs_under(tmp_path) == [job_id]
    worker = SlurmWorker(work_pool_name="unused")
    config = SlurmJobConfiguration(log_dir=str(tmp_path / "logs"))
    anyio.run(worker.kill_infrastructure, job_id, config, 10)
    assert jobs_under(tmp_path) == []
    with pytest.raises(InfrastructureNotFound, match=f"Slurm job {job_id} is not pending or running"):
        anyio.run(worker.kill_infrastructure, job_id, config, 10)

"""Faults on the real local Slurm: a cancelled flow run's stage jobs, scancel of a stage job, a node going DOWN.

The cluster is shared by everything on this machine: the node is set DOWN only while no other user's job
runs on it, for about a second, and set back (RESUME) in a ``finally``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra.jobs import JobSpec, JobState
from infra.slurm.commands import SlurmCLI
from tests.conftest import wait_for
from tests.slurm.conftest import backend, jobs_under, slurm, slurm_cluster  # noqa: F401 - fixtures
from tests.support import fault_ledger

pytestmark = [pytest.mark.faults, pytest.mark.slurm]
PY = sys.executable


def _wait(check, timeout: float, what: str):
    return wait_for(check, timeout, what, interval=0.3)


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "")


def _slurm_run(plane, tmp_path, fault: str):
    """A run of tests/faults/flows.py:submits_a_slurm_job through the slurm worker, and the fault-ledger row of
    ``fault`` watching it; (row, run, stage job id)."""
    from devtools import prefect_local as pl
    from infra.slurm_worker import labelled_jobs

    row = fault_ledger.open_row(fault)
    pool = "faults-slurm"
    with plane.scoped():
        pl.ensure_work_pool(pool, "slurm", plane.api, "deployments/slurm/base-job-template.json")
    plane.worker(pool, "slurm")
    deployment = plane.deploy(
        "tests/faults/flows.py:submits_a_slurm_job",
        name="slurm",
        concurrency_limit=None,
        pool=pool,
        job_variables={"log_dir": str(tmp_path / "logs"), "poll_interval_s": 1.0},
    )
    run = plane.run(deployment, directory=str(tmp_path))
    marker = tmp_path / "stage-job-id"
    stage = _wait(lambda: marker.exists() and marker.read_text(), 240, "the stage job")
    out = subprocess.run(["squeue", "-h", "-o", "%F|%k"], capture_output=True, text=True).stdout
    assert labelled_jobs(out, "flow-run", str(run.id)) == [stage], out  # run_job labelled it with this run
    row.watch_runs([run.id], lambda: plane.api.settings())
    return row, run, stage


@pytest.mark.prefect
@pytest.mark.slow
def test_cancelling_a_slurm_flow_run_scancels_its_stage_jobs(control_plane, slurm, tmp_path):  # noqa: F811 - fixture
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Cancelling

    plane = control_plane
    row, run, stage = _slurm_run(plane, tmp_path, "Slurm flow run cancelled during a stage job")
    with plane.api.settings(), get_client(sync_client=True) as client:
        accepted = client.set_flow_run_state(run.id, Cancelling(), force=True)  # what the UI's Cancel does
    row.injected += accepted.status is SetStateStatus.ACCEPT
    _wait(lambda: _job_state(stage) == "CANCELLED", 60, f"stage job {stage} CANCELLED")
    state = plane.wait_state(run.id, lambda s: s.is_final(), 60, "final")
    assert state.is_cancelled(), state
    _wait(lambda: jobs_under(tmp_path) == [], 30, "no job of the run left in squeue")
    # Never Crashed on the way, not even for a moment (crash hooks would fire on a user's cancel):
    # the engine in the job got a SIGTERM before its SIGKILL once, under load.
    with plane.api.settings(), get_client(sync_client=True) as client:
        states = client.read_flow_run_states(run.id)
        history = [s.type.value for s in states]
    assert "CRASHED" not in history, history
    assert history[-1] == "CANCELLED", history


@pytest.mark.prefect
@pytest.mark.slow
def test_a_slurm_flow_run_killed_hard_takes_its_stage_jobs_with_it(control_plane, slurm, tmp_path):  # noqa: F811 - fixture
    """The flow-run process is SIGKILLed (the OOM killer, say): nothing in it can cancel its stage job."""
    plane = control_plane
    row, run, stage = _slurm_run(plane, tmp_path, "Slurm flow-run job SIGKILLed during a stage job")
    flow_job = plane.flow_run(run.id).infrastructure_pid
    assert flow_job and flow_job != stage
    os.kill(int((tmp_path / "flow.pid").read_text()), signal.SIGKILL)  # the one-machine cluster: same host
    row.injected += 1  # the process existed (else os.kill raises)
    state = plane.wait_state(run.id, lambda s: s.is_final(), 90, "final")
    assert state.is_crashed(), state
    assert f"Slurm job {flow_job} ended" in state.message, state.message
    _wait(lambda: _job_state(stage) == "CANCELLED", 60, f"stage job {stage} CANCELLED")
    _wait(lambda: jobs_under(tmp_path) == [], 30, "no job of the run left in squeue")


# A job that checkpoints each step (atomically), resumes from its checkpoint, and goes fast once resumed.
COUNTER = """
import os, pathlib, sys, time
ck = pathlib.Path(sys.argv[1]); target = int(sys.argv[2])
step = int(ck.read_text()) if ck.exists() else 0
print(f"resume from {step}" if step else "fresh start", "restart", os.environ.get("SLURM_RESTART_COUNT", "0"), flush=True)
while step < target:
    step += 1
    tmp = ck.with_suffix(".tmp"); tmp.write_text(str(step)); tmp.replace(ck)
    print("step", step, flush=True)
    time.sleep(0.05 if ck.with_suffix(".resumed").exists() else 0.5)
print("done", step, flush=True)
"""


def _start(backend, spec):  # noqa: F811 - fixture name
    lines: list[str] = []
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", backend.run(spec, lines.append)))
    thread.start()
    _wait(lambda: "step 5" in lines, 120, "step 5 of the job")
    job_id = next(line.split()[3] for line in lines if line.startswith("[slurm] submitted"))
    return thread, box, lines, job_id


def _counter(tmp_path: Path, target: int) -> tuple[JobSpec, Path]:
    script = tmp_path / "counter.py"
    script.write_text(COUNTER)
    ckpt = tmp_path / "counter.ckpt"
    return JobSpec(name="counter", command=[PY, str(script), str(ckpt), str(target)], workdir=str(tmp_path)), ckpt


def test_scancel_of_a_stage_job_is_reported_and_a_rerun_resumes(backend, tmp_path):  # noqa: F811 - fixture
    spec, ckpt = _counter(tmp_path, 40)
    row = fault_ledger.open_row("scancel of a Slurm stage job")
    thread, box, lines, job_id = _start(backend, spec)
    SlurmCLI().scancel([job_id])  # an operator (or a higher-priority job's admin) cancels it
    thread.join(60)
    result = box["result"]
    row.injected += result.state is JobState.CANCELLED  # Slurm says it was cancelled
    assert result.state is JobState.CANCELLED, result
    done = int(ckpt.read_text())  # a whole number: the checkpoint is replaced atomically, never half-written
    assert 5 <= done < 40
    ckpt.with_suffix(".resumed").touch()
    lines.clear()
    rerun = backend.run(spec, lines.append)
    resumed_from = next((int(x.split()[2]) for x in lines if x.startswith("resume from ")), 0)
    row.count_lost(max(0, done - resumed_from))  # steps checkpointed before the cancel, done again
    assert rerun.state is JobState.COMPLETED, rerun
    assert any(line.startswith(f"resume from {done}") for line in lines), lines[:5]
    assert [int(x.split()[1]) for x in lines if x.startswith("step ")] == list(range(done + 1, 41))


def _node() -> str:
    return subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()[0]


def _others_running(ours: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%A"], capture_output=True, text=True).stdout
    return [j for j in out.split() if j != ours]


@pytest.mark.slow
def test_node_down_requeues_the_job_and_it_resumes(backend, tmp_path):  # noqa: F811 - fixture
    spec, ckpt = _counter(tmp_path, 30)
    backend.options.max_resubmits = 2
    row = fault_ledger.open_row("Slurm node set DOWN (job requeued or resubmitted)")
    thread, box, lines, job_id = _start(backend, spec)
    # The node is shared: take it down only while no one else's job runs there, for about a second.
    deadline = time.monotonic() + 90
    while _others_running(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _others_running(job_id):
        SlurmCLI().scancel([job_id])
        thread.join(60)
        pytest.skip("other jobs kept running on the shared node for 90 s: not taking it down under them")
    node = _node()
    try:
        checkpointed = int(ckpt.read_text())  # progress saved before the node goes down
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", "state=down", "reason=nemoflow-fault-test"], check=True
        )
        row.injected += 1
        ckpt.with_suffix(".resumed").touch()
        time.sleep(1)
    finally:
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    thread.join(300)
    result = box["result"]
    assert result.state is JobState.COMPLETED, (result, lines[-20:])
    resumed = [line for line in lines if line.startswith("resume from ")]
    row.count_lost(max(0, checkpointed - (int(resumed[0].split()[2]) if resumed else 0)))
    assert resumed and int(resumed[0].split()[2]) >= 5, lines[:40]
    assert ckpt.read_text() == "30"
    print("\n".join(line for line in lines if line.startswith("[slurm]") or "resume" in line))
    # the first attempt's job may linger as COMPLETING until the node has answered again
    _wait(lambda: jobs_under(tmp_path) == [], 60, "no job of the test left in squeue")

"""Crashed runs never block later runs (issue #12), on the demo's own control plane.

The issue's case: a ``cpt-refresh/local`` run was killed while running (its worker and flow-run
process died), then the Prefect server restarted. The run stayed Running for good, its deployment
slot and the global ``cpt-refresh`` slot stayed held, and every later refresh ended ``Cancelled:
Deployment concurrency limit reached``. Here a flow of the same shape (the deployment's concurrency
limit 1 / CANCEL_NEW, the same global lock taken by the same code, a cached step, a stage job on the
local backend) goes through exactly that; the next run must run and reuse the finished step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from flows.cpt_refresh import CONCURRENCY_LIMIT, LOCK_LEASE_S
from infra import processes
from tests.conftest import wait_for
from tests.support import fault_ledger

from .conftest import ZOMBIE_AFTER_S

pytestmark = [pytest.mark.faults, pytest.mark.prefect, pytest.mark.slow]

# The server's repossessor looks for expired leases every 15 s.
REPOSSESSOR_S = 15


def pid_in(path: Path, timeout: float = 120) -> int:
    return int(wait_for(lambda: path.exists() and path.read_text().strip(), timeout, f"{path.name}"))


def _task_runs(plane, flow_run_id) -> dict[str, str]:
    """The flow run's task runs in the server's database: {id: name}."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with plane.api.settings(), get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {str(r.id): r.name for r in runs}


def test_killed_run_and_server_restart_do_not_block_the_next_run(control_plane, tmp_path):
    plane = control_plane
    deployment = plane.deploy("tests/faults/flows.py:holds_refresh_lock")
    plane.worker()
    killed_row = fault_ledger.open_row("kill -9 of the worker and the flow-run process")
    restart_row = fault_ledger.open_row("Prefect server restart with a run's slots held")

    first = plane.run(deployment, directory=str(tmp_path))
    killed_row.watch_runs([first.id], lambda: plane.api.settings())
    flow_pid = pid_in(tmp_path / f"flow-{first.id}.pid")
    job_pid = pid_in(tmp_path / f"job-{first.id}.pid")
    assert plane.active_slots(CONCURRENCY_LIMIT) == 1
    assert plane.deployment_slots(deployment) == 1
    # The automation starts watching a run at its first heartbeat: a server stopped before it saw one
    # would never crash the run (what `stop_all` covers for `--down`, not a kill -9).
    wait_for(lambda: plane.heartbeats(first.id) >= 1, 60, "the run's first heartbeat in the server's events")
    finished_step = {"prepare-count": (tmp_path / "prepare-count").read_text()}  # the cached step, done
    recorded = _task_runs(plane, first.id)
    assert recorded

    # The fault: worker and flow-run process SIGKILLed (nothing in them can clean up), server restarted.
    worker_pid = plane.kill_worker()  # SIGKILL
    os.kill(flow_pid, signal.SIGKILL)
    for pid in (worker_pid, flow_pid):
        wait_for(lambda pid=pid: not processes.pid_alive(pid), 10, f"the end of pid {pid}")
        killed_row.injected += 1
    # The stage job dies with the flow run that started it (no orphan at 100% CPU).
    wait_for(lambda: not processes.pid_alive(job_pid), 10, f"the end of the orphaned stage job {job_pid}")
    restart_s = plane.restart_server()  # asserts the server was down before it started again
    restart_row.injected += 1
    restart_row.compare(recorded, _task_runs(plane, first.id))  # the run's records survived the restart
    plane.worker()  # a new worker, as after a reboot
    killed = time.monotonic()

    # The run ends Crashed (heartbeats stopped) instead of Running for good ...
    state = plane.wait_state(first.id, lambda s: s.is_final(), ZOMBIE_AFTER_S + 60, "final")
    assert state.is_crashed(), state
    assert "no heartbeat" in state.message, state.message
    crashed_after = time.monotonic() - killed
    # ... and both of its slots come back: the deployment's with the Crashed state, the global one when
    # its lease expires (the restarted server still knows the lease: it is on disk).
    assert plane.deployment_slots(deployment) == 0
    wait_for(
        lambda: plane.active_slots(CONCURRENCY_LIMIT) == 0,
        LOCK_LEASE_S + REPOSSESSOR_S + 30,
        f"the release of the '{CONCURRENCY_LIMIT}' slot",
    )
    freed_after = time.monotonic() - killed

    # The next run runs normally (not "Cancelled: Deployment concurrency limit reached") and does not
    # redo the step the killed run finished.
    second = plane.run(deployment, directory=str(tmp_path))
    restart_row.watch_runs([second.id], lambda: plane.api.settings())
    pid_in(tmp_path / f"job-{second.id}.pid")
    (tmp_path / "release").touch()
    state = plane.wait_state(second.id, lambda s: s.is_final(), 120, "final")
    assert state.is_completed(), state
    assert (tmp_path / "result.json").exists()
    killed_row.compare(finished_step, {"prepare-count": (tmp_path / "prepare-count").read_text()})
    assert (tmp_path / "prepare-count").read_text() == "1", "the finished step ran again"
    print(
        f"server restart {restart_s:.1f}s; Crashed {crashed_after:.0f}s and global slot free "
        f"{freed_after:.0f}s after the kill; the next run completed"
    )


@pytest.mark.parametrize("cancel_first", [True, False], ids=["as-run", "cancel-skipped"])
def test_demo_down_during_a_stage_job_leaves_no_orphan_and_a_final_run(control_plane, tmp_path, cancel_first):
    """`nemoflow demo --down` during a stage job: no process keeps running, the run ends saying why.

    ``--down`` first cancels the runs in progress (:func:`devtools.prefect_local.cancel_active_runs`),
    then ``stop_all`` stops the worker and the server: the run ends Cancelled. With the cancel left
    out (as when it failed or timed out) the worker and the server stop under the running flow.
    """
    plane = control_plane
    deployment = plane.deploy("tests/faults/flows.py:runs_a_stage_job", concurrency_limit=None)
    plane.worker()
    row = fault_ledger.open_row(
        "`nemoflow demo --down` during a stage job" + ("" if cancel_first else " (its cancel skipped)")
    )
    run = plane.run(deployment, directory=str(tmp_path))
    row.watch_runs([run.id], lambda: plane.api.settings())
    flow_pid = pid_in(tmp_path / f"flow-{run.id}.pid")
    job_pid = pid_in(tmp_path / f"job-{run.id}.pid")
    if cancel_first:
        assert plane.cancel_active_runs() == [run.name]
    stopped = plane.stop_all()
    assert "server" in stopped and f"worker-{plane.pool}" in stopped
    row.injected += 1
    for pid, what in ((job_pid, "stage job"), (flow_pid, "flow-run process")):
        wait_for(lambda pid=pid: not processes.pid_alive(pid), 15, f"the end of the {what} {pid}")
    # The next `nemoflow demo` finds the run in a final state that says what happened, at once: not
    # Running until the heartbeat automation notices (it never does when the server went down before
    # it saw the run's first heartbeat, as in one CI run: Running for good).
    plane.start_server()
    state = plane.flow_run(run.id).state
    if cancel_first:
        assert state.is_cancelled(), state
    else:
        assert state.is_crashed(), state
        assert "nemoflow demo --down" in state.message and f"pid {flow_pid}" in state.message, state.message
    print(f"after --down: {state.name}: {state.message}")

"""The stage-times artifact waits for the API to record each stage's last state (a real Prefect server)."""

from __future__ import annotations

import contextvars
import threading
import time

import pytest


@pytest.mark.prefect
def test_stage_times_waits_for_a_stage_the_api_still_shows_pending(prefect_server):
    """CI once published a cached re-run's table with its last stage ``Pending``: the task had returned, but
    its final state had not reached the API yet. Here a real task run sits in ``Pending`` in the API and
    turns ``Completed`` 2 s later; the table must show it ``Completed``."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Pending

    from flows.end_to_end import stage_times

    @task(name="slow-to-settle")
    def stage():
        return None

    @flow(name="stage-times-settle")
    def pipeline():
        return None

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(pipeline)
        task_run = client.create_task_run(stage, flow_run_id=run.id, dynamic_key="0", state=Pending())

        def settle():
            time.sleep(2)
            with get_client(sync_client=True) as other:
                other.set_task_run_state(task_run.id, Completed(), force=True)

        settler = threading.Thread(target=contextvars.copy_context().run, args=(settle,))  # the same API
        settler.start()
        try:
            rows = stage_times(run.id, settle_s=30)
        finally:
            settler.join()
    assert [(row["stage"], row["state"]) for row in rows] == [(task_run.name, "Completed")]
    # and a stage that never settles does not hold the flow for longer than settle_s
    with get_client(sync_client=True) as client:
        stuck = client.create_flow_run(pipeline)
        client.create_task_run(stage, flow_run_id=stuck.id, dynamic_key="0", state=Pending())
    started = time.monotonic()
    rows = stage_times(stuck.id, settle_s=2)
    assert [row["state"] for row in rows] == ["Pending"] and time.monotonic() - started < 10

"""The demo's control plane, for real, for the fault tests: a Prefect server, work pool, worker, deployment.

Everything comes from devtools/prefect_local.py (what ``nemoflow demo`` / ``deploy`` run), with its own
``PREFECT_HOME`` (database, concurrency leases) and ``NEMOFLOW_HOME`` (pid files, logs) in a temporary
directory and a free port, so the server can be killed and restarted without touching the session's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

# Shorter than the demo's 90 s (tests wait for it), still well above the 30 s heartbeat interval.
ZOMBIE_AFTER_S = 60


@dataclasses.dataclass
class ControlPlane:
    api: object  # devtools.prefect_local.PrefectApi
    port: int
    root: Path
    pool: str = "faults"

    @contextlib.contextmanager
    def scoped(self):
        """This control plane's environment (its homes, no session API) around a devtools call."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NEMOFLOW_HOME", str(self.root / "nemoflow"))
            mp.setenv("PREFECT_HOME", str(self.root / "prefect"))
            mp.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
            mp.delenv("PREFECT_API_URL", raising=False)
            mp.delenv("PREFECT_API_AUTH_STRING", raising=False)
            yield

    def restart_server(self) -> float:
        """Stop the server (SIGTERM, then SIGKILL) and start it again on the same database; seconds it took."""
        from devtools import prefect_local as pl
        from infra import processes

        started = time.monotonic()
        with self.scoped():
            pid = pl.running("server")
        assert pid is not None, "the server is not running"
        processes.stop(pid, group=True, grace_s=5)
        assert not self.api.healthy()
        self.start_server()
        return time.monotonic() - started

    def start_server(self) -> None:
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        from devtools import prefect_local as pl

        with self.scoped(), temporary_settings(restore_defaults={PREFECT_API_URL, PREFECT_API_AUTH_STRING}):
            self.api = pl.ensure_server(self.port, echo=lambda *_: None)

    def worker(self, pool: str | None = None, pool_type: str = "process") -> int:
        from devtools import prefect_local as pl

        with self.scoped():
            return pl.ensure_worker(pool or self.pool, pool_type, self.api, echo=lambda *_: None)

    def stop_all(self) -> list[str]:
        """What `nemoflow demo --down` does after cancelling the runs in progress and stopping the endpoint."""
        from devtools import prefect_local as pl

        with self.scoped():
            return pl.stop_all(echo=lambda *_: None)

    def cancel_active_runs(self) -> list[str]:
        """What `nemoflow demo --down` does first: cancel the runs in progress and wait for them."""
        from devtools import prefect_local as pl

        with self.scoped():
            return pl.cancel_active_runs(echo=lambda *_: None)

    def kill_worker(self) -> int:
        from devtools import prefect_local as pl

        with self.scoped():
            pid = pl.running(f"worker-{self.pool}")
        assert pid is not None
        os.kill(pid, 9)
        return pid

    def deploy(
        self,
        entrypoint: str,
        name: str = "local",
        concurrency_limit: int | None = 1,
        pool: str | None = None,
        job_variables: dict | None = None,
    ) -> str:
        from prefect import flow
        from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

        limit = (
            ConcurrencyLimitConfig(limit=concurrency_limit, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
            if concurrency_limit
            else None
        )
        with self.api.settings():
            loaded = flow.from_source(source=str(REPO), entrypoint=entrypoint)
            loaded.deploy(
                name=name,
                work_pool_name=pool or self.pool,
                concurrency_limit=limit,
                job_variables=job_variables or {},
                print_next_steps=False,
                ignore_warnings=True,
            )
        return f"{loaded.name}/{name}"

    def run(self, deployment: str, **parameters):
        from prefect.deployments import run_deployment

        with self.api.settings():
            return run_deployment(deployment, parameters=parameters, timeout=0)

    def flow_run(self, flow_run_id):
        from prefect.client.orchestration import get_client

        with self.api.settings(), get_client(sync_client=True) as client:
            return client.read_flow_run(flow_run_id)

    def wait_state(self, flow_run_id, done, timeout: float, what: str):
        """Poll the run until ``done(state)``; fail with the worker log after ``timeout``."""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # the server may be restarting
                state = self.flow_run(flow_run_id).state
                if state is not None and done(state):
                    return state
            time.sleep(1)
        from devtools import prefect_local as pl

        pytest.fail(
            f"flow run {flow_run_id} not {what} after {timeout:.0f}s (state {state!r}); worker log:\n"
            + pl.log_tail(f"worker-{self.pool}", 40)
        )

    def heartbeats(self, flow_run_id) -> int:
        """How many heartbeat events of the run the server has stored."""
        from prefect.client.orchestration import get_client
        from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

        wanted = EventFilter(
            event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
        )
        with self.api.settings(), get_client(sync_client=True) as client:
            return client.read_events(filter=wanted, limit=1).total  # the client's default 100 is over the API's 50

    def active_slots(self, limit: str) -> int:
        from prefect.client.orchestration import get_client

        with self.api.settings(), get_client(sync_client=True) as client:
            return client.read_global_concurrency_limit_by_name(limit).active_slots

    def deployment_slots(self, deployment: str) -> int:
        from prefect.client.orchestration import get_client

        with self.api.settings(), get_client(sync_client=True) as client:
            return client.read_deployment_by_name(deployment).global_concurrency_limit.active_slots


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """A Prefect server, pool and worker as ``nemoflow demo`` starts them, private to the fault tests."""
    from devtools import prefect_local as pl

    plane = ControlPlane(api=None, port=free_port(), root=tmp_path_factory.mktemp("control-plane"))
    try:
        plane.start_server()
        with plane.scoped():
            pl.ensure_work_pool(plane.pool, "process", plane.api)
            pl.ensure_zombie_automation(plane.api, within_s=ZOMBIE_AFTER_S, echo=lambda *_: None)
        yield plane
    finally:
        plane.stop_all()

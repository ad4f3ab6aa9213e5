"""prefect.yaml's cpt-refresh deployments, deployed for real: the nightly cron schedule is what the
Prefect server stores, and no deployment concurrency limit cancels a run before the flow's own
one-at-a-time check can say which run holds the slot."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC

import pytest

from nemoflow.commands import demo
from tests.conftest import REPO, VENV_BIN
from tests.foundation.test_submitted_parameters import deployed_schema

pytestmark = [pytest.mark.prefect]


def _prefect(args: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(VENV_BIN / "prefect"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_nightly_schedule_is_registered_and_no_deployment_limit_cancels_runs(prefect_server, work_dir):
    env = dict(os.environ, PREFECT_API_URL=prefect_server, NEMOFLOW_WORK_DIR=str(work_dir))
    _prefect(["work-pool", "create", "local", "--type", "process", "--overwrite"], env)
    names = ["cpt-refresh/nightly", "cpt-refresh/local", "end-to-end/local"]
    out = _prefect(["--no-prompt", "deploy", *[arg for name in names for arg in ("--name", name)]], env)
    assert "cpt-refresh/nightly" in out.stdout, out.stdout
    from prefect import get_client

    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("cpt-refresh/nightly")
        local = client.read_deployment_by_name("cpt-refresh/local")
        end_to_end = client.read_deployment_by_name("end-to-end/local")
    # The schema tests/foundation/test_submitted_parameters.py checks every submitted parameter set against is
    # the one this server stores
    for deployment in (nightly, end_to_end):
        assert deployment.parameter_openapi_schema == deployed_schema(deployment.entrypoint)
    # and the server itself takes the GPU demo's parameters and refuses the shape that once stopped it
    gpu_demo = demo.demo_parameters("end-to-end/local", steps=None, gpus=8)
    assert _server_check(end_to_end.id, gpu_demo) is None
    refused = _server_check(end_to_end.id, {"config": {"serve": {"resources": {"gpus_per_node": 1}}}})
    assert "'resources' was unexpected" in refused, refused
    assert len(nightly.schedules) == 1
    schedule = nightly.schedules[0]
    assert schedule.active
    assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 2 * * *", "UTC")
    assert local.schedules == []
    for deployment in (nightly, local):
        assert deployment.work_pool_name == "local"
        # One at a time is the flow's own global limit (a refused run names the holder: test_refresh_slot.py);
        # a deployment limit would cancel before the flow starts, with Prefect's message naming no holder.
        assert deployment.global_concurrency_limit is None


def _server_check(deployment_id, parameters: dict) -> str | None:
    """Create a flow run of the deployment with ``parameters`` (scheduled a year ahead, so no worker takes it, and
    deleted at once): None when the server accepts them, else its reason."""
    from datetime import datetime, timedelta

    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.states import Scheduled

    later = Scheduled(scheduled_time=datetime.now(UTC) + timedelta(days=365))
    with get_client(sync_client=True) as client:
        try:
            run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters, state=later)
        except PrefectHTTPStatusError as exc:
            return exc.response.text
        client.delete_flow_run(run.id)
    return None


def test_every_pool_has_a_nightly_refresh():
    import yaml

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    pools = {d["work_pool"]["name"] for d in spec["deployments"]}
    nightly = {
        d["work_pool"]["name"]: d
        for d in spec["deployments"]
        if d["entrypoint"] == "flows/cpt_refresh.py:cpt_refresh" and d.get("schedules")
    }
    assert set(nightly) == pools, f"pools without a nightly cpt-refresh: {pools - set(nightly)}"
    for pool, deployment in nightly.items():
        assert [s["cron"] for s in deployment["schedules"]] == ["0 2 * * *"], pool
        assert "concurrency_limit" not in deployment, pool  # the flow's global limit guards every pool
        executor = deployment.get("parameters", {}).get("config", {}).get("executor", "local")
        kind = executor if isinstance(executor, str) else executor["kind"]
        assert kind == {"local": "local", "gpu-cluster": "slurm", "nemoflow-k8s": "k8s"}[pool]

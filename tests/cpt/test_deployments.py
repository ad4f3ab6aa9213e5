"""prefect.yaml's cpt-refresh deployments, deployed for real: the nightly cron schedule is what the
Prefect server stores, and no deployment concurrency limit cancels a run before the flow's own
one-at-a-time check can say which run holds the slot."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO, VENV_BIN

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
    out = _prefect(["--no-prompt", "deploy", "--name", "cpt-refresh/nightly", "--name", "cpt-refresh/local"], env)
    assert "cpt-refresh/nightly" in out.stdout, out.stdout
    from prefect import get_client

    with get_client(sync_client=True) as client:
        nightly = client.read_deployment_by_name("cpt-refresh/nightly")
        local = client.read_deployment_by_name("cpt-refresh/local")
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

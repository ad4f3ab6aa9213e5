"""The work pools `nemoflow demo` / `deploy` create, read back from a real Prefect server: the template file's job
template, or the installed worker's default, as `prefect work-pool create` makes them (created in-process)."""

from __future__ import annotations

import json

import pytest

from devtools import prefect_local as pl
from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.prefect]


def _pool(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_work_pool(name)


def test_pools_are_created_once_with_the_file_or_the_workers_template(prefect_server):
    from prefect.workers.process import ProcessWorker

    suffix = free_port()
    local, slurm = f"local-{suffix}", f"slurm-{suffix}"
    assert pl.ensure_work_pool(local, "process", prefect_server) is True
    assert pl.ensure_work_pool(local, "process", prefect_server) is False  # exists: left as it is
    assert pl.ensure_work_pool(slurm, "slurm", prefect_server, "deployments/slurm/base-job-template.json") is True

    made = _pool(local)
    assert made.type == "process"
    assert made.base_job_template == ProcessWorker.get_default_base_job_template()
    made = _pool(slurm)
    assert made.type == "slurm"
    assert made.base_job_template == json.loads((REPO / "deployments/slurm/base-job-template.json").read_text())


def test_a_type_with_no_worker_and_no_template_is_one_line(prefect_server):
    with pytest.raises(pl.ControlPlaneError, match=r"no Prefect worker of type 'nosuch' is installed here") as info:
        pl.ensure_work_pool(f"x-{free_port()}", "nosuch", prefect_server)
    assert "\n" not in str(info.value)

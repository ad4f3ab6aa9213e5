"""prefect-kubernetes' worker process (``prefect worker start --type kubernetes``) against the API stand-in.

The pool is created from the shipped deployments/k8s/base-job-template.json; the flow-run pods are
scripted by tests/k8s/controller.py (no container runs: tests/e2e/test_end_to_end_k8s.py runs them).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.k8s.conftest import NAMESPACE
from tests.k8s.controller import JobScript, PodScript
from tests.support import fault_ledger
from tests.support.kube_worker import kubernetes_worker, log_tail, write_kubeconfig

pytestmark = [pytest.mark.prefect, pytest.mark.slow]
RUN_LABEL = "prefect.io/flow-run-id"


async def _deployment(prefect_server: str) -> tuple[str, str]:
    """A pool from the shipped template and a deployment on it; (pool, deployment id)."""
    from prefect.client.orchestration import get_client

    from devtools.prefect_local import ensure_work_pool

    pool = f"k8s-worker-{uuid.uuid4().hex[:6]}"
    await asyncio.to_thread(
        ensure_work_pool, pool, "kubernetes", prefect_server, "deployments/k8s/base-job-template.json"
    )
    async with get_client() as client:
        flow_id = await client.create_flow_from_name("k8s-worker-probe")
        deployment_id = await client.create_deployment(
            flow_id,
            "probe",
            work_pool_name=pool,
            entrypoint="flows/end_to_end.py:end_to_end",
            job_variables={
                "namespace": NAMESPACE,
                "pvc_name": "workspace",
                "secret_name": "nemoflow-secrets",
                "service_account_name": "nemoflow",
            },
        )
    return pool, str(deployment_id)


async def _final_state(run_id, timeout_s: float):
    from prefect.client.orchestration import get_client

    deadline = asyncio.get_running_loop().time() + timeout_s
    async with get_client() as client:
        while True:
            run = await client.read_flow_run(run_id)
            if (run.state and run.state.is_final()) or asyncio.get_running_loop().time() > deadline:
                return run
            await asyncio.sleep(1)


def _run_pods(cluster, run_id) -> list[dict]:
    return [p for p in cluster.live("v1/pods") if (p["metadata"].get("labels") or {}).get(RUN_LABEL) == str(run_id)]


@pytest.mark.faults
async def test_worker_names_the_flow_run_job_itself_and_its_observer_marks_a_failed_run_crashed(
    ready, prefect_server, tmp_path
):
    from prefect.client.orchestration import get_client

    row = fault_ledger.open_row("k8s: the flow-run pod fails before the flow starts (real worker, observer)")
    pool, deployment_id = await _deployment(prefect_server)
    # every pod of this cluster fails: the flow-run pod's container exits 1 before the flow starts
    ready.scripts[""] = JobScript(pod=lambda i: PodScript(logs=["flow-run pod: exit 1"], exit_code=1))
    async with get_client() as client:
        run = await client.create_flow_run_from_deployment(deployment_id)
    row.watch_runs([run.id])
    log = tmp_path / "worker.log"
    with kubernetes_worker(pool, prefect_server, write_kubeconfig(tmp_path / "kubeconfig", ready.url), log):
        final = await _final_state(run.id, timeout_s=180)
    row.injected += sum(p["status"].get("phase") == "Failed" for p in _run_pods(ready, run.id))
    assert row.injected == 1, _run_pods(ready, run.id)
    assert final.state.is_crashed(), f"{final.state}\n{log_tail(log)}"
    assert "No active or succeeded pods found for any job" in final.state.message

    # the worker created the run's Job with generateName: the API named it
    jobs = [j for j in ready.live("batch/v1/jobs") if j["metadata"]["labels"].get(RUN_LABEL) == str(run.id)]
    assert len(jobs) == 1, jobs
    name = jobs[0]["metadata"]["name"]
    assert name in ready.kmock.generated_names and name.startswith(jobs[0]["metadata"]["generateName"])
    assert final.infrastructure_pid == f"{NAMESPACE}:{name}"
    # its observer found the run's Job and pods by label selectors, on lists and watches
    selected = {
        (r.url.path, r.params.get("watch") == "true")
        for r in ready.kmock
        if RUN_LABEL in r.params.get("labelSelector", "")
    }
    assert {("/api/v1/pods", True), ("/apis/batch/v1/jobs", True)} <= selected, sorted(selected)
    assert (f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs", False) in selected, "the crash check lists the run's Jobs"
    _valid_but_for_pod_level_completions(jobs[0])


def _valid_but_for_pod_level_completions(job: dict) -> None:
    """The Job the worker sent passes the Kubernetes schemas (strict) once ``completions`` and ``parallelism``
    are taken out of its pod spec: prefect-kubernetes' own base manifest puts them there (its template
    validation requires them), and an API server drops such unknown fields with a warning (its default
    ``fieldValidation=Warn``); under ``fieldValidation=Strict`` the worker's create would be refused."""
    import copy

    import kubernetes_validate

    from tests.k8s.test_manifests import VERSIONS

    pod_spec = job["spec"]["template"]["spec"]
    assert (pod_spec.get("completions"), pod_spec.get("parallelism")) == (1, 1), pod_spec
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, VERSIONS[-1], strict=True)
    sent = copy.deepcopy(job)
    for field in ("completions", "parallelism"):
        del sent["spec"]["template"]["spec"][field]
    for version in VERSIONS:
        kubernetes_validate.validate(sent, version, strict=True)

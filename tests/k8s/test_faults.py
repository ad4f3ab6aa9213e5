"""Faults a cluster injects into a stage Job, through the Kubernetes backend against the API stand-in.

The pods are scripted by tests/k8s/controller.py; an eviction is written as a kubelet writes one under node
pressure (pod Failed, reason Evicted, a DisruptionTarget condition, the container killed with 137) and the Job
controller then fails the Job (backoffLimit 0: BackoffLimitExceeded).
"""

from __future__ import annotations

import asyncio

import pytest

from infra.backends.k8s import cancel_in_flight
from infra.jobs import JobSpec, JobState
from tests.k8s.controller import JobScript, PodScript
from tests.support import fault_ledger

IMAGE = "nvcr.io/nvidia/nemo:25.02"
PRESSURE = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 42Mi."


def _train() -> JobSpec:
    return JobSpec(name="train", container_image=IMAGE, command=["python", "-m", "workloads.train"])


def _evicted_pods(cluster) -> list[dict]:
    return [p for p in cluster.live("v1/pods") if (p.get("status") or {}).get("reason") == "Evicted"]


def _evict_first(n: int):
    """A Job script whose first ``n`` pods (over every Job of the stage) are evicted mid-way, the rest finish."""
    made = []

    def pod(index: int) -> PodScript:
        made.append(index)
        if len(made) <= n:
            return PodScript(logs=["step 1", "checkpoint saved at step 1", "step 2"], evicted=PRESSURE)
        return PodScript(logs=["resuming from the checkpoint of step 1", "step 2", "done"])

    return pod


@pytest.mark.faults
async def test_an_evicted_stage_pod_is_resubmitted_and_the_stage_completes(ready, make_backend):
    row = fault_ledger.open_row("k8s: a stage Job's pod evicted (node pressure): the Job is resubmitted")
    ready.scripts["train"] = JobScript(pod=_evict_first(1))
    lines: list[str] = []
    result = await asyncio.to_thread(make_backend(ready).run, _train(), lines.append)
    row.injected += len(_evicted_pods(ready))
    assert row.injected == 1, ready.live("v1/pods")

    assert result.state is JobState.COMPLETED and result.attempts == 2, (result, lines)
    jobs = sorted(ready.live("batch/v1/jobs"), key=lambda j: int(j["metadata"]["resourceVersion"]))
    assert len(jobs) == 2 and jobs[0]["metadata"]["name"] != jobs[1]["metadata"]["name"], jobs
    assert [c["reason"] for c in jobs[0]["status"]["conditions"]] == ["BackoffLimitExceeded"]
    assert [c["type"] for c in jobs[1]["status"]["conditions"]] == ["Complete"]
    assert result.job_id.endswith(jobs[1]["metadata"]["name"])
    resubmitted = [line for line in lines if "resubmitting" in line]
    assert resubmitted == [
        f"[k8s] job team/{jobs[0]['metadata']['name']} ended preempted (BackoffLimitExceeded: Job has reached the "
        f"specified backoff limit; Evicted in pod {_evicted_pods(ready)[0]['metadata']['name']}: {PRESSURE}); "
        "resubmitting (1/3) to resume from the latest checkpoint"
    ]
    assert lines.index(resubmitted[0]) < lines.index("resuming from the checkpoint of step 1")


@pytest.mark.faults
async def test_a_stage_evicted_on_every_attempt_ends_preempted_after_max_resubmits(ready, make_backend, k8s_options):
    row = fault_ledger.open_row("k8s: a stage Job's pod evicted on every attempt: preempted after max_resubmits")
    ready.scripts["train"] = JobScript(pod=_evict_first(10))
    backend = make_backend(ready, options=k8s_options.model_copy(update={"max_resubmits": 2}))
    lines: list[str] = []
    result = await asyncio.to_thread(backend.run, _train(), lines.append)
    row.injected += len(_evicted_pods(ready))
    assert row.injected == 3, ready.live("v1/pods")

    assert result.state is JobState.PREEMPTED and result.attempts == 3, (result, lines)
    last = max(ready.live("batch/v1/jobs"), key=lambda j: int(j["metadata"]["resourceVersion"]))["metadata"]["name"]
    (last_pod,) = [p["metadata"]["name"] for p in _evicted_pods(ready) if p["metadata"]["name"].startswith(last)]
    assert result.reason.endswith(f"Evicted in pod {last_pod}: {PRESSURE}"), result.reason
    assert [line.split("resubmitting ")[1] for line in lines if "resubmitting" in line] == [
        "(1/2) to resume from the latest checkpoint",
        "(2/2) to resume from the latest checkpoint",
    ]
    assert len(ready.live("batch/v1/jobs")) == 3


async def test_a_stage_pod_that_exits_1_is_not_resubmitted(ready, make_backend):
    """The other side of the rule: the job's own failure is reported at once, never resubmitted."""
    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=["Traceback: boom"], exit_code=1))
    lines: list[str] = []
    result = await asyncio.to_thread(make_backend(ready).run, _train(), lines.append)
    assert result.state is JobState.FAILED and result.exit_code == 1, result
    assert len(ready.live("batch/v1/jobs")) == 1
    assert not [line for line in lines if "resubmitting" in line]


@pytest.mark.faults
async def test_deleting_the_flow_run_job_deletes_its_stage_job_and_pods(ready, make_backend):
    """The stage Job is owned by the Job of its flow run (found by prefect-kubernetes' ``prefect.io/flow-run-id``
    label); deleting that Job as the worker's ``kill_infrastructure`` does (Foreground, grace 30 s) takes the
    stage Job and its pods with it, through the API's garbage collector, and the stage's run() ends CANCELLED."""
    from kubernetes import client

    from infra.k8s.config import api_client_for_url

    flow_run = "0b7c5a53-3c1e-4a8b-9c53-5a0c6f1e2d11"
    batch = client.BatchV1Api(api_client_for_url(ready.url))
    ready.scripts["probe-flow-run-"] = JobScript(pod=lambda i: PodScript(logs=["flow-run pod"], hang=True))
    ready.scripts["train"] = JobScript(pod=lambda i: PodScript(logs=["step 1"], hang=True))
    container = {"name": "prefect-job", "image": IMAGE, "args": ["prefect", "flow-run", "execute"]}
    flow_run_job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"generateName": "probe-flow-run-", "labels": {"prefect.io/flow-run-id": flow_run}},
        "spec": {"template": {"spec": {"containers": [container], "restartPolicy": "Never"}}},
    }
    owner = await asyncio.to_thread(batch.create_namespaced_job, "team", flow_run_job)
    stage = _train().model_copy(update={"labels": {"flow-run": flow_run}})
    lines: list[str] = []
    running = asyncio.create_task(asyncio.to_thread(make_backend(ready).run, stage, lines.append))
    try:
        async with asyncio.timeout(30):
            while "step 1" not in lines:
                await asyncio.sleep(0.05)
        (stage_job,) = [j for j in ready.live("batch/v1/jobs") if j["metadata"]["name"].startswith("train-")]
        assert stage_job["metadata"]["ownerReferences"] == [
            {"apiVersion": "batch/v1", "kind": "Job", "name": owner.metadata.name, "uid": owner.metadata.uid}
        ]
        stage_pods = [
            p["metadata"]["name"] for p in ready.live("v1/pods") if p["metadata"]["name"].startswith("train-")
        ]

        row = fault_ledger.open_row(
            "k8s: the flow-run Job deleted during a stage Job: the stage Job and pods go with it"
        )
        await asyncio.to_thread(
            batch.delete_namespaced_job,
            owner.metadata.name,
            "team",
            grace_period_seconds=30,
            propagation_policy="Foreground",
        )
        row.injected += 1
        await asyncio.wait({running}, timeout=60)
        result = running.result()  # InvalidStateError if it still runs a minute after the deletion
    finally:  # a failed assertion must not leave the run's thread waiting for ever
        if not running.done():
            await asyncio.to_thread(cancel_in_flight)
            await running
    await ready.settle()
    assert result.state is JobState.CANCELLED, (result, lines)
    assert result.reason == f"Job {stage_job['metadata']['name']} was deleted outside nemoflow"
    assert ready.live("batch/v1/jobs") == [] and ready.live("v1/pods") == [], "nothing of the run is left"
    deleted_by_gc = {r.url.path.rsplit("/", 1)[-1] for r in ready.kmock if r.method == "DELETE"}
    assert deleted_by_gc == {owner.metadata.name}, "only the flow-run Job was deleted over the API; the rest by the GC"
    assert stage_pods

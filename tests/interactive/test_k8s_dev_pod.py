"""`nemoflow interactive --backend k8s`: a dev pod with the workspace PVC, listed until released (kmock)."""

from __future__ import annotations

import asyncio

from infra.interactive import DevPods, InteractiveRequest, exec_instructions
from tests.k8s.conftest import NAMESPACE
from tests.k8s.controller import JobScript, PodScript


async def test_dev_pod_has_the_workspace_and_a_deadline_and_is_listed_until_released(ready, make_backend):
    ready.scripts["dev-alice"] = JobScript(pod=lambda index: PodScript(hang=True))  # sleeps until ended
    pods = DevPods(make_backend(ready))
    request = InteractiveRequest(
        image="registry.example.com/nemo:25.04", gpus_per_node=1, cpus_per_task=4, time="02:00:00"
    )
    body = await asyncio.to_thread(pods.create, request, "dev-alice")

    jobs = ready.live("batch/v1/jobs")
    assert [j["metadata"]["name"] for j in jobs] == ["dev-alice"]
    job = jobs[0]
    assert job["metadata"]["labels"]["nemoflow.dev/kind"] == "interactive"
    assert job["spec"]["activeDeadlineSeconds"] == 7200  # Kubernetes ends it at the time limit
    pod_spec = job["spec"]["template"]["spec"]
    main = pod_spec["containers"][0]
    assert main["image"] == "registry.example.com/nemo:25.04"
    assert main["command"] == ["sleep", "7200"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod_spec["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["workspace"]
    assert any(m["mountPath"] == "/nemo-workspace" for m in main["volumeMounts"])
    assert pod_spec["schedulerName"] == "runai-scheduler"
    assert body["metadata"]["name"] == "dev-alice"

    async def listed() -> list[dict]:
        for _ in range(100):  # the stand-in controller creates the pod and runs it
            rows = await asyncio.to_thread(pods.sessions)
            if rows and rows[0]["pod"] and rows[0]["state"] == "RUNNING":
                return rows
            await asyncio.sleep(0.1)
        return rows

    rows = await listed()
    assert [(r["id"], r["kind"], r["state"]) for r in rows] == [("dev-alice", "interactive", "RUNNING")]
    pod = rows[0]["pod"]
    assert exec_instructions(NAMESPACE, pod) == f"kubectl exec -it -n {NAMESPACE} {pod} -- bash"
    assert await asyncio.to_thread(pods.pod_name, "dev-alice") == pod

    assert await asyncio.to_thread(pods.release, "dev-alice")
    assert ready.get("jobs", "dev-alice") is None and ready.get("pods", pod) is None
    assert await asyncio.to_thread(pods.sessions) == []
    assert not await asyncio.to_thread(pods.release, "dev-alice")  # released already


async def test_a_missing_workspace_pvc_is_refused_before_anything_is_created(cluster, make_backend):
    cluster.add_namespace()
    pods = DevPods(make_backend(cluster))
    try:
        await asyncio.to_thread(pods.create, InteractiveRequest(), "dev-bob")
    except Exception as exc:  # noqa: BLE001 - the message is what is asserted
        assert "workspace" in str(exc)
    else:
        raise AssertionError("preflight should refuse a namespace without the workspace PVC")
    assert cluster.live("batch/v1/jobs") == []

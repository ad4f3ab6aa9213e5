"""A stand-in for the parts of a cluster kmock lacks: the Job controller, the scheduler and the kubelet.

kmock stores objects and serves watches, but nothing ever acts on them. This
controller polls kmock's objects and, for each new Job, creates its pods over
the API (so list/watch see them), moves them Pending -> Running -> Succeeded or
Failed as a per-pod :class:`PodScript` says, serves their log as ``text/plain``
(streamed, like ``?follow=true``), and sets the Job's conditions the way the
real Job controller does (Complete; Failed with BackoffLimitExceeded or
DeadlineExceeded). Deployments get one pod and ``readyReplicas``.
With ``kubelet=PodmanKubelet()`` (tests/k8s/kubelet.py) pods are not scripted: their
containers run for real as podman containers of the pod's image, with the PVC as a host
directory, env and Secrets resolved, readiness probes sent, exit codes as pod status,
and Job deadlines (``activeDeadlineSeconds``) enforced.
Pods carry an ``ownerReference`` to their Job, as the Job controller sets it: on the API
stand-in of tests/support/kube.py (``KubeApi``) deleting a Job with ``propagationPolicy``
Background or Foreground deletes its pods through the garbage collector, and the controller
records Events (SuccessfulCreate, Completed, BackoffLimitExceeded, DeadlineExceeded). On plain
kmock nothing collects a deleted Job's pods, so a test there sees whether the backend itself
leaves nothing behind. A Job being deleted (``deletionTimestamp`` set) is no longer driven.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


@dataclass
class PodScript:
    logs: list[str] = field(default_factory=lambda: ["hello from the pod"])
    exit_code: int = 0
    terminated_reason: str | None = None  # "OOMKilled", "Error"
    waiting: tuple[str, str] | None = None  # ("ImagePullBackOff", "Back-off pulling image ...")
    unschedulable: str | None = None  # the scheduler's message
    hang: bool = False  # keep running (and logging) until deleted
    line_delay_s: float = 0.02
    cut_log_after: int | None = None  # the first log connection drops after this many lines
    evicted: str | None = None  # after its logs the kubelet evicts the pod (node pressure) with this message


@dataclass
class JobScript:
    pod: Callable[[int], PodScript] = lambda index: PodScript()
    deadline_after_s: float | None = None  # the Job controller fails it with DeadlineExceeded


class FakeCluster:
    def __init__(self, kmock, namespace: str = "team", kubelet=None):
        self.kmock = kmock
        self.namespace = namespace
        self.kubelet = kubelet  # None: pods follow their PodScript; else a PodmanKubelet runs them
        self.pvc_dirs: dict[str, str] = {}  # PVC name -> host directory (for the kubelet)
        self.url = str(kmock.url).rstrip("/")
        self.scripts: dict[str, JobScript] = {}  # by job-name prefix (the spec name)
        self.logs: dict[str, list[tuple[float, str]]] = {}  # pod -> (time written, line)
        self.running: set[str] = set()  # pods whose container runs (their log can be followed)
        self.cut: dict[str, int] = {}
        self._seen: set[tuple] = set()
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        for resource in (
            "v1/pods",
            "v1/services",
            "batch/v1/jobs",
            "apps/v1/deployments",
            "v1/namespaces",
            "v1/secrets",
            "v1/serviceaccounts",
            "v1/persistentvolumeclaims",
            "v1/nodes",
            "kubeflow.org/v1/pytorchjobs",
            "serving.knative.dev/v1/services",
        ):
            if resource not in kmock.resources:  # KubeApi declares them with their kinds and verbs
                kmock.resources[resource] = {}
        kmock["get", re.compile(r"/api/v1/namespaces/[^/]+/pods/[^/]+/log")] << self._serve_log
        # kmock parses /api/v1/namespaces/NAME as "namespace NAME" without a resource, so
        # reading a Namespace object is served here.
        self.namespaces: set[str] = set()
        kmock["get", re.compile(r"^/api/v1/namespaces/[^/]+$")] << self._serve_namespace

    # --- fixtures of a namespace ---
    def add_namespace(self, name: str | None = None) -> None:
        self.namespaces.add(name or self.namespace)

    def _serve_namespace(self, request):
        import kmock

        name = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        if name not in self.namespaces:
            raise kmock.KubernetesNotFoundError(message=f'namespaces "{name}" not found')
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}, "status": {"phase": "Active"}}

    def add_pvc(self, name: str, host_dir: str | None = None) -> None:
        if host_dir is not None:
            self.pvc_dirs[name] = str(host_dir)
        self.kmock.objects["v1/persistentvolumeclaims", self.namespace, name] = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"accessModes": ["ReadWriteMany"]},
            "status": {"phase": "Bound"},
        }

    def add_service_account(self, name: str) -> None:
        self.kmock.objects["v1/serviceaccounts", self.namespace, name] = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": self.namespace},
        }

    def add_secret(self, name: str, data: dict[str, str]) -> None:
        import base64

        self.kmock.objects["v1/secrets", self.namespace, name] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": self.namespace},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }

    def add_node(self, name: str, gpus: int) -> None:
        self.kmock.objects["v1/nodes", None, name] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": str(gpus)}},
        }

    def live(self, resource: str) -> list[dict]:
        return [
            obj.raw
            for (res, _, _), obj in self.kmock.objects.items()
            if f"{res.group}/{res.version}/{res.plural}".lstrip("/") == resource and not obj.deleted
        ]

    async def settle(self) -> None:
        """Wait for the API's garbage collector (a Job deleted in Foreground stays until its pods are gone)."""
        if hasattr(self.kmock, "settle"):
            await self.kmock.settle()

    def get(self, plural: str, name: str) -> dict | None:
        """The live object of this namespace (None if absent or deleted)."""
        for (res, ns, n), obj in list(self.kmock.objects.items()):
            if res.plural == plural and n == name and ns == self.namespace and not obj.deleted:
                return obj.raw
        return None

    def pod_path(self, name: str) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods/{name}"

    # --- the control loop ---
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(base_url=self.url)
        self._tasks.append(asyncio.create_task(self._loop()))
        if self.kubelet is not None:
            self._tasks.append(await self.kubelet.start(self))

    async def stop(self) -> None:
        self.running.clear()  # open log streams end, so the server can shut down
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kubelet is not None:
            await asyncio.to_thread(self.kubelet.stop)
        if self._session:
            await self._session.close()

    async def _loop(self) -> None:
        while True:
            for (res, ns, name), obj in list(self.kmock.objects.items()):
                key = (res.plural, ns, name)
                if obj.deleted or key in self._seen:
                    continue
                if res.plural == "jobs":
                    self._seen.add(key)
                    self._tasks.append(asyncio.create_task(self._drive_job(obj.raw)))
                elif res.plural == "deployments":
                    self._seen.add(key)
                    self._tasks.append(asyncio.create_task(self._drive_deployment(obj.raw)))
                elif res.plural == "pytorchjobs":
                    self._seen.add(key)
                    self._tasks.append(asyncio.create_task(self._drive_pytorchjob(obj.raw)))
                elif res.plural == "services" and res.group == "serving.knative.dev":
                    self._seen.add(key)
                    self._tasks.append(asyncio.create_task(self._drive_ksvc(obj.raw)))
            await asyncio.sleep(0.02)

    def _script(self, job_name: str) -> JobScript:
        for prefix, script in sorted(self.scripts.items(), key=lambda kv: -len(kv[0])):
            if job_name.startswith(prefix):
                return script
        return JobScript()

    async def _patch(self, path: str, body: dict) -> None:
        async with self._session.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"}) as r:
            assert r.status < 300, await r.text()

    def _exists(self, plural: str, name: str) -> bool:
        """Whether the object is live and not being deleted (a controller stops driving it then)."""
        for (res, ns, n), obj in self.kmock.objects.items():
            if res.plural == plural and n == name and ns == self.namespace and not obj.deleted:
                return not (obj.raw.get("metadata") or {}).get("deletionTimestamp")
        return False

    async def event(self, involved: dict, reason: str, message: str, type_: str = "Normal") -> None:
        """An Event, as the Job controller records one (on the KubeApi stand-in only)."""
        if hasattr(self.kmock, "record_event"):
            await self.kmock.record_event(involved, reason, message, type_=type_, component="job-controller")

    async def _make_pod(
        self,
        owner: str,
        template: dict,
        index: int | None,
        suffix: str = "x7k2p",
        extra_labels: dict | None = None,
        owner_object: dict | None = None,
    ) -> str:
        name = f"{owner}-{index if index is not None else 0}-{suffix}"
        labels = dict(
            (template.get("metadata") or {}).get("labels") or {}, **{"job-name": owner}, **(extra_labels or {})
        )
        annotations = {INDEX_ANNOTATION: str(index)} if index is not None and not extra_labels else {}
        metadata = {"name": name, "namespace": self.namespace, "labels": labels, "annotations": annotations}
        owner_uid = ((owner_object or {}).get("metadata") or {}).get("uid")
        if owner_uid:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": owner_object["apiVersion"],
                    "kind": owner_object["kind"],
                    "name": owner,
                    "uid": owner_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": template["spec"],
            "status": {"phase": "Pending"},
        }
        async with self._session.post(f"/api/v1/namespaces/{self.namespace}/pods", json=pod) as r:
            assert r.status < 300, await r.text()
        if owner_object is not None:
            await self.event(owner_object, "SuccessfulCreate", f"Created pod: {name}")
        return name

    async def _run_pod(self, name: str, container: str, script: PodScript) -> bool:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        await asyncio.sleep(0.05)
        if script.unschedulable:
            await self._patch(
                path,
                {
                    "status": {
                        "conditions": [
                            {
                                "type": "PodScheduled",
                                "status": "False",
                                "reason": "Unschedulable",
                                "message": script.unschedulable,
                            }
                        ]
                    }
                },
            )
            return await self._forever()
        if script.waiting:
            reason, message = script.waiting
            waiting = {"reason": reason, "message": message}
            await self._patch(
                path, {"status": {"containerStatuses": [_container_status(container, False, waiting=waiting)]}}
            )
            return await self._forever()
        self.logs[name] = []
        self.running.add(name)
        if script.cut_log_after:
            self.cut[name] = script.cut_log_after
        await self._patch(
            path,
            {
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        _container_status(container, True, running={"startedAt": "2026-11-29T20:00:00Z"})
                    ],
                }
            },
        )
        for line in script.logs:  # the workload writing its output
            self.logs[name].append((time.time(), line))
            await asyncio.sleep(script.line_delay_s)
        if script.hang:
            return await self._forever()
        await asyncio.sleep(0.05)
        self.running.discard(name)
        if script.evicted:
            # what a kubelet (1.31+) writes when it evicts a pod under node pressure: the pod Failed with reason
            # Evicted and its message, a DisruptionTarget condition, the container killed (exit code 137)
            finished = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            killed = {"exitCode": 137, "reason": "Error", "finishedAt": finished}
            target = {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "TerminationByKubelet",
                "message": script.evicted,
            }
            await self._patch(
                path,
                {
                    "status": {
                        "phase": "Failed",
                        "reason": "Evicted",
                        "message": script.evicted,
                        "conditions": [target],
                        "containerStatuses": [_container_status(container, False, terminated=killed)],
                    }
                },
            )
            if hasattr(self.kmock, "record_event"):
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": self.namespace}}
                await self.kmock.record_event(pod, "Evicted", script.evicted, type_="Warning", component="kubelet")
            return False
        terminated = {
            "exitCode": script.exit_code,
            "reason": script.terminated_reason or ("Completed" if script.exit_code == 0 else "Error"),
        }
        await self._patch(
            path,
            {
                "status": {
                    "phase": "Succeeded" if script.exit_code == 0 else "Failed",
                    "containerStatuses": [_container_status(container, False, terminated=terminated)],
                }
            },
        )
        return script.exit_code == 0

    async def _forever(self) -> bool:
        await asyncio.Event().wait()
        return False

    async def _drive_job(self, job: dict) -> None:
        name = job["metadata"]["name"]
        spec = job["spec"]
        script = self._script(name)
        indexed = spec.get("completionMode") == "Indexed"
        completions = spec.get("completions") or 1
        container = spec["template"]["spec"]["containers"][0]["name"]
        pods = [
            await self._make_pod(name, spec["template"], i if indexed else None, owner_object=job)
            for i in range(completions)
        ]
        if self.kubelet is not None:
            runs = [asyncio.create_task(self.kubelet.run_pod(self, p, job)) for p in pods]
        else:
            runs = [asyncio.create_task(self._run_pod(p, container, script.pod(i))) for i, p in enumerate(pods)]
        self._tasks.extend(runs)
        path = f"/apis/batch/v1/namespaces/{self.namespace}/jobs/{name}"
        await self._patch(path, {"status": {"active": completions, "startTime": "2026-11-29T20:00:00Z"}})
        pending = set(runs)
        timeout = spec.get("activeDeadlineSeconds") if self.kubelet is not None else script.deadline_after_s
        started = asyncio.get_running_loop().time()
        while pending:
            left = None if timeout is None else max(0.0, timeout - (asyncio.get_running_loop().time() - started))
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not self._exists("jobs", name):
                return
            if timeout is not None and not done and pending:
                # the Job controller terminates the active pods of a Job past its deadline
                for task in pending:
                    task.cancel()
                for pod in pods:
                    self.running.discard(pod)
                    async with self._session.delete(f"/api/v1/namespaces/{self.namespace}/pods/{pod}"):
                        pass
                await self._patch(
                    path,
                    {
                        "status": {
                            "active": 0,
                            "conditions": [
                                {
                                    "type": "Failed",
                                    "status": "True",
                                    "reason": "DeadlineExceeded",
                                    "message": "Job was active longer than specified deadline",
                                }
                            ],
                        }
                    },
                )
                await self.event(job, "DeadlineExceeded", "Job was active longer than specified deadline", "Warning")
                return
            if any(not t.result() for t in done):
                for t in pending:
                    t.cancel()
                await self._patch(
                    path,
                    {
                        "status": {
                            "active": 0,
                            "failed": 1,
                            "conditions": [
                                {
                                    "type": "Failed",
                                    "status": "True",
                                    "reason": "BackoffLimitExceeded",
                                    "message": "Job has reached the specified backoff limit",
                                }
                            ],
                        }
                    },
                )
                await self.event(job, "BackoffLimitExceeded", "Job has reached the specified backoff limit", "Warning")
                return
        if not self._exists("jobs", name):
            return
        await self._patch(
            path,
            {"status": {"active": 0, "succeeded": completions, "conditions": [{"type": "Complete", "status": "True"}]}},
        )
        await self.event(job, "Completed", "Job completed")

    async def _drive_deployment(self, dep: dict) -> None:
        if self.kubelet is not None:
            await self.kubelet.drive_deployment(self, dep)
            return
        name = dep["metadata"]["name"]
        template = dep["spec"]["template"]
        script = self._script(name)
        pod = await self._make_pod(name, template, None)
        container = template["spec"]["containers"][0]["name"]
        pod_script = script.pod(0)
        if pod_script.unschedulable or pod_script.waiting:
            await self._run_pod(pod, container, pod_script)
            return
        pod_script.hang = True
        self._tasks.append(asyncio.create_task(self._run_pod(pod, container, pod_script)))
        await asyncio.sleep(0.1)
        await self._patch(
            f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}",
            {"status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}},
        )

    async def _drive_pytorchjob(self, job: dict) -> None:
        """The training operator: one pod per replica (pytorch-master-0, pytorch-worker-N), then Succeeded/Failed."""
        name = job["metadata"]["name"]
        script = self._script(name)
        pods = []
        for rtype, replica in job["spec"]["pytorchReplicaSpecs"].items():
            for i in range(replica.get("replicas", 1)):
                pods.append(
                    await self._make_pod(
                        name,
                        replica["template"],
                        i,
                        suffix=rtype.lower(),
                        extra_labels={
                            "training.kubeflow.org/replica-type": rtype.lower(),
                            "training.kubeflow.org/replica-index": str(i),
                        },
                    )
                )
        container = "pytorch"
        results = await asyncio.gather(*(self._run_pod(p, container, script.pod(i)) for i, p in enumerate(pods)))
        path = f"/apis/kubeflow.org/v1/namespaces/{self.namespace}/pytorchjobs/{name}"
        if all(results):
            condition = {
                "type": "Succeeded",
                "status": "True",
                "reason": "PyTorchJobSucceeded",
                "message": f"PyTorchJob {self.namespace}/{name} successfully completed.",
            }
        else:
            condition = {
                "type": "Failed",
                "status": "True",
                "reason": "PyTorchJobFailed",
                "message": f"PyTorchJob {self.namespace}/{name} has failed because 1 Worker replica(s) failed.",
            }
        await self._patch(path, {"status": {"conditions": [condition]}})

    async def _drive_ksvc(self, ksvc: dict) -> None:
        name = ksvc["metadata"]["name"]
        await asyncio.sleep(0.1)
        await self._patch(
            f"/apis/serving.knative.dev/v1/namespaces/{self.namespace}/services/{name}",
            {
                "status": {
                    "url": f"http://{name}.{self.namespace}.example.com",
                    "conditions": [{"type": "Ready", "status": "True"}],
                }
            },
        )

    # --- pod logs, like the kubelet: text/plain, ?follow, ?timestamps, ?sinceSeconds ---
    async def _serve_log(self, request):
        import kmock

        name = request.name
        if name not in self.logs:
            # raised, not returned: a returned Response's status would stick to this reaction
            raise kmock.KubernetesError(
                status=400,
                reason="BadRequest",
                message=f'container in pod "{name}" is waiting to start: ContainerCreating',
            )
        follow = request.params.get("follow") == "true"
        stamps = request.params.get("timestamps") == "true"
        since = request.params.get("sinceSeconds")
        cutoff = time.time() - int(since) if since else 0.0
        cut = self.cut.pop(name, None)

        async def stream():
            yield b""  # send the headers at once, as the API server does for a followed log
            i = sent = 0
            while True:
                lines = self.logs[name]
                while i < len(lines):
                    written, text = lines[i]
                    i += 1
                    if written < cutoff:
                        continue
                    stamp = datetime.datetime.fromtimestamp(written, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                    yield ((stamp + " " if stamps else "") + text + "\n").encode()
                    sent += 1
                    if cut is not None and sent >= cut:
                        return  # the connection drops (an API server restart, a proxy timeout)
                still_running = name in self.running and self._exists("pods", name)
                if not follow or not still_running:
                    return
                await asyncio.sleep(0.02)

        return kmock.Response(payload=stream(), headers={"Content-Type": "text/plain"})


def _container_status(name: str, ready: bool, **state: dict) -> dict:
    """A pod's containerStatuses entry in ``state`` (waiting, running or terminated, with its details)."""
    return {"name": name, "ready": ready, "restartCount": 0, "image": "x", "imageID": "", "state": state}

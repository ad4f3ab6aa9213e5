"""A kubelet for the API stand-in: each pod's container really runs, as a podman container.

:class:`~tests.k8s.controller.FakeCluster` plays Job controller and scheduler over
kmock; with ``FakeCluster(kmock, ns, kubelet=PodmanKubelet())`` its pods are no
longer scripted but run the pod spec as written, the way a kubelet would:

- the image must exist in the local podman store (``imagePullPolicy`` cannot pull here:
  a missing image is ``ErrImagePull`` / ``ImagePullBackOff``, as on a node);
- ``command``/``args``/``workingDir`` become the container's entrypoint, arguments and
  working directory;
- ``env`` values are set; ``secretKeyRef`` is read from the Secret in kmock (a missing,
  non-optional one is ``CreateContainerConfigError`` with the kubelet's message);
  ``fieldRef`` reads the pod's name, namespace, labels or annotations, so an Indexed
  Job's ``NEMOFLOW_ARRAY_INDEX`` comes from its completion-index annotation; Indexed
  Jobs also get ``JOB_COMPLETION_INDEX``, as Kubernetes sets it;
- a ``persistentVolumeClaim`` volume is a host directory registered with
  ``FakeCluster.add_pvc(name, host_dir=...)`` (``subPath`` a directory under it, made if
  missing; ``readOnly`` a read-only bind mount); a ``Memory`` emptyDir at /dev/shm is
  the container's shm with its ``sizeLimit``; other emptyDirs are tmpfs;
- ``limits.memory`` is enforced by the kernel on a pod-level memory cgroup (a container
  the OOM killer ends is ``OOMKilled``), ``limits.cpu`` by podman's ``--cpus``; GPUs are
  not emulated (a pod asking for ``nvidia.com/gpu`` runs on the CPU);
- networking is the host's (``--network host``): a pod hostname ``<job>-<i>.<subdomain>``
  and every Service name (``svc``, ``svc.ns``, ``svc.ns.svc.cluster.local``) resolve to
  127.0.0.1 inside the container, so torchrun's rendezvous and in-cluster URLs work. The
  names are cluster DNS: a Service created after a container started is added to that
  container's hosts file (podman's, bind-mounted at /etc/hosts) within a second;
- the API server is reachable from every pod, as in a cluster: kmock serves plain HTTP, so
  instead of a service-account token the kubelet mounts a kubeconfig naming it
  (``KUBECONFIG=/var/run/nemoflow-kubelet/kubeconfig``), which infra/k8s/config.py reads
  like any kubeconfig;
- the container's output is the pod log (served by the controller as text/plain with
  ``follow``/``timestamps``); its exit code and OOM flag become the container's
  ``terminated`` state and the pod's phase;
- a pod deleted through the API has its container killed (SIGKILL: the API server's
  grace period is not emulated);
- a Deployment's pod restarts when its container exits (``CrashLoopBackOff`` with
  ``restartCount``/``lastState`` in between), and its ``readinessProbe`` (HTTP GET) is
  really sent to the container: ``ready`` and the Deployment's ``readyReplicas`` follow
  the answers. A changed pod template is rolled out with the Recreate strategy.

Every container carries the label ``nemoflow.test/kubelet=<id>``;
:meth:`PodmanKubelet.stop` removes them all.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any

from deployments.image import podman
from infra.k8s.validation import quantity

if TYPE_CHECKING:
    from tests.k8s.controller import FakeCluster

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_MEMORY = f"{CGROUP_ROOT}/memory"
LABEL = "nemoflow.test/kubelet"
KUBECONFIG_IN_POD = "/var/run/nemoflow-kubelet/kubeconfig"
_FIELD_ANNOTATION = re.compile(r"^metadata\.annotations\['(.+)'\]$")
_FIELD_LABEL = re.compile(r"^metadata\.labels\['(.+)'\]$")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ContainerConfigError(Exception):
    """What the kubelet reports as CreateContainerConfigError (its message, word for word)."""


class PodmanKubelet:
    def __init__(self, *, probe_period_s: float = 0.5, restart_backoff_s: float = 1.0):
        self.id = uuid.uuid4().hex[:8]
        self.probe_period_s = probe_period_s
        self.restart_backoff_s = restart_backoff_s
        self.containers: dict[str, str] = {}  # pod name -> container name (running or not yet removed)
        self.commands: dict[str, list[str]] = {}  # pod name -> the podman command it ran (for tests)
        self.restarts: dict[str, int] = {}  # pod name -> restartCount
        self.kubeconfig: str | None = None  # written by start(): the API server, for pods
        # container name -> (its /etc/hosts on the host, the names already in it): cluster DNS
        self.hosts_files: dict[str, tuple[str, set[str]]] = {}
        self._started_names: dict[str, set[str]] = {}
        # podman's working directory: conmon drops a file named "oom" in its current directory
        # when the container it watches is OOM-killed (outside its cgroup: --cgroups=no-conmon)
        self.workdir = tempfile.mkdtemp(prefix=f"nemoflow-kubelet-{self.id}-")

    # --- what every pod of the cluster gets -------------------------------------------

    async def start(self, cluster: FakeCluster) -> asyncio.Task:
        """The API's kubeconfig for pods, and the task that publishes new Service names to running pods."""
        self.kubeconfig = os.path.join(self.workdir, "kubeconfig")
        with open(self.kubeconfig, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
                    "users": [{"name": "pod", "user": {}}],
                    "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "pod"}}],
                    "current-context": "kmock",
                },
                fh,
            )
        return asyncio.create_task(self._cluster_dns(cluster))

    @staticmethod
    def service_names(cluster: FakeCluster) -> set[str]:
        names: set[str] = set()
        for service in cluster.live("v1/services"):
            svc = service["metadata"]["name"]
            ns = service["metadata"].get("namespace", cluster.namespace)
            names |= {svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local"}
        return names

    async def _cluster_dns(self, cluster: FakeCluster) -> None:
        """Append the names of Services created since a container started to its hosts file."""
        while True:
            await asyncio.sleep(0.3)
            names = self.service_names(cluster)
            for container, (path, known) in list(self.hosts_files.items()):
                new = sorted(names - known)
                if not new:
                    continue
                try:
                    with open(path, "a", encoding="ascii") as fh:
                        fh.writelines(f"127.0.0.1\t{name}\n" for name in new)
                except OSError:
                    self.hosts_files.pop(container, None)  # the container is gone
                    continue
                known.update(new)

    async def _register_hosts(self, container_name: str) -> None:
        """Find the container's hosts file once podman has created it (for :meth:`_cluster_dns`)."""
        for _ in range(300):
            proc = await asyncio.create_subprocess_exec(
                *podman.command("inspect", "--format", "{{.HostsPath}}", container_name),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            out, _ = await proc.communicate()
            path = out.decode().strip()
            if proc.returncode == 0 and path:
                self.hosts_files[container_name] = (path, set(self._started_names.get(container_name, ())))
                return
            await asyncio.sleep(0.1)

    # --- the pod spec, resolved -------------------------------------------------------

    def resolve_env(self, cluster: FakeCluster, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        annotations = pod["metadata"].get("annotations") or {}
        if INDEX_ANNOTATION in annotations:
            env["JOB_COMPLETION_INDEX"] = annotations[INDEX_ANNOTATION]
        for item in container.get("env") or []:
            name = item["name"]
            if "value" in item:
                env[name] = str(item["value"])
                continue
            source = item.get("valueFrom")
            if source is None:
                env[name] = ""  # neither value nor valueFrom: the empty string, as Kubernetes sets it
            elif "secretKeyRef" in source:
                value = self._secret_value(cluster, source["secretKeyRef"])
                if value is not None:
                    env[name] = value
            elif "fieldRef" in source:
                env[name] = self._field_value(pod, source["fieldRef"]["fieldPath"])
            else:
                raise ContainerConfigError(f"env {name}: valueFrom {sorted(source)} is not supported here")
        return env

    def _secret_value(self, cluster: FakeCluster, ref: dict[str, Any]) -> str | None:
        secret = cluster.get("secrets", ref["name"])
        optional = bool(ref.get("optional"))
        if secret is None:
            if optional:
                return None
            raise ContainerConfigError(f'secret "{ref["name"]}" not found')
        data = secret.get("data") or {}
        if ref["key"] in data:
            return base64.b64decode(data[ref["key"]]).decode()
        if ref["key"] in (secret.get("stringData") or {}):
            return secret["stringData"][ref["key"]]
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {ref['key']} in Secret {cluster.namespace}/{ref['name']}")

    @staticmethod
    def _field_value(pod: dict[str, Any], path: str) -> str:
        meta = pod["metadata"]
        if path == "metadata.name":
            return meta["name"]
        if path == "metadata.namespace":
            return meta.get("namespace", "")
        for pattern, key in ((_FIELD_ANNOTATION, "annotations"), (_FIELD_LABEL, "labels")):
            match = pattern.match(path)
            if match:
                return str((meta.get(key) or {}).get(match.group(1), ""))
        raise ContainerConfigError(f"fieldRef {path} is not supported here")

    def volume_args(self, cluster: FakeCluster, pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        args: list[str] = []
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            target = mount["mountPath"]
            if "persistentVolumeClaim" in volume:
                root = cluster.pvc_dirs[volume["persistentVolumeClaim"]["claimName"]]
                source = os.path.join(root, mount.get("subPath") or "")
                os.makedirs(source, exist_ok=True)  # the kubelet creates a missing subPath directory
                args += ["--volume", f"{source}:{target}" + (":ro" if mount.get("readOnly") else "")]
            elif "emptyDir" in volume:
                limit = volume["emptyDir"].get("sizeLimit")
                if target == "/dev/shm" and volume["emptyDir"].get("medium") == "Memory":
                    args += ["--shm-size", str(int(quantity(limit, "sizeLimit"))) if limit else "1g"]
                else:
                    size = f",tmpfs-size={int(quantity(limit, 'sizeLimit'))}" if limit else ""
                    args += ["--mount", f"type=tmpfs,destination={target}{size}"]
            else:
                raise ContainerConfigError(f"volume {mount['name']}: only PVCs and emptyDirs are emulated")
        return args

    def resource_args(self, pod_name: str, container: dict[str, Any]) -> list[str]:
        limits = (container.get("resources") or {}).get("limits") or {}
        args: list[str] = []
        if "memory" in limits:
            memory = int(quantity(limits["memory"], "limits.memory"))
            parent = self._pod_cgroup(pod_name, memory)
            if parent:
                # the limit sits on a pod-level cgroup, as the kubelet's does; conmon stays outside it
                args += ["--cgroups=no-conmon", f"--cgroup-parent=/{parent}"]
            else:
                args += ["--memory", str(memory), "--memory-swap", str(memory)]
        if "cpu" in limits:
            args += ["--cpus", str(float(quantity(limits["cpu"], "limits.cpu")))]
        return args

    @classmethod
    def host_names(cls, cluster: FakeCluster, pod: dict[str, Any], job: dict[str, Any] | None) -> set[str]:
        names: set[str] = set()
        subdomain = pod["spec"].get("subdomain")
        if subdomain and job is not None:
            owner = job["metadata"]["name"]
            for i in range(job["spec"].get("completions") or 1):
                names |= {f"{owner}-{i}.{subdomain}", f"{owner}-{i}.{subdomain}.{cluster.namespace}.svc.cluster.local"}
        return names | cls.service_names(cluster)

    @classmethod
    def host_args(cls, cluster: FakeCluster, pod: dict[str, Any], job: dict[str, Any] | None) -> list[str]:
        names = cls.host_names(cluster, pod, job)
        return [arg for name in sorted(names) for arg in ("--add-host", f"{name}:127.0.0.1")]

    def command(
        self, cluster: FakeCluster, pod: dict[str, Any], job: dict[str, Any] | None
    ) -> tuple[list[str], dict[str, str]]:
        """The ``podman run`` command for the pod's first container, and the environment to run it with.

        Values reach podman through its own environment (``--env NAME`` without a value), so a
        secret never appears on a command line.
        """
        container = pod["spec"]["containers"][0]
        env = self.resolve_env(cluster, pod, container)
        name = f"nf-{self.id}-{pod['metadata']['name']}"[:253]
        api: list[str] = []
        if self.kubeconfig and "KUBECONFIG" not in env:
            env["KUBECONFIG"] = KUBECONFIG_IN_POD
            api = ["--volume", f"{self.kubeconfig}:{KUBECONFIG_IN_POD}:ro"]
        self._started_names[name] = self.host_names(cluster, pod, job)
        args = [
            "--name",
            name,
            "--replace",
            "--label",
            f"{LABEL}={self.id}",
            "--pull",
            "never",
            "--network",
            "host",
            *self.host_args(cluster, pod, job),
            *self.volume_args(cluster, pod, container),
            *api,
            *self.resource_args(pod["metadata"]["name"], container),
            *[arg for key in sorted(env) for arg in ("--env", key)],
        ]
        if container.get("workingDir"):
            args += ["--workdir", container["workingDir"]]
        if container.get("command"):
            args += ["--entrypoint", json.dumps(container["command"])]
        args += [container["image"], *(container.get("args") or [])]
        return podman.run_args(*args), {**os.environ, **env}

    # --- running a pod ----------------------------------------------------------------

    async def run_pod(self, cluster: FakeCluster, pod_name: str, job: dict[str, Any] | None) -> bool:
        """Run the pod to its end (a Job's pod); True if its container exited 0."""
        pod = cluster.get("pods", pod_name)
        if pod is None:
            return False
        blocked = await self._admit(cluster, pod, job)
        if blocked is not None:
            return await blocked
        try:
            exit_code, oom = await self._run_container(cluster, pod, job, restart_count=0)
            terminated = _terminated(exit_code, oom)
            await self._patch_pod(
                cluster,
                pod_name,
                {
                    "status": {
                        "phase": "Succeeded" if exit_code == 0 else "Failed",
                        "containerStatuses": [_status(pod, ready=False, state={"terminated": terminated})],
                    }
                },
            )
        finally:
            # leaves "running" only now: a log follower that sees the stream end finds the pod terminated
            cluster.running.discard(pod_name)
        return exit_code == 0

    @staticmethod
    async def _patch_pod(cluster: FakeCluster, pod_name: str, body: dict[str, Any]) -> None:
        """Patch the pod's status unless it was deleted meanwhile (its Job was cancelled)."""
        if cluster.get("pods", pod_name) is not None:
            await cluster._patch(cluster.pod_path(pod_name), body)

    async def _admit(self, cluster: FakeCluster, pod: dict[str, Any], job: dict[str, Any] | None):
        """None if the pod can start; else an awaitable that never returns (the pod stays stuck)."""
        name = pod["metadata"]["name"]
        for volume in pod["spec"].get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and (claim not in cluster.pvc_dirs or cluster.get("persistentvolumeclaims", claim) is None):
                await cluster._patch(
                    cluster.pod_path(name),
                    {
                        "status": {
                            "conditions": [
                                {
                                    "type": "PodScheduled",
                                    "status": "False",
                                    "reason": "Unschedulable",
                                    "message": f'0/1 nodes are available: persistentvolumeclaim "{claim}" not found.',
                                }
                            ]
                        }
                    },
                )
                return cluster._forever()
        container = pod["spec"]["containers"][0]
        waiting = None
        try:
            self.command(cluster, pod, job)
        except ContainerConfigError as exc:
            waiting = {"reason": "CreateContainerConfigError", "message": str(exc)}
        if waiting is None and not await asyncio.to_thread(podman.image_exists, container["image"]):
            waiting = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{container["image"]}"'}
        if waiting is None:
            return None
        await cluster._patch(
            cluster.pod_path(name),
            {
                "status": {
                    "phase": "Pending",
                    "containerStatuses": [_status(pod, ready=False, state={"waiting": waiting})],
                }
            },
        )
        return cluster._forever()

    async def _run_container(
        self, cluster: FakeCluster, pod: dict[str, Any], job: dict[str, Any] | None, *, restart_count: int
    ) -> tuple[int, bool]:
        """Start the container, stream its output into the pod log, wait; (exit code, OOM-killed)."""
        pod_name = pod["metadata"]["name"]
        cmd, env = self.command(cluster, pod, job)
        container_name = cmd[cmd.index("--name") + 1]
        self.commands[pod_name] = cmd
        self.containers[pod_name] = container_name
        cluster.logs.setdefault(pod_name, [])
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            env=env,
            cwd=self.workdir,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            limit=2**22,
        )
        cluster.running.add(pod_name)
        registration = asyncio.create_task(self._register_hosts(container_name))
        await self._patch_pod(
            cluster,
            pod_name,
            {
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        _status(pod, ready=False, state={"running": {"startedAt": _now()}}, restarts=restart_count)
                    ],
                }
            },
        )
        watcher = asyncio.create_task(self._kill_when_deleted(cluster, pod_name, container_name))
        try:
            assert proc.stdout is not None
            async for raw in proc.stdout:
                cluster.logs[pod_name].append((time.time(), raw.decode("utf-8", "replace").rstrip("\r\n")))
            exit_code = await proc.wait()
            oom = await asyncio.to_thread(self._oom_killed, pod_name, container_name, exit_code)
            return exit_code, oom
        except BaseException:
            cluster.running.discard(pod_name)
            raise
        finally:
            watcher.cancel()
            registration.cancel()
            self.hosts_files.pop(container_name, None)
            # cancelled or done: the container goes (a cancelled run_pod is the Job controller giving up)
            self._remove(container_name)
            self._remove_cgroup(pod_name)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def _kill_when_deleted(self, cluster: FakeCluster, pod_name: str, container_name: str) -> None:
        while cluster.get("pods", pod_name) is not None:
            await asyncio.sleep(0.2)
        await asyncio.to_thread(self._remove, container_name)

    # --- OOM: a pod-level memory cgroup -------------------------------------------------
    # podman (runc, cgroup v1) here reports OOMKilled=false for a container the kernel's
    # OOM killer ended, and the container's cgroup is gone by the time it exits. So the
    # memory limit is set on a pod cgroup that outlives the container (as the kubelet's pod
    # cgroups do): a SIGKILL'd container whose pod cgroup hit its limit (memory.failcnt > 0)
    # was OOM-killed. Without a writable cgroup v1 memory hierarchy, podman's --memory and
    # its own OOMKilled report are used instead.

    def _cgroup_name(self, pod_name: str) -> str:
        return f"nemoflow-kubelet-{self.id}-{pod_name}"[:200]

    def _pod_cgroup(self, pod_name: str, memory: int) -> str | None:
        path = os.path.join(CGROUP_MEMORY, self._cgroup_name(pod_name))
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "memory.limit_in_bytes"), "w") as fh:
                fh.write(str(memory))
        except OSError:
            return None
        return self._cgroup_name(pod_name)

    def _oom_killed(self, pod_name: str, container_name: str, exit_code: int) -> bool:
        failcnt = os.path.join(CGROUP_MEMORY, self._cgroup_name(pod_name), "memory.failcnt")
        if os.path.exists(failcnt):
            with open(failcnt) as fh:
                return exit_code == 137 and int(fh.read() or 0) > 0
        proc = subprocess.run(
            podman.command("inspect", "--format", "{{.State.OOMKilled}}", container_name),
            check=False,
            capture_output=True,
            text=True,
        )
        return proc.stdout.strip() == "true"

    def _remove_cgroup(self, pod_name: str) -> None:
        name = self._cgroup_name(pod_name)
        for controller in glob.glob(f"{CGROUP_ROOT}/*/{name}"):
            for root, _, _ in sorted(os.walk(controller), key=lambda item: -len(item[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(root)

    def _remove(self, container_name: str) -> None:
        subprocess.run(
            podman.command("rm", "--force", "--time", "0", "--ignore", container_name),
            check=False,
            capture_output=True,
        )

    # --- Deployments --------------------------------------------------------------------

    async def drive_deployment(self, cluster: FakeCluster, dep: dict[str, Any]) -> None:
        """One replica, restarted when it exits, readiness from its probe; Recreate on a new template."""
        name = dep["metadata"]["name"]
        path = f"/apis/apps/v1/namespaces/{cluster.namespace}/deployments/{name}"
        generation = 0
        while True:
            current = cluster.get("deployments", name)
            if current is None:
                return
            generation += 1
            template = json.dumps(current["spec"]["template"], sort_keys=True)
            pod_name = await cluster._make_pod(name, current["spec"]["template"], None, suffix=f"r{generation}")
            await cluster._patch(
                path, {"status": {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 0, "availableReplicas": 0}}
            )
            pod = cluster.get("pods", pod_name)
            blocked = await self._admit(cluster, pod, None)
            runner = asyncio.create_task(self._serve(cluster, pod) if blocked is None else blocked)
            prober = asyncio.create_task(self._probe(cluster, pod, path))
            try:
                while True:
                    await asyncio.sleep(0.2)
                    latest = cluster.get("deployments", name)
                    if latest is None or json.dumps(latest["spec"]["template"], sort_keys=True) != template:
                        break
            finally:
                runner.cancel()
                prober.cancel()
                await asyncio.gather(runner, prober, return_exceptions=True)
                async with cluster._session.delete(cluster.pod_path(pod_name)):
                    pass
                if pod_name in self.containers:
                    await asyncio.to_thread(self._remove, self.containers[pod_name])

    async def _serve(self, cluster: FakeCluster, pod: dict[str, Any]) -> None:
        restarts = 0
        while True:
            exit_code, oom = await self._run_container(cluster, pod, None, restart_count=restarts)
            restarts += 1
            self.restarts[pod["metadata"]["name"]] = restarts
            cluster.running.discard(pod["metadata"]["name"])
            await self._patch_pod(
                cluster,
                pod["metadata"]["name"],
                {
                    "status": {
                        "containerStatuses": [
                            _status(
                                pod,
                                ready=False,
                                restarts=restarts,
                                state={
                                    "waiting": {
                                        "reason": "CrashLoopBackOff",
                                        "message": f"back-off restarting failed container {pod['spec']['containers'][0]['name']}",
                                    }
                                },
                                last={"terminated": _terminated(exit_code, oom)},
                            )
                        ]
                    }
                },
            )
            await asyncio.sleep(self.restart_backoff_s)

    async def _probe(self, cluster: FakeCluster, pod: dict[str, Any], deployment_path: str) -> None:
        container = pod["spec"]["containers"][0]
        probe = (container.get("readinessProbe") or {}).get("httpGet")
        pod_name = pod["metadata"]["name"]
        ready = False
        failures = 0
        threshold = (container.get("readinessProbe") or {}).get("failureThreshold", 3)
        while True:
            await asyncio.sleep(self.probe_period_s)
            if pod_name not in cluster.running:
                ok = False
            elif probe is None:
                ok = True  # no probe: ready once running
            else:
                ok = await asyncio.to_thread(_http_ok, _probe_url(container, probe))
            failures = 0 if ok else failures + 1
            if ok == ready or (not ok and ready and failures < threshold):
                continue
            ready = ok
            status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
            if pod_name in cluster.running:
                running = {"running": {"startedAt": _now()}}
                restarts = self.restarts.get(pod_name, 0)
                status["containerStatuses"] = [_status(pod, ready=ready, state=running, restarts=restarts)]
            await self._patch_pod(cluster, pod_name, {"status": status})
            count = 1 if ready else 0
            await cluster._patch(deployment_path, {"status": {"readyReplicas": count, "availableReplicas": count}})

    def stop(self) -> None:
        """Remove every container this kubelet started (running or not)."""
        listed = subprocess.run(
            podman.command("ps", "--all", "--quiet", "--filter", f"label={LABEL}={self.id}"),
            check=False,
            capture_output=True,
            text=True,
        ).stdout.split()
        if listed:
            subprocess.run(podman.command("rm", "--force", "--time", "0", *listed), check=False, capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _probe_url(container: dict[str, Any], probe: dict[str, Any]) -> str:
    port = probe["port"]
    if isinstance(port, str) and not port.isdigit():
        port = next(p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port)
    return f"http://127.0.0.1:{port}{probe.get('path') or '/'}"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return 200 <= resp.status < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _terminated(exit_code: int, oom: bool) -> dict[str, Any]:
    reason = "OOMKilled" if oom else "Completed" if exit_code == 0 else "Error"
    return {"exitCode": exit_code, "reason": reason, "finishedAt": _now()}


def _status(
    pod: dict[str, Any],
    *,
    ready: bool,
    state: dict[str, Any],
    restarts: int = 0,
    last: dict[str, Any] | None = None,
) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    status = {
        "name": container["name"],
        "ready": ready,
        "restartCount": restarts,
        "image": container["image"],
        "imageID": "",
        "state": state,
    }
    if last:
        status["lastState"] = last
    return status

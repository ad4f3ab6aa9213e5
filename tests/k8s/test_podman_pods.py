"""The Kubernetes backend with pods that really run: kmock + the stand-in controller + podman (tests/k8s/kubelet.py).

Each JobSpec/ServiceSpec goes through KubernetesBackend.run()/start_service() exactly
as against a cluster; the controller makes the pods and the kubelet runs their
containers from the nemoflow CPU image built by tests/image_build, with the workspace
PVC as a host directory at /nemo-workspace and env/Secrets resolved from the API.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import textwrap
import time
import urllib.request

import pytest
import pytest_asyncio

from deployments.image import podman
from infra.backends.k8s import cancel_in_flight
from infra.jobs import JobSpec, JobState, Resources, ServiceSpec
from infra.k8s.options import K8sOptions
from tests.conftest import free_port
from tests.k8s.conftest import NAMESPACE, SECRET_VALUES
from tests.k8s.controller import FakeCluster
from tests.k8s.kubelet import LABEL, PodmanKubelet

pytestmark = pytest.mark.slow


@pytest_asyncio.fixture
async def pods(kmock, tmp_path, nemoflow_image):
    """A namespace whose pods run as podman containers; the PVC 'workspace' is tmp_path/pvc."""
    kubelet = PodmanKubelet(probe_period_s=0.3, restart_backoff_s=0.5)
    fake = FakeCluster(kmock, NAMESPACE, kubelet=kubelet)
    fake.add_namespace()
    fake.add_pvc("workspace", host_dir=tmp_path / "pvc")
    fake.add_service_account("nemoflow")
    fake.add_secret("nemoflow-secrets", SECRET_VALUES)
    await fake.start()
    yield fake
    # every finished, deleted or cancelled pod's container is gone before the cluster stops
    left = await _wait_gone(kubelet, running_only=False)
    await fake.stop()
    assert not left, f"containers left behind: {left}"


async def _wait_gone(kubelet: PodmanKubelet, *, running_only: bool, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = await asyncio.to_thread(_containers, kubelet, running_only=running_only)
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.2)


@pytest.fixture
def backend(make_backend, k8s_options, nemoflow_image):
    def make(cluster, **kwargs):
        options = K8sOptions(**{**k8s_options.model_dump(), "image": nemoflow_image, **kwargs.pop("options", {})})
        return make_backend(cluster, options=options, **kwargs)

    return make


def _containers(kubelet: PodmanKubelet, *, running_only: bool = False) -> list[str]:
    args = ["ps", "--quiet", "--filter", f"label={LABEL}={kubelet.id}"]
    if not running_only:
        args.insert(1, "--all")
    return subprocess.run(podman.command(*args), capture_output=True, text=True, check=True).stdout.split()


async def run(backend, spec: JobSpec):
    lines: list[str] = []
    result = await asyncio.to_thread(backend.run, spec, lines.append)
    return result, lines


SHARD = textwrap.dedent(
    """
    import hashlib, json, os
    i = os.environ["NEMOFLOW_ARRAY_INDEX"]
    out = {"index": i, "job_completion_index": os.environ["JOB_COMPLETION_INDEX"],
           "token_ok": hashlib.sha256(os.environ["HF_TOKEN"].encode()).hexdigest() == os.environ["TOKEN_SHA"],
           "greeting": os.environ["GREETING"], "cwd": os.getcwd()}
    os.makedirs("/nemo-workspace/out", exist_ok=True)
    with open(f"/nemo-workspace/out/{i}.json", "w") as fh:
        json.dump(out, fh)
    print(f"shard {i} wrote /nemo-workspace/out/{i}.json", flush=True)
    print("token", os.environ["HF_TOKEN"], flush=True)
    """
)


async def test_indexed_job_runs_each_pod_as_a_container(pods, backend, secret_env, tmp_path):
    spec = JobSpec(
        name="shard",
        command=["python", "-c", SHARD],
        env={"GREETING": "hi", "TOKEN_SHA": hashlib.sha256(secret_env["HF_TOKEN"].encode()).hexdigest()},
        secret_env=["HF_TOKEN"],
        array_size=3,
        workdir="/opt/nemoflow",
    )
    result, lines = await run(backend(pods), spec)

    assert result.state is JobState.COMPLETED and result.exit_code == 0, result
    for i in range(3):
        written = json.loads((tmp_path / "pvc" / "out" / f"{i}.json").read_text())
        assert written == {
            "index": str(i),
            "job_completion_index": str(i),
            "token_ok": True,
            "greeting": "hi",
            "cwd": "/opt/nemoflow",
        }
        assert f"[{i}] shard {i} wrote /nemo-workspace/out/{i}.json" in lines
    # the container printed the real token; the backend redacted it before the Prefect log
    assert sum(line.endswith("token ***") for line in lines) == 3
    assert not any(secret_env["HF_TOKEN"] in line for line in lines)
    # the token travelled by podman's environment, never on a command line
    assert not any(secret_env["HF_TOKEN"] in " ".join(cmd) for cmd in pods.kubelet.commands.values())
    assert not _containers(pods.kubelet), "finished containers are removed"


async def test_exit_code_becomes_the_job_result(pods, backend):
    spec = JobSpec(name="bad", command=["sh", "-c", "echo 'bad input: no such shard' >&2; exit 3"])
    result, lines = await run(backend(pods), spec)
    assert result.state is JobState.FAILED and result.exit_code == 3, result
    assert "BackoffLimitExceeded" in result.reason and "exit code 3" in result.reason
    assert "bad input: no such shard" in lines


async def test_memory_limit_is_enforced_by_the_kernel(pods, backend):
    hog = "b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('survived')"
    spec = JobSpec(name="hog", command=["python", "-c", hog], resources=Resources(mem="128M"))
    result, lines = await run(backend(pods), spec)
    assert result.state is JobState.OUT_OF_MEMORY, result
    assert "OOMKilled" in result.reason and "survived" not in lines


async def test_time_limit_stops_the_container(pods, backend):
    spec = JobSpec(name="slow", command=["sh", "-c", "echo started; sleep 300"], resources=Resources(time="0:04"))
    started = time.monotonic()
    result, lines = await run(backend(pods), spec)
    assert result.state is JobState.TIMEOUT and "DeadlineExceeded" in result.reason, result
    assert "started" in lines and time.monotonic() - started < 60
    assert not await _wait_gone(pods.kubelet, running_only=True), "the container outlived its deleted pod"


async def test_missing_image_fails_as_image_pull_backoff(pods, backend):
    spec = JobSpec(name="noimg", command=["true"], container_image="localhost/nemoflow-test:no-such-tag")
    result, _ = await run(backend(pods), spec)
    assert result.state is JobState.FAILED
    assert "ImagePullBackOff" in result.reason and "localhost/nemoflow-test:no-such-tag" in result.reason


async def test_cancelling_a_run_kills_its_container(pods, backend):
    spec = JobSpec(name="forever", command=["sh", "-c", "echo up; sleep 600"])
    task = asyncio.ensure_future(run(backend(pods), spec))
    for _ in range(300):
        # the pod is marked running before podman has the container up: wait for both
        if pods.running and _containers(pods.kubelet, running_only=True):
            break
        await asyncio.sleep(0.1)
    assert pods.running and _containers(pods.kubelet, running_only=True)
    assert await asyncio.to_thread(cancel_in_flight) == 1
    result, _ = await asyncio.wait_for(task, 60)
    assert result.state is JobState.CANCELLED
    assert not await _wait_gone(pods.kubelet, running_only=True), "the cancelled run's container still runs"


RENDEZVOUS = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    rank = int(os.environ["NODE_RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=int(os.environ["NNODES"]))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    print(f"rank {rank} of {dist.get_world_size()} sum {t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


async def test_two_node_job_rendezvous_over_the_headless_service_names(pods, backend):
    port = free_port()
    spec = JobSpec(name="ddp", command=["python", "-c", RENDEZVOUS], resources=Resources(nodes=2))
    result, lines = await run(backend(pods, options={"rendezvous_port": port}), spec)
    assert result.state is JobState.COMPLETED, (result, lines)
    assert "[0] rank 0 of 2 sum 3" in lines and "[1] rank 1 of 2 sum 3" in lines


async def test_deployment_is_ready_only_when_its_probe_answers(pods, backend):
    port = free_port()
    spec = ServiceSpec(
        name="echo",
        command=["sh", "-c", f"sleep 3; exec python -m http.server {port} --bind 127.0.0.1"],
        port=port,
        health_path="/",
    )
    be = backend(pods)
    url = (await asyncio.to_thread(be.start_service, spec)).url
    assert url == f"http://echo.{NAMESPACE}.svc.cluster.local:{port}"
    # ready means the container answers now (the server only listens after 3 s)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
        assert resp.status == 200
    dep = pods.get("deployments", "echo")
    assert dep["status"]["readyReplicas"] == 1
    await asyncio.to_thread(be.stop_service, "echo")
    assert not await _wait_gone(pods.kubelet, running_only=True), "stop_service leaves no server running"


async def test_crashing_server_fails_start_service_with_crash_loop(pods, backend):
    spec = ServiceSpec(name="crash", command=["sh", "-c", "echo cannot load the checkpoint; exit 1"], port=free_port())
    with pytest.raises(RuntimeError, match=r"CrashLoopBackOff .*exit code 1"):
        await asyncio.to_thread(backend(pods).start_service, spec)
    assert pods.get("deployments", "crash") is None, "a service that cannot start is removed"


IN_CLUSTER = textwrap.dedent(
    """
    import socket, time
    from kubernetes import client
    from infra.k8s.config import api_client
    mine = [p.metadata.name for p in client.CoreV1Api(api_client()).list_namespaced_pod("team").items]
    print("api sees", [n for n in mine if n.startswith("incluster-")], flush=True)
    name = "late.team.svc.cluster.local"
    try:
        socket.gethostbyname(name)
        print("resolved too early", flush=True)
    except OSError:
        print("waiting for", name, flush=True)
    deadline = time.time() + 60
    while True:
        try:
            print("resolved", name, socket.gethostbyname(name), flush=True)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    """
)


async def test_pods_reach_the_api_and_resolve_services_created_after_they_started(pods, backend):
    """A flow-run pod submits stage Jobs through the API and calls a Service it did not see start."""
    from kubernetes import client as k

    be = backend(pods)
    task = asyncio.ensure_future(run(be, JobSpec(name="incluster", command=["python", "-c", IN_CLUSTER])))
    for _ in range(600):
        if any(text.startswith("waiting for") for logged in pods.logs.values() for _, text in logged):
            break
        assert not task.done(), task.result()
        await asyncio.sleep(0.1)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "late", "namespace": NAMESPACE},
        "spec": {"selector": {"app": "late"}, "ports": [{"port": 8080}]},
    }
    await asyncio.to_thread(k.CoreV1Api(be.api).create_namespaced_service, NAMESPACE, service)
    result, lines = await asyncio.wait_for(task, 120)
    assert result.state is JobState.COMPLETED, (result, lines)
    assert any(line.startswith("api sees ['incluster-") for line in lines), lines
    assert "resolved late.team.svc.cluster.local 127.0.0.1" in lines and "resolved too early" not in lines

"""A started end-to-end/k8s run cancelled, or its flow-run pod killed, through prefect-kubernetes' real worker,
with every pod a container.

The set-up is tests/e2e/test_end_to_end_k8s.py's (the API stand-in, tests/k8s/controller.py + kubelet.py running
each pod as a podman container of the CPU image built from this checkout, the shipped pool and deployment); the
run is cancelled with ``prefect flow-run cancel`` (what the UI's Cancel does: the run goes Cancelling) while its
training Job's pod runs; or the flow-run pod's container is SIGKILLed then, and the deployment is run again.

What delivers a cancel to a started run in Prefect 3.9.1: not the worker (``BaseWorker._cancel_run`` in
prefect/workers/base.py returns at once for a run whose ``start_time`` is set; it kills only runs still pending),
but the flow-run pod's own supervisor, ``prefect flow-run execute`` (prefect/cli/flow_run.py): its
``FlowRunExecutorContext`` (prefect/runner/_flow_run_executor.py) runs a ``FlowRunCancellingObserver`` on the
run's ``prefect.flow-run.Cancelling`` event and its ``CancellationManager`` sends the engine process SIGTERM with
the intent ``cancel``; the engine raises ``TerminationSignal`` through the running stage, whose
``KubernetesBackend.run`` deletes its Job and pods in ``finally``, and ends the run Cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.test_end_to_end_k8s import _prefect, shipped_image, shipped_job_variables  # noqa: F401 - fixture
from tests.support import fault_ledger
from tests.support.kube import KubeApi
from tests.support.kube_worker import kubernetes_worker, log_tail, write_kubeconfig
from tests.support.tiny import TINY_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.kmock(cls=KubeApi)]
RUN_LABEL = "nemoflow.io/flow-run"


def _stage_jobs(cluster, run_id: str, prefix: str) -> list[str]:
    """The run's stage Jobs named ``prefix...`` (the backend labels Jobs with their flow run)."""
    return [
        j["metadata"]["name"]
        for j in cluster.live("batch/v1/jobs")
        if j["metadata"]["name"].startswith(prefix) and (j["metadata"].get("labels") or {}).get(RUN_LABEL) == run_id
    ]


def _pods_of(cluster, job: str) -> list[str]:
    return [p["metadata"]["name"] for p in cluster.live("v1/pods") if p["metadata"]["name"].startswith(job + "-")]


async def _deploy(prefect_server: str, env: dict, cluster, tmp_path) -> Path:
    """The work pools and `end-to-end/k8s` deployed; a kubeconfig for the worker, naming the stand-in API."""
    from devtools.prefect_local import ensure_pools

    await asyncio.to_thread(ensure_pools, prefect_server)
    await asyncio.to_thread(_prefect, ["--no-prompt", "deploy", "--name", "end-to-end/k8s"], env)
    return write_kubeconfig(tmp_path / "kubeconfig", cluster.url)


@pytest.mark.faults
@pytest.mark.usefixtures("shipped_image")  # the pool's image name, built from this checkout
async def test_cancelling_a_started_run_deletes_its_stage_job_and_ends_it_cancelled(kmock, prefect_server, tmp_path):
    from prefect.client.orchestration import get_client

    from tests.k8s.controller import FakeCluster
    from tests.k8s.kubelet import PodmanKubelet

    variables = shipped_job_variables()
    ns = variables["namespace"]
    kubelet = PodmanKubelet(probe_period_s=0.5)
    cluster = FakeCluster(kmock, ns, kubelet=kubelet)
    cluster.add_namespace()
    cluster.add_pvc(variables["pvc_name"], host_dir=tmp_path / "pvc")
    cluster.add_service_account(variables["service_account_name"])
    cluster.add_secret(variables["secret_name"], {"NEMOFLOW_SERVE_API_KEY": "sk-cancel-SENTINEL-1"})
    await cluster.start()
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    # a long training run: it is cancelled while its pod runs
    config = {
        "executor": {"kind": "k8s"},
        "data": {"workers": 1},
        "train": {**TINY_TRAIN, "max_steps": 2000},
        "serve": {"port": free_port(), "model_name": "nemoflow-k8s-cancel"},
        "validation_threshold": 9.5,
    }
    worker_log = tmp_path / "worker.log"
    try:
        kubeconfig = await _deploy(prefect_server, env, cluster, tmp_path)
        with kubernetes_worker("nemoflow-k8s", prefect_server, kubeconfig, worker_log) as worker:
            started = await asyncio.to_thread(
                _prefect, ["deployment", "run", "end-to-end/k8s", "--params", json.dumps({"config": config})], env
            )
            run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", started).group(1)
            deadline = time.monotonic() + 900
            while not [
                p for j in _stage_jobs(cluster, run_id, "train-") for p in _pods_of(cluster, j) if p in cluster.running
            ]:
                assert worker.poll() is None and time.monotonic() < deadline, log_tail(worker_log)
                async with get_client() as client:
                    run = await client.read_flow_run(run_id)
                assert not run.state.is_final(), f"{run.state}: ended before its training pod ran"
                await asyncio.sleep(2)
            (train_job,) = _stage_jobs(cluster, run_id, "train-")

            row = fault_ledger.open_row("k8s: a started run cancelled (prefect flow-run cancel) during a stage Job")
            row.watch_runs([run_id])
            await asyncio.to_thread(_prefect, ["flow-run", "cancel", run_id], env)
            row.injected += 1
            deadline = time.monotonic() + 180
            async with get_client() as client:
                while not (run := await client.read_flow_run(run_id)).state.is_final():
                    assert time.monotonic() < deadline, f"{run.state} 180 s after the cancel\n{log_tail(worker_log)}"
                    await asyncio.sleep(2)
            await cluster.settle()
            assert run.state.is_cancelled(), f"{run.state}\n{log_tail(worker_log)}"
            assert cluster.get("jobs", train_job) is None, "the training Job was deleted"
            assert not _pods_of(cluster, train_job), "and its pods"
            # nothing of the run runs: no container of any of its pods (the flow-run pod's ended too)
            deadline = time.monotonic() + 60
            while [p for p in cluster.running if p.startswith(train_job)]:
                assert time.monotonic() < deadline, sorted(cluster.running)
                await asyncio.sleep(1)
            flow_job = run.infrastructure_pid.split(":", 1)[1]
            # who did it: the stage's own backend, in the flow-run pod, deleted the training Job (Foreground);
            # the worker never deleted the flow-run Job (its kill_infrastructure is for pending runs only)
            deletes = {
                r.url.path.rsplit("/", 1)[-1]: r for r in kmock if r.method == "DELETE" and "/jobs/" in r.url.path
            }
            assert deletes[train_job].data["propagationPolicy"] == "Foreground", sorted(deletes)
            assert flow_job not in deletes, sorted(deletes)
            while [p for p in cluster.running if p.startswith(flow_job)]:
                assert time.monotonic() < deadline, sorted(cluster.running)
                await asyncio.sleep(1)
    finally:
        await cluster.stop()


def _saved_checkpoints(root) -> list:
    """Training checkpoints on the PVC that are complete (AutoModel's ``.incomplete`` marker gone)."""
    found = []
    for run in root.glob("nemoflow/runs/*/checkpoints"):
        with contextlib.suppress(FileNotFoundError):  # the trainer prunes old ones meanwhile
            found += [d for d in run.iterdir() if d.name.startswith("epoch_") and not (d / ".incomplete").exists()]
    return found


async def _final(run_id: str, timeout_s: float):
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while not (run := await client.read_flow_run(run_id)).state.is_final():
            assert time.monotonic() < deadline, f"{run.state} after {timeout_s} s"
            await asyncio.sleep(2)
    return run


@pytest.mark.faults
@pytest.mark.usefixtures("shipped_image")
async def test_a_run_whose_flow_run_pod_is_killed_ends_crashed_and_its_retry_resumes_training(
    kmock, prefect_server, tmp_path
):
    from kubernetes import client as k

    from deployments.image import podman
    from infra.k8s.config import api_client_for_url
    from tests.k8s.controller import FakeCluster
    from tests.k8s.kubelet import PodmanKubelet

    variables = shipped_job_variables()
    ns = variables["namespace"]
    pvc = tmp_path / "pvc"
    kubelet = PodmanKubelet(probe_period_s=0.5)
    cluster = FakeCluster(kmock, ns, kubelet=kubelet)
    cluster.add_namespace()
    cluster.add_pvc(variables["pvc_name"], host_dir=pvc)
    cluster.add_service_account(variables["service_account_name"])
    cluster.add_secret(variables["secret_name"], {"NEMOFLOW_SERVE_API_KEY": "sk-crash-SENTINEL-2"})
    await cluster.start()
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    model = "nemoflow-k8s-crash"
    config = {
        "executor": {"kind": "k8s"},
        "data": {"workers": 1},
        "train": {**TINY_TRAIN, "max_steps": 400},
        "serve": {"port": free_port(), "model_name": model},
        "validation_threshold": 9.5,
    }
    params = ["--params", json.dumps({"config": config})]
    batch = k.BatchV1Api(api_client_for_url(cluster.url))
    worker_log = tmp_path / "worker.log"
    try:
        kubeconfig = await _deploy(prefect_server, env, cluster, tmp_path)
        with kubernetes_worker("nemoflow-k8s", prefect_server, kubeconfig, worker_log) as worker:
            started = await asyncio.to_thread(_prefect, ["deployment", "run", "end-to-end/k8s", *params], env)
            first = re.search(r"UUID:\s*([0-9a-f-]{36})", started).group(1)
            deadline = time.monotonic() + 900
            training = []
            while not (training and _saved_checkpoints(pvc)):
                assert worker.poll() is None and time.monotonic() < deadline, log_tail(worker_log)
                await asyncio.sleep(0.5)
                training = [
                    p
                    for j in _stage_jobs(cluster, first, "train-")
                    for p in _pods_of(cluster, j)
                    if p in cluster.running
                ]
            print(f"training pod {training} running, checkpoints {_saved_checkpoints(pvc)}", flush=True)
            (train_job,) = _stage_jobs(cluster, first, "train-")
            from prefect.client.orchestration import get_client

            async with get_client() as client:
                flow_job = (await client.read_flow_run(first)).infrastructure_pid.split(":", 1)[1]
            (flow_pod,) = _pods_of(cluster, flow_job)

            row = fault_ledger.open_row("k8s: the flow-run pod killed (SIGKILL) during training; a retry resumes")
            row.watch_runs([first])
            killed = await asyncio.to_thread(
                podman.subprocess.run,
                podman.command("kill", "--signal", "KILL", kubelet.containers[flow_pod]),
                capture_output=True,
            )
            row.injected += killed.returncode == 0
            assert killed.returncode == 0, killed.stderr
            print(f"killed the flow-run pod {flow_pod}: {killed.returncode}", flush=True)
            crashed = await _final(first, 180)
            assert crashed.state.is_crashed(), f"{crashed.state}\n{log_tail(worker_log)}"

            # what happens then: the worker's observer marked the run Crashed and deleted nothing; the run's
            # training Job still runs, owned by the flow-run Job (Failed, kept until its TTL, which the stand-in
            # has no controller for): deleting that Job as its TTL would takes the training Job with it
            assert cluster.get("jobs", train_job) is not None
            await asyncio.to_thread(batch.delete_namespaced_job, flow_job, ns, propagation_policy="Background")
            deadline = time.monotonic() + 60
            while cluster.get("jobs", train_job) is not None or [p for p in cluster.running if p.startswith(train_job)]:
                assert time.monotonic() < deadline, sorted(cluster.running)
                await asyncio.sleep(1)
            saved = sorted(int(d.name.rsplit("_", 1)[1]) for d in _saved_checkpoints(pvc))
            print(f"crashed, the training Job deleted with its owner; saved checkpoints {saved}", flush=True)

            # the retry: the same deployment run again; the dataset stages are Cached (no tokenize Job), the
            # training Job resumes from the newest checkpoint the killed run saved
            started = await asyncio.to_thread(_prefect, ["deployment", "run", "end-to-end/k8s", *params], env)
            retry = re.search(r"UUID:\s*([0-9a-f-]{36})", started).group(1)
            row.watch_runs([retry])
            done = await _final(retry, 900)
            assert done.state.is_completed(), f"{done.state}\n{log_tail(worker_log)}"
            assert not _stage_jobs(cluster, retry, "nemoflow-tokenize"), "the tokenized dataset was reused"
            (again,) = _stage_jobs(cluster, retry, "train-")
            lines = [text for pod, logged in cluster.logs.items() if pod.startswith(again) for _, text in logged]
            resumed = [line for line in lines if line.startswith("resuming from ")]
            assert resumed, lines[-30:]
            # the newest checkpoint the killed run saved (AutoModel names step N's directory step_{N-1})
            latest, step = re.match(r"resuming from (\S+) at step (\d+) ", resumed[0]).groups()
            assert (latest.rsplit("/", 1)[1], int(step)) == (f"epoch_0_step_{saved[-1]}", saved[-1] + 1), resumed
    finally:
        for delete in (k.AppsV1Api(api_client_for_url(cluster.url)).delete_namespaced_deployment,):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(delete, model, ns)
        await cluster.stop()

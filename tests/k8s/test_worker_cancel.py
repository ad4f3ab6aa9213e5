"""Cancelling a started end-to-end/k8s run, through prefect-kubernetes' real worker, with every pod a container.

The set-up is tests/e2e/test_end_to_end_k8s.py's (the API stand-in, tests/k8s/controller.py + kubelet.py running
each pod as a podman container of the CPU image built from this checkout, the shipped pool and deployment); the
run is cancelled with ``prefect flow-run cancel`` (what the UI's Cancel does: the run goes Cancelling) while its
training Job's pod runs.

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
import json
import os
import re
import time

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


@pytest.mark.faults
@pytest.mark.usefixtures("shipped_image")  # the pool's image name, built from this checkout
async def test_cancelling_a_started_run_deletes_its_stage_job_and_ends_it_cancelled(kmock, prefect_server, tmp_path):
    from prefect.client.orchestration import get_client

    from devtools.prefect_local import ensure_pools
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
        await asyncio.to_thread(ensure_pools, prefect_server)
        await asyncio.to_thread(_prefect, ["--no-prompt", "deploy", "--name", "end-to-end/k8s"], env)
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
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

"""end-to-end/k8s as prefect.yaml ships it, every pod a real container: the API is the stand-in (kmock),
the controller and kubelet are tests/k8s/controller.py + kubelet.py (podman), the image is the CPU
nemoflow image built from this checkout under the name the pool's job variables give it.

What runs, in order:

1. ``prefect deploy --name end-to-end/k8s`` from prefect.yaml (pool ``nemoflow-k8s``, created from
   deployments/k8s/base-job-template.json), then ``prefect deployment run end-to-end/k8s``;
2. the worker: prefect-kubernetes' own process, ``prefect worker start --pool nemoflow-k8s --type
   kubernetes``, with a kubeconfig naming the API stand-in (tests/support/kube.py, kmock extended with
   generateName, label selectors, uid/resourceVersion, garbage collection): it renders the flow-run Job
   from the pool's template and the deployment's job variables, creates it (``generateName``), and its
   observer watches the run's pods and Jobs by label selector;
3. the flow-run pod runs ``prefect flow-run execute`` in the image, with the workspace PVC (a host
   directory) at /nemo-workspace, the Secret's keys by ``secretKeyRef``, and the API through the
   kubeconfig the kubelet mounts; the flow submits every stage through the k8s backend: the image
   reference, the tokenize Indexed Job, the training Job (NeMo AutoModel on CPU), the validation Job,
   the inference Deployment + Service (ready when its readiness probe answers from the container),
   the seed's smoke request from the flow-run pod to ``http://<svc>.<ns>.svc.cluster.local:<port>``
   (cluster DNS: the kubelet publishes Service names into running pods), and the model registry.

4. the same run again: every stage Cached (the endpoint still healthy, nothing re-trained), again
   through a flow-run Job the worker creates.

Only the parameters are the test's: the tiny model, a free port, one tokenizer worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, VENV_BIN, free_port, get_json
from tests.e2e.test_end_to_end import _task_states
from tests.support.kube import KubeApi
from tests.support.kube_worker import kubernetes_worker, log_tail, write_kubeconfig
from tests.support.require import need
from tests.support.tiny import TINY_TRAIN

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.kmock(cls=KubeApi)]

SERVE_KEY = "sk-k8s-e2e-SENTINEL-27182818"
HF_TOKEN = "hf_k8sE2eSENTINEL31415926"
MODEL = "nemoflow-k8s-e2e"
DEADLINE_S = 1800


def shipped_job_variables() -> dict:
    """The job variables of prefect.yaml's end-to-end/k8s deployment (anchors resolved by YAML)."""
    for deployment in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]:
        if deployment["name"] == "k8s" and deployment["entrypoint"].startswith("flows/end_to_end.py"):
            return deployment["work_pool"]["job_variables"]
    raise AssertionError("prefect.yaml has no end-to-end/k8s deployment")


@pytest.fixture
def shipped_image():
    """The CPU image of this checkout under the pool's image name, for this test only.

    The name is shared by every checkout on the machine: a lock keeps two sessions of this test
    from running each other's code, and the name is removed afterwards.
    """
    from deployments.image import podman
    from deployments.image.build import build, cache_dir

    need(podman.shutil.which(podman.PODMAN), "podman", "apt-get install podman (scripts/setup.sh --test)")
    tag = shipped_job_variables()["image"]
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "e2e-k8s.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build("cpu", [tag], log=lambda line: print(line, flush=True))
        try:
            yield tag
        finally:
            subprocess.run(podman.command("untag", tag, tag), check=False, capture_output=True)


def _prefect(args: list[str], env: dict, timeout: float = 600) -> str:
    proc = subprocess.run(
        [str(VENV_BIN / "prefect"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


async def _wait_for_final_state(run_id: str, cluster, worker) -> tuple[object, str | None]:
    """The run's final state (or its last one, if its Job failed, the worker died or time ran out) and
    the name of the flow-run Job the worker created for it."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + DEADLINE_S
    async with get_client() as client:
        while True:
            run = await client.read_flow_run(run_id)
            job_name = run.infrastructure_pid.split(":", 1)[1] if run.infrastructure_pid else None
            if run.state is not None and run.state.is_final():
                return run.state, job_name
            job = cluster.get("jobs", job_name) or {} if job_name else {}
            failed = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("type") == "Failed"]
            if failed or worker.poll() is not None or time.monotonic() > deadline:
                return run.state, job_name
            await asyncio.sleep(3)


def _tails(cluster, lines: int = 40) -> str:
    out = []
    for pod, logged in cluster.logs.items():
        out.append(f"--- pod {pod}")
        out += [text for _, text in logged[-lines:]]
    return "\n".join(out)


async def _run(env: dict, config: dict, cluster, worker) -> tuple[str, object, str | None]:
    """``prefect deployment run end-to-end/k8s``; (run id, its final state, its flow-run Job's name)."""
    started = await asyncio.to_thread(
        _prefect, ["deployment", "run", "end-to-end/k8s", "--params", json.dumps({"config": config})], env
    )
    run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", started).group(1)
    state, job_name = await _wait_for_final_state(run_id, cluster, worker)
    return run_id, state, job_name


async def test_end_to_end_k8s_as_shipped_every_pod_a_container(kmock, prefect_server, tmp_path, shipped_image):
    from devtools.prefect_local import ensure_pools
    from infra.k8s.config import api_client_for_url
    from infra.registry import ModelRegistry
    from tests.k8s.controller import FakeCluster
    from tests.k8s.kubelet import PodmanKubelet

    variables = shipped_job_variables()
    ns, pvc_name, secret = variables["namespace"], variables["pvc_name"], variables["secret_name"]
    work_dir = variables["env"]["NEMOFLOW_WORK_DIR"]
    assert work_dir.startswith("/nemo-workspace/"), work_dir
    pvc = tmp_path / "pvc"
    # the one-time set-up deployments/k8s/README.md describes: namespace, PVC, service account, Secret
    kubelet = PodmanKubelet(probe_period_s=0.5)
    cluster = FakeCluster(kmock, ns, kubelet=kubelet)
    cluster.add_namespace()
    cluster.add_pvc(pvc_name, host_dir=pvc)
    cluster.add_service_account(variables["service_account_name"])
    cluster.add_secret(secret, {"NEMOFLOW_SERVE_API_KEY": SERVE_KEY, "HF_TOKEN": HF_TOKEN})
    await cluster.start()
    api = api_client_for_url(cluster.url)
    from kubernetes import client as k

    try:
        env = dict(os.environ, PREFECT_API_URL=prefect_server, PREFECT_SERVER_ANALYTICS_ENABLED="false")
        await asyncio.to_thread(ensure_pools, prefect_server)
        await asyncio.to_thread(_prefect, ["--no-prompt", "deploy", "--name", "end-to-end/k8s"], env)
        port = free_port()
        config = {
            "executor": {"kind": "k8s"},  # as shipped: every option from the pool's NEMOFLOW_K8S_*
            "data": {"workers": 1},
            "train": TINY_TRAIN,
            "serve": {"port": port, "model_name": MODEL},
            "validation_threshold": 9.5,
        }
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
        worker_log = tmp_path / "worker.log"
        with kubernetes_worker("nemoflow-k8s", prefect_server, kubeconfig, worker_log) as worker:
            t0 = time.monotonic()
            run_id, state, job_name = await _run(env, config, cluster, worker)
            print(f"end-to-end/k8s: {state.name if state else None} after {time.monotonic() - t0:.0f} s")
            assert state is not None and state.is_completed(), f"{state}\n{_tails(cluster)}\n{log_tail(worker_log)}"

            # nothing changed: the same run again through the worker is all Cached, and runs no stage Job
            t0 = time.monotonic()
            again_id, again, again_job = await _run(env, config, cluster, worker)
            print(f"end-to-end/k8s again: {again.name if again else None} after {time.monotonic() - t0:.0f} s")
            assert again is not None and again.is_completed(), f"{again}\n{_tails(cluster)}\n{log_tail(worker_log)}"
        states = await asyncio.to_thread(_task_states, again_id)
        assert states and {n: s for n, s in states.items() if s != "Cached"} == {}, states
        assert not [
            j for j in cluster.live("batch/v1/jobs") if j["metadata"]["labels"].get("nemoflow.io/flow-run") == again_id
        ], "a cached run submits no stage Job"

        # the worker created each flow-run Job: named by the API from its generateName, labelled with its run
        for run, name in ((run_id, job_name), (again_id, again_job)):
            flow_job = cluster.get("jobs", name)
            assert name in kmock.generated_names and flow_job["metadata"]["generateName"], name
            assert flow_job["metadata"]["labels"]["prefect.io/flow-run-id"] == run
            assert flow_job["metadata"]["labels"]["prefect.io/worker-name"], flow_job["metadata"]["labels"]

        # the run's summary and artifacts are on the PVC, under the pool's NEMOFLOW_WORK_DIR
        root = pvc / Path(work_dir).relative_to("/nemo-workspace")
        summary = json.loads((root / "flow-runs" / f"{run_id}.json").read_text())
        assert summary["answer"].strip(), summary
        assert summary["endpoint"] == f"http://{MODEL}.{ns}.svc.cluster.local:{port}", summary
        assert summary["image"] == {**summary["image"], "kind": "registry", "uri": shipped_image}
        assert summary["checkpoint"].startswith(work_dir + "/runs/"), summary

        # every stage was a Job of this flow run, and each of their pods ran as a container of the image
        jobs = {
            j["metadata"]["name"]: j
            for j in cluster.live("batch/v1/jobs")
            if (j["metadata"].get("labels") or {}).get("nemoflow.io/flow-run") == run_id
        }
        by_stage = {
            prefix: [n for n in jobs if n.startswith(prefix)] for prefix in ("nemoflow-tokenize", "train-", "validate-")
        }
        assert all(len(names) == 1 for names in by_stage.values()), (by_stage, sorted(jobs))
        tokenize = jobs[by_stage["nemoflow-tokenize"][0]]
        assert tokenize["spec"]["completionMode"] == "Indexed" and tokenize["spec"]["completions"] == 4
        for name, stage_job in jobs.items():
            conditions = {c["type"] for c in stage_job["status"].get("conditions") or []}
            assert "Complete" in conditions, (name, stage_job["status"])
            pods = [p for p in kubelet.commands if p.startswith(name + "-")]
            assert len(pods) == stage_job["spec"].get("completions", 1), (name, pods)
            assert all(shipped_image in kubelet.commands[p] for p in pods)
        flow_pods = [p for p in kubelet.commands if p.startswith(job_name + "-")]
        assert len(flow_pods) == 1 and shipped_image in kubelet.commands[flow_pods[0]], "the flow run ran in a pod"

        # the server: a Deployment whose pod runs the image, its key by reference, answering from the container
        deployment = cluster.get("deployments", MODEL)
        assert deployment["status"]["readyReplicas"] == 1
        server_env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert server_env["NEMOFLOW_SERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": secret,
            "key": "NEMOFLOW_SERVE_API_KEY",
            "optional": False,
        }
        status, models = await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/v1/models", SERVE_KEY)
        assert status == 200 and models["data"][0]["id"] == MODEL
        assert (await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/v1/models", None))[0] == 401

        # the registry promoted the validated checkpoint, which lies on the PVC
        promoted = ModelRegistry(str(root / "registry")).read().promoted_model()
        assert promoted is not None and promoted.checkpoint == summary["checkpoint"]
        checkpoint = pvc / Path(summary["checkpoint"]).relative_to("/nemo-workspace")
        assert (checkpoint / "MANIFEST.json").is_file() and (checkpoint / "config.json").is_file()

        # secrets reached the pods by reference only: no value in any pod's output or in the run's logs
        every_line = "\n".join(text for logged in cluster.logs.values() for _, text in logged)
        assert SERVE_KEY not in every_line and HF_TOKEN not in every_line
        assert not any(SERVE_KEY in " ".join(cmd) or HF_TOKEN in " ".join(cmd) for cmd in kubelet.commands.values())
    finally:
        for delete in (k.AppsV1Api(api).delete_namespaced_deployment, k.CoreV1Api(api).delete_namespaced_service):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(delete, MODEL, ns)
        await cluster.stop()

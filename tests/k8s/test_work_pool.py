"""The Kubernetes work pool's base job template (deployments/k8s/base-job-template.json).

A job manifest is rendered from it exactly as prefect-kubernetes' worker does
(``from_template_and_values`` + ``prepare_for_flow_run``) and validated strictly.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import uuid

import kubernetes_validate
import pytest
import yaml

from infra.k8s.manifests import to_dict, workspace_pvc
from infra.k8s.options import K8sOptions

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deployments" / "k8s" / "base-job-template.json"
VERSIONS = ["1.30.0", "1.37.0"]
# prefect-kubernetes' validator requires these two (Job fields) inside the pod spec, where the
# API server drops them with an "unknown field" warning; strict validation rightly flags them.
WORKER_REQUIRED_POD_FIELDS = ("completions", "parallelism")

SAMPLE = {
    "namespace": "llm",
    "image": "nvcr.io/nvidia/nemo:25.02",
    "gpus": 1,
    "scheduler_name": "runai-scheduler",
    "service_account_name": "nemoflow",
    "pvc_name": "nemo-workspace",
    "secret_name": "hf-and-wandb",
    "cpu_request": "4",
    "memory_request": "16Gi",
    "env": {"NEMOFLOW_WORK_DIR": "/nemo-workspace/work"},
}


def rendered_job(values: dict) -> dict:
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads(TEMPLATE.read_text())

    async def build():
        # client: the template holds no block or variable references, so none is contacted
        return await KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=object())

    config = asyncio.run(build())
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="nemo-run", flow_id=uuid.uuid4()))
    return config.job_manifest


@pytest.fixture(scope="module")
def job() -> dict:
    return rendered_job(SAMPLE)


def test_template_extends_the_installed_default():
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    ours = json.loads(TEMPLATE.read_text())
    assert set(default["variables"]["properties"]) <= set(ours["variables"]["properties"])
    assert set(default["job_configuration"]) == set(ours["job_configuration"])
    added = set(ours["variables"]["properties"]) - set(default["variables"]["properties"])
    assert added == {"pvc_name", "workspace_mount", "gpus", "scheduler_name", "secret_name"}


def test_rendered_job_passes_strict_validation(job):
    pod = job["spec"]["template"]["spec"]
    assert all(field in pod for field in WORKER_REQUIRED_POD_FIELDS)
    stripped = json.loads(json.dumps(job))
    for field in WORKER_REQUIRED_POD_FIELDS:
        stripped["spec"]["template"]["spec"].pop(field)
    # generateName is how the worker names jobs; the schema accepts it without a name
    for version in VERSIONS:
        kubernetes_validate.validate(stripped, version, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, VERSIONS[-1], strict=True)


def test_rendered_job_carries_workspace_gpus_scheduler_and_secret_refs(job):
    pod = job["spec"]["template"]["spec"]
    main = pod["containers"][0]
    assert job["metadata"]["namespace"] == "llm"
    assert pod["schedulerName"] == "runai-scheduler" and pod["serviceAccountName"] == "nemoflow"
    assert {"name": "workspace", "persistentVolumeClaim": {"claimName": "nemo-workspace"}} in pod["volumes"]
    assert {"name": "workspace", "mountPath": "/nemo-workspace"} in main["volumeMounts"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in main["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-and-wandb", "key": "HF_TOKEN", "optional": True}},
    }
    assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "hf-and-wandb"
    # the flow run's own backend settings point at the same namespace, PVC and Secret
    assert (
        env["NEMOFLOW_K8S_NAMESPACE"]["value"] == "llm" and env["NEMOFLOW_K8S_SECRET_NAME"]["value"] == "hf-and-wandb"
    )
    assert env["NEMOFLOW_WORK_DIR"]["value"] == "/nemo-workspace/work", "deployment env still reaches the pod"
    assert env["PREFECT__FLOW_RUN_ID"]["value"]


def test_secret_values_in_the_environment_do_not_enter_the_job(secret_env):
    text = json.dumps(rendered_job(SAMPLE))
    for value in secret_env.values():
        assert value not in text


def test_workspace_pvc_and_rbac_files_are_valid():
    pvc = yaml.safe_load((ROOT / "deployments" / "k8s" / "workspace-pvc.yaml").read_text())
    expected = to_dict(workspace_pvc(K8sOptions(namespace="x")))
    expected["metadata"].pop("namespace")
    assert pvc == expected, "deployments/k8s/workspace-pvc.yaml drifted from infra.k8s.manifests.workspace_pvc"
    docs = list(yaml.safe_load_all((ROOT / "deployments" / "k8s" / "rbac.yaml").read_text())) + [pvc]
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim"}
    for doc in docs:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)

"""Every manifest nemoflow writes passes strict schema validation (Kubernetes 1.30 and 1.37).

Built-in kinds: kubernetes-validate --strict (offline OpenAPI schemas; unknown
fields are errors). Kubeflow PyTorchJob: tests/k8s/schemas/pytorchjob-kubeflow-v1.schema.json,
a JSON schema written from the training operator's v1 CRD, plus its pod template
as a v1 PodTemplate. Knative Service: structural checks plus its pod spec as a v1 Pod.
"""

from __future__ import annotations

import copy
import json
import pathlib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infra.jobs import JobSpec, Mount
from infra.k8s.images import InvalidImageReference, validate_image_reference
from infra.k8s.manifests import job_objects, k8s_quantity, to_dict
from infra.k8s.options import K8sOptions
from nemoflow.cli import main as cli

VERSIONS = ["1.30.0", "1.37.0"]
HERE = pathlib.Path(__file__).parent
PYTORCHJOB_SCHEMA = json.loads((HERE / "schemas" / "pytorchjob-kubeflow-v1.schema.json").read_text())

GPU_MULTINODE = {
    "executor": {
        "kind": "k8s",
        "namespace": "llm",
        "scheduler_name": "runai-scheduler",
        "service_account": "nemoflow",
        "image_pull_secrets": ["ngc"],
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "shm_size": "64Gi",
        "pvc_storage_class": "standard-rwx",
    },
    "image": {"source": "nvcr.io/nvidia/nemo:25.02"},
    "data": {
        "sources": "https://data.example.com/train/chunk{chunk}/example_train_{shard}.jsonl.zst",
        "chunks": "1",
        "shards": "0-15",
        "shards_per_file": 1,
    },
    "train": {
        "num_nodes": 4,
        "gpus_per_node": 8,
        "tensor_model_parallel_size": 2,
        "global_batch_size": 256,
        "mem": "480G",
        "time": "04:00:00",
    },
    "serve": {"engine": {"resources": {"gpus_per_node": 2, "cpus_per_task": 4}}},
}
CONFIGS = {
    "default": {},
    "gpu-multinode": GPU_MULTINODE,
    "pytorchjob-knative": {
        "executor": {"kind": "k8s", "training_kind": "pytorchjob", "inference_kind": "knative", "shm": False},
        "train": {"num_nodes": 2, "gpus_per_node": 8, "global_batch_size": 128},
        "serve": {"engine": {"resources": {"gpus_per_node": 8}}},
    },
}


@pytest.fixture(autouse=True)
def workspace_work_dir(monkeypatch):
    """Runs on Kubernetes keep their artifacts on the workspace PVC."""
    from infra.settings import reload_settings

    monkeypatch.setenv("NEMOFLOW_WORK_DIR", "/nemo-workspace/nemoflow")
    reload_settings()
    yield
    monkeypatch.undo()
    reload_settings()


def render(tmp_path, config: dict) -> dict[str, dict]:
    out = tmp_path / "out"
    args = ["render", "--backend", "k8s", "--out", str(out)]
    if config:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        args += ["--config", str(path)]
    assert cli(args) == 0
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}


def one(files: dict[str, dict], prefix: str) -> dict:
    found = [obj for name, obj in files.items() if name.startswith(prefix)]
    assert len(found) == 1, (prefix, sorted(files))
    return found[0]


def validate(obj: dict) -> None:
    if obj["kind"] == "PyTorchJob":
        jsonschema.validate(obj, PYTORCHJOB_SCHEMA)
        for replica in obj["spec"]["pytorchReplicaSpecs"].values():
            validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": replica["template"]}
            )
        return
    if obj["apiVersion"] == "serving.knative.dev/v1":
        template = obj["spec"]["template"]
        assert set(obj) == {"apiVersion", "kind", "metadata", "spec"} and set(obj["spec"]) == {"template"}
        assert len(template["spec"]["containers"]) == 1, "Knative allows one serving container"
        assert "restartPolicy" not in template["spec"]
        validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "k"}, "spec": template["spec"]})
        return
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_rendered_manifests_pass_strict_validation(tmp_path, config_name):
    files = render(tmp_path, CONFIGS[config_name])
    assert files
    for name, obj in files.items():
        assert name == f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        validate(obj)


def test_strict_validation_rejects_an_unknown_field():
    """The validator is really strict: a misplaced field (here a Job field in the pod spec) fails."""
    job = to_dict(job_objects(JobSpec(name="x", command=["true"]), K8sOptions())[0])
    validate(job)
    broken = copy.deepcopy(job)
    broken["spec"]["template"]["spec"]["completions"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)
    bad_pytorch = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "p"},
        "spec": {
            "nprocPerNode": 8,
            "pytorchReplicaSpecs": {"Master": {"template": {"spec": {"containers": [{"name": "pytorch"}]}}}},
        },
    }
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        jsonschema.validate(bad_pytorch, PYTORCHJOB_SCHEMA)


def test_gpu_multinode_manifests_wire_rendezvous_gpus_and_workspace(tmp_path):
    files = render(tmp_path, CONFIGS["gpu-multinode"])
    job = one(files, "job-train-")
    svc = one(files, "service-train-")
    pod = job["spec"]["template"]["spec"]
    main = pod["containers"][0]
    env = {e["name"]: e for e in main["env"]}
    # torchrun on every node, the rendezvous from the Indexed Job's variables
    assert main["command"][:4] == ["python", "-m", "torch.distributed.run", "--nproc-per-node=8"]
    assert "--node-rank=$(NODE_RANK)" in main["command"] and "workloads.train" in main["command"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    # pod <job>-0 is reachable as <job>-0.<subdomain>: the headless Service selecting these pods
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc["metadata"]["name"]
    assert set(svc["spec"]["selector"].items()) <= set(job["spec"]["template"]["metadata"]["labels"].items())
    assert env["MASTER_ADDR"]["value"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert env["NNODES"]["value"] == "4" and env["NPROC_PER_NODE"]["value"] == "8"
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "8" and main["resources"]["limits"]["memory"] == "480Gi"
    assert pod["schedulerName"] == "runai-scheduler" and pod["serviceAccountName"] == "nemoflow"
    assert {"name": "workspace", "mountPath": "/nemo-workspace"} in main["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert job["spec"]["activeDeadlineSeconds"] == 4 * 3600
    tok = one(files, "job-nemoflow-tokenize")
    tok_env = {e["name"]: e for e in tok["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert tok["spec"]["completions"] == 16
    assert "job-completion-index" in tok_env["NEMOFLOW_ARRAY_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    serve = one(files, "deployment-nemoflow-demo")["spec"]["template"]["spec"]["containers"][0]
    assert serve["resources"]["limits"]["nvidia.com/gpu"] == "2", "GPU count = tensor parallel size"
    assert serve["readinessProbe"]["httpGet"]["port"] == serve["ports"][0]["containerPort"] == 8000
    pvc = files["persistentvolumeclaim-nemo-workspace.yaml"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "standard-rwx"


def test_pytorchjob_and_knative_variants(tmp_path):
    files = render(tmp_path, CONFIGS["pytorchjob-knative"])
    ptj = one(files, "pytorchjob-train-")
    assert ptj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert ptj["spec"]["nprocPerNode"] == "8"
    pod = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert all(v["name"] != "dshm" for v in pod["volumes"]), "shm: false removes /dev/shm"
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "nemo-workspace"
    command = pod["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "torch.distributed.run", "--nproc-per-node=8"]
    assert not any(arg.startswith("--node-rank") for arg in command), "the operator sets torchrun's PET_* variables"
    ksvc = one(files, "service-nemoflow-demo")
    assert ksvc["apiVersion"] == "serving.knative.dev/v1"
    assert ksvc["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_secret_values_never_reach_manifests(tmp_path, secret_env):
    files = render(tmp_path, CONFIGS["gpu-multinode"])
    text = "".join((tmp_path / "out" / name).read_text() for name in files)
    for value in secret_env.values():
        assert value not in text
    seen = set()
    for obj in files.values():
        for container in _containers(obj):
            for env in container.get("env", []):
                if env["name"] in secret_env:
                    assert "value" not in env and env["valueFrom"]["secretKeyRef"]["key"] == env["name"]
                    seen.add(env["name"])
    assert seen == set(secret_env)


def _containers(obj):
    spec = obj.get("spec") or {}
    if "template" in spec:
        yield from spec["template"]["spec"]["containers"]


def test_render_writes_atomically_and_overwrites(tmp_path):
    first = render(tmp_path, {})
    assert one(first, "job-nemoflow-tokenize")["spec"]["completions"] == 4  # the demo corpus: 4 parts
    second = render(tmp_path, {"data": {**GPU_MULTINODE["data"], "shards": "0-6"}})
    assert one(second, "job-nemoflow-tokenize")["spec"]["completions"] == 7
    assert not [p for p in (tmp_path / "out").iterdir() if ".tmp-" in p.name]


def test_render_rejects_bad_input_naming_it(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"image": {"source": "nvcr.io/nvidia/NeMo:25.02"}}))
    assert cli(["render", "--out", str(tmp_path / "o"), "--config", str(config)]) == 2
    assert "nvcr.io/nvidia/NeMo:25.02" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({"train": {"nodez": 2}}))
    assert cli(["render", "--out", str(tmp_path / "o"), "--config", str(config)]) == 2
    assert "nodez" in capsys.readouterr().err
    config.write_text("executor: {kind: k8s\n")
    assert cli(["render", "--out", str(tmp_path / "o"), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "is not valid YAML" in err and len(err.strip().splitlines()) == 1


def test_render_is_what_the_stages_submit(tmp_path):
    """The manifests come from the tasks' own builders: the same spec, through the backend's renderer."""
    from flows.end_to_end import EndToEndConfig
    from flows.plan import planned_specs
    from infra.backends.k8s import KubernetesBackend
    from tasks.serve import build_serve_spec

    config = EndToEndConfig.model_validate(GPU_MULTINODE)
    plan = dict(planned_specs(config))
    files = render(tmp_path, GPU_MULTINODE)
    backend = KubernetesBackend(config.executor)
    for stage in ("tokenize", "pretrain", "validate", "serve"):
        for name, text in backend.render(plan[stage]).items():
            assert files[name] == yaml.safe_load(text), (stage, name)
    serve = plan["serve"]
    assert serve.command[:3] == ["python", "-m", "workloads.serve"] and "0.0.0.0" in serve.command
    assert build_serve_spec.__module__ == "tasks.serve"


@pytest.mark.parametrize(
    "image",
    [
        "nvcr.io/nvidia/nemo:25.02",
        "nemo",
        "localhost:5000/team/nemo:dev-1",
        "nvcr.io/nvidia/nemo@sha256:" + "a" * 64,
        "ghcr.io/org/img:1.0@sha256:" + "0123456789abcdef" * 4,
    ],
)
def test_valid_image_references(image):
    assert validate_image_reference(image) == image


@pytest.mark.parametrize(
    "image",
    [
        "nvcr.io/nvidia/nemo:25.02",
        "localhost:5000/team/nemo:dev-1",
        "[::1]:5000/nemo:1",
        "ghcr.io/o/i@sha256:" + "b" * 64,
    ],
)
def test_one_reference_grammar_for_pods_and_enroot(image):
    """What a pod pulls and what enroot imports are read by the same grammar (infra.images)."""
    from infra.images import parse_docker_ref

    assert validate_image_reference(image) == image and parse_docker_ref(image).canonical == image


@pytest.mark.parametrize(
    "image, hint",
    [
        ("nvcr.io/nvidia/NeMo:25.02", "not [registry/]"),
        ("nemo@sha256:abc", "64 lowercase hex"),
        ("/images/nemo.sqsh", "enroot"),
        ("docker://nvcr.io/nvidia/nemo:25.02", "scheme"),
        ("nemo:", "not [registry/]"),
        (" nemo", "surrounding spaces"),
    ],
)
def test_invalid_image_references_say_why(image, hint):
    with pytest.raises(InvalidImageReference) as info:
        validate_image_reference(image)
    assert hint in str(info.value) and repr(image) in str(info.value)


def test_memory_quantities_and_mounts():
    assert k8s_quantity("16G") == "16Gi" and k8s_quantity("512M") == "512Mi" and k8s_quantity("1024") == "1024"
    with pytest.raises(ValueError, match="16 gigs"):
        k8s_quantity("16 gigs")
    inside = JobSpec(
        name="m", command=["x"], mounts=[Mount(source="/nemo-workspace/data", target="/data", read_only=True)]
    )
    pod = to_dict(job_objects(inside, K8sOptions())[0])["spec"]["template"]["spec"]
    assert {"name": "workspace", "mountPath": "/data", "subPath": "data", "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]
    outside = JobSpec(name="m", command=["x"], mounts=[Mount(source="/scratch/data", target="/data")])
    with pytest.raises(ValueError, match="/scratch/data"):
        job_objects(outside, K8sOptions())


def test_secret_value_in_plain_env_is_refused_without_echoing_it(secret_env):
    leaky = JobSpec(name="leaky", command=["x"], env={"TOKEN_COPY": f"Bearer {secret_env['HF_TOKEN']}"})
    with pytest.raises(ValueError, match="env TOKEN_COPY holds a secret value") as info:
        job_objects(leaky, K8sOptions())
    assert secret_env["HF_TOKEN"] not in str(info.value)

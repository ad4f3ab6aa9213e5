"""Typed Kubernetes manifests built from a :class:`~infra.jobs.JobSpec` or :class:`~infra.jobs.ServiceSpec`.

One builder per kind; each returns the official client's ``V1*`` model (or, for
the CRDs the official client does not model, a pydantic model), and
:func:`to_dict` turns any of them into the JSON ``kubectl apply`` takes.

Which objects a spec becomes (:func:`job_objects`, :func:`service_objects`):

- ``array_size=N``: an Indexed ``batch/v1`` Job, N completions; each pod's
  ``NEMOFLOW_ARRAY_INDEX`` is its completion index (dataset preparation).
- ``nodes>1``: an Indexed Job with one pod per node plus a headless Service, so
  pod ``<job>-<i>`` resolves as ``<job>-<i>.<job>`` and torchrun rendezvouses
  at index 0; or a Kubeflow ``PyTorchJob`` with ``training_kind=pytorchjob``.
- otherwise: a one-pod Job.
- a ServiceSpec: a Deployment + ClusterIP Service (or a Knative Service).

Secrets are referenced (``secretKeyRef``), never copied into a manifest.
"""

from __future__ import annotations

import re
from typing import Any

from kubernetes import client as k
from pydantic import BaseModel, ConfigDict, Field

from infra.jobs import ARRAY_INDEX_ENV, JobSpec, Mount, Resources, ServiceSpec
from infra.k8s import validation
from infra.k8s.images import validate_image_reference
from infra.k8s.options import K8sOptions

GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER_NAME = "main"
# The training operator finds the training container by this name.
PYTORCH_CONTAINER_NAME = "pytorch"
LABEL_JOB = "nemoflow.dev/job"
LABEL_RUN = "nemoflow.dev/run"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
_api = k.ApiClient()


def to_dict(obj: Any) -> dict[str, Any]:
    """A model as the camelCase JSON the API server takes, without empty fields."""
    if isinstance(obj, BaseModel):
        return obj.model_dump(by_alias=True, exclude_none=True)
    return _api.sanitize_for_serialization(obj)


def k8s_quantity(mem: str, field: str = "memory") -> str:
    """sbatch memory (``16G``, ``512M``, ``16GB``) to a Kubernetes quantity (``16Gi``)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?", str(mem).strip(), re.IGNORECASE)
    if not match:
        raise ValueError(f"{field} {mem!r} is not like 16G, 512M or 16Gi")
    number, unit, _ = match.groups()
    quantity = f"{number}{unit.upper()}i" if unit else number
    validation.quantity(quantity, field)
    return quantity


# --- pod-level pieces -------------------------------------------------------


def labels_for(name: str, options: K8sOptions, run_id: str | None = None) -> dict[str, str]:
    labels = {LABEL_MANAGED_BY: "nemoflow", LABEL_JOB: name, **options.labels}
    if run_id:
        labels[LABEL_RUN] = run_id
    return labels


def _env(
    env: dict[str, str], secret_env: list[str], options: K8sOptions, extra: list[k.V1EnvVar] = ()
) -> list[k.V1EnvVar]:
    for key in env:
        validation.env_name(key, "env name")
    for name in secret_env:
        validation.secret_key(name, "secret_env name")
    out = [k.V1EnvVar(name=key, value=value) for key, value in env.items()]
    for name in secret_env:
        # Required unless listed optional: a missing key then fails the pod visibly
        # (CreateContainerConfigError) instead of running a job without its token.
        optional = name in options.optional_secrets
        out.append(
            k.V1EnvVar(
                name=name,
                value_from=k.V1EnvVarSource(
                    secret_key_ref=k.V1SecretKeySelector(name=options.secret_for(name), key=name, optional=optional)
                ),
            )
        )
    out.extend(extra)
    return out


def _index_env(name: str) -> k.V1EnvVar:
    # The completion index comes from the pod's annotation, the same source
    # Kubernetes uses for JOB_COMPLETION_INDEX, so no shell wrapper is needed.
    return k.V1EnvVar(
        name=name,
        value_from=k.V1EnvVarSource(
            field_ref=k.V1ObjectFieldSelector(field_path=f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']")
        ),
    )


def _resources(resources: Resources) -> k.V1ResourceRequirements:
    requests: dict[str, str] = {"cpu": str(resources.cpus_per_task * resources.ntasks_per_node)}
    limits: dict[str, str] = {}
    if resources.mem:
        requests["memory"] = limits["memory"] = k8s_quantity(resources.mem, "resources.mem")
    if resources.gpus_per_node:
        # Extended resources are set as limits; the request defaults to the limit.
        limits[GPU_RESOURCE] = str(resources.gpus_per_node)
    return k.V1ResourceRequirements(requests=requests, limits=limits or None)


def _volumes(mounts: list[Mount], options: K8sOptions) -> tuple[list[k.V1Volume], list[k.V1VolumeMount]]:
    volumes: list[k.V1Volume] = []
    volume_mounts: list[k.V1VolumeMount] = []
    root = options.workspace_mount.rstrip("/")
    if options.pvc_name:
        volumes.append(
            k.V1Volume(
                name="workspace",
                persistent_volume_claim=k.V1PersistentVolumeClaimVolumeSource(claim_name=options.pvc_name),
            )
        )
        volume_mounts.append(k.V1VolumeMount(name="workspace", mount_path=root))
    for mount in mounts:
        validation.absolute_path(mount.target, f"mount target of {mount.source}")
        # A spec's bind mounts (Slurm, local) are paths on shared storage; here that
        # storage is the workspace PVC, so a mount becomes a sub-path of it.
        inside = mount.source == root or mount.source.startswith(root + "/")
        if not (options.pvc_name and inside):
            raise ValueError(
                f"mount {mount.source} -> {mount.target}: the Kubernetes backend mounts only paths "
                f"inside the workspace PVC ({root}); put the data there or use a gs:// URI"
            )
        if mount.target == root and mount.source == root:
            continue
        sub_path = mount.source[len(root) :].lstrip("/") or None
        volume_mounts.append(
            k.V1VolumeMount(
                name="workspace", mount_path=mount.target, sub_path=sub_path, read_only=mount.read_only or None
            )
        )
    if options.shm:
        volumes.append(
            k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory", size_limit=options.shm_size))
        )
        volume_mounts.append(k.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
    return volumes, volume_mounts


def container(
    spec: JobSpec | ServiceSpec,
    options: K8sOptions,
    *,
    name: str = CONTAINER_NAME,
    extra_env: list[k.V1EnvVar] = (),
    ports: list[k.V1ContainerPort] | None = None,
    readiness: k.V1Probe | None = None,
) -> tuple[k.V1Container, list[k.V1Volume]]:
    try:
        image = validate_image_reference(spec.container_image or options.image)
        _refuse_inline_secrets(spec)
        env = _env(spec.env, spec.secret_env, options, list(extra_env)) or None
        resources = _resources(spec.resources)
        volumes, volume_mounts = _volumes(spec.mounts, options)
    except ValueError as exc:
        # name the job: a plan has several, and the message must say which one to fix
        # (same class: callers catch InvalidImageReference)
        message = str(exc)
        raise type(exc)(message if message.startswith(f"{spec.name}:") else f"{spec.name}: {message}") from None
    return (
        k.V1Container(
            name=name,
            image=image,
            image_pull_policy=options.image_pull_policy,
            command=list(spec.command),
            working_dir=spec.workdir,
            env=env,
            resources=resources,
            volume_mounts=volume_mounts or None,
            ports=ports,
            readiness_probe=readiness,
        ),
        volumes,
    )


def _refuse_inline_secrets(spec: JobSpec | ServiceSpec) -> None:
    """A secret value in ``env`` would be written into the manifest: refuse, naming the variable only."""
    from infra.settings import get_settings

    secrets = [v for v in get_settings().secret_values() if len(v) >= 4]
    for key, value in spec.env.items():
        if any(secret in value for secret in secrets):
            raise ValueError(
                f"{spec.name}: env {key} holds a secret value; list the secret's name in secret_env instead "
                "(it is then read from a Kubernetes Secret)"
            )


def pod_spec(
    main: k.V1Container, volumes: list[k.V1Volume], options: K8sOptions, *, restart_policy: str = "Never", **extra: Any
) -> k.V1PodSpec:
    return k.V1PodSpec(
        containers=[main],
        volumes=volumes or None,
        restart_policy=restart_policy,
        scheduler_name=options.scheduler_name,
        service_account_name=options.service_account,
        image_pull_secrets=[k.V1LocalObjectReference(name=n) for n in options.image_pull_secrets] or None,
        node_selector=options.node_selector or None,
        tolerations=[k.V1Toleration(**t.model_dump()) for t in options.tolerations] or None,
        **extra,
    )


def _meta(name: str, options: K8sOptions, labels: dict[str, str]) -> k.V1ObjectMeta:
    return k.V1ObjectMeta(name=name, namespace=options.namespace, labels=labels)


# --- Jobs -------------------------------------------------------------------


def _job(
    name: str,
    spec: JobSpec,
    options: K8sOptions,
    labels: dict[str, str],
    *,
    completions: int,
    parallelism: int,
    indexed: bool,
    extra_env: list[k.V1EnvVar] = (),
    subdomain: str | None = None,
) -> k.V1Job:
    main, volumes = container(spec, options, extra_env=extra_env)
    return k.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=_meta(name, options, labels),
        spec=k.V1JobSpec(
            completions=completions,
            parallelism=parallelism,
            completion_mode="Indexed" if indexed else None,
            backoff_limit=options.backoff_limit,
            ttl_seconds_after_finished=options.ttl_seconds_after_finished,
            active_deadline_seconds=spec.resources.time_seconds,
            template=k.V1PodTemplateSpec(
                metadata=k.V1ObjectMeta(labels=labels),
                spec=pod_spec(main, volumes, options, subdomain=subdomain),
            ),
        ),
    )


def single_job(spec: JobSpec, options: K8sOptions, *, name: str | None = None, run_id: str | None = None) -> k.V1Job:
    """One pod (single-node training, validation, a one-off step)."""
    name = name or spec.name
    return _job(name, spec, options, labels_for(name, options, run_id), completions=1, parallelism=1, indexed=False)


def array_job(spec: JobSpec, options: K8sOptions, *, name: str | None = None, run_id: str | None = None) -> k.V1Job:
    """An Indexed Job of ``array_size`` completions (dataset preparation over file groups)."""
    if not spec.array_size:
        raise ValueError(f"job {spec.name}: array_job needs array_size")
    name = name or spec.name
    parallelism = spec.array_parallelism or options.array_parallelism or spec.array_size
    return _job(
        name,
        spec,
        options,
        labels_for(name, options, run_id),
        completions=spec.array_size,
        parallelism=min(parallelism, spec.array_size),
        indexed=True,
        extra_env=[_index_env(ARRAY_INDEX_ENV)],
    )


def rendezvous_env(name: str, spec: JobSpec, options: K8sOptions, *, rank_env: bool = True) -> list[k.V1EnvVar]:
    """torchrun's rendezvous variables: index 0 of the Indexed Job is the master."""
    env = [
        k.V1EnvVar(name="MASTER_ADDR", value=f"{name}-0.{name}"),
        k.V1EnvVar(name="MASTER_PORT", value=str(options.rendezvous_port)),
        k.V1EnvVar(name="NNODES", value=str(spec.resources.nodes)),
        k.V1EnvVar(
            name="NPROC_PER_NODE", value=str(max(1, spec.resources.gpus_per_node or spec.resources.ntasks_per_node))
        ),
    ]
    if rank_env:
        env.append(_index_env("NODE_RANK"))
    return env


def multinode_job(spec: JobSpec, options: K8sOptions, *, name: str | None = None, run_id: str | None = None) -> k.V1Job:
    """One pod per node, all started together (parallelism = completions = nodes)."""
    name = name or spec.name
    nodes = spec.resources.nodes
    return _job(
        name,
        spec,
        options,
        labels_for(name, options, run_id),
        completions=nodes,
        parallelism=nodes,
        indexed=True,
        extra_env=rendezvous_env(name, spec, options),
        subdomain=name,
    )


def headless_service(
    name: str, options: K8sOptions, *, run_id: str | None = None, port: int | None = None
) -> k.V1Service:
    """DNS names for the pods of a multi-node Job; addresses published before readiness so rendezvous can start."""
    validation.dns1035_label(name, "job name (it names the rendezvous Service)")
    labels = labels_for(name, options, run_id)
    return k.V1Service(
        api_version="v1",
        kind="Service",
        metadata=_meta(name, options, labels),
        spec=k.V1ServiceSpec(
            cluster_ip="None",
            publish_not_ready_addresses=True,
            selector={LABEL_JOB: name},
            ports=[k.V1ServicePort(name="rendezvous", port=port or options.rendezvous_port)],
        ),
    )


# --- Kubeflow PyTorchJob (kubeflow.org/v1) ------------------------------------
# The official client has no models for CRDs; these pydantic models follow the
# training operator's v1 types (pkg/apis/kubeflow.org/v1: PyTorchJobSpec,
# ReplicaSpec, RunPolicy). pod templates stay V1PodTemplateSpec dicts.


class _CamelModel(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")


class ReplicaSpec(_CamelModel):
    replicas: int = Field(ge=0)
    restart_policy: str = Field("Never", alias="restartPolicy")
    template: dict[str, Any]


class RunPolicy(_CamelModel):
    clean_pod_policy: str | None = Field("Running", alias="cleanPodPolicy")
    ttl_seconds_after_finished: int | None = Field(None, alias="ttlSecondsAfterFinished")
    active_deadline_seconds: int | None = Field(None, alias="activeDeadlineSeconds")
    backoff_limit: int | None = Field(None, alias="backoffLimit")


class PyTorchJobSpec(_CamelModel):
    # A string in the v1 API (it also accepts "auto", "gpu", "cpu").
    nproc_per_node: str | None = Field(None, alias="nprocPerNode")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, alias="runPolicy")
    pytorch_replica_specs: dict[str, ReplicaSpec] = Field(alias="pytorchReplicaSpecs")


class PyTorchJob(_CamelModel):
    api_version: str = Field("kubeflow.org/v1", alias="apiVersion")
    kind: str = "PyTorchJob"
    metadata: dict[str, Any]
    spec: PyTorchJobSpec


def pytorch_job(
    spec: JobSpec, options: K8sOptions, *, name: str | None = None, run_id: str | None = None
) -> PyTorchJob:
    """Master + Workers for clusters with the Kubeflow training operator (it injects MASTER_ADDR, RANK, ...)."""
    name = name or spec.name
    labels = labels_for(name, options, run_id)
    main, volumes = container(spec, options, name=PYTORCH_CONTAINER_NAME)
    template = to_dict(
        k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels=labels), spec=pod_spec(main, volumes, options))
    )
    replicas = {"Master": ReplicaSpec(replicas=1, template=template)}
    if spec.resources.nodes > 1:
        replicas["Worker"] = ReplicaSpec(replicas=spec.resources.nodes - 1, template=template)
    nproc = spec.resources.gpus_per_node or spec.resources.ntasks_per_node
    return PyTorchJob(
        metadata=to_dict(_meta(name, options, labels)),
        spec=PyTorchJobSpec(
            nproc_per_node=str(nproc),
            run_policy=RunPolicy(
                ttl_seconds_after_finished=options.ttl_seconds_after_finished,
                active_deadline_seconds=spec.resources.time_seconds,
                backoff_limit=options.backoff_limit,
            ),
            pytorch_replica_specs=replicas,
        ),
    )


# --- inference ----------------------------------------------------------------


def _probe(spec: ServiceSpec) -> k.V1Probe:
    return k.V1Probe(
        http_get=k.V1HTTPGetAction(path=spec.health_path, port=spec.port),
        period_seconds=10,
        failure_threshold=3,
    )


def inference_deployment(spec: ServiceSpec, options: K8sOptions, *, replicas: int = 1) -> k.V1Deployment:
    """The model server; its GPUs (``gpus_per_node``) are the tensor-parallel size."""
    labels = labels_for(spec.name, options)
    main, volumes = container(
        spec,
        options,
        ports=[k.V1ContainerPort(name="http", container_port=spec.port)],
        readiness=_probe(spec),
    )
    return k.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=_meta(spec.name, options, labels),
        spec=k.V1DeploymentSpec(
            replicas=replicas,
            selector=k.V1LabelSelector(match_labels={LABEL_JOB: spec.name}),
            # A new model server must not start beside the old one on the same GPUs.
            strategy=k.V1DeploymentStrategy(type="Recreate"),
            template=k.V1PodTemplateSpec(
                metadata=k.V1ObjectMeta(labels=labels),
                spec=pod_spec(main, volumes, options, restart_policy="Always"),
            ),
        ),
    )


def inference_service(spec: ServiceSpec, options: K8sOptions) -> k.V1Service:
    validation.dns1035_label(spec.name, "service name")
    labels = labels_for(spec.name, options)
    return k.V1Service(
        api_version="v1",
        kind="Service",
        metadata=_meta(spec.name, options, labels),
        spec=k.V1ServiceSpec(
            type="ClusterIP",
            selector={LABEL_JOB: spec.name},
            ports=[k.V1ServicePort(name="http", port=spec.port, target_port="http", protocol="TCP")],
        ),
    )


def knative_service(spec: ServiceSpec, options: K8sOptions) -> dict[str, Any]:
    """A Knative ``serving.knative.dev/v1`` Service (the seed guide's ksvc), kept at one warm replica."""
    validation.dns1035_label(spec.name, "service name")
    labels = labels_for(spec.name, options)
    main, volumes = container(
        spec, options, ports=[k.V1ContainerPort(name="http1", container_port=spec.port)], readiness=_probe(spec)
    )
    # The probe keeps the container's own port: the only one Knative accepts there.
    # Knative accepts the PVC and emptyDir volumes only with its features
    # kubernetes.podspec-persistent-volume-claim / -emptydir enabled.
    pod = to_dict(pod_spec(main, volumes, options, restart_policy=None))
    pod.pop("restartPolicy", None)
    return {
        "apiVersion": "serving.knative.dev/v1",
        "kind": "Service",
        "metadata": to_dict(_meta(spec.name, options, labels)),
        "spec": {
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "autoscaling.knative.dev/min-scale": "1",
                        "autoscaling.knative.dev/max-scale": "1",
                    },
                },
                "spec": pod,
            }
        },
    }


def workspace_pvc(options: K8sOptions) -> k.V1PersistentVolumeClaim:
    """The shared workspace every job mounts; applied once per namespace."""
    if not options.pvc_name:
        raise ValueError("no pvc_name set: there is no workspace PVC to render")
    return k.V1PersistentVolumeClaim(
        api_version="v1",
        kind="PersistentVolumeClaim",
        metadata=_meta(options.pvc_name, options, {LABEL_MANAGED_BY: "nemoflow", **options.labels}),
        spec=k.V1PersistentVolumeClaimSpec(
            access_modes=["ReadWriteMany"],
            storage_class_name=options.pvc_storage_class,
            resources=k.V1VolumeResourceRequirements(requests={"storage": options.pvc_size}),
        ),
    )


# --- what a spec becomes --------------------------------------------------------


def job_objects(spec: JobSpec, options: K8sOptions, *, name: str | None = None, run_id: str | None = None) -> list[Any]:
    """Every object a JobSpec is submitted as, in creation order (Service before its Job)."""
    name = name or spec.name
    if spec.array_size:
        return [array_job(spec, options, name=name, run_id=run_id)]
    if spec.resources.nodes > 1:
        if options.training_kind == "pytorchjob":
            return [pytorch_job(spec, options, name=name, run_id=run_id)]
        return [
            headless_service(name, options, run_id=run_id),
            multinode_job(spec, options, name=name, run_id=run_id),
        ]
    return [single_job(spec, options, name=name, run_id=run_id)]


def service_objects(spec: ServiceSpec, options: K8sOptions) -> list[Any]:
    if options.inference_kind == "knative":
        return [knative_service(spec, options)]
    return [inference_deployment(spec, options), inference_service(spec, options)]

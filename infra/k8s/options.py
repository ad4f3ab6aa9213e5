"""Cluster-specific settings for the Kubernetes backend and ``nemoflow render``.

Every field can be set from the environment with the ``NEMOFLOW_K8S_`` prefix
(``NEMOFLOW_K8S_NAMESPACE=team-llm``), or from the ``k8s:`` section of the file
given to ``nemoflow render --config``. Defaults follow the NeMo-on-Run:ai guide:
a shared ReadWriteMany PVC mounted at ``/nemo-workspace``, a ``/dev/shm``
in memory for NCCL and data loaders, secrets in one Secret.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_IMAGE = "nvcr.io/nvidia/nemo:25.02"
WORKSPACE_MOUNT = "/nemo-workspace"


class Toleration(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    key: str | None = None
    operator: str = "Exists"
    value: str | None = None
    effect: str | None = None


class K8sOptions(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NEMOFLOW_K8S_", extra="forbid", env_nested_delimiter="__")

    namespace: str = Field("default", description="namespace every object is created in")
    image: str = Field(DEFAULT_IMAGE, description="container image for specs that name none")
    image_pull_policy: str = Field("IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")
    image_pull_secrets: list[str] = Field(default_factory=list, description="names of registry Secrets")
    pvc_name: str | None = Field("nemo-workspace", description="shared ReadWriteMany PVC; None: no workspace")
    workspace_mount: str = Field(WORKSPACE_MOUNT, description="where the PVC is mounted in every pod")
    pvc_storage_class: str | None = Field(
        None, description="storage class of the PVC manifest (cluster default if unset)"
    )
    pvc_size: str = Field("1Ti", description="size of the PVC manifest")
    shm: bool = Field(True, description="mount an in-memory emptyDir at /dev/shm (NCCL, DataLoader workers)")
    shm_size: str | None = Field(None, description="size limit of /dev/shm, e.g. '64Gi' (unbounded if unset)")
    scheduler_name: str | None = Field(None, description="e.g. 'runai-scheduler'; the default scheduler if unset")
    service_account: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    secret_name: str = Field(
        "nemoflow-secrets",
        description="Secret whose keys are the secret env names (HF_TOKEN, WANDB_API_KEY)",
    )
    secret_names: dict[str, str] = Field(
        default_factory=dict, description="per-variable Secret override: {'HF_TOKEN': 'hf-secret'}"
    )
    optional_secrets: list[str] = Field(
        default_factory=lambda: ["WANDB_API_KEY"],
        description="secret env names a job may run without (secretKeyRef optional: true; preflight does not "
        "require them). W&B logging is off when WANDB_API_KEY is absent.",
    )
    ttl_seconds_after_finished: int | None = Field(3600, ge=0, description="finished Jobs are deleted after this")
    backoff_limit: int = Field(0, ge=0, description="pod retries of a Job (0: a failure fails the stage)")
    array_parallelism: int | None = Field(None, ge=1, description="default parallelism of Indexed array Jobs")
    training_kind: str = Field(
        "indexed-job",
        pattern="^(indexed-job|pytorchjob)$",
        description="multi-node training as an Indexed Job + headless Service (any cluster) or a Kubeflow PyTorchJob",
    )
    rendezvous_port: int = Field(29500, ge=1, le=65535)
    inference_kind: str = Field("deployment", pattern="^(deployment|knative)$")
    labels: dict[str, str] = Field(default_factory=dict, description="added to every object and pod")

    def secret_for(self, env_name: str) -> str:
        return self.secret_names.get(env_name, self.secret_name)

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None) -> K8sOptions:
        """Options from a config-file section; environment variables fill what it leaves out."""
        return cls(**(data or {}))

"""Cluster-specific settings for the Kubernetes backend and ``nemoflow render``.

Every field can be set from the environment with the ``NEMOFLOW_K8S_`` prefix
(``NEMOFLOW_K8S_NAMESPACE=team-llm``), or from the ``k8s:`` section of the file
given to ``nemoflow render --config``. Defaults follow the NeMo-on-Run:ai guide:
a shared ReadWriteMany PVC mounted at ``/nemo-workspace``, a ``/dev/shm``
in memory for NCCL and data loaders, secrets in one Secret.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.k8s import validation as v
from infra.k8s.images import validate_image_reference

DEFAULT_IMAGE = "nvcr.io/nvidia/nemo:25.02"
WORKSPACE_MOUNT = "/nemo-workspace"


ENV_PREFIX = "NEMOFLOW_K8S_"


class K8sOptionsError(ValueError):
    """An invalid option, as one line naming the field (and the variable it came from)."""


class Toleration(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    key: str | None = None
    operator: str = Field("Exists", pattern="^(Exists|Equal)$")
    value: str | None = None
    effect: str | None = Field(None, pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")

    @model_validator(mode="after")
    def _check(self) -> Toleration:
        if self.key:
            v.qualified_name(self.key, "key")
        elif self.operator != "Exists":
            raise ValueError("a toleration without a key must use operator 'Exists'")
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty when operator is 'Exists'")
        if self.value:
            v.label_value(self.value, "value")
        return self


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
    max_resubmits: int = Field(
        3,
        ge=0,
        description="a Job whose pod was evicted or preempted is submitted again, up to this many times "
        "(the workload resumes from its latest checkpoint)",
    )
    array_parallelism: int | None = Field(None, ge=1, description="default parallelism of Indexed array Jobs")
    training_kind: str = Field(
        "indexed-job",
        pattern="^(indexed-job|pytorchjob)$",
        description="multi-node training as an Indexed Job + headless Service (any cluster) or a Kubeflow PyTorchJob",
    )
    rendezvous_port: int = Field(29500, ge=1, le=65535)
    inference_kind: str = Field("deployment", pattern="^(deployment|knative)$")
    labels: dict[str, str] = Field(default_factory=dict, description="added to every object and pod")

    def __init__(self, **data: Any) -> None:
        # One line naming the field, not pydantic's multi-line report: this reaches users as-is.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise K8sOptionsError(_one_line(exc, data)) from None

    # --- Kubernetes' rules for each field (infra/k8s/validation.py) ---
    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return v.dns1123_label(value, "namespace")

    @field_validator("pvc_name", "pvc_storage_class", "scheduler_name", "service_account")
    @classmethod
    def _object_name(cls, value: str | None, info) -> str | None:
        return None if value is None else v.dns1123_subdomain(value, info.field_name)

    @field_validator("secret_name")
    @classmethod
    def _secret_name(cls, value: str) -> str:
        return v.dns1123_subdomain(value, "secret_name")

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str]) -> list[str]:
        return [v.dns1123_subdomain(name, f"image_pull_secrets[{i}]") for i, name in enumerate(value)]

    @field_validator("secret_names")
    @classmethod
    def _secret_names(cls, value: dict[str, str]) -> dict[str, str]:
        for env_name, secret in value.items():
            v.secret_key(env_name, "secret_names key")
            v.dns1123_subdomain(secret, f"secret_names[{env_name!r}]")
        return value

    @field_validator("optional_secrets")
    @classmethod
    def _optional_secrets(cls, value: list[str]) -> list[str]:
        return [v.secret_key(name, f"optional_secrets[{i}]") for i, name in enumerate(value)]

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        return validate_image_reference(value)

    @field_validator("workspace_mount")
    @classmethod
    def _mount(cls, value: str) -> str:
        return v.absolute_path(value, "workspace_mount")

    @field_validator("pvc_size")
    @classmethod
    def _pvc_size(cls, value: str) -> str:
        v.quantity(value, "pvc_size")
        return value

    @field_validator("shm_size")
    @classmethod
    def _shm_size(cls, value: str | None) -> str | None:
        if value is not None:
            v.quantity(value, "shm_size")
        return value

    @field_validator("labels", "node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str], info) -> dict[str, str]:
        return v.labels(value, info.field_name)

    def secret_for(self, env_name: str) -> str:
        return self.secret_names.get(env_name, self.secret_name)

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None) -> K8sOptions:
        """Options from a config-file section; environment variables fill what it leaves out."""
        if data is not None and not isinstance(data, dict):
            raise K8sOptionsError(f"k8s: expected a mapping of options, got {type(data).__name__}")
        return cls(**(data or {}))


def _one_line(exc: ValidationError, data: dict[str, Any]) -> str:
    """``k8s.namespace 'Bad_Namespace!' is not a valid name: ...``; several errors joined by '; '.

    A value that came from the environment is named by its variable (NEMOFLOW_K8S_NAMESPACE).
    """
    parts = []
    for error in exc.errors(include_url=False):
        loc = [str(p) for p in error.get("loc", ())]
        field = ".".join(loc) or "k8s"
        where = f"k8s.{field}" if loc and loc[0] in data else f"{ENV_PREFIX}{loc[0].upper()}" if loc else "k8s"
        message = error.get("msg", "invalid").removeprefix("Value error, ")
        if error.get("type") == "extra_forbidden":
            message = f"unknown option {field!r} (known: {', '.join(K8sOptions.model_fields)})"
        elif loc and message.startswith(loc[-1]) and message[len(loc[-1]) : len(loc[-1]) + 1] in (" ", "["):
            # the validators' messages start with the field's name: put the full name there
            parts.append(where + message[len(loc[-1]) :])
            continue
        elif "input" in error:
            message = f"{error['input']!r}: {message}"
        parts.append(f"{where}: {message}")
    return "invalid Kubernetes options: " + "; ".join(parts)

"""Where a flow's jobs run, and with what options: one typed value, the executor.

    config = EndToEndConfig(executor={"kind": "slurm", "partition": "gpu", "account": "proj"})
    backend = get_backend(config.executor)          # a SlurmBackend with those options

An executor is a tagged union (``kind``) of :class:`LocalExecutor`,
:class:`SlurmExecutor` (every sbatch option of :class:`infra.slurm.options.SlurmOptions`)
and :class:`K8sExecutor` (every cluster option of :class:`infra.k8s.options.K8sOptions`).
Flow configs hold one, Prefect shows it as a typed parameter, and stages hand it to
:func:`get_backend`. A name alone is accepted where an executor is expected
(``executor: slurm``). Fields left unset are filled from the environment
(``NEMOFLOW_SLURM_*``, ``NEMOFLOW_K8S_*``) in the process that runs the flow, so a
site's settings apply to every deployment; ``nemoflow settings`` shows the result.

A fourth backend is one module in infra/backends/ plus one executor class here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field

from infra.jobs import Backend
from infra.k8s.options import K8sOptions
from infra.slurm.options import SlurmOptions


class LocalExecutor(BaseModel):
    """Processes on the machine that runs the flow (the embedded default)."""

    kind: Literal["local"] = "local"
    max_parallel: int | None = Field(None, ge=1, description="processes at once (default: one per CPU core)")

    def backend(self) -> Backend:
        from infra.backends.local import LocalBackend

        return LocalBackend(max_parallel=self.max_parallel)


class SlurmExecutor(SlurmOptions):
    """sbatch jobs on a Slurm cluster; the fields are sbatch's options (``partition``, ``account``, ...)."""

    kind: Literal["slurm"] = "slurm"

    def backend(self) -> Backend:
        from infra.backends.slurm import SlurmBackend

        return SlurmBackend(self)


class K8sExecutor(K8sOptions):
    """Kubernetes Jobs and Deployments on a shared workspace PVC (Run:ai, DGX Cloud, any cluster)."""

    kind: Literal["k8s"] = "k8s"

    def backend(self) -> Backend:
        from infra.backends.k8s import KubernetesBackend

        return KubernetesBackend(self)


EXECUTORS: dict[str, type[BaseModel]] = {"local": LocalExecutor, "slurm": SlurmExecutor, "k8s": K8sExecutor}
AnyExecutor = LocalExecutor | SlurmExecutor | K8sExecutor


def as_executor(value: Any) -> AnyExecutor:
    """An executor from a name (``"slurm"``), a mapping (``{"kind": "slurm", ...}``) or an executor.

    Built through the class itself, so unset fields are read from the environment (pydantic's
    nested validation would skip that).
    """
    if isinstance(value, LocalExecutor | SlurmExecutor | K8sExecutor):
        return value
    if value is None:
        return default_executor()
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, dict):
        raise ValueError(f"an executor is a name ({', '.join(EXECUTORS)}) or a mapping with 'kind', not {value!r}")
    kind = value.get("kind", "local")
    if kind not in EXECUTORS:
        raise ValueError(f"unknown executor kind {kind!r}; choose one of {', '.join(EXECUTORS)}")
    return EXECUTORS[kind](**value)


Executor = Annotated[
    LocalExecutor | SlurmExecutor | K8sExecutor,
    BeforeValidator(as_executor),
    Field(discriminator="kind"),
]


def default_executor() -> AnyExecutor:
    """The executor a config that names none gets: ``NEMOFLOW_EXECUTOR`` (default ``local``)."""
    from infra.settings import get_settings

    return as_executor(get_settings().executor)


def get_backend(executor: Any = None) -> Backend:
    """The backend that runs jobs for ``executor`` (an executor, its name, or a mapping)."""
    return as_executor(executor).backend()

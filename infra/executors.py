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

A fourth backend is one module in infra/backends/ plus one executor class here, added to
``EXECUTOR_TYPES`` (the one list: the union, ``EXECUTORS``, the settings' choices and every
command's ``--backend`` choices come from it). What the command line does differently per
backend (the extra files ``nemoflow render`` writes, interactive sessions) is a method of the
executor (:class:`ExecutorBase`), so no command asks which backend it holds.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, Field

from infra.jobs import Backend
from infra.k8s.options import K8sOptions
from infra.slurm.options import SlurmOptions


class ExecutorBase:
    """What every executor offers besides its backend: the command line's backend-specific parts.

    Defaults suit a backend that needs nothing extra; an executor overrides what differs.
    """

    def backend(self) -> Backend:
        raise NotImplementedError

    def render_setup(self) -> dict[str, str]:
        """Files ``nemoflow render`` writes besides the jobs' own (objects applied once, such as a volume)."""
        return {}

    def render_work_dir(self, work_dir: str, chosen: bool) -> str | None:
        """The work dir to render jobs with when ``work_dir`` (the setting; ``chosen``: set by the user)
        is not one this backend's jobs can see; None when it is. Raises when a chosen one cannot work."""
        return None

    def apply_hint(self, out_dir: str) -> str:
        """How a user submits what ``nemoflow render`` wrote to ``out_dir``."""
        return "sbatch / bash them"

    def interactive(self, preset: str | None = None, kubeconfig: str | None = None) -> Any:
        """This backend's :class:`infra.sessions.Sessions` (held nodes with a shell); ``ValueError`` where
        it has none. ``preset``: a Slurm cluster type; ``kubeconfig``: a Kubernetes client's file."""
        raise ValueError(
            f"the {self.kind} backend has no interactive sessions; choose one of {', '.join(interactive_kinds())}"
        )


class LocalExecutor(ExecutorBase, BaseModel):
    """Processes on the machine that runs the flow (the embedded default)."""

    kind: Literal["local"] = "local"
    max_parallel: int | None = Field(None, ge=1, description="processes at once (default: one per CPU core)")

    def backend(self) -> Backend:
        from infra.backends.local import LocalBackend

        return LocalBackend(max_parallel=self.max_parallel)


class SlurmExecutor(ExecutorBase, SlurmOptions):
    """sbatch jobs on a Slurm cluster; the fields are sbatch's options (``partition``, ``account``, ...)."""

    kind: Literal["slurm"] = "slurm"

    def backend(self) -> Backend:
        from infra.backends.slurm import SlurmBackend

        return SlurmBackend(self)

    def interactive(self, preset: str | None = None, kubeconfig: str | None = None) -> Any:
        from infra.sessions import SlurmSessions

        return SlurmSessions(SlurmOptions(**({"preset": preset} if preset else {})))


class K8sExecutor(ExecutorBase, K8sOptions):
    """Kubernetes Jobs and Deployments on a shared workspace PVC (Run:ai, DGX Cloud, any cluster)."""

    kind: Literal["k8s"] = "k8s"

    def backend(self) -> Backend:
        from infra.backends.k8s import KubernetesBackend

        return KubernetesBackend(self)

    def render_setup(self) -> dict[str, str]:
        if not self.pvc_name:
            return {}
        import yaml

        from infra.k8s.manifests import to_dict, workspace_pvc

        pvc = to_dict(workspace_pvc(self))
        return {f"persistentvolumeclaim-{pvc['metadata']['name']}.yaml": yaml.safe_dump(pvc, sort_keys=False)}

    def render_work_dir(self, work_dir: str, chosen: bool) -> str | None:
        """Pods see only the workspace PVC (and gs://), so a local work dir outside it cannot be the run's.

        Left at its default, it becomes ``<workspace_mount>/nemoflow`` (prefect.yaml's k8s deployments
        set NEMOFLOW_WORK_DIR=/nemo-workspace/nemoflow); set by the user, it is an error naming the variable.
        """
        from infra import storage

        if not self.pvc_name or not storage.is_local(work_dir):
            return None
        path = os.path.abspath(storage.local_path(work_dir))
        root = self.workspace_mount.rstrip("/")
        if path == root or path.startswith(root + "/"):
            return None
        wanted = f"{root}/nemoflow"
        if chosen:
            raise ValueError(
                f"NEMOFLOW_WORK_DIR={work_dir} is outside the workspace PVC ({root}), the only local path "
                f"Kubernetes pods see: set NEMOFLOW_WORK_DIR={wanted} (what prefect.yaml's k8s deployments set) "
                "or a gs:// URI"
            )
        return wanted

    def apply_hint(self, out_dir: str) -> str:
        return f"kubectl apply -f {out_dir}"

    def interactive(self, preset: str | None = None, kubeconfig: str | None = None) -> Any:
        from infra.sessions import DevPodSessions

        return DevPodSessions(kubeconfig)


# THE list of executors: everything else that names backends is derived from it.
EXECUTOR_TYPES: tuple[type[ExecutorBase], ...] = (LocalExecutor, SlurmExecutor, K8sExecutor)
EXECUTORS: dict[str, type[ExecutorBase]] = {cls.model_fields["kind"].default: cls for cls in EXECUTOR_TYPES}
AnyExecutor = Union[EXECUTOR_TYPES]  # noqa: UP007 - a union built from the tuple


def interactive_kinds() -> list[str]:
    """The executors whose backend holds interactive sessions (those that override ``interactive``)."""
    return [kind for kind, cls in EXECUTORS.items() if cls.interactive is not ExecutorBase.interactive]


def as_executor(value: Any) -> AnyExecutor:
    """An executor from a name (``"slurm"``), a mapping (``{"kind": "slurm", ...}``) or an executor.

    Built through the class itself, so unset fields are read from the environment (pydantic's
    nested validation would skip that).
    """
    if isinstance(value, EXECUTOR_TYPES):
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
    AnyExecutor,
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

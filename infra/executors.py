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
command's ``--backend`` choices come from it). What the command line and the dev tools do
differently per backend (the extra files ``nemoflow render`` writes, interactive sessions, the
Prefect work pool, how ``nemoflow demo`` runs, finds and stops its endpoint) is a method or
attribute of the executor (:class:`ExecutorBase`), so no command asks which backend it holds.
"""

from __future__ import annotations

import os
import shutil
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Union

from pydantic import BaseModel, BeforeValidator, Field

from infra.jobs import Backend
from infra.k8s.options import K8sOptions
from infra.slurm.options import SlurmOptions


class WorkPool(NamedTuple):
    """The Prefect work pool prefect.yaml's deployments of a backend run in (``nemoflow deploy`` creates it)."""

    name: str
    worker_type: str
    base_job_template: str | None = None  # relative to the repository root


class Demo(NamedTuple):
    """How ``nemoflow demo --backend KIND`` runs on a backend (its deployment is ``end-to-end/KIND``)."""

    port: int  # the endpoint's port: each backend its own, so a demo of each can run at once
    setup: tuple[str, ...] = ()  # `nemoflow` arguments that bring the backend up on this machine first


class ExecutorBase:
    """What every executor offers besides its backend: the command line's backend-specific parts.

    Defaults suit a backend that needs nothing extra; an executor overrides what differs.
    """

    kind: str
    work_pool: ClassVar[WorkPool]
    demo: ClassVar[Demo | None] = None  # None: `nemoflow demo` does not run on this backend
    # Its jobs and services run on the machine that runs the flow (so they may use its GPUs and ports).
    on_this_machine: ClassVar[bool] = False

    def backend(self) -> Backend:
        raise NotImplementedError

    def available_here(self) -> bool:
        """Whether this machine can reach the backend at all (its client tools are installed)."""
        return True

    def find_service(self, name: str, port: int, listener: int | None) -> str | None:
        """Who this backend's service ``name`` is, when it is what serves on ``port`` of this machine
        (``listener``: the pid listening there, None when this user cannot see it); None when it is not."""
        info = self.backend().service(name)
        if info is not None and info.url.endswith(f":{port}"):
            return f"{name} ({self.kind} job, {info.url})"
        return None

    def stop_services(self, name: str) -> tuple[list[str], list[str], set[int]]:
        """Stop this backend's service ``name``: (what was stopped, what could not be, the ports of this machine
        they served on). Raises when the backend cannot be reached."""
        if self.backend().stop_service(name):
            return [f"cancelled the inference server's {self.kind} job {name}"], [], set()
        return [], [], set()

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

    work_pool: ClassVar[WorkPool] = WorkPool("local", "process")
    demo: ClassVar[Demo | None] = Demo(port=8000)
    on_this_machine: ClassVar[bool] = True

    def backend(self) -> Backend:
        from infra.backends.local import LocalBackend

        return LocalBackend(max_parallel=self.max_parallel)

    # Local services live in the work dir's service table; a switched-in server is named ``NAME-...``.
    def find_service(self, name: str, port: int, listener: int | None) -> str | None:
        from infra import processes, services

        if listener is None:
            return None
        for handle in services.list_services():
            if handle.name.startswith(name) and handle.port == port:
                if listener in processes.group_members(handle.pid) or processes.descends_from(listener, handle.pid):
                    return f"{handle.name} (pid {handle.pid}, {handle.url})"
        return None

    def stop_services(self, name: str) -> tuple[list[str], list[str], set[int]]:
        from infra import services
        from infra.settings import get_settings

        work_dir = get_settings().work_dir
        try:
            handles = [h for h in services.list_services() if h.name.startswith(name)]
        except Exception as exc:  # noqa: BLE001 - a table we cannot read: say which
            return [], [f"could not read the service table of work dir {work_dir}: {exc}"], set()
        stopped: list[str] = []
        problems: list[str] = []
        for handle in handles:
            try:
                services.stop_service(handle.name)
                stopped.append(f"stopped the inference server {handle.name} ({handle.url}, work dir {work_dir})")
            except Exception as exc:  # noqa: BLE001 - name it and go on with the rest
                problems.append(f"could not stop the inference server {handle.name} ({handle.url}): {exc}")
        return stopped, problems, {h.port for h in handles}


class SlurmExecutor(ExecutorBase, SlurmOptions):
    """sbatch jobs on a Slurm cluster; the fields are sbatch's options (``partition``, ``account``, ...)."""

    kind: Literal["slurm"] = "slurm"

    work_pool: ClassVar[WorkPool] = WorkPool("gpu-cluster", "slurm", "deployments/slurm/base-job-template.json")
    # The one-machine Slurm (`nemoflow local-slurm up`), whose node is this machine: a port of its own lets
    # the Slurm demo serve beside a local demo left running (the README's order).
    demo: ClassVar[Demo | None] = Demo(port=8001, setup=("local-slurm", "up"))

    def backend(self) -> Backend:
        from infra.backends.slurm import SlurmBackend

        return SlurmBackend(self)

    def available_here(self) -> bool:
        return shutil.which("squeue") is not None

    def interactive(self, preset: str | None = None, kubeconfig: str | None = None) -> Any:
        from infra.sessions import SlurmSessions

        return SlurmSessions(SlurmOptions(**({"preset": preset} if preset else {})))


class K8sExecutor(ExecutorBase, K8sOptions):
    """Kubernetes Jobs and Deployments on a shared workspace PVC (Run:ai, DGX Cloud, any cluster)."""

    kind: Literal["k8s"] = "k8s"

    work_pool: ClassVar[WorkPool] = WorkPool("nemoflow-k8s", "kubernetes", "deployments/k8s/base-job-template.json")

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


def demo_kinds() -> list[str]:
    """The executors ``nemoflow demo`` runs on (those with a :class:`Demo`)."""
    return [kind for kind, cls in EXECUTORS.items() if cls.demo is not None]


def work_pools() -> list[WorkPool]:
    """The work pools of every backend's deployments (prefect.yaml's)."""
    return [cls.work_pool for cls in EXECUTOR_TYPES]


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

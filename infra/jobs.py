"""The backend contract: what a stage asks to run, and what it gets back.

A stage describes work as a :class:`JobSpec` (run to completion) or a
:class:`ServiceSpec` (a long-running server), usually through the one builder
:func:`workload_job` / :func:`workload_service` ("run this workload module with
these arguments, in this image, with these resources"), and hands it to the
:class:`Backend` that :func:`infra.executors.get_backend` returns for the flow's
executor (local processes, sbatch jobs, Kubernetes objects). Every backend
implements the whole contract, so a stage never knows where it runs and never
branches on a backend's name:

- jobs: :meth:`Backend.run` (submit, stream the log, wait, resubmit what is
  resumable, cancel on interruption) and :meth:`Backend.cancel`;
- services: :meth:`Backend.start_service`, :meth:`Backend.stop_service`,
  :meth:`Backend.service` (inspect: running? healthy? which fingerprint?),
  :meth:`Backend.service_log_tail` (its last log lines) and
  :meth:`Backend.switch_service` (replace a running server without downtime);
- images: :meth:`Backend.stage_image` (what this backend's jobs run in),
  :meth:`Backend.planned_image` (the same, without doing it) and
  :meth:`Backend.image_identity` (its cache key);
- review: :meth:`Backend.render` (the files a submission would write).

Fan-out: ``array_size=N`` runs N copies; each sees its index in the
environment variable ``NEMOFLOW_ARRAY_INDEX`` (a Slurm job array, an Indexed
Kubernetes Job, or N local processes). Distributed PyTorch: ``nproc_per_node=P``
starts P processes on each of ``resources.nodes`` nodes under torchrun (the
backend provides the rendezvous: standalone locally, the first node of a Slurm
allocation, the headless Service of an Indexed Job).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, Field, field_validator

ARRAY_INDEX_ENV = "NEMOFLOW_ARRAY_INDEX"
# The repository root: jobs that run outside the nemoflow image (this Python environment, a
# NeMo .sqsh) import the workloads from here.
REPO_ROOT = str(Path(__file__).resolve().parents[1])
# Where the nemoflow image (deployments/image/) holds the repository.
IMAGE_REPO_ROOT = "/opt/nemoflow"

_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})$|^(\d+)$|^(\d+):(\d{2})$")
_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class ExitCode(enum.IntEnum):
    """What a workload's exit status means; every backend and stage reads them from here."""

    OK = 0
    BAD_CONFIG = 2  # retrying cannot help: the input is wrong
    OUT_OF_MEMORY = 75  # the workload caught an out-of-memory error (reported as OUT_OF_MEMORY)
    PREEMPTED = 76  # stopped by SIGTERM/SIGUSR1 after saving a checkpoint: resubmit to resume


def parse_time_limit(value: str) -> int:
    """Slurm time syntax to seconds: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH:MM:SS``.

    >>> parse_time_limit("1-02:00:00")
    93600
    """
    match = _TIME_RE.match(value.strip())
    if not match:
        raise ValueError(f"time limit {value!r} is not MM, MM:SS, HH:MM:SS or D-HH:MM:SS")
    days, hours, minutes, seconds, only_minutes, mm, ss = match.groups()
    if only_minutes is not None:
        return int(only_minutes) * 60
    if mm is not None:
        return int(mm) * 60 + int(ss)
    return int(days or 0) * 86400 + int(hours) * 3600 + int(minutes) * 60 + int(seconds)


def _checked_time_limit(value: str | None) -> str | None:
    if value is not None:
        parse_time_limit(value)
    return value


# A model field holding a time limit in Slurm syntax (None: none), refused at validation when unparseable.
TimeLimit = Annotated[str | None, AfterValidator(_checked_time_limit)]


class Resources(BaseModel):
    """Resources of one job, named like sbatch's options."""

    nodes: int = Field(1, ge=1)
    ntasks_per_node: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    mem: str | None = Field(None, description="memory per node, e.g. '16G' (sbatch --mem)")
    time: TimeLimit = Field(None, description="time limit, sbatch syntax, e.g. '04:00:00'")

    @property
    def time_seconds(self) -> int | None:
        return parse_time_limit(self.time) if self.time else None


class Mount(BaseModel):
    source: str
    target: str
    read_only: bool = False


@dataclasses.dataclass(frozen=True)
class ImageKind:
    """How a job runs in an image of one kind: the builder reads these facts and never the kind's name.

    ``container``: jobs run in a container whose image is the ref's ``uri`` (else ``uri`` is the
    interpreter of an environment the job's machine shares); ``code_root``: where the repository is
    inside; ``mount_code``: the repository is mounted in (the image lacks our code); ``holds_environment``:
    nemoflow's own environment and code are in the image, so paths under them are not mounted.
    """

    container: bool
    code_root: str = REPO_ROOT
    mount_code: bool = False
    holds_environment: bool = False


# Every kind of image a backend stages (ImageRef.kind); a new kind is one entry here.
IMAGE_KINDS: dict[str, ImageKind] = {
    "sqsh": ImageKind(container=True, mount_code=True),
    "registry": ImageKind(container=True, code_root=IMAGE_REPO_ROOT, holds_environment=True),
    "python-env": ImageKind(container=False),
}
_KIND_NAMES = [repr(kind) for kind in IMAGE_KINDS]


class ImageRef(BaseModel):
    """What a job runs in (and the lineage every artifact records).

    ``python-env``: no container; ``uri`` is the Python interpreter of an environment the job's
    machine shares (this machine, or nemoflow installed on a cluster's shared storage).
    ``sqsh``: an enroot/pyxis image file on shared storage (a NeMo container); the repository is
    mounted into it. ``registry``: an image reference a node pulls; the nemoflow image holds the
    repository at ``/opt/nemoflow``.
    """

    kind: str = Field(..., description=f"{', '.join(_KIND_NAMES[:-1])} or {_KIND_NAMES[-1]}")
    uri: str = Field(..., description="path/URI of the .sqsh, the image reference, or the python executable")
    checksum: str | None = None
    digest: str | None = None
    size: int | None = None
    source: str | None = None

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        if value not in IMAGE_KINDS:
            raise ValueError(f"unknown image kind {value!r}; choose one of {', '.join(IMAGE_KINDS)}")
        return value

    @property
    def runs_as(self) -> ImageKind:
        """How jobs run in this image (:data:`IMAGE_KINDS`)."""
        return IMAGE_KINDS[self.kind]

    @property
    def container(self) -> str | None:
        """The value for ``JobSpec.container_image``: None when jobs run without a container."""
        return self.uri if self.runs_as.container else None

    def lineage(self) -> dict[str, str]:
        """Flat facts for manifests, artifacts and job environments (``NEMOFLOW_IMAGE*``)."""
        facts = {"image_kind": self.kind, "image": self.uri}
        for key in ("checksum", "digest", "source"):
            value = getattr(self, key)
            if value:
                facts[f"image_{key}"] = value
        return facts

    def lineage_markdown(self) -> str:
        """One line for a stage's artifact: which image produced this."""
        what = f"{self.kind} `{self.uri}`"
        if self.digest:
            what += f" @ `{self.digest}`"
        elif self.checksum:
            what += f" (`{self.checksum}`)"
        return "image: " + what


class JobSpec(BaseModel):
    name: str = Field(..., pattern=_NAME, max_length=63)
    command: list[str] = Field(..., min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: list[str] = Field(
        default_factory=list,
        description="names of secrets (HF_TOKEN, WANDB_API_KEY) the job needs; backends inject "
        "them without writing values into scripts, manifests or logs",
    )
    resources: Resources = Field(default_factory=Resources)
    container_image: str | None = None
    mounts: list[Mount] = Field(default_factory=list)
    workdir: str | None = None
    array_size: int | None = Field(None, ge=1)
    array_parallelism: int | None = Field(None, ge=1)
    nproc_per_node: int | None = Field(
        None, ge=1, description="a torch.distributed job: this many processes per node, started by torchrun"
    )
    log_dir: str | None = Field(None, description="where job output files go (shared storage)")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="short key=value tags the backend records with the job (Slurm --comment, Kubernetes "
        "labels): the flow run that submitted it, a fingerprint",
    )


class JobState(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    NODE_FAIL = "node_fail"
    PREEMPTED = "preempted"
    OUT_OF_MEMORY = "out_of_memory"
    UNKNOWN = "unknown"

    @property
    def is_terminal(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING, JobState.UNKNOWN)

    @property
    def is_resumable(self) -> bool:
        """Ended for a reason outside the job's code: resubmit and resume from a checkpoint."""
        return self in (JobState.TIMEOUT, JobState.NODE_FAIL, JobState.PREEMPTED)


class JobResult(BaseModel):
    job_id: str
    backend: str
    state: JobState
    exit_code: int | None = None
    reason: str | None = None
    log_tail: list[str] = Field(default_factory=list)
    attempts: int = 1


class JobFailed(RuntimeError):
    def __init__(self, spec_name: str, result: JobResult):
        self.result = result
        detail = f": {result.reason}" if result.reason else ""
        tail = "\n".join(result.log_tail[-20:])
        super().__init__(
            f"job {spec_name} ({result.backend} {result.job_id}) ended {result.state.value}"
            f" with exit code {result.exit_code}{detail}" + (f"\nlast log lines:\n{tail}" if tail else "")
        )


LogSink = Callable[[str], None]


class ServiceSpec(BaseModel):
    """A long-running server (the inference endpoint): a local process, a Slurm job, a k8s Deployment."""

    name: str = Field(..., pattern=_NAME, max_length=63)
    command: list[str] = Field(..., min_length=1)
    port: int = Field(..., ge=1, le=65535)
    health_path: str = "/health"
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: list[str] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    container_image: str | None = None
    mounts: list[Mount] = Field(default_factory=list)
    workdir: str | None = None
    fingerprint: str | None = Field(
        None,
        description="what was deployed (checkpoint, options, code); recorded by the backend and returned by "
        "Backend.service(), so a re-run can tell the running server is the one it would start",
    )
    log_dir: str | None = Field(None, description="where the server's output goes (shared storage)")
    labels: dict[str, str] = Field(default_factory=dict, description="as JobSpec.labels")
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="what it serves, for people ('checkpoint', 'model'): kept where the backend can "
        "(the local service table, Kubernetes annotations)",
    )


class ServiceInfo(BaseModel):
    """A running service as its backend sees it."""

    name: str
    url: str = Field(..., description="base URL clients use, e.g. http://127.0.0.1:8000")
    backend: str
    job_id: str | None = Field(None, description="pid, Slurm job id, or Kubernetes object name")
    healthy: bool = False
    fingerprint: str | None = None
    log: str | None = Field(None, description="where its output can be read (a file, or how to get it)")
    details: dict[str, Any] = Field(default_factory=dict)


class Backend(abc.ABC):
    """Where jobs and services run. Implemented by infra/backends/{local,slurm,k8s}.py.

    Adding a backend means one module with a subclass and an executor type in
    infra/executors.py; no stage changes.
    """

    name: ClassVar[str]
    # The address services bind to: loopback on this machine, every interface on a cluster node.
    bind_host: ClassVar[str] = "0.0.0.0"

    # ---- jobs
    @abc.abstractmethod
    def run(self, spec: JobSpec, on_log: LogSink | None = None) -> JobResult:
        """Submit, stream output to ``on_log``, wait for the end; cancel the job if interrupted."""

    @abc.abstractmethod
    def cancel(self, job_id: str) -> None:
        """Stop a job this backend started (a no-op when it already ended)."""

    # ---- services
    @abc.abstractmethod
    def start_service(
        self, spec: ServiceSpec, *, ready_timeout_s: float = 900.0, on_log: LogSink | None = None
    ) -> ServiceInfo:
        """Start (or bring to ``spec``) a server; return once ``spec.health_path`` answers.

        A service of the same name that runs something else (another fingerprint) is replaced.
        A start that fails or is interrupted leaves nothing running.
        """

    @abc.abstractmethod
    def stop_service(self, name: str) -> bool:
        """Stop a service; False when none of that name was running."""

    @abc.abstractmethod
    def service(self, name: str) -> ServiceInfo | None:
        """The running service of that name (with ``healthy`` probed now), or None."""

    @abc.abstractmethod
    def service_log_tail(self, name: str, lines: int = 20) -> list[str]:
        """The last lines the service of that name wrote (secrets redacted); [] when there are none."""

    @abc.abstractmethod
    def switch_service(
        self,
        current: str | None,
        spec: ServiceSpec,
        check: Callable[[ServiceInfo], None],
        *,
        ready_timeout_s: float = 900.0,
        on_log: LogSink | None = None,
    ) -> ServiceInfo:
        """Replace the service ``current`` by ``spec`` without downtime.

        ``check`` is called with the new server before it takes traffic (a smoke test that
        raises on failure); a failure leaves ``current`` serving and nothing of ``spec`` running.
        Returns the new service; its URL is the one clients should use from now on.
        """

    def _start_checked_then_stop(
        self,
        current: str | None,
        spec: ServiceSpec,
        check: Callable[[ServiceInfo], None],
        *,
        ready_timeout_s: float | None,
        on_log: LogSink | None,
    ) -> ServiceInfo:
        """:meth:`switch_service` for a backend that starts the new service beside the old one: start ``spec``,
        ``check`` it, then stop ``current``; a failed check stops ``spec`` and leaves ``current`` serving. Under
        the current name (updated in place, as a Deployment is), nothing is stopped."""
        new = self.start_service(spec, ready_timeout_s=ready_timeout_s, on_log=on_log)
        try:
            check(new)
        except BaseException:
            if current != spec.name:
                self.stop_service(spec.name)
            raise
        if current and current != spec.name:
            self.stop_service(current)
        return new

    # ---- images
    @abc.abstractmethod
    def stage_image(
        self,
        source: str | None,
        dest: str,
        *,
        convert: bool = False,
        force: bool = False,
        log: LogSink | None = None,
        progress: Callable[[int, int | None], None] | None = None,
        resources: Resources | None = None,
    ) -> tuple[ImageRef, dict[str, Any]]:
        """Make ``source`` usable by this backend's jobs; returns the ref and facts for a report.

        ``resources``: for a conversion job, where the backend runs one (enroot import on Slurm).
        """

    @abc.abstractmethod
    def planned_image(self, source: str | None, dest: str, convert: bool = False) -> ImageRef:
        """The ref :meth:`stage_image` would return, without copying or converting anything (render)."""

    @abc.abstractmethod
    def image_identity(self, source: str | None, dest: str, convert: bool = False) -> tuple[str, bool] | None:
        """A cache key for staging ``source`` (what would be staged), and whether it is staged now.

        None: not cacheable (the next call stages again).
        """

    # ---- review
    @abc.abstractmethod
    def render(self, spec: JobSpec | ServiceSpec) -> dict[str, str]:
        """The files a submission of ``spec`` would write (file name -> text), without submitting."""


# ---------------------------------------------------------------- the job builder


def python_for(image: ImageRef | None) -> str:
    """The interpreter a job uses in ``image``: this one, a shared environment's, or the container's."""
    if image is None:
        return sys.executable
    return "python" if image.runs_as.container else image.uri


def _code_placement(image: ImageRef | None) -> tuple[str, list[Mount]]:
    """Where the repository is inside the job, and the mounts that put it there."""
    if image is None:
        return REPO_ROOT, []
    kind = image.runs_as
    mounts = [Mount(source=REPO_ROOT, target=REPO_ROOT, read_only=True)] if kind.mount_code else []
    return kind.code_root, mounts  # the nemoflow image holds the code; a NeMo image gets it mounted


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _common(
    image: ImageRef | None, env: dict[str, str] | None, paths: Sequence[str], read_only: Sequence[str]
) -> dict[str, Any]:
    code, mounts = _code_placement(image)
    if image is not None and image.container is not None:
        # A container sees only what is mounted: the paths the job reads and writes, at the same place.
        # The nemoflow image (registry) holds nemoflow's own environment: files of it (the packaged
        # tokenizer, the code) are in the image already.
        inside = (sys.prefix, REPO_ROOT) if image.runs_as.holds_environment else ()
        seen = {m.target for m in mounts}
        for path, ro in [*((p, False) for p in paths), *((p, True) for p in read_only)]:
            if not path or "://" in path or path in seen or any(_under(path, root) for root in inside):
                continue
            mounts.append(Mount(source=path, target=path, read_only=ro))
            seen.add(path)
    job_env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": code, "TOKENIZERS_PARALLELISM": "false"}
    if image is not None:
        job_env.update({"NEMOFLOW_" + key.upper(): value for key, value in image.lineage().items()})
    job_env.update(env or {})
    return {
        "env": job_env,
        "container_image": image.container if image is not None else None,
        "mounts": mounts,
        "workdir": code,
    }


def workload_job(
    name: str,
    module: str,
    args: Sequence[str] = (),
    *,
    image: ImageRef | None = None,
    resources: Resources | None = None,
    paths: Sequence[str] = (),
    read_only: Sequence[str] = (),
    env: dict[str, str] | None = None,
    secret_env: Sequence[str] = (),
    array_size: int | None = None,
    array_parallelism: int | None = None,
    nproc_per_node: int | None = None,
    log_dir: str | None = None,
) -> JobSpec:
    """``python -m MODULE ARGS`` as a job in ``image`` (None: this Python environment).

    ``paths`` (read-write) and ``read_only`` are the directories the job uses; in a container they
    are mounted at the same place. Every stage builds its jobs here, and ``nemoflow render``
    renders exactly these specs.
    """
    return JobSpec(
        name=name,
        command=[python_for(image), "-m", module, *args],
        secret_env=list(secret_env),
        resources=resources or Resources(),
        array_size=array_size,
        array_parallelism=array_parallelism,
        nproc_per_node=nproc_per_node,
        log_dir=log_dir,
        **_common(image, env, paths, read_only),
    )


def workload_service(
    name: str,
    module: str,
    args: Sequence[str] = (),
    *,
    port: int,
    image: ImageRef | None = None,
    resources: Resources | None = None,
    paths: Sequence[str] = (),
    read_only: Sequence[str] = (),
    env: dict[str, str] | None = None,
    secret_env: Sequence[str] = (),
    health_path: str = "/health",
    fingerprint: str | None = None,
    log_dir: str | None = None,
    annotations: dict[str, str] | None = None,
) -> ServiceSpec:
    """``python -m MODULE ARGS`` as a long-running server in ``image`` (see :func:`workload_job`)."""
    return ServiceSpec(
        name=name,
        command=[python_for(image), "-m", module, *args],
        port=port,
        health_path=health_path,
        secret_env=list(secret_env),
        resources=resources or Resources(),
        fingerprint=fingerprint,
        log_dir=log_dir,
        annotations=annotations or {},
        **_common(image, env, paths, read_only),
    )

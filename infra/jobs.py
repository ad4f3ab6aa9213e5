"""The backend-neutral job description every stage submits, and the result it gets back.

A stage builds a :class:`JobSpec` (what to run, with which resources) and hands
it to a backend from :func:`infra.backends.get_backend` (``local``, ``slurm``
or ``k8s``). Backends translate the same description into a subprocess, an
sbatch script or Kubernetes manifests, so a stage never knows where it runs.

Fan-out: ``array_size=N`` runs N copies; each sees its index in the
environment variable ``NEMOFLOW_ARRAY_INDEX`` (a Slurm job array, an Indexed
Kubernetes Job, or N local processes).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel, Field, field_validator

ARRAY_INDEX_ENV = "NEMOFLOW_ARRAY_INDEX"

_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})$|^(\d+)$|^(\d+):(\d{2})$")


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


class Resources(BaseModel):
    """Resources of one job, named like sbatch's options."""

    nodes: int = Field(1, ge=1)
    ntasks_per_node: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    mem: str | None = Field(None, description="memory per node, e.g. '16G' (sbatch --mem)")
    time: str | None = Field(None, description="time limit, sbatch syntax, e.g. '04:00:00'")

    @field_validator("time")
    @classmethod
    def _check_time(cls, value: str | None) -> str | None:
        if value is not None:
            parse_time_limit(value)
        return value

    @property
    def time_seconds(self) -> int | None:
        return parse_time_limit(self.time) if self.time else None


class Mount(BaseModel):
    source: str
    target: str
    read_only: bool = False


class JobSpec(BaseModel):
    name: str = Field(..., pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
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
    log_dir: str | None = Field(None, description="where job output files go (shared storage)")


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


class Backend(Protocol):
    name: str

    def run(self, spec: JobSpec, on_log: LogSink | None = None) -> JobResult:
        """Submit, stream output to ``on_log``, wait for the end; cancel the job if interrupted."""
        ...


class ServiceSpec(BaseModel):
    """A long-running server (the inference endpoint): a local process, a Slurm job, a k8s Deployment."""

    name: str = Field(..., pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    command: list[str] = Field(..., min_length=1)
    port: int = Field(..., ge=1, le=65535)
    health_path: str = "/health"
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: list[str] = Field(default_factory=list)
    resources: Resources = Field(default_factory=Resources)
    container_image: str | None = None
    mounts: list[Mount] = Field(default_factory=list)
    workdir: str | None = None

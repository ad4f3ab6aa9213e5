"""Run a :class:`~infra.jobs.JobSpec` as a Slurm batch job (``get_backend("slurm", partition="gpu")``).

One :meth:`SlurmBackend.run` call: check the request against ``sinfo``
(preflight), render the sbatch script from the template, submit it with
``sbatch --parsable`` (secrets in sbatch's environment only, never in the
script), stream the job's output file(s) into ``on_log`` while a shared
watcher polls ``sacct`` for all jobs at once, and return a
:class:`~infra.jobs.JobResult` with Slurm's state and exit code.

- TIMEOUT, NODE_FAIL and PREEMPTED are resubmitted (only the affected tasks of
  an array) up to ``max_resubmits`` times; the workload resumes from its own
  latest checkpoint. FAILED is never retried here: that is Prefect's call.
- Any exit other than the job ending by itself (an exception, Ctrl-C, a
  Prefect cancellation) ``scancel``s the job: nothing is left running.
- ``array_size=N`` is ONE job array (``--array=0-N-1%P``); each task sees
  ``NEMOFLOW_ARRAY_INDEX`` and its output lines come prefixed ``[i]``.
"""

from __future__ import annotations

import collections
import getpass
import logging
import os
import time
import urllib.request
import uuid
from pathlib import Path

from infra.backends.local import EXIT_OUT_OF_MEMORY
from infra.jobs import JobFailed, JobResult, JobSpec, JobState, LogSink, ServiceSpec
from infra.settings import DEFAULT_HOME, get_settings, redact
from infra.slurm.commands import SlurmCLI, SlurmCommandError
from infra.slurm.options import SbatchRequest, SlurmOptions, merge
from infra.slurm.parsers import parse_scontrol_record
from infra.slurm.preflight import preflight
from infra.slurm.script import render_batch_script
from infra.slurm.watcher import JobStatus, SlurmWatcher, shared_watcher

logger = logging.getLogger(__name__)


class SlurmSubmitError(RuntimeError):
    """sbatch rejected the job; the message is sbatch's, prefixed with the job name."""


class OutputTail:
    """Follow a growing output file from the last read position (it may not exist yet)."""

    def __init__(self, path: str, prefix: str = ""):
        self.path, self.prefix = path, prefix
        self.offset = 0
        self.partial = ""

    def read(self, final: bool = False) -> list[str]:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        if size < self.offset:  # truncated (a requeued job started over)
            self.offset, self.partial = 0, ""
        if size == self.offset and not (final and self.partial):
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        text = self.partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        return [self.prefix + line for line in lines]


def expand_output(pattern: str, job_id: str, task: int | None, job_name: str) -> str:
    """The file sbatch writes for ``pattern`` (``%j``, ``%A``, ``%a``, ``%x``, ``%%``).

    >>> expand_output("/logs/%x-%A_%a.out", "12", 3, "prep")
    '/logs/prep-12_3.out'
    """
    out = pattern.replace("%%", "\0").replace("%A", job_id).replace("%x", job_name).replace("%j", job_id)
    out = out.replace("%a", str(task) if task is not None else "4294967294")
    return out.replace("\0", "%")


def _sbatch_env(spec: JobSpec, extra_env: dict[str, str] | None) -> dict[str, str]:
    # Variables of an enclosing allocation (a worker running inside a Slurm job)
    # would leak into the new job's srun steps and shrink or break them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    secrets = get_settings().secret_env()
    for name in spec.secret_env:
        if name in secrets:
            env[name] = secrets[name]
        elif name in os.environ:
            env[name] = os.environ[name]
    env.update(extra_env or {})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class SlurmBackend:
    name = "slurm"

    def __init__(
        self,
        options: SlurmOptions | None = None,
        *,
        cli: SlurmCLI | None = None,
        watcher: SlurmWatcher | None = None,
        poll_interval_s: float = 1.0,
        check: bool = True,
        **option_fields,
    ):
        # SlurmOptions fields may be passed directly: get_backend("slurm", partition="gpu")
        if option_fields:
            base = options.model_dump(exclude_unset=True) if options is not None else {}
            options = SlurmOptions(**{**base, **option_fields})
        self.options = options or SlurmOptions()
        self.cli = cli or SlurmCLI()
        self.watcher = watcher or (shared_watcher() if cli is None else SlurmWatcher(self.cli))
        self.poll_interval_s = poll_interval_s
        self.check = check

    # ------------------------------------------------------------------ helpers

    def log_dir(self, spec: JobSpec) -> str:
        path = spec.log_dir or self.options.log_dir or os.path.join(DEFAULT_HOME, "slurm", spec.name)
        if "://" in path and not path.startswith("file://"):
            raise ValueError(f"Slurm log_dir must be a path on shared storage, not {path!r}")
        path = path.removeprefix("file://")
        Path(path).mkdir(parents=True, exist_ok=True)
        return path

    def prepare(self, spec: JobSpec, array_indices: list[int] | None = None) -> tuple[SbatchRequest, str]:
        """Merged request and script text, without submitting (``nemoflow`` dry runs use this)."""
        req = merge(spec, self.options, self.log_dir(spec), array_indices)
        return req, render_batch_script(spec, req, self.options.container_mounts)

    def submit(
        self,
        spec: JobSpec,
        array_indices: list[int] | None = None,
        attempt: int = 1,
        extra_env: dict[str, str] | None = None,
        check: bool | None = None,
    ) -> tuple[str, SbatchRequest]:
        """Preflight, write the script (atomically), sbatch it; returns (job id, request)."""
        req, script = self.prepare(spec, array_indices)
        if self.check if check is None else check:
            preflight(req, spec, self.cli)
        log_dir = self.log_dir(spec)
        path = Path(log_dir) / f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}-a{attempt}.sbatch"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(script)
        tmp.replace(path)
        try:
            job_id = self.cli.sbatch(str(path), env=_sbatch_env(spec, extra_env))
        except SlurmCommandError as exc:
            raise SlurmSubmitError(f"sbatch rejected job {spec.name!r}: {redact(exc.stderr)}") from exc
        return job_id, req

    def cancel(self, job_id: str, wait_s: float = 15.0) -> None:
        """scancel and wait until squeue no longer lists the job (pending, running or completing)."""
        try:
            self.cli.scancel([job_id])
        except Exception as exc:  # noqa: BLE001 - never mask the exception that got us here
            logger.warning("scancel %s failed: %s", job_id, exc)
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                rows = self.cli.squeue([job_id])
            except Exception:  # noqa: BLE001 - squeue failing means nothing more to wait for
                return
            if not any(r.state.job_state in (JobState.PENDING, JobState.RUNNING) for r in rows):
                return
            time.sleep(0.3)

    # ------------------------------------------------------------------ run

    def run(self, spec: JobSpec, on_log: LogSink | None = None, extra_env: dict[str, str] | None = None) -> JobResult:
        indices = list(range(spec.array_size)) if spec.array_size else None
        tail: collections.deque[str] = collections.deque(maxlen=50)
        secrets = (
            get_settings().secret_values()
            + [os.environ[n] for n in spec.secret_env if os.environ.get(n)]
            + [v for k, v in (extra_env or {}).items() if "KEY" in k or "TOKEN" in k or "SECRET" in k]
        )

        def emit(line: str) -> None:
            line = redact(line, secrets)
            tail.append(line)
            if on_log is not None:
                on_log(line)

        attempts = 0
        while True:
            attempts += 1
            job_id, req = self.submit(spec, indices, attempts, extra_env, check=self.check and attempts == 1)
            emit(
                f"[slurm] submitted job {job_id} (attempt {attempts}"
                + (f", array {req.array}" if req.array else "")
                + ")"
            )
            status = self.wait(job_id, req, indices, emit)
            if status.state.is_resumable and attempts <= self.options.max_resubmits:
                if indices is not None:
                    indices = (
                        sorted(i for i, row in status.tasks.items() if row.state.job_state is not JobState.COMPLETED)
                        or indices
                    )
                emit(
                    f"[slurm] job {job_id} ended {status.state.value}; resubmitting "
                    f"({attempts}/{self.options.max_resubmits}) to resume from the latest checkpoint"
                )
                continue
            break
        exit_code = status.exit_code
        if status.state is JobState.COMPLETED:
            exit_code = 0
        elif status.state is JobState.FAILED and exit_code == EXIT_OUT_OF_MEMORY:
            # The workloads' own out-of-memory exit code: same verdict as the local backend.
            status.state = JobState.OUT_OF_MEMORY
        reason = None
        if status.state is not JobState.COMPLETED:
            reason = f"Slurm job {job_id} ended {status.state.value.upper()}"
            if status.reason:
                reason += f" ({status.reason})"
            if exit_code is not None:
                reason += f", exit code {exit_code}"
        return JobResult(
            job_id=job_id,
            backend=self.name,
            state=status.state,
            exit_code=exit_code,
            reason=reason,
            log_tail=list(tail),
            attempts=attempts,
        )

    def wait(self, job_id: str, req: SbatchRequest, indices: list[int] | None, emit: LogSink) -> JobStatus:
        if indices is None:
            tails = [OutputTail(expand_output(req.output, job_id, None, req.job_name))]
        else:
            tails = [OutputTail(expand_output(req.output, job_id, i, req.job_name), f"[{i}] ") for i in indices]
        self.watcher.register(job_id, set(indices) if indices else None)
        finished = False
        unknown_since: float | None = None
        last_seen: tuple | None = None
        try:
            while True:
                for t in tails:
                    for line in t.read():
                        emit(line)
                status = self.watcher.status(job_id)
                seen = (status.state, status.reason if status.state is JobState.PENDING else None, status.restarts)
                if seen != last_seen and status.state in (JobState.PENDING, JobState.RUNNING):
                    # Say why a job waits (Resources, Priority, QOS limits...) instead of going quiet.
                    detail = f" ({status.reason})" if status.state is JobState.PENDING and status.reason else ""
                    restarts = f", restart {status.restarts}" if status.restarts else ""
                    emit(f"[slurm] job {job_id} {status.state.value}{detail}{restarts}")
                    last_seen = seen
                if status.state.is_terminal:
                    finished = True
                    break
                if status.state is JobState.UNKNOWN:
                    # Neither accounting nor the controller knows the job (yet): give them time.
                    unknown_since = unknown_since or time.monotonic()
                    if time.monotonic() - unknown_since > 300:
                        finished = True
                        status.reason = "no Slurm command knows this job any more"
                        break
                else:
                    unknown_since = None
                time.sleep(self.poll_interval_s)
            # The output file can trail the state on shared storage: one last read.
            time.sleep(0.2)
            for t in tails:
                for line in t.read(final=True):
                    emit(line)
            return status
        finally:
            self.watcher.forget(job_id)
            if not finished:
                self.cancel(job_id)

    # ------------------------------------------------------------------ services

    def _service_jobs(self, name: str) -> list[tuple[str, JobState, str]]:
        """Live jobs of this user named ``name``: (job id, state, node list)."""
        out = self.cli.run(["squeue", "-h", "-u", getpass.getuser(), "-n", name, "-o", "%i|%T|%N"])
        rows = []
        for line in out.splitlines():
            job_id, state, nodes = (line.split("|") + ["", ""])[:3]
            from infra.slurm.states import SlurmState

            job_state = SlurmState.parse(state).job_state
            if job_state in (JobState.PENDING, JobState.RUNNING):
                rows.append((job_id, job_state, nodes))
        return rows

    def start_service(self, spec: ServiceSpec, ready_timeout_s: float = 900) -> str:
        """Run a server as a Slurm job; returns ``http://NODE:PORT`` once ``health_path`` answers.

        Idempotent: a running job of the same name (and user) is reused. The job
        has no time limit beyond the partition's; stop it with :meth:`stop_service`.
        """
        existing = self._service_jobs(spec.name)
        if existing:
            job_id = existing[0][0]
        else:
            job = JobSpec(
                name=spec.name,
                command=spec.command,
                env=spec.env,
                secret_env=spec.secret_env,
                resources=spec.resources,
                container_image=spec.container_image,
                mounts=spec.mounts,
                workdir=spec.workdir,
            )
            job_id, _ = self.submit(job)
        deadline = time.monotonic() + ready_timeout_s
        url = None
        try:
            while time.monotonic() < deadline:
                status = self.watcher.status(job_id)
                if status.state.is_terminal:
                    raise JobFailed(
                        spec.name,
                        JobResult(
                            job_id=job_id,
                            backend=self.name,
                            state=status.state,
                            exit_code=status.exit_code,
                            reason=f"service job ended before it was ready: {status.reason or status.state.value}",
                        ),
                    )
                if url is None and status.state is JobState.RUNNING:
                    nodes = [r[2] for r in self._service_jobs(spec.name) if r[0] == job_id]
                    if nodes and nodes[0]:
                        host = self.cli.run(["scontrol", "show", "hostnames", nodes[0]]).split()[0]
                        # NodeAddr is what the controller itself reaches the node at; the
                        # node's name may not resolve from here.
                        node = parse_scontrol_record(self.cli.run(["scontrol", "-o", "show", "node", host]))
                        url = f"http://{node.get('NodeAddr') or host}:{spec.port}"
                if url is not None:
                    try:
                        with urllib.request.urlopen(url + spec.health_path, timeout=5) as resp:
                            if resp.status < 500:
                                return url
                    except OSError:
                        pass
                time.sleep(self.poll_interval_s)
        except BaseException:
            self.watcher.forget(job_id)
            if not existing:
                self.cancel(job_id)
            raise
        self.watcher.forget(job_id)
        if not existing:
            self.cancel(job_id)
        raise TimeoutError(
            f"service {spec.name} (Slurm job {job_id}) not healthy at "
            f"{url or 'an unknown node'}{spec.health_path} after {ready_timeout_s:.0f}s"
        )

    def stop_service(self, name: str) -> bool:
        """scancel the service's job(s); False when none was running."""
        jobs = self._service_jobs(name)
        for job_id, _, _ in jobs:
            self.cancel(job_id)
        return bool(jobs)

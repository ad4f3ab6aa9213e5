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
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra import environment
from infra.jobs import (
    Backend,
    ExitCode,
    ImageRef,
    JobFailed,
    JobResult,
    JobSpec,
    JobState,
    LogSink,
    Resources,
    ServiceInfo,
    ServiceSpec,
)
from infra.services import ServiceNotReady
from infra.services import log_tail as file_tail
from infra.settings import DEFAULT_HOME, get_settings, redact
from infra.slurm.commands import SlurmCLI, SlurmCommandError
from infra.slurm.options import SbatchRequest, SlurmOptions, merge, parse_labels_comment
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


class SlurmBackend(Backend):
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
            options = (type(options) if options is not None else SlurmOptions)(**{**base, **option_fields})
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
        elif status.state is JobState.FAILED and exit_code == ExitCode.OUT_OF_MEMORY:
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

    def _service_jobs(self, name: str) -> list[dict[str, str]]:
        """Live (pending or running) jobs of this user named ``name``: id, state, nodes, labels."""
        from infra.slurm.states import SlurmState

        out = self.cli.run(["squeue", "-h", "-u", getpass.getuser(), "-n", name, "-o", "%i|%T|%N|%k"])
        rows = []
        for line in out.splitlines():
            job_id, state, nodes, comment = (line.split("|", 3) + ["", "", ""])[:4]
            job_state = SlurmState.parse(state).job_state
            if job_state in (JobState.PENDING, JobState.RUNNING):
                rows.append(
                    {"job_id": job_id, "state": job_state.value, "nodes": nodes, **parse_labels_comment(comment)}
                )
        return rows

    def _node_url(self, nodes: str, port: int | str) -> str | None:
        if not nodes:
            return None
        host = self.cli.run(["scontrol", "show", "hostnames", nodes]).split()[0]
        # NodeAddr is what the controller itself reaches the node at; the node's name may not resolve here.
        node = parse_scontrol_record(self.cli.run(["scontrol", "-o", "show", "node", host]))
        return f"http://{node.get('NodeAddr') or host}:{port}"

    def service(self, name: str) -> ServiceInfo | None:
        jobs = self._service_jobs(name)
        if not jobs:
            return None
        job = jobs[0]
        url = self._node_url(job["nodes"], job.get("port", "")) if job["state"] == "running" else None
        return ServiceInfo(
            name=name,
            url=url or "",
            backend=self.name,
            job_id=job["job_id"],
            healthy=bool(url) and _healthy(url + job.get("health", "/health")),
            fingerprint=job.get("fingerprint"),
            details={"state": job["state"], "nodes": job["nodes"]},
        )

    def service_log_tail(self, name: str, lines: int = 20) -> list[str]:
        """The tail of the service job's output file (shared storage), read through scontrol's StdOut."""
        jobs = self._service_jobs(name)
        if not jobs:
            return []
        record = parse_scontrol_record(self.cli.run(["scontrol", "-o", "show", "job", jobs[0]["job_id"]]))
        path = record.get("StdOut")
        try:
            with open(path or "", errors="replace") as fh:
                return [redact(line.rstrip("\n")) for line in collections.deque(fh, maxlen=lines)]
        except OSError:
            return []

    def start_service(
        self, spec: ServiceSpec, *, ready_timeout_s: float = 900.0, on_log: LogSink | None = None
    ) -> ServiceInfo:
        """Run a server as a Slurm job; return once ``health_path`` answers on its node.

        A running job of the same name that serves the same fingerprint is kept; one that serves
        something else is cancelled first. The job has no time limit beyond the partition's; stop it
        with :meth:`stop_service`.
        """
        current = self.service(spec.name)
        if current is not None:
            if spec.fingerprint and current.fingerprint == spec.fingerprint and current.healthy:
                return current
            self.stop_service(spec.name)
        labels = {**spec.labels, "port": str(spec.port), "health": spec.health_path}
        if spec.fingerprint:
            labels["fingerprint"] = spec.fingerprint
        job = JobSpec(
            name=spec.name,
            command=spec.command,
            env=spec.env,
            secret_env=spec.secret_env,
            resources=spec.resources,
            container_image=spec.container_image,
            mounts=spec.mounts,
            workdir=spec.workdir,
            log_dir=spec.log_dir,
            labels=labels,
        )
        job_id, req = self.submit(job)
        log_path = expand_output(req.output, job_id, None, req.job_name)
        tail = OutputTail(log_path)
        deadline = time.monotonic() + ready_timeout_s
        url = None
        try:
            while time.monotonic() < deadline:
                for line in tail.read():
                    if on_log is not None:
                        on_log(redact(line))
                status = self.watcher.status(job_id)
                if status.state.is_terminal:
                    for line in tail.read(final=True):
                        if on_log is not None:
                            on_log(redact(line))
                    lines = file_tail(log_path, 20)  # the file's last lines, also those forwarded already
                    if status.state in (JobState.FAILED, JobState.OUT_OF_MEMORY):
                        # The server exited by itself while starting (as a local one reports it: the same
                        # error, its exit code and its last line, the cause; not retried by the stage).
                        code = status.exit_code if status.exit_code is not None else 1
                        raise ServiceNotReady(
                            f"service '{spec.name}' (Slurm job {job_id}) exited with code {code} before it "
                            f"became ready" + (" (out of memory)" if status.state is JobState.OUT_OF_MEMORY else ""),
                            lines[-20:],
                            exit_code=code,
                            where=f"log: {log_path}",
                        )
                    raise JobFailed(
                        spec.name,
                        JobResult(
                            job_id=job_id,
                            backend=self.name,
                            state=status.state,
                            exit_code=status.exit_code,
                            reason=f"service job ended before it was ready: {status.reason or status.state.value}",
                            log_tail=lines[-20:],
                        ),
                    )
                if url is None and status.state is JobState.RUNNING:
                    nodes = [j["nodes"] for j in self._service_jobs(spec.name) if j["job_id"] == job_id]
                    url = self._node_url(nodes[0], spec.port) if nodes else None
                if url is not None and _healthy(url + spec.health_path):
                    self.watcher.forget(job_id)
                    return ServiceInfo(
                        name=spec.name,
                        url=url,
                        backend=self.name,
                        job_id=job_id,
                        healthy=True,
                        fingerprint=spec.fingerprint,
                        log=log_path,
                    )
                time.sleep(self.poll_interval_s)
        except BaseException:
            self.watcher.forget(job_id)
            self.cancel(job_id)
            raise
        self.watcher.forget(job_id)
        self.cancel(job_id)
        raise TimeoutError(
            f"service {spec.name} (Slurm job {job_id}) not healthy at "
            f"{url or 'an unknown node'}{spec.health_path} after {ready_timeout_s:.0f}s; it was cancelled"
        )

    def stop_service(self, name: str) -> bool:
        """scancel the service's job(s); False when none was running."""
        jobs = self._service_jobs(name)
        for job in jobs:
            self.cancel(job["job_id"])
        return bool(jobs)

    def switch_service(
        self,
        current: str | None,
        spec: ServiceSpec,
        check: Callable[[ServiceInfo], None],
        *,
        ready_timeout_s: float = 900.0,
        on_log: LogSink | None = None,
    ) -> ServiceInfo:
        """The new server starts as a job of its own (``spec.name`` must differ from ``current``), is
        checked, and only then is the old job cancelled. Its URL is the new job's node and port: clients
        that call a node directly must move (a load balancer or DNS name in front keeps them unaware).
        """
        if current == spec.name:
            raise ValueError(f"switch_service: the new service needs a name other than the current {current!r}")
        return self._start_checked_then_stop(current, spec, check, ready_timeout_s=ready_timeout_s, on_log=on_log)

    # ------------------------------------------------------------------ images

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
        """A .sqsh copied (verified, cached) to ``dest``, a docker:// image imported by enroot in a job, or
        ``python-env``: no container, the nodes share this Python environment."""
        from infra import images

        log = log or (lambda line: None)
        started = time.monotonic()
        if source == environment.PYTHON_ENV:
            ref = environment.python_env_ref()
            log(f"slurm without a container: jobs run with the shared Python environment {ref.uri}")
            return ref, {"cached": False, "bytes_copied": 0, "seconds": time.monotonic() - started}
        if source is None:
            raise ValueError(
                "the slurm backend runs stages in a container: give an image SOURCE (a .sqsh, or docker://REF "
                f"with convert), or {environment.PYTHON_ENV!r} when the nodes share this Python environment"
            )
        source = images.resolve_region(source)
        if images.is_docker_source(source):
            if not convert:
                raise ValueError(
                    f"{source} is a registry image: pass --convert to import it into a .sqsh with enroot on the "
                    "cluster (one pull, then every job starts from the shared file), or give a prebuilt .sqsh"
                )
            staged = images.convert_image(source, dest, backend=self, force=force, log=log, resources=resources)
        else:
            if convert:
                raise ValueError(f"--convert needs a docker:// reference, not {source}")
            staged = images.copy_image(source, dest, force=force, log=log, progress=progress)
        ref = ImageRef(
            kind="sqsh",
            uri=staged.uri,
            checksum=staged.checksum,
            digest=staged.digest,
            size=staged.size,
            source=staged.source,
        )
        return ref, {"cached": staged.cached, "bytes_copied": staged.bytes_copied, "seconds": staged.seconds}

    def planned_image(self, source: str | None, dest: str, convert: bool = False) -> ImageRef:
        from infra import images, storage

        if source == environment.PYTHON_ENV or source is None:
            return environment.python_env_ref() if source else self.stage_image(source, dest)[0]
        source = images.resolve_region(source)
        if images.is_docker_source(source):
            parsed = images.parse_docker_ref(source)
            return ImageRef(kind="sqsh", uri=storage.join(dest, parsed.sqsh_name), digest=parsed.digest, source=source)
        return ImageRef(kind="sqsh", uri=storage.join(dest, images.destination_name(source)), source=source)

    def image_identity(self, source: str | None, dest: str, convert: bool = False) -> tuple[str, bool] | None:
        from infra import images, storage

        if source == environment.PYTHON_ENV:
            return "python-env:" + environment.identity(), True
        if source is None:
            return None
        try:
            source = images.resolve_region(source)
            dest = storage.normalize(dest)
            if images.is_docker_source(source):
                parsed = images.parse_docker_ref(source)
                identity = parsed.digest or f"tag:{parsed.canonical}"
                final = storage.join(dest, parsed.sqsh_name)
            else:
                info = images.probe_source(source)
                source, identity = info.shown, info.identity
                final = storage.join(dest, images.destination_name(source))
            sidecar = images.read_sidecar(final)
            staged = bool(sidecar) and sidecar.get("source_checksum") == identity and storage.exists(final)
        except Exception:  # noqa: BLE001 - stage_image raises the clear error; a cache key must not
            return None
        return "|".join([source, identity, dest, str(bool(convert))]), staged

    # ------------------------------------------------------------------ review

    def render(self, spec: JobSpec | ServiceSpec) -> dict[str, str]:
        """The sbatch script a submission of ``spec`` writes (no secrets: they travel in sbatch's env)."""
        if isinstance(spec, ServiceSpec):
            spec = JobSpec(**{k: v for k, v in spec.model_dump().items() if k in JobSpec.model_fields})
        indices = list(range(spec.array_size)) if spec.array_size else None
        req = merge(spec, self.options, spec.log_dir or "<log_dir>", indices)
        return {f"{spec.name}.sbatch": render_batch_script(spec, req, self.options.container_mounts)}


def _healthy(url: str) -> bool:
    """A 2xx answer to a GET, redirects followed (what urllib's urlopen, which raises on 4xx/5xx, decided before)."""
    import httpx

    try:
        return httpx.get(url, timeout=5, follow_redirects=True).is_success
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError):
        return False

"""The local backend: jobs and services as managed processes on this machine.

Jobs: each process starts in its own session (process group), its merged
stdout/stderr is streamed line by line to the caller, and any exit from
:meth:`LocalBackend.run` other than the processes ending by themselves (an
exception, a Prefect cancellation, Ctrl-C) kills the whole group: a cancelled
flow run leaves no orphan processes. A process that dies without any exit
(SIGKILL of the flow run, its worker stopped) takes its jobs with it too:
each job runs behind :func:`infra.processes.guarded`, which kills the job's
group when its parent is gone. A job with ``nproc_per_node`` runs under
``torchrun --standalone`` (one machine, gloo or NCCL as the workload chooses).

Services: :mod:`infra.services` (process groups that outlive the flow run, a
machine-local registry); a zero-downtime switch is a blue/green on one port
(SO_REUSEPORT, see :meth:`LocalBackend.switch_service`).

Images: no containers; jobs run with this Python environment, which is what
:meth:`LocalBackend.stage_image` records.
"""

from __future__ import annotations

import collections
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from infra import environment, processes, services
from infra.jobs import (
    ARRAY_INDEX_ENV,
    Backend,
    ExitCode,
    ImageRef,
    JobResult,
    JobSpec,
    JobState,
    LogSink,
    Resources,
    ServiceInfo,
    ServiceSpec,
)
from infra.settings import get_settings, redact

# Running jobs of this process, for cancel(): job id -> its processes.
_RUNNING: dict[str, list[subprocess.Popen]] = {}
_RUNNING_LOCK = threading.Lock()


def torchrun_command(command: list[str], nproc_per_node: int) -> list[str]:
    """``python -m MODULE ARGS`` started by torchrun on this machine (a standalone rendezvous).

    >>> torchrun_command(["/venv/bin/python", "-m", "workloads.train", "--config", "c.json"], 2)[:6]
    ['/venv/bin/python', '-m', 'torch.distributed.run', '--standalone', '--nnodes=1', '--nproc-per-node=2']
    """
    if len(command) < 3 or command[1] != "-m":
        raise ValueError(f"a distributed job runs `python -m MODULE ...`, not {command[:3]}")
    launcher = [command[0], "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    return [*launcher, f"--nproc-per-node={nproc_per_node}", "-m", *command[2:]]


def with_option(command: list[str], flag: str, value: str) -> list[str]:
    """``command`` with ``flag``'s value replaced (or the flag appended).

    >>> with_option(["serve", "--port", "8000", "--x"], "--port", "9000")
    ['serve', '--port', '9000', '--x']
    """
    out = list(command)
    if flag in out[:-1]:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def check_gpus(spec: JobSpec | ServiceSpec) -> None:
    """A job or service that asks for GPUs gets them from this machine, or is refused before it starts
    (infra/gpus.py: none here, hidden, unusable by this torch, or fewer than asked for)."""
    if spec.resources.gpus_per_node:
        from infra import gpus

        gpus.check_request(spec.resources.gpus_per_node, gpus.probe(), what=spec.name)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _info(entry: services.ServiceHandle, healthy: bool | None = None) -> ServiceInfo:
    return ServiceInfo(
        name=entry.name,
        url=entry.url,
        backend="local",
        job_id=str(entry.pid),
        healthy=services.is_healthy(entry) if healthy is None else healthy,
        fingerprint=entry.spec_hash,
        log=entry.log_path,
        details={"pid": entry.pid, "proc_start": entry.proc_start, "port": entry.port, "checkpoint": entry.checkpoint},
    )


class LocalBackend(Backend):
    name = "local"
    bind_host = "127.0.0.1"

    def __init__(self, max_parallel: int | None = None, kill_grace_s: float = 5.0):
        from infra import gpus

        self.max_parallel = max_parallel or max(1, os.cpu_count() or 1)
        self.kill_grace_s = kill_grace_s
        gpus.prefetch()  # where there are GPUs: their probe runs beside the flow's first stages (check_gpus)

    # ------------------------------------------------------------------ jobs

    def _env(self, spec: JobSpec, index: int | None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(spec.env)
        secrets = get_settings().secret_env()
        for name in spec.secret_env:
            if name in secrets:
                env[name] = secrets[name]
        if index is not None:
            env[ARRAY_INDEX_ENV] = str(index)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def command(self, spec: JobSpec) -> list[str]:
        """What one process of ``spec`` executes (refusing, in one line, what cannot run on this machine)."""
        check_gpus(spec)
        if spec.resources.nodes > 1:
            raise ValueError(
                f"job {spec.name} asks for {spec.resources.nodes} nodes; the local backend runs on this machine "
                "only (use a slurm or k8s executor)"
            )
        if spec.nproc_per_node and spec.nproc_per_node > 1:
            return torchrun_command(spec.command, spec.nproc_per_node)
        return list(spec.command)

    def _start(self, spec: JobSpec, index: int | None) -> subprocess.Popen:
        # The guard makes the job's process group die with this process (a killed flow run or worker).
        return subprocess.Popen(
            processes.guarded(self.command(spec)),
            cwd=spec.workdir or None,
            env=self._env(spec, index),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )

    def _kill(self, proc: subprocess.Popen) -> None:
        # the job's whole process group (it runs in its own session): SIGTERM, SIGKILL after the grace
        processes.stop(proc.pid, group=True, grace_s=self.kill_grace_s, proc=proc)

    def cancel(self, job_id: str) -> None:
        with _RUNNING_LOCK:
            procs = list(_RUNNING.get(job_id, []))
        for proc in procs:
            self._kill(proc)

    def run(self, spec: JobSpec, on_log: LogSink | None = None) -> JobResult:
        job_id = f"local-{uuid.uuid4().hex[:8]}"
        self.command(spec)  # refuse what cannot run here before starting anything
        indices: list[int | None] = list(range(spec.array_size)) if spec.array_size else [None]
        # An array task asking for several CPUs leaves room for the others.
        fits = max(1, self.max_parallel // max(1, spec.resources.cpus_per_task))
        parallel = min(fits, spec.array_parallelism or fits)
        tail: collections.deque[str] = collections.deque(maxlen=50)
        lock = threading.Lock()
        secrets = get_settings().secret_values()

        def pump(proc: subprocess.Popen, index: int | None) -> None:
            prefix = f"[{index}] " if index is not None else ""
            assert proc.stdout is not None
            for line in proc.stdout:
                line = redact(line.rstrip("\n"), secrets)
                with lock:
                    tail.append(prefix + line)
                if on_log is not None:
                    on_log(prefix + line)

        pending = collections.deque(indices)
        running: dict[int | None, tuple[subprocess.Popen, threading.Thread]] = {}
        failures: list[tuple[int | None, int]] = []
        deadline = time.monotonic() + spec.resources.time_seconds if spec.resources.time else None
        state = JobState.COMPLETED
        with _RUNNING_LOCK:
            _RUNNING[job_id] = []
        try:
            while pending or running:
                while pending and len(running) < parallel and not failures:
                    index = pending.popleft()
                    proc = self._start(spec, index)
                    with _RUNNING_LOCK:
                        _RUNNING[job_id].append(proc)
                    thread = threading.Thread(target=pump, args=(proc, index), daemon=True)
                    thread.start()
                    running[index] = (proc, thread)
                for index, (proc, thread) in list(running.items()):
                    if proc.poll() is not None:
                        thread.join()
                        del running[index]
                        if proc.returncode != 0:
                            failures.append((index, proc.returncode))
                if failures and not running:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    state = JobState.TIMEOUT
                    break
                time.sleep(0.05)
        finally:
            for proc, thread in running.values():
                self._kill(proc)
                thread.join(timeout=2)
            with _RUNNING_LOCK:
                _RUNNING.pop(job_id, None)
        exit_code = 0
        reason = None
        if state is JobState.TIMEOUT:
            exit_code = None
            reason = f"time limit {spec.resources.time} reached"
        elif failures:
            index, exit_code = failures[0]
            state = JobState.FAILED
            where = f"array task {index}" if index is not None else "process"
            if exit_code == ExitCode.OUT_OF_MEMORY:
                state = JobState.OUT_OF_MEMORY
            if exit_code < 0:
                reason = f"{where} killed by signal {signal.Signals(-exit_code).name}"
            else:
                reason = f"{where} exited with code {exit_code}"
        return JobResult(
            job_id=job_id, backend=self.name, state=state, exit_code=exit_code, reason=reason, log_tail=list(tail)
        )

    # ------------------------------------------------------------------ services

    def _log_dir(self, spec: ServiceSpec) -> str:
        return spec.log_dir or str(services.table_path().parent / "logs")

    def _spawn(self, spec: ServiceSpec, ready_timeout_s: float, on_log: LogSink | None) -> services.ServiceHandle:
        """Start ``spec`` as a managed local server and wait until it is ready (the service table records it)."""
        return services.start_service(
            spec,
            self._log_dir(spec),
            host=self.bind_host,
            ready_timeout_s=ready_timeout_s,
            spec_hash=spec.fingerprint,
            checkpoint=spec.annotations.get("checkpoint"),
            model=spec.annotations.get("model"),
            on_log=on_log,
        )

    def start_service(
        self, spec: ServiceSpec, *, ready_timeout_s: float = 900.0, on_log: LogSink | None = None
    ) -> ServiceInfo:
        current = services.get_service(spec.name)
        if current is not None:
            if spec.fingerprint and current.spec_hash == spec.fingerprint and services.is_healthy(current):
                return _info(current, healthy=True)
        check_gpus(spec)  # before the running server is stopped for a new one that could not start
        if current is not None:
            services.stop_service(current)
        return _info(self._spawn(spec, ready_timeout_s, on_log), healthy=True)

    def stop_service(self, name: str) -> bool:
        return services.stop_service(name)

    def service(self, name: str) -> ServiceInfo | None:
        entry = services.get_service(name)
        return _info(entry) if entry is not None else None

    def service_log_tail(self, name: str, lines: int = 20) -> list[str]:
        entry = services.get_service(name)
        return services.log_tail(entry.log_path, lines) if entry is not None else []

    def switch_service(
        self,
        current: str | None,
        spec: ServiceSpec,
        check: Callable[[ServiceInfo], None],
        *,
        ready_timeout_s: float = 900.0,
        on_log: LogSink | None = None,
    ) -> ServiceInfo:
        """Blue/green on one port: the new server starts on a private port, is ``check``ed there, then
        also listens on ``spec.port`` (SO_REUSEPORT; it is started with ``--join-port PORT`` and joins
        on SIGUSR1), and only then is the old one told to leave the port (SIGUSR2, if it is itself a
        switched-in server) and stopped after draining (SIGTERM). The URL never changes and some
        server accepts on it at every moment. A failure before the join stops only the new server.

        The server's command must take ``--port`` and ``--join-port`` (workloads/serve.py does).
        """
        public = spec.port
        old = services.get_service(current) if current else None
        if old is None:
            # Something may answer on the port that nemoflow started under another name: find it.
            owner = services.port_owner(public)
            old = next((s for s in services.list_services() if s.pid == owner), None) if owner else None
        if old is None:
            try:
                services.check_port_free(public, self.bind_host)
            except services.PortInUseError as exc:
                raise services.ServiceError(
                    f"port {public} is served by a process nemoflow does not manage; it cannot be switched "
                    f"without downtime ({exc})"
                ) from exc
        private = _free_port(self.bind_host)
        command = with_option(with_option(spec.command, "--port", str(private)), "--join-port", str(public))
        green = spec.model_copy(update={"port": private, "command": command})
        handle = self._spawn(green, ready_timeout_s, on_log)
        try:
            check(_info(handle, healthy=True))
            _signal(handle, signal.SIGUSR1)
            if not _wait_for_log(handle.log_path, f"joined port {public}", 20):
                raise services.ServiceError(
                    f"new server {spec.name} did not join port {public} (see {handle.log_path}); was the old "
                    "server started before SO_REUSEPORT support? Restart it once, then switch again"
                )
        except BaseException:
            services.stop_service(handle)
            raise
        if old is not None:
            # The joiner steered new connections to itself (workloads/serve_http.py); give the old
            # server a moment to accept the few queued before that, which closing its socket would reset.
            time.sleep(0.5)
            if "--join-port" in old.command:
                # A relay (an earlier switch): close it first, so no new connection lands on a server
                # that is about to stop; without --join-port, SIGUSR2 would kill the server outright.
                _signal(old, signal.SIGUSR2)
                _wait_for_log(old.log_path, f"left port {public}", 5)
            services.stop_service(old)  # SIGTERM: uvicorn stops accepting, finishes requests in flight
        url_host = "127.0.0.1" if self.bind_host in ("0.0.0.0", "") else self.bind_host
        return _info(handle, healthy=True).model_copy(update={"url": f"http://{url_host}:{public}"})

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
        # Local stages run as processes of this interpreter, never in a container: recording
        # a .sqsh here would make later stages believe they ran in it.
        log = log or (lambda line: None)
        if source is not None and source != environment.PYTHON_ENV:
            log(f"the local backend runs no containers: {redact(source)} is not staged")
        ref = environment.python_env_ref()
        log(f"local backend: the image is the Python environment {ref.uri} ({ref.checksum})")
        return ref, {"cached": False, "bytes_copied": 0, "seconds": 0.0}

    def planned_image(self, source: str | None, dest: str, convert: bool = False) -> ImageRef:
        return environment.python_env_ref()

    def image_identity(self, source: str | None, dest: str, convert: bool = False) -> tuple[str, bool] | None:
        return "python-env:" + environment.identity(), True

    # ------------------------------------------------------------------ review

    def render(self, spec: JobSpec | ServiceSpec) -> dict[str, str]:
        """A shell script that does what a run would (environment without secrets, then the command)."""
        command = self.command(spec) if isinstance(spec, JobSpec) else list(spec.command)
        lines = [
            "#!/bin/bash",
            f"# nemoflow local job {spec.name}; secrets are passed by name only",
            "set -eo pipefail",
        ]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())]
        if spec.workdir:
            lines.append(f"cd {shlex.quote(spec.workdir)}")
        lines.append("exec " + shlex.join(command))
        return {f"{spec.name}.sh": "\n".join(lines) + "\n"}


def _signal(handle: services.ServiceHandle, sig: int) -> None:
    if services.pid_alive(handle.pid, handle.proc_start):
        os.kill(handle.pid, sig)


def _wait_for_log(path: str, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path, errors="replace") as fh:
                if text in fh.read():
                    return True
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    return False

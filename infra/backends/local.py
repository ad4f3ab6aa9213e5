"""Run a :class:`~infra.jobs.JobSpec` as managed subprocesses on this machine.

Each process starts in its own session (process group), its merged
stdout/stderr is streamed line by line to the caller, and any exit from
:meth:`LocalBackend.run` other than the processes ending by themselves
(an exception, a Prefect cancellation, Ctrl-C) kills the whole group: a
cancelled flow run leaves no orphan processes.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
import uuid

from infra.jobs import ARRAY_INDEX_ENV, JobResult, JobSpec, JobState, LogSink
from infra.settings import get_settings, redact

# Exit code a workload uses to say it ran out of memory (see workloads/).
EXIT_OUT_OF_MEMORY = 75


class LocalBackend:
    name = "local"

    def __init__(self, max_parallel: int | None = None, kill_grace_s: float = 5.0):
        self.max_parallel = max_parallel or max(1, os.cpu_count() or 1)
        self.kill_grace_s = kill_grace_s

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

    def _start(self, spec: JobSpec, index: int | None) -> subprocess.Popen:
        return subprocess.Popen(
            spec.command,
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
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.kill_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def run(self, spec: JobSpec, on_log: LogSink | None = None) -> JobResult:
        job_id = f"local-{uuid.uuid4().hex[:8]}"
        indices: list[int | None] = list(range(spec.array_size)) if spec.array_size else [None]
        parallel = min(self.max_parallel, spec.array_parallelism or self.max_parallel)
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
        try:
            while pending or running:
                while pending and len(running) < parallel and not failures:
                    index = pending.popleft()
                    proc = self._start(spec, index)
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
        exit_code = 0
        reason = None
        if state is JobState.TIMEOUT:
            exit_code = None
            reason = f"time limit {spec.resources.time} reached"
        elif failures:
            index, exit_code = failures[0]
            state = JobState.FAILED
            where = f"array task {index}" if index is not None else "process"
            if exit_code == EXIT_OUT_OF_MEMORY or exit_code in (-signal.SIGKILL, 137):
                state = JobState.OUT_OF_MEMORY if exit_code == EXIT_OUT_OF_MEMORY else JobState.FAILED
            if exit_code < 0:
                reason = f"{where} killed by signal {signal.Signals(-exit_code).name}"
            else:
                reason = f"{where} exited with code {exit_code}"
        return JobResult(
            job_id=job_id,
            backend=self.name,
            state=state,
            exit_code=exit_code,
            reason=reason,
            log_tail=list(tail),
        )

"""Long-running servers (the inference endpoint) as managed local processes.

    handle = start_service(ServiceSpec(name="tiny", command=[...], port=8000), log_dir)
    stop_service("tiny")          # from this or any other process on the machine

A service runs in its own session (process group) with its output in a log
file, so it outlives the process that started it: a deployed endpoint keeps
serving after the Prefect flow run that deployed it has finished. Stopping is
therefore explicit (:func:`stop_service`, ``nemoflow serve stop NAME``, the
``stop_inference`` task), and it signals the whole group: SIGTERM, then
SIGKILL after a grace period.

Nothing is left behind by a start that does not finish: :func:`start_service`
checks the port before spawning anything, and if the server exits, never
answers 200 on its health path in time, or the caller is interrupted (Ctrl-C,
a Prefect cancellation, which raises in the task), the group is killed before
the error propagates. Against a SIGKILL of the caller, which no code can
catch, the table entry is written as ``starting`` before the wait: the next
deploy of the same name, or ``nemoflow serve stop NAME``, finds and stops it.

The service table is one JSON file, ``<work_dir>/services/table.json`` (or
``~/.nemoflow/services/`` when the work dir is remote: it lists local
processes), updated under an ``flock`` and replaced atomically. Each entry
records the process start time, so a recycled pid is never mistaken for the
server; entries whose process is gone are dropped whenever the table is read. (The *model*
registry is infra/registry.py; container registries are the images'.)
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from filelock import FileLock
from pydantic import BaseModel, Field

from infra import storage
from infra.jobs import ServiceSpec
from infra.processes import group_members, pid_alive, port_owner, process_start_time, stop
from infra.settings import DEFAULT_HOME, get_settings, redact

DEFAULT_READY_TIMEOUT_S = 120.0
DEFAULT_GRACE_S = 10.0
LOG_TAIL_LINES = 20


class ServiceError(RuntimeError):
    """A service could not be started or stopped; the message says why and what to do."""


class PortInUseError(ServiceError):
    pass


class ServiceNotReady(ServiceError):
    """The server exited or did not become ready; the message carries its last log lines.

    ``exit_code`` is the server's own exit status when it exited before it was ready (None when
    it never answered in time). A server that exits by itself while starting refused its
    configuration or input (a missing API key, an unreadable checkpoint, a bad flag): starting it
    again cannot help, so ``transient`` is False and the deploy stage does not retry it. Only a
    server killed by a signal (negative code) may succeed on a second start. The first line ends
    with the server's last log line, its one-line cause (the server prints its fatal error last).
    """

    def __init__(self, message: str, log_tail: list[str], exit_code: int | None = None, where: str = ""):
        self.log_tail = log_tail
        self.exit_code = exit_code
        self.transient = exit_code is not None and exit_code < 0
        cause = last_line(log_tail) if exit_code is not None else None
        first = f"{message}: {cause}" if cause else message
        tail = "\n".join(log_tail)
        super().__init__(
            first
            + (f"\n{where}" if where else "")
            + (f"\nlast {len(log_tail)} log lines:\n{tail}" if tail else "\n(the log is empty)")
        )


def last_line(lines: list[str]) -> str | None:
    """The last non-blank line (stripped), or None."""
    return next((line.strip() for line in reversed(lines) if line.strip()), None)


class ServiceHandle(BaseModel):
    name: str
    url: str
    pid: int
    port: int
    log_path: str
    host: str = "127.0.0.1"
    health_path: str = "/health"
    state: Literal["starting", "ready"] = "starting"
    started: datetime = Field(default_factory=lambda: datetime.now(UTC))
    proc_start: int | None = Field(None, description="process start time (clock ticks since boot): pid identity")
    checkpoint: str | None = None
    model: str | None = None
    spec_hash: str | None = Field(None, description="what the caller deployed (tasks.serve compares it on re-runs)")
    command: list[str] = Field(default_factory=list)


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise :class:`PortInUseError` naming the port (and its owner when known) if it cannot be bound."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # uvicorn binds with SO_REUSEADDR; probing the same way ignores TIME_WAIT leftovers.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return
        except OSError:
            pass
    owner = port_owner(port)
    who = ""
    if owner is not None:
        who = f" (by pid {owner}"
        for entry in list_services():
            if entry.pid == owner:
                who += f", service '{entry.name}'"
        who += ")"
    raise PortInUseError(f"port {port} is already in use{who}; choose another with --port")


# ---------------------------------------------------------------- the service table


def local_state_dir() -> Path:
    """Where machine-local state lives: the work dir when it is local, else ``~/.nemoflow``."""
    work_dir = get_settings().work_dir
    return Path(storage.local_path(work_dir)) if storage.is_local(work_dir) else Path(DEFAULT_HOME)


def table_path() -> Path:
    path = local_state_dir() / "services" / "table.json"
    legacy = path.with_name("registry.json")  # its name before 0.2: servers started then stay known
    if legacy.exists() and not path.exists():
        with contextlib.suppress(OSError):
            os.replace(legacy, path)
    return path


@contextlib.contextmanager
def _table() -> Iterator[dict[str, ServiceHandle]]:
    """The service table, locked; changes to the yielded dict are written back atomically."""
    path = table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_suffix(".lock")):
        entries: dict[str, ServiceHandle] = {}
        if path.exists():
            try:
                raw = json.loads(path.read_text() or "{}")
            except ValueError as exc:
                raise ServiceError(f"service table {path} is not valid JSON ({exc}); remove it") from exc
            entries = {name: ServiceHandle.model_validate(value) for name, value in raw.items()}
        before = {name: entry.model_dump(mode="json") for name, entry in entries.items()}
        for name, entry in list(entries.items()):
            if not pid_alive(entry.pid, entry.proc_start):
                del entries[name]
        yield entries
        after = {name: entry.model_dump(mode="json") for name, entry in entries.items()}
        if after != before:
            tmp = path.with_name(f"{storage.TMP_MARK}{os.getpid()}-{path.name}")
            tmp.write_text(json.dumps(after, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, path)


def list_services() -> list[ServiceHandle]:
    """Running services (entries of dead processes are cleaned on the way)."""
    with _table() as entries:
        return sorted(entries.values(), key=lambda e: e.name)


def get_service(name: str) -> ServiceHandle | None:
    with _table() as entries:
        return entries.get(name)


def _register(handle: ServiceHandle) -> None:
    with _table() as entries:
        entries[handle.name] = handle


def _unregister(name: str, pid: int) -> None:
    with _table() as entries:
        if name in entries and entries[name].pid == pid:
            del entries[name]


# ---------------------------------------------------------------- start, probe, stop


def probe(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET (redirects followed), or None when nothing answers."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout, follow_redirects=True).status_code
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError):
        return None


def is_healthy(handle: ServiceHandle, timeout: float = 2.0) -> bool:
    return pid_alive(handle.pid, handle.proc_start) and probe(handle.url + handle.health_path, timeout) == 200


def log_tail(path: str | Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as fh:
            return [redact(line.rstrip("\n")) for line in collections.deque(fh, maxlen=lines)]
    except FileNotFoundError:
        return []


def _env(spec: ServiceSpec) -> dict[str, str]:
    env = dict(os.environ)
    env.update(spec.env)
    secrets = get_settings().secret_env()
    env.update({name: secrets[name] for name in spec.secret_env if name in secrets})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start_service(
    spec: ServiceSpec,
    log_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    checkpoint: str | None = None,
    model: str | None = None,
    spec_hash: str | None = None,
    on_log: Callable[[str], None] | None = None,
    poll_s: float = 0.25,
) -> ServiceHandle:
    """Start ``spec.command`` as a managed server and return once ``GET {url}{health_path}`` answers 200.

    ``host`` is where the server is reached (the address its command binds). ``on_log``
    receives the server's output while it starts (e.g. the Prefect run logger).
    """
    existing = get_service(spec.name)
    if existing is not None:
        raise ServiceError(
            f"a service named '{spec.name}' is already running (pid {existing.pid}, {existing.url}); "
            f"stop it first: nemoflow serve stop {spec.name}"
        )
    check_port_free(spec.port, host)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_path = log_dir / f"{spec.name}-{stamp}-{os.getpid()}.log"
    url_host = f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)
    url = f"http://{url_host}:{spec.port}"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            spec.command,
            cwd=spec.workdir or None,
            env=_env(spec),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    handle = ServiceHandle(
        name=spec.name,
        url=url,
        pid=proc.pid,
        port=spec.port,
        log_path=str(log_path),
        host=host,
        health_path=spec.health_path,
        proc_start=process_start_time(proc.pid),
        checkpoint=checkpoint,
        model=model,
        spec_hash=spec_hash,
        command=[redact(arg) for arg in spec.command],
    )
    try:
        _register(handle)
        _await_ready(handle, proc, ready_timeout_s, on_log, poll_s)
        handle = handle.model_copy(update={"state": "ready"})
        _register(handle)
        return handle
    except BaseException:
        # Exited, timed out, or interrupted/cancelled: leave nothing running behind.
        _terminate_group(proc.pid, DEFAULT_GRACE_S, proc)
        _unregister(handle.name, handle.pid)
        raise


def _await_ready(
    handle: ServiceHandle,
    proc: subprocess.Popen,
    timeout_s: float,
    on_log: Callable[[str], None] | None,
    poll_s: float,
) -> None:
    health = handle.url + handle.health_path
    deadline = time.monotonic() + timeout_s
    offset = 0

    def forward() -> None:
        nonlocal offset
        if on_log is None:
            return
        with open(handle.log_path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
        complete = data[: data.rfind(b"\n") + 1]
        offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            on_log(redact(line))

    while True:
        forward()
        code = proc.poll()
        if code is not None:
            raise ServiceNotReady(
                f"service '{handle.name}' exited with code {code} before it became ready",
                log_tail(handle.log_path),
                exit_code=code,
                where=f"command: {' '.join(handle.command)}; log: {handle.log_path}",
            )
        status = probe(health, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
        if status == 200:
            forward()
            return
        if time.monotonic() >= deadline:
            last = f"it answered HTTP {status}" if status is not None else "nothing answered"
            raise ServiceNotReady(
                f"service '{handle.name}' was not ready after {timeout_s:g}s: GET {health} never returned 200 "
                f"({last}); it was stopped (log: {handle.log_path})",
                log_tail(handle.log_path),
            )
        time.sleep(poll_s)


def _terminate_group(pgid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM the group, SIGKILL what is left after ``grace_s``, and wait until it is gone (processes.stop)."""
    if not stop(pgid, group=True, grace_s=grace_s, proc=proc):
        raise ServiceError(f"process group {pgid} survived SIGKILL: {group_members(pgid)}")


def stop_service(target: str | ServiceHandle, grace_s: float = DEFAULT_GRACE_S) -> bool:
    """Stop a service by name or handle: SIGTERM its group, SIGKILL after ``grace_s``.

    Returns False when no such service is running (already stopped: not an error).
    """
    name = target if isinstance(target, str) else target.name
    entry = get_service(name)
    if entry is None:
        return False
    if isinstance(target, ServiceHandle) and (target.pid, target.proc_start) != (entry.pid, entry.proc_start):
        # The handle is from an earlier deploy of this name; the registered one is another process.
        return False
    _terminate_group(entry.pid, grace_s)
    _unregister(entry.name, entry.pid)
    return True

"""A local Prefect control plane for the demo: server, work pools, deployments, workers.

``nemoflow demo`` and ``nemoflow deploy`` use these to go from a fresh machine to a
watched deployment run: reuse a reachable Prefect API (``PREFECT_API_URL``) or start
``prefect server start`` in the background; create the work pools; ``prefect
--no-prompt deploy``; start a worker; run the deployment. Background processes
record pid files (pid and start time) under ``$NEMOFLOW_HOME/prefect`` so
``nemoflow demo --down`` stops exactly what was started.

Three things keep a crashed run from blocking the runs after it (issue #12: a killed
``cpt-refresh`` held its concurrency slots for good, and every later refresh ended
``Cancelled: Deployment concurrency limit reached``):

- Flow runs send heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, in the environment
  of the workers started here, which their flow runs inherit), and the automation
  :data:`ZOMBIE_AUTOMATION` marks a run ``Crashed`` when its heartbeats stop
  (Prefect's "detect zombie flows" recipe). A Crashed run releases its deployment
  concurrency slot.
- The server keeps concurrency leases on disk
  (``PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE``, the filesystem store under
  PREFECT_HOME) instead of in memory, so a restart does not forget who holds a slot;
  the server's repossessor frees the slots of leases nobody renews any more (the
  global ``cpt-refresh`` slot of a killed run: flows/cpt_refresh.py takes it with a
  short lease).
- :func:`ensure_server` sets both on the server it starts; for a server you run
  yourself, set :data:`SERVER_SETTINGS` in its environment and run ``nemoflow deploy``
  (which creates the automation).

Two things make the API usable from any shell and safe to share:

- The API URL (and the auth string, when on) is recorded in the active Prefect
  profile, Prefect's own place for it (what ``prefect config set`` writes), so
  ``prefect deployment run ...`` in a new shell talks to this server instead of
  starting a temporary one on the same SQLite database. ``--down`` removes what it
  recorded.
- With ``auth=True`` the server checks HTTP Basic credentials
  (``PREFECT_SERVER_API_AUTH_STRING`` in its environment; clients send
  ``PREFECT_API_AUTH_STRING``). The string is the user's ``PREFECT_API_AUTH_STRING``
  or one generated into ``$NEMOFLOW_HOME/prefect/auth-string`` (mode 0600). It
  travels only through environments and that file: never argv (``ps``), never a log.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import SecretStr

from infra import processes
from infra.run_slots import ZOMBIE_AUTOMATION
from infra.settings import DEFAULT_HOME

DEFAULT_PORT = 4200

# The server's settings for crash recovery (see the module docstring).
SERVER_SETTINGS = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}
# Flow runs' heartbeat interval, seconds (Prefect's minimum is 30), and how long without one makes a zombie.
HEARTBEAT_S = 30
ZOMBIE_AFTER_S = 90
REPO_ROOT = Path(__file__).resolve().parent.parent
AUTH_USER = "nemoflow"


class ControlPlaneError(RuntimeError):
    """The local control plane cannot be set up; the message says why and what to do."""


def state_dir() -> Path:
    """Pid files, logs, the deploy stamp and the generated auth string (``$NEMOFLOW_HOME/prefect``)."""
    return Path(os.environ.get("NEMOFLOW_HOME", DEFAULT_HOME)) / "prefect"


def prefect_bin() -> str:
    candidate = Path(sys.executable).parent / "prefect"
    return str(candidate) if candidate.exists() else "prefect"


@dataclasses.dataclass(frozen=True)
class PrefectApi:
    """Where the Prefect API is and how to authenticate to it (``repr`` masks the secret)."""

    url: str
    auth_string: SecretStr | None = None

    @classmethod
    def from_settings(cls) -> PrefectApi:
        """The API the current Prefect settings name (environment, then the active profile)."""
        from prefect.settings import get_current_settings

        api = get_current_settings().api
        if not api.url:
            raise ControlPlaneError("no Prefect API is configured: run `nemoflow demo` or set PREFECT_API_URL")
        return cls(api.url, api.auth_string)

    def client_env(self) -> dict[str, str]:
        """Environment variables for a Prefect client process (CLI, worker, flow run)."""
        env = {"PREFECT_API_URL": self.url}
        if self.auth_string is not None:
            env["PREFECT_API_AUTH_STRING"] = self.auth_string.get_secret_value()
        return env

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """In-process Prefect clients inside this block talk to this API."""
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        updates = {PREFECT_API_URL: self.url}
        if self.auth_string is not None:
            updates[PREFECT_API_AUTH_STRING] = self.auth_string.get_secret_value()
        with temporary_settings(updates=updates):
            yield

    def status(self, path: str, authenticated: bool = True, timeout: float = 5.0) -> int | None:
        """HTTP status of ``GET {url}{path}`` (None when nothing answers)."""
        import httpx

        headers = {}
        if authenticated and self.auth_string is not None:
            token = base64.b64encode(self.auth_string.get_secret_value().encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        try:
            return httpx.get(
                self.url.rstrip("/") + path, headers=headers, timeout=timeout, follow_redirects=True
            ).status_code
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError):
            return None

    def healthy(self) -> bool:
        return self.status("/health", authenticated=False, timeout=2.0) == 200  # /health needs no credentials

    def requires_auth(self) -> bool:
        return self.status("/admin/version", authenticated=False) == 401


def _env(**extra: str) -> dict[str, str]:
    """This process's environment for a Prefect child, without Prefect's API/auth variables (the caller sets them)."""
    env = {k: v for k, v in os.environ.items() if k not in _API_VARIABLES}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.update(extra)
    return env


_API_VARIABLES = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING")


# ---------------------------------------------------------------- auth string


def auth_string_path() -> Path:
    return state_dir() / "auth-string"


def demo_auth_string() -> SecretStr:
    """The auth string for a server the demo starts: the user's PREFECT_API_AUTH_STRING, else a generated one.

    The generated string is ``nemoflow:<random>`` (the UI asks for ``user:password``),
    created once with mode 0600 and reused, so clients keep working across restarts.
    """
    from prefect.settings import get_current_settings

    configured = get_current_settings().api.auth_string
    if configured is not None and configured.get_secret_value():
        return configured
    return secret_file(auth_string_path(), lambda: f"{AUTH_USER}:{secrets.token_urlsafe(24)}")


def secret_file(path: Path, make) -> SecretStr:
    """The secret in ``path``, created once with ``make()`` and mode 0600 (never readable by others), then reused."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        value = make()
        with contextlib.suppress(FileExistsError):  # another process wrote it first: read theirs
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(value + "\n")
    return SecretStr(path.read_text().strip())


# ---------------------------------------------------------------- background processes


def _start_background(name: str, argv: list[str], env: dict[str, str]) -> int:
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
    processes.write_pidfile(directory / f"{name}.pid", proc.pid)
    return proc.pid


def running(name: str) -> int | None:
    """The pid of the background process ``name`` we started, while it runs."""
    return processes.read_pidfile(state_dir() / f"{name}.pid")


def log_path(name: str) -> Path:
    return state_dir() / f"{name}.log"


def log_tail(name: str, lines: int = 20) -> str:
    log = log_path(name)
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def cancel_active_runs(echo=print, timeout: float = 45.0) -> list[str]:
    """Cancel the flow runs still in progress in the pools of the workers we started, and wait for them.

    Before ``--down`` stops the workers: a cancelled run's worker ends its infrastructure (a Slurm
    flow-run job is scancelled, and with it its stage jobs; a local process is killed), which a
    stopped worker no longer could. Does nothing when our server is not running. Names of the runs.
    """
    if running("server") is None:
        return []
    pools = [p.stem.removeprefix("worker-") for p in state_dir().glob("worker-*.pid") if running(p.stem)]
    if not pools:
        return []
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    api = started_server_api()
    if api is None:  # a server started before its URL was recorded: the profile names it
        try:
            api = PrefectApi.from_settings()
        except ControlPlaneError:
            return []
    with api.settings(), get_client(sync_client=True) as client:
        runs = _runs_in(client, pools, [StateType.PENDING, StateType.RUNNING])
        for run in runs:
            client.set_flow_run_state(run.id, Cancelling(message="nemoflow demo --down"), force=True)
            echo(f"cancelling flow run {run.name} (its worker ends its jobs)")
        deadline = time.monotonic() + timeout
        pending = {run.id for run in runs}
        while pending and time.monotonic() < deadline:
            time.sleep(1)
            pending = {i for i in pending if not (client.read_flow_run(i).state or Cancelling()).is_final()}
    if pending:
        echo(f"note: {len(pending)} flow run(s) still not cancelled after {timeout:g} s")
    return [run.name for run in runs]


def _runs_in(client, pools: list[str], states: list) -> list:
    """The flow runs of work pools ``pools`` whose state type is one of ``states``."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )

    return client.read_flow_runs(
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=pools)),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=states))),
    )


def stop_all(echo=print) -> list[str]:
    """Stop every background process the demo started (workers first, then the server).

    Between the two, the runs that the stopped process workers were running are set Crashed
    (:func:`crash_orphaned_runs`), so the next ``nemoflow demo`` shows what happened to them.
    """
    stopped = []
    directory = state_dir()
    if not directory.exists():
        return stopped
    server = started_server_api()
    for pidfile in sorted(directory.glob("*.pid"), key=lambda p: p.stem == "server"):
        if pidfile.stem == "server" and server is not None:
            worker_pools = [n.removeprefix("worker-") for n in stopped if n.startswith("worker-")]
            try:
                crash_orphaned_runs(server, worker_pools, echo)
            except Exception as exc:  # noqa: BLE001 - the server may not answer: stop it all the same
                echo(f"note: could not mark the stopped workers' runs Crashed: {exc}")
        pid = processes.read_pidfile(pidfile)
        if pid is not None:
            # A process worker starts each flow run in a session of its own (out of reach of a signal to the
            # worker's group) and stops them while it drains; one SIGKILLed before it finished left them
            # running under init for good. Its children are noted first and stopped when it is gone.
            flow_runs = processes.children(pid)
            # Prefect workers ignore the first SIGTERM (they drain); the second stops them.
            processes.stop(pid, group=True, grace_s=5, terms=2)
            echo(f"stopped {pidfile.stem} (pid {pid})")
            stopped.append(pidfile.stem)
            for child, started in flow_runs:
                if processes.pid_alive(child, started):
                    processes.stop(child, group=True, grace_s=5)
                    echo(f"stopped the flow-run process {child} that {pidfile.stem} left running")
        pidfile.unlink()
    _server_record().unlink(missing_ok=True)
    if "server" in stopped:
        forget_profile(echo)
    return stopped


def crash_orphaned_runs(api: PrefectApi, pools: list[str], echo=print, wait_s: float = 10.0) -> list[str]:
    """Set Crashed the unfinished runs of ``pools``' process workers whose flow-run process is gone.

    ``--down`` cancels the runs in progress first; a run that cancel did not end dies with its
    process worker (a process worker's flow runs are its children). Left alone it would stay
    Running until the heartbeat automation noticed, and never if the server stopped before the
    automation saw the run's first heartbeat. Runs of other pool types (a Slurm flow-run job) do
    not die with their worker and are left alone. Names of the runs set Crashed.
    """
    if not pools:
        return []
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    crashed = []
    with api.settings(), get_client(sync_client=True) as client:
        process_pools = [p for p in pools if client.read_work_pool(p).type == "process"]
        if not process_pools:
            return []
        runs = _runs_in(client, process_pools, [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING])
        for run in runs:
            pid = int(run.infrastructure_pid) if (run.infrastructure_pid or "").isdigit() else None
            deadline = time.monotonic() + wait_s
            while pid is not None and processes.pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid is not None and processes.pid_alive(pid):
                echo(f"note: flow run {run.name}'s process {pid} still runs after its worker stopped")
                continue
            process = f"its process (pid {pid}) ended with it" if pid is not None else "it had no process yet"
            message = f"nemoflow demo --down stopped the {run.work_pool_name!r} worker during this run; {process}"
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
            echo(f"flow run {run.name}: Crashed ({message})")
            crashed.append(run.name)
    return crashed


# ---------------------------------------------------------------- the server


def _server_record() -> Path:
    return state_dir() / "server.json"


def started_server_api() -> PrefectApi | None:
    """The API of the server :func:`ensure_server` started, while it runs (None otherwise)."""
    if running("server") is None or not _server_record().exists():
        return None
    record = json.loads(_server_record().read_text())
    return PrefectApi(record["url"], demo_auth_string() if record.get("auth") else None)


def configured_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def ensure_server(port: int = DEFAULT_PORT, timeout: float = 120.0, auth: bool = False, echo=print) -> PrefectApi:
    """A healthy Prefect API: the configured one if it answers, else a local server we start.

    With ``auth``, a server we start checks the auth string (:func:`demo_auth_string`),
    and a server we find must already check one. Without it, a found server that
    asks for credentials is used with the configured ``PREFECT_API_AUTH_STRING``.
    """
    from prefect.settings import get_current_settings

    configured_auth = get_current_settings().api.auth_string
    secret = demo_auth_string() if auth else configured_auth
    candidates = []
    configured = configured_api_url()
    if configured:
        candidates.append((configured, f"the Prefect API at {configured}"))
        # A local URL that does not answer names the port to start the server on (the one the user chose).
        port = _local_port(configured) or port
    local = f"http://127.0.0.1:{port}/api"
    if local != configured:
        candidates.append((local, f"the Prefect server already running at {local}"))
    for url, what in candidates:
        api = PrefectApi(url, secret)
        if api.healthy():
            _check_credentials(api, auth, what)
            echo(f"using {what}" + (" (authenticated)" if api.requires_auth() else ""))
            return api
    if configured:
        echo(f"PREFECT_API_URL={configured} does not answer; starting a local server instead")
    api = PrefectApi(local, secret if auth else None)
    if running("server") is None:
        # The UI calls the API at PREFECT_UI_API_URL, which must match the port we chose.
        env = _env(PREFECT_UI_API_URL=local, **SERVER_SETTINGS)
        if auth:
            env["PREFECT_SERVER_API_AUTH_STRING"] = secret.get_secret_value()
        argv = [prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        _start_background("server", argv, env)
        _server_record().write_text(json.dumps({"url": local, "auth": auth}) + "\n")
        note = ", authenticated: clients need PREFECT_API_AUTH_STRING" if auth else ""
        echo(f"starting a local Prefect server on port {port}{note} (log: {log_path('server')})")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if api.healthy():
            _check_credentials(api, auth, f"the local Prefect server at {local}")
            return api
        if running("server") is None:
            raise ControlPlaneError(f"the Prefect server exited while starting:\n{log_tail('server')}")
        time.sleep(0.5)
    raise ControlPlaneError(f"the Prefect server did not become healthy in {timeout:.0f}s:\n{log_tail('server')}")


def _local_port(url: str) -> int | None:
    """The port of ``http://127.0.0.1:PORT/api`` (or localhost), None for any other URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost") and parts.path.rstrip("/") == "/api":
        return parts.port
    return None


def _check_credentials(api: PrefectApi, auth: bool, what: str) -> None:
    """Fail with one line when the server's authentication and ours do not fit together."""
    if not api.requires_auth():
        if auth:
            ours = running("server")
            fix = (
                f"it is the demo's server (pid {ours}): stop it with `nemoflow demo --down`, then run again"
                if ours is not None
                else "turn it on there (PREFECT_SERVER_API_AUTH_STRING) or point PREFECT_API_URL elsewhere"
            )
            raise ControlPlaneError(f"--auth was asked for, but {what} accepts unauthenticated calls; {fix}")
        return
    if api.auth_string is None:
        raise ControlPlaneError(
            f"{what} asks for credentials: set PREFECT_API_AUTH_STRING (`nemoflow demo --auth` uses "
            f"the one in {auth_string_path()} if it generated one)"
        )
    code = api.status("/admin/version")
    if code != 200:
        raise ControlPlaneError(f"{what} refused the auth string (HTTP {code}); check PREFECT_API_AUTH_STRING")


# ---------------------------------------------------------------- the active Prefect profile


def _record_path() -> Path:
    return state_dir() / "profile-record.json"


def record_in_profile(api: PrefectApi, echo=print) -> bool:
    """Write the API URL (and auth string) into the active Prefect profile; True when something changed.

    Prefect reads the environment first, then the active profile (``prefect profile
    ls``), so a new shell's ``prefect deployment run ...`` reaches this server. The
    profiles file holds a secret then: it is made readable by its owner only.
    """
    import prefect.context
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, load_profiles, update_current_profile

    profile = prefect.context.get_settings_context().profile
    current = load_profiles().profiles_by_name.get(profile.name)
    saved = current.settings if current is not None else {}
    updates: dict = {}
    if _plain(saved.get(PREFECT_API_URL)) != api.url:
        updates[PREFECT_API_URL] = api.url
    if api.auth_string is not None and _plain(saved.get(PREFECT_API_AUTH_STRING)) != api.auth_string.get_secret_value():
        updates[PREFECT_API_AUTH_STRING] = api.auth_string.get_secret_value()
    if not updates:
        return False
    update_current_profile(updates)
    from prefect.settings import get_current_settings

    profiles_path = Path(get_current_settings().profiles_path)
    if api.auth_string is not None:
        profiles_path.chmod(0o600)
    record = {"profile": profile.name, "profiles_path": str(profiles_path), "url": api.url}
    record["auth"] = api.auth_string is not None
    state_dir().mkdir(parents=True, exist_ok=True)
    _record_path().write_text(json.dumps(record) + "\n")
    what = "PREFECT_API_URL" + (" and PREFECT_API_AUTH_STRING" if api.auth_string is not None else "")
    echo(f"recorded {what} in the Prefect profile {profile.name!r} ({profiles_path}): `prefect ...` works in any shell")
    return True


def _plain(value):
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def forget_profile(echo=print) -> None:
    """Undo :func:`record_in_profile` if the profile still names the server we recorded."""
    path = _record_path()
    if not path.exists():
        return
    record = json.loads(path.read_text())
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, load_profiles, save_profiles

    profiles = load_profiles()
    profile = profiles.profiles_by_name.get(record["profile"])
    if profile is not None and _plain(profile.settings.get(PREFECT_API_URL)) == record["url"]:
        drop = {PREFECT_API_URL: None}
        if record.get("auth"):
            drop[PREFECT_API_AUTH_STRING] = None
        profiles.update_profile(record["profile"], drop)
        save_profiles(profiles)
        echo(f"removed PREFECT_API_URL={record['url']} from the Prefect profile {record['profile']!r}")
    path.unlink()


# ---------------------------------------------------------------- pools, deployments, workers


def prefect_cli(args: list[str], api: PrefectApi, check: bool = True) -> subprocess.CompletedProcess:
    """``prefect ARGS`` against ``api`` (URL and auth string through the environment, never argv)."""
    env = _env(PWD=str(REPO_ROOT), **api.client_env())
    proc = subprocess.run([prefect_bin(), *args], cwd=str(REPO_ROOT), env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ControlPlaneError(f"`prefect {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def _as_api(api: PrefectApi | str) -> PrefectApi:
    if isinstance(api, PrefectApi):
        return api
    from prefect.settings import get_current_settings

    return PrefectApi(api, get_current_settings().api.auth_string)


def _existing_pools(api: PrefectApi) -> set[str]:
    """Pool names on the server, read in-process (a `prefect work-pool inspect` costs ~2 s each)."""
    from prefect.client.orchestration import get_client

    with api.settings(), get_client(sync_client=True) as client:
        return {pool.name for pool in client.read_work_pools()}


def ensure_pools(api: PrefectApi | str, echo=print) -> None:
    """Create the work pools prefect.yaml deploys to, one per backend (its executor's ``work_pool``):
    `prefect --no-prompt deploy --all` refuses deployments whose pool does not exist (creating one starts nothing)."""
    from infra.executors import work_pools

    api = _as_api(api)
    existing = _existing_pools(api)
    for pool in work_pools():
        if pool.name not in existing and ensure_work_pool(pool.name, pool.worker_type, api, pool.base_job_template):
            echo(f"created work pool {pool.name!r} ({pool.worker_type})")


def ensure_work_pool(name: str, pool_type: str, api: PrefectApi | str, base_job_template: str | None = None) -> bool:
    """Create the pool unless it exists; True when it was created.

    What `prefect work-pool create NAME --type TYPE [--base-job-template FILE]` does, in this process: the
    template file's job template, else the default one of the installed worker of that type. Each CLI call
    started a Python that imports Prefect (about 2.5 CPU-s; a demo or deploy made six, inspect and create)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.base import BaseWorker

    api = _as_api(api)
    if base_job_template:
        template = json.loads((REPO_ROOT / base_job_template).read_text())
    else:
        worker = BaseWorker.get_worker_class_from_type(pool_type)
        if worker is None:
            raise ControlPlaneError(
                f"work pool {name!r}: no Prefect worker of type {pool_type!r} is installed here, so it has no "
                "default job template (name a --base-job-template file)"
            )
        template = worker.get_default_base_job_template()
    with api.settings(), get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))
        except ObjectAlreadyExists:  # it exists (the server answers 409): left as it is
            return False
    return True


def _deployed_fingerprint(api: PrefectApi) -> str:
    """The API, this checkout's path (the deployments' pull step runs the flows from it: a clone elsewhere must
    redeploy, or its runs crash on a directory that is gone) and prefect.yaml."""
    text = "\n".join([api.url, str(REPO_ROOT.resolve()), (REPO_ROOT / "prefect.yaml").read_text()])
    return hashlib.sha256(text.encode()).hexdigest()


def deploy_if_changed(api: PrefectApi, echo=print, first: str = "end-to-end/local") -> PendingDeploy | None:
    """Deploy ``first`` now and every deployment of prefect.yaml in the background, unless this prefect.yaml was
    already deployed to this API and ``first`` is still there (then None: nothing to do).

    Local and Slurm workers load the flow code from the repository at run time, so only prefect.yaml
    (parameters, pools, schedules) needs a redeploy; that saves ~7 s a demo run. On a new server (a first demo:
    a fresh machine, a GPU node) `prefect deploy --all` took 16.5 s on the 2-core machine, and `--name` of the
    one deployment the demo runs 4.0 s: the demo runs it while the rest deploy beside the run. The stamp is
    written when the background deploy succeeds (:meth:`PendingDeploy.wait`), so a failed or interrupted one
    deploys again next time.
    """
    stamp = state_dir() / "deployed.sha256"
    fingerprint = _deployed_fingerprint(api)
    if stamp.exists() and stamp.read_text() == fingerprint and _deployment_exists(api, first):
        return None
    deploy([first], api)
    echo(f"deployed {first}; the other deployments of prefect.yaml deploy in the background")
    state_dir().mkdir(parents=True, exist_ok=True)
    log = log_path("deploy")
    with open(log, "w") as out:  # the auth string travels in the environment, never in argv or the log
        proc = subprocess.Popen(
            [prefect_bin(), "--no-prompt", "deploy", "--all"],
            cwd=str(REPO_ROOT),
            env=_env(PWD=str(REPO_ROOT), **api.client_env()),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return PendingDeploy(proc, stamp, fingerprint, log)


@dataclasses.dataclass
class PendingDeploy:
    """`prefect deploy --all` running in the background (:func:`deploy_if_changed`)."""

    proc: subprocess.Popen
    stamp: Path
    fingerprint: str
    log: Path

    def wait(self, echo=print, timeout: float = 600) -> bool:
        """Wait for it; on success write the deploy stamp. False (with the log's last line) when it failed."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if code == 0:
            self.stamp.write_text(self.fingerprint)
            echo("deployed prefect.yaml (every deployment)")
            return True
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        echo(
            f"error: `prefect deploy --all` failed (exit {code}): {lines[-1] if lines else 'no output'} (log {self.log})"
        )
        return False


def _deployment_exists(api: PrefectApi, name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with api.settings(), get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
            return True
        except ObjectNotFound:
            return False


def deploy(names: list[str] | None, api: PrefectApi) -> str:
    """``prefect --no-prompt deploy --all`` (or ``--name ...``) from prefect.yaml at the repository root."""
    args = ["--no-prompt", "deploy"]
    if names is None:
        args.append("--all")
    for name in names or []:
        args += ["--name", name]
    return prefect_cli(args, api).stdout


def ensure_worker(
    pool: str, pool_type: str, api: PrefectApi, echo=print, extra_env: dict[str, str] | None = None
) -> int:
    """A worker for ``pool`` in the background (started unless ours runs); its pid.

    ``extra_env`` reaches the worker's flow runs (a Slurm flow run gets it through sbatch's
    environment): a worker of ours that was started with other values is restarted, so the
    values in force are always the ones given. Only a hash of them is kept on disk.
    """
    name = f"worker-{pool}"
    stamp = state_dir() / f"{name}.env.sha256"
    wanted = hashlib.sha256(json.dumps(sorted((extra_env or {}).items())).encode()).hexdigest()
    pid = running(name)
    if pid is not None:
        if stamp.exists() and stamp.read_text() == wanted:
            return pid
        processes.stop(pid, group=True, grace_s=5, terms=2)  # Prefect workers drain on the first SIGTERM
        echo(f"restarted the {pool_type} worker for pool {pool!r}: its environment changed")
    # Poll every second instead of Prefect's 10 s: a cached re-run then starts at once. Flow runs inherit
    # the worker's environment: they send heartbeats, so a run whose process dies is marked Crashed.
    env = _env(PREFECT_WORKER_QUERY_SECONDS="1", **heartbeat_env(), **api.client_env(), **(extra_env or {}))
    pid = _start_background(name, [prefect_bin(), "worker", "start", "--pool", pool, "--type", pool_type], env)
    stamp.write_text(wanted)
    echo(f"started a {pool_type} worker for pool {pool!r} (pid {pid}, log: {log_path(name)})")
    return pid


# ---------------------------------------------------------------- crashed runs


def heartbeat_env(seconds: int = HEARTBEAT_S) -> dict[str, str]:
    """The environment that makes flow runs send heartbeats (a worker passes it on to its runs)."""
    return {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(seconds)}


def zombie_automation(within_s: float = ZOMBIE_AFTER_S):
    """Prefect's "detect zombie flows" automation: a run without a heartbeat for ``within_s`` is Crashed.

    After a heartbeat, the automation expects another heartbeat or a final state within
    ``within_s``; when neither comes (the process, its worker or its host died), it sets the run
    Crashed, which releases the run's deployment concurrency slot.
    """
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    if within_s <= HEARTBEAT_S:
        raise ValueError(f"within_s={within_s} must exceed the heartbeat interval ({HEARTBEAT_S} s)")
    return AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description="Marks a flow run Crashed when its heartbeats stop (its process, worker or host died), "
        "so it releases its concurrency slots. Created by `nemoflow deploy` / `nemoflow demo`.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within_s:g} s: the flow run's process, worker or host died "
                f"(automation {ZOMBIE_AUTOMATION!r})",
            )
        ],
    )


def ensure_zombie_automation(api: PrefectApi | str, within_s: float = ZOMBIE_AFTER_S, echo=print) -> bool:
    """Create (or bring up to date) :func:`zombie_automation` on the server; True when something changed."""
    from prefect.client.orchestration import get_client

    api = _as_api(api)
    wanted = zombie_automation(within_s)
    with api.settings(), get_client(sync_client=True) as client:
        found = client.read_automations_by_name(ZOMBIE_AUTOMATION)
        if found and _comparable(found[0]) == _comparable(wanted):
            return False
        if found:
            client.update_automation(found[0].id, wanted)
        else:
            client.create_automation(wanted)
    echo(f"{'updated' if found else 'created'} the automation {ZOMBIE_AUTOMATION!r} (no heartbeat for {within_s:g} s)")
    return True


def _comparable(automation) -> dict:
    data = automation.model_dump(mode="json", include={"name", "description", "enabled", "trigger", "actions"})
    data["trigger"].pop("id", None)
    return data


def failure_causes(api: PrefectApi | str, flow_run_id: str) -> list[str]:
    """One line per failed stage of a flow run (its subflows included): ``stage: cause``.

    Read from the Prefect API: the failed task runs' state messages (what the UI shows), first
    line, without Prefect's "Task run encountered an exception" prefix. A run without a failed
    task gives its own state message.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    api = _as_api(api)
    with api.settings(), get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        runs = [run.id]
        frontier = [run.id]
        while frontier:  # subflows, and theirs
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=frontier))
            )
            frontier = [child.id for child in children if child.id not in runs]
            runs += frontier
        failed = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=runs)),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.FAILED, StateType.CRASHED]))
            ),
        )
    causes = []
    for task_run in sorted(failed, key=lambda t: t.end_time or t.created):
        message = _first_line((task_run.state.message if task_run.state else "") or "")
        causes.append(f"{task_run.name}: {message.removeprefix('Task run encountered an exception ')}")
    if not causes and run.state is not None:
        causes.append(f"{run.name}: {run.state.name}: {_first_line(run.state.message or '')}")
    return causes


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def ui_url(api: PrefectApi | str, flow_run_id: str) -> str:
    base = (api.url if isinstance(api, PrefectApi) else api).rstrip("/")
    base = base[: -len("/api")] if base.endswith("/api") else base
    return f"{base}/runs/flow-run/{flow_run_id}"


def run_deployment(
    api: PrefectApi, deployment: str, params: list[str] | None = None, on_run=None
) -> tuple[str | None, int]:
    """``prefect deployment run DEPLOYMENT [--params ...] --watch``, its output passed through line by line:
    (the flow run's id, the command's exit code). ``on_run(flow_run_id)`` is called once the run exists."""
    import re

    proc = subprocess.Popen(
        [prefect_bin(), "deployment", "run", deployment, *(params or []), "--watch", "--watch-interval", "1"],
        cwd=str(REPO_ROOT),
        env=_env(**api.client_env()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    flow_run_id = None
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        match = re.search(r"UUID:\s*([0-9a-f-]{36})", line)
        if match and flow_run_id is None:
            flow_run_id = match.group(1)
            if on_run is not None:
                on_run(flow_run_id)
    return flow_run_id, proc.wait()

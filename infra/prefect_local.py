"""A local Prefect control plane for the demo: server, work pool, deployments, worker.

``nemoflow demo`` uses these to go from a fresh machine to a watched deployment
run: reuse a reachable Prefect API (``PREFECT_API_URL``) or start ``prefect
server start`` in the background; create the work pool; ``prefect --no-prompt
deploy``; start a worker; run the deployment. Background processes record pid
files under ``~/.nemoflow/prefect`` so ``nemoflow demo --down`` stops exactly
what was started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from infra.settings import DEFAULT_HOME

STATE_DIR = Path(os.environ.get("NEMOFLOW_HOME", DEFAULT_HOME)) / "prefect"
DEFAULT_PORT = 4200
REPO_ROOT = Path(__file__).resolve().parent.parent


def prefect_bin() -> str:
    candidate = Path(sys.executable).parent / "prefect"
    return str(candidate) if candidate.exists() else "prefect"


def _healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - any failure means: not healthy
        return False


def configured_api_url() -> str | None:
    """PREFECT_API_URL from the environment or the active Prefect profile."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_background(name: str, argv: list[str], env: dict[str, str]) -> int:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    log = STATE_DIR / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
    (STATE_DIR / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _running(name: str) -> int | None:
    pidfile = STATE_DIR / f"{name}.pid"
    if not pidfile.exists():
        return None
    pid = int(pidfile.read_text())
    return pid if _pid_alive(pid) else None


def log_tail(name: str, lines: int = 20) -> str:
    log = STATE_DIR / f"{name}.log"
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def ensure_server(port: int = DEFAULT_PORT, timeout: float = 120.0, echo=print) -> str:
    """A healthy Prefect API URL: the configured one if it answers, else a local server we start."""
    configured = configured_api_url()
    if configured and _healthy(configured):
        echo(f"using the Prefect API at {configured}")
        return configured
    api = f"http://127.0.0.1:{port}/api"
    if _healthy(api):
        echo(f"using the Prefect server already running at {api}")
        return api
    if configured:
        echo(f"PREFECT_API_URL={configured} does not answer; starting a local server instead")
    if _running("server") is None:
        # The UI calls the API at PREFECT_UI_API_URL, which must match the port we chose.
        env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_API_URL=api)
        env.pop("PREFECT_API_URL", None)
        _start_background("server", [prefect_bin(), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env)
        echo(f"starting a local Prefect server on port {port} (log: {STATE_DIR / 'server.log'})")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _healthy(api):
            return api
        if _running("server") is None:
            raise RuntimeError(f"the Prefect server exited while starting:\n{log_tail('server')}")
        time.sleep(0.5)
    raise RuntimeError(f"the Prefect server did not become healthy in {timeout:.0f}s:\n{log_tail('server')}")


def prefect_cli(args: list[str], api_url: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", PWD=str(REPO_ROOT))
    proc = subprocess.run([prefect_bin(), *args], cwd=str(REPO_ROOT), env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`prefect {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# The work pools prefect.yaml deploys to: name -> (worker type, base job template).
# `prefect --no-prompt deploy --all` refuses deployments whose pool does not exist,
# so `nemoflow deploy` creates them first (creating a pool starts nothing).
POOLS = {
    "local": ("process", None),
    "gpu-cluster": ("slurm", "deployments/slurm/base-job-template.json"),
    "nemoflow-k8s": ("kubernetes", "deployments/k8s/base-job-template.json"),
}


def _existing_pools(api_url: str) -> set[str]:
    """Pool names on the server, read in-process (a `prefect work-pool inspect` costs ~2 s each)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return {pool.name for pool in client.read_work_pools()}


def ensure_pools(api_url: str, echo=print) -> None:
    existing = _existing_pools(api_url)
    for name, (pool_type, template) in POOLS.items():
        if name not in existing and ensure_work_pool(name, pool_type, api_url, template):
            echo(f"created work pool {name!r} ({pool_type})")


def ensure_work_pool(name: str, pool_type: str, api_url: str, base_job_template: str | None = None) -> bool:
    """Create the pool unless it exists; True when it was created."""
    if prefect_cli(["work-pool", "inspect", name], api_url, check=False).returncode == 0:
        return False
    args = ["work-pool", "create", name, "--type", pool_type]
    if base_job_template:
        args += ["--base-job-template", str(REPO_ROOT / base_job_template)]
    prefect_cli(args, api_url)
    return True


def _deployed_fingerprint(api_url: str) -> str:
    import hashlib

    return hashlib.sha256((api_url + "\n" + (REPO_ROOT / "prefect.yaml").read_text()).encode()).hexdigest()


def deploy_if_changed(api_url: str, echo=print) -> bool:
    """Deploy everything unless this prefect.yaml was already deployed to this API and is still there.

    Local and Slurm workers load the flow code from the repository at run time, so only
    prefect.yaml (parameters, pools, schedules) needs a redeploy; that saves ~7 s a demo run.
    """
    stamp = STATE_DIR / "deployed.sha256"
    fingerprint = _deployed_fingerprint(api_url)
    if stamp.exists() and stamp.read_text() == fingerprint and _deployment_exists(api_url, "end-to-end/local"):
        return False
    deploy(None, api_url)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint)
    echo("deployed prefect.yaml")
    return True


def _deployment_exists(api_url: str, name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
            return True
        except ObjectNotFound:
            return False


def deploy(names: list[str] | None, api_url: str) -> str:
    """``prefect --no-prompt deploy --all`` (or ``--name ...``) from prefect.yaml at the repository root."""
    args = ["--no-prompt", "deploy"]
    if names is None:
        args.append("--all")
    for name in names or []:
        args += ["--name", name]
    return prefect_cli(args, api_url).stdout


def ensure_worker(pool: str, pool_type: str, api_url: str, echo=print) -> int:
    name = f"worker-{pool}"
    pid = _running(name)
    if pid is not None:
        return pid
    # Poll every second instead of Prefect's 10 s: a cached re-run then starts at once.
    env = dict(
        os.environ, PREFECT_API_URL=api_url, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_WORKER_QUERY_SECONDS="1"
    )
    pid = _start_background(name, [prefect_bin(), "worker", "start", "--pool", pool, "--type", pool_type], env)
    echo(f"started a {pool_type} worker for pool {pool!r} (pid {pid}, log: {STATE_DIR / (name + '.log')})")
    return pid


def stop_all(echo=print) -> list[str]:
    """Stop every background process the demo started (workers first, then the server)."""
    stopped = []
    if not STATE_DIR.exists():
        return stopped
    pidfiles = sorted(STATE_DIR.glob("*.pid"), key=lambda p: p.stem == "server")
    for pidfile in pidfiles:
        pid = int(pidfile.read_text())
        if _pid_alive(pid):
            # Prefect workers ignore the first SIGTERM (they drain); the second stops them.
            for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    break
                for _ in range(50):
                    if not _pid_alive(pid):
                        break
                    time.sleep(0.1)
                if not _pid_alive(pid):
                    break
            echo(f"stopped {pidfile.stem} (pid {pid})")
            stopped.append(pidfile.stem)
        pidfile.unlink()
    return stopped


def ui_url(api_url: str, flow_run_id: str) -> str:
    base = api_url.rstrip("/")
    base = base[: -len("/api")] if base.endswith("/api") else base
    return f"{base}/runs/flow-run/{flow_run_id}"


def write_state(name: str, data: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / f"{name}.json").write_text(json.dumps(data, indent=2))

"""The demo's control plane for real: an authenticated Prefect server, the active profile, a worker, a flow run.

Everything runs in subprocesses whose environment is a fresh shell's (no PREFECT_API_URL,
no auth string), with PREFECT_HOME and NEMOFLOW_HOME in the test's directory: the user's
own profile and pid files are never touched.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ENSURE_LOCAL_WORKER, REPO, VENV_BIN, free_port

pytestmark = [pytest.mark.prefect]


def shell_env(tmp_path: Path) -> dict[str, str]:
    """A new shell's environment: nothing of Prefect's but where its home is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        NEMOFLOW_HOME=str(tmp_path / "nemoflow-home"),
        NEMOFLOW_WORK_DIR=str(tmp_path / "work"),
    )
    return env


# a safety net, not what is tested: `nemoflow deploy` takes ~70 s alone and 3-4x that on a 2-core machine
# shared with 5 other pytest-xdist workers
def run(argv: list[str], env: dict[str, str], cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def status(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"}, method="POST")
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def profile_settings(env: dict[str, str]) -> dict[str, str]:
    """What a new shell's Prefect reads from its active profile."""
    code = (
        "import json; from prefect.settings import get_current_settings as s; a = s().api; "
        "print(json.dumps({'url': a.url, 'auth': a.auth_string.get_secret_value() if a.auth_string else None}))"
    )
    proc = run([sys.executable, "-c", code], env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def stop_control_plane(env: dict[str, str]) -> subprocess.CompletedProcess:
    # devtools' stop_all, not `nemoflow demo --down`: that also stops the machine's demo endpoint
    return run([sys.executable, "-c", "from devtools import prefect_local as pl; pl.stop_all()"], env)


@pytest.mark.slow
def test_deploy_auth_refuses_anonymous_calls_and_a_worker_still_runs_flows(tmp_path):
    env = shell_env(tmp_path)
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    outputs = []
    try:
        # `nemoflow deploy --auth`: a local server with an auth string, pools, every deployment of prefect.yaml
        deployed = run([str(VENV_BIN / "nemoflow"), "deploy", "--auth", "--port", str(port)], env)
        outputs.append(deployed.stdout + deployed.stderr)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        assert "deployed end-to-end/local" in deployed.stdout
        secret_file = tmp_path / "nemoflow-home" / "prefect" / "auth-string"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        secret = secret_file.read_text().strip()
        assert secret.startswith("nemoflow:") and len(secret) > 30

        # unauthenticated and wrong credentials: 401; the right ones: 200
        assert status(f"{api}/flows/filter") == 401
        assert status(f"{api}/flows/filter", "nemoflow:wrong") == 401
        assert status(f"{api}/flows/filter", secret) == 200

        # a new shell finds the server and the credentials in the active profile (not a temporary server)
        assert profile_settings(env) == {"url": api, "auth": secret}
        profiles = tmp_path / "prefect-home" / "profiles.toml"
        assert stat.S_IMODE(profiles.stat().st_mode) == 0o600  # it holds a secret now

        # a flow deployed and run from that shell, through a process worker the control plane starts
        flow_dir = tmp_path / "flow"
        flow_dir.mkdir()
        shutil.copy(Path(__file__).parent / "auth_flow.py", flow_dir / "auth_flow.py")
        made = run(
            [
                str(VENV_BIN / "prefect"),
                "--no-prompt",
                "deploy",
                "auth_flow.py:auth_check",
                "-n",
                "auth",
                "-p",
                "local",
            ],
            env,
            cwd=flow_dir,
        )
        outputs.append(made.stdout + made.stderr)
        assert made.returncode == 0, made.stdout + made.stderr
        worker = run(ENSURE_LOCAL_WORKER, env)
        assert worker.returncode == 0, worker.stderr
        watched = run(
            [str(VENV_BIN / "prefect"), "deployment", "run", "auth-check/auth", "--watch", "--watch-timeout", "150"],
            env,
            timeout=200,
        )
        outputs.append(watched.stdout + watched.stderr)
        assert watched.returncode == 0, watched.stdout + watched.stderr
        assert "Completed" in watched.stdout
        assert "Starting temporary server" not in watched.stdout + watched.stderr

        # the secret is on no command line (ps) and in no log or output
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                assert secret not in cmdline, f"pid {entry}: {cmdline!r}"
        logs = list((tmp_path / "nemoflow-home" / "prefect").glob("*.log"))
        assert {log.name for log in logs} >= {"server.log", "worker-local.log"}
        for text in [log.read_text(errors="replace") for log in logs] + outputs:
            assert secret not in text
    finally:
        stopped = stop_control_plane(env)
    assert "stopped server" in stopped.stdout, stopped.stdout + stopped.stderr
    assert "stopped worker-local" in stopped.stdout
    # `down` takes back what it recorded: a new shell no longer points at the stopped server
    assert profile_settings(env) == {"url": None, "auth": None}


@pytest.mark.slow
def test_an_authenticated_server_without_credentials_is_one_line(tmp_path):
    """A server that asks for credentials the client lacks: one line saying what to set (no traceback)."""
    env = shell_env(tmp_path)
    port = free_port()
    server_env = dict(
        env, PREFECT_SERVER_API_AUTH_STRING="admin:s3cret-value", PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api"
    )
    log = tmp_path / "server.log"
    from tests.conftest import prefect_server_process, wait_http

    server = prefect_server_process(port, server_env, log)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", 90, server, log)
        proc = run(
            [str(VENV_BIN / "nemoflow"), "deploy", "--port", str(port)],
            dict(env, PREFECT_API_URL=f"http://127.0.0.1:{port}/api"),
        )
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [
            f"nemoflow deploy: error: the Prefect API at http://127.0.0.1:{port}/api asks for credentials: "
            "set PREFECT_API_AUTH_STRING (`nemoflow demo --auth` uses the one in "
            f"{tmp_path / 'nemoflow-home' / 'prefect' / 'auth-string'} if it generated one)"
        ]
        wrong = run(
            [str(VENV_BIN / "nemoflow"), "deploy", "--port", str(port)],
            dict(env, PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PREFECT_API_AUTH_STRING="admin:wrong"),
        )
        assert wrong.returncode == 2
        assert wrong.stderr.strip().endswith("refused the auth string (HTTP 401); check PREFECT_API_AUTH_STRING")
        assert "admin:wrong" not in wrong.stderr and "s3cret-value" not in wrong.stderr
    finally:
        from tests.conftest import _stop

        _stop(server)

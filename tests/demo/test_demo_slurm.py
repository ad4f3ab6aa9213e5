"""`nemoflow demo --backend slurm` exactly as the README prints it, with no endpoint key in the environment.

Issue 26: the deploy stage starts the server on the Slurm node bound to every interface, which refuses
to start without NEMOFLOW_SERVE_API_KEY; the demo set none, the stage was retried three times and the
demo printed only the worker log's path. Now the demo generates a key (mode 0600) and the run completes
on the local Slurm: flow run, tokenization array, training, validation and the server each a Slurm job,
the smoke test sending the key.

Isolation from the other users of this machine: a private HOME (so ~/.nemoflow, ~/.prefect and the
profile are the test's own) and PREFECT_API_URL naming a free local port (the demo starts its Prefect
server there); `nemoflow demo --down` afterwards (it stops only what this HOME's demo started). The
endpoint uses the Slurm demo's printed port, 8001, while port 8000 is held as the README's order leaves
it (`scripts/demo.sh`, then the tests, with the local demo still serving): by the user's local demo if it
runs, else by this test.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import REPO, VENV_BIN, free_port
from tests.support.require import need

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.prefect]

COMMAND = "nemoflow demo --backend slurm"  # the README's line
DEMO_PORT = 8001  # nemoflow.commands.demo.ENDPOINT_PORTS["slurm"]
LOCAL_DEMO_PORT = 8000  # the local demo's, left running before the tests


def _status(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


@pytest.fixture
def newcomer_env(tmp_path):
    """A shell as a newcomer's: the venv on PATH, a fresh HOME, no NEMOFLOW_*/PREFECT_* settings, no key."""
    need(
        os.geteuid() == 0 and shutil.which("sbatch"),
        "the local Slurm cluster (root, sbatch)",
        "run the tests as root with Debian's slurm packages (scripts/services-up.sh starts the local cluster)",
    )
    if not _port_free(DEMO_PORT):
        pytest.fail(f"port {DEMO_PORT}, the Slurm demo endpoint's, is taken on this machine: cannot run it as printed")
    mine = subprocess.run(["squeue", "-h", "-n", "nemoflow-demo", "-o", "%i"], capture_output=True, text=True)
    if mine.stdout.split():  # the demo would replace it: never disturb a Slurm demo the user left running
        pytest.fail(f"a Slurm demo endpoint (job {mine.stdout.split()[0]}) runs here: `nemoflow demo --down` first")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMOFLOW_", "PREFECT_"))}
    env.pop("HF_TOKEN", None)
    env.update(
        HOME=str(home),
        PATH=f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(REPO),  # this checkout's code in every process and Slurm job
        PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api",  # a free port for the demo's own server
    )
    yield env
    down = subprocess.run(
        ["bash", "-c", "nemoflow demo --down"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    print(down.stdout[-2000:], down.stderr[-2000:])


@pytest.fixture
def local_demo_port_held():
    """Port 8000 held during the run, as a local demo left running holds it (the user's, or this socket)."""
    with socket.socket() as sock:
        if _port_free(LOCAL_DEMO_PORT):
            sock.bind(("127.0.0.1", LOCAL_DEMO_PORT))
            sock.listen()
        yield


def test_demo_on_slurm_generates_a_key_and_completes(newcomer_env, local_demo_port_held):
    env = newcomer_env
    assert not _port_free(LOCAL_DEMO_PORT)
    started = time.monotonic()
    proc = subprocess.run(["bash", "-c", COMMAND], cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    worker_log = (
        open(os.path.join(env["HOME"], ".nemoflow/prefect/worker-gpu-cluster.log"), errors="replace").read()[-4000:]
        if os.path.exists(os.path.join(env["HOME"], ".nemoflow/prefect/worker-gpu-cluster.log"))
        else ""
    )
    assert proc.returncode == 0, out[-6000:] + "\nworker log:\n" + worker_log
    print(f"`{COMMAND}` took {took:.0f} s")
    assert re.search(r"^training:\s+40 steps, ", out, re.M), out[-3000:]  # the demo's own training, as printed
    # A new server: the demo's own deployment first, the other deployments of prefect.yaml beside the run (a user's
    # next `prefect deployment run` finds them), and the stamp that spares the next demo the deploy.
    assert "deployed end-to-end/slurm; the other deployments of prefect.yaml deploy in the background" in out
    assert "deployed prefect.yaml (every deployment)" in out, out[-3000:]
    assert os.path.exists(os.path.join(env["HOME"], ".nemoflow/prefect/deployed.sha256"))
    listed = subprocess.run(
        ["prefect", "deployment", "ls"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    ).stdout
    assert all(name in listed for name in ("end-to-end/local", "end-to-end/k8s", "cpt-refresh/nightly-slurm")), listed

    # The key: generated once, the owner's alone, named in the summary with how to send it, never printed.
    key_file = os.path.join(env["HOME"], ".nemoflow", "serve-api-key")
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    key = open(key_file).read().strip()
    assert len(key) >= 32
    assert key not in out and key not in worker_log
    assert "api key:     ~/.nemoflow/serve-api-key (mode 0600)" in out, out[-3000:]
    assert 'curl -H "Authorization: Bearer $(cat ~/.nemoflow/serve-api-key)"' in out

    # The run completed on Slurm: the endpoint is the Slurm job's, it wants the key, the smoke test sent it.
    endpoint = re.search(r"^endpoint:\s+(\S+)", out, re.M).group(1)
    assert endpoint.endswith(f":{DEMO_PORT}")
    assert re.search(r"^smoke test:\s+'In the beginning[^']*' -> '.+", out, re.M), out[-3000:]
    # the last line itemises the control plane, as the GPU acceptance report reads it (devtools/acceptance.py)
    from devtools.acceptance import control_plane

    steps = re.findall(r"([a-zA-Z][a-zA-Z ]+) [0-9.]+ s", control_plane(out) or "")
    assert steps == [
        "checks and GPU probe",
        "backend setup",
        "Prefect server",
        "work pools and automation",
        "worker and deployment",
    ], out[-500:]
    assert _status(endpoint + "/v1/models") == 401
    assert _status(endpoint + "/v1/models", key) == 200
    jobs = subprocess.run(["squeue", "-h", "-n", "nemoflow-demo", "-o", "%T"], capture_output=True, text=True).stdout
    assert jobs.split() == ["RUNNING"], jobs

    # The printed curl works as printed (the shell reads the key from the file).
    curl = re.search(r'^\s+(curl -H "Authorization: Bearer \$\(cat [^)]+\)" \S+/v1/models)$', out, re.M).group(1)
    shown = subprocess.run(["bash", "-c", curl + " -s -o /dev/null -w %{http_code}"], env=env, capture_output=True)
    assert shown.stdout.decode() == "200", shown

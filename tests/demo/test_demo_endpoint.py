"""The demo's endpoint port and `nemoflow demo --down`, beside a demo the user left running.

A held endpoint port stops `nemoflow demo` before anything starts, in one line naming the holder and the
fix; the Slurm demo serves on a port of its own, so it runs beside a local demo left up (the README's
order); `--down` stops the endpoint the demo started whatever NEMOFLOW_WORK_DIR the second shell has, and
names what it could not stop. Real processes and sockets, a real `nemoflow` command line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from flows.end_to_end import EndToEndConfig
from infra import processes
from nemoflow.commands import demo
from tests.conftest import REPO, VENV_BIN, free_port


def _newcomer_env(tmp_path, **extra: str) -> dict[str, str]:
    """A shell of its own: fresh HOME (so ~/.nemoflow is the test's), no NEMOFLOW_*/PREFECT_* settings."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMOFLOW_", "PREFECT_"))}
    env.update(
        HOME=str(home),
        PATH=f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(REPO),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        **extra,
    )
    return env


def _nemoflow(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def held_port():
    """A port something else listens on (this test process), as a demo left running would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("backend", ["local", "slurm"])
def test_a_held_endpoint_port_stops_the_demo_in_one_line_before_anything_starts(tmp_path, held_port, backend):
    # PREFECT_API_URL names a port nobody answers on: a demo that went on would start a server there.
    env = _newcomer_env(tmp_path, PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api")
    proc = _nemoflow(["demo", "--backend", backend, "--gpus", "0", "--serve-port", str(held_port)], env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert f"port {held_port}, where this demo's endpoint would listen, is held by pid {os.getpid()}" in line
    assert f"`nemoflow demo --backend {backend} --serve-port " in line  # the fix, as a command
    state = tmp_path / "home" / ".nemoflow" / "prefect"
    assert not (state / "server.pid").exists() and not (state / demo.RECORD_FILE).exists()  # nothing started


def test_a_port_out_of_range_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--serve-port 70000: a TCP port is between 1 and 65535"):
        demo.check_endpoint_port(70000, "local")


def test_the_slurm_demo_serves_beside_the_local_demo_on_a_port_of_its_own():
    assert demo.ENDPOINT_PORTS["slurm"] != demo.ENDPOINT_PORTS["local"]
    assert demo.deployed_serve_port("end-to-end/local") == demo.ENDPOINT_PORTS["local"]  # no override needed
    config = demo.run_config("end-to-end/slurm", serve_port=demo.ENDPOINT_PORTS["slurm"])
    parsed = EndToEndConfig.model_validate(config)  # what the flow does with the run's parameter
    assert parsed.serve.port == demo.ENDPOINT_PORTS["slurm"]
    assert parsed.executor.kind == "slurm" and parsed.train.cpus_per_task == 1  # prefect.yaml's, carried over


@pytest.fixture
def demo_endpoint(tmp_path, monkeypatch):
    """A local demo endpoint as `NEMOFLOW_WORK_DIR=DIR nemoflow demo` leaves it: a real server named
    nemoflow-demo in DIR's service table, recorded under NEMOFLOW_HOME by the demo's own function."""
    from infra import services
    from infra.jobs import ServiceSpec
    from infra.settings import reload_settings

    home, work = tmp_path / "nemoflow-home", tmp_path / "elsewhere"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "health").write_text("ok\n")
    monkeypatch.setenv("NEMOFLOW_HOME", str(home))
    monkeypatch.setenv("NEMOFLOW_WORK_DIR", str(work))
    reload_settings()
    port = free_port()
    demo.record_endpoint("local", port)
    command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory"]
    spec = ServiceSpec(name=demo.ENDPOINT_NAME, command=[*command, str(tmp_path / "site")], port=port)
    handle = services.start_service(spec, tmp_path / "logs", ready_timeout_s=60)
    yield handle, home, work
    if processes.pid_alive(handle.pid):
        services.stop_service(handle.name)
    monkeypatch.undo()
    reload_settings()


def test_the_slurm_demo_is_refused_naming_the_local_demo_that_holds_its_port(demo_endpoint):
    handle, _, _ = demo_endpoint
    demo.check_endpoint_port(handle.port, "local")  # the local demo's own endpoint: reused or replaced
    with pytest.raises(ValueError) as refused:
        demo.check_endpoint_port(handle.port, "slurm")
    message = str(refused.value)
    assert f"is held by the local demo's inference server nemoflow-demo (pid {handle.pid}, {handle.url})" in message
    assert "stop it with `nemoflow demo --down`" in message and "--serve-port" in message


def test_down_stops_the_endpoint_whatever_the_work_dir_of_the_second_shell(tmp_path, demo_endpoint):
    handle, home, work = demo_endpoint
    # The second shell: the same home, no NEMOFLOW_WORK_DIR (the table of ~/.nemoflow/work is empty).
    env = _newcomer_env(tmp_path, NEMOFLOW_HOME=str(home))
    proc = _nemoflow(["demo", "--down"], env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"stopped the inference server nemoflow-demo ({handle.url}, work dir {work})" in out
    assert not processes.pid_alive(handle.pid, handle.proc_start)
    assert processes.port_owner(handle.port) is None
    assert not (home / "prefect" / demo.RECORD_FILE).exists()  # all stopped: the record goes


def test_down_names_what_it_could_not_stop(tmp_path, monkeypatch, held_port):
    from infra.settings import reload_settings

    home = tmp_path / "nemoflow-home"
    monkeypatch.setenv("NEMOFLOW_HOME", str(home))
    reload_settings()
    demo.record_endpoint("local", held_port)  # the demo's port, now held by a process it did not start
    proc = _nemoflow(["demo", "--down"], _newcomer_env(tmp_path, NEMOFLOW_HOME=str(home)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"not stopped: port {held_port} is still served by pid {os.getpid()} (" in proc.stderr
    assert (home / "prefect" / demo.RECORD_FILE).exists()  # kept: a later --down looks again
    monkeypatch.undo()
    reload_settings()

"""infra.services: managed server processes, against real processes and real sockets."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import services
from infra.jobs import ServiceSpec
from tests.conftest import free_port
from tests.support import fault_ledger

STANDINS = str(Path(__file__).with_name("standins.py"))


def standin(name: str, port: int, mode: str) -> ServiceSpec:
    return ServiceSpec(name=name, command=[sys.executable, STANDINS, "--port", str(port), "--mode", mode], port=port)


@pytest.mark.faults
def test_busy_port_fails_before_starting_anything(work_dir, cleanup, tmp_path):
    marker = tmp_path / "started"
    row = fault_ledger.open_row("port clash when starting a server")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(OSError):  # the clash is real: nothing else can bind the port now
            socket.create_server(("127.0.0.1", port)).close()
        row.injected += 1
        spec = ServiceSpec(name="busy", command=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"], port=port)
        with pytest.raises(services.PortInUseError) as info:
            services.start_service(spec, tmp_path / "logs", ready_timeout_s=5)
    message = str(info.value)
    assert f"port {port} is already in use" in message
    assert f"by pid {os.getpid()}" in message and "--port" in message
    # No process was started: its output would go to a log file under logs/, created before the
    # process is (a check that needs no sleep; the marker would only show up once python ran).
    assert not (tmp_path / "logs").exists(), "the command was started although the port was busy"
    assert not marker.exists()
    assert services.list_services() == []


def test_never_ready_times_out_with_log_tail_and_leaves_nothing(work_dir, cleanup, tmp_path):
    port = free_port()
    script = "import time\nfor i in range(30): print(f'booting step {i}', flush=True)\ntime.sleep(600)"
    spec = ServiceSpec(name="never-ready", command=[sys.executable, "-c", script], port=port)
    started = time.monotonic()
    with pytest.raises(services.ServiceNotReady) as info:
        services.start_service(spec, tmp_path / "logs", ready_timeout_s=2, poll_s=0.1)
    assert time.monotonic() - started < 15
    message = str(info.value)
    assert "not ready after 2s" in message and f"127.0.0.1:{port}/health" in message
    assert "booting step 29" in message and "booting step 10" in message
    assert "booting step 9\n" not in message  # only the last 20 lines
    assert info.value.log_tail[-1] == "booting step 29"
    assert subprocess.run(["pgrep", "-f", "booting step"], capture_output=True).returncode == 1  # none left
    assert services.list_services() == []


def test_server_that_exits_reports_code_and_log(work_dir, cleanup, tmp_path):
    script = "import sys; print('cannot load checkpoint /nowhere', flush=True); sys.exit(3)"
    spec = ServiceSpec(name="crashes", command=[sys.executable, "-c", script], port=free_port())
    with pytest.raises(services.ServiceNotReady) as info:
        services.start_service(spec, tmp_path / "logs", ready_timeout_s=30)
    assert "exited with code 3" in str(info.value)
    assert "cannot load checkpoint /nowhere" in str(info.value)


def test_stop_from_another_process_kills_the_whole_group(work_dir, cleanup, tmp_path):
    port = free_port()
    handle = services.start_service(standin("grouped", port, "child"), tmp_path / "logs", ready_timeout_s=30)
    assert handle.state == "ready" and handle.url == f"http://127.0.0.1:{port}"
    members = services.group_members(handle.pid)
    assert len(members) == 2, members  # the server and its grandchild `sleep`
    table = json.loads(services.table_path().read_text())
    assert table["grouped"]["pid"] == handle.pid and table["grouped"]["state"] == "ready"
    # `nemoflow serve stop` runs in a separate process: it finds the server through the service table
    result = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "serve", "stop", "grouped"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "grouped: stopped" in result.stdout
    time.sleep(0.2)
    assert [pid for pid in members if services.pid_alive(pid)] == []
    assert services.list_services() == []
    assert services.probe(handle.url + "/health", timeout=1) is None


def test_sigterm_ignored_falls_back_to_sigkill(work_dir, cleanup, tmp_path):
    handle = services.start_service(standin("stubborn", free_port(), "ignore-term"), tmp_path / "logs")
    started = time.monotonic()
    assert services.stop_service(handle, grace_s=0.5) is True
    assert time.monotonic() - started < 10
    assert not services.pid_alive(handle.pid)
    assert services.stop_service("stubborn") is False  # already stopped: not an error


def test_interrupted_start_kills_what_it_started(work_dir, cleanup, tmp_path):
    """A Prefect cancellation raises inside the waiting task; simulate it from the log callback."""
    port = free_port()
    script = "import time\nprint('loading', flush=True)\ntime.sleep(600)  # cancel-marker-7f3a"
    spec = ServiceSpec(name="cancelled", command=[sys.executable, "-c", script], port=port)
    seen: list[str] = []

    def on_log(line: str) -> None:
        seen.append(line)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        services.start_service(spec, tmp_path / "logs", ready_timeout_s=60, on_log=on_log)
    assert seen == ["loading"]
    assert subprocess.run(["pgrep", "-f", "cancel-marker-7f3a"], capture_output=True).returncode == 1  # none left
    assert services.list_services() == []


def test_stale_entries_are_cleaned_and_names_are_unique(work_dir, cleanup, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path = services.table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    stale = services.ServiceHandle(name="ghost", url="http://127.0.0.1:1", pid=dead.pid, port=1, log_path="x")
    # a live pid with another start time is a recycled pid, not our server
    recycled = services.ServiceHandle(
        name="recycled", url="http://127.0.0.1:2", pid=os.getpid(), port=2, log_path="x", proc_start=1
    )
    path.write_text(json.dumps({h.name: h.model_dump(mode="json") for h in (stale, recycled)}))
    assert services.list_services() == []
    assert json.loads(path.read_text()) == {}

    handle = services.start_service(standin("unique", free_port(), "empty"), tmp_path / "logs")
    with pytest.raises(services.ServiceError, match="already running"):
        services.start_service(standin("unique", free_port(), "empty"), tmp_path / "logs")
    assert services.is_healthy(handle)

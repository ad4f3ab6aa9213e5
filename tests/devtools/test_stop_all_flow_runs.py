"""`nemoflow demo --down` (devtools.prefect_local.stop_all) never leaves a flow-run process behind.

Prefect's process worker starts each flow run in a session of its own and stops them while it drains on
SIGTERM; a worker that does not finish draining within stop_all's grace is SIGKILLed, and its flow runs (not in
its process group) then ran on under init for good: a CI run found one, with its stage job, 70 minutes after
its test ended. Here the worker is a stand-in that never drains (it ignores SIGTERM), so it is SIGKILLed every
time; its "flow run" is a real process in a session of its own, as Prefect starts them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from devtools import prefect_local as pl
from infra import processes
from tests.conftest import wait_for
from tests.support import fault_ledger

WORKER = r"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # never drains: stop_all ends it with SIGKILL
run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1] + ".tmp", "w").write(str(run.pid))
__import__("os").replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


@pytest.mark.faults
def test_a_worker_killed_before_it_stopped_its_flow_runs_leaves_none_running(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMOFLOW_HOME", str(tmp_path))
    row = fault_ledger.open_row("process worker SIGKILLed before it stopped its flow run (`demo --down`)")
    run_file = tmp_path / "flow-run.pid"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(run_file)], start_new_session=True)
    try:
        wait_for(run_file.exists, 30, "the stand-in worker's flow run")
        flow_run = int(run_file.read_text())
        processes.write_pidfile(pl.state_dir() / "worker-demo.pid", worker.pid)
        lines: list[str] = []
        assert pl.stop_all(echo=lines.append) == ["worker-demo"]
        assert not processes.pid_alive(worker.pid)  # it never drained: SIGKILLed, as a slow worker is
        row.injected += 1
        wait_for(lambda: not processes.pid_alive(flow_run), 30, f"the end of the flow-run process {flow_run}")
        assert any(f"flow-run process {flow_run}" in line for line in lines), lines
    finally:
        if worker.poll() is None:
            worker.kill()
        if run_file.exists() and processes.pid_alive(pid := int(run_file.read_text())):
            processes.stop(pid, group=True, grace_s=1)

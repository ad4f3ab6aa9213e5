"""A stage job dies with the flow run that started it (issue #12: an orphaned trainer at 100% CPU).

The local backend runs each job behind :func:`infra.processes.guarded`; these tests SIGKILL the process
that called :meth:`LocalBackend.run` (from a thread, as Prefect's task runner does) and check that the
job, and what the job started (torchrun's workers are grandchildren), are gone within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from infra import processes
from tests.conftest import REPO
from tests.support import fault_ledger

pytestmark = [pytest.mark.faults]

# The "flow-run process": runs a job through the local backend from a worker thread.
RUNNER = textwrap.dedent(
    """
    import sys, threading
    from infra.backends.local import LocalBackend
    from infra.jobs import JobSpec

    job = sys.argv[1]
    spec = JobSpec(name="stage", command=[sys.executable, "-c", job, *sys.argv[2:]])
    thread = threading.Thread(target=LocalBackend().run, args=(spec,))
    thread.start()
    thread.join()
    """
)
# The job: starts a grandchild (as torchrun starts its workers), records both pids, waits.
JOB = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
    """
)


def _pids(path: Path, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().split()) == 2:
            return [int(p) for p in path.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"the job never wrote {path}")


def _gone_within(pids: list[int], timeout: float) -> float | None:
    """Seconds until none of ``pids`` runs (zombies count as gone), None if some still run."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if not any(processes.pid_alive(p) for p in pids):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "term"])
def test_job_and_its_children_die_with_the_flow_run_process(tmp_path, sig):
    marker = tmp_path / "pids"
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, JOB, str(marker)], cwd=REPO, start_new_session=True)
    try:
        row = fault_ledger.open_row(f"flow-run process killed ({sig.name}) during a stage job")
        pids = _pids(marker)
        assert all(processes.pid_alive(p) for p in pids)
        assert runner.poll() is None
        runner.send_signal(sig)  # SIGTERM: Python's default handler ends it without running any cleanup
        assert runner.wait(10) == -sig
        row.injected += 1
        took = _gone_within(pids, 10)
        assert took is not None, f"the job {pids} outlived its flow-run process"
    finally:
        runner.kill()
        runner.wait()
        for pid in pids if "pids" in locals() else []:
            if processes.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_guard_reports_the_command_exit_like_the_command(tmp_path):
    """Behind the guard, an exit code and a death by signal look exactly as without it."""
    row = fault_ledger.open_row("command SIGKILLed behind the guard")
    code = subprocess.run(processes.guarded([sys.executable, "-c", "raise SystemExit(7)"]), cwd=REPO).returncode
    assert code == 7
    killed = subprocess.run(
        processes.guarded([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]),
        cwd=REPO,
    )
    row.injected += killed.returncode == -signal.SIGKILL
    assert killed.returncode == -signal.SIGKILL


def test_a_cancel_still_lets_the_job_handle_sigterm(tmp_path):
    """The local backend's cancel (SIGTERM to the group) reaches the job, which may save and exit 76."""
    from infra.backends.local import LocalBackend
    from infra.jobs import JobSpec, JobState

    ready = tmp_path / "ready"
    job = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(76))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(600)\n"
    )
    row = fault_ledger.open_row("stage job cancelled (SIGTERM to its process group)")
    spec = JobSpec(name="term", command=[sys.executable, "-c", job], resources={"time": "00:00:10"})
    backend = LocalBackend(kill_grace_s=5)
    import threading

    results = []
    thread = threading.Thread(target=lambda: results.append(backend.run(spec)))
    thread.start()
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    from infra.backends import local

    (job_id,) = list(local._RUNNING)
    backend.cancel(job_id)
    row.injected += 1  # the job was running (its id listed) when it was cancelled
    thread.join(30)
    assert results and results[0].state is JobState.FAILED and results[0].exit_code == 76, results

"""A refresh refused for concurrency says why, and `nemoflow refresh --wait` waits for the slot (issue 26).

The issue's case: right after a crashed refresh and a server restart, `prefect deployment run
cpt-refresh/local --watch` ended ``Cancelled`` within a second, and neither the CLI nor the run's state
said which run held the slot or when it would free. Here, on a private Prefect server with the demo's
worker (heartbeats) and its zombie automation, a run of the real ``cpt_refresh`` flow started while
another run holds the ``cpt-refresh`` slot must end Cancelled with a state message naming the holder
(its name and id), its last heartbeat and its heartbeat deadline; `--watch` must print it. Then
`nemoflow refresh --wait` waits, names the holder while it waits, and starts the refresh once the
holder has finished. (A dead holder is named the same way: its last heartbeat stays the last, and the
zombie automation marks it Crashed at the deadline the message states; tests/faults/test_crashed_runs.py
shows the slot then frees.)
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import time

import pytest

from tests.conftest import REPO, VENV_BIN, free_port

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

ZOMBIE_AFTER_S = 60


@pytest.fixture
def plane(tmp_path, monkeypatch):
    """A Prefect server, pool, automation and worker as `nemoflow demo` starts them, private to this test."""
    from devtools import prefect_local as pl
    from tests.faults.conftest import ControlPlane

    monkeypatch.setenv("NEMOFLOW_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    control = ControlPlane(api=None, port=free_port(), root=tmp_path / "plane", pool="refresh-slot")
    try:
        control.start_server()
        with control.scoped():
            pl.ensure_work_pool(control.pool, "process", control.api)
            pl.ensure_zombie_automation(control.api, within_s=ZOMBIE_AFTER_S, echo=lambda *_: None)
        control.worker()
        yield control
    finally:
        control.stop_all()


def _heartbeat(plane, flow_run_id, timeout: float = 60) -> datetime.datetime:
    """The run's last heartbeat, once the API has one."""
    from infra.run_slots import slot_holders

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with plane.api.settings():
            found = [h for h in slot_holders(run_ids=[str(flow_run_id)]) if h.last_heartbeat]
        if found:
            return found[0].last_heartbeat
        time.sleep(1)
    pytest.fail(f"no heartbeat of {flow_run_id} in {timeout:.0f}s")


def _pid(path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.5)
    pytest.fail(f"{path.name} not written in {timeout:.0f}s")


def _cli_env(plane) -> dict:
    return dict(os.environ, PREFECT_API_URL=plane.api.url, PYTHONPATH=str(REPO))


def _watch(plane, deployment: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [str(VENV_BIN / "prefect"), "deployment", "run", deployment, "--watch", "--watch-interval", "1"],
        cwd=REPO,
        env=_cli_env(plane),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, time.monotonic() - started


def _run_id(output: str) -> str:
    return re.search(r"UUID:\s*([0-9a-f-]{36})", output).group(1)


def _clock(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime("%H:%M:%S UTC")


def test_refused_refresh_names_the_holder_and_refresh_wait_waits(plane, tmp_path):
    from flows.cpt_refresh import REFUSED

    holder_deployment = plane.deploy("tests/cpt/slot_holder_flow.py:holds_the_refresh_slot", concurrency_limit=None)
    refresh = plane.deploy("flows/cpt_refresh.py:cpt_refresh", name="slot-test", concurrency_limit=None)

    # A refresh holds the slot (cpt_refresh's own lock code) until `release` appears.
    holder = plane.run(holder_deployment, directory=str(tmp_path))
    _pid(tmp_path / f"flow-{holder.id}.pid")
    beat = _heartbeat(plane, holder.id)
    name = plane.flow_run(holder.id).name

    # 1. A refresh started now is refused: Cancelled, and the message says by whom and until when.
    proc, took = _watch(plane, refresh)
    refused = plane.flow_run(_run_id(proc.stdout))
    message = refused.state.message
    print(f"refused in {took:.1f}s: {message}")
    assert refused.state.is_cancelled(), refused.state
    assert message.startswith(REFUSED)
    assert f"run '{name}' ({holder.id}), Running since" in message
    last, crash = _times(message)
    assert crash - last == datetime.timedelta(seconds=ZOMBIE_AFTER_S), message  # the heartbeat deadline
    assert last >= beat.replace(microsecond=0), message  # the holder's latest heartbeat (it is alive)
    assert "nemoflow refresh --wait" in message
    shown = " ".join((proc.stdout + proc.stderr).split())  # --watch prints the run's log lines, wrapped
    assert " ".join(message.split()) in shown, "--watch does not show why:\n" + proc.stdout

    # 2. `nemoflow refresh --wait` waits, saying for whom, and runs once the holder finished.
    waiter = subprocess.Popen(
        [str(VENV_BIN / "nemoflow"), "refresh", "--deployment", refresh, "--wait", "--timeout", "300"],
        cwd=REPO,
        env=_cli_env(plane),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    assert waiter.stdout is not None
    for line in waiter.stdout:
        lines.append(line)
        if line.startswith("waiting for the cpt-refresh slot"):
            break
    assert lines and f"held by run '{name}' ({holder.id})" in lines[-1], "".join(lines)
    assert waiter.poll() is None, "it did not wait"
    (tmp_path / "release").touch()
    rest, _ = waiter.communicate(timeout=300)
    out = "".join(lines) + rest
    holder_run = plane.flow_run(holder.id)
    assert holder_run.state.is_completed(), holder_run.state
    assert "the slot is free" in out, out[-3000:]
    ran = plane.flow_run(_run_id(out))
    # It got past the slot: the refresh itself ran and stopped at the empty registry (no model to continue).
    assert ran.state.is_failed(), ran.state
    assert "has no promoted model to continue from" in ran.state.message
    assert ran.start_time >= holder_run.end_time
    assert waiter.returncode == 1  # the refresh failed (as it should, with nothing promoted)


def _times(message: str) -> tuple[datetime.datetime, datetime.datetime]:
    """(last heartbeat, marked-Crashed time) as the message states them (today, UTC)."""
    found = re.search(r"last heartbeat (\d\d:\d\d:\d\d) UTC; .*marked Crashed at (\d\d:\d\d:\d\d) UTC", message)
    assert found, message
    today = datetime.datetime.now(datetime.UTC).date()
    at = [datetime.datetime.combine(today, datetime.time.fromisoformat(t), datetime.UTC) for t in found.groups()]
    if at[1] < at[0]:  # past midnight
        at[1] += datetime.timedelta(days=1)
    return at[0], at[1]

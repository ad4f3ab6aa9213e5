"""Fixtures for the Slurm tests: the real local cluster (``nemoflow local-slurm up``).

Every job a test submits writes its script under the test's ``tmp_path``; after
each test, any job whose script lives there and is still pending or running is
cancelled AND the test fails: a backend must never leave jobs behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.require import missing

DATA = Path(__file__).parent / "data"


SLURM_HOW = "run the tests as root with Debian's slurm packages (scripts/services-up.sh starts the local cluster)"


def _cannot_start_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root; tests run as a regular user"
    from devtools.slurm_cluster import LocalSlurm

    if LocalSlurm.missing_packages() and not shutil.which("apt-get"):
        return "Slurm packages are missing and apt-get is not available"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running local cluster (started if needed); skips with the reason where it cannot run (fails
    under CI=true: tests/support/require.py)."""
    reason = _cannot_start_reason()
    if reason:
        missing(f"the local Slurm cluster ({reason})", SLURM_HOW)
    from devtools.slurm_cluster import LocalSlurm, LocalSlurmError

    cluster = LocalSlurm()
    try:
        cluster.up()
    except LocalSlurmError as exc:
        missing(f"the local Slurm cluster (it could not start: {exc})", SLURM_HOW)
    return cluster


def jobs_under(path: Path) -> list[str]:
    """Live jobs (pending/running) whose batch script or workdir is under ``path``."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%T|%o|%Z"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        job_id, state, command, workdir = (line.split("|") + ["", "", "", ""])[:4]
        if str(path) in command or str(path) in workdir:
            found.append(job_id)
    return found


@pytest.fixture
def slurm(slurm_cluster, tmp_path):
    """A test against the real cluster; fails the test if it leaves jobs behind."""
    yield slurm_cluster
    left = jobs_under(tmp_path)
    if left:
        subprocess.run(["scancel", *left], capture_output=True)
        pytest.fail(f"jobs left running after the test: {left}")


@pytest.fixture
def backend(slurm, tmp_path):
    from infra.backends.slurm import SlurmBackend
    from infra.slurm.watcher import SlurmWatcher

    # A private watcher with a short interval: tests need quick state changes.
    b = SlurmBackend(log_dir=str(tmp_path / "logs"), gpu_partition="gpu", poll_interval_s=0.5)
    b.watcher = SlurmWatcher(b.cli, min_interval_s=1.0)
    return b

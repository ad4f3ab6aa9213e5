"""The local cluster: configs as the notes prescribe, idempotent `up`, status, CLI."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from devtools.slurm_cluster import FAKE_GPUS, Layout, render_configs

pytestmark = pytest.mark.slurm


def test_configs_carry_the_settings_tests_rely_on(tmp_path):
    configs = render_configs(Layout(tmp_path), "node1", 2, 24000, "pw")
    conf = configs["slurm.conf"]
    for setting in (
        "EnforcePartLimits=ALL",
        "DependencyParameters=kill_invalid_depend",
        "MinJobAge=3600",
        "AuthInfo=cred_expire=10",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "GresTypes=gpu",
    ):
        assert setting in conf.splitlines(), setting
    assert "PartitionName=cpu Nodes=node1 Default=YES" in conf
    assert "PartitionName=gpu Nodes=node1" in conf
    assert f"Gres=gpu:{FAKE_GPUS}" in conf and "RealMemory=22976" in conf  # 1 GiB headroom
    assert f"File={tmp_path}/dev/nvidia[0-{FAKE_GPUS - 1}]" in configs["gres.conf"]
    assert "StoragePass=pw" in configs["slurmdbd.conf"]


def test_up_again_is_quick_and_everything_runs(slurm_cluster):
    started = time.monotonic()
    slurm_cluster.up()
    assert time.monotonic() - started < 3
    assert all(slurm_cluster.running().values()), slurm_cluster.running()
    # fake GPUs are character devices (slurmd rejects plain files)
    import stat

    for i in range(FAKE_GPUS):
        assert stat.S_ISCHR((slurm_cluster.layout.dev / f"nvidia{i}").stat().st_mode)


def test_sacct_reports_a_finished_job_through_slurmdbd(slurm, tmp_path):
    """sacct answers from the accounting database: this job's own id, its state and its exit code."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", "-o", str(tmp_path / "out.txt"), "--wrap", "exit 3"],
        capture_output=True,
        text=True,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 60
    row = ""
    while time.monotonic() < deadline:
        proc = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode"], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        row = proc.stdout.strip()
        if row and row.split("|")[1] not in ("PENDING", "RUNNING", "COMPLETING"):
            break
        time.sleep(0.5)
    assert row == f"{job_id}|FAILED|3:0"


def test_cli_status_lists_daemons_and_partitions(slurm_cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "local-slurm", "status"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for daemon in ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd"):
        assert any(line.startswith(daemon) and "running, pid" in line for line in proc.stdout.splitlines())
    assert "cpu*" in proc.stdout and "gpu" in proc.stdout


def test_cli_help_explains():
    proc = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "local-slurm", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "fake GPUs" in proc.stdout and "pid files" in proc.stdout

"""`nemoflow interactive` on the real local Slurm, driven through a pseudo-terminal (pexpect).

The cluster is shared: every allocation here is one CPU for at most two minutes, and each test
releases what it took in a finally block."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.interactive import InteractiveRequest, attach_argv, container_spec, parse_granted, salloc_argv
from infra.slurm.options import SlurmOptions
from tests.slurm.conftest import slurm_cluster  # noqa: F401 - the fixture

NEMOFLOW = str(Path(sys.executable).parent / "nemoflow")
# The one-machine cluster is shared: other sessions' jobs may hold its two CPUs for a while.
WAIT = 600
slurm = pytest.mark.usefixtures("slurm_cluster")  # started if needed; skips, or fails under CI=true


def test_salloc_takes_the_presets_partition_gpus_and_labels():
    argv = salloc_argv(InteractiveRequest(time="02:00:00"), SlurmOptions(preset="hcc-a3m", account="proj", qos="high"))
    assert argv[:2] == ["salloc", "--no-shell"]
    assert {"--partition=a3mega", "--gpus-per-node=8", "--time=02:00:00", "--account=proj", "--qos=high"} <= set(argv)
    comment = next(a for a in argv if a.startswith("--comment="))
    assert comment.startswith("--comment=nemoflow:") and "kind=interactive" in comment and "preset=hcc-a3m" in comment
    # the request wins over the preset
    argv = salloc_argv(InteractiveRequest(partition="debug", gpus_per_node=1), SlurmOptions(preset="hcc-a4"))
    assert "--partition=debug" in argv and "--gpus-per-node=1" in argv
    assert parse_granted("salloc: Pending job allocation 77\nsalloc: Granted job allocation 77\n") == "77"


def test_the_shell_runs_in_the_container_with_the_presets_setup():
    options = SlurmOptions(preset="hcc-a3u", container_mounts=["/lustre:/lustre"])
    request = InteractiveRequest(image="/shared/nemo.sqsh", mounts=["/data:/data:ro"], workdir="/workspace")
    session = {
        "spec": container_spec(request, options).model_dump(mode="json"),
        "extra_mounts": options.container_mounts,
        "setup_lines": options.cluster_preset.setup_lines,
    }
    argv = attach_argv("4242", session)
    assert argv[:4] == ["srun", "--jobid=4242", "--overlap", "--pty"]
    assert "--container-image=/shared/nemo.sqsh" in argv
    assert "--container-mounts=/data:/data:ro,/lustre:/lustre" in argv
    assert "--container-workdir=/workspace" in argv
    assert argv[-3:-1] == ["bash", "-c"] and argv[-1].startswith("export LD_LIBRARY_PATH=/usr/local/gib/lib64")
    assert argv[-1].endswith("exec bash -i")


def _queue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def _jobs() -> str:
    return subprocess.run([NEMOFLOW, "jobs", "--backend", "slurm"], capture_output=True, text=True, timeout=60).stdout


def _run_in(child, command: str, timeout: float = 60) -> str:
    """Type ``command`` into the shell; return what it printed (a marker the echo of the input cannot match)."""
    child.sendline(f"{command}; echo END-$((40+2))")
    child.expect("END-42", timeout=timeout)
    return child.before


@slurm
@pytest.mark.slurm
@pytest.mark.slow
def test_interactive_shell_attach_and_release_on_exit(work_dir):
    import pexpect

    env = dict(os.environ, NEMOFLOW_WORK_DIR=str(work_dir))
    shell = pexpect.spawn(
        NEMOFLOW,
        ["interactive", "--backend", "slurm", "--partition", "cpu", "--cpus", "1", "--gpus", "1", "--time", "2"],
        env=env,
        encoding="utf-8",
        timeout=120,
    )
    job_id = None
    try:
        shell.expect(r"allocation (\d+) granted", timeout=WAIT)
        job_id = shell.match.group(1)
        out = _run_in(shell, "echo JOB=$SLURM_JOB_ID GPUS=$CUDA_VISIBLE_DEVICES HOST=$(hostname)")
        assert f"JOB={job_id}" in out and re.search(r"GPUS=\d", out), out
        assert _queue(job_id) == "RUNNING"
        listed = _jobs()
        assert re.search(rf"^{job_id}\s+interactive\s+RUNNING", listed, re.M), listed

        # come back from another terminal: a second shell in the same allocation
        attach = pexpect.spawn(
            NEMOFLOW, ["attach", job_id, "--backend", "slurm"], env=env, encoding="utf-8", timeout=120
        )
        try:
            assert f"JOB={job_id}" in _run_in(attach, "echo JOB=$SLURM_JOB_ID")
            attach.sendline("exit")
            attach.expect(pexpect.EOF)
        finally:
            attach.close(force=True)
        assert _queue(job_id) == "RUNNING", "leaving an attached shell keeps the allocation"

        shell.sendline("exit")
        shell.expect(f"released allocation {job_id}")
        shell.expect(pexpect.EOF)
        deadline = time.monotonic() + 30
        while _queue(job_id) not in ("", "COMPLETING", "CANCELLED") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _queue(job_id) in ("", "COMPLETING", "CANCELLED")
        assert job_id not in _jobs()
        # attaching to a released allocation is a one-line error
        proc = subprocess.run(
            [NEMOFLOW, "attach", job_id, "--backend", "slurm"], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2 and "is not a held nemoflow interactive allocation" in proc.stderr
    finally:
        shell.close(force=True)
        if job_id:
            subprocess.run(["scancel", job_id], capture_output=True)


@slurm
@pytest.mark.slurm
@pytest.mark.slow
def test_a_kept_allocation_ends_at_its_time_limit(work_dir):
    """--no-shell holds the node (listed) until Slurm ends it at the one-minute limit."""
    env = dict(os.environ, NEMOFLOW_WORK_DIR=str(work_dir))
    proc = subprocess.run(
        [
            NEMOFLOW,
            "interactive",
            "--backend",
            "slurm",
            "--partition",
            "cpu",
            "--cpus",
            "1",
            "--time",
            "1",
            "--no-shell",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT + 60,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"allocation (\d+) granted", proc.stdout).group(1)
    try:
        assert re.search(rf"^{job_id}\s+interactive\s+RUNNING", _jobs(), re.M)
        deadline = time.monotonic() + 150  # the limit, plus Slurm's ~30 s of slack
        while _queue(job_id) and time.monotonic() < deadline:
            time.sleep(2)
        assert not _queue(job_id), "Slurm ends the allocation at its time limit"
        assert job_id not in _jobs()
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


@slurm
@pytest.mark.slurm
def test_a_request_that_is_not_granted_in_time_is_withdrawn_and_an_impossible_one_is_one_line(work_dir, monkeypatch):
    from infra.interactive import InteractiveError, allocate

    monkeypatch.setenv("NEMOFLOW_WORK_DIR", str(work_dir))
    later = SlurmOptions(extra_sbatch_flags=["--begin=now+3600"])  # queued, never granted within the wait
    with pytest.raises(InteractiveError, match="no allocation within 3s, request withdrawn"):
        allocate(InteractiveRequest(partition="cpu", cpus_per_task=1, time="1"), later, timeout_s=3)
    queued = subprocess.run(
        ["squeue", "-h", "-n", "nemoflow-interactive", "-t", "PENDING", "-o", "%i %r"], capture_output=True, text=True
    )
    assert "BeginTime" not in queued.stdout, "the queued request was left behind"
    with pytest.raises(InteractiveError, match="salloc refused the allocation: .*"):
        allocate(InteractiveRequest(partition="cpu", gpus_per_node=64, time="1"), SlurmOptions(), timeout_s=30)

"""SlurmBackend against the real local Slurm: jobs, arrays, bad input and faults.

Test jobs use 1 CPU so two run at once on the 2-core node (which other
engineers' tests share: nothing here touches the node or the daemons).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from infra.backends.local import LocalBackend
from infra.jobs import JobSpec, JobState, Mount, Resources
from infra.slurm.commands import SlurmCLI, SlurmCommandError, SlurmUnavailable
from infra.slurm.preflight import SlurmPreflightError
from infra.slurm.watcher import SlurmWatcher

from .conftest import jobs_under

pytestmark = pytest.mark.slurm
PY = sys.executable


def py(code: str) -> list[str]:
    return [PY, "-c", code]


def test_same_jobspec_runs_unchanged_on_local_and_slurm(backend, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    code = (
        "import os, pathlib; print('cwd', os.getcwd()); print('stage', os.environ['STAGE']);"
        "pathlib.Path('out.txt').write_text('written by ' + os.environ['STAGE'])"
    )
    spec = JobSpec(
        name="same-spec",
        command=py(code),
        env={"STAGE": "train-1"},
        workdir=str(work),
        resources=Resources(cpus_per_task=1, mem="256M", time="00:05:00"),
    )
    local = LocalBackend().run(spec)
    slurm = backend.run(spec)
    assert local.state is slurm.state is JobState.COMPLETED
    assert slurm.exit_code == 0 and slurm.attempts == 1
    job_lines = [line for line in slurm.log_tail if not line.startswith("[slurm]")]
    assert job_lines == local.log_tail == [f"cwd {work}", "stage train-1"]
    assert (work / "out.txt").read_text() == "written by train-1"


def test_array_is_one_job_with_indexed_tasks(backend, tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    code = f"import os; i=os.environ['NEMOFLOW_ARRAY_INDEX']; open('{out}/shard-'+i,'w').write(i); print('shard', i)"
    lines: list[str] = []
    result = backend.run(JobSpec(name="prep-array", command=py(code), array_size=3, array_parallelism=2), lines.append)
    assert result.state is JobState.COMPLETED
    assert sorted(p.name for p in out.iterdir()) == ["shard-0", "shard-1", "shard-2"]
    submissions = [line for line in lines if line.startswith("[slurm] submitted")]
    assert len(submissions) == 1 and "array 0-2%2" in submissions[0]
    assert {"[0] shard 0", "[1] shard 1", "[2] shard 2"} <= set(lines)


def test_exit_3_is_failed_with_code_and_not_retried(backend):
    result = backend.run(JobSpec(name="exit-three", command=py("import sys; print('bad input'); sys.exit(3)")))
    assert result.state is JobState.FAILED
    assert result.exit_code == 3
    assert result.attempts == 1
    assert "FAILED" in result.reason and "exit code 3" in result.reason
    assert "bad input" in result.log_tail


def test_workload_out_of_memory_exit_code_maps_like_the_local_backend(backend):
    from infra.jobs import ExitCode

    EXIT_OUT_OF_MEMORY = int(ExitCode.OUT_OF_MEMORY)

    spec = JobSpec(name="oom", command=py(f"import sys; sys.exit({EXIT_OUT_OF_MEMORY})"))
    local, slurm = LocalBackend().run(spec), backend.run(spec)
    assert local.state is slurm.state is JobState.OUT_OF_MEMORY
    assert slurm.exit_code == EXIT_OUT_OF_MEMORY and slurm.attempts == 1  # not resubmitted


def test_gpu_request_gets_fake_gpus(backend):
    spec = JobSpec(
        name="gpu-job",
        command=py("import os; print('gpus', os.environ.get('CUDA_VISIBLE_DEVICES'))"),
        resources=Resources(gpus_per_node=2),
    )
    result = backend.run(spec)
    assert result.state is JobState.COMPLETED
    assert "gpus 0,1" in result.log_tail


def test_secrets_reach_the_job_but_not_the_script_or_logs(backend, tmp_path, monkeypatch):
    from infra.settings import reload_settings

    monkeypatch.setenv("HF_TOKEN", "hf_do_not_leak_42")
    reload_settings()
    try:
        code = "import os; t=os.environ['HF_TOKEN']; print('len', len(t)); print('echo', t)"
        result = backend.run(JobSpec(name="secret-job", command=py(code), secret_env=["HF_TOKEN"]))
    finally:
        monkeypatch.delenv("HF_TOKEN")
        reload_settings()
    assert result.state is JobState.COMPLETED
    assert "len 17" in result.log_tail and "echo ***" in result.log_tail
    for path in (tmp_path / "logs").iterdir():
        if path.suffix == ".sbatch":
            assert "hf_do_not_leak_42" not in path.read_text()


def test_unknown_partition_fails_before_submission_listing_real_ones(slurm, tmp_path):
    from infra.backends.slurm import SlurmBackend

    b = SlurmBackend(partition="general", log_dir=str(tmp_path / "logs"))
    with pytest.raises(SlurmPreflightError, match=r"partition 'general' does not exist; available: cpu, gpu"):
        b.run(JobSpec(name="nowhere", command=["true"]))
    assert not list((tmp_path / "logs").glob("*.sbatch"))  # nothing was submitted


@pytest.mark.parametrize(
    "resources, message",
    [
        (Resources(cpus_per_task=64), r"64 CPUs per node requested .* has 2"),
        (Resources(gpus_per_node=16), r"16 GPUs per node requested but partition 'gpu' has 4 GPUs"),
        (Resources(mem="100000G"), r"mem=100000G .* largest node in partition 'cpu' has \d+ MB"),
        (Resources(nodes=3), r"3 nodes requested but partition 'cpu' has 1"),
        (
            Resources(time="10:00:00", gpus_per_node=1),
            r"time=10:00:00 exceeds the MaxTime of partition 'gpu' \(02:00:00\)",
        ),
    ],
)
def test_impossible_requests_fail_with_the_limit(backend, resources, message):
    with pytest.raises(SlurmPreflightError, match=message):
        backend.run(JobSpec(name="too-big", command=["true"], resources=resources))


def test_impossible_request_without_preflight_is_refused_by_slurm(backend):
    """EnforcePartLimits=ALL: sbatch itself refuses, and the error says so instead of pending forever."""
    from infra.backends.slurm import SlurmSubmitError

    backend.check = False
    with pytest.raises(SlurmSubmitError, match="sbatch rejected job 'too-long'"):
        backend.run(JobSpec(name="too-long", command=["true"], resources=Resources(time="1-00:00:00")))


def test_missing_container_image_fails_before_submission(backend, tmp_path):
    spec = JobSpec(
        name="nemo",
        command=["python", "train.py"],
        container_image=str(tmp_path / "nemo.sqsh"),
        mounts=[Mount(source=str(tmp_path), target="/data")],
    )
    with pytest.raises(SlurmPreflightError, match=r"container image '.*nemo.sqsh' does not exist"):
        backend.run(spec)


def test_sbatch_not_on_path_is_a_clear_error(backend, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmUnavailable, match="is not on PATH: install Slurm's client tools"):
        backend.run(JobSpec(name="no-slurm", command=["true"]))


def test_interrupted_run_scancels_the_job(backend, tmp_path):
    class Stop(Exception):
        pass

    def on_log(line: str) -> None:
        if line == "working":
            raise Stop()

    spec = JobSpec(name="to-cancel", command=py("import time; print('working', flush=True); time.sleep(300)"))
    with pytest.raises(Stop):
        backend.run(spec, on_log)
    assert jobs_under(tmp_path) == []  # scancel'd, not left in squeue


def test_keyboard_interrupt_from_another_thread_style_cancel(backend, tmp_path):
    """A Prefect cancellation arrives as an exception inside run(): same cleanup path."""
    seen = threading.Event()

    def on_log(line: str) -> None:
        if line == "up":
            seen.set()
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        backend.run(JobSpec(name="ctrl-c", command=py("import time; print('up', flush=True); time.sleep(300)")), on_log)
    assert seen.is_set() and jobs_under(tmp_path) == []


class LaggingCLI(SlurmCLI):
    """Real Slurm, but sacct knows nothing for the first ``lag_s`` seconds (as right after submit/end)."""

    def __init__(self, lag_s: float, fail: bool = False):
        super().__init__()
        self.lag_until = time.monotonic() + lag_s
        self.fail = fail
        self.sacct_calls: list[list[str]] = []

    def sacct(self, job_ids):
        job_ids = list(job_ids)
        self.sacct_calls.append(job_ids)
        if time.monotonic() < self.lag_until:
            if self.fail:
                raise SlurmCommandError(["sacct"], 1, "sacct: error: Problem talking to the database")
            return []
        return super().sacct(job_ids)


@pytest.mark.parametrize("fail", [False, True], ids=["no-rows-yet", "slurmdbd-unreachable"])
def test_sacct_lagging_falls_back_to_the_controller(slurm, tmp_path, fail):
    from infra.backends.slurm import SlurmBackend

    cli = LaggingCLI(lag_s=120, fail=fail)
    b = SlurmBackend(log_dir=str(tmp_path / "logs"), cli=cli, watcher=SlurmWatcher(cli, 0.5), poll_interval_s=0.3)
    result = b.run(JobSpec(name="lagging", command=py("import time,sys; time.sleep(2); sys.exit(5)")))
    # sacct never answered, yet the job was neither called failed early nor lost: scontrol had it
    assert cli.sacct_calls and time.monotonic() < cli.lag_until
    assert result.state is JobState.FAILED and result.exit_code == 5


def test_watcher_asks_sacct_once_for_all_jobs(slurm, tmp_path):
    from infra.backends.slurm import SlurmBackend

    cli = LaggingCLI(lag_s=0)
    watcher = SlurmWatcher(cli, min_interval_s=1.0)
    b = SlurmBackend(log_dir=str(tmp_path / "logs"), cli=cli, watcher=watcher, poll_interval_s=0.2)
    results = {}

    def run(i: int) -> None:
        results[i] = b.run(JobSpec(name=f"batched-{i}", command=py("import time; time.sleep(3)")))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    elapsed = time.monotonic() - started
    assert all(r.state is JobState.COMPLETED for r in results.values()) and len(results) == 3
    # three jobs polled every 0.2 s would be ~15 calls/s; one shared poll per second is far fewer
    assert len(cli.sacct_calls) <= elapsed / 1.0 + 3
    assert max(len(ids) for ids in cli.sacct_calls) >= 2  # one call carried several jobs


CHECKPOINTED = """
import os, pathlib, sys, time
ck = pathlib.Path(sys.argv[1]); target = int(sys.argv[2])
step = int(ck.read_text()) if ck.exists() else 0
print(f"resume from {step}" if step else "fresh start", "restart", os.environ.get("SLURM_RESTART_COUNT", "0"), flush=True)
resumed = "resume" in sys.argv or os.environ.get("SLURM_RESTART_COUNT", "0") != "0"
while step < target:
    step += 1
    tmp = ck.with_suffix(".tmp"); tmp.write_text(str(step)); tmp.replace(ck)
    print("step", step, flush=True)
    # First run: slow, so the time limit (or a requeue) hits it midway. A resumed
    # run goes fast to keep the test short: what matters is where it resumes.
    time.sleep(0.05 if resumed else 1.0)
print("done", step, flush=True)
"""


def _checkpointed(tmp_path: Path, target: int) -> tuple[Path, Path]:
    script = tmp_path / "counter.py"
    script.write_text(CHECKPOINTED)
    return script, tmp_path / "counter.ckpt"


@pytest.mark.slow
def test_timeout_is_resubmitted_and_resumes_from_checkpoint(backend, tmp_path):
    script, ckpt = _checkpointed(tmp_path, 200)
    lines: list[str] = []
    spec = JobSpec(name="time-limited", command=[PY, str(script), str(ckpt), "200"], resources=Resources(time="1"))
    backend.options.max_resubmits = 3
    result = _run_with_fast_resume(backend, spec, lines)
    assert result.state is JobState.COMPLETED and result.attempts == 2
    assert any("ended timeout; resubmitting" in line for line in lines)
    resumed = [line for line in lines if line.startswith("resume from ")]
    assert resumed, lines[-20:]
    resumed_at = int(resumed[0].split()[2])
    assert 30 < resumed_at < 200
    assert ckpt.read_text() == "200"
    # the resumed attempt ran exactly the steps after the checkpoint, none twice
    # (the killed attempt may have checkpointed its last step without printing it)
    at = lines.index(resumed[0])
    before = [int(line.split()[1]) for line in lines[:at] if line.startswith("step ")]
    after = [int(line.split()[1]) for line in lines[at:] if line.startswith("step ")]
    assert max(before) <= resumed_at
    assert after == list(range(resumed_at + 1, 201))


def _run_with_fast_resume(backend, spec, lines):
    # The resubmitted attempt reads the checkpoint; passing "resume" makes it fast.
    original_submit = backend.submit

    def submit(spec_, indices=None, attempt=1, extra_env=None, check=None):
        if attempt > 1:
            spec_ = spec_.model_copy(update={"command": [*spec_.command, "resume"]})
        return original_submit(spec_, indices, attempt, extra_env, check)

    backend.submit = submit
    return backend.run(spec, lines.append)


@pytest.mark.slow
def test_requeued_job_restarts_and_resumes(backend, tmp_path):
    """`scontrol requeue` (what a node failure does to a requeueable job): same id, SLURM_RESTART_COUNT=1."""
    script, ckpt = _checkpointed(tmp_path, 60)
    lines: list[str] = []
    done = threading.Event()
    result_box = {}

    def run():
        result_box["r"] = backend.run(
            JobSpec(name="requeued", command=[PY, str(script), str(ckpt), "60"]), lines.append
        )
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while not any(line == "step 5" for line in lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    job_id = next(line.split()[3] for line in lines if line.startswith("[slurm] submitted"))
    SlurmCLI().run(["scontrol", "requeue", job_id])
    thread.join(timeout=240)
    result = result_box["r"]
    assert result.state is JobState.COMPLETED and result.job_id == job_id and result.attempts == 1
    restarted = [line for line in lines if line.startswith("resume from ")]
    assert restarted and restarted[0].endswith("restart 1")
    assert int(restarted[0].split()[2]) >= 5
    assert ckpt.read_text() == "60"


def test_service_runs_as_a_job_until_stopped(backend, tmp_path):
    import socket
    import urllib.request

    from infra.jobs import ServiceSpec

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "health").write_text("ok")
    spec = ServiceSpec(
        name="svc-http",
        command=[PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        port=port,
        health_path="/health",
        workdir=str(tmp_path),
        fingerprint="f1",
    )
    info = backend.start_service(spec, ready_timeout_s=120)
    url = info.url
    try:
        assert url == f"http://127.0.0.1:{port}"  # the node's NodeAddr
        with urllib.request.urlopen(url + "/health") as r:
            assert r.read() == b"ok"
        seen = backend.service("svc-http")
        assert (seen.job_id, seen.fingerprint, seen.healthy, seen.url) == (info.job_id, "f1", True, url)
        again = backend.start_service(spec)  # the same fingerprint, healthy: the same job is kept
        assert again.job_id == info.job_id and len(jobs_under(tmp_path)) == 1
        replaced = backend.start_service(spec.model_copy(update={"fingerprint": "f2"}), ready_timeout_s=120)
        assert replaced.job_id != info.job_id and backend.service("svc-http").fingerprint == "f2"
        assert len(jobs_under(tmp_path)) == 1
    finally:
        assert backend.stop_service("svc-http") is True
    assert jobs_under(tmp_path) == []
    assert backend.stop_service("svc-http") is False


def test_unreachable_controller_is_a_clear_error(slurm, tmp_path, monkeypatch):
    from infra.backends.slurm import SlurmBackend

    conf = tmp_path / "etc"
    conf.mkdir()
    for name in ("slurm.conf", "gres.conf", "cgroup.conf"):
        (conf / name).write_text((slurm.layout.etc / name).read_text())
    with (conf / "slurm.conf").open("a") as fh:
        fh.write("SlurmctldPort=1\n")  # nothing listens there
    monkeypatch.setenv("SLURM_CONF", str(conf / "slurm.conf"))
    b = SlurmBackend(log_dir=str(tmp_path / "logs"), cli=SlurmCLI(retries=0))
    with pytest.raises(
        SlurmUnavailable, match="the Slurm controller is unreachable: .*Unable to contact slurm controller"
    ):
        b.run(JobSpec(name="no-controller", command=["true"]))

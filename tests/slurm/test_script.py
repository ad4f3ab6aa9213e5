"""The sbatch script: options merged from JobSpec + SlurmOptions + presets, rendered from one template.

Rendered scripts are checked with ``bash -n`` (real syntax check) and read back
line by line; container and multi-node paths cannot run here (no pyxis, one
node) so their rendering is what we can test.
"""

from __future__ import annotations

import subprocess

import pytest
from pydantic import ValidationError

from infra.jobs import JobSpec, Mount, Resources
from infra.slurm.options import PRESETS, SlurmOptions, merge
from infra.slurm.script import render_batch_script


def render(spec: JobSpec, indices=None, **opts) -> tuple[object, str]:
    req = merge(spec, SlurmOptions(**opts), "/shared/logs", indices)
    script = render_batch_script(spec, req, opts.get("container_mounts"))
    syntax = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert syntax.returncode == 0, syntax.stderr + script
    return req, script


def directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            flag = line[len("#SBATCH ") :]
            key, _, value = flag.partition("=")
            out[key] = value
    return out


def test_stage_resources_win_over_backend_defaults_and_options_fill_the_rest():
    spec = JobSpec(
        name="train", command=["python", "-m", "workloads.train"], resources=Resources(gpus_per_node=2, time="00:30:00")
    )
    req, script = render(
        spec,
        partition="cpu",
        gpu_partition="gpu",
        time="04:00:00",
        mem="8G",
        account="proj",
        qos="high",
        constraint="h100",
        exclusive=True,
        dependency="afterok:12",
    )
    d = directives(script)
    assert d["--partition"] == "gpu"  # GPU job goes to the GPU partition
    assert d["--time"] == "00:30:00"  # the stage asked for it explicitly
    assert d["--mem"] == "8G"  # the stage did not: backend default
    assert d["--gpus-per-node"] == "2" and d["--account"] == "proj" and d["--qos"] == "high"
    assert d["--constraint"] == "h100" and "--exclusive" in d and d["--dependency"] == "afterok:12"
    # one node, one task: the workload replaces the shell (signals reach it directly)
    assert script.rstrip().splitlines()[-1] == "exec python -m workloads.train"


def test_array_job_exports_index_and_per_task_output():
    spec = JobSpec(name="prep", command=["python", "-c", "print(1)"], array_size=8, array_parallelism=3)
    req, script = render(spec, list(range(8)))
    d = directives(script)
    assert d["--array"] == "0-7%3"
    assert d["--output"] == "/shared/logs/prep-%A_%a.out"
    assert 'export NEMOFLOW_ARRAY_INDEX="$SLURM_ARRAY_TASK_ID"' in script
    # resubmitting only the tasks that timed out
    req, script = render(spec, [2, 5])
    assert directives(script)["--array"] == "2,5%3"


def test_secret_values_never_in_script_but_env_is_quoted(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret123")
    spec = JobSpec(name="dl", command=["echo", "x"], env={"GREETING": "it's $HOME"}, secret_env=["HF_TOKEN"])
    _, script = render(spec)
    assert "hf_supersecret123" not in script
    assert "HF_TOKEN" not in script
    # single quotes survive and $HOME is not expanded at submit time
    assert "export GREETING='it'\"'\"'s $HOME'" in script


def test_container_job_runs_srun_with_pyxis_flags():
    spec = JobSpec(
        name="nemo",
        command=["python", "/opt/NeMo/train.py", "--cfg", "a b"],
        container_image="/shared/images/nemo-25.02.sqsh",
        mounts=[Mount(source="/shared/data", target="/data", read_only=True)],
        workdir="/workspace",
    )
    _, script = render(spec, container_mounts=["/shared/ckpt:/ckpt"])
    launch = script.strip().splitlines()[-1].removeprefix("exec ")
    assert launch.startswith("srun --kill-on-bad-exit=1 --container-image=/shared/images/nemo-25.02.sqsh ")
    assert "--container-mounts=/shared/data:/data:ro,/shared/ckpt:/ckpt" in launch
    assert "--container-workdir=/workspace" in launch
    assert launch.endswith("python /opt/NeMo/train.py --cfg 'a b'")
    # the host may not have the container's workdir
    assert "--chdir" not in directives(script)


def test_multi_node_uses_torchrun_rendezvous_on_first_node():
    spec = JobSpec(
        name="pretrain",
        command=["python", "-m", "workloads.train", "--steps", "10"],
        resources=Resources(nodes=4, gpus_per_node=8),
    )
    req, script = render(spec, preset="hcc-a3m", master_port=29555)
    assert req.launcher == "torchrun"
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"' in script
    assert "export MASTER_PORT=29555" in script
    launch = script.strip().splitlines()[-1].removeprefix("exec ")
    assert launch.startswith("srun --kill-on-bad-exit=1 --ntasks-per-node=1 --nodes=4 python -m torch.distributed.run")
    assert "--nnodes=$SLURM_NNODES --nproc-per-node=8" in launch
    assert "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" in launch
    assert launch.endswith("-m workloads.train --steps 10")
    # preset: partition and NCCL environment, overridable
    assert directives(script)["--partition"] == PRESETS["hcc-a3m"].partition
    assert "export NCCL_FASTRAK_CTRL_DEV=enp0s12" in script
    _, script = render(spec, preset="hcc-a3m", partition="mine", env={"NCCL_FASTRAK_CTRL_DEV": "eth9"})
    assert directives(script)["--partition"] == "mine" and "export NCCL_FASTRAK_CTRL_DEV=eth9" in script


def test_signal_is_forwarded_to_the_workload():
    spec = JobSpec(name="long", command=["python", "-m", "workloads.train"])
    _, script = render(spec, signal="B:USR1@120", setup_lines=["module load cuda/12.4", "source /venv/bin/activate"])
    assert directives(script)["--signal"] == "B:USR1@120"
    assert "trap _nemoflow_forward USR1" in script
    assert script.index("module load cuda/12.4") < script.index("python -m workloads.train")


def test_signal_forwarding_really_reaches_the_child(tmp_path):
    """Run the rendered script with bash (no Slurm needed): USR1 to the shell reaches the workload.

    The signal goes to the shell only once the workload says its handler is installed (a ready
    file), not after a fixed sleep: on a loaded machine python may not have started after 1 s."""
    import time

    marker, ready = tmp_path / "got-usr1", tmp_path / "ready"
    code = (
        "import signal,time,sys; "
        f"signal.signal(signal.SIGUSR1, lambda *a: (open('{marker}','w').close(), sys.exit(7))); "
        f"open('{ready}','w').close(); time.sleep(30)"
    )
    spec = JobSpec(name="sig", command=["python3", "-c", code])
    _, script = render(spec, signal="B:USR1@60")
    path = tmp_path / "job.sh"
    path.write_text(script)
    proc = subprocess.Popen(["bash", str(path)])
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, f"the job script ended ({proc.returncode}) before the workload was ready"
            assert time.monotonic() < deadline, "the workload never started"
            time.sleep(0.05)
        proc.send_signal(10)  # SIGUSR1, to the batch shell only (as sbatch --signal=B: sends it)
        assert proc.wait(timeout=20) == 7  # the workload's own exit code: it got the signal and handled it
        assert marker.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_options_name_the_value():
    with pytest.raises(ValidationError, match="unknown cluster preset 'hcc-zz'"):
        SlurmOptions(preset="hcc-zz")
    with pytest.raises(ValidationError, match="not MM, MM:SS"):
        SlurmOptions(time="forever")
    with pytest.raises(ValidationError):
        SlurmOptions(partiton="gpu")  # typo: extra fields are rejected


def test_every_preset_is_eight_gpus_with_nccl_env():
    assert set(PRESETS) == {"hcc-a3m", "hcc-a3u", "hcc-a4", "hcc-a3h"}
    for preset in PRESETS.values():
        assert preset.gpus_per_node == 8
        assert any(k.startswith("NCCL_") for k in preset.env)


def test_options_come_from_the_environment(monkeypatch):
    from pydantic import BaseModel

    from infra.executors import Executor, get_backend

    monkeypatch.setenv("NEMOFLOW_SLURM_PARTITION", "gpu")
    monkeypatch.setenv("NEMOFLOW_SLURM_SETUP_LINES", '["module load cuda/12.4"]')
    monkeypatch.setenv("NEMOFLOW_SLURM_MAX_RESUBMITS", "1")
    backend = get_backend({"kind": "slurm", "account": "proj"})
    assert backend.options.partition == "gpu" and backend.options.account == "proj"
    assert backend.options.setup_lines == ["module load cuda/12.4"] and backend.options.max_resubmits == 1
    # an explicit value beats the environment
    assert get_backend({"kind": "slurm", "partition": "cpu"}).options.partition == "cpu"

    # The same inside a flow config: a name alone takes every option from the environment.
    class Config(BaseModel):
        executor: Executor

    assert Config(executor="slurm").executor.partition == "gpu"
    assert Config.model_validate({"executor": {"kind": "slurm", "qos": "high"}}).executor.partition == "gpu"

"""``nemoflow demo --gpus``: the GPU demo on every usable GPU, or a one-line refusal before anything starts.

This machine has no NVIDIA GPU, so the refusal runs for real; the GPU choice is checked on views of real
machines (an H200 node, a GPU node with a CPU build of torch). The GPU demo itself ran on an H200
(devtools/gpu_node.sh; README "On a GPU machine").
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flows.end_to_end import EndToEndConfig, demo_gpu_config, demo_gpu_train_config
from infra import gpus
from nemoflow.commands import demo

H200 = gpus.LocalGpus(("NVIDIA H200",) * 2, "580.159.03", "13.0", "2.11.0+cu130", "13.0", 2)
CPU_TORCH = gpus.LocalGpus(("NVIDIA H200",), "580.159.03", "13.0", "2.13.0+cpu", None, 0)
NO_GPU = gpus.LocalGpus((), None, None, None, None, 0)


@pytest.mark.parametrize(
    ("machine", "choice", "expected"),
    [(H200, "auto", 2), (H200, "1", 1), (H200, "0", 0), (NO_GPU, "auto", 0), (NO_GPU, "0", 0), (CPU_TORCH, "0", 0)],
)
def test_the_demo_takes_the_gpus_it_can_use(monkeypatch, machine, choice, expected):
    monkeypatch.setattr(gpus, "probe", lambda: machine)
    assert demo.demo_gpus(choice, "local") == expected


@pytest.mark.parametrize(
    ("machine", "choice", "backend", "message"),
    [
        (H200, "4", "local", "the GPU demo (--gpus 4) asks for 4 GPUs but this machine has 2 usable"),
        (CPU_TORCH, "auto", "local", "torch 2.13.0+cpu is a CPU build and cannot use this machine's GPUs"),
        (H200, "two", "local", "--gpus 'two': give auto, 0 or a number of GPUs"),
        (H200, "2", "slurm", "--gpus 2 is for --backend local"),
    ],
)
def test_a_demo_that_cannot_have_its_gpus_is_refused(monkeypatch, machine, choice, backend, message):
    monkeypatch.setattr(gpus, "probe", lambda: machine)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        demo.demo_gpus(choice, backend)


def test_the_gpu_demo_configuration_is_valid_for_any_gpu_count():
    for n in (1, 2, 8):
        config = EndToEndConfig(**demo_gpu_config(n))
        assert config.train.gpus_per_node == n and config.train.global_batch_size == 16 * n
        assert config.train.total_steps * config.train.global_batch_size * config.train.seq_length <= 2_500_000
        assert config.serve.engine.resources.gpus_per_node == 1  # served on one GPU


@pytest.mark.parametrize("n", [1, 8])
def test_the_gpu_demo_trains_what_flows_end_to_end_defines_field_by_field(n):
    """The run's parameters (nemoflow demo's --params, as the flow receives them) make the flow train exactly
    demo_gpu_train_config. A partial `train` is merged over the CPU demo's model (EndToEndConfig), so a GPU value
    that equals the class default is not a value to leave out: at d1f5225 the GPU demo validated every 20 steps
    (the CPU demo's val_check_interval) instead of every 50, 8 validations instead of 4 (11.4 s on the H200)."""
    params = demo.demo_parameters("end-to-end/local", None, n)
    assert EndToEndConfig(**params["config"]).train.model_dump() == demo_gpu_train_config(n).model_dump()


def test_demo_with_gpus_on_a_machine_without_one_starts_nothing(tmp_path):
    """For real, on this GPU-less machine: one line, exit 2, no Prefect server started."""
    env = dict(os.environ, HOME=str(tmp_path), NEMOFLOW_HOME=str(tmp_path / "home"))
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "nemoflow.cli", "demo", "--gpus", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "asks for 1 GPU but this machine has no NVIDIA GPU" in lines[0], proc.stderr
    assert not (tmp_path / "home" / "prefect").exists()  # no server, no worker, no pid files

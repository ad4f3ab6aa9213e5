"""Resume on a GPU: a run killed after a background save resumes to the uninterrupted run's losses.

Runs only where torch sees a CUDA GPU (the H200 of devtools/gpu_node.sh; README "On a GPU machine" has
the result); on the CPU the same resume path is checked bit for bit (tests/train/test_trainer.py).
bf16 compute with fp32 master weights: the two runs may differ by the order of floating-point reductions
(atomics in some backward kernels), so losses are compared within bf16's tolerance, not bit for bit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from infra import failpoints
from tests.support import fault_ledger
from tests.train.helpers import REPO, read_metrics, run_trainer, tiny_config, trainer_env, write_config
from workloads import checkpoint as ckpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run it on a GPU machine)"),
    pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex"),
]


def _config(train_dataset, run_dir):
    return tiny_config(
        train_dataset,
        run_dir,
        hidden_size=512,
        num_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        ffn_hidden_size=1408,
        seq_length=512,
        global_batch_size=16,
        micro_batch_size=16,
        max_steps=40,
        warmup_steps=4,
        lr=1e-3,
        min_lr=1e-4,
        val_check_interval=10,
        limit_val_batches=2,
        ckpt_every_n_steps=10,
        gpus_per_node=1,
        precision="bf16-mixed",
    )


@pytest.mark.faults
def test_killed_on_the_gpu_resumes_to_the_uninterrupted_losses(tmp_path, train_dataset):
    row = fault_ledger.open_row("GPU training job SIGKILLed after a checkpoint")
    whole = tmp_path / "whole"
    done = run_trainer(write_config(_config(train_dataset, whole), tmp_path / "whole.json"), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    run_dir = tmp_path / "run"
    config_path = write_config(_config(train_dataset, run_dir), tmp_path / "run.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "workloads.train", "--config", str(config_path)],
        cwd=REPO,
        env=trainer_env(**failpoints.env(train__pause_after_step=25)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    published = f"saved checkpoint {ckpt.checkpoints_dir(run_dir) / ckpt.step_dir_name(20)} "
    try:
        deadline = time.monotonic() + 900
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(published) and any(x.startswith("step=25 ") for x in seen):
                break
            if line.startswith("step=25 ") and any(x.startswith(published) for x in seen):
                break
            assert time.monotonic() < deadline, "".join(seen[-50:])
        proc.send_signal(signal.SIGKILL)
        row.injected += proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-50:])
    assert ckpt.saved_checkpoints(run_dir)[-1].step == 20

    resumed = run_trainer(config_path, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at step 20 (consumed_samples=320)" in resumed.stdout
    mine = {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}
    theirs = {m["step"]: m["loss"] for m in read_metrics(whole) if "loss" in m}
    assert sorted(mine) == sorted(theirs) == list(range(1, 41))
    for step in range(21, 41):  # the resumed steps
        assert mine[step] == pytest.approx(theirs[step], rel=5e-3, abs=5e-3), (step, mine[step], theirs[step])
    val = {m["step"]: m["val_loss"] for m in read_metrics(run_dir) if "val_loss" in m}
    val_whole = {m["step"]: m["val_loss"] for m in read_metrics(whole) if "val_loss" in m}
    assert val[40] == pytest.approx(val_whole[40], rel=5e-3, abs=5e-3)
    print("resumed losses (step: resumed / uninterrupted):", {s: (mine[s], theirs[s]) for s in (21, 30, 40)})

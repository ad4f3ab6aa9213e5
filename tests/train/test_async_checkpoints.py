"""Checkpoints that do not stop training: background saves, the export after training, and their crashes.

Every save is AutoModel's asynchronous torch.distributed.checkpoint save (on CPU too: the same code path as
on GPUs, without pinned memory); the Hugging Face export is made by a separate process after training
(workloads/consolidate.py). These tests kill each piece at its worst moment and check that nothing partial
is ever taken for a checkpoint, and that a re-run resumes from the newest complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from infra import failpoints
from tests.support import fault_ledger
from tests.support.require import need
from tests.train.helpers import (
    REPO,
    checkpoints_now,
    deterministic_part,
    read_metrics,
    record_saves,
    run_trainer,
    tiny_config_file,
    trainer_env,
    write_config,
)
from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _step_dir(run_dir, step):
    return ckpt.checkpoints_dir(run_dir) / ckpt.step_dir_name(step)


def test_saves_are_asynchronous_and_the_loop_waits_only_for_the_copy(reference_run):
    """The reference run saved at steps 4, 8 and 12 in the background: each save is on record with the time
    the loop spent in it and, at the next optimizer step, the time it waited for the copy to host memory."""
    metrics = reference_run["metrics"]
    saves = [m for m in metrics if "checkpoint_save_s" in m]
    waits = [m for m in metrics if "checkpoint_wait_s" in m]
    assert [m["step"] for m in saves] == [4, 8, 12]
    # the saves of steps 4 and 8 are followed by training steps; the last one by the end of training
    assert [m["step"] for m in waits] == [4, 8]
    assert "saving synchronously" not in reference_run["stdout"]
    # Published (AutoModel's marker removed) while training went on, not at the end: the save of step 4 is
    # reported before step 12 is reached. (Before step 8 on a quiet machine; on a loaded one its background
    # write can outlast four steps of the tiny model, and the step-8 save then waits for it.)
    lines = reference_run["stdout"].splitlines()
    wanted = f"saved checkpoint {_step_dir(reference_run['run_dir'], 4)} "
    found = [i for i, line in enumerate(lines) if line.startswith(wanted)]
    assert found, "\n".join(line for line in lines if "checkpoint" in line)  # what was reported instead
    published = found[0]
    assert published < next(i for i, line in enumerate(lines) if line.startswith("step=12 loss="))


def test_each_save_writes_its_files_in_parallel_and_its_rate_is_on_record(reference_run):
    """ckpt_write_threads (default 4): every rank's weights and optimizer state go to 4 files each, written by
    as many threads at once (issue 34, item 1); each save's write time, size and rate are in metrics.jsonl."""
    step_dir = ckpt.saved_checkpoints(reference_run["run_dir"])[-1].step_dir
    assert len(list((step_dir / "model").glob("shard-00001-model-*-of-00004.safetensors"))) == 4
    assert len(list((step_dir / "optim").glob("__0_*.distcp"))) == 4
    writes = [m for m in reference_run["metrics"] if "checkpoint_write_gbps" in m]
    assert [m["step"] for m in writes] == [4, 8, 12]
    for m in writes:
        assert m["checkpoint_write_s"] > 0 and m["checkpoint_gb"] > 0
        assert m["checkpoint_write_gbps"] == pytest.approx(m["checkpoint_gb"] / m["checkpoint_write_s"])


def test_the_first_saves_staging_buffers_are_prepared_before_it(reference_run):
    """The host buffers the first save copies into were allocated in the background before it (issue 34, item 3):
    at least the weights and AdamW's two moments (fp32 on CPU), and the save allocated none of its own (the
    buffers it used, measured after its copy, are exactly the pre-staged ones)."""
    metrics = reference_run["metrics"]
    prestaged = [m for m in metrics if "checkpoint_prestage_gib" in m]
    used = [m for m in metrics if "checkpoint_staged_gib" in m]
    assert [m["step"] for m in prestaged] == [4] and [m["step"] for m in used] == [4]
    weights = sum(n for n in _weights_numel(ckpt.latest_checkpoint(reference_run["run_dir"]).path).values())
    assert prestaged[0]["checkpoint_prestage_gib"] * 2**30 >= 3 * 4 * weights
    assert used[0]["checkpoint_staged_gib"] == prestaged[0]["checkpoint_prestage_gib"]
    line = next(x for x in reference_run["stdout"].splitlines() if x.startswith("checkpoint staging buffers ready: "))
    assert "prepared in" in line and "in the background" in line


@pytest.mark.slow
@pytest.mark.faults
def test_killed_right_after_a_save_resumes_from_the_one_before(tmp_path, train_dataset, reference_run):
    """SIGKILL while the step-8 save is being written in the background: it is never published, and the re-run
    resumes from step 4 to the uninterrupted run's numbers."""
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
    row = fault_ledger.open_row("training job SIGKILLed during a background checkpoint write")
    crashed = run_trainer(config_path, **failpoints.env(train__crash_after_save_at_step=8))
    row.injected += crashed.returncode == -signal.SIGKILL
    record_saves(row, run_dir, crashed.stdout)  # what was saved before the kill
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout[-3000:] + crashed.stderr[-3000:]
    assert (_step_dir(run_dir, 8) / ckpt.INCOMPLETE).exists()  # whatever the writer finished: unpublished
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [4]

    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at step 4 (consumed_samples=32)" in resumed.stdout
    assert deterministic_part(read_metrics(run_dir)) == deterministic_part(reference_run["metrics"])
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [8, 12]


@pytest.mark.slow
@pytest.mark.faults
def test_killed_export_is_never_a_checkpoint_and_a_rerun_exports_it(tmp_path, reference_run):
    """The export process dies after writing the weights, before its manifest: the trainer fails with one line,
    no export is listed, and running the trainer again (nothing left to train) makes the export."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run["run_dir"], run_dir, symlinks=True)
    config = {**reference_run["config"], "run_dir": str(run_dir)}
    config_path = write_config(config, tmp_path / "config.json")
    for info in ckpt.list_checkpoints(run_dir):  # as if the run had just finished training: no export yet
        shutil.rmtree(info.path)
    assert ckpt.list_checkpoints(run_dir) == [] and [c.step for c in ckpt.saved_checkpoints(run_dir)] == [8, 12]

    row = fault_ledger.open_row("export process SIGKILLed before its manifest")
    before = checkpoints_now(run_dir)
    killed = run_trainer(config_path, **failpoints.env(consolidate__crash_before_manifest=True))
    row.injected += f"(exit -{int(signal.SIGKILL)})" in killed.stderr  # the trainer saw its export killed
    row.compare(before, checkpoints_now(run_dir))
    assert killed.returncode == 1, killed.stdout[-3000:] + killed.stderr[-3000:]
    last = killed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the export of ") and "the saved checkpoints are intact" in last, last
    half = ckpt.consolidated_dir(_step_dir(run_dir, 12))
    assert list(half.glob("*.safetensors")) and not (half / ckpt.MANIFEST).exists()  # weights, no manifest
    assert ckpt.list_checkpoints(run_dir) == []

    again = run_trainer(config_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [c.step for c in ckpt.list_checkpoints(run_dir)] == [12]
    exported = ckpt.latest_checkpoint(run_dir)
    assert ckpt.verify_manifest(exported.path) == []
    reference = ckpt.latest_checkpoint(reference_run["run_dir"])
    assert _weights(exported.path) == _weights(reference.path)  # the same tensors as the uninterrupted export


@pytest.mark.slow
@pytest.mark.faults
def test_export_killed_from_outside_leaves_no_checkpoint(tmp_path, reference_run):
    """``python -m workloads.consolidate`` run by hand on a step directory and SIGKILLed once its weights are
    written: no manifest, so no checkpoint; the next run makes it whole."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run["run_dir"], run_dir, symlinks=True)
    step_dir = _step_dir(run_dir, 8)
    row = fault_ledger.open_row("export process SIGKILLed mid-way (run by hand)")
    before = checkpoints_now(run_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workloads.consolidate", str(step_dir)],
        cwd=REPO,
        env={**_env(), **failpoints.env(consolidate__pause_before_manifest=True)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    weights = ckpt.consolidated_dir(step_dir) / "model.safetensors.index.json"  # written after the weights
    try:
        deadline = time.monotonic() + 120
        while not weights.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the export never wrote its weights"
            time.sleep(0.1)
    finally:
        proc.kill()
    proc.wait()
    row.injected += proc.returncode == -signal.SIGKILL and weights.exists()  # killed after writing its weights
    row.compare(before, checkpoints_now(run_dir))
    assert proc.returncode == -signal.SIGKILL
    assert not (ckpt.consolidated_dir(step_dir) / ckpt.MANIFEST).exists()
    assert [c.step for c in ckpt.list_checkpoints(run_dir)] == [12]

    done = _export(step_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"exported {ckpt.consolidated_dir(step_dir)}" in done.stdout
    assert [c.step for c in ckpt.list_checkpoints(run_dir)] == [8, 12]
    meta = json.loads((ckpt.consolidated_dir(step_dir) / ckpt.META).read_text())
    assert meta["step"] == 8 and (ckpt.consolidated_dir(step_dir) / ckpt.TOKENIZER).exists()


def test_export_refuses_what_is_not_a_saved_checkpoint(tmp_path, reference_run):
    half = tmp_path / "checkpoints" / "epoch_0_step_3"
    half.mkdir(parents=True)
    (half / ckpt.INCOMPLETE).touch()
    for target, message in (
        (half, "was never published"),
        (tmp_path / "nowhere", "is not an AutoModel checkpoint directory"),
    ):
        proc = _export(target)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.faults
def test_too_little_shared_memory_saves_synchronously(tmp_path, train_dataset, reference_run):
    """A node whose /dev/shm cannot hold the staging copy (a container's default 64 MiB, here 1 MiB): one
    warning line, synchronous saves, the same numbers; never a bus error."""
    need(
        shutil.which("unshare") and os.geteuid() == 0,
        "unshare and root (a private /dev/shm mount)",
        "util-linux, as root",
    )
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
    trainer = f"{sys.executable} -m workloads.train --config {config_path}"
    row = fault_ledger.open_row("/dev/shm too small for checkpoint staging (1 MiB tmpfs)")
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {trainer}",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warning = next((line for line in proc.stdout.splitlines() if "saving synchronously" in line), None)
    row.injected += warning is not None and "but 0.0 GiB is available" in warning  # it saw the 1 MiB /dev/shm
    record_saves(row, run_dir, proc.stdout)
    assert warning and warning.startswith("warning: asynchronous checkpoints need "), proc.stdout[-3000:]
    metrics = read_metrics(run_dir)
    assert not [m for m in metrics if "checkpoint_wait_s" in m]  # synchronous: nothing left to wait for
    assert deterministic_part(metrics) == deterministic_part(reference_run["metrics"])


def _export(target) -> subprocess.CompletedProcess:
    """``python -m workloads.consolidate TARGET``, as a user runs it by hand."""
    return subprocess.run(
        [sys.executable, "-m", "workloads.consolidate", str(target)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
    )


def _env() -> dict:

    return trainer_env()


def _weights(path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for file in sorted(path.glob("*.safetensors")):
        found.update({k: v.sum().item() for k, v in load_file(str(file)).items()})
    return found


def _weights_numel(path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for file in sorted(path.glob("*.safetensors")):
        found.update({k: v.numel() for k, v in load_file(str(file)).items()})
    return found

"""A failed background save does not end the run (issue 34, item 2).

The writer is failed for real, inside torch.distributed.checkpoint's background writer process: an I/O error
after part of a file is written (a failpoint in the writer), the writer process SIGKILLed half-way through a
save, a full disk (a real tmpfs). Each time the run must go on, report the failure (a log line, a record in
metrics.jsonl, the stage's artifact), keep the previous checkpoint as the newest, stop only after
``ckpt_max_failed_saves`` failures in a row (saying so), and a resumed run must never pick the failed save.
"""

from __future__ import annotations

import re
import signal

import pytest

from infra import failpoints
from tests.support import fault_ledger
from tests.support.tmpfs import is_full, resize, tmpfs
from tests.train.helpers import (
    checkpoints_now,
    deterministic_part,
    read_metrics,
    record_saves,
    run_trainer,
    tiny_config_file,
)
from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")

WARNING = re.compile(r"^warning: the checkpoint of step (\d+) was not saved: (.*); training continues, the newest ")


def _failures(stdout: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for line in stdout.splitlines() if (m := WARNING.match(line))]


def _losses(metrics: list[dict]) -> list[dict]:
    """The deterministic records, without the failed saves' own records (the reference run had none)."""
    return deterministic_part([m for m in metrics if "checkpoint_failed" not in m])


def _training(metrics: list[dict]) -> list[dict]:
    """The optimizer steps' records (loss, lr, grad norm, samples), without wall-clock fields: a run that
    checkpoints (and so validates) more often than the reference run trains the same steps."""
    return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in metrics if "loss" in m]


def _trained_steps(metrics: list[dict]) -> list[int]:
    return [m["step"] for m in metrics if "loss" in m]


@pytest.mark.slow
@pytest.mark.faults
def test_a_failed_write_is_reported_and_training_continues(tmp_path, train_dataset, reference_run):
    """The writer process fails the step-8 save with an I/O error after part of a file: the run reports it, goes
    on to step 12, saves it, ends with exit 0 and the uninterrupted run's numbers; the failed save is gone."""
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
    row = fault_ledger.open_row("checkpoint writer I/O error during a background save (failpoint)")
    proc = run_trainer(config_path, **failpoints.env(train__fail_checkpoint_write_at_step=8))
    failures = _failures(proc.stdout)
    row.injected += len(failures)  # each failure the writer process raised and the trainer reported
    record_saves(row, run_dir, proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [step for step, _ in failures] == [8], proc.stdout[-3000:]
    assert "OSError: [Errno 5] Input/output error (simulated by a failpoint)" in failures[0][1]
    line = next(line for line in proc.stdout.splitlines() if WARNING.match(line))
    assert f"the newest checkpoint is still step 4 ({ckpt.checkpoints_dir(run_dir) / 'epoch_0_step_3'})" in line
    metrics = read_metrics(run_dir)
    records = [m for m in metrics if "checkpoint_failed" in m]
    assert [(m["step"], m["checkpoint_failed_in_row"]) for m in records] == [(8, 1)]
    assert _trained_steps(metrics) == list(range(1, 13))  # it trained on after the failure
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [4, 12]
    assert not ckpt.checkpoints_dir(run_dir).joinpath("epoch_0_step_7").exists()  # the failed save is removed
    assert _losses(metrics) == deterministic_part(reference_run["metrics"])
    # the stage's artifact names the failed save
    from tasks.train_engines.automodel import loss_curve_markdown

    markdown = loss_curve_markdown(metrics, None, str(run_dir))
    assert "checkpoints: 1 failed save (step 8: " in markdown and "[Errno 5]" in markdown, markdown


@pytest.mark.slow
@pytest.mark.faults
def test_failures_in_a_row_stop_the_run_and_a_rerun_resumes_from_the_last_good_save(
    tmp_path, train_dataset, reference_run
):
    """Every save from step 6 on fails (a storage that stays broken), ckpt_max_failed_saves=2: the saves of steps
    6 and 8 fail, the run stops at step 8 with one line saying why; the re-run resumes from step 4 (never from a
    failed save) and ends with the uninterrupted run's numbers."""
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(
        train_dataset, run_dir, tmp_path / "config.json", ckpt_every_n_steps=2, ckpt_max_failed_saves=2, save_top_k=-1
    )
    row = fault_ledger.open_row("checkpoint writer failing every save from step 6 on (failpoint)")
    proc = run_trainer(config_path, **failpoints.env(train__fail_checkpoint_write_at_step="6+"))
    failures = _failures(proc.stdout)
    row.injected += len(failures)
    record_saves(row, run_dir, proc.stdout)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [step for step, _ in failures] == [6, 8], proc.stdout[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 checkpoint saves in a row failed (the last, of step 8: "), last
    assert "stopping: the newest complete checkpoint is kept" in last
    metrics = read_metrics(run_dir)
    assert max(_trained_steps(metrics)) < 12  # stopped before the end
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [2, 4]

    resumed = run_trainer(config_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at step 4 (consumed_samples=32)" in resumed.stdout
    # validation runs at every save, so at steps the reference run did not validate: the training steps compare
    assert _training(read_metrics(run_dir)) == _training(reference_run["metrics"])


@pytest.mark.slow
@pytest.mark.faults
def test_a_killed_writer_process_is_replaced_and_training_continues(tmp_path, train_dataset, reference_run):
    """The background writer process SIGKILLs itself half-way through the step-8 save: the trainer reports it,
    starts a new writer, saves step 12 through it and ends with exit 0 and the uninterrupted run's numbers."""
    run_dir = tmp_path / "run"
    config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
    row = fault_ledger.open_row("checkpoint writer process SIGKILLed during a background save")
    proc = run_trainer(config_path, **failpoints.env(train__kill_checkpoint_writer_at_step=8))
    failures = _failures(proc.stdout)
    row.injected += sum("writer process died" in reason for _, reason in failures)
    record_saves(row, run_dir, proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [step for step, _ in failures] == [8], proc.stdout[-3000:]
    assert "Checkpoint background process is dead" in failures[0][1]
    assert (
        f"the checkpoint writer process died with exit code -{int(signal.SIGKILL)}; a new one is started"
        in (failures[0][1])
    )
    assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [4, 12]  # step 12 written by the new writer
    assert checkpoints_now(run_dir) == {4: "intact", 12: "intact"}
    assert _losses(read_metrics(run_dir)) == deterministic_part(reference_run["metrics"])


def _size(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.faults
def test_a_full_disk_fails_a_save_training_continues_then_the_last_save_stops_the_run(
    tmp_path, train_dataset, reference_run
):
    """A real tmpfs with room for one checkpoint: the step-8 save fails with ENOSPC and training goes on to step 12;
    the last save fails too and ends the run with the no-space line (its state is not on disk); with more space
    the re-run resumes from step 4, never from a failed save, to the uninterrupted run's numbers."""
    reference = reference_run["run_dir"]
    one_checkpoint = max(
        _size(c.step_dir) - (_size(c.consolidated) if c.consolidated.exists() else 0)
        for c in ckpt.saved_checkpoints(reference)
    )
    room = _size(reference) - _size(ckpt.checkpoints_dir(reference)) + int(one_checkpoint * 1.5)
    row = fault_ledger.open_row("disk full (tmpfs) during a background save: training continues")
    with tmpfs(tmp_path / "disk", f"size={room}") as disk:
        run_dir = disk / "run"
        config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json", save_top_k=1)
        proc = run_trainer(config_path, timeout=900)
        failures = _failures(proc.stdout)
        row.injected += sum("no space left" in reason.lower() for _, reason in failures)
        record_saves(row, run_dir, proc.stdout)
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert [step for step, _ in failures] == [8, 12], proc.stdout[-3000:]
        # ENOSPC from the safetensors write, or torch.save's "unexpected pos" on a full disk (no errno), named so
        assert all("no space left" in reason.lower() for _, reason in failures), failures
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: no space left on the device holding the run directory"), last
        metrics = read_metrics(run_dir)
        assert _trained_steps(metrics) == list(range(1, 13))  # trained on after the step-8 failure
        assert [c.step for c in ckpt.saved_checkpoints(run_dir)] == [4]
        assert not is_full(disk)  # the failed saves were removed: their space is back

        resize(disk, str(room * 4))
        resumed = run_trainer(config_path, timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert "at step 4 (consumed_samples=32)" in resumed.stdout
        assert _losses(read_metrics(run_dir)) == deterministic_part(reference_run["metrics"])

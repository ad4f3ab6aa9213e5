"""Disk full during a checkpoint save: a real tmpfs holding the run directory runs out of space at a save.

The job must fail (not hang), name the cause, leave no checkpoint under a final name that is not complete
(MANIFEST.json written last), and a re-run with more space must resume from the last complete checkpoint
and end with the uninterrupted run's numbers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support import fault_ledger
from tests.support.tmpfs import is_full, resize, tmpfs
from tests.train.helpers import deterministic_part, read_metrics, record_saves, run_trainer, tiny_config_file
from workloads import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:.*Transformer Engine and Apex")


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.faults
def test_disk_full_in_a_save_fails_cleanly_and_a_rerun_resumes(tmp_path, train_dataset, reference_run):
    reference = Path(reference_run["run_dir"])
    # one saved checkpoint (a step directory without its Hugging Face export, which only comes after training)
    one_checkpoint = max(
        _size(c.step_dir) - (_size(c.consolidated) if c.consolidated.exists() else 0)
        for c in ckpt.saved_checkpoints(reference)
    )
    everything_but_checkpoints = _size(reference) - _size(ckpt.checkpoints_dir(reference))
    # room for the run's own files and the step-4 checkpoint, not for a second one
    room = everything_but_checkpoints + int(one_checkpoint * 1.5)
    row = fault_ledger.open_row("disk full (tmpfs) during a checkpoint save")
    with tmpfs(tmp_path / "disk", f"size={room}") as disk:
        run_dir = disk / "run"
        config_path = tiny_config_file(train_dataset, run_dir, tmp_path / "config.json")
        full = run_trainer(config_path, timeout=900)
        row.injected += is_full(disk)  # the save filled the tmpfs: ENOSPC for real
        record_saves(row, run_dir, full.stdout)  # checkpoints saved before the fault
        assert full.returncode != 0, full.stdout[-2000:]
        last = (full.stdout + full.stderr).strip().splitlines()[-1]
        assert last.startswith("error: no space left on the device holding the run directory"), last
        saved = [c.step for c in ckpt.saved_checkpoints(run_dir)]
        assert saved == [4], saved  # the step-8 save never became a checkpoint
        assert ckpt.list_checkpoints(run_dir) == []  # and nothing was exported from a failed run

        resize(disk, str(room * 4))  # more space: the operator's fix
        resumed = run_trainer(config_path, timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
        assert "at step 4 (consumed_samples=32)" in resumed.stdout
        assert deterministic_part(read_metrics(run_dir)) == deterministic_part(reference_run["metrics"])
        for info in ckpt.list_checkpoints(run_dir):
            assert ckpt.verify_manifest(info.path) == []
        shutil.rmtree(run_dir)

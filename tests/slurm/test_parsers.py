"""Parsers and the state table, on output captured from the real local Slurm 22.05 (tests/slurm/data)."""

from __future__ import annotations

import doctest

import pytest

from infra.jobs import JobState
from infra.slurm import options, parsers, states
from infra.slurm.parsers import JobId
from infra.slurm.states import SlurmState
from infra.slurm.watcher import merge_rows

from .conftest import DATA


@pytest.mark.parametrize("module", [parsers, states, options])
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_job_id_from_parsable_output():
    assert parsers.parse_job_id("4242;nemoflow\n") == "4242"
    # sbatch may warn before printing the id
    assert parsers.parse_job_id("sbatch: warning: x\n17\n") == "17"
    with pytest.raises(ValueError, match="not a job id"):
        parsers.parse_job_id("sbatch: error: Batch job submission failed")


def test_sacct_captured_mixed_states():
    rows = {
        str(r.job_id.base) + (f"_{r.job_id.task}" if r.job_id.task is not None else ""): r
        for r in parsers.parse_sacct((DATA / "sacct-running.txt").read_text())
    }
    assert rows["12"].state is SlurmState.COMPLETED and rows["12"].exit_code == 0
    assert rows["13"].state.job_state is JobState.FAILED and rows["13"].exit_code == 3
    assert rows["14"].state is SlurmState.CANCELLED and rows["14"].raw_state == "CANCELLED by 0"
    assert rows["17"].nodes is None  # "None assigned"
    assert rows["16_0"].state.job_state is JobState.RUNNING
    pending = [r for r in parsers.parse_sacct((DATA / "sacct-running.txt").read_text()) if r.job_id.pending_tasks]
    assert pending and pending[0].job_id == JobId("16", None, "1-3%1")


def test_sacct_captured_final_states():
    rows = parsers.parse_sacct((DATA / "sacct-final.txt").read_text())
    by_state = {r.state for r in rows}
    assert SlurmState.TIMEOUT in by_state
    timeout = next(r for r in rows if r.state is SlurmState.TIMEOUT)
    assert timeout.state.job_state.is_resumable
    killed = merge_rows("18", [r for r in rows if r.job_id.base == "18"])
    assert killed.state is JobState.FAILED and "killed by signal 9" in killed.reason
    array = [r for r in rows if r.job_id.base == "16"]
    assert sorted(r.job_id.task for r in array) == [0, 1, 2, 3]
    assert merge_rows("16", array, {0, 1, 2, 3}).state is JobState.COMPLETED


def test_squeue_array_pending_and_reason_with_commas():
    rows = parsers.parse_squeue((DATA / "squeue-array-pending.txt").read_text())
    gpu = next(r for r in rows if r.job_id.base == "18")
    assert gpu.state is SlurmState.PENDING and "DOWN, DRAINED" in gpu.reason
    assert any(r.job_id.pending_tasks == "1-3%1" for r in rows)
    expanded = parsers.parse_squeue((DATA / "squeue-live.txt").read_text())
    assert {r.job_id.task for r in expanded if r.job_id.base == "16"} == {0, 1, 2, 3}


def test_scontrol_records():
    rows = parsers.parse_scontrol_jobs((DATA / "scontrol-array.txt").read_text())
    assert {r.job_id.base for r in rows} == {"16"}
    running = next(r for r in rows if r.job_id.task == 0)
    assert running.state is SlurmState.RUNNING
    failed = parsers.parse_scontrol_jobs((DATA / "scontrol-exit3.txt").read_text())[0]
    assert (failed.state, failed.exit_code, failed.reason) == (SlurmState.FAILED, 3, "NonZeroExitCode")


def test_sinfo_partitions():
    parts = parsers.parse_sinfo((DATA / "sinfo.txt").read_text())
    assert list(parts) == ["cpu", "gpu"]
    assert parts["cpu"].default and not parts["gpu"].default
    assert parts["gpu"].gpus_per_node == 4 and parts["cpu"].cpus_per_node == 2
    assert parts["gpu"].max_time_s == 2 * 3600
    # two node groups in one partition merge into the largest node
    merged = parsers.parse_sinfo(
        "big|up|infinite|2|64|512000|gpu:h100:8(S:0-1)|idle\nbig|up|infinite|3|32|256000|(null)|mixed\n"
    )
    assert merged["big"].nodes == 5 and merged["big"].gpus_per_node == 8 and merged["big"].max_time_s is None


def test_every_slurm_state_maps_and_unknown_words_are_unknown():
    assert SlurmState.parse("REQUEUED").job_state is JobState.PENDING
    assert SlurmState.parse("COMPLETING").job_state is JobState.RUNNING  # exit code not final yet
    assert SlurmState.parse("PREEMPTED").job_state.is_resumable
    assert SlurmState.parse("OUT_OF_MEMORY").job_state is JobState.OUT_OF_MEMORY
    assert SlurmState.parse("NEW_STATE_FROM_2030") is SlurmState.UNKNOWN


def test_merge_array_lagging_rows_are_not_completed():
    rows = parsers.parse_sacct("5_0|6|COMPLETED|0:0|None|vm\n5_2|5|COMPLETED|0:0|None|vm\n")
    # task 1 has no row yet: the array is not done
    assert merge_rows("5", rows, {0, 1, 2}).state is JobState.UNKNOWN
    failed = parsers.parse_sacct("5_0|6|COMPLETED|0:0|None|vm\n5_1|7|TIMEOUT|0:15|None|vm\n5_2|5|FAILED|2:0|None|vm\n")
    status = merge_rows("5", failed, {0, 1, 2})
    # a real failure outranks a resumable one: resubmitting would not fix task 2
    assert status.state is JobState.FAILED and status.exit_code == 2 and "array task 2" in status.reason

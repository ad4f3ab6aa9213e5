"""The phase timer a job runs (infra/phases.py) and the run's accounting from its stages' records
(tasks/gpu_time.py). The whole path, a real end-to-end run's artifact, is checked in tests/e2e/test_end_to_end.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from infra import phases
from infra.jobs import Resources
from tasks import gpu_time

CHILD = textwrap.dedent(
    """
    import time
    time.sleep(0.4)                      # before the timer exists: still the process's start
    from infra import phases
    phases.switch(phases.DATA)
    time.sleep(0.3)
    with phases.within(phases.VALIDATION):
        time.sleep(0.2)
    time.sleep(0.1)                      # data loading again, after the inner phase
    phases.switch(phases.STEPS)
    time.sleep(0.25)
    phases.write()
    """
)


def _child(tmp_path, **env) -> tuple[float, float, dict | None]:
    path = tmp_path / "phases" / "job.json"
    before = time.time()
    subprocess.run(
        [sys.executable, "-c", CHILD],
        check=True,
        env={**os.environ, phases.PHASES_FILE_ENV: str(path), **env},
        cwd=os.path.dirname(os.path.dirname(phases.__file__)),
    )
    return before, time.time(), phases.read(str(path))


def test_a_process_phases_cover_it_from_its_start_without_a_gap(tmp_path):
    before, after, seen = _child(tmp_path)
    assert seen is not None
    # The first phase began when the process started (before the sleep and the import), not at the import.
    assert before - 0.05 <= seen["process_start_unix"] <= before + 0.3, (before, seen)
    assert seen["end_unix"] <= after + 0.05
    seconds = seen["seconds"]
    assert list(seconds) == [phases.START, phases.DATA, phases.VALIDATION, phases.STEPS]
    assert seconds[phases.START] >= 0.4
    assert 0.4 <= seconds[phases.DATA] < 0.4 + 0.6  # 0.3 + 0.1: the outer phase resumed after the inner one
    assert 0.2 <= seconds[phases.VALIDATION] < 0.2 + 0.6
    assert 0.25 <= seconds[phases.STEPS] < 0.25 + 0.6
    # contiguous: the phases add up to the process's time from its start to the last boundary
    assert sum(seconds.values()) == pytest.approx(seen["end_unix"] - seen["process_start_unix"], abs=0.02)


def test_only_rank_zero_writes_and_no_file_means_no_phases(tmp_path):
    assert _child(tmp_path, RANK="1")[2] is None
    assert phases.read(str(tmp_path / "nothing.json")) is None


def test_a_stopped_timer_counts_nothing_more():
    timer = phases.Timer(age_s=0.0)
    timer.switch(phases.BUILD)
    time.sleep(0.05)
    timer.stop()
    frozen = timer.report()
    time.sleep(0.05)
    timer.switch(phases.GENERATION)
    assert timer.report() == frozen
    assert frozen["seconds"][phases.BUILD] >= 0.05


def _record(stage, seconds, held_by, **phase_s):
    return {"stage": stage, "seconds": seconds, "held_by": held_by, "phases": phase_s}


def test_accounting_holds_gpu_seconds_and_goodput_is_the_steps_share():
    records = [
        _record("pretrain", 100.0, {"gpus": 2, "cpus": 8}, **{phases.LAUNCH: 5.0, phases.STEPS: 60.0, "other": 35.0}),
        _record("tokenize", 40.0, {"gpus": 0, "cpus": 16}, **{phases.UNITEMISED: 40.0}),
        _record("smoke-test", 10.0, None, **{phases.GENERATION: 10.0}),
    ]
    serving = Resources(gpus_per_node=1, cpus_per_task=2)
    accounting = gpu_time.account(records, serving)
    assert accounting["unit"] == "GPU" and accounting["column"] == "GPU-s"
    # held = GPUs x seconds per stage: a stage without GPUs holds none; the smoke test holds the server's one
    held = 100.0 * 2 + 40.0 * 0 + 10.0 * 1
    assert accounting["held"] == held
    assert accounting["goodput"] == round(60.0 * 2 / held, 4)
    totals = [row for row in accounting["rows"] if row["phase"] == "all"]
    assert [(row["stage"], row["GPU-s"], row["accelerators"]) for row in totals] == [
        ("pretrain", 200.0, 2),
        ("tokenize", 0.0, 0),
        ("smoke-test", 10.0, 1),
    ]
    # phases are listed in the pipeline's order, launch first
    assert [r["phase"] for r in accounting["rows"][:3]] == [phases.LAUNCH, phases.STEPS, "other"]
    text = gpu_time.markdown(accounting, "end-to-end")
    assert f"goodput {accounting['goodput'] * 100:.1f} %" in text and "| **pretrain** |" in text


def test_a_run_without_gpus_is_accounted_in_cpu_seconds():
    records = [_record("pretrain", 30.0, {"gpus": 0, "cpus": 2}, **{phases.STEPS: 12.0, phases.START: 18.0})]
    accounting = gpu_time.account(records)
    assert accounting["unit"] == "CPU" and accounting["held"] == 60.0 and accounting["goodput"] == 0.4
    assert "CPU-s" in accounting["rows"][0] and "CPU cores x seconds" in gpu_time.markdown(accounting, "x")
    empty = gpu_time.account([])
    assert empty["held"] == 0 and empty["goodput"] is None
    assert "nothing was held" in gpu_time.markdown(empty, "x")


def test_a_stage_itemises_around_the_job_and_refuses_an_older_process():
    clock = gpu_time.StageClock(Resources(cpus_per_task=2))
    time.sleep(0.05)
    clock.stop()
    start = clock.started_unix + 0.01
    clock.job = {"process_start_unix": start, "end_unix": start + 0.03, "seconds": {phases.STEPS: 0.03}}
    seen = clock.itemised()
    assert seen[phases.LAUNCH] == pytest.approx(0.01, abs=1e-4) and seen[phases.STEPS] == 0.03
    assert sum(seen.values()) == pytest.approx(clock.seconds, abs=1e-4)
    # a server that was already running when the stage began: its phases are not this stage's
    clock.job = {**clock.job, "process_start_unix": clock.started_unix - 60}
    assert clock.itemised() == {phases.UNITEMISED: clock.seconds}


def test_the_phases_file_format_is_json_the_stage_reads(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"nope": 1}))
    assert phases.read(str(path)) is None  # not a phases file
    path.write_text("{half")
    assert phases.read(str(path)) is None

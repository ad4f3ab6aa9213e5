"""Slurm job states as data, and what each means for :class:`infra.jobs.JobState`.

The table is the only place Slurm's state names are interpreted; everything
else compares enum members.
"""

from __future__ import annotations

import enum

from infra.jobs import JobState


class SlurmState(str, enum.Enum):
    PENDING = "PENDING"
    CONFIGURING = "CONFIGURING"
    REQUEUED = "REQUEUED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    REQUEUE_FED = "REQUEUE_FED"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    RUNNING = "RUNNING"
    COMPLETING = "COMPLETING"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    RESIZING = "RESIZING"
    SIGNALING = "SIGNALING"
    STAGE_OUT = "STAGE_OUT"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    BOOT_FAIL = "BOOT_FAIL"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    TIMEOUT = "TIMEOUT"
    DEADLINE = "DEADLINE"
    CANCELLED = "CANCELLED"
    REVOKED = "REVOKED"
    NODE_FAIL = "NODE_FAIL"
    PREEMPTED = "PREEMPTED"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, text: str) -> SlurmState:
        """``CANCELLED by 0`` -> CANCELLED; ``CANCELLED+`` (squeue's truncation) too; unknown -> UNKNOWN.

        >>> SlurmState.parse("CANCELLED by 1000")
        <SlurmState.CANCELLED: 'CANCELLED'>
        """
        word = text.strip().split(" ", 1)[0].rstrip("+").upper()
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    @property
    def job_state(self) -> JobState:
        return _TO_JOB_STATE[self]


_TO_JOB_STATE = {
    # Requeued jobs go back to the queue and run again under the same id.
    SlurmState.PENDING: JobState.PENDING,
    SlurmState.CONFIGURING: JobState.PENDING,
    SlurmState.REQUEUED: JobState.PENDING,
    SlurmState.REQUEUE_HOLD: JobState.PENDING,
    SlurmState.REQUEUE_FED: JobState.PENDING,
    SlurmState.RESV_DEL_HOLD: JobState.PENDING,
    SlurmState.RUNNING: JobState.RUNNING,
    # COMPLETING: processes are being cleaned up; the exit code is not final yet.
    SlurmState.COMPLETING: JobState.RUNNING,
    SlurmState.SUSPENDED: JobState.RUNNING,
    SlurmState.STOPPED: JobState.RUNNING,
    SlurmState.RESIZING: JobState.RUNNING,
    SlurmState.SIGNALING: JobState.RUNNING,
    SlurmState.STAGE_OUT: JobState.RUNNING,
    SlurmState.COMPLETED: JobState.COMPLETED,
    SlurmState.FAILED: JobState.FAILED,
    SlurmState.BOOT_FAIL: JobState.NODE_FAIL,
    SlurmState.SPECIAL_EXIT: JobState.FAILED,
    SlurmState.TIMEOUT: JobState.TIMEOUT,
    SlurmState.DEADLINE: JobState.TIMEOUT,
    SlurmState.CANCELLED: JobState.CANCELLED,
    SlurmState.REVOKED: JobState.CANCELLED,
    SlurmState.NODE_FAIL: JobState.NODE_FAIL,
    SlurmState.PREEMPTED: JobState.PREEMPTED,
    SlurmState.OUT_OF_MEMORY: JobState.OUT_OF_MEMORY,
    SlurmState.UNKNOWN: JobState.UNKNOWN,
}
assert set(_TO_JOB_STATE) == set(SlurmState), "every Slurm state needs a JobState"

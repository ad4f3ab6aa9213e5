"""One poller for every Slurm job this process waits on.

Many stages (and array tasks) wait at once; asking ``sacct`` once per job per
interval would hammer slurmdbd on a busy cluster. :class:`SlurmWatcher` (the
model is submitit's ``SlurmInfoWatcher``) asks ``sacct`` ONCE per interval
for all registered jobs, caches finished jobs, and falls back to ``squeue``
and ``scontrol`` when sacct lags (no row yet right after submit or after the
end, or slurmdbd unreachable): a job is never reported failed because
accounting has not caught up.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from infra.jobs import JobState
from infra.slurm.commands import SlurmCLI, SlurmCommandError, SlurmUnavailable
from infra.slurm.parsers import JobRow


@dataclasses.dataclass
class JobStatus:
    """A job's (or a whole array's) state, merged over its tasks."""

    job_id: str
    state: JobState
    exit_code: int | None = None
    reason: str | None = None
    restarts: int = 0
    tasks: dict[int, JobRow] = dataclasses.field(default_factory=dict)
    source: str = "none"

    @property
    def failed_tasks(self) -> dict[int, JobRow]:
        return {i: r for i, r in self.tasks.items() if r.state.job_state not in (JobState.COMPLETED,)}


# When tasks end differently, the array's state is the most actionable one.
_PRIORITY = [
    JobState.FAILED,
    JobState.OUT_OF_MEMORY,
    JobState.CANCELLED,
    JobState.NODE_FAIL,
    JobState.PREEMPTED,
    JobState.TIMEOUT,
    JobState.COMPLETED,
]


def merge_rows(job_id: str, rows: list[JobRow], expected_tasks: set[int] | None = None) -> JobStatus:
    """Fold the rows of one job (or its array tasks) into one :class:`JobStatus`.

    Any live row (pending tasks, a running task) keeps the whole job live. An
    array whose finished rows miss some of ``expected_tasks`` is UNKNOWN (the
    source lags), never COMPLETED.
    """
    if not rows:
        return JobStatus(job_id, JobState.UNKNOWN)
    tasks = {r.job_id.task: r for r in rows if r.job_id.task is not None}
    states = [r.state.job_state for r in rows]
    restarts = max(r.restarts for r in rows)
    source = rows[0].source
    if JobState.RUNNING in states:
        return JobStatus(job_id, JobState.RUNNING, restarts=restarts, tasks=tasks, source=source)
    if JobState.PENDING in states or JobState.UNKNOWN in states:
        pending = next(r for r in rows if r.state.job_state in (JobState.PENDING, JobState.UNKNOWN))
        return JobStatus(job_id, JobState.PENDING, reason=pending.reason, restarts=restarts, tasks=tasks, source=source)
    if expected_tasks and not expected_tasks <= set(tasks):
        return JobStatus(job_id, JobState.UNKNOWN, restarts=restarts, tasks=tasks, source=source)
    for state in _PRIORITY:
        for row in rows:
            if row.state.job_state is state:
                reason = row.reason
                if row.job_id.task is not None and state is not JobState.COMPLETED:
                    reason = f"array task {row.job_id.task}: {row.raw_state}" + (f" ({reason})" if reason else "")
                exit_code = row.exit_code
                if row.signal:
                    reason = (reason + "; " if reason else "") + f"killed by signal {row.signal}"
                return JobStatus(job_id, state, exit_code, reason, restarts, tasks, source)
    return JobStatus(job_id, JobState.UNKNOWN, tasks=tasks, source=source)


class SlurmWatcher:
    """Batched, cached job states. Thread-safe; one per process is enough (:func:`shared_watcher`)."""

    def __init__(self, cli: SlurmCLI | None = None, min_interval_s: float = 2.0):
        self.cli = cli or SlurmCLI()
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._watched: dict[str, set[int] | None] = {}
        self._status: dict[str, JobStatus] = {}
        self._finished: dict[str, JobStatus] = {}
        self._last_poll = 0.0
        self.polls = 0  # number of sacct calls made; tests and benchmarks read it

    def register(self, job_id: str, array_tasks: set[int] | None = None) -> None:
        """Watch ``job_id``; for an array, ``array_tasks`` are the indices it must report."""
        with self._lock:
            self._watched[job_id] = set(array_tasks) if array_tasks else None
            self._finished.pop(job_id, None)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._watched.pop(job_id, None)
            self._status.pop(job_id, None)

    def status(self, job_id: str) -> JobStatus:
        """The latest known status; polls Slurm at most once per ``min_interval_s`` for ALL jobs."""
        with self._lock:
            if job_id in self._finished:
                return self._finished[job_id]
            self._watched.setdefault(job_id, None)
            if time.monotonic() - self._last_poll >= self.min_interval_s or job_id not in self._status:
                self._poll()
            return self._status.get(job_id, JobStatus(job_id, JobState.UNKNOWN))

    def _poll(self) -> None:
        live = sorted(set(self._watched) - set(self._finished))
        self._last_poll = time.monotonic()
        if not live:
            return
        rows: dict[str, list[JobRow]] = {j: [] for j in live}
        sacct_ok = True
        try:
            self.polls += 1
            for row in self.cli.sacct(live):
                if row.job_id.base in rows:
                    rows[row.job_id.base].append(row)
        except (SlurmCommandError, SlurmUnavailable):
            sacct_ok = False  # accounting down or disabled: the controller still knows
        merged = {j: merge_rows(j, r, self._watched.get(j)) for j, r in rows.items()}
        # sacct has no row, or says "done" before the controller agrees? ask the controller.
        lagging = [j for j, s in merged.items() if not sacct_ok or s.state is JobState.UNKNOWN]
        if lagging:
            for job_id, status in self._ask_controller(lagging).items():
                merged[job_id] = status
        for job_id, status in merged.items():
            self._status[job_id] = status
            if status.state.is_terminal and status.source != "none":
                self._finished[job_id] = status

    def _ask_controller(self, job_ids: list[str]) -> dict[str, JobStatus]:
        found: dict[str, list[JobRow]] = {j: [] for j in job_ids}
        try:
            for row in self.cli.squeue(job_ids):
                if row.job_id.base in found:
                    found[row.job_id.base].append(row)
        except (SlurmCommandError, SlurmUnavailable):
            pass
        result = {}
        for job_id, rows in found.items():
            live = merge_rows(job_id, rows) if rows else None
            if live is not None and not live.state.is_terminal and live.state is not JobState.UNKNOWN:
                result[job_id] = live
                continue
            # Left the queue: only scontrol (until MinJobAge) has the final state and exit code.
            try:
                rows = self.cli.scontrol_job(job_id)
            except (SlurmCommandError, SlurmUnavailable):
                rows = []
            status = merge_rows(job_id, rows, self._watched.get(job_id))
            status.source = "scontrol" if rows else "none"
            result[job_id] = status
        return result


_shared: SlurmWatcher | None = None
_shared_lock = threading.Lock()


def shared_watcher() -> SlurmWatcher:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SlurmWatcher()
        return _shared

"""Where a job's seconds go: the process's time cut into named phases, for the run's ``gpu-time`` artifact.

    from infra import phases
    phases.switch(phases.BUILD)            # the phase before ends here, "model build and compile" begins
    with phases.within(phases.VALIDATION): # a phase inside another: the outer one resumes after
        ...
    phases.write()                         # rank 0: to $NEMOFLOW_PHASES_FILE (nothing when it is unset)

One timer per process. Its first phase, :data:`START` (process start and imports), begins when the
process started (its start time from ``/proc/self/stat``, not when this module was imported), so the
phases cover the process from its start to the last boundary without a gap: every second is in exactly
one phase. Durations are measured on the monotonic clock; the wall-clock instants of the start and the
end are kept too, because the stage that reads the file (tasks/gpu_time.py) measured the job from
another process, maybe another machine, and compares wall clocks (NTP-synchronised on a cluster).

The file (written atomically, by global rank 0 only; the ranks of a job run the same phases in lock-step)::

    {"version": 1,
     "process_start_unix": 1764720000.12,   # when the process started (wall clock)
     "end_unix": 1764720093.50,             # the end of the last phase (wall clock)
     "seconds": {"process start and imports": 12.3, "data loading": 1.2, ...}}   # in first-seen order

A phase may recur (training steps, a save, training steps again): its seconds are the total. The phase
names are the fixed list below, so the stage, the artifact and metrics.jsonl use the same words.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager

PHASES_FILE_ENV = "NEMOFLOW_PHASES_FILE"

START = "process start and imports"
BUILD = "model build and compile"  # a process's first training step too: torch.compile compiles inside it
DATA = "data loading"  # in the training loop: waiting for the next batch and the loop's own bookkeeping
STEPS = "training steps"
SAVE = "checkpoint saves and export"
VALIDATION = "validation"
SERVER_START = "server start"
GENERATION = "generation"
# What a stage measures around the process (tasks/gpu_time.py): before it started, after its last phase.
LAUNCH = "queue and launch"
EXIT = "exit and teardown"
WAIT = "readiness check"
OTHER = "stage's own work"
UNITEMISED = "not itemised (the job reported no phases)"
ORDER = (LAUNCH, START, DATA, BUILD, STEPS, VALIDATION, SAVE, SERVER_START, GENERATION, EXIT, WAIT, OTHER, UNITEMISED)


def process_age_s(pid: int | str = "self") -> float:
    """Seconds since the process started: its start time in /proc/PID/stat (clock ticks since boot) against
    CLOCK_BOOTTIME, the clock that start time is counted on. 0 where /proc cannot tell (then the first phase
    begins at the timer's creation)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Timer:
    """The phases of one process (see the module docstring); thread-safe: a save runs beside the loop."""

    def __init__(self, age_s: float | None = None):
        age = process_age_s() if age_s is None else age_s
        now = time.monotonic()
        self.start_unix = time.time() - age
        self._origin = now - age
        self._since = now - age
        self._current = START
        self._seconds: dict[str, float] = {}
        self._ended: float | None = None
        self._lock = threading.Lock()

    @property
    def current(self) -> str:
        return self._current

    def switch(self, name: str) -> str:
        """End the current phase here and begin ``name``; returns the phase that ended."""
        with self._lock:
            now = time.monotonic()
            ended = self._current
            if self._ended is None:
                self._seconds[ended] = self._seconds.get(ended, 0.0) + (now - self._since)
            self._current, self._since = name, now
            return ended

    @contextmanager
    def within(self, name: str):
        """``name`` for the duration of the block, then the phase that was current before it."""
        outer = self.switch(name)
        try:
            yield
        finally:
            self.switch(outer)

    def stop(self) -> None:
        """End the current phase: later switches count nothing (a server's phases end when it is ready)."""
        if self._ended is None:
            self.switch(self._current)
            self._ended = time.monotonic()

    def report(self) -> dict:
        """The file's content: the phases so far, the current one counted up to now (or to :meth:`stop`)."""
        with self._lock:
            end = self._ended if self._ended is not None else time.monotonic()
            seconds = dict(self._seconds)
            if self._ended is None:
                seconds[self._current] = seconds.get(self._current, 0.0) + (end - self._since)
        return {
            "version": 1,
            "process_start_unix": self.start_unix,
            "end_unix": self.start_unix + (end - self._origin),
            "seconds": {name: round(value, 4) for name, value in seconds.items()},
        }


_timer: Timer | None = None
_timer_lock = threading.Lock()


def timer() -> Timer:
    """This process's timer (created at first use; its first phase begins at the process's start)."""
    global _timer
    with _timer_lock:
        if _timer is None:
            _timer = Timer()
        return _timer


def switch(name: str) -> str:
    return timer().switch(name)


def within(name: str):
    return timer().within(name)


def report() -> dict:
    return timer().report()


def stop() -> None:
    timer().stop()


def write(path: str | None = None) -> str | None:
    """Write :func:`report` to ``path`` (default ``$NEMOFLOW_PHASES_FILE``) if this is global rank 0; the path
    written, or None. Never raises: the phases are for the report, the job's work does not depend on them."""
    path = path or os.environ.get(PHASES_FILE_ENV)
    if not path or os.environ.get("RANK", "0") != "0":
        return None
    text = json.dumps(report(), indent=1)  # the phases end here, before the import of the storage code
    try:
        from infra import storage

        storage.write_text(path, text)
        return path
    except Exception as exc:  # noqa: BLE001 - see the docstring
        print(f"warning: could not write the phase times to {path}: {exc}", flush=True)
        return None


def read(path: str) -> dict | None:
    """A phases file as written by :func:`write`; None when there is none (the job wrote none)."""
    from infra import storage

    try:
        storage.url_to_fs(path)[0].invalidate_cache()  # the job wrote it: no listing cached before counts
        if not storage.exists(path):
            return None
        data = json.loads(storage.read_text(path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("seconds"), dict) else None


def timed(name: str):
    """Decorator: the function runs within phase ``name`` (one line over a method the job's loop calls)."""

    def decorate(fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with within(name):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def summary(accelerators: int, unit: str) -> dict:
    """The process's phases as one flat record for metrics.jsonl and W&B: seconds per phase, the
    accelerator-seconds the process held (``unit`` GPU or CPU, ``accelerators`` of them, from its start to
    now) and its goodput (training-step seconds over those seconds)."""
    seen = report()
    held = seen["end_unix"] - seen["process_start_unix"]
    steps = seen["seconds"].get(STEPS, 0.0)
    return {
        "phase_s": seen["seconds"],
        "accelerators": accelerators,
        "unit": unit,
        f"held_{unit.lower()}_s": round(held * accelerators, 3),
        "goodput": round(steps / held, 4) if held > 0 else None,
    }

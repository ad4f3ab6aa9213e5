"""Pace requests to a host across the threads and array tasks of one job; back off together on 429.

    throttle = HostThrottle(rate_per_s=2.0, shared_dir="gs://bucket/ds/shards/journal/cooldown")
    throttle.wait("huggingface.co")            # before each request: pacing + any shared cooldown
    throttle.cool_down("huggingface.co", 30)   # a 429 asked for 30 s: every thread and task pauses

Why not only per-request backoff: ``infra.fetch.download`` already retries a 429 after its
``Retry-After``, but only the request that got it waits; the other threads of the task and
the other array tasks keep asking, and a rate-limited host answers them with more 429s. A
host that says "slow down" is slowed down for everybody: the cooldown is kept per task in
memory and written to ``shared_dir`` (the dataset's storage, which every array task sees,
locally or on a cluster); tasks re-read it at most once per ``refresh_s``. Deadlines are wall
clock times (nodes of a cluster are NTP-synchronised; a cooldown lasts seconds, so a skew
well under a second does not matter).

Pacing: ``rate_per_s`` requests per second per task, spaced evenly (no bursts). The data
stage gives each task an equal share of the job's ``requests_per_second``.

Nothing here fits an off-the-shelf limiter: tenacity retries one call, and the rate-limiting
packages keep their state in one process (or need Redis); this needs a file any node can read.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable

from infra import storage

# A line of infra.fetch's log that reports an HTTP 429 answer ("... HTTP 429 Too Many Requests;
# retrying in 3.2s"): the status code alone identifies it; the delay is used when present.
_LINE_429 = re.compile(r"\b429\b")
_RETRY_IN = re.compile(r"retrying in ([0-9]+(?:\.[0-9]+)?)\s*s")
DEFAULT_COOLDOWN_S = 10.0
MAX_COOLDOWN_S = 300.0


def _file_name(host: str) -> str:
    return "cooldown-" + re.sub(r"[^A-Za-z0-9.-]", "_", host) + ".json"


class HostThrottle:
    """Per-host pacing and a cooldown shared through ``shared_dir`` (None: this process only)."""

    def __init__(
        self,
        rate_per_s: float | None = None,
        shared_dir: str | None = None,
        *,
        refresh_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if rate_per_s is not None and rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be positive, got {rate_per_s}")
        self.rate_per_s = rate_per_s
        self.shared_dir = shared_dir
        self.refresh_s = refresh_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next_slot: dict[str, float] = {}
        self._until: dict[str, float] = {}
        self._read_at: dict[str, float] = {}
        self.paused_s = 0.0  # total time spent waiting for cooldowns (reported by the task)

    # ---------------------------------------------------------------- cooldown

    def _shared_until(self, host: str) -> float:
        """The cooldown deadline other tasks wrote for ``host`` (re-read at most every ``refresh_s``)."""
        if self.shared_dir is None:
            return 0.0
        now = self._clock()
        with self._lock:
            if now - self._read_at.get(host, -1e18) < self.refresh_s:
                return self._until.get(host, 0.0)
            self._read_at[host] = now
        until = 0.0
        with contextlib.suppress(FileNotFoundError, ValueError, OSError, KeyError):
            until = float(storage.read_json(storage.join(self.shared_dir, _file_name(host)))["until"])
        with self._lock:
            self._until[host] = max(self._until.get(host, 0.0), until)
            return self._until[host]

    def cool_down(self, host: str, seconds: float) -> None:
        """No new request to ``host`` from any thread or task for ``seconds`` (capped at 5 minutes)."""
        until = self._clock() + min(max(seconds, 0.0), MAX_COOLDOWN_S)
        with self._lock:
            if until <= self._until.get(host, 0.0):
                return
            self._until[host] = until
        if self.shared_dir is not None:
            with contextlib.suppress(OSError):
                storage.write_text(
                    storage.join(self.shared_dir, _file_name(host)), json.dumps({"host": host, "until": until})
                )

    def note_log_line(self, host: str, line: str) -> None:
        """Feed a line of ``infra.fetch.download``'s log: a 429 there starts a shared cooldown."""
        if _LINE_429.search(line):
            delay = _RETRY_IN.search(line)
            self.cool_down(host, float(delay.group(1)) if delay else DEFAULT_COOLDOWN_S)

    # ---------------------------------------------------------------- pacing

    def wait(self, host: str) -> None:
        """Block until a request to ``host`` may start: after any cooldown, then in its pacing slot."""
        while True:
            pause = self._shared_until(host) - self._clock()
            if pause <= 0:
                break
            self.paused_s += pause
            self._sleep(pause)
        if self.rate_per_s is None:
            return
        with self._lock:
            now = self._clock()
            slot = max(now, self._next_slot.get(host, now))
            self._next_slot[host] = slot + 1.0 / self.rate_per_s
        if slot > now:
            self._sleep(slot - now)

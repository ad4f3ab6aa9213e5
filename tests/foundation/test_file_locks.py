"""The project's file locks (filelock) exclude another process, not only another thread.

A child process takes the lock and holds it until told to let go; meanwhile this process is refused it (a
real ``flock`` answering EWOULDBLOCK, watched, not timed), and gets it after.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap
import threading
import time

import pytest

HOLD = """
import sys
{setup}
with {lock}:
    print("held", flush=True)
    sys.stdin.readline()
"""


def _hold(setup: str, lock: str) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD.format(setup=setup, lock=lock))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "held"
    return child


def _waits_for(child: subprocess.Popen, take) -> None:
    """``take()`` is refused the lock while ``child`` holds it, and gets it once the child lets go.

    No timing: the locks are filelock's, which try ``flock(LOCK_EX | LOCK_NB)`` and retry; the real call is
    watched here. The proof of exclusion is a refused attempt (EWOULDBLOCK) while the child holds the lock;
    without a lock, ``take()`` finishes with no refusal and the test fails at once, whatever the load.
    """
    real_flock = fcntl.flock
    refused = threading.Event()
    done = threading.Event()

    def watched_flock(fd, operation):
        try:
            return real_flock(fd, operation)
        except BlockingIOError:
            refused.set()
            raise

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fcntl, "flock", watched_flock)
        thread = threading.Thread(target=lambda: (take(), done.set()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 120  # a bound for a hung lock, not part of the proof
        while not (refused.is_set() or done.is_set()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not done.is_set(), "the lock was taken while another process held it"
        assert refused.is_set(), "take() neither got the lock nor was refused it in 120 s"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
        assert done.wait(30), "the lock was not taken after the other process let go"
        thread.join(10)


def test_staging_lock_waits_for_another_process(tmp_path):
    from workloads import staging

    child = _hold(
        "from workloads import staging; from pathlib import Path", f"staging._locked(Path({str(tmp_path)!r}))"
    )

    def take():
        with staging._locked(tmp_path):
            pass

    _waits_for(child, take)


def test_download_lock_says_it_waits_for_another_process(tmp_path):
    from infra import fetch

    dest = str(tmp_path / "x.bin")
    child = _hold("from infra import fetch", f"fetch._dest_lock({dest!r}, print)")
    said: list[str] = []

    def take():
        with fetch._dest_lock(dest, said.append):
            pass

    _waits_for(child, take)
    assert said == ["another download of this file is running here: waiting for it"]


@pytest.mark.parametrize("module", ["services", "registry"])
def test_infra_locks_wait_for_another_process(tmp_path, work_dir, module):
    if module == "services":
        from infra import services

        setup = "from infra import services"
        lock = "services._table()"
        (work_dir / "services").mkdir(parents=True)

        def take():
            with services._table():
                pass
    else:
        from infra.registry import ModelRegistry

        setup = f"from infra.registry import ModelRegistry; r = ModelRegistry({str(tmp_path / 'reg')!r})"
        lock = "r._lock()"

        def take():
            with ModelRegistry(str(tmp_path / "reg"))._lock():
                pass

    _waits_for(_hold(setup, lock), take)

"""Processes on this machine, read from ``/proc``: identity, liveness, groups, port owners, stopping.

One copy of what the service table (infra/services.py), the demo's control plane
(devtools/prefect_local.py) and the local Slurm cluster (devtools/slurm_cluster.py)
need to know about a process they started earlier, possibly from another process:

    pid = spawn(...).pid
    write_pidfile(path, pid)                # "PID START": the start time makes it an identity
    read_pidfile(path)                      # the pid while that same process runs, else None
    stop(pid, group=True, grace_s=10)       # SIGTERM, then SIGKILL; waits until it is gone
    Popen(guarded(command), start_new_session=True)   # dies with this process (see guarded)

A pid alone is not an identity: the kernel reuses pids. The start time (clock
ticks since boot, field 22 of ``/proc/PID/stat``) is recorded beside it, so a
recycled pid is never taken for the process that was started. Zombies count as
dead: they run nothing, and only their parent can collect them (:func:`reap`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces and parens)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (None when it does not exist)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def pid_alive(pid: int, proc_start: int | None = None) -> bool:
    """Running (not a zombie) and, when ``proc_start`` is given, the same process as recorded."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return proc_start is None or int(fields[19]) == proc_start


def _live_processes():
    """(pid, /proc/PID/stat fields) of every live (non-zombie) process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields and fields[0] not in ("Z", "X"):
                yield int(entry), fields


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    return [pid for pid, fields in _live_processes() if int(fields[2]) == pgid]


def children(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of each live child of ``pid``: who to look for once ``pid`` is gone."""
    return [(child, int(fields[19])) for child, fields in _live_processes() if int(fields[1]) == pid]


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (/proc's parent links): a server's child that
    left its process group still belongs to it."""
    for _ in range(64):
        if pid == ancestor:
            return True
        fields = _stat_fields(pid)
        if fields is None:
            return False
        pid = int(fields[1])
        if pid <= 1:
            return False
    return False


def command_name(pid: int, settle_s: float = 1.0) -> str | None:
    """The executable's base name from ``/proc/PID/cmdline`` (None when the process is gone).

    A process that has just been started reads an empty cmdline for a moment (seen right after
    Popen returned: 114 of 300 starts in a test): read again for up to ``settle_s``, then take
    ``/proc/PID/comm`` (the name the kernel keeps; empty cmdline is also what kernel threads show).
    """
    deadline = time.monotonic() + settle_s
    while True:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            return None
        if argv0:
            return Path(argv0).name
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or None
    except OSError:
        return None


def reap(pid: int) -> None:
    """Collect our own exited child so it does not linger as a zombie (no-op for others' processes)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def port_owner(port: int) -> int | None:
    """The pid listening on TCP ``port``, if this user can see it (best effort, Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(parts[9])
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in targets:
                        return int(entry)
    return None


# ---------------------------------------------------------------- pid files


def write_pidfile(path: str | Path, pid: int) -> None:
    """Record ``pid`` with its start time, atomically (a reader never sees half a line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(f"{pid} {process_start_time(pid) or ''}".strip() + "\n")
    os.replace(tmp, path)


def read_pidfile(path: str | Path, name: str | None = None) -> int | None:
    """The pid recorded in ``path`` while that process still runs, else None.

    A pid file written by :func:`write_pidfile` carries the start time, which must
    match. Daemons write bare pids (``slurmctld``, ``munged``): then ``name`` is
    checked against the running executable's name instead, so a recycled pid of
    another program is not mistaken for the daemon.
    """
    try:
        fields = Path(path).read_text().split()
        pid = int(fields[0])
        proc_start = int(fields[1]) if len(fields) > 1 else None
    except (OSError, ValueError, IndexError):
        return None
    if not pid_alive(pid, proc_start):
        return None
    if name is not None and not (command_name(pid) or "").startswith(name):
        return None
    return pid


def wait_pidfile(path: str | Path, timeout_s: float, poll_s: float = 0.1) -> float:
    """Wait while the process recorded in ``path`` runs (at most ``timeout_s``); the seconds waited."""
    started = time.monotonic()
    while read_pidfile(path) is not None and time.monotonic() - started < timeout_s:
        time.sleep(poll_s)
    return time.monotonic() - started


# ---------------------------------------------------------------- stopping


def _gone(pid: int, group: bool, proc: subprocess.Popen | None) -> bool:
    gone = not group_members(pid) if group else not pid_alive(pid)
    # Collect the exit status after the check, not before: a leader that exits between the two
    # would otherwise count as gone with its status never read (returncode None, a zombie).
    if proc is not None:
        proc.poll()
    else:
        reap(pid)
    return gone


def _signal(pid: int, group: bool, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)


def _wait_gone(pid: int, group: bool, proc: subprocess.Popen | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if _gone(pid, group, proc):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop(
    pid: int,
    *,
    group: bool = False,
    grace_s: float = 10.0,
    terms: int = 1,
    proc: subprocess.Popen | None = None,
    kill_wait_s: float = 10.0,
) -> bool:
    """SIGTERM ``pid`` (its whole process group with ``group``), SIGKILL what is left after ``grace_s``.

    ``terms`` SIGTERMs are sent, each followed by up to ``grace_s`` of waiting: a
    Prefect worker drains on the first and stops on the second. Returns True once
    nothing is left, False if something survived SIGKILL for ``kill_wait_s``.
    Pass ``proc`` for our own child so its exit status is collected (no zombie).
    """
    for _ in range(terms):
        if _gone(pid, group, proc):
            return True
        _signal(pid, group, signal.SIGTERM)
        if _wait_gone(pid, group, proc, grace_s):
            return True
    _signal(pid, group, signal.SIGKILL)
    return _wait_gone(pid, group, proc, kill_wait_s)


# ---------------------------------------------------------------- dying with the parent


def guarded(command: list[str], parent: int | None = None) -> list[str]:
    """``command`` behind a guard that kills the command's whole process group when ``parent`` dies.

    A stage job must not outlive the flow run that started it (a killed worker, a SIGKILLed flow-run
    process, ``nemoflow demo --down``): nothing in a dead process can clean up after it. Start the
    returned argv as a new session (``start_new_session=True``): the guard is then the group leader
    and the command, torchrun's workers and anything else they start share its group.

    Why a guard process and not ``setpriv --pdeathsig KILL`` alone: the parent-death signal reaches
    only the direct child, and torchrun's workers (grandchildren) would keep running; Popen's
    ``preexec_fn`` could set it without a wrapper but is unsafe in a threaded parent (Prefect runs
    tasks in threads). The guard sets PR_SET_PDEATHSIG on itself and also polls ``getppid()``
    (the signal follows the *thread* that forked; a poll catches every other way of losing the parent).
    """
    parent = os.getpid() if parent is None else parent
    return [sys.executable, "-c", _GUARD_ENTRY, str(parent), "--", *command]


_GUARD_ENTRY = "import sys; from infra.processes import guard_main; guard_main(sys.argv[1:])"
PR_SET_PDEATHSIG = 1


def _set_parent_death_signal(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the getppid() poll still works
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def guard_main(argv: list[str], poll_s: float = 0.5) -> None:
    """The guard of :func:`guarded`: ``PARENT_PID -- COMMAND...``; exits as the command did."""
    parent = int(argv[0])
    command = argv[2:] if argv[1:2] == ["--"] else argv[1:]

    def orphaned() -> bool:
        return os.getppid() != parent

    def kill_group() -> None:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the guard too: nothing is left to report to

    def on_signal(signum, frame) -> None:
        # A signal to the whole group (a cancel: SIGTERM, then SIGKILL) reaches the command too; the
        # guard stays to report how it ended. The parent-death signal is the other SIGTERM.
        if orphaned():
            kill_group()

    _set_parent_death_signal(signal.SIGTERM)
    if orphaned():  # the parent died before the signal was armed
        kill_group()
    child = subprocess.Popen(command)
    # Python-level handlers (not SIG_IGN, which the command would inherit across exec).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, on_signal)
    while True:
        try:
            code = child.wait(timeout=poll_s)
            break
        except subprocess.TimeoutExpired:
            if orphaned():
                kill_group()
    if code < 0:  # end the way the command ended, so the parent sees the same signal
        with contextlib.suppress(OSError, ValueError):  # SIGKILL/SIGSTOP have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def exit_now(code: int | None) -> NoReturn:
    """End this process as the interpreter would, less its teardown: threading's exit callbacks and the threads
    the interpreter waits for (non-daemon ones), the atexit handlers (logging's flush, multiprocessing's
    children, W&B), stdout and stderr flushed, then ``os._exit``. What is skipped is the finalisation of every
    module and C++ object (CUDA contexts, allocator caches, compiled kernels, process groups), which the kernel
    reclaims at exit anyway: about 1 s of a trainer's end on the 2-core VM; on the H200 at e5b86ee the GPU
    demo's pretrain job spent 5.0 s and its validate job 2.2 s after their last phase (what of that this saves
    there: not yet measured). For a job's entry point, once its work is written and closed."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls: executors' exits, then joins
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)

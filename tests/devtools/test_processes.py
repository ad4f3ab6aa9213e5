"""infra/processes.py against real processes: pid identity, groups, pid files, stopping."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra import processes

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)


def test_a_zombie_and_a_recycled_pid_are_not_alive():
    proc = spawn([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while processes.pid_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not processes.pid_alive(proc.pid)  # exited, not yet reaped: a zombie
    processes.reap(proc.pid)
    assert processes.process_start_time(proc.pid) is None

    live = spawn(SLEEP)
    try:
        real = processes.process_start_time(live.pid)
        assert processes.pid_alive(live.pid, real)
        assert not processes.pid_alive(live.pid, real + 1)  # the same pid, another process
    finally:
        live.kill()
        live.wait()


def test_pidfile_records_identity_and_checks_the_program(tmp_path):
    proc = spawn(SLEEP)
    try:
        pidfile = tmp_path / "run" / "sleeper.pid"
        processes.write_pidfile(pidfile, proc.pid)
        pid, start = pidfile.read_text().split()
        assert (int(pid), int(start)) == (proc.pid, processes.process_start_time(proc.pid))
        assert processes.read_pidfile(pidfile) == proc.pid
        assert processes.read_pidfile(pidfile, name="python") == proc.pid
        assert processes.read_pidfile(pidfile, name="slurmctld") is None  # a daemon's pid file, reused pid
        pidfile.write_text(f"{proc.pid} {int(start) + 1}\n")
        assert processes.read_pidfile(pidfile) is None  # recorded start time differs: not our process
        pidfile.write_text(f"{proc.pid}\n")  # a bare pid, as daemons write them
        assert processes.read_pidfile(pidfile) == proc.pid
        pidfile.write_text("garbage")
        assert processes.read_pidfile(pidfile) is None
        assert processes.read_pidfile(tmp_path / "missing.pid") is None
    finally:
        proc.kill()
        proc.wait()


def test_stop_group_kills_children_and_a_second_sigterm_stops_a_draining_process(tmp_path):
    # The leader ignores its first SIGTERM (as a Prefect worker drains) and has a child in its group.
    code = (
        "import signal, subprocess, sys, time\n"
        "count = [0]\n"
        "def handler(signum, frame):\n"
        "    count[0] += 1\n"
        "    if count[0] == 2: sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, handler)\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
        "while True: time.sleep(0.05)\n"
    )
    proc = spawn([sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while not (tmp_path / "child").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    assert sorted(processes.group_members(proc.pid)) == sorted([proc.pid, child])

    started = time.monotonic()
    assert processes.stop(proc.pid, group=True, grace_s=1.0, terms=2, proc=proc)
    assert time.monotonic() - started < 5
    assert proc.returncode == 0  # the second SIGTERM ended it, no SIGKILL was needed
    assert processes.group_members(proc.pid) == []
    assert not processes.pid_alive(child)


def _ready_python(on_sigterm: str) -> subprocess.Popen:
    """A Python process whose SIGTERM handler is ``on_sigterm``, returned once it is in place (it says so: a fixed
    sleep lost the race on a loaded machine, the SIGTERM came first); then it sleeps for a minute."""
    code = f"import signal, sys, time; signal.signal(signal.SIGTERM, {on_sigterm}); print('ready', flush=True)"
    proc = spawn([sys.executable, "-c", code + "; time.sleep(60)"], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    return proc


def test_stop_escalates_to_sigkill():
    proc = _ready_python(on_sigterm="signal.SIG_IGN")
    assert processes.stop(proc.pid, grace_s=0.3, proc=proc)
    assert proc.returncode == -signal.SIGKILL


def test_port_owner_finds_the_listening_process():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert processes.port_owner(sock.getsockname()[1]) == os.getpid()


def test_stop_collects_the_exit_status_of_a_leader_that_exits_during_the_group_scan(tmp_path, monkeypatch):
    """The leader may exit between the poll of its status and the scan of its group (seen in CI under
    load): stop() must still collect its exit status, not report the group gone with returncode None."""
    proc = _ready_python(on_sigterm="lambda *a: sys.exit(3)")
    real_members = processes.group_members

    def members_after_the_leader_exited(pgid: int) -> list[int]:
        os.kill(proc.pid, signal.SIGTERM)  # the leader exits right now, after stop() polled it
        deadline = time.monotonic() + 20
        while processes.pid_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return real_members(pgid)

    monkeypatch.setattr(processes, "group_members", members_after_the_leader_exited)
    assert processes.stop(proc.pid, group=True, grace_s=5.0, proc=proc)
    assert proc.returncode == 3


def test_command_name_of_a_process_just_started():
    """Right after Popen returns, /proc/PID/cmdline reads empty now and then (CI failed on it): the
    name must still be the program's. 300 starts: before the fix 114 of them read None."""
    names = []
    for _ in range(300):
        proc = spawn(SLEEP)
        try:
            names.append(processes.command_name(proc.pid))
        finally:
            proc.kill()
            proc.wait()
    assert set(names) == {Path(sys.executable).name}, collections.Counter(names)


EXITING = """
import atexit, concurrent.futures, logging, sys, threading, time
from pathlib import Path
from infra.processes import exit_now

out = Path(sys.argv[1])
log = logging.getLogger("exit-test")
log.addHandler(logging.FileHandler(out / "log.txt"))
log.warning("logged")
atexit.register(lambda: (out / "atexit").write_text("ran"))
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(lambda: None).result()  # an idle worker: it waits for work until the exit callbacks wake it

def late():
    time.sleep(0.5)
    (out / "thread").write_text("finished")

threading.Thread(target=late).start()
sys.stdout.write("buffered, no newline")
exit_now(3)
"""


def test_exit_now_keeps_what_the_interpreters_exit_keeps(tmp_path):
    """exit_now skips the interpreter's teardown, nothing else: a thread still working finishes, atexit handlers
    and logging's flush run, buffered output comes out, an idle executor does not hang it, the code is kept."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo))
    done = subprocess.run(
        [sys.executable, "-c", EXITING, str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "log.txt").read_text() == "logged\n"

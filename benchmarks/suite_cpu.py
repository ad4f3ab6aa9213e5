"""Where a command's CPU time goes, by process kind: run it (for example the whole test suite) and sample /proc.

    python benchmarks/suite_cpu.py --out benchmarks/out/suite-cpu.json -- bash .ci/run
    python benchmarks/suite_cpu.py --report benchmarks/out/suite-cpu.json     # the table again

Every ``--interval`` seconds (default 0.3) every process's user + system CPU time is read from
``/proc/PID/stat``; a process is known by (pid, start time) and keeps the last value seen, minus what it had
used when sampling began. Processes started by the command and by anything else on the machine are counted
alike (run it on an otherwise idle machine): a job that Slurm starts is not a child of the command, and is
exactly what must be counted. A process that lives less than one interval is missed (its CPU time is small).

The table groups processes by kind: ``python -m MODULE`` by module (each pipeline job: ``workloads.train``,
``workloads.serve``, ...), Prefect servers, workers and CLI calls, pytest-xdist workers, the compiler, and
the rest by the program's name. The total, divided by the machine's cores, is the shortest wall time the
same work can take there.

Not a test: the README records what it measured, with this command and the commit.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _read(pid: str) -> tuple[tuple[str, str], float] | None:
    """((pid, start time), CPU seconds) of one process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return (pid, fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class Sampler:
    """Samples every process until stopped; ``rows()`` = [cmdline, CPU seconds used since sampling began]."""

    def __init__(self, interval: float):
        self.interval = interval
        self.seen: dict[tuple[str, str], list] = {}  # key -> [cmdline, cpu at first sight (0 if new), last cpu]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _scan(self, first: bool) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            read = _read(pid)
            if read is None:
                continue
            key, cpu = read
            row = self.seen.get(key)
            if row is None:
                self.seen[key] = [_cmdline(pid), cpu if first else 0.0, cpu]
            else:
                row[2] = cpu
                if not row[0]:  # /proc/PID/cmdline reads empty just after a process starts
                    row[0] = _cmdline(pid)

    def _run(self) -> None:
        self._scan(first=True)
        while not self.stopped.wait(self.interval):
            self._scan(first=False)

    def rows(self) -> list[list]:
        return [[cmd, round(last - base, 2)] for cmd, base, last in self.seen.values() if last - base > 0]


def kind(cmdline: str) -> str:
    """The row of the table a process belongs to."""
    module = re.search(r"(?:^|\s)-m (\S+)", cmdline)
    if module:
        return f"python -m {module.group(1)}"
    if "import sys;exec(eval(sys.stdin.readline()))" in cmdline:
        return "pytest-xdist worker (tests run in-process)"
    if "multiprocessing.spawn import spawn_main" in cmdline:
        return "multiprocessing spawn child (e.g. the async checkpoint writer)"
    words = cmdline.split()
    if not words:
        return "(no command line: kernel threads, exited before read)"
    program = os.path.basename(words[0])
    if program.startswith("python") and len(words) > 1:
        script = os.path.basename(words[1])
        if script == "prefect" and len(words) > 2:
            sub = [w for w in words[2:5] if not w.startswith("-")]
            if sub[:2] in (["server", "start"], ["worker", "start"]):
                return f"prefect {sub[0]} start"
            return f"prefect {sub[0] if sub else ''} (CLI call)"
        return f"python {script}"
    return program


def report(rows: list[list], cores: int, top: int) -> str:
    table: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for cmd, cpu in rows:
        entry = table[kind(cmd)]
        entry[0] += cpu
        entry[1] += 1
    total = sum(cpu for cmd, cpu in rows)
    lines = [f"{'CPU s':>9}  {'share':>6}  {'procs':>5}  kind", f"{'-' * 9}  {'-' * 6}  {'-' * 5}  {'-' * 40}"]
    for name, (cpu, count) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{cpu:9.1f}  {cpu / total:6.1%}  {count:5d}  {name}")
    lines.append(f"{total:9.1f}  100.0%  {len(rows):5d}  total: at least {total / cores / 60:.1f} min on {cores} cores")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", help="write the sampled processes (JSON) here")
    parser.add_argument("--report", metavar="JSON", help="print the table of an earlier --out and stop")
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between scans of /proc")
    parser.add_argument("--top", type=int, default=30, help="rows of the table")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        print(report(saved["processes"], saved["cores"], args.top))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, or --report JSON")
    sampler = Sampler(args.interval)
    sampler.thread.start()
    started = time.monotonic()
    code = subprocess.call(command)
    wall = time.monotonic() - started
    sampler.stopped.set()
    sampler.thread.join()
    rows = sampler.rows()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {"command": command, "exit_code": code, "wall_s": round(wall, 1), "cores": cores, "processes": rows}
        Path(args.out).write_text(json.dumps(record))
    print(f"\n{' '.join(command)}: exit code {code}, {wall / 60:.1f} min wall", file=sys.stderr)
    print(report(rows, cores, args.top), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

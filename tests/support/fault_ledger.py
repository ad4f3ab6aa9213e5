"""The fault table: what the faults suite injected and what came of it, measured, printed at the end of a run.

A fault test (marked ``@pytest.mark.faults``) opens its row BEFORE it injects the fault and counts only what
it observed; the test's outcome decides whether the faults survived:

    row = fault_ledger.open_row("gcs 503 during a shard download")
    with gcs_behind(gcs_endpoint) as proxy:
        proxy.add_faults(...)
        ... the work ...
        row.injected += proxy.injected_count()       # what the fault proxy actually served
    row.compare(before, after)                       # data lost: entries of ``before`` missing or changed after
    row.watch_runs([flow_run_id], plane.api.settings)  # stuck: runs not final when the test ends (Prefect API)

Columns:

- ``injected``: faults the test saw happen (a fault server's counters, a kill that hit a live process, a disk
  that answered ENOSPC), counted up by the test;
- ``survived``: ``injected`` when the test passed (the run told the truth: finished verified, or ended with a
  clear one-line error and nothing half-written under a final name) AND the row counted no data lost, no stuck
  run and no unknown; 0 otherwise (failed, errored, data lost, stuck runs, or stuck runs that could not be read);
  a skipped test's row shows ``-`` and the outcome ``skipped`` (with the reason);
- ``data lost``: from :meth:`Row.compare` (checksums or rows of what existed before the fault, compared after)
  or :meth:`Row.count_lost`; ``-`` where the test has nothing that existed before the fault;
- ``stuck runs``: flow runs given to :meth:`Row.watch_runs` that the Prefect API does not show in a final
  state when the test's call ends; ``-`` where the test starts no flow run; ``unknown`` where the API could
  not be read (the reason is printed under the table, and the row is not survived).

No row is lost, whatever happens: a faults test that ends (passed, failed, errored in setup, call or teardown,
skipped) without having opened a row shows one stand-in row named after the test, with its outcome; a faults
test that PASSES without opening a row is turned into an error (it injected nothing it counted); a faults test
whose teardown report never arrives (its xdist worker crashed, the run was interrupted) shows a stand-in row
``error`` at the end. A test that injects several faults opens all its rows before the first one. A race is one
fault: one row, the writers in its name, the lost updates it caused as ``data lost``.

``NEMOFLOW_FAULT_TABLE_OUT=PATH``: the summary also writes the table, with the commit it ran on and its rows as
JSON, to PATH (written whole or not at all); docs/fault-table.md is that file from the last full run
(``NEMOFLOW_FAULT_TABLE_OUT=docs/fault-table.md scripts/test.sh``). How the rows
reach the table: each test's rows ride on its teardown report (``report.user_properties``, which pytest-xdist
sends from its workers to the controller), and the controller gathers them in ``pytest_runtest_logreport``,
so the table is the same with and without ``-n``. Registered as a plugin by tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

PROPERTY = "fault_ledger"
TABLE_OUT_ENV = "NEMOFLOW_FAULT_TABLE_OUT"
UNKNOWN = "unknown"


@dataclasses.dataclass
class Row:
    fault: str
    test: str = ""
    injected: int = 0
    data_lost: int | None = None  # None: not measured
    stuck: int | None = None  # None: no flow run watched (see stuck_unknown)
    outcome: str = "running"  # passed / failed / error / skipped / xfailed
    reason: str = ""
    stuck_unknown: str = ""  # why the stuck runs could not be counted ("" = they were, or none were watched)
    _watched: list = dataclasses.field(default_factory=list, repr=False)  # [(run ids, settings factory)]
    _counters: list = dataclasses.field(default_factory=list, repr=False)  # callables read when the call ends

    @property
    def survived(self) -> int | None:
        """``injected`` for a passed test that lost nothing and left nothing stuck (known); else 0 (- if skipped)."""
        if self.outcome == "skipped":
            return None
        if self.outcome != "passed" or self.data_lost or self.stuck or self.stuck_unknown:
            return 0
        return self.injected

    @property
    def why_not(self) -> str:
        """Why a row that ran did not survive, in words ("" when it survived or was skipped)."""
        if self.outcome == "skipped":
            return ""
        parts = [] if self.outcome == "passed" else [self.outcome]
        if self.data_lost:
            parts.append(f"{self.data_lost} lost")
        if self.stuck:
            parts.append(f"{self.stuck} stuck")
        if self.stuck_unknown:
            parts.append(f"stuck runs {UNKNOWN}: {self.stuck_unknown}")
        return ", ".join(parts)

    def compare(self, before: Mapping, after: Mapping) -> int:
        """Count the entries of ``before`` that ``after`` lacks or holds with another value, as data lost.

        ``before`` / ``after``: e.g. :func:`checksums` of a directory before the fault and after it, or row
        counts by name. Returns the count; a row with data lost is not survived, whether the test asserts 0 or not.
        """
        lost = sum(1 for key, value in before.items() if key not in after or after[key] != value)
        self.count_lost(lost)
        return lost

    def count_lost(self, n: int) -> int:
        """Add ``n`` items the test found lost by its own comparison (e.g. registry updates missing)."""
        self.data_lost = (self.data_lost or 0) + int(n)
        return int(n)

    def watch_runs(
        self, flow_run_ids: Iterable, settings: Callable[[], contextlib.AbstractContextManager] | None = None
    ):
        """Flow runs whose state is read from the Prefect API when the test's call ends (``settings``: a
        context manager factory pointing the client at that API, e.g. ``plane.api.settings``)."""
        self._watched.append(([str(i) for i in flow_run_ids], settings))
        if self.stuck is None and not self.stuck_unknown:
            self.stuck = 0

    def injected_from(self, count: Callable[[], int]) -> None:
        """Add ``count()`` to ``injected`` when the test's call ends, passed or not (e.g. a fault server's
        ``injected_count``): the faults it served are counted even when the test stops half-way."""
        self._counters.append(count)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}


def checksums(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path (what :meth:`Row.compare` takes)."""
    root = Path(root)
    if root.is_file():
        return {root.name: hashlib.sha256(root.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ---------------------------------------------------------------- the running test's rows

_ROWS = pytest.StashKey[list]()
_PHASES = pytest.StashKey[dict]()
_current: pytest.Item | None = None
NO_ROW = "marked faults, passed, and opened no row: open one before injecting (fault_ledger.open_row)"


def open_row(fault: str, *, injected: int = 0) -> Row:
    """A new row of the running test, counted from now on; open it before injecting the fault."""
    item = _current
    if item is None:
        raise RuntimeError("fault_ledger.open_row() is called from inside a test")
    if item.get_closest_marker("faults") is None:
        raise RuntimeError(f"{item.nodeid} injects faults: mark it @pytest.mark.faults (so `-m faults` runs it)")
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.id not in fault:  # a parametrized test's rows tell its cases apart
        fault = f"{fault} [{callspec.id}]"
    row = Row(fault=fault, test=item.nodeid, injected=injected)
    item.stash.setdefault(_ROWS, []).append(row)
    return row


def _unfinished(ids: list[str], settings) -> int:
    from prefect.client.orchestration import get_client

    with settings() if settings else contextlib.nullcontext(), get_client(sync_client=True) as client:
        states = [client.read_flow_run(i).state for i in ids]
    return sum(1 for s in states if s is None or not s.is_final())


def _measure_stuck(row: Row) -> None:
    stuck = 0
    for ids, settings in row._watched:
        try:
            stuck += _unfinished(ids, settings)
        except Exception as exc:  # noqa: BLE001 - an API that cannot be read is reported, not counted as 0
            row.stuck = None
            row.stuck_unknown = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            return
    row.stuck = stuck


def _outcome(phases: dict) -> tuple[str, str]:
    for when in ("setup", "call", "teardown"):
        report = phases.get(when)
        if report is None:
            continue
        if hasattr(report, "wasxfail"):
            return "xfailed", str(report.wasxfail)
        if report.failed:
            return ("failed" if when == "call" else "error"), f"{when} failed: {_first_line(report)}"
        if report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            return "skipped", reason.removeprefix("Skipped: ")
    return "passed", ""


def _first_line(report) -> str:
    """The error's own line (``E   ...``) of a failed report, short."""
    text = str(report.longrepr or "")
    for line in text.splitlines():
        if line.startswith("E   "):
            return line[4:].strip()[:160]
    return (text.strip().splitlines() or [""])[-1][:160]


def stand_in(test: str, name: str, outcome: str, reason: str) -> Row:
    """The row of a faults test that has none of its own (it ended before opening one, or never reported)."""
    return Row(fault=f"({name})", test=test, outcome=outcome, reason=reason)


# ---------------------------------------------------------------- pytest hooks (this module is a plugin)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = item
    try:
        return (yield)
    finally:
        _current = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    item.stash.setdefault(_PHASES, {})[report.when] = report
    rows = item.stash.get(_ROWS, [])
    if report.when == "call":
        for row in rows:
            for count in row._counters:
                try:
                    row.injected += int(count())
                except Exception as exc:  # noqa: BLE001 - the count is lost, the row is not: say why
                    row.reason = f"injected count unreadable: {type(exc).__name__}: {exc}"[:200]
            if row._watched:
                _measure_stuck(row)
    if report.when == "teardown":
        marked = item.get_closest_marker("faults") is not None
        if marked and not rows and report.passed and _outcome(item.stash[_PHASES])[0] == "passed":
            report.outcome = "failed"  # a faults test that counted nothing must not pass unseen
            report.longrepr = f"{item.nodeid}: {NO_ROW}"
        outcome, reason = _outcome(item.stash[_PHASES])
        if marked and not rows:
            rows = [stand_in(item.nodeid, item.name, outcome, reason)]
        for row in rows:
            row.outcome = outcome
            row.reason = row.reason or reason
        if rows:
            report.user_properties.append((PROPERTY, json.dumps([r.as_dict() for r in rows])))
    return report


ROWS: list[Row] = []
_MARKED: dict[str, str] = {}  # faults tests that reported a setup, not yet their teardown: nodeid -> name


def pytest_runtest_logreport(report):
    """Runs in the process that reports (the controller under xdist): gather the rows each test carried."""
    if report.when == "setup" and "faults" in report.keywords:
        _MARKED[report.nodeid] = report.nodeid.rsplit("::", 1)[-1]
    if report.when not in ("teardown", "???"):  # "???": pytest-xdist's report of a worker that crashed
        return
    carried = [value for name, value in report.user_properties if name == PROPERTY]
    for value in carried:
        ROWS.extend(Row(**entry) for entry in json.loads(value))
    name = _MARKED.pop(report.nodeid, None)
    if not carried and name is not None and report.when == "???":
        ROWS.append(stand_in(report.nodeid, name, "error", _first_line(report)))


def _cell(value) -> str:
    return "-" if value is None else str(value)


def _stuck_cell(row: Row) -> str:
    return UNKNOWN if row.stuck_unknown else _cell(row.stuck)


def table(rows: list[Row] | None = None) -> str:
    rows = sorted(ROWS if rows is None else rows, key=lambda r: (r.test, r.fault))
    header = ("fault", "injected", "survived", "data lost", "stuck runs", "outcome")
    lines = [
        (
            r.fault,
            str(r.injected),
            _cell(r.survived),
            _cell(r.data_lost),
            _stuck_cell(r),
            r.outcome.upper() if r.outcome in ("failed", "error") else r.outcome,
        )
        for r in rows
    ]

    def total(values) -> str:
        measured = [v for v in values if v is not None]
        return str(sum(measured)) if measured else "-"

    unknown = sum(1 for r in rows if r.stuck_unknown)
    stuck_total = total([r.stuck for r in rows])
    if unknown:
        stuck_total = f"{'' if stuck_total == '-' else stuck_total + ' + '}{unknown} {UNKNOWN}"
    totals = (
        "total",
        str(sum(r.injected for r in rows)),
        total([r.survived for r in rows]),
        total([r.data_lost for r in rows]),
        stuck_total,
        ", ".join(f"{n} {o}" for o, n in _counts(rows)),
    )
    widths = [max(len(line[i]) for line in [header, *lines, totals]) for i in range(6)]

    def fmt(line) -> str:
        cells = [cell.ljust(w) if i in (0, 5) else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, lines), rule, fmt(totals)])


def notes(rows: list[Row] | None = None) -> list[str]:
    """One line per row that did not pass or did not survive, with its reasons (what the table cannot show)."""
    out = []
    for row in sorted(ROWS if rows is None else rows, key=lambda r: (r.test, r.fault)):
        why = row.why_not
        if row.outcome == "passed" and not why:
            continue
        reason = "; ".join(part for part in (why.removeprefix(row.outcome).lstrip(", "), row.reason) if part)
        label = row.outcome if row.outcome != "passed" else "passed, not survived"
        out.append(f"{label}: {row.fault}: {row.test}" + (f" ({reason})" if reason else ""))
    return out


def _counts(rows: list[Row]) -> list[tuple[str, int]]:
    order = ["passed", "failed", "error", "xfailed", "skipped"]
    found = {o: sum(1 for r in rows if r.outcome == o) for o in order}
    return [(o, n) for o, n in found.items() if n]


# ---------------------------------------------------------------- the saved table (docs/fault-table.md)

ROWS_BEGIN = "<!-- fault-ledger rows (JSON, one row a line): the table above is table() of these -->"
ROWS_END = "<!-- end of rows -->"


def _commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True)
    except OSError:
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def document(rows: list[Row], *, commit: str, command: str, exitstatus: int, when: str) -> str:
    """The saved table: what ran, on which commit, the table, the notes, and the rows it was made from."""
    body = [
        "# Fault table (the saved output of a test run)",
        "",
        "Written by the fault ledger (tests/support/fault_ledger.py) at the end of the run, not by hand:",
        "`NEMOFLOW_FAULT_TABLE_OUT=docs/fault-table.md scripts/test.sh` makes it again.",
        "tests/faults/test_fault_ledger.py fails when the table below is not what the ledger prints for the rows",
        "saved under it.",
        "",
        f"- commit: {commit}",
        f"- command: `{command}`",
        f"- finished: {when}, pytest exit status {exitstatus}",
        "",
        "```text",
        table(rows),
        "```",
        "",
    ]
    extra = notes(rows)
    if extra:
        body += ["Rows that did not pass or did not survive:", "", *[f"- {line}" for line in extra], ""]
    body += [ROWS_BEGIN, "<!--"]
    body += [json.dumps(r.as_dict(), sort_keys=True) for r in sorted(rows, key=lambda r: (r.test, r.fault))]
    body += ["-->", ROWS_END, ""]
    return "\n".join(body)


def read_document(text: str) -> tuple[str, list[Row]]:
    """(the table printed in a saved document, the rows saved under it)."""
    printed = text.split("```text\n", 1)[1].split("\n```", 1)[0]
    saved = text.split(ROWS_BEGIN, 1)[1].split(ROWS_END, 1)[0]
    lines = [line for line in saved.splitlines() if line.strip() not in ("", "<!--", "-->")]
    return printed, [Row(**json.loads(line)) for line in lines]


def write_document(path: Path, text: str) -> None:
    """Whole or not at all: a temporary file beside ``path``, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):  # an xdist worker: its controller prints the table
        return
    for nodeid, name in sorted(_MARKED.items()):  # set up, never torn down: the run stopped inside them
        ROWS.append(stand_in(nodeid, name, "error", "no teardown report (the run was interrupted or its worker died)"))
    _MARKED.clear()
    if not ROWS:
        return
    terminalreporter.write_sep("=", "faults injected / survived")
    terminalreporter.write_line(table())
    for line in notes():
        terminalreporter.write_line(line)
    out = os.environ.get(TABLE_OUT_ENV)
    if out:
        text = document(
            ROWS,
            commit=_commit(config.rootpath),
            command=" ".join(["pytest", *map(str, config.invocation_params.args)]),
            exitstatus=int(exitstatus),
            when=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        )
        write_document(config.invocation_params.dir / out, text)
        terminalreporter.write_line(f"fault table written to {out}")

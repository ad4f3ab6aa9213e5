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
  clear one-line error and nothing half-written under a final name), 0 when it failed or errored; a skipped
  test's row shows ``-`` and the outcome ``skipped`` (with the reason);
- ``data lost``: from :meth:`Row.compare` (checksums or rows of what existed before the fault, compared after)
  or :meth:`Row.count_lost`; ``-`` where the test has nothing that existed before the fault;
- ``stuck runs``: flow runs given to :meth:`Row.watch_runs` that the Prefect API does not show in a final
  state when the test's call ends; ``-`` where the test starts no flow run.

A faults test that is skipped before it opens a row still shows one row, named after the test. How the rows
reach the table: each test's rows ride on its teardown report (``report.user_properties``, which pytest-xdist
sends from its workers to the controller), and the controller gathers them in ``pytest_runtest_logreport``,
so the table is the same with and without ``-n``. Registered as a plugin by tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

PROPERTY = "fault_ledger"


@dataclasses.dataclass
class Row:
    fault: str
    test: str = ""
    injected: int = 0
    data_lost: int | None = None  # None: not measured
    stuck: int | None = None  # None: no flow run watched
    outcome: str = "running"  # passed / failed / error / skipped / xfailed
    reason: str = ""
    _watched: list = dataclasses.field(default_factory=list, repr=False)  # [(run ids, settings factory)]

    @property
    def survived(self) -> int | None:
        if self.outcome == "skipped":
            return None
        return self.injected if self.outcome == "passed" else 0

    def compare(self, before: Mapping, after: Mapping) -> int:
        """Count the entries of ``before`` that ``after`` lacks or holds with another value, as data lost.

        ``before`` / ``after``: e.g. :func:`checksums` of a directory before the fault and after it, or row
        counts by name. Returns the count (the test may assert it is 0 after this call: the row keeps it).
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
        if self.stuck is None:
            self.stuck = 0

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


def open_row(fault: str, *, injected: int = 0) -> Row:
    """A new row of the running test, counted from now on; open it before injecting the fault."""
    item = _current
    if item is None:
        raise RuntimeError("fault_ledger.open_row() is called from inside a test")
    if item.get_closest_marker("faults") is None:
        raise RuntimeError(f"{item.nodeid} injects faults: mark it @pytest.mark.faults (so `-m faults` runs it)")
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
            row.reason = f"stuck runs unknown: {type(exc).__name__}: {exc}"[:200]
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
            return ("failed" if when == "call" else "error"), f"{when} failed"
        if report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            return "skipped", reason.removeprefix("Skipped: ")
    return "passed", ""


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
            if row._watched:
                _measure_stuck(row)
    if report.when == "teardown":
        outcome, reason = _outcome(item.stash[_PHASES])
        if not rows and outcome == "skipped" and item.get_closest_marker("faults") is not None:
            rows = [Row(fault=f"({item.name})", test=item.nodeid)]
        for row in rows:
            row.outcome = outcome
            row.reason = row.reason or reason
        if rows:
            report.user_properties.append((PROPERTY, json.dumps([r.as_dict() for r in rows])))
    return report


ROWS: list[Row] = []


def pytest_runtest_logreport(report):
    """Runs in the process that reports (the controller under xdist): gather the rows each test carried."""
    if report.when != "teardown":
        return
    for name, value in report.user_properties:
        if name == PROPERTY:
            ROWS.extend(Row(**entry) for entry in json.loads(value))


def _cell(value) -> str:
    return "-" if value is None else str(value)


def table(rows: list[Row] | None = None) -> str:
    rows = sorted(ROWS if rows is None else rows, key=lambda r: (r.test, r.fault))
    header = ("fault", "injected", "survived", "data lost", "stuck runs", "outcome")
    lines = [
        (
            r.fault,
            str(r.injected),
            _cell(r.survived),
            _cell(r.data_lost),
            _cell(r.stuck),
            r.outcome.upper() if r.outcome in ("failed", "error") else r.outcome,
        )
        for r in rows
    ]

    def total(values) -> str:
        measured = [v for v in values if v is not None]
        return str(sum(measured)) if measured else "-"

    totals = (
        "total",
        str(sum(r.injected for r in rows)),
        total([r.survived for r in rows]),
        total([r.data_lost for r in rows]),
        total([r.stuck for r in rows]),
        ", ".join(f"{n} {o}" for o, n in _counts(rows)),
    )
    widths = [max(len(line[i]) for line in [header, *lines, totals]) for i in range(6)]

    def fmt(line) -> str:
        cells = [cell.ljust(w) if i in (0, 5) else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, lines), rule, fmt(totals)])


def _counts(rows: list[Row]) -> list[tuple[str, int]]:
    order = ["passed", "failed", "error", "xfailed", "skipped"]
    found = {o: sum(1 for r in rows if r.outcome == o) for o in order}
    return [(o, n) for o, n in found.items() if n]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not ROWS:  # an xdist worker: its controller prints the table
        return
    terminalreporter.write_sep("=", "faults injected / survived")
    terminalreporter.write_line(table())
    for row in sorted(ROWS, key=lambda r: (r.test, r.fault)):
        if row.outcome != "passed":
            terminalreporter.write_line(
                f"{row.outcome}: {row.fault}: {row.test}" + (f" ({row.reason})" if row.reason else "")
            )

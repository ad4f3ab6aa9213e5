"""The fault table cannot lose a row: an inner pytest session of small fault tests, and the table it prints.

Each way a faults test can end is in the inner session: passed, failed after injecting (its data lost shown),
failed or errored BEFORE opening a row (setup, call, teardown), skipped before and after opening, passed with
data lost, passed with stuck runs that could not be counted, passed without opening a row (made an error),
and, under pytest-xdist, a worker killed in the middle of a test. Every one shows exactly its rows. The same
table comes back from pytest-xdist workers, and NEMOFLOW_FAULT_TABLE_OUT saves it with the rows it came from.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO
from tests.support import fault_ledger
from tests.support.fault_ledger import Row
from tests.support.require import need

INNER = textwrap.dedent(
    """
    import pytest
    from tests.support import fault_ledger

    pytestmark = pytest.mark.faults


    def test_survives():
        row = fault_ledger.open_row("a fault it survives")
        row.injected += 2
        assert row.compare({"a": 1, "b": 2}, {"a": 1, "b": 2}) == 0


    def test_fails_after_injecting():
        row = fault_ledger.open_row("a fault that breaks it")
        row.injected_from(lambda: 3)  # read when the call ends, failed or not
        row.compare({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 20})  # b changed, c gone
        assert False, "the run did not tell the truth"


    def test_fails_before_opening():
        assert False, "broke before its row"


    @pytest.fixture
    def broken_setup():
        raise RuntimeError("setup broke")


    def test_setup_error(broken_setup):
        fault_ledger.open_row("never reached")


    @pytest.fixture
    def broken_teardown():
        yield
        raise RuntimeError("teardown broke")


    def test_teardown_error(broken_teardown):
        row = fault_ledger.open_row("a fault whose cleanup broke")
        row.injected += 1
        row.count_lost(0)


    def test_teardown_error_without_a_row(broken_teardown):
        pass


    def test_skipped_after_opening():
        row = fault_ledger.open_row("a fault it could not inject")
        pytest.skip("no tmpfs here (install X)")


    @pytest.fixture
    def service():
        pytest.skip("service missing (install Y)")


    def test_skipped_before_opening(service):
        fault_ledger.open_row("never opened")


    def test_passes_with_data_lost():
        row = fault_ledger.open_row("a fault that lost data the test did not check")
        row.injected += 1
        row.count_lost(1)


    def test_passes_with_stuck_unknown():
        row = fault_ledger.open_row("a fault whose runs could not be read")
        row.injected += 1

        def unreachable():
            raise ConnectionError("the Prefect API at 127.0.0.1:9 refused")

        row.watch_runs(["00000000-0000-0000-0000-000000000000"], unreachable)


    def test_passes_without_a_row():
        pass


    @pytest.mark.parametrize("n", [1, 4])
    def test_counted(n):
        row = fault_ledger.open_row(f"counted {n}")
        row.injected += n
    """
)
UNMARKED = textwrap.dedent(
    """
    import pytest
    from tests.support import fault_ledger


    def test_open_without_the_marker_is_refused():
        with pytest.raises(RuntimeError, match="mark it @pytest.mark.faults"):
            fault_ledger.open_row("unmarked")
    """
)
# Only under xdist: one process would die with it (and print nothing).
CRASH = textwrap.dedent(
    """
    import os, signal
    import pytest
    from tests.support import fault_ledger


    @pytest.mark.faults
    def test_worker_killed():
        row = fault_ledger.open_row("lost with its worker")
        row.injected += 1
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _run_inner(tmp_path, *args: str, crash: bool = False, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "test_unmarked.py").write_text(UNMARKED)
    if crash:
        (tmp_path / "test_crash.py").write_text(CRASH)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.support.fault_ledger"]\n')
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    faults: injects faults\naddopts = --strict-markers\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    env.pop("PYTEST_ADDOPTS", None)
    if not env_extra:
        env.pop(fault_ledger.TABLE_OUT_ENV, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", *args, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _table(stdout: str) -> dict[str, list[str]]:
    """{fault: [injected, survived, data lost, stuck runs, outcome]} from the printed table, and its total."""
    assert "faults injected / survived" in stdout, stdout
    section = stdout.split("faults injected / survived", 1)[1].splitlines()[1:]
    rules = [i for i, line in enumerate(section) if line.startswith("---")]
    header = re.split(r"\s{2,}", section[0].strip())
    assert header == ["fault", "injected", "survived", "data lost", "stuck runs", "outcome"], section[0]
    rows = {}
    for line in section[rules[0] + 1 : rules[1] + 2]:
        if not line.startswith("---"):
            cells = re.split(r"\s{2,}", line.strip())
            assert cells[0] not in rows, f"two rows named {cells[0]!r}"
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("workers", [None, "2"], ids=["one-process", "xdist"])
def test_every_faults_test_has_its_rows_whatever_happens(tmp_path, workers):
    if workers:
        need(importlib.util.find_spec("xdist"), "pytest-xdist", "pip install -c constraints.txt -e .[test]")
    run = _run_inner(tmp_path, *(["-n", workers] if workers else []), crash=bool(workers))
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    rows = _table(run.stdout)
    expected = {
        "a fault it survives": ["2", "2", "0", "-", "passed"],
        "a fault that breaks it": ["3", "0", "2", "-", "FAILED"],
        "(test_fails_before_opening)": ["0", "0", "-", "-", "FAILED"],
        "(test_setup_error)": ["0", "0", "-", "-", "ERROR"],
        "a fault whose cleanup broke": ["1", "0", "0", "-", "ERROR"],
        "(test_teardown_error_without_a_row)": ["0", "0", "-", "-", "ERROR"],
        "a fault it could not inject": ["0", "-", "-", "-", "skipped"],
        "(test_skipped_before_opening)": ["0", "-", "-", "-", "skipped"],
        "a fault that lost data the test did not check": ["1", "0", "1", "-", "passed"],
        "a fault whose runs could not be read": ["1", "0", "-", "unknown", "passed"],
        "(test_passes_without_a_row)": ["0", "0", "-", "-", "ERROR"],
        "counted 1": ["1", "1", "-", "-", "passed"],
        "counted 4": ["4", "4", "-", "-", "passed"],
    }
    total = ["13", "7", "3", "1 unknown", "5 passed, 2 failed, 4 error, 2 skipped"]
    if workers:
        expected["(test_worker_killed)"] = ["0", "0", "-", "-", "ERROR"]
        total = ["13", "7", "3", "1 unknown", "5 passed, 2 failed, 5 error, 2 skipped"]
    assert {k: v for k, v in rows.items() if k != "total"} == expected
    assert rows["total"] == total
    assert "never reached" not in out and "never opened" not in rows and "unmarked" not in rows
    # the reasons the table cannot show, one line per row that did not pass or did not survive
    assert "skipped: a fault it could not inject: " in out and "(no tmpfs here (install X))" in out
    assert "(service missing (install Y))" in out
    assert "failed: (test_fails_before_opening): " in out and "AssertionError: broke before its row" in out
    assert "error: (test_setup_error): " in out and "setup failed: RuntimeError: setup broke" in out
    assert "passed, not survived: a fault that lost data the test did not check: " in out and "(1 lost)" in out
    assert "stuck runs unknown: ConnectionError: the Prefect API at 127.0.0.1:9 refused" in out
    assert fault_ledger.NO_ROW in out  # why the row-less pass is an error
    if workers:
        assert "error: (test_worker_killed): " in out and "crashed" in out


def test_the_saved_table_is_the_printed_one_with_its_rows(tmp_path):
    saved = tmp_path / "out" / "fault-table.md"
    (tmp_path / "run").mkdir()
    run = _run_inner(tmp_path / "run", env_extra={fault_ledger.TABLE_OUT_ENV: str(saved)})
    assert run.returncode == 1, run.stdout + run.stderr
    text = saved.read_text()
    printed, rows = fault_ledger.read_document(text)
    assert len(rows) == 13
    assert printed == fault_ledger.table(rows)
    assert printed in run.stdout  # the file holds what the run printed
    assert "- commit: " in text and "- command: `pytest " in text and "pytest exit status 1" in text
    assert not list(saved.parent.glob(".*.tmp"))


def test_survived_counts_only_what_passed_lost_nothing_and_left_nothing_stuck():
    assert Row("f", injected=3, outcome="passed").survived == 3
    assert Row("f", injected=3, outcome="passed", data_lost=0, stuck=0).survived == 3
    assert Row("f", injected=3, outcome="passed", data_lost=1).survived == 0
    assert Row("f", injected=3, outcome="passed", stuck=1).survived == 0
    assert Row("f", injected=3, outcome="passed", stuck_unknown="ConnectError").survived == 0
    assert Row("f", injected=3, outcome="failed").survived == 0
    assert Row("f", injected=3, outcome="xfailed").survived == 0
    assert Row("f", injected=3, outcome="skipped").survived is None
    assert "2 stuck" in Row("f", injected=1, outcome="passed", stuck=2).why_not


def test_the_committed_fault_table_is_what_the_ledger_prints_for_its_rows():
    """docs/fault-table.md: the saved output of a run; its table must be table() of the rows saved with it."""
    path = REPO / "docs" / "fault-table.md"
    text = path.read_text()
    printed, rows = fault_ledger.read_document(text)
    assert rows, f"{path} saves no rows"
    assert printed == fault_ledger.table(rows), f"{path}: the table is not what the ledger prints for its rows"
    assert re.search(r"^- commit: [0-9a-f]{7,}", text, re.M), f"{path} names no commit"
    notes = [line.removeprefix("- ") for line in text.splitlines() if line.startswith("- ") and ": " in line]
    for line in fault_ledger.notes(rows):
        assert line in notes, f"{path} lacks the note {line!r}"

"""The fault table measures: an inner pytest session of small fault tests, and the table it prints.

A test that fails after injecting shows its faults as not survived, with the data it found lost; a skipped
test shows its row as skipped; a faults test skipped before it opened a row still shows one; a test that
injects without the ``faults`` marker errors. The same table comes back from pytest-xdist workers.
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
        row.injected += 3
        row.compare({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 20})  # b changed, c gone
        assert False, "the run did not tell the truth"


    def test_skipped_after_opening():
        row = fault_ledger.open_row("a fault it could not inject")
        pytest.skip("no tmpfs here (install X)")


    @pytest.fixture
    def service():
        pytest.skip("service missing (install Y)")


    def test_skipped_before_opening(service):
        fault_ledger.open_row("never opened")


    @pytest.fixture
    def broken_teardown():
        yield
        raise RuntimeError("teardown broke")


    def test_teardown_error(broken_teardown):
        row = fault_ledger.open_row("a fault whose cleanup broke")
        row.injected += 1
        row.count_lost(0)


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


def _run_inner(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "test_unmarked.py").write_text(UNMARKED)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.support.fault_ledger"]\n')
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    faults: injects faults\naddopts = --strict-markers\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTEST_ADDOPTS", None)
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
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("workers", [None, "2"], ids=["one-process", "xdist"])
def test_a_failing_fault_test_shows_a_failed_row(tmp_path, workers):
    if workers:
        need(importlib.util.find_spec("xdist"), "pytest-xdist", "pip install -c constraints.txt -e .[test]")
    run = _run_inner(tmp_path, *(["-n", workers] if workers else []))
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed, one errored in teardown
    rows = _table(run.stdout)
    assert rows["a fault it survives"] == ["2", "2", "0", "-", "passed"]
    assert rows["a fault that breaks it"] == ["3", "0", "2", "-", "FAILED"]
    assert rows["a fault it could not inject"] == ["0", "-", "-", "-", "skipped"]
    assert rows["(test_skipped_before_opening)"] == ["0", "-", "-", "-", "skipped"]
    assert rows["a fault whose cleanup broke"] == ["1", "0", "0", "-", "ERROR"]
    assert rows["counted 1"] == ["1", "1", "-", "-", "passed"]
    assert rows["counted 4"] == ["4", "4", "-", "-", "passed"]
    assert "never opened" not in rows and "unmarked" not in rows
    assert rows["total"] == ["11", "7", "2", "-", "3 passed, 1 failed, 1 error, 2 skipped"]
    assert "skipped: a fault it could not inject: " in run.stdout and "(no tmpfs here (install X))" in run.stdout
    assert "(service missing (install Y))" in run.stdout

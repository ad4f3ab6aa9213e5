"""SlurmCLI's retries (tenacity, infra.retry): a busy controller is retried, a wrong command is not.

The commands are real processes: a ``squeue`` earlier on PATH that answers like a busy or unreachable
slurmctld for its first calls, counts every call in a file, and otherwise runs Debian's real squeue.
No controller is needed: the real squeue fails on a bad option before it asks one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from infra.slurm.commands import SlurmCLI, SlurmCommandError, SlurmUnavailable
from tests.support.require import need

REAL_SQUEUE = shutil.which("squeue")


@pytest.fixture(autouse=True)
def _real_squeue():
    """Slurm's client tools, which the test command installs: a skip here outside CI, a failure under CI=true."""
    need(REAL_SQUEUE, "Slurm's client tools (squeue)", "apt-get install slurm-client (scripts/setup.sh --test)")


WRAPPER = """#!/bin/sh
echo call >> {calls}
n=$(wc -l < {calls})
if [ "$n" -le {failures} ]; then
    {fail}
fi
exec {real} "$@"
"""


def _squeue(tmp_path: Path, failures: int, fail: str) -> tuple[dict[str, str], Path]:
    """A PATH whose ``squeue`` does ``fail`` for its first ``failures`` calls; and the file counting calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    calls.touch()
    script = bin_dir / "squeue"
    script.write_text(WRAPPER.format(calls=calls, failures=failures, fail=fail, real=REAL_SQUEUE))
    script.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"), calls


def _calls(calls: Path) -> int:
    return len(calls.read_text().splitlines())


BUSY = 'echo "squeue: error: Socket timed out on send/recv operation" >&2; exit 1'
UNREACHABLE = 'echo "slurm_load_jobs error: Unable to contact slurm controller (connect failure)" >&2; exit 1'


def test_a_busy_controller_is_retried_until_it_answers(tmp_path):
    env, calls = _squeue(tmp_path, failures=2, fail=BUSY)
    out = SlurmCLI(retries=3, retry_delay_s=0.01).run(["squeue", "--version"], env=env)
    assert out == subprocess.run([REAL_SQUEUE, "--version"], capture_output=True, text=True, check=True).stdout
    assert _calls(calls) == 3


def test_a_wrong_command_fails_at_once_with_squeues_message(tmp_path):
    env, calls = _squeue(tmp_path, failures=0, fail=BUSY)
    with pytest.raises(SlurmCommandError, match=r"\(exit 1\): \S*squeue: unrecognized option '--no-such-option'"):
        SlurmCLI(retries=3, retry_delay_s=0.01).run(["squeue", "--no-such-option"], env=env)
    assert _calls(calls) == 1


def test_an_unreachable_controller_is_retried_then_named(tmp_path):
    env, calls = _squeue(tmp_path, failures=99, fail=UNREACHABLE)
    with pytest.raises(SlurmUnavailable, match="the Slurm controller is unreachable: .*Unable to contact"):
        SlurmCLI(retries=2, retry_delay_s=0.01).run(["squeue", "--version"], env=env)
    assert _calls(calls) == 3


def test_a_command_that_does_not_answer_is_retried_then_named(tmp_path):
    env, calls = _squeue(tmp_path, failures=99, fail="exec sleep 5")
    with pytest.raises(SlurmUnavailable, match=r"`squeue` did not answer within 0s"):
        SlurmCLI(retries=1, retry_delay_s=0.01, timeout_s=0.3).run(["squeue", "--version"], env=env)
    assert _calls(calls) == 2

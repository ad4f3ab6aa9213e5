"""The code style is checked, not hoped for: ruff (pinned in pyproject) formats and lints the tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"


def test_ruff_format_and_lint_are_clean():
    formatted = subprocess.run([str(RUFF), "format", "--check", "."], cwd=REPO, capture_output=True, text=True)
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
    linted = subprocess.run([str(RUFF), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_every_noqa_says_why():
    listed = subprocess.run(["git", "grep", "-n", "noqa", "--", "*.py"], cwd=REPO, capture_output=True, text=True)
    bare = [line for line in listed.stdout.splitlines() if "# noqa" in line and " - " not in line.split("# noqa", 1)[1]]
    assert not bare, "noqa without a reason:\n" + "\n".join(bare)
    # the pattern is spelled so that it does not match this line itself
    skips = subprocess.run(["git", "grep", "-n", "fmt[:] skip"], cwd=REPO, capture_output=True, text=True)
    assert skips.stdout == "", skips.stdout

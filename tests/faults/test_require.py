"""tests/support/require.py: a missing service or tool skips the test saying what to install, and fails it
under CI=true (where the test command installs everything, so a skip would hide a broken install)."""

from __future__ import annotations

import pytest

from tests.support.require import need


def test_missing_tool_skips_outside_ci_and_fails_under_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"^needs mksquashfs: apt-get install squashfs-tools$"):
        need(None, "mksquashfs", "apt-get install squashfs-tools")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"^CI=true and this test needs mksquashfs: apt-get install"):
        need("", "mksquashfs", "apt-get install squashfs-tools")
    need("/usr/bin/mksquashfs", "mksquashfs", "apt-get install squashfs-tools")  # present: the test goes on

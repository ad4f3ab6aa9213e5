"""Explicit modes for what nemoflow writes (infra/permissions.py), whatever umask a process inherited."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys

import pytest

from infra import permissions, storage
from infra.settings import PermissionPolicyError, SettingsError, parse_umask, reload_settings
from tests.conftest import REPO
from tests.support.require import need


@contextlib.contextmanager
def inherited_umask(value: int):
    """Run the block as a process started with ``value`` as its umask would."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def policy_env(monkeypatch):
    def set_policy(umask: str | None = None, group: str | None = None) -> None:
        for name, value in (("NEMOFLOW_UMASK", umask), ("NEMOFLOW_GROUP", group)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        reload_settings()

    yield set_policy
    monkeypatch.delenv("NEMOFLOW_UMASK", raising=False)
    monkeypatch.delenv("NEMOFLOW_GROUP", raising=False)
    reload_settings()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_umask_values():
    assert parse_umask("027") == 0o027 and parse_umask("0o007") == 0o007 and parse_umask("0022") == 0o022
    for bad, why in (("000", "world-writable"), ("020", "world-writable"), ("627", "own files"), ("9", "octal")):
        with pytest.raises(PermissionPolicyError, match=why):
            parse_umask(bad)


def test_an_invalid_setting_fails_in_one_line_naming_the_variable(policy_env):
    with pytest.raises(SettingsError) as info:
        policy_env(umask="000")
    message = str(info.value)
    assert message.startswith("NEMOFLOW_UMASK='000' is invalid") and "world-writable" in message
    assert "\n" not in message
    with pytest.raises(SettingsError, match=r"NEMOFLOW_GROUP='no-such-team-group' is invalid: .*no group"):
        policy_env(group="no-such-team-group")


def test_storage_writes_get_the_configured_modes_under_a_permissive_umask(policy_env, tmp_path):
    policy_env()  # the default, 027
    target = tmp_path / "work" / "datasets" / "demo"
    with inherited_umask(0):
        storage.write_text(str(target / "blend.json"), "[]")
        with storage.atomic_open(str(target / "manifest.json"), "w") as fh:
            fh.write("{}")
        source = tmp_path / "private.bin"
        source.write_bytes(b"x")
        source.chmod(0o600)  # what mkstemp makes
        storage.put_file(str(source), str(target / "copy.bin"))
    assert [mode(target / n) for n in ("blend.json", "manifest.json", "copy.bin")] == [0o640] * 3
    assert [mode(p) for p in (tmp_path / "work", tmp_path / "work" / "datasets", target)] == [0o750] * 3
    # a directory that already existed keeps what its owner chose
    before = mode(tmp_path)
    storage.makedirs(str(tmp_path))
    assert mode(tmp_path) == before


def test_a_team_group_owns_every_directory_and_what_anyone_writes_below(policy_env, tmp_path):
    import grp

    need(os.geteuid() == 0, "root (to give files to another group)", "run the tests as root, as CI does")
    team = grp.getgrnam("users").gr_gid
    assert team != os.getegid()
    policy_env(umask="007", group="users")
    with inherited_umask(0):
        storage.write_text(str(tmp_path / "work" / "registry" / "registry.json"), "{}")
    registry = tmp_path / "work" / "registry"
    assert (mode(registry), os.stat(registry).st_gid) == (0o2770, team)
    assert (mode(registry / "registry.json"), os.stat(registry / "registry.json").st_gid) == (0o660, team)
    # a library that writes below with plain os.makedirs/open (AutoModel) inherits the group
    with inherited_umask(0o007):
        os.makedirs(registry / "by-a-library" / "deeper")
        (registry / "by-a-library" / "deeper" / "f").write_text("x")
    assert os.stat(registry / "by-a-library" / "deeper" / "f").st_gid == team
    assert mode(registry / "by-a-library" / "deeper") & stat.S_ISGID


def test_job_writers_set_the_mode_themselves(policy_env, tmp_path):
    import numpy as np

    from workloads import checkpoint
    from workloads.indexed_dataset import DType, IndexedDatasetWriter

    policy_env(umask="007")
    with inherited_umask(0):
        with IndexedDatasetWriter(str(tmp_path / "part_text_document"), DType.for_vocab_size(32000)) as writer:
            writer.add_documents(np.arange(5, dtype=np.uint16), np.array([5]), np.array([1]))
        consolidated = tmp_path / "run" / "checkpoints" / "epoch_0_step_1" / "model" / "consolidated"
        consolidated.mkdir(parents=True)
        script = consolidated.parent / "consolidate.sh"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)  # what AutoModel does, whatever the umask
        checkpoint.write_meta(consolidated, {"step": 2}, None)
        checkpoint.write_manifest(consolidated)
    assert {mode(tmp_path / f"part_text_document.{ext}") for ext in ("bin", "idx")} == {0o660}
    assert {mode(consolidated / n) for n in ("meta.json", "MANIFEST.json")} == {0o660}
    assert mode(script) == 0o770  # executable stays executable, for the owner and group only


def test_every_job_process_starts_with_the_configured_umask():
    """`python -m workloads.X` imports the package first: its umask is set before any library writes."""
    probe = [sys.executable, "-c", "import os, workloads; print(oct(os.umask(0)))"]

    def run(**env):
        merged = {k: v for k, v in os.environ.items() if k not in ("NEMOFLOW_UMASK", "NEMOFLOW_GROUP")}
        proc = subprocess.run(
            probe,
            cwd=REPO,
            env={**merged, **env},
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=lambda: os.umask(0),
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert run() == "0o27"
    assert run(NEMOFLOW_UMASK="007") == "0o7"
    # an invalid value never leaves the inherited 000: the default applies until the settings are read
    assert run(NEMOFLOW_UMASK="000") == "0o27"


def test_secure_file_keeps_execute_bits_only_where_the_umask_allows(tmp_path):
    path = tmp_path / "tool.sh"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o777)
    permissions.secure_file(path, permissions.Policy(umask=0o027))
    assert mode(path) == 0o750
    path.chmod(0o600)
    permissions.secure_file(path, permissions.Policy(umask=0o022))
    assert mode(path) == 0o644

"""The enroot import job: rendered script, credentials handling, fail-fast without enroot, local Slurm."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from infra import images
from infra.backends.local import LocalBackend
from infra.images import EnrootNotFound, ImageError, RegistryCredentialsError, convert_image, plan_conversion
from tests.slurm.conftest import slurm_cluster  # noqa: F401 - the fixture (skips, or fails under CI=true)
from tests.support.require import need

from .conftest import leftovers

SECRET = "nvapi-TEST-4f7c2b9e0d1a6c3b8e5f"

# enroot is not packaged for Debian, so a job that must *succeed* uses this
# stand-in: it reports what the job handed it (credentials file, modes,
# environment) and builds a real squashfs image with mksquashfs.
ENROOT_STAND_IN = r"""#!/usr/bin/env bash
set -euo pipefail
case "$1" in
  version) echo "3.5.0-nemoflow-test" ;;
  import)
    out="$3"; uri="$4"
    creds="${ENROOT_CONFIG_PATH}/.credentials"
    {
      echo "uri=$uri"
      echo "config=$ENROOT_CONFIG_PATH"
      if [ -e "$creds" ]; then
        echo "mode=$(stat -c %a "$creds")"
        echo "creds_sha256=$(sha256sum < "$creds" | cut -d' ' -f1)"
      fi
      echo "dirmode=$(stat -c %a "$ENROOT_CONFIG_PATH")"
      echo "password_in_env=${NEMOFLOW_REGISTRY_PASSWORD:+yes}"
    } > "$NEMOFLOW_TEST_ENROOT_RECORD"
    if [ -n "${NEMOFLOW_TEST_ENROOT_FAIL:-}" ]; then
      head -c 5000 /dev/urandom > "$out"
      echo "[ERROR] URL https://nvcr.io/v2/ returned error code: 401 Unauthorized" >&2
      exit 1
    fi
    mksquashfs "$NEMOFLOW_TEST_ROOTFS" "$out" -noappend -quiet -no-progress
    ;;
  *) echo "unexpected enroot call: $*" >&2; exit 3 ;;
esac
"""


def read_record(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.fixture
def stand_in_enroot(tmp_path, monkeypatch, kjv_chapters):
    need(shutil.which("mksquashfs"), "mksquashfs", "apt-get install squashfs-tools (scripts/setup.sh --test)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    enroot = bin_dir / "enroot"
    enroot.write_text(ENROOT_STAND_IN)
    enroot.chmod(0o755)
    rootfs = tmp_path / "rootfs"
    (rootfs / "workspace").mkdir(parents=True)
    (rootfs / "workspace" / "README.txt").write_text(kjv_chapters[1])
    record = tmp_path / "enroot-record.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NEMOFLOW_TEST_ENROOT_RECORD", str(record))
    monkeypatch.setenv("NEMOFLOW_TEST_ROOTFS", str(rootfs))
    return record


# ---------------------------------------------------------------- the rendered job


def test_script_carries_no_credentials(registry_env, tmp_path):
    registry_env(NEMOFLOW_REGISTRY_PASSWORD=SECRET, NEMOFLOW_REGISTRY_USER="$oauthtoken")
    plan = plan_conversion("docker://nvcr.io/nvidia/nemo:25.02", str(tmp_path / "images"))
    assert SECRET not in plan.script
    assert SECRET not in plan.spec.model_dump_json()
    assert set(plan.spec.secret_env) == {"NEMOFLOW_REGISTRY_USER", "NEMOFLOW_REGISTRY_PASSWORD"}
    assert "'docker://nvcr.io#nvidia/nemo:25.02'" in plan.script
    assert "machine %s login %s password %s" in plan.script and "authn.nvidia.com" in plan.script
    assert plan.spec.command == ["bash", plan.script_uri]
    subprocess.run(["bash", "-n"], input=plan.script, text=True, check=True)  # valid bash
    assert not (tmp_path / "images").exists()  # planning writes nothing


def test_anonymous_registry_renders_without_credentials(registry_env, tmp_path):
    plan = plan_conversion("docker://ghcr.io/org/tool:1.0", str(tmp_path))
    assert plan.spec.secret_env == []
    assert "/.credentials" not in plan.script and "Anonymous pull" in plan.script


def test_private_registry_without_credentials_fails_before_submitting(registry_env, tmp_path):
    dest = tmp_path / "images"
    with pytest.raises(RegistryCredentialsError, match="nvcr.io needs credentials .*NEMOFLOW_REGISTRY_PASSWORD"):
        convert_image("docker://nvcr.io/nvidia/nemo:25.02", str(dest), backend=LocalBackend())
    assert leftovers(dest) == []  # no script written, no job run
    registry_env(NEMOFLOW_REGISTRY_USER="robot")
    with pytest.raises(RegistryCredentialsError, match="NEMOFLOW_REGISTRY_USER is set but NEMOFLOW_REGISTRY_PASSWORD"):
        plan_conversion("docker://ghcr.io/org/tool:1.0", str(dest))
    registry_env(NEMOFLOW_REGISTRY_PASSWORD="two words")
    with pytest.raises(RegistryCredentialsError, match="white space") as info:
        plan_conversion("docker://ghcr.io/org/tool:1.0", str(dest))
    assert "two words" not in str(info.value)


def test_job_options_need_convert(capsys):
    from nemoflow.cli import main

    assert main(["stage-image", "x.sqsh", "--partition", "cpu", "--no-prefect"]) == 2
    assert "add --convert" in capsys.readouterr().err


def test_conversion_needs_a_shared_path(registry_env, gcs_bucket):
    with pytest.raises(ImageError, match="must be a shared file system path"):
        plan_conversion("docker://ghcr.io/org/tool:1.0", f"{gcs_bucket}/images")


# ---------------------------------------------------------------- running it


def test_missing_enroot_fails_fast_and_clearly(registry_env, tmp_path):
    if shutil.which("enroot"):
        pytest.skip("enroot is installed here")
    registry_env(NEMOFLOW_REGISTRY_PASSWORD=SECRET)
    dest = tmp_path / "images"
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(EnrootNotFound, match=r"enroot not found on the node \(install enroot \+ pyxis, or stage"):
        convert_image("docker://nvcr.io/nvidia/nemo:25.02", str(dest), backend=LocalBackend(), log=lines.append)
    assert time.monotonic() - started < 10
    assert not any(p.endswith(".sqsh") for p in leftovers(dest))
    assert SECRET not in "\n".join(lines)


def test_import_job_with_credentials_end_to_end(registry_env, tmp_path, stand_in_enroot):
    """Through the local backend: private credentials file, cleanup, verified rename, sidecar, cache."""
    registry_env(NEMOFLOW_REGISTRY_PASSWORD=SECRET)
    dest = tmp_path / "images"
    lines: list[str] = []
    staged = convert_image("docker://nvcr.io/nvidia/nemo:25.02", str(dest), backend=LocalBackend(), log=lines.append)

    record = read_record(stand_in_enroot)
    assert record["uri"] == "docker://nvcr.io#nvidia/nemo:25.02"
    assert record["mode"] == "600" and record["dirmode"] == "700"
    expected = "".join(
        f"machine {host} login $oauthtoken password {SECRET}\n" for host in ("nvcr.io", "authn.nvidia.com")
    )
    assert record["creds_sha256"] == hashlib.sha256(expected.encode()).hexdigest()
    assert record["password_in_env"] == ""  # unset before enroot runs
    assert not Path(record["config"]).exists()  # the private config is gone

    final = dest / "nvcr.io+nvidia+nemo+25.02.sqsh"
    assert staged.uri == str(final) and final.exists()
    assert staged.checksum == "sha256:" + hashlib.sha256(final.read_bytes()).hexdigest()
    assert images.read_superblock(str(final)).inodes >= 2
    meta = json.loads((dest / "nvcr.io+nvidia+nemo+25.02.sqsh.meta.json").read_text())
    assert meta["source"] == "nvcr.io/nvidia/nemo:25.02"
    assert not [p for p in leftovers(dest) if ".tmp-" in p]
    everything = "\n".join(lines) + "".join(p.read_text() for p in dest.rglob("*") if p.suffix in (".sh", ".json"))
    assert SECRET not in everything

    stand_in_enroot.unlink()
    again = convert_image("docker://nvcr.io/nvidia/nemo:25.02", str(dest), backend=LocalBackend())
    assert again.cached and not stand_in_enroot.exists()  # no job ran


def test_failed_import_leaves_no_image(registry_env, tmp_path, stand_in_enroot, monkeypatch):
    monkeypatch.setenv("NEMOFLOW_TEST_ENROOT_FAIL", "1")
    dest = tmp_path / "images"
    failed = r"(?s)enroot import of docker.io/library/ubuntu:22.04 failed.*401 Unauthorized"
    with pytest.raises(ImageError, match=failed):
        convert_image("docker://ubuntu:22.04", str(dest), backend=LocalBackend())
    assert not any(p.endswith(".sqsh") for p in leftovers(dest))


@pytest.mark.slurm
def test_missing_enroot_on_slurm_node_fails_clearly(registry_env, tmp_path, capsys, slurm_cluster):  # noqa: F811 - fixture
    """Submitted to the local Slurm cluster, whose node has no enroot: a clear failure, fast."""
    if shutil.which("enroot"):
        pytest.skip("enroot is installed on this node")
    registry_env(NEMOFLOW_REGISTRY_PASSWORD=SECRET)
    dest = tmp_path / "images"
    if importlib.util.find_spec("infra.backends.slurm") is not None:
        from nemoflow.cli import main

        started = time.monotonic()
        code = main(
            [
                "stage-image",
                "docker://nvcr.io/nvidia/nemo:25.02",
                "--convert",
                "--dest",
                str(dest),
                "--no-prefect",
                "--cpus-per-task",
                "1",
                "--time",
                "00:05:00",
            ]
        )
        err = capsys.readouterr().err
        assert code == 2
        assert "enroot not found on the node (install enroot + pyxis, or stage a prebuilt .sqsh)" in err
        assert re.search(r"\(slurm job \d+\)", err)
        assert time.monotonic() - started < 60  # failed fast, did not hang
        assert not any(p.endswith(".sqsh") for p in leftovers(dest))
        assert SECRET not in err + "".join(p.read_text() for p in dest.rglob("*") if p.is_file())
        return
    # The Slurm backend is not in this tree yet: submit the rendered script with sbatch directly.
    plan = plan_conversion("docker://nvcr.io/nvidia/nemo:25.02", str(dest))
    Path(plan.script_uri).parent.mkdir(parents=True)
    Path(plan.script_uri).write_text(plan.script)
    log = dest / "job.out"
    env = dict(os.environ, NEMOFLOW_REGISTRY_PASSWORD=SECRET)
    done = subprocess.run(
        ["sbatch", "--wait", "--parsable", "-J", plan.spec.name, "-o", str(log), "-t", "00:02:00", plan.script_uri],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert images.ENROOT_MISSING in log.read_text()
    assert SECRET not in log.read_text() and SECRET not in Path(plan.script_uri).read_text()

"""The demo redeploys when the checkout moved: the deployments' pull step names the checkout's directory, so a
clone elsewhere that reused the stamp of the first crashed every run ("No such file or directory: '/check/...'")."""

from __future__ import annotations

import shutil
import subprocess

from devtools import prefect_local
from devtools.prefect_local import PrefectApi


def test_a_clone_at_another_path_does_not_reuse_the_deployment_stamp(tmp_path, monkeypatch):
    api = PrefectApi("http://127.0.0.1:4200/api")
    here = prefect_local._deployed_fingerprint(api)
    assert prefect_local._deployed_fingerprint(api) == here  # stable for the same checkout
    clone = tmp_path / "elsewhere"
    clone.mkdir()
    shutil.copy(prefect_local.REPO_ROOT / "prefect.yaml", clone / "prefect.yaml")  # the same prefect.yaml
    monkeypatch.setattr(prefect_local, "REPO_ROOT", clone)
    assert prefect_local._deployed_fingerprint(api) != here


def test_a_failed_background_deploy_says_why_in_one_line_and_leaves_no_stamp(tmp_path):
    """The demo deploys the rest of prefect.yaml beside its run; when that fails, the demo's last lines say so (with
    the deploy's last line and its log) and the next demo deploys again (no stamp)."""
    log = tmp_path / "deploy.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["sh", "-c", "echo Deploying; echo 'work pool nemoflow-k8s not found' >&2; exit 3"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    stamp = tmp_path / "deployed.sha256"
    said: list[str] = []
    assert prefect_local.PendingDeploy(proc, stamp, "f" * 64, log).wait(echo=said.append) is False
    assert said == [f"error: `prefect deploy --all` failed (exit 3): work pool nemoflow-k8s not found (log {log})"]
    assert not stamp.exists()
    with open(log, "w") as out:
        proc = subprocess.Popen(["true"], stdout=out)
    assert prefect_local.PendingDeploy(proc, stamp, "f" * 64, log).wait(echo=said.append) is True
    assert stamp.read_text() == "f" * 64 and said[-1] == "deployed prefect.yaml (every deployment)"

"""The demo redeploys when the checkout moved: the deployments' pull step names the checkout's directory, so a
clone elsewhere that reused the stamp of the first crashed every run ("No such file or directory: '/check/...'")."""

from __future__ import annotations

import shutil

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

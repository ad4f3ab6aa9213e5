"""`nemoflow render --backend k8s` from a machine that ran the demo (issue 26).

The demo leaves its dataset under the default work dir, ~/.nemoflow/work, which no pod can see; the
README's first Kubernetes command failed there ("the Kubernetes backend mounts only paths inside the
workspace PVC"). Left at its default, the work dir becomes the k8s deployments' /nemo-workspace/nemoflow;
one the user set outside the PVC is refused in one line naming NEMOFLOW_WORK_DIR.
"""

from __future__ import annotations

import json
import os
import subprocess

import yaml

from tests.conftest import REPO, VENV_BIN


def _render(home, out, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("NEMOFLOW_")}
    base.update(HOME=str(home), PYTHONPATH=str(REPO), **env)
    return subprocess.run(
        [str(VENV_BIN / "nemoflow"), "render", "--backend", "k8s", "--out", str(out)],
        cwd=home,
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_default_work_dir_renders_on_the_workspace_pvc(tmp_path):
    home = tmp_path / "home"
    demo = home / ".nemoflow" / "work" / "datasets" / "demo"
    demo.mkdir(parents=True)  # what the demo leaves behind (its dataset directory)
    (demo / "manifest.json").write_text(json.dumps({"parts": []}))
    proc = _render(home, tmp_path / "manifests")
    assert proc.returncode == 0, proc.stderr
    assert "NEMOFLOW_WORK_DIR=/nemo-workspace/nemoflow" in proc.stderr
    files = {p.name: yaml.safe_load(p.read_text()) for p in (tmp_path / "manifests").glob("*.yaml")}
    tokenize = files["job-nemoflow-tokenize.yaml"]
    mounts = [m["mountPath"] for c in tokenize["spec"]["template"]["spec"]["containers"] for m in c["volumeMounts"]]
    assert "/nemo-workspace/nemoflow/datasets/demo" in mounts, mounts
    text = "".join(p.read_text() for p in (tmp_path / "manifests").glob("*.yaml"))
    assert str(home) not in text  # nothing points at the machine's home


def test_work_dir_set_outside_the_pvc_names_the_variable(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    proc = _render(home, tmp_path / "manifests", NEMOFLOW_WORK_DIR=str(tmp_path / "work"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"NEMOFLOW_WORK_DIR={tmp_path / 'work'} is outside the workspace PVC (/nemo-workspace)" in lines[0]
    assert "set NEMOFLOW_WORK_DIR=/nemo-workspace/nemoflow" in lines[0]
    assert not (tmp_path / "manifests").exists()

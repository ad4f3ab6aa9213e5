"""Every secret the settings know, set at once: none reaches what a run would submit (issue #17, item 1).

`nemoflow render` writes what a run submits, through the stages' own builders and the backend that
submits them: the sbatch scripts, the Kubernetes manifests, the local shell scripts. The endpoint's
key, HF_TOKEN, WANDB_API_KEY and the registry login must travel by name only.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from nemoflow.cli import main as cli

SECRETS = {
    "NEMOFLOW_SERVE_API_KEY": "sk-SENTINEL-" + uuid.uuid4().hex,
    "HF_TOKEN": "hf_SENTINEL" + uuid.uuid4().hex,
    "WANDB_API_KEY": "wandbSENTINEL" + uuid.uuid4().hex,
    "NEMOFLOW_REGISTRY_USER": "userSENTINEL" + uuid.uuid4().hex[:8],
    "NEMOFLOW_REGISTRY_PASSWORD": "nvapi-SENTINEL" + uuid.uuid4().hex,
}


@pytest.fixture
def every_secret(monkeypatch, tmp_path):
    from infra.settings import reload_settings

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NEMOFLOW_WORK_DIR", str(tmp_path / "work"))
    reload_settings()
    yield
    monkeypatch.undo()
    reload_settings()


def _render(tmp_path: Path, backend: str, config: dict, capsys) -> dict[str, str]:
    out = tmp_path / backend
    path = tmp_path / f"{backend}.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli(["render", "--backend", backend, "--out", str(out), "--config", str(path)]) == 0
    printed = capsys.readouterr()
    files = {p.name: p.read_text() for p in sorted(out.iterdir())}
    files["(printed)"] = printed.out + printed.err
    return files


@pytest.mark.parametrize("backend", ["slurm", "k8s", "local"])
def test_no_secret_value_in_what_a_run_submits(every_secret, tmp_path, capsys, monkeypatch, backend):
    if backend == "k8s":  # pods see the workspace PVC only (nothing is written there: render names the demo data)
        from infra.settings import reload_settings

        monkeypatch.setenv("NEMOFLOW_WORK_DIR", "/nemo-workspace/nemoflow")
        reload_settings()
    config = {"image": {"source": "python-env"}} if backend == "slurm" else {}
    files = _render(tmp_path, backend, config, capsys)
    leaks = [f"{name} in {file}" for file, text in files.items() for name, value in SECRETS.items() if value in text]
    assert leaks == []
    # ... while the endpoint still gets its key, by name
    server = next(text for name, text in files.items() if "workloads.serve" in text and name != "(printed)")
    if backend != "k8s":
        assert "--api-key-env NEMOFLOW_SERVE_API_KEY" in server
        return
    (container,) = yaml.safe_load(server)["spec"]["template"]["spec"]["containers"]
    command = container["command"] + container.get("args", [])
    assert command[command.index("--api-key-env") + 1] == "NEMOFLOW_SERVE_API_KEY"
    key = next(e for e in container["env"] if e["name"] == "NEMOFLOW_SERVE_API_KEY")
    assert "value" not in key and key["valueFrom"]["secretKeyRef"]["key"] == "NEMOFLOW_SERVE_API_KEY"

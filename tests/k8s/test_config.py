"""Where the backend finds the API: a kubeconfig file, KUBECONFIG, a Prefect KubernetesCredentials block."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from infra.backends.k8s import KubernetesBackend
from infra.jobs import JobSpec, JobState
from infra.k8s.config import KubeConfigError, api_client


def kubeconfig(url: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "ci", "user": {"token": "not-a-real-token"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "ci"}}],
    }


def test_kubeconfig_file_and_env(tmp_path, monkeypatch):
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(kubeconfig("http://127.0.0.1:6443")))
    assert api_client(kubeconfig=str(path)).configuration.host == "http://127.0.0.1:6443"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert api_client().configuration.host == "http://127.0.0.1:6443"


def test_missing_configuration_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(KubeConfigError, match=f"kubeconfig {tmp_path}/nope does not exist"):
        api_client(kubeconfig=str(tmp_path / "nope"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(KubeConfigError, match="set KUBECONFIG or name a Prefect KubernetesCredentials block"):
        api_client()


async def test_prefect_credentials_block_drives_a_run(ready, k8s_options):
    """A KubernetesCredentials block (as the work pool's worker uses) gives the backend its API.
    Saving and loading the block by name is Prefect's part and needs a server; not repeated here."""
    from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

    from infra.k8s.config import client_from_credentials

    block = KubernetesCredentials(
        cluster_config=KubernetesClusterConfig(config=kubeconfig(ready.url), context_name="kmock")
    )
    backend = KubernetesBackend(
        k8s_options, api_client=client_from_credentials(block), watch_timeout_s=0.5, backoff_s=0.05
    )
    spec = JobSpec(name="blk", command=["true"], container_image="nvcr.io/nvidia/nemo:25.02")
    result = await asyncio.to_thread(backend.run, spec)
    assert result.state is JobState.COMPLETED
    assert backend.api.configuration.host == ready.url

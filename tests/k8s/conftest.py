from __future__ import annotations

import pytest
import pytest_asyncio

from infra.backends.k8s import KubernetesBackend
from infra.k8s.config import api_client_for_url
from infra.k8s.options import K8sOptions
from tests.image_build.fixtures import nemoflow_image  # noqa: F401 - a fixture, used by name (podman tests)
from tests.k8s.controller import FakeCluster
from tests.support.kube import KubeApi

NAMESPACE = "team"
# Values that must never show up in a manifest, a log line or an error.
SECRET_VALUES = {"HF_TOKEN": "hf_SENTINELsecretVALUE123", "WANDB_API_KEY": "wandbSENTINEL0987654321"}


@pytest.fixture
def k8s_options() -> K8sOptions:
    return K8sOptions(
        namespace=NAMESPACE,
        pvc_name="workspace",
        secret_name="nemoflow-secrets",
        scheduler_name="runai-scheduler",
        service_account="nemoflow",
    )


@pytest_asyncio.fixture
async def cluster(kmock):
    fake = FakeCluster(kmock, NAMESPACE)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
def ready(cluster):
    """A namespace with everything a run needs: the PVC, the secrets, two GPU nodes."""
    cluster.add_namespace()
    cluster.add_pvc("workspace")
    cluster.add_service_account("nemoflow")
    cluster.add_secret("nemoflow-secrets", SECRET_VALUES)
    cluster.add_node("gpu-a", 8)
    cluster.add_node("gpu-b", 8)
    return cluster


@pytest.fixture
def make_backend(k8s_options):
    def make(cluster, **kwargs) -> KubernetesBackend:
        params = dict(watch_timeout_s=0.5, backoff_s=0.05, retries=3, log_join_timeout_s=5.0)
        params.update(kwargs)
        options = params.pop("options", k8s_options)
        return KubernetesBackend(options, api_client=api_client_for_url(cluster.url), **params)

    return make


@pytest.fixture
def secret_env(monkeypatch):
    from infra.settings import reload_settings

    for key, value in SECRET_VALUES.items():
        monkeypatch.setenv(key, value)
    reload_settings()
    yield SECRET_VALUES
    monkeypatch.undo()
    reload_settings()


@pytest.fixture
def kmock_options(kmock_options):
    """Every kmock of these tests is the API stand-in of tests/support/kube.py."""
    return {**kmock_options, "cls": KubeApi}

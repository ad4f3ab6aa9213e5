"""Where the Kubernetes API is: in-cluster, a kubeconfig, or a Prefect ``KubernetesCredentials`` block.

Order: an explicit block name, an explicit kubeconfig file, the in-cluster
service account (a worker pod), then ``$KUBECONFIG`` / ``~/.kube/config``.
"""

from __future__ import annotations

import os

from kubernetes import client, config


class KubeConfigError(RuntimeError):
    pass


def api_client(
    *, credentials_block: str | None = None, kubeconfig: str | None = None, context: str | None = None
) -> client.ApiClient:
    if credentials_block:
        from prefect_kubernetes.credentials import KubernetesCredentials

        try:
            credentials = KubernetesCredentials.load(credentials_block)
        except ValueError as exc:
            raise KubeConfigError(f"Prefect block kubernetes-credentials/{credentials_block} not found: {exc}") from exc
        return client_from_credentials(credentials, kubeconfig=kubeconfig, context=context)
    if kubeconfig:
        if not os.path.exists(kubeconfig):
            raise KubeConfigError(f"kubeconfig {kubeconfig} does not exist")
        return config.new_client_from_config(config_file=kubeconfig, context=context)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        except config.ConfigException:
            pass  # a pod without a mounted service account: try a kubeconfig
    try:
        # read KUBECONFIG now: the client reads it once, at import time (a list of paths works too)
        return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"), context=context)
    except (config.ConfigException, FileNotFoundError) as exc:
        raise KubeConfigError(
            "no Kubernetes configuration: not in a cluster, and no kubeconfig at "
            f"{os.environ.get('KUBECONFIG', '~/.kube/config')} ({exc}); set KUBECONFIG or name a "
            "Prefect KubernetesCredentials block"
        ) from exc


def client_from_credentials(
    credentials, *, kubeconfig: str | None = None, context: str | None = None
) -> client.ApiClient:
    """A sync client from a prefect-kubernetes ``KubernetesCredentials`` block.

    The block's own clients are kubernetes_asyncio; the backend is synchronous, so a
    sync client is built from the same kubeconfig dict. A block without a cluster
    config means "in-cluster or the local kubeconfig", as it does for the worker.
    """
    cluster = credentials.cluster_config
    if cluster is None:
        return api_client(kubeconfig=kubeconfig, context=context)
    return config.new_client_from_config_dict(cluster.config, context=cluster.context_name or context)


def api_client_for_url(url: str) -> client.ApiClient:
    """A client for a plain-HTTP API server URL (a local proxy, ``kubectl proxy``, tests)."""
    configuration = client.Configuration()
    configuration.host = url.rstrip("/")
    return client.ApiClient(configuration)

"""The Kubernetes area's fixtures (kmock with the stand-in controller), used by name in test_k8s_dev_pod.py."""

from tests.k8s.conftest import cluster, k8s_options, make_backend, ready  # noqa: F401 - fixtures used by name

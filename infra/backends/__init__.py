"""Job backends: the same :class:`infra.jobs.JobSpec` runs locally, on Slurm or on Kubernetes."""

from __future__ import annotations

from infra.jobs import Backend

BACKENDS = ("local", "slurm", "k8s")


def get_backend(name: str, **options) -> Backend:
    if name == "local":
        from infra.backends.local import LocalBackend

        return LocalBackend(**options)
    if name == "slurm":
        from infra.backends.slurm import SlurmBackend

        return SlurmBackend(**options)
    if name in ("k8s", "kubernetes"):
        from infra.backends.k8s import KubernetesBackend

        return KubernetesBackend(**options)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")

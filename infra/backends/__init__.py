"""Job backends: the same :class:`infra.jobs.JobSpec` runs locally, on Slurm or on Kubernetes.

Each module implements :class:`infra.jobs.Backend` in full; :func:`infra.executors.get_backend`
picks one from a flow's executor.
"""

"""Developer tooling: what makes a laptop or a CI machine look like a deployment, never used by a run.

- ``slurm_cluster``  a real one-machine Slurm cluster (``nemoflow local-slurm up``, tests, CI)
- ``prefect_local``  the demo's Prefect control plane: server, work pools, deployments, workers

Pipeline code (flows/, tasks/, workloads/, infra/) never imports this package.
"""

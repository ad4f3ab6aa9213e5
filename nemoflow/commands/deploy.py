"""``nemoflow deploy``: create the work pools prefect.yaml names, then deploy everything in it."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser(
        "deploy",
        help="create the work pools (local, gpu-cluster, nemoflow-k8s) and run `prefect --no-prompt deploy --all`",
        description="Prefect refuses to deploy to a work pool that does not exist. This creates the pools "
        "prefect.yaml uses (a process pool `local`; `gpu-cluster` of type slurm and `nemoflow-k8s` of type "
        "kubernetes, from their base job templates in deployments/) unless they exist, then deploys every "
        "deployment in prefect.yaml to the Prefect API at PREFECT_API_URL (or a local server it starts). "
        "Creating a pool starts no worker: start one with `prefect worker start --pool NAME`.",
    )
    parser.add_argument("--port", type=int, default=4200, help="port of the local Prefect server if one is started")
    parser.set_defaults(func=run)


def run(args) -> int:
    import re

    from infra import prefect_local as pl

    api = pl.ensure_server(args.port)
    pl.ensure_pools(api)
    output = pl.deploy(None, api)
    for name in re.findall(r"Deployment '([^']+)' successfully", output):
        print(f"deployed {name}")
    return 0

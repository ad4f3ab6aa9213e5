"""``nemoflow deploy``: create the work pools prefect.yaml names, then deploy everything in it."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser(
        "deploy",
        help="create the work pools (local, gpu-cluster, nemoflow-k8s) and run `prefect --no-prompt deploy --all`",
        description="Prefect refuses to deploy to a work pool that does not exist. This creates the pools "
        "prefect.yaml uses (a process pool `local`; `gpu-cluster` of type slurm and `nemoflow-k8s` of type "
        "kubernetes, from their base job templates in deployments/) unless they exist, then deploys every "
        "deployment in prefect.yaml to the Prefect API at PREFECT_API_URL (or a local server it starts, whose URL "
        "it records in the active Prefect profile). "
        "Creating a pool starts no worker: start one with `prefect worker start --pool NAME`. "
        "It also creates the automation that marks a flow run Crashed when its heartbeats stop, freeing its "
        "concurrency slots: start workers with PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 so their runs send them, and run "
        "the server with PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem "
        "(the server nemoflow starts has both).",
    )
    parser.add_argument("--port", type=int, default=4200, help="port of the local Prefect server if one is started")
    from nemoflow.commands.demo import AUTH_HELP

    parser.add_argument("--auth", action="store_true", help=AUTH_HELP)
    parser.set_defaults(func=run)


def run(args) -> int:
    import re

    from devtools import prefect_local as pl

    try:
        api = pl.ensure_server(args.port, auth=args.auth)
    except pl.ControlPlaneError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from None
    pl.record_in_profile(api)
    pl.ensure_pools(api)
    pl.ensure_zombie_automation(api)
    output = pl.deploy(None, api)
    for name in re.findall(r"Deployment '([^']+)' successfully", output):
        print(f"deployed {name}")
    return 0

"""``nemoflow local-slurm up|down|status``: a real one-machine Slurm cluster for tests and demos.

The cluster itself is developer tooling (``devtools/slurm_cluster.py``); this module only
hangs its command line under ``nemoflow``.
"""

from __future__ import annotations

from nemoflow.commands import add_command


def register(sub) -> None:
    from devtools import slurm_cluster

    parser = add_command(
        sub, "local-slurm", "start/stop a real one-machine Slurm cluster (tests, demos, CI)", slurm_cluster.DESCRIPTION
    )
    slurm_cluster.add_arguments(parser)
    parser.set_defaults(func=slurm_cluster.run)

"""``nemoflow local-slurm up|down|status``: a real one-machine Slurm cluster for tests and demos.

The cluster itself is developer tooling (``devtools/slurm_cluster.py``); this module only
hangs its command line under ``nemoflow``.
"""

from __future__ import annotations


def register(sub) -> None:
    import argparse

    from devtools import slurm_cluster

    parser = sub.add_parser(
        "local-slurm",
        help="start/stop a real one-machine Slurm cluster (tests, demos, CI)",
        description=slurm_cluster.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    slurm_cluster.add_arguments(parser)
    parser.set_defaults(func=slurm_cluster.run)

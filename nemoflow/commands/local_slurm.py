"""``nemoflow local-slurm up|down|status``: a real one-machine Slurm cluster for tests and demos."""

from __future__ import annotations

DESCRIPTION = """\
Run a real Slurm 22.05 cluster on this machine (Debian, as root): munged, a
private MariaDB + slurmdbd (so sacct works), slurmctld and slurmd, with two
partitions: cpu (default) and gpu (fake GPUs as GRES, so GPU requests are
scheduled). Configs, logs, pid files and the database live in the state dir
(NEMOFLOW_SLURM_STATE_DIR, default /var/lib/nemoflow-slurm); /etc/slurm/*.conf
link there unless another Slurm config is already installed.

  up      install missing Debian packages (apt-get), write configs, start the
          daemons that are not running; quick when already up
  down    stop the daemons this state dir started (by their pid files)
  status  show which daemons run and `sinfo`

Then: sbatch/squeue/sacct work as on any cluster, and
`get_backend("slurm")` runs nemoflow jobs there."""


def register(sub) -> None:
    import argparse

    parser = sub.add_parser(
        "local-slurm",
        help="start/stop a real one-machine Slurm cluster (tests, demos, CI)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", default=None, help="where configs, logs and the database live")
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for each daemon (up)")
    parser.set_defaults(func=run)


def run(args) -> int:
    import sys

    from infra.slurm.cluster import LocalSlurm, LocalSlurmError

    cluster = LocalSlurm(args.state_dir)
    try:
        if args.action == "up":
            cluster.up(timeout=args.timeout)
            print(cluster.status())
        elif args.action == "down":
            stopped = cluster.down()
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        else:
            print(cluster.status())
            return 0 if all(cluster.running().values()) else 3
    except LocalSlurmError as exc:
        print(f"nemoflow local-slurm {args.action}: error: {exc}", file=sys.stderr)
        return 1
    return 0

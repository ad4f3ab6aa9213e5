"""``nemoflow interactive`` / ``attach`` / ``jobs`` / ``release``: a node held for debugging (infra/interactive.py)."""

from __future__ import annotations

from nemoflow.commands import add_command

INTERACTIVE_HELP = """\
Hold a node for debugging and open a shell in it.

Slurm: salloc with the partition, GPUs and time limit of a cluster preset (--preset, or
NEMOFLOW_SLURM_PRESET; account/qos/... from NEMOFLOW_SLURM_*), then a shell on the node
(srun --overlap --pty), inside the container when --image is given (pyxis). The allocation is
released when this shell exits (unless --keep) or when the time limit runs out; `nemoflow attach
JOBID` opens another shell in it meanwhile.

  nemoflow interactive --preset hcc-a3m --gpus 8 --time 02:00:00 --image /shared/nemo.sqsh
  nemoflow interactive --partition cpu --time 30 --keep

Kubernetes: a dev pod in the image with the workspace PVC, deleted when the time limit runs
out (activeDeadlineSeconds); a shell with `kubectl exec -it ...` (printed).

  nemoflow interactive --backend k8s --gpus 1 --time 04:00:00"""


def _kinds() -> list[str]:
    """The backends with interactive sessions (infra/executors.py; imported only when the command runs)."""
    from infra.executors import interactive_kinds

    return interactive_kinds()


def _backend_option(parser, text: str | None = None) -> None:
    def add(p) -> None:
        kinds = _kinds()
        p.add_argument("--backend", choices=kinds, default=None, help=text and text.format(first=kinds[0]))

    parser.defer(add)


def register(sub) -> None:
    p = add_command(
        sub, "interactive", "hold a node (Slurm allocation or dev pod) with a shell in it", INTERACTIVE_HELP
    )
    _backend_option(p, text="default: NEMOFLOW_EXECUTOR, else {first}")

    def options(p) -> None:
        p.add_argument("--preset", help="cluster type (infra/slurm/options.py PRESETS): partition, GPUs, NCCL env")
        request_options().add_to(p)  # --partition --nodes --gpus --cpus --mem --time --image --mount --shell
        p.add_argument(
            "--keep", action="store_true", help="keep the allocation after the shell exits (release it later)"
        )
        p.add_argument("--no-shell", action="store_true", help="only allocate (print the job id); attach later")
        p.add_argument("--kubeconfig", help="Kubernetes: kubeconfig file (default: in-cluster, then ~/.kube/config)")
        p.add_argument("--wait", type=float, default=600, help="seconds to wait for the allocation (default 600)")

    p.defer(options)
    p.set_defaults(func=run_interactive)

    a = sub.add_parser("attach", help="another shell in a held allocation: srun --jobid ID --overlap --pty")
    a.add_argument("job_id")
    _backend_option(a)
    a.defer(lambda a: (a.add_argument("--shell", default="bash"), a.add_argument("--kubeconfig")))
    a.set_defaults(func=run_attach)

    j = sub.add_parser(
        "jobs", help="nemoflow's jobs in the queue: interactive sessions (until released) and stage jobs"
    )
    _backend_option(j)
    j.defer(lambda j: j.add_argument("--kubeconfig"))
    j.set_defaults(func=run_jobs)

    r = sub.add_parser("release", help="end an interactive session (scancel / delete the dev pod)")
    r.add_argument("job_id")
    _backend_option(r)
    r.defer(lambda r: r.add_argument("--kubeconfig"))
    r.set_defaults(func=run_release)


def sessions(args):
    """The chosen backend's interactive sessions: --backend, else NEMOFLOW_EXECUTOR where it has them,
    else the first backend that does."""
    from infra.executors import as_executor
    from infra.settings import get_settings

    kind = args.backend
    if kind is None:
        kind = get_settings().executor
        if kind not in _kinds():  # e.g. local: no sessions there, so the cluster default
            kind = _kinds()[0]
    return as_executor(kind).interactive(preset=getattr(args, "preset", None), kubeconfig=args.kubeconfig)


def request_options():
    """The session's options: the fields of :class:`~infra.interactive.InteractiveRequest`, in sbatch's short names."""
    from infra.interactive import InteractiveRequest
    from nemoflow.options import ModelOptions, Option

    return ModelOptions(
        InteractiveRequest,
        exclude={"workdir"},
        fields={
            "gpus_per_node": Option("--gpus"),
            "cpus_per_task": Option("--cpus", help="CPUs per task"),
            "mounts": Option("--mount", repeat=True),
        },
    )


def _request(args):
    return request_options().build(args)  # a bad value: OptionsError, one line naming the option


def run_interactive(args) -> int:
    request = _request(args)
    return sessions(args).hold(request, keep=args.keep, no_shell=args.no_shell, wait=args.wait)


def run_attach(args) -> int:
    from infra.interactive import InteractiveError

    try:
        return sessions(args).attach(args.job_id, args.shell)
    except InteractiveError as exc:
        from nemoflow.cli import UserError

        raise UserError(str(exc)) from None


def run_jobs(args) -> int:
    rows = sessions(args).rows()
    if not rows:
        print("no nemoflow jobs")
        return 0
    columns = ("id", "kind", "state", "elapsed", "limit", "where", "name")
    widths = {c: max(len(c), *(len(str(r.get(c) or "")) for r in rows)) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row.get(c) or "").ljust(widths[c]) for c in columns))
    return 0


def run_release(args) -> int:
    if not sessions(args).release(args.job_id):
        print(f"no dev job {args.job_id}")
        return 1
    print(f"released {args.job_id}")
    return 0

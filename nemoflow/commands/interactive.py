"""``nemoflow interactive`` / ``attach`` / ``jobs`` / ``release``: a node held for debugging (infra/interactive.py)."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

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


def register(sub) -> None:
    p = sub.add_parser(
        "interactive",
        help="hold a node (Slurm allocation or dev pod) with a shell in it",
        description=INTERACTIVE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=["slurm", "k8s"], default=None, help="default: NEMOFLOW_EXECUTOR, else slurm")
    p.add_argument("--preset", help="cluster type (infra/slurm/options.py PRESETS): partition, GPUs, NCCL env")
    request_options().add_to(p)  # --partition --nodes --gpus --cpus --mem --time --image --mount --shell
    p.add_argument("--keep", action="store_true", help="keep the allocation after the shell exits (release it later)")
    p.add_argument("--no-shell", action="store_true", help="only allocate (print the job id); attach later")
    p.add_argument("--kubeconfig", help="Kubernetes: kubeconfig file (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for the allocation (default 600)")
    p.set_defaults(func=run_interactive)

    a = sub.add_parser("attach", help="another shell in a held allocation: srun --jobid ID --overlap --pty")
    a.add_argument("job_id")
    a.add_argument("--backend", choices=["slurm", "k8s"], default=None)
    a.add_argument("--shell", default="bash")
    a.add_argument("--kubeconfig")
    a.set_defaults(func=run_attach)

    j = sub.add_parser(
        "jobs", help="nemoflow's jobs in the queue: interactive sessions (until released) and stage jobs"
    )
    j.add_argument("--backend", choices=["slurm", "k8s"], default=None)
    j.add_argument("--kubeconfig")
    j.set_defaults(func=run_jobs)

    r = sub.add_parser("release", help="end an interactive session (scancel / delete the dev pod)")
    r.add_argument("job_id")
    r.add_argument("--backend", choices=["slurm", "k8s"], default=None)
    r.add_argument("--kubeconfig")
    r.set_defaults(func=run_release)


def _backend(args) -> str:
    if args.backend:
        return args.backend
    from infra.settings import get_settings

    kind = get_settings().executor
    return kind if kind in ("slurm", "k8s") else "slurm"


def _slurm_options(args):
    from infra.slurm.options import SlurmOptions

    overrides = {"preset": args.preset} if getattr(args, "preset", None) else {}
    return SlurmOptions(**overrides)


def _dev_pods(args):
    from infra.backends.k8s import KubernetesBackend
    from infra.interactive import DevPods

    return DevPods(KubernetesBackend(kubeconfig=args.kubeconfig))


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
    from infra import interactive

    request = _request(args)
    if _backend(args) == "k8s":
        pods = _dev_pods(args)
        body = pods.create(request)
        name, ns = body["metadata"]["name"], pods.ns
        print(
            f"dev job {name} created in namespace {ns}: image {body['spec']['template']['spec']['containers'][0]['image']}, "
            f"workspace PVC {pods.backend.options.pvc_name} at {pods.backend.options.workspace_mount}; "
            f"Kubernetes deletes it after {request.time}"
        )
        print(
            f"  a shell:  kubectl exec -it -n {ns} $(kubectl get pods -n {ns} -l job-name={name} -o name) -- {request.shell}"
        )
        print(f"            (or: nemoflow attach {name} --backend k8s)")
        print(f"  release:  nemoflow release {name} --backend k8s")
        return 0

    options = _slurm_options(args)
    print("requesting: " + " ".join(interactive.salloc_argv(request, options)), flush=True)
    job_id, session = interactive.allocate(request, options, timeout_s=args.wait)
    print(
        f"allocation {job_id} granted (time limit {request.time}); `nemoflow attach {job_id}` opens another shell",
        flush=True,
    )
    if args.no_shell:
        print(f"release it with `nemoflow release {job_id}` (or it ends at the time limit)")
        return 0
    released = False

    def release(*_ignored) -> None:
        nonlocal released
        if not released and not args.keep:
            released = True
            interactive.release_slurm(job_id)
            print(f"released allocation {job_id}", flush=True)

    # a closed terminal or a kill ends the session: release the node rather than leave it idle
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, lambda *_: (release(), sys.exit(129)))
    try:
        status = subprocess.call(
            interactive.attach_argv(job_id, session, request.shell), env=interactive.session_env(session)
        )
    finally:
        release()
    if args.keep:
        print(f"allocation {job_id} kept: `nemoflow attach {job_id}`, `nemoflow release {job_id}`", flush=True)
    return status


def run_attach(args) -> int:
    from infra import interactive

    if _backend(args) == "k8s":
        pods = _dev_pods(args)
        pod = pods.pod_name(args.job_id)
        argv = ["kubectl", "exec", "-it", "-n", pods.ns, pod, "--", args.shell]
        if args.kubeconfig:
            argv[1:1] = ["--kubeconfig", args.kubeconfig]
        print(" ".join(argv), flush=True)
        try:
            return subprocess.call(argv)
        except FileNotFoundError:
            print("kubectl is not installed here: run the command above where it is", file=sys.stderr)
            return 0
    live = {row["id"]: row for row in interactive.slurm_sessions()}
    if args.job_id not in live or live[args.job_id]["kind"] != interactive.KIND:
        from nemoflow.cli import UserError

        raise UserError(f"{args.job_id} is not a held nemoflow interactive allocation (see `nemoflow jobs`)")
    session = interactive.load_session(args.job_id)
    return subprocess.call(
        interactive.attach_argv(args.job_id, session, args.shell), env=interactive.session_env(session)
    )


def run_jobs(args) -> int:
    from infra import interactive

    rows = _dev_pods(args).sessions() if _backend(args) == "k8s" else interactive.slurm_sessions()
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
    from infra import interactive

    if _backend(args) == "k8s":
        if not _dev_pods(args).release(args.job_id):
            print(f"no dev job {args.job_id}")
            return 1
    else:
        interactive.release_slurm(args.job_id)
    print(f"released {args.job_id}")
    return 0

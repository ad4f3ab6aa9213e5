"""Interactive sessions with one interface per backend: what ``nemoflow interactive / attach / jobs /
release`` call, so the commands never ask which backend holds the session.

    sessions = as_executor("slurm").interactive(preset="hcc-a3m")
    sessions.hold(request, keep=False, no_shell=False, wait=600)   # allocate, open a shell, release

The backend's own parts live in :mod:`infra.interactive` (salloc/srun, dev pods); an executor returns its
``Sessions`` from :meth:`infra.executors.ExecutorBase.interactive`.
"""

from __future__ import annotations

import abc
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from infra import interactive
from infra.interactive import InteractiveError, InteractiveRequest

Say = Callable[[str], None]


def _say(line: str) -> None:
    print(line, flush=True)


class Sessions(abc.ABC):
    """Held nodes of one backend, by the id the user sees (a Slurm job id, a dev Job's name)."""

    flag = ""  # what `attach`/`release` need besides the id to reach this backend (``--backend k8s``)

    @abc.abstractmethod
    def hold(self, request: InteractiveRequest, *, keep: bool, no_shell: bool, wait: float, say: Say = _say) -> int:
        """Take a node for ``request`` and, unless ``no_shell``, a shell in it; the exit status."""

    @abc.abstractmethod
    def attach(self, job_id: str, shell: str, say: Say = _say) -> int:
        """Another shell in a held session; the shell's exit status."""

    @abc.abstractmethod
    def rows(self) -> list[dict[str, Any]]:
        """nemoflow's sessions and jobs on this backend (id, kind, state, elapsed, limit, where, name)."""

    @abc.abstractmethod
    def release(self, job_id: str) -> bool:
        """End a session; False when there was none of that id."""


class SlurmSessions(Sessions):
    """salloc --no-shell, then srun --overlap --pty on the node (inside the container with --image)."""

    def __init__(self, options) -> None:
        self.options = options

    def hold(self, request, *, keep, no_shell, wait, say=_say) -> int:
        say("requesting: " + " ".join(interactive.salloc_argv(request, self.options)))
        job_id, session = interactive.allocate(request, self.options, timeout_s=wait)
        say(f"allocation {job_id} granted (time limit {request.time}); `nemoflow attach {job_id}` opens another shell")
        if no_shell:
            say(f"release it with `nemoflow release {job_id}` (or it ends at the time limit)")
            return 0
        released = False

        def release(*_ignored) -> None:
            nonlocal released
            if not released and not keep:
                released = True
                interactive.release_slurm(job_id)
                say(f"released allocation {job_id}")

        # a closed terminal or a kill ends the session: release the node rather than leave it idle
        for sig in (signal.SIGHUP, signal.SIGTERM):
            signal.signal(sig, lambda *_: (release(), sys.exit(129)))
        try:
            status = subprocess.call(
                interactive.attach_argv(job_id, session, request.shell), env=interactive.session_env(session)
            )
        finally:
            release()
        if keep:
            say(f"allocation {job_id} kept: `nemoflow attach {job_id}`, `nemoflow release {job_id}`")
        return status

    def attach(self, job_id, shell, say=_say) -> int:
        live = {row["id"]: row for row in interactive.slurm_sessions()}
        if job_id not in live or live[job_id]["kind"] != interactive.KIND:
            raise InteractiveError(f"{job_id} is not a held nemoflow interactive allocation (see `nemoflow jobs`)")
        session = interactive.load_session(job_id)
        return subprocess.call(interactive.attach_argv(job_id, session, shell), env=interactive.session_env(session))

    def rows(self) -> list[dict[str, Any]]:
        return interactive.slurm_sessions()

    def release(self, job_id) -> bool:
        interactive.release_slurm(job_id)
        return True


class DevPodSessions(Sessions):
    """A dev Job (a pod sleeping until its time limit) with the workspace PVC; shells by ``kubectl exec``."""

    flag = " --backend k8s"

    def __init__(self, kubeconfig: str | None = None) -> None:
        from infra.backends.k8s import KubernetesBackend

        self.kubeconfig = kubeconfig
        self.pods = interactive.DevPods(KubernetesBackend(kubeconfig=kubeconfig))

    def hold(self, request, *, keep, no_shell, wait, say=_say) -> int:
        pods = self.pods
        body = pods.create(request)
        name, ns = body["metadata"]["name"], pods.ns
        image = body["spec"]["template"]["spec"]["containers"][0]["image"]
        say(
            f"dev job {name} created in namespace {ns}: image {image}, "
            f"workspace PVC {pods.backend.options.pvc_name} at {pods.backend.options.workspace_mount}; "
            f"Kubernetes deletes it after {request.time}"
        )
        say(
            f"  a shell:  kubectl exec -it -n {ns} $(kubectl get pods -n {ns} -l job-name={name} -o name) -- {request.shell}"
        )
        say(f"            (or: nemoflow attach {name}{self.flag})")
        say(f"  release:  nemoflow release {name}{self.flag}")
        return 0

    def attach(self, job_id, shell, say=_say) -> int:
        pod = self.pods.pod_name(job_id)
        argv = ["kubectl", "exec", "-it", "-n", self.pods.ns, pod, "--", shell]
        if self.kubeconfig:
            argv[1:1] = ["--kubeconfig", self.kubeconfig]
        say(" ".join(argv))
        try:
            return subprocess.call(argv)
        except FileNotFoundError:
            print("kubectl is not installed here: run the command above where it is", file=sys.stderr)
            return 0

    def rows(self) -> list[dict[str, Any]]:
        return self.pods.sessions()

    def release(self, job_id) -> bool:
        return self.pods.release(job_id)

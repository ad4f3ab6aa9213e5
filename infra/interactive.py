"""Interactive allocations: a node held for debugging, with a shell in it, that one can come back to.

    nemoflow interactive --backend slurm --preset hcc-a3m --gpus 8 --time 02:00:00 --image nemo.sqsh
    nemoflow attach 12345            # another shell in the same allocation (srun --overlap)
    nemoflow jobs                    # interactive sessions (and stage jobs) until they are released
    nemoflow release 12345

Slurm (like the seeds' ``launch.sh --interactive`` / ``attach.sh``): ``salloc --no-shell`` takes the
allocation with the partition, GPUs and time limit of a cluster preset (infra/slurm/options.py), then
``srun --jobid ID --overlap --pty`` opens the shell on the allocated node, inside the container
(pyxis ``--container-image`` / ``--container-mounts``) when an image is given. The allocation is
labelled ``--comment nemoflow:kind=interactive,...`` so ``nemoflow jobs`` finds it. It is released
(``scancel``) when the first shell exits (unless ``--keep``), when ``nemoflow release`` says so,
or by Slurm itself when the time limit runs out.

Kubernetes: a one-pod Job (the stages' own builder, infra/k8s/manifests.py ``single_job``) running
``sleep`` in the image with the workspace PVC mounted, ``activeDeadlineSeconds`` = the time limit
(Kubernetes deletes it then), labelled ``nemoflow.dev/kind=interactive``; the shell is
``kubectl exec -it POD -- bash``.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import signal
import subprocess
from typing import Any

from pydantic import BaseModel, Field

from infra.jobs import JobSpec, Mount, Resources, parse_time_limit
from infra.slurm.options import SlurmOptions, labels_comment, parse_labels_comment

KIND_LABEL = "kind"
KIND = "interactive"
K8S_KIND_LABEL = "nemoflow.dev/kind"
JOB_NAME = "nemoflow-interactive"
_GRANTED = re.compile(r"Granted job allocation (\d+)")
_PENDING = re.compile(r"Pending job allocation (\d+)")


class InteractiveError(RuntimeError):
    """The allocation could not be made or found; the message says why and what to do."""


class InteractiveRequest(BaseModel):
    """What an interactive session asks for (sbatch names; unset values come from the preset or the options)."""

    partition: str | None = None
    nodes: int = Field(1, ge=1)
    gpus_per_node: int | None = Field(None, ge=0, description="default: the preset's GPUs per node, else 0")
    cpus_per_task: int | None = Field(None, ge=1)
    mem: str | None = None
    time: str = Field("01:00:00", description="time limit (sbatch syntax); the allocation ends then")
    image: str | None = Field(None, description=".sqsh / image reference for the shell (pyxis; k8s: the pod's image)")
    mounts: list[str] = Field(default_factory=list, description="extra container mounts 'src:dst[:ro]'")
    shell: str = "bash"
    workdir: str | None = None

    def time_seconds(self) -> int:
        return parse_time_limit(self.time)


# ================================================================== Slurm
def parse_granted(stderr: str) -> str:
    """The job id salloc reports.

    >>> parse_granted("salloc: Granted job allocation 4242\\nsalloc: Waiting for resource configuration")
    '4242'
    """
    match = _GRANTED.search(stderr)
    if not match:
        raise InteractiveError(f"salloc did not grant an allocation: {stderr.strip() or 'no output'}")
    return match.group(1)


def salloc_argv(request: InteractiveRequest, options: SlurmOptions) -> list[str]:
    """``salloc --no-shell`` with the preset's partition and GPUs, the options' account/qos, and the labels."""
    preset = options.cluster_preset
    gpus = request.gpus_per_node
    if gpus is None:
        gpus = options.gpus_per_node if options.gpus_per_node is not None else (preset.gpus_per_node if preset else 0)
    partition = request.partition or (options.gpu_partition if gpus and options.gpu_partition else options.partition)
    if partition is None and preset is not None:
        partition = preset.partition
    argv = ["salloc", "--no-shell", f"--job-name={JOB_NAME}", f"--nodes={request.nodes}", f"--time={request.time}"]
    if partition:
        argv.append(f"--partition={partition}")
    for flag, value in (("account", options.account), ("qos", options.qos), ("constraint", options.constraint)):
        if value:
            argv.append(f"--{flag}={value}")
    if gpus:
        argv.append(f"--gpus-per-node={gpus}")
    cpus = request.cpus_per_task or options.cpus_per_task
    if cpus:
        argv.append(f"--cpus-per-task={cpus}")
    mem = request.mem or options.mem
    if mem:
        argv.append(f"--mem={mem}")
    if options.exclusive:
        argv.append("--exclusive")
    labels = {KIND_LABEL: KIND, "user": _user()}
    if options.preset:
        labels["preset"] = options.preset
    argv.append(f"--comment={labels_comment(labels)}")
    argv += [
        f for f in options.extra_sbatch_flags if not f.startswith(("--array", "--output", "--error", "--open-mode"))
    ]
    return argv


def container_spec(request: InteractiveRequest, options: SlurmOptions) -> JobSpec:
    """The shell as a JobSpec, so its container flags are rendered like every job's (infra/slurm/script.py)."""
    mounts = []
    for text in request.mounts:
        parts = text.split(":")
        if len(parts) < 2:
            raise ValueError(f"mount {text!r} is not 'src:dst[:ro]'")
        mounts.append(Mount(source=parts[0], target=parts[1], read_only=len(parts) > 2 and parts[2] == "ro"))
    return JobSpec(
        name=JOB_NAME,
        command=[request.shell],
        container_image=request.image,
        mounts=mounts,
        workdir=request.workdir,
        resources=Resources(),
    )


def attach_argv(job_id: str, session: dict | None = None, shell: str = "bash") -> list[str]:
    """``srun --jobid ID --overlap --pty [container flags] SHELL`` (with the preset's setup lines first)."""
    from infra.slurm.script import container_flags

    session = session or {}
    argv = ["srun", f"--jobid={job_id}", "--overlap", "--pty", "--nodes=1", "--ntasks=1"]
    if session.get("spec"):
        spec = JobSpec.model_validate(session["spec"])
        argv += container_flags(spec, session.get("extra_mounts") or [])
        shell = spec.command[0]
    setup = session.get("setup_lines") or []
    if setup:
        return [*argv, "bash", "-c", "; ".join([*setup, f"exec {shlex.quote(shell)} -i"])]
    return [*argv, shell]


def session_env(session: dict | None) -> dict[str, str]:
    """The environment for the shell's srun: the preset's NCCL variables and the options' env (srun exports it)."""
    return dict(os.environ, **((session or {}).get("env") or {}))


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def sessions_dir() -> str:
    from infra import storage
    from infra.settings import get_settings

    return storage.local_path(storage.join(get_settings().work_dir, "interactive"))


def save_session(job_id: str, data: dict) -> str:
    from infra import storage

    path = os.path.join(sessions_dir(), f"{job_id}.json")
    storage.makedirs(os.path.dirname(path))
    storage.write_text(path, json.dumps(data, indent=1))
    return path


def load_session(job_id: str) -> dict | None:
    path = os.path.join(sessions_dir(), f"{job_id}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def forget_session(job_id: str) -> None:
    path = os.path.join(sessions_dir(), f"{job_id}.json")
    if os.path.exists(path):
        os.remove(path)


def allocate(request: InteractiveRequest, options: SlurmOptions, timeout_s: float = 600) -> tuple[str, dict]:
    """Take the allocation (waits until granted); returns (job id, session record)."""
    argv = salloc_argv(request, options)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise InteractiveError("`salloc` is not on PATH: run on a login node of the cluster") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGINT: salloc revokes its queued request itself; the scancel covers a salloc that cannot
        proc.send_signal(signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pending = _PENDING.search(stderr or "")
        if pending:
            subprocess.run(["scancel", pending.group(1)], capture_output=True)
        raise InteractiveError(
            f"no allocation within {timeout_s:.0f}s, request withdrawn: {shlex.join(argv)}; "
            "the partition is busy (`squeue -p PARTITION`): try later, another partition or a shorter --time"
        ) from None
    except BaseException:
        proc.send_signal(signal.SIGINT)  # interrupted while queued: withdraw the request, leave nothing behind
        proc.wait(timeout=15)
        raise
    if proc.returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {proc.returncode}"
        raise InteractiveError(f"salloc refused the allocation: {last}")
    job_id = parse_granted(stderr + stdout)
    preset = options.cluster_preset
    session = {
        "job_id": job_id,
        "backend": "slurm",
        "salloc": argv,
        "time": request.time,
        "spec": container_spec(request, options).model_dump(mode="json") if request.image else None,
        "extra_mounts": list(options.container_mounts),
        "env": {**(preset.env if preset else {}), **options.env},
        "setup_lines": [*(preset.setup_lines if preset else []), *options.setup_lines],
    }
    save_session(job_id, session)
    return job_id, session


def slurm_sessions() -> list[dict[str, Any]]:
    """Live nemoflow jobs in the queue (interactive sessions and stage jobs), from ONE squeue call."""
    from infra.slurm.commands import SlurmCLI

    out = SlurmCLI(retries=1).run(["squeue", "-h", "-o", "%i|%j|%T|%M|%l|%P|%N|%k"])
    rows = []
    for line in out.splitlines():
        parts = line.split("|", 7)
        if len(parts) < 8 or not parts[7].startswith("nemoflow:"):
            continue
        labels = parse_labels_comment(parts[7])
        rows.append(
            {
                "id": parts[0],
                "name": parts[1],
                "state": parts[2],
                "elapsed": parts[3],
                "limit": parts[4],
                "where": parts[5] + (f" {parts[6]}" if parts[6] and parts[6] != "(null)" else ""),
                "kind": labels.get(KIND_LABEL, "job"),
                "labels": labels,
            }
        )
    return rows


def release_slurm(job_id: str) -> None:
    from infra.slurm.commands import SlurmCLI

    SlurmCLI(retries=1).scancel([job_id])
    forget_session(job_id)


# ================================================================== Kubernetes
def dev_job_spec(request: InteractiveRequest, name: str, options) -> JobSpec:
    """A pod that sleeps until the time limit (Kubernetes' activeDeadlineSeconds ends it then)."""
    seconds = request.time_seconds()
    return JobSpec(
        name=name,
        command=["sleep", str(seconds)],
        container_image=request.image,
        workdir=request.workdir or options.workspace_mount,
        resources=Resources(
            gpus_per_node=request.gpus_per_node or 0,
            cpus_per_task=request.cpus_per_task or 1,
            mem=request.mem,
            time=request.time,
        ),
        labels={KIND_LABEL: KIND},
    )


def dev_job(request: InteractiveRequest, name: str, options) -> dict:
    """The Job manifest (the stages' builder) with the interactive label on the Job and its pod."""
    from infra.k8s.manifests import single_job, to_dict

    labelled = options.model_copy(update={"labels": {**options.labels, K8S_KIND_LABEL: KIND}})
    return to_dict(single_job(dev_job_spec(request, name, labelled), labelled))


def exec_instructions(namespace: str, pod: str, shell: str = "bash") -> str:
    return f"kubectl exec -it -n {namespace} {pod} -- {shell}"


class DevPods:
    """Interactive dev pods through a :class:`~infra.backends.k8s.KubernetesBackend`'s API clients."""

    def __init__(self, backend):
        self.backend = backend
        self.ns = backend.options.namespace

    def create(self, request: InteractiveRequest, name: str | None = None) -> dict:
        """Create the dev Job (preflight first: PVC, image, service account); returns its manifest."""
        name = name or f"nemoflow-dev-{_user()[:20].lower()}-{os.urandom(3).hex()}"
        name = re.sub(r"[^a-z0-9-]", "-", name)[:52].strip("-")
        spec = dev_job_spec(request, name, self.backend.options)
        if self.backend.preflight:
            self.backend.check(spec)
        body = dev_job(request, name, self.backend.options)
        self.backend.batch.create_namespaced_job(self.ns, body)
        return body

    def _jobs(self) -> list[dict]:
        # kmock (the tests' API server) ignores label selectors: filter here, as a client would anyway.
        items = self.backend.api.sanitize_for_serialization(self.backend.batch.list_namespaced_job(self.ns)).get(
            "items", []
        )
        return [j for j in items if (j["metadata"].get("labels") or {}).get(K8S_KIND_LABEL) == KIND]

    def pods_of(self, job: str) -> list[dict]:
        items = self.backend.api.sanitize_for_serialization(self.backend.core.list_namespaced_pod(self.ns)).get(
            "items", []
        )
        return [p for p in items if (p["metadata"].get("labels") or {}).get("job-name") == job]

    def sessions(self) -> list[dict[str, Any]]:
        rows = []
        for job in self._jobs():
            name = job["metadata"]["name"]
            pods = self.pods_of(name)
            phase = (pods[0].get("status") or {}).get("phase", "Pending") if pods else "Pending"
            if (job.get("status") or {}).get("failed") or phase in ("Succeeded", "Failed"):
                continue  # over: the deadline passed (or it was ended)
            rows.append(
                {
                    "id": name,
                    "name": name,
                    "state": phase.upper(),
                    "elapsed": (job.get("status") or {}).get("startTime") or "",
                    "limit": str(job["spec"].get("activeDeadlineSeconds", "")) + "s",
                    "where": self.ns + (f" {pods[0]['metadata']['name']}" if pods else ""),
                    "kind": KIND,
                    "pod": pods[0]["metadata"]["name"] if pods else None,
                }
            )
        return rows

    def pod_name(self, job: str) -> str:
        pods = self.pods_of(job)
        if not pods:
            raise InteractiveError(
                f"dev job {job} has no pod yet in namespace {self.ns} (`kubectl get pods -n {self.ns}`)"
            )
        return pods[0]["metadata"]["name"]

    def release(self, job: str) -> bool:
        from kubernetes.client.rest import ApiException

        try:
            self.backend.batch.delete_namespaced_job(job, self.ns, propagation_policy="Foreground")
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        for pod in self.pods_of(job):
            try:
                self.backend.core.delete_namespaced_pod(pod["metadata"]["name"], self.ns)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        return True

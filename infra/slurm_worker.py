"""
A Prefect worker that runs each flow run as a Slurm batch job.

To start a Slurm worker on a login node (any machine with sbatch/squeue/sacct and
the cluster's munge key), run:

```bash
prefect work-pool create gpu-cluster --type slurm \\
    --base-job-template deployments/slurm/base-job-template.json
prefect worker start --pool gpu-cluster --type slurm
```

Each flow run becomes one ``sbatch`` job whose script runs the flow run command
(``<this python> -m prefect.engine`` unless the deployment sets ``command``).
``PREFECT_API_URL``, ``PREFECT__FLOW_RUN_ID`` and the rest of the job's ``env``
reach the job through sbatch's environment (``--export=ALL``), never through the
script, so an API key is not written to shared storage. Job variables
(partition, time, nodes, cpus_per_task, mem, gpus_per_node, account, qos,
extra_sbatch_flags, setup_lines, working_dir, log_dir) are the sbatch options of
:class:`infra.slurm.options.SlurmOptions`.

Cancelling a flow run (UI, API, ``prefect flow-run cancel``) ``scancel``s its job,
pending or running, and every stage job the run submitted: those carry the label
``flow-run=<flow run id>`` in their ``--comment`` (``tasks.common.run_job``), and
the flow-run job itself is killed with SIGKILL, so nothing inside it could cancel
them (nor report the run Crashed, as Prefect's engine does on SIGTERM): ``sacct``
shows that job FAILED with signal 9, the stage jobs CANCELLED. A job that ends without completing (TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, a
non-zero exit) is reported Crashed with Slurm's state, reason and exit code, and
its stage jobs are scancelled the same way.

The worker type is registered through the ``prefect.collections`` entry point of
the nemoflow package, so ``--type slurm`` is found once nemoflow is installed.
"""

from __future__ import annotations

import getpass
import logging
import re
import shlex
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.client.schemas.objects import StateType
from prefect.exceptions import InfrastructureNotFound
from prefect.states import Cancelled
from prefect.workers.base import BaseJobConfiguration, BaseVariables, BaseWorker, BaseWorkerResult
from pydantic import Field

from infra.backends.slurm import SlurmBackend
from infra.jobs import JobSpec, JobState, Resources
from infra.slurm.commands import SlurmCLI
from infra.slurm.options import SlurmOptions, parse_labels_comment

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

log = logging.getLogger("nemoflow.slurm_worker")

# squeue -h -u USER -o <STAGE_JOBS_FORMAT>: the array job id (%F, the job id of a plain job) and the comment
STAGE_JOBS_FORMAT = "%F|%k"


def jobs_of_flow_run(cli: SlurmCLI, flow_run_id: str) -> list[str]:
    """Live jobs of this user labelled ``flow-run=<flow_run_id>`` (array jobs once, by their base id)."""
    out = cli.run(["squeue", "-h", "-u", getpass.getuser(), "-o", STAGE_JOBS_FORMAT])
    return labelled_jobs(out, "flow-run", flow_run_id)


def labelled_jobs(squeue_output: str, key: str, value: str) -> list[str]:
    """Job ids of ``squeue -h -o '%F|%k'`` rows whose nemoflow comment has ``key=value``.

    >>> labelled_jobs("12|nemoflow:flow-run=a\n13|nemoflow:flow-run=b\n12|nemoflow:flow-run=a\n14|", "flow-run", "a")
    ['12']
    """
    found: list[str] = []
    for line in squeue_output.splitlines():
        job_id, _, comment = line.strip().partition("|")
        if job_id and parse_labels_comment(comment).get(key) == value and job_id not in found:
            found.append(job_id)
    return found


def cancel_jobs_of_flow_run(cli: SlurmCLI, flow_run_id: str) -> list[str]:
    """scancel every live job labelled with the flow run; returns their ids (best effort, never raises)."""
    try:
        jobs = jobs_of_flow_run(cli, flow_run_id)
        cli.scancel(jobs)
    except Exception as exc:  # noqa: BLE001 - a cancel must not fail on a cleanup that can be redone
        log.warning("could not scancel the stage jobs of flow run %s: %s", flow_run_id, exc)
        return []
    return jobs


def kill_flow_run_job(backend: SlurmBackend, job_id: str, wait_s: float = 15.0) -> None:
    """SIGKILL a flow-run job's batch step (the engine: the script execs it), then scancel what is left.

    Not scancel's SIGTERM: on SIGTERM the engine in the job forces the run to Crashed (firing crash
    hooks) although the user cancelled it. ``--signal=KILL`` needs ``--batch``: without it Slurm makes
    it a plain cancel, SIGTERM first (CI saw the run end Crashed). The plain scancel comes once the
    job has left RUNNING, for steps and anything else left.
    """
    try:
        backend.cli.scancel([job_id], signal="KILL", batch=True)
    except Exception as exc:  # noqa: BLE001 - a pending job cannot be signalled: the scancel below ends it
        log.info("scancel --signal=KILL %s: %s", job_id, exc)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            rows = backend.cli.squeue([job_id])
        except Exception:  # noqa: BLE001 - squeue failing: let scancel decide
            break
        if not any(r.state.job_state is JobState.RUNNING for r in rows):
            break
        time.sleep(0.2)
    backend.cancel(job_id)


class SlurmJobConfiguration(BaseJobConfiguration):
    """The sbatch job of one flow run; every field is a template variable of the work pool."""

    partition: str | None = Field(default=None)
    time: str | None = Field(default=None)
    nodes: int = Field(default=1, ge=1)
    cpus_per_task: int = Field(default=1, ge=1)
    mem: str | None = Field(default=None)
    gpus_per_node: int = Field(default=0, ge=0)
    account: str | None = Field(default=None)
    qos: str | None = Field(default=None)
    extra_sbatch_flags: list[str] = Field(default_factory=list)
    setup_lines: list[str] = Field(default_factory=list)
    working_dir: str | None = Field(default=None)
    log_dir: str | None = Field(default=None)
    stream_output: bool = Field(default=True)
    poll_interval_s: float = Field(default=2.0, gt=0)

    def prepare_for_flow_run(
        self,
        flow_run: FlowRun,
        deployment: DeploymentResponse | None = None,
        flow: APIFlow | None = None,
        work_pool: WorkPool | None = None,
        worker_name: str | None = None,
        worker_id: UUID | None = None,
    ) -> None:
        configured = self.command is not None
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        if not configured:
            # The worker's own interpreter: on a cluster the venv sits on shared storage.
            self.command = f"{shlex.quote(sys.executable)} -m prefect.engine"

    def job_spec(self, flow_run: FlowRun) -> JobSpec:
        name = re.sub(r"[^a-z0-9-]+", "-", (self.name or flow_run.name).lower()).strip("-")[:40] or "flow-run"
        return JobSpec(
            name=f"prefect-{name}"[:63].rstrip("-"),
            command=shlex.split(self.command or ""),
            workdir=self.working_dir,
            log_dir=self.log_dir,
            resources=Resources(
                nodes=self.nodes,
                cpus_per_task=self.cpus_per_task,
                gpus_per_node=self.gpus_per_node,
                mem=self.mem,
                time=self.time,
            ),
        )

    def slurm_options(self) -> SlurmOptions:
        return SlurmOptions(
            partition=self.partition,
            account=self.account,
            qos=self.qos,
            extra_sbatch_flags=self.extra_sbatch_flags,
            setup_lines=self.setup_lines,
            # A flow run is not resumable by resubmission: Prefect's retries own that.
            max_resubmits=0,
        )


class SlurmVariables(BaseVariables):
    partition: str | None = Field(default=None, description="sbatch --partition; the cluster default if unset.")
    time: str | None = Field(default=None, description="sbatch --time, e.g. '04:00:00'.")
    nodes: int = Field(default=1, ge=1, description="sbatch --nodes.")
    cpus_per_task: int = Field(default=1, ge=1, description="sbatch --cpus-per-task.")
    mem: str | None = Field(default=None, description="sbatch --mem (per node), e.g. '32G'.")
    gpus_per_node: int = Field(default=0, ge=0, description="sbatch --gpus-per-node.")
    account: str | None = Field(default=None, description="sbatch --account.")
    qos: str | None = Field(default=None, description="sbatch --qos.")
    extra_sbatch_flags: list[str] = Field(
        default_factory=list, description="More sbatch flags, e.g. ['--reservation=train', '--exclusive']."
    )
    setup_lines: list[str] = Field(
        default_factory=list,
        description="Shell lines run before the flow, e.g. ['module load cuda', 'source /shared/venv/bin/activate'].",
    )
    working_dir: str | None = Field(
        default=None, title="Working Directory", description="Directory the job starts in (sbatch --chdir)."
    )
    log_dir: str | None = Field(default=None, description="Where job scripts and output files go (shared storage).")
    stream_output: bool = Field(default=True, description="Copy the job's output to the worker's stdout.")
    poll_interval_s: float = Field(default=2.0, gt=0, description="Seconds between job state polls.")


class SlurmWorkerResult(BaseWorkerResult):
    """The Slurm job id and how it ended."""


class SlurmWorker(BaseWorker[SlurmJobConfiguration, SlurmVariables, SlurmWorkerResult]):
    type = "slurm"
    job_configuration = SlurmJobConfiguration
    job_configuration_variables = SlurmVariables
    _description = "Run each flow run as a Slurm batch job (sbatch), on any Slurm version."
    _display_name = "Slurm"
    _documentation_url = "https://slurm.schedmd.com/sbatch.html"
    _logo_url = "https://slurm.schedmd.com/slurm_logo.png"

    async def run(
        self,
        flow_run: FlowRun,
        configuration: SlurmJobConfiguration,
        task_status: anyio.abc.TaskStatus[str] | None = None,
    ) -> SlurmWorkerResult:
        logger = self.get_flow_run_logger(flow_run)
        backend = SlurmBackend(configuration.slurm_options(), poll_interval_s=configuration.poll_interval_s)
        spec = configuration.job_spec(flow_run)
        env = {k: v for k, v in configuration.env.items() if v is not None}
        job_id, req = await anyio.to_thread.run_sync(lambda: backend.submit(spec, extra_env=env))
        logger.info(f"Submitted flow run {flow_run.id} as Slurm job {job_id} (partition {req.partition or 'default'})")
        if task_status is not None:
            task_status.started(job_id)

        stop = anyio.Event()
        cancelled = False

        async def watch_cancellation() -> None:
            nonlocal cancelled
            while not stop.is_set():
                with anyio.move_on_after(configuration.poll_interval_s):
                    await stop.wait()
                if stop.is_set():
                    return
                try:
                    state = (await self.client.read_flow_run(flow_run.id)).state
                except Exception:  # noqa: BLE001 - an API blip: poll again
                    continue
                if state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED):
                    cancelled = True
                    logger.info(f"Flow run is {state.name}: cancelling Slurm job {job_id}")
                    await self._ensure_cancelled(flow_run, f"Slurm job {job_id} cancelled")
                    await anyio.to_thread.run_sync(kill_flow_run_job, backend, job_id)
                    await self._cancel_stage_jobs(backend.cli, str(flow_run.id), logger)
                    return

        def on_log(line: str) -> None:
            if configuration.stream_output:
                print(line, flush=True)

        async with anyio.create_task_group() as group:
            group.start_soon(watch_cancellation)
            try:
                status = await anyio.to_thread.run_sync(lambda: backend.wait(job_id, req, None, on_log))
            finally:
                stop.set()

        if cancelled or status.state is JobState.CANCELLED:
            await self._cancel_stage_jobs(backend.cli, str(flow_run.id), logger)
            await self._ensure_cancelled(flow_run, f"Slurm job {job_id} cancelled")
            return SlurmWorkerResult(identifier=job_id, status_code=0)
        if status.state is JobState.COMPLETED:
            return SlurmWorkerResult(identifier=job_id, status_code=0)
        # The flow run's process died (node failure, OOM, time limit): nothing in it will cancel its jobs.
        await self._cancel_stage_jobs(backend.cli, str(flow_run.id), logger)
        message = f"Slurm job {job_id} ended {status.state.value.upper()}"
        if status.reason:
            message += f" ({status.reason})"
        if status.exit_code is not None:
            message += f", exit code {status.exit_code}"
        await self._propose_crashed_state(flow_run, message)
        return SlurmWorkerResult(identifier=job_id, status_code=status.exit_code or 1)

    async def _cancel_stage_jobs(self, cli: SlurmCLI, flow_run_id: str, logger) -> None:
        jobs = await anyio.to_thread.run_sync(cancel_jobs_of_flow_run, cli, flow_run_id)
        if jobs:
            logger.info(f"Cancelled the stage jobs of flow run {flow_run_id}: Slurm job(s) {', '.join(jobs)}")

    async def _ensure_cancelled(self, flow_run: FlowRun, message: str) -> None:
        # scancel's SIGTERM makes the engine in the job report Crashed; the user asked for a cancel.
        current = await self.client.read_flow_run(flow_run.id)
        if current.state is None or not current.state.is_cancelled():
            await self.client.set_flow_run_state(flow_run.id, Cancelled(message=message), force=True)

    async def kill_infrastructure(
        self,
        infrastructure_pid: str,
        configuration: SlurmJobConfiguration,
        grace_seconds: int = 30,
    ) -> None:
        """scancel the flow run's job (the infrastructure pid is the Slurm job id)."""
        backend = SlurmBackend(configuration.slurm_options())
        rows = await anyio.to_thread.run_sync(backend.cli.squeue, [infrastructure_pid])
        if not any(not r.state.job_state.is_terminal for r in rows):
            raise InfrastructureNotFound(f"Slurm job {infrastructure_pid} is not pending or running")
        # Same as the cancellation watcher in run(): Prefect's base worker calls this on its own when
        # it sees Cancelling.
        await anyio.to_thread.run_sync(kill_flow_run_job, backend, infrastructure_pid)
        flow_run_id = configuration.env.get("PREFECT__FLOW_RUN_ID")
        if flow_run_id:
            await anyio.to_thread.run_sync(cancel_jobs_of_flow_run, backend.cli, flow_run_id)


def default_base_job_template() -> dict[str, Any]:
    """What deployments/slurm/base-job-template.json holds (a test keeps them equal)."""
    return SlurmWorker.get_default_base_job_template()

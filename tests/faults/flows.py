"""Flows the fault tests deploy: the shape of cpt-refresh (the same global lock, a stage job), small.

``holds_refresh_lock`` takes the ``cpt-refresh`` global concurrency slot exactly as flows/cpt_refresh.py
does (:func:`flows.cpt_refresh.refresh_lock`), finishes a cached step, then runs a stage job on the local
backend (a process that records its pid and waits) and writes a result once the job ends.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from prefect import flow, task
from prefect.cache_policies import INPUTS

from flows.cpt_refresh import refresh_lock
from infra.backends.local import LocalBackend
from infra.jobs import JobSpec

# The stage job: prints its pid (the test kills or watches it), then waits for `release` to appear.
JOB = (
    "import os, pathlib, sys, time\n"
    "pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))\n"
    "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.1)\n"
)


@task(cache_policy=INPUTS, persist_result=True)
def prepare(directory: str) -> str:
    """A finished stage: a re-run must find it Cached (the counter file counts real executions)."""
    counter = pathlib.Path(directory) / "prepare-count"
    counter.write_text(str(int(counter.read_text() or 0) + 1 if counter.exists() else 1))
    return "prepared"


@flow(name="holds-refresh-lock")
def holds_refresh_lock(directory: str, lock_timeout_s: float = 2) -> str:
    """Take the cpt-refresh lock, run one cached step and one stage job, then record the result."""
    d = pathlib.Path(directory)
    with refresh_lock(lock_timeout_s):
        (d / f"flow-{os.environ.get('PREFECT__FLOW_RUN_ID', 'x')}.pid").write_text(str(os.getpid()))
        prepare(directory)
        job_pid = d / f"job-{os.environ.get('PREFECT__FLOW_RUN_ID', 'x')}.pid"
        spec = JobSpec(name="stage", command=[sys.executable, "-c", JOB, str(job_pid), str(d / "release")])
        result = LocalBackend().run(spec)
        if result.exit_code != 0:
            raise RuntimeError(f"stage job failed: {result.reason}")
        (d / "result.json").write_text(json.dumps({"finished": time.time()}))
        return "done"


@flow(name="runs-a-stage-job")
def runs_a_stage_job(directory: str) -> str:
    """One stage job on the local backend, waiting for ``release``."""
    d = pathlib.Path(directory)
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID", "x")
    (d / f"flow-{run_id}.pid").write_text(str(os.getpid()))
    spec = JobSpec(name="stage", command=[sys.executable, "-c", JOB, str(d / f"job-{run_id}.pid"), str(d / "release")])
    result = LocalBackend().run(spec)
    if result.exit_code != 0:
        raise RuntimeError(f"stage job failed: {result.reason}")
    return "done"


# A Slurm stage job: records its job id, then sleeps (the test cancels the flow run meanwhile).
SLURM_JOB = (
    "import os, pathlib, sys, time\npathlib.Path(sys.argv[1]).write_text(os.environ['SLURM_JOB_ID'])\ntime.sleep(600)\n"
)


@flow(name="submits-a-slurm-job")
def submits_a_slurm_job(directory: str) -> str:
    """A stage job through the stages' own ``run_job`` (which labels it with this flow run) on Slurm."""
    from tasks.common import run_job

    d = pathlib.Path(directory)
    (d / "flow.pid").write_text(str(os.getpid()))
    spec = JobSpec(
        name="stage-sleeps",
        command=[sys.executable, "-c", SLURM_JOB, str(d / "stage-job-id")],
        log_dir=str(d / "logs"),
        workdir=str(d),
    )
    run_job(spec, "slurm")
    return "done"

"""Flows the Slurm worker test deploys: each proves where and how it ran."""

from __future__ import annotations

import os
import pathlib
import time

from prefect import flow


@flow
def inside_slurm(marker: str) -> str:
    job_id = os.environ.get("SLURM_JOB_ID", "")
    pathlib.Path(marker).write_text(f"{job_id}\n{os.environ.get('PREFECT__FLOW_RUN_ID', '')}")
    return job_id


@flow
def sleeps(marker: str, seconds: float = 300) -> None:
    pathlib.Path(marker).write_text(os.environ.get("SLURM_JOB_ID", ""))
    time.sleep(seconds)


@flow
def dies(code: int = 7) -> None:
    # The process vanishes without telling Prefect, as when a node dies or the OOM killer strikes.
    os._exit(code)

"""The options of the download + extract job array (workloads/fetch_array.py): the data flow takes them
(``PrepareConfig``), the data stage writes them into the job's plan, each array task reads them there."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FetchOptions(BaseModel):
    threads: int = Field(4, ge=1, description="shards in flight per array task")
    requests_per_second: float | None = Field(None, gt=0, description="for the whole job; each task gets 1/tasks")
    delete_compressed: bool = False
    revalidate: bool = Field(False, description="probe HTTP(S) sources again instead of trusting their record")
